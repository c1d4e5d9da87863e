// Markdown to DOM for the chat page: a small subset (fenced code, headings, lists, quotes, tables, rules,
// paragraphs; inline code, bold, italics, strike-through, links) and a keyword highlighter for code.
// Safety: every piece of text becomes a Text node (textContent), never HTML, so a reply cannot inject
// markup; links keep only http(s) and mailto targets. Unclosed fences and strings render as they stream.
// Any reply renders in time linear in its length: no regex searches for a closer from every position,
// nothing recurses deeper than MAX_DEPTH, and a render makes at most MAX_NODES nodes (the rest is text).
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

  // Nodes one render may make; the rest of a reply past them is plain text. Real replies stay well
  // below it; it bounds what the page must lay out for a hostile one (tens of microseconds a node).
  const MAX_NODES = 5000;
  let budget = Infinity; // what the render under way has left

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
      if (budget-- <= 0) break; // the rest stays plain text
      if (m.index > last) parent.append(code.slice(last, m.index));
      parent.append(el("span", cls, m[0]));
      last = re.lastIndex;
    }
    if (last < code.length) parent.append(code.slice(last));
  }

  // ------------------------------------------------------------------------------------------ inline
  // One left-to-right pass over a line: code spans, links and bare URLs become nodes as they are met;
  // runs of * _ ~ become text nodes on a delimiter stack that emphasis() pairs up at the end. Every
  // look-ahead (a code span's closing run, a link's `]`, `)` or a URL's end) is answered from an index
  // or a cursor that only moves forward, so the work is linear in the line on any input, and nothing
  // recurses but a link's text, which holds no links.
  const STARTS = new Uint8Array(128); // the characters that may start a token (h: http:// or https://)
  for (const c of "`*_~[h") STARTS[c.charCodeAt(0)] = 1;
  const URL_TAIL = ".,;:!?'\"*_]"; // not the last character of a bare URL
  const SPACE = /\s/;
  const WORD_CHAR = /\w/;
  // A character (undefined past either end) is white space: ASCII decided at once, the rest by \s.
  const isSpace = (c) => c === " " || (c !== undefined && (c < "!" || c > "~") && SPACE.test(c));
  // Lists, quotes and emphasis nested deeper are text: each list or quote level scans its lines again,
  // and Chromium lays out a deep DOM slowly. Real replies nest 3 or 4 deep.
  const MAX_DEPTH = 8;

  function inline(text, parent, links = true) {
    const s = { text, parent, links, plain: 0, runs: null, seek: null, bottom: null, top: null };
    s.bottom = s.top = { pos: -1, after: 0, prev: null, next: null };
    for (let i = 0; i < text.length && budget > 0; ) {
      const code = text.charCodeAt(i);
      if (code > 127 || !STARTS[code]) { i++; continue; }
      const c = text[i];
      if (c === "`") i = codeSpan(s, i);
      else if (c === "[") i = linkAt(s, i);
      else if (c === "h") i = bareUrl(s, i);
      else i = delimiter(s, i);
    }
    if (s.plain < text.length) parent.append(text.slice(s.plain));
    emphasis(s.bottom);
  }

  // Appends the text since the last node, then `node`, which ends at `end`; returns `end`.
  function emit(s, at, end, node) {
    if (at > s.plain) s.parent.append(s.text.slice(s.plain, at));
    s.parent.append(node);
    budget -= 2; // the node and the text before it
    s.plain = end;
    return end;
  }

  // Each run of backticks, with the index of the next run of the same length (its closer; -1: none),
  // found in one pass from the right.
  function backtickRuns(text) {
    const start = [];
    const len = [];
    for (let i = text.indexOf("`"); i >= 0; i = text.indexOf("`", i)) {
      let j = i + 1;
      while (text[j] === "`") j++;
      start.push(i);
      len.push(j - i);
      i = j;
    }
    const next = new Array(start.length).fill(-1);
    const seen = new Map();
    for (let k = start.length - 1; k >= 0; k--) {
      if (seen.has(len[k])) next[k] = seen.get(len[k]);
      seen.set(len[k], k);
    }
    return { start, len, next, at: 0 };
  }

  function codeSpan(s, at) {
    const runs = s.runs || (s.runs = backtickRuns(s.text));
    while (runs.start[runs.at] < at) runs.at++;
    const k = runs.at;
    if (runs.start[k] !== at) { // the middle of a run: text
      let j = at;
      while (s.text[j] === "`") j++;
      return j;
    }
    const close = runs.next[k];
    if (close < 0) return at + runs.len[k]; // no closing run: the backticks are text
    let code = s.text.slice(at + runs.len[k], runs.start[close]);
    if (code.length > 2 && code.startsWith(" ") && code.endsWith(" ")) code = code.slice(1, -1);
    runs.at = close + 1;
    return emit(s, at, runs.start[close] + runs.len[k], el("code", null, code));
  }

  // The first index at or after `from` of `char`, or where the regex `source` (one character class)
  // matches; else text.length. Each caller asks with `from` never decreasing, so a search starts past
  // the last answer: linear in all.
  function seeker(text, char, source) {
    const re = source && new RegExp(source, "g");
    let asked = -1;
    let found = -1;
    return (from) => {
      if (from < asked || from > found) {
        if (re) {
          re.lastIndex = from;
          found = re.exec(text) ? re.lastIndex - 1 : text.length;
        } else {
          found = text.indexOf(char, from);
          if (found < 0) found = text.length;
        }
        asked = from;
      }
      return found;
    };
  }

  function seekers(text) {
    return {
      close: seeker(text, "]"), titleEnd: seeker(text, '"'), closeAt: -1, lastOpen: -1,
      destStart: seeker(text, null, String.raw`\S`), destEnd: seeker(text, null, String.raw`[\s)<>]`),
      afterDest: seeker(text, null, String.raw`\S`), afterTitle: seeker(text, null, String.raw`\S`),
      urlEnd: seeker(text, null, String.raw`[\s<>()]`),
    };
  }

  // `[text](url)`, `[text](<url>)` or `[text](url "title")`; text without brackets, url without spaces.
  function linkAt(s, at) {
    if (!s.links) return at + 1;
    while (s.text[at + 1] === "[") at++; // of a run of [ only the last may open a link
    const seek = s.seek || (s.seek = seekers(s.text));
    const close = seek.close(at + 1);
    if (close !== seek.closeAt) { // the [ nearest this ], once per ]: the stretches searched are disjoint
      seek.closeAt = close;
      seek.lastOpen = s.text.lastIndexOf("[", close);
    }
    if (seek.lastOpen !== at) return at + 1;
    if (close === at + 1 || s.text[close + 1] !== "(") return at + 1;
    const dest = destination(s.text, seek, close + 2);
    if (!dest) return at + 1;
    return emit(s, at, dest.end, link(s.text.slice(at + 1, close), dest.url, true));
  }

  function destination(text, seek, from) {
    let start = isSpace(text[from]) ? seek.destStart(from) : from; // (the seeker skips spaces)
    if (text[start] === "<") start++;
    const end = seek.destEnd(start);
    if (end === start) return null;
    const after = text[end] === ">" ? end + 1 : end;
    let paren = isSpace(text[after]) ? seek.afterDest(after) : after; // `)`, or a title's quote
    if (paren > after && text[paren] === '"') {
      const closing = seek.titleEnd(paren + 1);
      if (closing === text.length) return null;
      paren = isSpace(text[closing + 1]) ? seek.afterTitle(closing + 1) : closing + 1;
    }
    return text[paren] === ")" ? { url: text.slice(start, end), end: paren + 1 } : null;
  }

  function bareUrl(s, at) {
    const scheme = s.text.startsWith("https://", at) ? 8 : s.text.startsWith("http://", at) ? 7 : 0;
    const start = at + scheme;
    if (!scheme) return at + 1;
    if (!s.links) return start; // in a link's text: text
    const seek = s.seek || (s.seek = seekers(s.text));
    let end = seek.urlEnd(at);
    while (end > start && URL_TAIL.includes(s.text[end - 1])) end--;
    if (end === start) return start;
    const url = s.text.slice(at, end);
    return emit(s, at, end, link(url, url, false));
  }

  // A run of * _ or ~~: a text node that may open (a non-space follows) or close (a non-space comes
  // before) emphasis; `_` only at word edges, so snake_case stays text; `\` before a run keeps it text.
  function delimiter(s, at) {
    const { text } = s;
    const ch = text[at];
    let end = at + 1;
    while (text[end] === ch) end++;
    const before = text[at - 1] || "";
    const after = text[end] || "";
    if (before === "\\" || (ch === "~" && end - at !== 2)) return end;
    let canOpen = after !== "" && !isSpace(after);
    let canClose = before !== "" && !isSpace(before);
    if (ch === "_") {
      canOpen = canOpen && !WORD_CHAR.test(before);
      canClose = canClose && !WORD_CHAR.test(after);
    }
    if (!canOpen && !canClose) return end;
    const node = document.createTextNode(text.slice(at, end));
    const d = { node, ch, count: end - at, orig: end - at, canOpen, canClose, after: 0, next: null };
    d.pos = s.top.pos + 1;
    d.prev = s.top;
    s.top = s.top.next = d;
    return emit(s, at, end, node);
  }

  // Pairs the delimiter runs as CommonMark's "process emphasis" does: each closer, left to right, takes
  // the nearest fitting opener below it; `floors` remember, per kind of closer, below which no opener
  // fits, so no run is searched twice. `after` on a run is the emphasis depth of the nodes after it.
  function emphasis(bottom) {
    const floors = new Map();
    let closer = bottom.next;
    while (closer) {
      if (!closer.canClose) { closer = closer.next; continue; }
      const key = closer.ch + (closer.canOpen ? "o" : "c") + (closer.orig % 3);
      const floor = floors.has(key) ? floors.get(key) : -1;
      let opener = closer.prev;
      let depth = 0;
      for (; opener.pos > floor; opener = opener.prev) {
        depth = Math.max(depth, opener.after);
        if (fits(opener, closer)) break;
      }
      if (opener.pos > floor && depth < MAX_DEPTH) {
        wrap(opener, closer, depth + 1);
        if (closer.count > 0) continue;
        closer.node.remove();
      } else {
        floors.set(key, closer.prev.pos);
        if (closer.canOpen) { closer = closer.next; continue; }
      }
      const next = closer.next;
      unlink(closer);
      closer = next;
    }
  }

  function fits(opener, closer) {
    if (opener.ch !== closer.ch || !opener.canOpen) return false;
    if (opener.ch === "~" || !(opener.canClose || closer.canOpen)) return true;
    // CommonMark's rule of 3: *a**b* is <em>a**b</em>, not a strong from the middle run
    return (opener.orig + closer.orig) % 3 !== 0 || (opener.orig % 3 === 0 && closer.orig % 3 === 0);
  }

  // Moves the nodes between the two runs into <em>, <strong> or <del>, taking 1 or 2 marks from each.
  function wrap(opener, closer, depth) {
    const use = opener.ch === "~" || (opener.count >= 2 && closer.count >= 2) ? 2 : 1;
    const node = el(opener.ch === "~" ? "del" : use === 2 ? "strong" : "em");
    for (let n = opener.node.nextSibling; n !== closer.node; n = opener.node.nextSibling) node.append(n);
    closer.node.before(node);
    opener.next = closer; // the runs between are inside `node` now, as text
    closer.prev = opener;
    opener.after = depth;
    opener.count -= use;
    closer.count -= use;
    opener.node.data = opener.node.data.slice(use);
    closer.node.data = closer.node.data.slice(use);
    if (opener.count === 0) {
      opener.node.remove();
      unlink(opener);
    }
  }

  function unlink(d) {
    d.prev.after = Math.max(d.prev.after, d.after);
    d.prev.next = d.next;
    if (d.next) d.next.prev = d.prev;
  }

  function safeUrl(url) {
    try {
      const parsed = new URL(url, location.href);
      return ["http:", "https:", "mailto:"].includes(parsed.protocol) ? parsed.href : null;
    } catch {
      return null;
    }
  }

  // `rich`: the text may hold code and emphasis (never another link or URL); else it is plain text.
  function link(text, url, rich) {
    const href = safeUrl(url);
    if (!href) return document.createTextNode(text);
    const a = el("a", null);
    a.href = href;
    a.rel = "noopener noreferrer";
    a.target = "_blank";
    if (rich) inline(text, a, false);
    else a.textContent = text;
    return a;
  }

  // Lines joined with <br>: models write single newlines meaning a new line.
  function inlineLines(lines, parent) {
    for (let k = 0; k < lines.length; k++) {
      if (budget <= 0) {
        parent.classList.add("rest");
        parent.append((k ? "\n" : "") + lines.slice(k).join("\n"));
        break;
      }
      if (k) {
        parent.append(el("br"));
        budget--;
      }
      inline(lines[k].trim(), parent);
    }
    return parent;
  }

  // ------------------------------------------------------------------------------------------ blocks
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s/; // the text is cut by hand: a lazy regex there is quadratic
  const RULE_LINE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const NOT_RULE = /[^-*_\s]/; // one scan that spares a long "- - - x" the rule's backtracking
  const isRule = (line) => !NOT_RULE.test(line) && RULE_LINE.test(line);
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])\s+/;
  const SEP_CELL = /^:?-+:?$/;
  // `nest`: quotes and lists may start (false past MAX_DEPTH levels of them, where lines are text)
  const startsBlock = (line, nest) => FENCE.test(line) || HEADING.test(line) || isRule(line) ||
    (nest && (QUOTE.test(line) || ITEM.test(line)));

  // "Title ##" -> "Title"; "C#" keeps its mark (the closing run needs a space before it)
  function headingText(rest) {
    const text = rest.trim();
    let end = text.length;
    while (end > 0 && text[end - 1] === "#") end--;
    return end === 0 || isSpace(text[end - 1]) ? text.slice(0, end).trim() : text;
  }

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
    let row = line.trim();
    if (row.startsWith("|")) row = row.slice(1);
    if (row.endsWith("|")) row = row.slice(0, -1);
    return row.split("|").map((c) => c.trim());
  }

  const tableSeparator = (line) => line.includes("-") && splitRow(line).every((c) => SEP_CELL.test(c));
  // A header row, a separator row below, and cells the budget can hold (else the lines are text).
  const isTable = (lines, i) => lines[i].includes("|") && i + 1 < lines.length &&
    tableSeparator(lines[i + 1]) && 2 * splitRow(lines[i]).length <= budget;

  // The table whose header is lines[i]; returns the index after the last row the budget allows.
  function table(lines, i, parent) {
    const t = parent.appendChild(el("table"));
    row(splitRow(lines[i]), t.appendChild(el("thead")), "th");
    const body = t.appendChild(el("tbody"));
    for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) {
      const cells = splitRow(lines[i]);
      if (2 * cells.length > budget) break;
      row(cells, body, "td");
    }
    return i;
  }

  function row(cells, parent, tag) {
    const tr = parent.appendChild(el("tr"));
    budget -= 2 * cells.length; // a cell and its text
    for (const cell of cells) inline(cell, tr.appendChild(el(tag)));
  }

  // One list from line i: each item's lines (continuations dedented) rendered as blocks; returns the
  // index after it. Indented items belong to the item above, where they become a nested list.
  function list(lines, i, parent, depth) {
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
      } else if (indented(line) || !startsBlock(line, true)) {
        items[items.length - 1].push(line.replace(/^\s{1,4}/, ""));
      } else break;
    }
    const node = parent.appendChild(el(ordered ? "ol" : "ul"));
    const number = parseInt(first[2], 10);
    if (ordered && number !== 1) node.start = number;
    for (let k = 0; k < items.length; k++) {
      if (budget-- <= 0) {
        node.appendChild(el("li")).append(rest(items.slice(k).flat()));
        break;
      }
      blocks(items[k], node.appendChild(el("li")), true, depth + 1);
    }
    return i;
  }

  // A fence from line i to its closing fence, or to the end while it streams; returns the index after.
  function fenced(lines, i, parent, fence, lang) {
    const body = [];
    for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) body.push(lines[i]);
    parent.append(codeBlock(body.join("\n"), lang));
    return i + 1;
  }

  function paragraph(lines, i, parent, nest) {
    const para = [];
    for (; i < lines.length && lines[i].trim() !== ""; i++) {
      if (para.length && startsBlock(lines[i], nest)) break;
      para.push(lines[i]);
    }
    parent.append(inlineLines(para, el("p")));
    return i;
  }

  // The lines left once the budget is spent, as they are.
  const rest = (lines) => el("p", "rest", lines.join("\n"));

  // Renders `lines` as block elements into `parent`; `tight`: a lone paragraph becomes inline text.
  // `depth`: the lists and quotes around; past MAX_DEPTH their markers are text, so each line is
  // scanned at most MAX_DEPTH + 1 times and the DOM stays shallow however deep the input nests.
  function blocks(lines, parent, tight, depth = 0) {
    const nest = depth < MAX_DEPTH;
    const start = parent.childNodes.length;
    for (let i = 0, m; i < lines.length; ) {
      const line = lines[i];
      if (line.trim() === "") { i++; continue; }
      if (budget-- <= 0) {
        parent.append(rest(lines.slice(i)));
        break;
      }
      if ((m = line.match(FENCE))) i = fenced(lines, i, parent, m[1], m[2]);
      else if ((m = line.match(HEADING))) {
        const heading = parent.appendChild(el(`h${Math.min(m[1].length + 2, 6)}`));
        inline(headingText(line.slice(m[0].length)), heading);
        i++;
      } else if (isRule(line)) {
        parent.append(el("hr"));
        i++;
      } else if (nest && QUOTE.test(line)) {
        const quoted = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) quoted.push(lines[i].replace(QUOTE, ""));
        parent.append(blocks(quoted, el("blockquote"), false, depth + 1));
      } else if (nest && ITEM.test(line)) i = list(lines, i, parent, depth);
      else if (isTable(lines, i)) i = table(lines, i, parent);
      else i = paragraph(lines, i, parent, nest);
    }
    if (tight && parent.childNodes.length - start === 1 && parent.lastChild.tagName === "P") {
      const para = parent.lastChild; // moved one by one: a spread of 100k children overflows the stack
      while (para.firstChild) parent.insertBefore(para.firstChild, para);
      para.remove();
    }
    return parent;
  }

  // Replaces the children of `container` with `text` rendered as Markdown, in at most MAX_NODES nodes.
  function render(text, container) {
    const fragment = document.createDocumentFragment();
    budget = MAX_NODES;
    try {
      blocks(String(text).replace(/\r\n?/g, "\n").split("\n"), fragment);
    } finally {
      budget = Infinity;
    }
    container.replaceChildren(fragment);
  }

  window.LocalMarkdown = { render, highlight };
})();
