// The chat page: conversations in localStorage, replies streamed from this server's
// /v1/chat/completions (Server-Sent Events), stats from the usage chunk, Markdown via markdown.js.
// All text reaches the page through textContent or markdown.js (which builds Text nodes): never HTML.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const KEYS = {
    conversations: "localllm.conversations", current: "localllm.current",
    settings: "localllm.settings", apiKey: "localllm.apiKey", model: "localllm.model",
  };
  const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "seed"];
  const narrow = window.matchMedia("(max-width: 760px)");
  const state = {
    conversations: [], currentId: null, controller: null, model: null, models: [], renderQueued: false,
  };

  // ---------------------------------------------------------------------------------------- storage
  function load(key, fallback) {
    try {
      const raw = localStorage.getItem(key);
      return raw === null ? fallback : JSON.parse(raw);
    } catch {
      return fallback;
    }
  }

  function store(key, value) {
    try {
      if (value === null) localStorage.removeItem(key);
      else localStorage.setItem(key, JSON.stringify(value));
    } catch (e) {
      notify(`Could not save in the browser's storage (${e.name}): delete old conversations to make room.`);
    }
  }

  const apiKey = () => load(KEYS.apiKey, "") || "";

  const save = () => store(KEYS.conversations, state.conversations.filter((c) => c.messages.length));
  const current = () => state.conversations.find((c) => c.id === state.currentId) || null;

  // ----------------------------------------------------------------------------------------- notices
  function notify(text) {
    const box = $("notice");
    box.textContent = text;
    box.hidden = !text;
  }

  function askForKey(refused) {
    const form = $("key-form");
    form.querySelector("label").textContent = refused
      ? "The server refused this API key: enter the right one"
      : "This server needs an API key: enter it to chat";
    form.hidden = false;
    $("api-key").focus();
  }

  // ------------------------------------------------------------------------------------- rendering
  function messageNode(message) {
    const node = document.createElement("article");
    node.className = `msg ${message.role}${message.error ? " error" : ""}`;
    const who = node.appendChild(document.createElement("div"));
    who.className = "who";
    who.textContent = message.role === "user" ? "You" : "Assistant";
    const body = node.appendChild(document.createElement("div"));
    body.className = "body";
    fillBody(body, message);
    const stats = node.appendChild(document.createElement("div"));
    stats.className = "stats";
    stats.textContent = message.stats || "";
    return node;
  }

  function fillBody(body, message) {
    if (message.role === "user") body.textContent = message.content;
    else if (!message.reasoning) window.LocalMarkdown.render(message.content, body);
    else {
      const answer = document.createElement("div");
      window.LocalMarkdown.render(message.content, answer);
      body.replaceChildren(thinkingNode(message), answer);
    }
    if (message.error) body.appendChild(document.createElement("p")).textContent = message.error;
  }

  // A thinking model's reasoning, folded: open while it is all there is, closed once the answer
  // starts, unless the reader opened or closed it.
  function thinkingNode(message) {
    const details = document.createElement("details");
    details.className = "thinking";
    details.open = message.showThinking ?? !message.content;
    const summary = details.appendChild(document.createElement("summary"));
    summary.textContent = message.content ? "Thought" : "Thinking…";
    summary.addEventListener("click", () => { message.showThinking = !details.open; });
    details.appendChild(document.createElement("div")).textContent = message.reasoning;
    return details;
  }

  function renderMessages() {
    const box = $("messages");
    const conversation = current();
    box.replaceChildren();
    if (!conversation || !conversation.messages.length) {
      const empty = box.appendChild(document.createElement("p"));
      empty.className = "empty";
      empty.textContent = "Ask anything. Enter sends, Shift+Enter starts a new line, Esc stops a reply.";
    } else {
      for (const message of conversation.messages) box.append(messageNode(message));
    }
    box.scrollTop = box.scrollHeight;
    $("chat-title").textContent = conversation ? conversation.title : "New chat";
    for (const id of ["rename-chat", "export-chat", "delete-chat"]) $(id).disabled = !conversation;
  }

  function renderList() {
    const list = $("conversations");
    list.replaceChildren();
    for (const conversation of state.conversations) {
      if (!conversation.messages.length) continue;
      const button = list.appendChild(document.createElement("li")).appendChild(document.createElement("button"));
      button.type = "button";
      button.textContent = conversation.title;
      button.title = conversation.title;
      if (conversation.id === state.currentId) button.setAttribute("aria-current", "true");
      button.addEventListener("click", () => select(conversation.id));
    }
  }

  function render() {
    renderList();
    renderMessages();
  }

  // Re-renders the streaming reply at most once a frame, keeping the view pinned to the bottom.
  function queueReplyRender(node, message) {
    if (state.renderQueued) return;
    state.renderQueued = true;
    requestAnimationFrame(() => {
      state.renderQueued = false;
      const box = $("messages");
      const pinned = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
      fillBody(node.querySelector(".body"), message);
      node.querySelector(".stats").textContent = message.stats || "";
      if (pinned) box.scrollTop = box.scrollHeight;
    });
  }

  // --------------------------------------------------------------------------------- conversations
  function select(id) {
    state.currentId = id;
    store(KEYS.current, id);
    render();
    if (narrow.matches) setPanel("sidebar", false);
    $("prompt").focus();
  }

  function newConversation() {
    const now = Date.now();
    const conversation = { id: `c${now.toString(36)}${Math.random().toString(36).slice(2, 6)}`,
      title: "New chat", created: now, updated: now, messages: [] };
    state.conversations.unshift(conversation);
    return conversation;
  }

  function touch(conversation) {
    conversation.updated = Date.now();
    state.conversations.sort((a, b) => b.updated - a.updated);
    save();
  }

  function renameConversation() {
    const conversation = current();
    if (!conversation || state.controller) return;
    const title = $("chat-title");
    const input = document.createElement("input");
    input.value = conversation.title;
    input.setAttribute("aria-label", "Conversation title");
    input.className = "title-input";
    let done = false;
    const finish = (keep) => {
      if (done) return;
      done = true;
      if (keep && input.value.trim()) conversation.title = input.value.trim().slice(0, 200);
      input.replaceWith(title);
      save();
      render();
      $("rename-chat").focus();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") { e.preventDefault(); finish(true); }
      if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); finish(false); }
    });
    input.addEventListener("blur", () => finish(true));
    title.replaceWith(input);
    input.focus();
    input.select();
  }

  function deleteConversation() {
    const conversation = current();
    if (!conversation || state.controller) return;
    if (!window.confirm(`Delete the conversation "${conversation.title}"?`)) return;
    state.conversations = state.conversations.filter((c) => c !== conversation);
    save();
    const next = state.conversations.find((c) => c.messages.length);
    select(next ? next.id : null);
  }

  function exportConversation() {
    const conversation = current();
    if (!conversation) return;
    const data = { format: "localllm-chat", version: 1, model: state.model && state.model.id, ...conversation };
    const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = `${conversation.title.replace(/[^\w.-]+/g, "-").slice(0, 60) || "chat"}.json`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  // -------------------------------------------------------------------------------------- settings
  function loadSettings() {
    const saved = load(KEYS.settings, {});
    for (const name of SETTINGS) if (saved[name] !== undefined) $(name).value = saved[name];
  }

  function saveSettings() {
    const values = {};
    for (const name of SETTINGS) values[name] = $(name).value;
    store(KEYS.settings, values);
  }

  // The sampling fields the API takes; an empty field leaves the server's default.
  function samplingFields() {
    const fields = {};
    for (const name of ["temperature", "top_p", "max_tokens", "seed"]) {
      const input = $(name);
      if (input.value.trim() === "") continue;
      const value = Number(input.value);
      if (!Number.isFinite(value) || !input.checkValidity()) {
        throw new Error(`${input.labels[0].textContent}: ${input.validationMessage || "not a number"}`);
      }
      fields[name] = name === "max_tokens" || name === "seed" ? Math.trunc(value) : value;
    }
    return fields;
  }

  function setPanel(name, open) {
    document.body.classList.toggle(`show-${name}`, open);
    $(`toggle-${name}`).setAttribute("aria-expanded", String(open));
  }

  // ----------------------------------------------------------------------------------------- model
  async function loadModel() {
    let response;
    try {
      response = await fetch("/v1/models", { headers: authHeaders() });
    } catch {
      $("model-info").textContent = "server unreachable";
      return setTimeout(loadModel, 3000);
    }
    if (response.status === 401) {
      $("model-info").textContent = "API key needed";
      return askForKey(Boolean(apiKey()));
    }
    const cards = response.ok ? ((await response.json()).data || []) : [];
    if (!cards.length) return;
    state.models = cards;
    if (cards.length > 1) return showModels(cards);
    const card = cards[0];
    state.model = card;
    const context = card.max_model_len ? `context ${card.max_model_len.toLocaleString("en")} tokens` : "loading…";
    $("model-info").textContent = `${card.id} · ${context}`;
    if (!card.max_model_len) setTimeout(loadModel, 2000); // the model is still loading
  }

  // A server of several models: the user picks one (kept for the next visit); each card says
  // whether it is loaded, and an unloaded one loads with the first message sent to it.
  function showModels(cards) {
    const select = $("model-select");
    const wanted = (state.model && state.model.id) || load(KEYS.model, null);
    const card = cards.find((c) => c.id === wanted) || cards[0];
    select.replaceChildren(...cards.map((c) => new Option(`${c.id} (${c.state || "loaded"})`, c.id)));
    select.value = card.id;
    select.hidden = false;
    state.model = card;
    const context = card.max_model_len ? `context ${card.max_model_len.toLocaleString("en")} tokens` : "";
    $("model-info").textContent = card.state === "loaded" ? context : "loads with the first message";
  }

  function pickModel() {
    const card = state.models.find((c) => c.id === $("model-select").value);
    if (!card) return;
    state.model = card;
    store(KEYS.model, card.id);
    showModels(state.models);
  }

  function authHeaders() {
    const key = apiKey();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  // ------------------------------------------------------------------------------------- streaming
  // The user's turn is kept only once the server accepts the request; a refusal puts the text back.
  async function send() {
    const text = $("prompt").value;
    if (!text.trim() || state.controller) return;
    let fields;
    try {
      fields = samplingFields();
    } catch (e) {
      return notify(e.message);
    }
    notify("");
    const conversation = current() || newConversation();
    state.currentId = conversation.id;
    store(KEYS.current, conversation.id);
    if (!conversation.messages.length) conversation.title = text.trim().split("\n")[0].slice(0, 60);
    const user = { role: "user", content: text };
    const reply = { role: "assistant", content: "" };
    conversation.messages.push(user, reply);
    $("prompt").value = "";
    render();
    const node = $("messages").lastElementChild;
    await stream(conversation, reply, node, requestBody(conversation, fields));
  }

  function requestBody(conversation, fields) {
    const system = $("system").value.trim();
    conversation.system = system || undefined;
    const messages = conversation.messages.slice(0, -1).filter((m) => !m.error || m.content);
    // earlier thinking goes back too: the model's chat template decides whether it is shown
    const history = messages.map((m) => (m.reasoning
      ? { role: m.role, content: m.content, reasoning_content: m.reasoning }
      : { role: m.role, content: m.content }));
    const model = state.models.length > 1 && state.model ? { model: state.model.id } : {};
    return {
      ...model, messages: system ? [{ role: "system", content: system }, ...history] : history,
      stream: true, stream_options: { include_usage: true }, ...fields,
    };
  }

  function setBusy(busy, node) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    if (node) node.setAttribute("aria-busy", String(busy));
    if (!busy) $("prompt").focus();
  }

  async function stream(conversation, reply, node, body) {
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true, node);
    const timing = { sent: performance.now(), first: 0, chunks: 0, usage: null, finish: null };
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", body: JSON.stringify(body), signal: controller.signal,
        headers: { "Content-Type": "application/json", ...authHeaders() },
      });
      if (!response.ok) return await refused(conversation, response);
      await readEvents(response, (event) => onEvent(event, reply, node, timing));
    } catch (e) {
      if (e.name !== "AbortError") reply.error = failureText(e);
    } finally {
      state.controller = null;
      if (conversation.messages.includes(reply)) finishReply(conversation, reply, timing, controller);
      setBusy(false, node);
      if (state.models.length > 1) loadModel(); // the models' states changed (this one loaded, maybe another not)
    }
  }

  function finishReply(conversation, reply, timing, controller) {
    const stopped = controller.signal.aborted;
    reply.stats = timing.chunks || !reply.error ? statsText(timing, stopped) : "";
    if (stopped && !reply.content && !reply.reasoning) reply.error = "Stopped before the first token.";
    touch(conversation);
    render();
  }

  function failureText(e) {
    if (e instanceof TypeError) return "The connection to the server was lost: is `localllm serve` still running?";
    return `Error: ${e.message}`;
  }

  // Parses Server-Sent Events from the response body and hands each `data:` payload to `handle`.
  async function readEvents(response, handle) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split(/\r?\n\r?\n/);
      buffer = events.pop();
      for (const event of events) {
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim());
        if (!data.length) continue;
        if (data.join("\n") === "[DONE]") return;
        handle(JSON.parse(data.join("\n")));
      }
    }
  }

  function onEvent(event, reply, node, timing) {
    if (event.error) {
      reply.error = `The server stopped the reply: ${event.error.message}`;
    }
    if (event.usage) timing.usage = event.usage;
    const choice = (event.choices || [])[0];
    if (choice && choice.delta && choice.delta.reasoning_content) {
      if (!timing.first) timing.first = performance.now();
      timing.chunks++;
      reply.reasoning = (reply.reasoning || "") + choice.delta.reasoning_content;
    }
    if (choice && choice.delta && choice.delta.content) {
      if (!timing.first) timing.first = performance.now();
      timing.chunks++;
      reply.content += choice.delta.content;
    }
    // native_finish_reason: the server's own reason where finish_reason is OpenAI's ("repetition" -> "length")
    if (choice && choice.finish_reason) timing.finish = choice.native_finish_reason || choice.finish_reason;
    timing.last = performance.now();
    queueReplyRender(node, reply);
  }

  // tokens, decode rate after the first token, time to first token, prompt and cached tokens, context.
  function statsText(t, stopped) {
    const parts = [];
    const tokens = t.usage ? t.usage.completion_tokens : t.chunks;
    parts.push(`${tokens} token${tokens === 1 ? "" : "s"}${t.usage ? "" : " (about)"}`);
    const end = t.last || performance.now();
    if (t.first && tokens > 1 && end > t.first) parts.push(`${((tokens - 1) / ((end - t.first) / 1000)).toFixed(1)} tok/s`);
    if (t.first) parts.push(`first token ${Math.round(t.first - t.sent)} ms`);
    if (t.usage) {
      const cached = (t.usage.prompt_tokens_details || {}).cached_tokens || 0;
      parts.push(`prompt ${t.usage.prompt_tokens} tokens, ${cached} cached`);
      if (state.model && state.model.max_model_len) {
        parts.push(`context ${t.usage.total_tokens}/${state.model.max_model_len}`);
      }
    }
    if (stopped) parts.push("stopped");
    else if (t.finish === "length") parts.push("stopped at the token limit");
    else if (t.finish === "repetition") parts.push("stopped: it kept repeating itself");
    return parts.join(" · ");
  }

  // A request the server refused: roll the turn back, put the text back, and say what to do.
  async function refused(conversation, response) {
    let error = {};
    try { error = (await response.json()).error || {}; } catch { error = {}; }
    const user = conversation.messages[conversation.messages.length - 2];
    conversation.messages.splice(-2, 2);
    $("prompt").value = user.content;
    if (!conversation.messages.length) state.conversations = state.conversations.filter((c) => c !== conversation);
    save();
    render();
    notify(refusalText(response.status, error));
    if (response.status === 401) askForKey(Boolean(apiKey()));
  }

  function refusalText(status, error) {
    const said = error.message ? ` (the server said: ${error.message})` : "";
    if (status === 401) return "This server needs an API key. Enter it below, then send again.";
    if (status === 503 && error.code === "model_loading") return "The model is still loading: send again in a few seconds.";
    if (status === 503) return `The server is busy: too many requests are waiting. Try again in a moment.${said}`;
    if (error.code === "context_length_exceeded") {
      const limit = state.model && state.model.max_model_len ? ` of ${state.model.max_model_len} tokens` : "";
      const lower = $("max_tokens").value ? ", or lower Max tokens in the settings" : "";
      return `This conversation no longer fits the model's context${limit}. Start a new chat${lower}.${said}`;
    }
    if (status === 403) return `The server refused the page's request${said}.`;
    return `The request failed with status ${status}${said}.`;
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  // --------------------------------------------------------------------------------------- wiring
  function onKeys() {
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        send();
      }
    });
    document.addEventListener("keydown", (e) => {
      if (e.key !== "Escape") return;
      if (state.controller) return stop();
      if (narrow.matches) { setPanel("sidebar", false); setPanel("settings", false); }
    });
  }

  function onButtons() {
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
    $("stop").addEventListener("click", stop);
    $("new-chat").addEventListener("click", () => { if (!state.controller) select(null); });
    $("rename-chat").addEventListener("click", renameConversation);
    $("delete-chat").addEventListener("click", deleteConversation);
    $("export-chat").addEventListener("click", exportConversation);
    for (const name of ["sidebar", "settings"]) {
      $(`toggle-${name}`).addEventListener("click", () => {
        const open = !document.body.classList.contains(`show-${name}`);
        if (open && narrow.matches) setPanel(name === "sidebar" ? "settings" : "sidebar", false);
        setPanel(name, open);
      });
    }
    for (const name of SETTINGS) $(name).addEventListener("change", saveSettings);
    $("model-select").addEventListener("change", pickModel);
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      store(KEYS.apiKey, $("api-key").value.trim());
      $("api-key").value = "";
      $("key-form").hidden = true;
      notify("");
      loadModel();
      $("prompt").focus();
    });
    $("forget-key").addEventListener("click", () => { store(KEYS.apiKey, null); notify("The API key is forgotten."); });
  }

  function start() {
    state.conversations = load(KEYS.conversations, []).filter((c) => c && Array.isArray(c.messages));
    const saved = load(KEYS.current, null);
    state.currentId = state.conversations.some((c) => c.id === saved) ? saved : null;
    loadSettings();
    setPanel("sidebar", !narrow.matches);
    setPanel("settings", !narrow.matches && window.innerWidth >= 1100);
    onKeys();
    onButtons();
    render();
    loadModel();
  }

  start();
})();
