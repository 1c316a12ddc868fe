// The llaisys chat page. Conversations live on the server (api/conversations, see
// docs/server.md); answers stream from the server's own v1/chat/completions.
//
// A conversation is a tree of messages; the page shows the path from the first message to the
// conversation's active leaf. Sending saves the user message first, then creates the assistant
// message and saves its text as it streams (every SAVE_EVERY_MS and at the end, stopped or not).
(function () {
  "use strict";

  const MD = window.LlaisysMarkdown;
  const SAVE_EVERY_MS = 1000;
  const KEY_STORAGE = "llaisys.apiKey";
  const SETTINGS = ["temperature", "top_p", "max_tokens", "seed"];
  const INTEGER_SETTINGS = new Set(["max_tokens", "seed"]);

  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };

  const state = {
    list: [],            // conversation summaries shown in the sidebar
    conv: null,          // the open conversation (id null: a draft not saved yet)
    byId: new Map(),     // its messages by id
    branchLeaf: new Map(), // message id -> leaf last shown under it, to come back to a branch
    stream: null,        // the answer being generated: {convId, msg, controller, content, ...}
    model: null,
    apiKey: localStorage.getItem(KEY_STORAGE) || null,
    keyPrompt: null,     // the pending API key dialog, shared by concurrent 401s
    search: "",
  };

  // ------------------------------------------------------------------ server calls

  function authHeaders(extra) {
    const h = Object.assign({}, extra || {});
    if (state.apiKey) h.Authorization = "Bearer " + state.apiKey;
    return h;
  }

  async function errorText(res) {
    try {
      const body = await res.json();
      const e = body.error || body.detail || body;
      return (typeof e === "string" ? e : e.message || JSON.stringify(e)) + " (HTTP " + res.status + ")";
    } catch (_) {
      return "HTTP " + res.status + " " + res.statusText;
    }
  }

  function askKey(message) {
    if (state.keyPrompt) return state.keyPrompt;
    const dialog = $("key-dialog");
    $("key-error").textContent = message || "";
    $("key-input").value = "";
    state.keyPrompt = new Promise((resolve) => {
      dialog.addEventListener("close", function done() {
        dialog.removeEventListener("close", done);
        const key = $("key-input").value.trim();
        if (key) {
          state.apiKey = key;
          localStorage.setItem(KEY_STORAGE, key);
        }
        state.keyPrompt = null;
        resolve();
      });
    });
    dialog.showModal();
    return state.keyPrompt;
  }

  // fetch with the API key; a 401 asks for the key and tries again.
  async function authFetch(url, init) {
    for (;;) {
      const res = await fetch(url, Object.assign({}, init, { headers: authHeaders(init && init.headers) }));
      if (res.status !== 401) return res;
      await askKey(state.apiKey ? "The server refused that key." : "");
    }
  }

  async function api(method, path, body) {
    const init = { method };
    if (body !== undefined) {
      init.headers = { "Content-Type": "application/json" };
      init.body = JSON.stringify(body);
    }
    const res = await authFetch("api/conversations" + path, init);
    if (!res.ok) throw new Error(await errorText(res));
    return res.status === 204 ? null : res.json();
  }

  function notify(text, isError) {
    const n = $("notice");
    n.textContent = text;
    n.className = isError ? "error" : "";
    n.hidden = false;
    clearTimeout(notify.timer);
    notify.timer = setTimeout(() => { n.hidden = true; }, isError ? 8000 : 3000);
  }

  function reportErrors(fn) {
    return async function (...args) {
      try {
        return await fn.apply(this, args);
      } catch (e) {
        console.error(e);
        notify(e.message || String(e), true);
      }
    };
  }

  // ------------------------------------------------------------------ conversation tree

  function setConversation(conv) {
    state.conv = conv;
    state.byId = new Map(conv.messages.map((m) => [m.id, m]));
    if (conv.id) history.replaceState(null, "", "#c=" + encodeURIComponent(conv.id));
    else history.replaceState(null, "", location.pathname + location.search);
  }

  function draft() {
    return { id: null, title: "", system_prompt: "", settings: {}, active_leaf: null, messages: [], path: [] };
  }

  function pathTo(id) {
    const out = [];
    for (let m = state.byId.get(id); m; m = state.byId.get(m.parent_id)) out.push(m);
    return out.reverse();
  }

  function childrenOf(parentId) {
    return state.conv.messages.filter((m) => m.parent_id === parentId);
  }

  function isUnder(leafId, ancestorId) {
    return pathTo(leafId).some((m) => m.id === ancestorId);
  }

  // The leaf to show under ``id``: the one last shown there, else the newest child at each step.
  function leafUnder(id) {
    const remembered = state.branchLeaf.get(id);
    if (remembered && state.byId.has(remembered) && isUnder(remembered, id)) return remembered;
    for (;;) {
      const kids = childrenOf(id);
      if (!kids.length) return id;
      id = kids[kids.length - 1].id;
    }
  }

  function addLocal(message) {
    if (!state.conv || state.conv.id !== message.conversation_id) return;
    const known = state.byId.get(message.id);
    if (known) Object.assign(known, message);
    else {
      state.conv.messages.push(message);
      state.byId.set(message.id, message);
    }
  }

  // ------------------------------------------------------------------ rendering

  function renderList() {
    const ul = $("conversation-list");
    ul.textContent = "";
    if (!state.list.length) {
      ul.appendChild(el("li", "empty", state.search ? "No chat matches." : "No chats yet."));
      return;
    }
    for (const c of state.list) {
      const li = el("li", "conversation" + (state.conv && state.conv.id === c.id ? " active" : ""));
      li.dataset.id = c.id;
      const open = el("button", "conv-open");
      open.type = "button";
      open.appendChild(el("span", "conv-title", c.title || "New chat"));
      if (c.snippet) open.appendChild(el("span", "conv-snippet", c.snippet));
      open.addEventListener("click", () => openConversation(c.id));
      const rename = el("button", "conv-rename icon", "✎");
      rename.type = "button";
      rename.title = "Rename";
      rename.addEventListener("click", () => startRename(li, c));
      const del = el("button", "conv-delete icon", "×");
      del.type = "button";
      del.title = "Delete";
      del.addEventListener("click", () => deleteConversation(c));
      li.append(open, rename, del);
      ul.appendChild(li);
    }
  }

  function renderHeader() {
    const conv = state.conv;
    $("chat-title").textContent = (conv && conv.title) || "New chat";
    document.title = ((conv && conv.title) || "New chat") + " · llaisys";
    $("rename-button").disabled = $("export-button").disabled = !(conv && conv.id);
    $("model-name").textContent = state.model || "";
    $("system-prompt").value = conv ? conv.system_prompt : "";
    for (const k of SETTINGS) {
      const v = conv && conv.settings[k];
      $("set-" + k).value = v === undefined || v === null ? "" : String(v);
    }
    $("settings-error").hidden = true;
  }

  function statsText(meta) {
    const parts = [];
    if (meta.completion_tokens !== undefined) parts.push(meta.completion_tokens + " tokens");
    if (meta.tokens_per_s !== undefined) parts.push(meta.tokens_per_s.toFixed(1) + " tok/s");
    if (meta.ttft_s !== undefined) parts.push("first token " + meta.ttft_s.toFixed(2) + " s");
    return parts.join(" · ");
  }

  function statusOf(m) {
    if (state.stream && state.stream.msg.id === m.id) return "streaming";
    const s = m.meta && m.meta.status;
    return s === "streaming" ? "interrupted" : s; // a stream this page is not running: cut short
  }

  function messageEl(m) {
    const streaming = state.stream && state.stream.msg.id === m.id;
    const content = streaming ? state.stream.content : m.content;
    const box = el("article", "msg " + m.role + (streaming ? " streaming" : ""));
    box.dataset.id = m.id;
    box.appendChild(el("div", "msg-role", m.role === "user" ? "You" : "Assistant"));
    const body = el("div", "msg-body");
    if (m.role === "assistant") body.innerHTML = MD.render(content); // escaped by the renderer
    else body.textContent = content;
    box.appendChild(body);

    const foot = el("div", "msg-foot");
    const siblings = childrenOf(m.parent_id);
    if (siblings.length > 1) {
      const k = siblings.findIndex((s) => s.id === m.id);
      const nav = el("span", "branch-nav");
      const prev = el("button", "branch-prev icon", "‹");
      const next = el("button", "branch-next icon", "›");
      prev.type = next.type = "button";
      prev.title = "Previous version";
      next.title = "Next version";
      prev.disabled = k === 0 || !!state.stream;
      next.disabled = k === siblings.length - 1 || !!state.stream;
      prev.addEventListener("click", () => switchBranch(m, siblings[k - 1]));
      next.addEventListener("click", () => switchBranch(m, siblings[k + 1]));
      nav.append(prev, el("span", "branch-pos", (k + 1) + "/" + siblings.length), next);
      foot.appendChild(nav);
    }
    if (m.role === "user") {
      const edit = el("button", "edit-button", "Edit");
      edit.type = "button";
      edit.disabled = !!state.stream;
      edit.addEventListener("click", () => startEdit(box, m));
      foot.appendChild(edit);
    } else {
      const copy = el("button", "copy-message", "Copy");
      copy.type = "button";
      copy.addEventListener("click", () => copyText(streaming ? state.stream.content : m.content, copy));
      const again = el("button", "regenerate-button", "Regenerate");
      again.type = "button";
      again.disabled = !!state.stream;
      again.addEventListener("click", reportErrors(() => generate(state.byId.get(m.parent_id))));
      foot.append(copy, again);
      const status = statusOf(m);
      if (status && status !== "done") foot.appendChild(el("span", "msg-status " + status, status));
      if (m.meta && m.meta.error) foot.appendChild(el("span", "msg-error", m.meta.error));
      const stats = m.meta ? statsText(m.meta) : "";
      if (stats && !streaming) foot.appendChild(el("span", "msg-stats", stats));
    }
    box.appendChild(foot);
    return box;
  }

  function renderMessages() {
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    box.textContent = "";
    const conv = state.conv;
    const path = conv && conv.active_leaf ? pathTo(conv.active_leaf) : [];
    if (!path.length) {
      box.appendChild(el("div", "empty-chat", "Send a message to start."));
    }
    for (const m of path) box.appendChild(messageEl(m));
    if (atBottom || state.stream) box.scrollTop = box.scrollHeight;
  }

  // Re-render the streaming message's text at most every 50 ms.
  function scheduleStreamRender() {
    if (scheduleStreamRender.pending) return;
    scheduleStreamRender.pending = setTimeout(() => {
      scheduleStreamRender.pending = null;
      const s = state.stream;
      if (!s) return;
      const node = document.querySelector('.msg[data-id="' + CSS.escape(s.msg.id) + '"] .msg-body');
      if (!node) return;
      const box = $("messages");
      const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
      node.innerHTML = MD.render(s.content);
      if (atBottom) box.scrollTop = box.scrollHeight;
    }, 50);
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
  }

  // ------------------------------------------------------------------ actions

  const refreshList = reportErrors(async function () {
    const search = state.search;
    const list = (await api("GET", search ? "?q=" + encodeURIComponent(search) : "")).data;
    if (search !== state.search) return; // an answer to a search typed over since
    state.list = list;
    renderList();
  });

  const openConversation = reportErrors(async function (id) {
    setConversation(await api("GET", "/" + encodeURIComponent(id)));
    state.branchLeaf.clear();
    renderHeader();
    renderMessages();
    renderList();
    document.body.classList.remove("show-sidebar");
  });

  function newChat() {
    setConversation(draft());
    renderHeader();
    renderMessages();
    renderList();
    $("prompt").focus();
  }

  async function ensureSaved() {
    if (state.conv.id) return state.conv;
    const c = state.conv;
    const saved = await api("POST", "", { title: c.title, system_prompt: c.system_prompt, settings: c.settings });
    setConversation(saved);
    return saved;
  }

  function startRename(li, summary) {
    const input = el("input", "rename-input");
    input.value = summary.title;
    input.setAttribute("aria-label", "New title");
    li.textContent = "";
    li.appendChild(input);
    input.focus();
    input.select();
    let done = false;
    const finish = reportErrors(async (save) => {
      if (done) return;
      done = true;
      if (save && input.value.trim() !== summary.title) {
        const conv = await api("PATCH", "/" + encodeURIComponent(summary.id), { title: input.value });
        if (state.conv && state.conv.id === conv.id) {
          state.conv.title = conv.title;
          renderHeader();
        }
      }
      await refreshList();
    });
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") { e.preventDefault(); finish(true); }
      if (e.key === "Escape") { e.preventDefault(); finish(false); }
    });
    input.addEventListener("blur", () => finish(true));
  }

  const deleteConversation = reportErrors(async function (summary) {
    if (!confirm("Delete “" + (summary.title || "New chat") + "”?")) return;
    await api("DELETE", "/" + encodeURIComponent(summary.id));
    if (state.conv && state.conv.id === summary.id) newChat();
    await refreshList();
  });

  const switchBranch = reportErrors(async function (from, to) {
    if (!to || state.stream) return;
    state.branchLeaf.set(from.id, state.conv.active_leaf);
    const leaf = leafUnder(to.id);
    state.conv.active_leaf = leaf;
    renderMessages();
    if (state.conv.id) await api("PATCH", "/" + encodeURIComponent(state.conv.id), { active_leaf: leaf });
  });

  function startEdit(box, m) {
    if (state.stream) return;
    const body = box.querySelector(".msg-body");
    const foot = box.querySelector(".msg-foot");
    const area = el("textarea", "edit-input");
    area.value = m.content;
    area.rows = Math.min(12, Math.max(2, m.content.split("\n").length));
    const save = el("button", "edit-send primary", "Send");
    const cancel = el("button", "edit-cancel", "Cancel");
    save.type = cancel.type = "button";
    const bar = el("div", "edit-bar");
    bar.append(save, cancel);
    body.replaceWith(area);
    foot.replaceWith(bar);
    area.focus();
    cancel.addEventListener("click", renderMessages);
    save.addEventListener("click", reportErrors(async () => {
      const text = area.value;
      if (!text.trim()) return;
      await sendMessage(text, m.parent_id); // a sibling of m: a new branch, m's kept
    }));
  }

  // Save a user message under ``parentId`` (undefined: the end of the branch on screen), then answer it.
  async function sendMessage(text, parentId) {
    if (state.stream) return;
    let conv, user;
    try {
      conv = await ensureSaved();
      const parent = parentId === undefined ? conv.active_leaf : parentId;
      user = await api("POST", "/" + encodeURIComponent(conv.id) + "/messages",
        { role: "user", content: text, parent_id: parent });
    } catch (e) {
      e.unsaved = true;
      throw e;
    }
    addLocal(user);
    conv.active_leaf = user.id;
    if (!conv.title) conv.title = user.content.slice(0, 60); // the server titles it too
    renderHeader();
    renderMessages();
    refreshList();
    await generate(user);
  }

  function requestBody(userMsg) {
    const conv = state.conv;
    const messages = [];
    if (conv.system_prompt.trim()) messages.push({ role: "system", content: conv.system_prompt });
    for (const m of pathTo(userMsg.id)) messages.push({ role: m.role, content: m.content });
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (state.model) body.model = state.model;
    for (const k of SETTINGS) {
      if (conv.settings[k] !== undefined && conv.settings[k] !== null) body[k] = conv.settings[k];
    }
    return body;
  }

  // Read an SSE body, calling onData with each parsed ``data:`` object until [DONE] or the end.
  async function readSse(body, onData) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buf += decoder.decode(value, { stream: true });
        let m;
        while ((m = /\r?\n\r?\n/.exec(buf))) {
          const event = buf.slice(0, m.index);
          buf = buf.slice(m.index + m[0].length);
          const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
          if (data === "[DONE]") return;
          if (data) onData(JSON.parse(data));
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  function saveStream(s, meta) {
    // saves run one after another, so the final one lands last
    const patch = { content: s.content };
    if (meta) patch.meta = meta;
    s.lastSave = performance.now();
    s.saving = (s.saving || Promise.resolve()).then(() =>
      api("PATCH", "/" + encodeURIComponent(s.convId) + "/messages/" + encodeURIComponent(s.msg.id), patch))
      .catch((e) => { console.error(e); notify("Could not save the answer: " + e.message, true); return null; });
    return s.saving;
  }

  // Answer ``userMsg``: a new assistant message under it, streamed from the server and saved as it grows.
  async function generate(userMsg) {
    if (state.stream || !userMsg) return;
    const conv = state.conv;
    const body = requestBody(userMsg);
    const msg = await api("POST", "/" + encodeURIComponent(conv.id) + "/messages",
      { role: "assistant", content: "", parent_id: userMsg.id, meta: { status: "streaming", model: state.model } });
    const s = {
      convId: conv.id, msg, controller: new AbortController(), content: "", saving: null, lastSave: 0,
      t0: performance.now(), tFirst: null, tLast: null, usage: null, finish: null,
    };
    state.stream = s;
    addLocal(msg);
    conv.active_leaf = msg.id;
    setBusy(true);
    renderMessages();
    let status = "done";
    let error = null;
    try {
      const res = await authFetch("v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body), signal: s.controller.signal,
      });
      if (!res.ok) throw new Error(await errorText(res));
      await readSse(res.body, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        const choice = chunk.choices && chunk.choices[0];
        const delta = choice && choice.delta && choice.delta.content;
        if (delta) {
          const now = performance.now();
          if (s.tFirst === null) s.tFirst = now;
          s.tLast = now;
          s.content += delta;
          scheduleStreamRender();
          if (now - s.lastSave >= SAVE_EVERY_MS) saveStream(s);
        }
        if (choice && choice.finish_reason) s.finish = choice.finish_reason;
        if (chunk.usage) s.usage = chunk.usage;
      });
    } catch (e) {
      if (s.controller.signal.aborted) status = "stopped";
      else { status = "error"; error = e.message || String(e); }
    }
    const meta = { status, model: state.model || null, finish_reason: s.finish };
    if (error) meta.error = error;
    if (s.tFirst !== null) meta.ttft_s = (s.tFirst - s.t0) / 1000;
    if (s.usage) {
      meta.prompt_tokens = s.usage.prompt_tokens;
      meta.completion_tokens = s.usage.completion_tokens;
      // decode speed: the tokens after the first over the time from the first token to the last
      const dt = (s.tLast - s.tFirst) / 1000;
      if (s.usage.completion_tokens > 1 && dt > 0) meta.tokens_per_s = (s.usage.completion_tokens - 1) / dt;
    }
    const saved = await saveStream(s, meta);
    state.stream = null;
    setBusy(false);
    const local = state.byId.get(msg.id);
    if (local) Object.assign(local, saved || { content: s.content, meta });
    if (state.conv && state.conv.id === s.convId) renderMessages();
    refreshList();
  }

  function stop() {
    if (state.stream) state.stream.controller.abort();
  }

  // A page closed mid-answer: save what came, marked stopped (keepalive outlives the page).
  function saveOnExit() {
    const s = state.stream;
    if (!s) return;
    fetch("api/conversations/" + encodeURIComponent(s.convId) + "/messages/" + encodeURIComponent(s.msg.id), {
      method: "PATCH", keepalive: true, headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify({ content: s.content, meta: { status: "stopped" } }),
    }).catch(() => {});
  }

  async function copyText(text, button) {
    let copied = false;
    try {
      if (navigator.clipboard && window.isSecureContext) {
        await navigator.clipboard.writeText(text);
        copied = true;
      }
    } catch (_) { /* no permission or no focus: the old way below */ }
    if (!copied) { // plain http on another host has no clipboard API
      const area = el("textarea");
      area.value = text;
      area.style.position = "fixed";
      area.style.opacity = "0";
      document.body.appendChild(area);
      area.select();
      copied = document.execCommand("copy");
      area.remove();
    }
    const old = button.dataset.label || button.textContent;
    button.dataset.label = old;
    button.textContent = copied ? "Copied" : "Copy failed";
    setTimeout(() => { button.textContent = old; }, 1500);
  }

  const saveSettings = reportErrors(async function () {
    const conv = state.conv;
    const settings = {};
    for (const k of SETTINGS) {
      const raw = $("set-" + k).value.trim();
      if (raw === "") continue;
      const v = Number(raw);
      if (!Number.isFinite(v) || (INTEGER_SETTINGS.has(k) && !Number.isInteger(v))) {
        $("settings-error").textContent = k + " must be " + (INTEGER_SETTINGS.has(k) ? "an integer" : "a number");
        $("settings-error").hidden = false;
        return;
      }
      settings[k] = v;
    }
    const systemPrompt = $("system-prompt").value;
    if (!conv.id) {
      conv.settings = settings;
      conv.system_prompt = systemPrompt;
      $("settings-error").hidden = true;
      return;
    }
    try {
      const saved = await api("PATCH", "/" + encodeURIComponent(conv.id), { system_prompt: systemPrompt, settings });
      conv.settings = saved.settings;
      conv.system_prompt = saved.system_prompt;
      $("settings-error").hidden = true;
    } catch (e) {
      $("settings-error").textContent = e.message;
      $("settings-error").hidden = false;
    }
  });

  const exportConversation = reportErrors(async function () {
    if (!state.conv || !state.conv.id) return;
    const doc = await api("GET", "/" + encodeURIComponent(state.conv.id) + "/export");
    const blob = new Blob([JSON.stringify(doc, null, 2)], { type: "application/json" });
    const a = el("a");
    a.href = URL.createObjectURL(blob);
    a.download = (state.conv.title || "conversation").replace(/[^\w.-]+/g, "-").slice(0, 60) + ".json";
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  });

  const importFile = reportErrors(async function (file) {
    let doc;
    try {
      doc = JSON.parse(await file.text());
    } catch (e) {
      throw new Error(file.name + " is not JSON: " + e.message);
    }
    const made = (await api("POST", "/import", doc)).data;
    notify("Imported " + made.length + " conversation" + (made.length === 1 ? "" : "s"));
    await refreshList();
    if (made.length) await openConversation(made[0].id);
  });

  const loadModel = async function () {
    try {
      const res = await authFetch("v1/models", {});
      if (!res.ok) return;
      const body = await res.json();
      state.model = body.data && body.data.length ? body.data[0].id : null;
      $("model-name").textContent = state.model || "";
    } catch (e) {
      console.warn("no model list", e);
    }
  };

  // ------------------------------------------------------------------ wiring

  function wire() {
    $("new-chat").addEventListener("click", newChat);
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("prompt").value;
      if (!text.trim() || state.stream) return;
      $("prompt").value = "";
      autoGrow();
      sendMessage(text).catch((err) => {
        if (err.unsaved && !$("prompt").value) $("prompt").value = text; // not saved: give it back
        notify(err.message || String(err), true);
      });
    });
    const autoGrow = () => {
      const p = $("prompt");
      p.style.height = "auto";
      p.style.height = Math.min(p.scrollHeight + 2, 240) + "px"; // + its borders
      p.style.overflowY = p.scrollHeight + 2 > 240 ? "auto" : "hidden";
    };
    $("prompt").addEventListener("input", autoGrow);
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", stop);
    $("messages").addEventListener("click", (e) => {
      const button = e.target.closest(".copy-code");
      if (button) copyText(button.closest(".code-block").querySelector("code").textContent, button);
    });
    let searchTimer = null;
    $("search").addEventListener("input", () => {
      clearTimeout(searchTimer);
      searchTimer = setTimeout(() => { state.search = $("search").value.trim(); refreshList(); }, 200);
    });
    $("settings-button").addEventListener("click", () => {
      const panel = $("settings-panel");
      panel.hidden = !panel.hidden;
      $("settings-button").setAttribute("aria-expanded", String(!panel.hidden));
    });
    $("system-prompt").addEventListener("change", saveSettings);
    for (const k of SETTINGS) $("set-" + k).addEventListener("change", saveSettings);
    $("rename-button").addEventListener("click", () => {
      const li = state.conv && document.querySelector('.conversation[data-id="' + CSS.escape(state.conv.id) + '"]');
      const summary = li && state.list.find((c) => c.id === state.conv.id);
      if (summary) startRename(li, summary);
    });
    $("export-button").addEventListener("click", exportConversation);
    $("import-button").addEventListener("click", () => $("import-file").click());
    $("import-file").addEventListener("change", () => {
      const file = $("import-file").files[0];
      $("import-file").value = "";
      if (file) importFile(file);
    });
    $("toggle-sidebar").addEventListener("click", () => document.body.classList.toggle("show-sidebar"));
    $("key-dialog").addEventListener("cancel", (e) => e.preventDefault()); // the key is needed to go on
    window.addEventListener("pagehide", saveOnExit);
  }

  async function start() {
    wire();
    const m = /^#c=([^&]+)/.exec(location.hash); // the chat open before a reload
    setConversation(draft());
    renderHeader();
    renderMessages();
    await refreshList();
    if (m) await openConversation(decodeURIComponent(m[1]));
    loadModel();
    document.body.dataset.ready = "1"; // for tests: the page has loaded what it shows
  }

  start();
})();
