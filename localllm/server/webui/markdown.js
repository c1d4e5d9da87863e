// Markdown to DOM for the chat page: a small subset (fenced code, headings, lists, quotes, tables, rules,
// paragraphs; inline code, bold, italics, strike-through, links) and a keyword highlighter for code.
// Safety: every piece of text becomes a Text node (textContent), never HTML, so a reply cannot inject
// markup; links keep only http(s) and mailto targets. Unclosed fences and strings render as they stream.
"use strict";

(function () {
  const el = (tag, cls, text) => {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  };

  // ---------------------------------------------------------------------------------- highlighting
  const words = (s) => new Set(s.split(" "));
  const C_COMMENT = String.raw`\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)`;
  const HASH_COMMENT = String.raw`#[^\n]*`;
  const DQ = String.raw`"(?:\\[\s\S]|[^"\\\n])*"?`;
  const SQ = String.raw`'(?:\\[\s\S]|[^'\\\n])*'?`;
  const BT = String.raw`\`(?:\\[\s\S]|[^\`\\])*\`?`;
  const TRIPLE = String.raw`"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)`;
  const C_WORDS = words(
    "auto bool break case char class const continue default do double else enum extern false final float " +
    "fn for func go goto if impl import int interface let long match mod mut namespace new nil null " +
    "package private protected public pub return self Self short signed sizeof static string struct " +
    "switch template this throw throws true try type typedef union unsigned use using var void volatile " +
    "where while async await catch finally extends implements defer chan map range select trait dyn ref"
  );
  const JS_WORDS = words(
    "async await break case catch class const continue debugger default delete do else export extends " +
    "false finally for from function if import in instanceof let new null of return static super switch " +
    "this throw true try typeof undefined var void while yield interface type enum"
  );
  const LANGS = {
    python: [HASH_COMMENT, `${TRIPLE}|${DQ}|${SQ}`, words(
      "False None True and as assert async await break class continue def del elif else except finally " +
      "for from global if import in is lambda match case nonlocal not or pass raise return self try " +
      "while with yield"
    )],
    js: [C_COMMENT, `${DQ}|${SQ}|${BT}`, JS_WORDS],
    c: [C_COMMENT, `${DQ}|'(?:\\\\.|[^'\\\\\\n])'`, C_WORDS],
    shell: [HASH_COMMENT, `${DQ}|'[^']*'?`, words(
      "if then else elif fi for while until do done case esac function in return export local exit " +
      "set unset cd echo source alias sudo"
    )],
    sql: ["--[^\\n]*", SQ, words(
      "select from where insert into values update set delete create table drop alter join left right " +
      "inner outer on group by order having limit as and or not null is in distinct primary key index " +
      "union all case when then else end"
    ), true],
    conf: [HASH_COMMENT, `${DQ}|${SQ}`, words("true false null yes no on off")],
  };
  const ALIASES = {
    py: "python", python3: "python", javascript: "js", ts: "js", typescript: "js", jsx: "js", tsx: "js",
    json: "js", mjs: "js", cpp: "c", "c++": "c", h: "c", hpp: "c", cc: "c", java: "c", cs: "c",
    csharp: "c", go: "c", rust: "c", rs: "c", swift: "c", kotlin: "c", kt: "c", php: "c", scala: "c",
    bash: "shell", sh: "shell", zsh: "shell", console: "shell", shell: "shell", yaml: "conf", yml: "conf",
    toml: "conf", ini: "conf", dockerfile: "shell", makefile: "shell", sql: "sql",
  };
  const NUM = String.raw`\b(?:0[xob][\da-f_]+|\d[\d_]*(?:\.\d+)?(?:e[+-]?\d+)?)\b`;
  const WORD = String.raw`[A-Za-z_$][\w$]*`;
  const compiled = {};

  function grammar(lang) {
    const name = ALIASES[lang] || (LANGS[lang] ? lang : "c");
    if (!compiled[name]) {
      const [comment, string, keywords, nocase] = LANGS[name];
      const re = new RegExp(`(${comment})|(${string})|(${NUM})|(${WORD})`, "gi");
      compiled[name] = { re, keywords, nocase };
    }
    return compiled[name];
  }

  // Appends `code` to `parent` as text nodes and <span class="tok-*"> around comments, strings, numbers,
  // keywords and called names.
  function highlight(code, lang, parent) {
    const { re, keywords, nocase } = grammar((lang || "").toLowerCase());
    let last = 0;
    re.lastIndex = 0;
    for (let m; (m = re.exec(code)); ) {
      if (m[0] === "") { re.lastIndex++; continue; }
      let cls = m[1] ? "tok-c" : m[2] ? "tok-s" : m[3] ? "tok-n" : null;
      if (m[4]) {
        if (keywords.has(nocase ? m[4].toLowerCase() : m[4])) cls = "tok-k";
        else if (code[re.lastIndex] === "(") cls = "tok-f";
        else continue;
      }
      if (m.index > last) parent.append(code.slice(last, m.index));
      parent.append(el("span", cls, m[0]));
      last = re.lastIndex;
    }
    if (last < code.length) parent.append(code.slice(last));
  }

  // ------------------------------------------------------------------------------------------ inline
  const INLINE = new RegExp([
    String.raw`(\`+)([\s\S]*?[^\`])\1(?!\`)`,                  // 1, 2: code
    String.raw`\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__`, // 3, 4: strong
    String.raw`\*(?=[^\s*])([\s\S]*?[^\s*])\*`,                // 5: em
    String.raw`(?<![\w\\])_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)`,  // 6: em
    String.raw`~~(?=\S)([\s\S]*?\S)~~`,                        // 7: strike-through
    String.raw`\[([^\]\n]+)\]\(\s*<?([^\s)<>]+)>?(?:\s+"[^"]*")?\s*\)`, // 8, 9: link
    String.raw`(https?:\/\/[^\s<>()]*[^\s<>().,;:!?'"*_\]])`,   // 10: bare URL
  ].join("|"), "g");

  function safeUrl(url) {
    try {
      const parsed = new URL(url, location.href);
      return ["http:", "https:", "mailto:"].includes(parsed.protocol) ? parsed.href : null;
    } catch {
      return null;
    }
  }

  function link(text, url) {
    const href = safeUrl(url);
    if (!href) return document.createTextNode(text);
    const a = el("a", null);
    a.href = href;
    a.rel = "noopener noreferrer";
    a.target = "_blank";
    inline(text, a);
    return a;
  }

  function inline(text, parent) {
    const re = new RegExp(INLINE.source, "g"); // a fresh one: inline() recurses
    let last = 0;
    for (let m; (m = re.exec(text)); ) {
      if (m.index > last) parent.append(text.slice(last, m.index));
      last = re.lastIndex;
      if (m[1]) {
        const code = m[2].length > 2 && m[2].startsWith(" ") && m[2].endsWith(" ") ? m[2].slice(1, -1) : m[2];
        parent.append(el("code", null, code));
      } else if (m[3] || m[4]) inline(m[3] || m[4], parent.appendChild(el("strong")));
      else if (m[5] || m[6]) inline(m[5] || m[6], parent.appendChild(el("em")));
      else if (m[7]) inline(m[7], parent.appendChild(el("del")));
      else if (m[8]) parent.append(link(m[8], m[9]));
      else if (m[10]) parent.append(link(m[10], m[10]));
    }
    if (last < text.length) parent.append(text.slice(last));
  }

  // Lines joined with <br>: models write single newlines meaning a new line.
  function inlineLines(lines, parent) {
    lines.forEach((line, i) => {
      if (i) parent.append(el("br"));
      inline(line.trim(), parent);
    });
    return parent;
  }

  // ------------------------------------------------------------------------------------------ blocks
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])\s+/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
  const startsBlock = (line) => FENCE.test(line) || HEADING.test(line) || RULE.test(line) ||
    QUOTE.test(line) || ITEM.test(line);

  function copyText(text, button) {
    const done = () => {
      button.textContent = "Copied";
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, () => fallbackCopy(text) && done());
    } else if (fallbackCopy(text)) done();
  }

  // Plain-http pages on a LAN address are not a secure context: no Clipboard API there.
  function fallbackCopy(text) {
    const area = el("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    let ok = false;
    try { ok = document.execCommand("copy"); } catch { ok = false; }
    area.remove();
    return ok;
  }

  function codeBlock(code, lang) {
    const box = el("div", "code-block");
    const head = box.appendChild(el("div", "code-head"));
    head.append(el("span", null, lang || "code"));
    const button = head.appendChild(el("button", null, "Copy"));
    button.type = "button";
    button.setAttribute("aria-label", `Copy ${lang || ""} code`.replace("  ", " "));
    button.addEventListener("click", () => copyText(code, button));
    const codeEl = box.appendChild(el("pre")).appendChild(el("code"));
    if (lang) codeEl.className = `language-${lang}`;
    highlight(code, lang, codeEl);
    return box;
  }

  function splitRow(line) {
    const cells = line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|");
    return cells.map((c) => c.trim());
  }

  function table(header, rows) {
    const t = el("table");
    const tr = t.appendChild(el("thead")).appendChild(el("tr"));
    for (const cell of splitRow(header)) inline(cell, tr.appendChild(el("th")));
    const body = t.appendChild(el("tbody"));
    for (const row of rows) {
      const r = body.appendChild(el("tr"));
      for (const cell of splitRow(row)) inline(cell, r.appendChild(el("td")));
    }
    return t;
  }

  // One list from line i: each item's lines (continuations dedented) rendered as blocks; returns the
  // index after it. Indented items belong to the item above, where they become a nested list.
  function list(lines, i, parent) {
    const first = lines[i].match(ITEM);
    const base = first[1].length;
    const ordered = /\d/.test(first[2]);
    const sameList = (m) => m && m[1].length <= base + 1 && /\d/.test(m[2]) === ordered;
    const indented = (line) => /^\s{2,}\S/.test(line);
    const items = [];
    for (; i < lines.length; i++) {
      const line = lines[i];
      const m = line.match(ITEM);
      const next = lines[i + 1];
      if (sameList(m)) items.push([line.slice(m[0].length)]);
      else if (m && m[1].length <= base + 1) break; // the other kind of list starts
      else if (line.trim() === "") {
        if (next === undefined || !(indented(next) || sameList(next.match(ITEM)))) break;
        if (indented(next)) items[items.length - 1].push("");
      } else if (indented(line) || !startsBlock(line)) items[items.length - 1].push(line.replace(/^\s{1,4}/, ""));
      else break;
    }
    const node = parent.appendChild(el(ordered ? "ol" : "ul"));
    const number = parseInt(first[2], 10);
    if (ordered && number !== 1) node.start = number;
    for (const item of items) blocks(item, node.appendChild(el("li")), true);
    return i;
  }

  // Renders `lines` as block elements into `parent`; `tight`: a lone paragraph becomes inline text.
  function blocks(lines, parent, tight) {
    let i = 0;
    const start = parent.childNodes.length;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (line.trim() === "") { i++; continue; }
      if ((m = line.match(FENCE))) {
        const fence = m[1];
        const body = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) body.push(lines[i]);
        i++;
        parent.append(codeBlock(body.join("\n"), m[2]));
      } else if ((m = line.match(HEADING))) {
        inline(m[2], parent.appendChild(el(`h${Math.min(m[1].length + 2, 6)}`)));
        i++;
      } else if (RULE.test(line)) {
        parent.append(el("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const quoted = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) quoted.push(lines[i].replace(QUOTE, ""));
        parent.append(blocks(quoted, el("blockquote")));
      } else if (ITEM.test(line)) {
        i = list(lines, i, parent);
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
        const rows = [];
        for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) rows.push(lines[i]);
        parent.append(table(line, rows));
      } else {
        const para = [];
        for (; i < lines.length && lines[i].trim() !== "" && (para.length === 0 || !startsBlock(lines[i])); i++) {
          para.push(lines[i]);
        }
        parent.append(inlineLines(para, el("p")));
      }
    }
    const added = parent.childNodes.length - start;
    if (tight && added === 1 && parent.lastChild.tagName === "P") {
      parent.lastChild.replaceWith(...parent.lastChild.childNodes);
    }
    return parent;
  }

  // Replaces the children of `container` with `text` rendered as Markdown.
  function render(text, container) {
    const fragment = document.createDocumentFragment();
    blocks(String(text).replace(/\r\n?/g, "\n").split("\n"), fragment);
    container.replaceChildren(fragment);
  }

  window.LocalMarkdown = { render, highlight };
})();
