// The llaisys chat page. Conversations live on the server (api/conversations, see
// docs/server.md); answers stream from the server's own v1/chat/completions.
//
// A conversation is a tree of messages; the page shows the path from the first message to the
// conversation's active leaf. Sending saves the user message first, then creates the assistant
// message and saves its text as it streams (every SAVE_EVERY_MS and at the end, stopped or not).
// Each request carries the model's sampling defaults (api/settings, as the CLI uses them) and a
// max_tokens, under what the user set for the chat. A reload mid-answer keeps it, marked stopped.
// A reasoning model's reasoning_content is kept in the answer's meta.reasoning and shown folded
// above it; it is never sent back to the model.
// A model that lists "vision" among its capabilities (v1/models) takes images: the user attaches,
// pastes or drops them on the composer; a user message keeps them as data URLs (its ``images``,
// stored with the conversation) and sends them, with the history, as OpenAI image_url parts.
// A server of several models gets a picker (v1/models lists them); the model picked answers.
(function () {
  "use strict";

  const MD = window.LlaisysMarkdown;
  const SAVE_EVERY_MS = 1000;
  const KEY_STORAGE = "llaisys.apiKey";
  const STREAM_STORAGE = "llaisys.streaming"; // sessionStorage: the answer this tab streams, for after a reload
  const KEEPALIVE_MAX = 60000; // bytes: browsers cap what keepalive requests in flight carry at 64 KiB
  const SETTINGS = ["temperature", "top_p", "max_tokens", "seed"];
  const INTEGER_SETTINGS = new Set(["max_tokens", "seed"]);

  const SHOWN_DEFAULTS = ["temperature", "top_p", "max_tokens"];
  // What the store keeps (store.IMAGE_TYPES, MAX_IMAGE_BYTES, MAX_IMAGES) and the server decodes.
  const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp"];
  const MAX_IMAGE_BYTES = 20 * 1024 * 1024;
  const MAX_IMAGES = 8;
  const MODEL_RETRY_MS = 3000; // v1/models asked again while the model loads (503)
  const MODEL_KEY = "llaisys.model"; // localStorage: the model picked last, on a server of several

  const $ = (id) => document.getElementById(id);
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
  // A message's meta as an object, whatever was stored (an imported file may carry anything).
  const metaOf = (m) => (isObj(m.meta) ? m.meta : {});
  // A message's image URLs: the data URLs of its images (an imported file may carry anything).
  const imagesOf = (m) => (Array.isArray(m.images) ? m.images : [])
    .map((i) => (isObj(i) ? i.url : null)).filter((u) => typeof u === "string" && /^data:image\//i.test(u));
  const textOf = (v) => (typeof v === "string" ? v : v === undefined || v === null ? "" : String(v));
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
    stream: null,        // the answer being generated: {convId, msg, controller, content, reasoning, ...}
    openReasoning: new Set(), // ids of answers whose reasoning the user unfolded (kept across re-renders)
    model: null,
    models: [],          // v1/models' entries (a picker shows them when there are several)
    vision: false,       // the model takes images (v1/models lists "vision"); false until known
    attachments: [],     // images in the composer, to go with the next message: {url, name}
    defaults: null,      // api/settings: the model's sampling defaults and max_tokens
    leaving: false,      // the page is being unloaded: a failing stream is cut by that, not by an error
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
      const v = conv && isObj(conv.settings) ? conv.settings[k] : undefined;
      $("set-" + k).value = isNum(v) ? String(v) : "";
    }
    $("settings-error").hidden = true;
    showDefaults();
  }

  // The settings panel shows the model's defaults in its empty fields.
  function showDefaults() {
    const d = state.defaults || {};
    const shown = [];
    for (const k of SHOWN_DEFAULTS) {
      const v = d[k];
      $("set-" + k).placeholder = isNum(v) ? String(v) : "default";
      if (isNum(v)) shown.push((k === "max_tokens" ? "max tokens" : k) + " " + v);
    }
    $("settings-defaults").textContent = shown.length
      ? "Empty fields use the model's defaults: " + shown.join(", ") + "."
      : "Empty fields use the server's defaults.";
  }

  function statsText(meta) {
    const parts = [];
    if (isNum(meta.completion_tokens)) parts.push(meta.completion_tokens + " tokens");
    if (isNum(meta.tokens_per_s)) parts.push(meta.tokens_per_s.toFixed(1) + " tok/s");
    if (isNum(meta.ttft_s)) parts.push("first token " + meta.ttft_s.toFixed(2) + " s");
    return parts.join(" · ");
  }

  function statusOf(m) {
    if (state.stream && state.stream.msg.id === m.id) return "streaming";
    const s = metaOf(m).status;
    if (typeof s !== "string" || !/^[a-z_]{1,20}$/.test(s)) return undefined; // also a CSS class
    return s === "streaming" ? "interrupted" : s; // a stream this page is not running: cut short
  }

  // A message that cannot be rendered (a bug, or data no check foresaw) still shows its text.
  function safeMessageEl(m) {
    try {
      return messageEl(m);
    } catch (e) {
      console.error("could not render message", m && m.id, e);
      const box = el("article", "msg " + (m.role === "user" ? "user" : "assistant"));
      box.dataset.id = textOf(m.id);
      box.appendChild(el("div", "msg-role", m.role === "user" ? "You" : "Assistant"));
      box.appendChild(el("div", "msg-body", textOf(m.content)));
      return box;
    }
  }

  // An answer's reasoning, folded (a click opens it): "Thinking…" while it streams and no answer
  // text has come yet. Rendered by the Markdown renderer, which escapes every piece of text.
  function reasoningEl(m, text, thinking) {
    const fold = el("details", "reasoning");
    fold.open = state.openReasoning.has(m.id);
    fold.addEventListener("toggle", () => {
      if (fold.open) state.openReasoning.add(m.id);
      else state.openReasoning.delete(m.id);
    });
    fold.append(el("summary", "reasoning-summary"), el("div", "reasoning-body md"));
    fillReasoning(fold, text, thinking);
    return fold;
  }

  function fillReasoning(fold, text, thinking) {
    fold.classList.toggle("thinking", thinking);
    fold.querySelector(".reasoning-summary").textContent = thinking ? "Thinking…" : "Reasoning";
    fold.querySelector(".reasoning-body").innerHTML = MD.render(text); // escaped by the renderer
  }

  function messageEl(m) {
    const streaming = state.stream && state.stream.msg.id === m.id;
    const content = streaming ? state.stream.content : textOf(m.content);
    const box = el("article", "msg " + m.role + (streaming ? " streaming" : ""));
    box.dataset.id = m.id;
    box.appendChild(el("div", "msg-role", m.role === "user" ? "You" : "Assistant"));
    if (m.role === "assistant") {
      const stored = metaOf(m).reasoning;
      const reasoning = streaming ? state.stream.reasoning : typeof stored === "string" ? stored : "";
      if (reasoning) box.appendChild(reasoningEl(m, reasoning, streaming && !content));
      if (streaming) box.dataset.shown = reasoning.length + "," + content.length; // see scheduleStreamRender
    }
    const images = m.role === "user" ? imagesOf(m) : [];
    if (images.length) box.appendChild(messageImagesEl(images));
    const body = el("div", "msg-body" + (m.role === "assistant" ? " md" : ""));
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
      copy.addEventListener("click", () => copyText(streaming ? state.stream.content : textOf(m.content), copy));
      const again = el("button", "regenerate-button", "Regenerate");
      again.type = "button";
      again.disabled = !!state.stream;
      again.addEventListener("click", reportErrors(() => generate(state.byId.get(m.parent_id))));
      foot.append(copy, again);
      const status = statusOf(m);
      if (status && status !== "done") foot.appendChild(el("span", "msg-status " + status, status));
      const meta = metaOf(m);
      if (meta.finish_reason === "length" && !streaming) {
        const cut = el("span", "msg-status length", "cut at max tokens");
        cut.title = "The answer reached its token limit: raise Max tokens in Settings, or ask it to go on.";
        foot.appendChild(cut);
      }
      if (typeof meta.error === "string" && meta.error) foot.appendChild(el("span", "msg-error", meta.error));
      const stats = statsText(meta);
      if (stats && !streaming) foot.appendChild(el("span", "msg-stats", stats));
    }
    box.appendChild(foot);
    return box;
  }

  // A user message's images, full width a click away.
  function messageImagesEl(urls) {
    const row = el("div", "msg-images");
    urls.forEach((url, k) => {
      const img = el("img", "msg-image");
      img.src = url;
      img.alt = "Image " + (k + 1) + " of " + urls.length;
      img.addEventListener("click", () => img.classList.toggle("expanded"));
      row.appendChild(img);
    });
    return row;
  }

  // Thumbnails of images about to be sent ({url, name}), each with a button that removes it.
  function thumbsEl(box, images, onRemove) {
    box.textContent = "";
    images.forEach((image, k) => {
      const fig = el("figure", "thumb");
      const img = el("img");
      img.src = image.url;
      img.alt = image.name || "Image " + (k + 1);
      img.title = image.name || "";
      const remove = el("button", "thumb-remove", "×");
      remove.type = "button";
      remove.title = "Remove " + (image.name || "this image");
      remove.setAttribute("aria-label", remove.title);
      remove.addEventListener("click", () => onRemove(k));
      fig.append(img, remove);
      box.appendChild(fig);
    });
    box.hidden = !images.length;
    return box;
  }

  function renderAttachments() {
    thumbsEl($("attachments"), state.attachments, (k) => {
      state.attachments.splice(k, 1);
      renderAttachments();
    });
  }

  // The attach button: on for a model that takes images, else off saying why.
  function renderAttach() {
    const why = state.vision ? "Attach images (or paste or drop them here)"
      : (state.model || "This model") + " takes text only: it cannot read images";
    $("attach").disabled = $("attach-file").disabled = !state.vision;
    $("attach").title = $("attach-wrap").title = why; // a disabled button shows no tooltip in some browsers
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
    for (const m of path) box.appendChild(safeMessageEl(m));
    if (atBottom || state.stream) box.scrollTop = box.scrollHeight;
  }

  // Re-render the streaming message's text (and reasoning) at most every 50 ms, what changed only.
  function scheduleStreamRender() {
    if (scheduleStreamRender.pending) return;
    scheduleStreamRender.pending = setTimeout(() => {
      scheduleStreamRender.pending = null;
      const s = state.stream;
      if (!s) return;
      const msg = document.querySelector('.msg[data-id="' + CSS.escape(s.msg.id) + '"]');
      const node = msg && msg.querySelector(".msg-body");
      if (!node) return;
      const box = $("messages");
      const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
      const [reasoning, content] = (msg.dataset.shown || "-1,-1").split(",").map(Number); // the lengths on screen
      if (s.reasoning.length !== reasoning || (s.content.length > 0) !== (content > 0)) {
        const fold = msg.querySelector(".reasoning");
        if (fold) fillReasoning(fold, s.reasoning, !s.content);
        else if (s.reasoning) node.before(reasoningEl(s.msg, s.reasoning, !s.content));
      }
      if (s.content.length !== content) node.innerHTML = MD.render(s.content);
      msg.dataset.shown = s.reasoning.length + "," + s.content.length;
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
    area.value = textOf(m.content);
    area.rows = Math.min(12, Math.max(2, area.value.split("\n").length));
    const save = el("button", "edit-send primary", "Send");
    const cancel = el("button", "edit-cancel", "Cancel");
    save.type = cancel.type = "button";
    const bar = el("div", "edit-bar");
    bar.append(save, cancel);
    // the images go with the edited text, less those the user removes
    const kept = imagesOf(m).map((url, k) => ({ url, name: "Image " + (k + 1) }));
    const shown = box.querySelector(".msg-images");
    if (shown) {
      const strip = el("div", "thumbs edit-thumbs");
      const redraw = () => thumbsEl(strip, kept, (k) => { kept.splice(k, 1); redraw(); });
      shown.replaceWith(redraw());
    }
    body.replaceWith(area);
    foot.replaceWith(bar);
    area.focus();
    cancel.addEventListener("click", renderMessages);
    save.addEventListener("click", reportErrors(async () => {
      const text = area.value;
      if (!text.trim() && !kept.length) return;
      await sendMessage(text.trim() ? text : "", m.parent_id, kept); // a sibling of m: a new branch, m's kept
    }));
  }

  // Save a user message (``text`` and ``images``, a list of {url}) under ``parentId`` (undefined:
  // the end of the branch on screen), then answer it.
  async function sendMessage(text, parentId, images) {
    if (state.stream) return;
    let conv, user;
    try {
      conv = await ensureSaved();
      const parent = parentId === undefined ? conv.active_leaf : parentId;
      const body = { role: "user", content: text, parent_id: parent };
      if (images && images.length) body.images = images.map((i) => ({ url: i.url }));
      user = await api("POST", "/" + encodeURIComponent(conv.id) + "/messages", body);
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

  // The model's defaults (api/settings); an Error saying why when the server has none (yet).
  async function loadDefaults() {
    const chosen = state.models.length > 1 && state.model ? "?model=" + encodeURIComponent(state.model) : "";
    const res = await authFetch("api/settings" + chosen, {});
    if (!res.ok) throw new Error("no sampling defaults from the server: " + await errorText(res));
    const d = await res.json();
    state.defaults = isObj(d) ? d : {};
    showDefaults();
    return state.defaults;
  }

  // What a message says to the model: its text, or for a user message with images OpenAI's
  // content parts (the text, when there is some, then each image).
  function contentOf(m) {
    const text = textOf(m.content);
    const images = m.role === "user" ? imagesOf(m) : [];
    if (!images.length) return text;
    const parts = text ? [{ type: "text", text }] : [];
    for (const url of images) parts.push({ type: "image_url", image_url: { url } });
    return parts;
  }

  // The request for an answer to ``userMsg``: the model's defaults (every sampling value and
  // max_tokens, so an answer never runs on for minutes unasked) under the chat's own settings.
  async function requestBody(userMsg) {
    const conv = state.conv;
    const defaults = state.defaults || await loadDefaults();
    const messages = [];
    if (textOf(conv.system_prompt).trim()) messages.push({ role: "system", content: conv.system_prompt });
    for (const m of pathTo(userMsg.id)) messages.push({ role: m.role, content: contentOf(m) });
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (state.model) body.model = state.model;
    for (const [k, v] of Object.entries(defaults)) {
      if (k !== "max_model_len" && isNum(v)) body[k] = v;
    }
    const own = isObj(conv.settings) ? conv.settings : {};
    for (const k of SETTINGS) {
      if (isNum(own[k])) body[k] = own[k];
    }
    if (!isNum(own.max_tokens) && isNum(body.max_tokens)) await fitContext(body, defaults.max_model_len);
    return body;
  }

  // Lower the default max_tokens where the conversation leaves less room in the context (the
  // server refuses a prompt plus max_tokens above it). Only a long chat asks the server to count:
  // a token is at least one byte, so bytes plus room for the template bound the prompt's tokens.
  // An image's tokens have no such bound (a small picture may become many tiles): a chat with
  // images is always counted.
  async function fitContext(body, context) {
    if (!isNum(context)) return;
    const encoder = new TextEncoder();
    let images = false;
    const bytes = (content) => {
      if (!Array.isArray(content)) return encoder.encode(content).length;
      images = true;
      return content.reduce((n, p) => n + (p.type === "text" ? encoder.encode(p.text).length : 0), 0);
    };
    const bound = body.messages.reduce((n, m) => n + bytes(m.content) + 32, 64);
    if (!images && bound + body.max_tokens <= context) return;
    try {
      const res = await authFetch("tokenize", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ model: body.model, messages: body.messages }),
      });
      if (!res.ok) return; // the chat request will say what is wrong
      const count = (await res.json()).count;
      if (isNum(count)) body.max_tokens = Math.max(1, Math.min(body.max_tokens, context - count));
    } catch (e) {
      console.warn("could not count the prompt's tokens", e);
    }
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
    else if (s.reasoning) patch.meta = { reasoning: s.reasoning };
    s.lastSave = performance.now();
    s.saving = (s.saving || Promise.resolve()).then(() =>
      api("PATCH", "/" + encodeURIComponent(s.convId) + "/messages/" + encodeURIComponent(s.msg.id), patch))
      .catch((e) => { console.error(e); notify("Could not save the answer: " + e.message, true); return null; });
    return s.saving;
  }

  // The meta an answer ends with: how it ended, its speed, and what it was sampled with.
  function finalMeta(s, status, error) {
    const meta = { status, model: state.model || null, finish_reason: s.finish };
    if (s.reasoning) meta.reasoning = s.reasoning;
    if (error) meta.error = error;
    if (s.sampling) meta.sampling = s.sampling;
    if (s.tFirst !== null) meta.ttft_s = (s.tFirst - s.t0) / 1000;
    if (s.usage) {
      if (isNum(s.usage.prompt_tokens)) meta.prompt_tokens = s.usage.prompt_tokens;
      if (isNum(s.usage.completion_tokens)) meta.completion_tokens = s.usage.completion_tokens;
      // decode speed: the tokens after the first over the time from the first token to the last
      const dt = (s.tLast - s.tFirst) / 1000;
      if (s.usage.completion_tokens > 1 && dt > 0) meta.tokens_per_s = (s.usage.completion_tokens - 1) / dt;
    }
    return meta;
  }

  // Answer ``userMsg``: a new assistant message under it, streamed from the server and saved as it grows.
  async function generate(userMsg) {
    if (state.stream || !userMsg) return;
    const conv = state.conv;
    const msg = await api("POST", "/" + encodeURIComponent(conv.id) + "/messages",
      { role: "assistant", content: "", parent_id: userMsg.id, meta: { status: "streaming", model: state.model } });
    const s = {
      convId: conv.id, msg, controller: new AbortController(), content: "", reasoning: "", saving: null,
      lastSave: 0, t0: performance.now(), tFirst: null, tLast: null, usage: null, finish: null, sampling: null,
      final: null, exitSaved: false,
    };
    state.stream = s;
    try { // a reload cuts this stream: the next page of this tab finds it here and marks it stopped
      sessionStorage.setItem(STREAM_STORAGE, JSON.stringify({ conv: s.convId, msg: msg.id }));
    } catch (_) { /* no storage: the save on pagehide is all there is */ }
    addLocal(msg);
    conv.active_leaf = msg.id;
    setBusy(true);
    renderMessages();
    let status = "done";
    let error = null;
    try {
      const body = await requestBody(userMsg);
      s.sampling = {};
      for (const [k, v] of Object.entries(body)) if (isNum(v)) s.sampling[k] = v;
      s.t0 = performance.now();
      const res = await authFetch("v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body), signal: s.controller.signal,
      });
      if (!res.ok) throw new Error(await errorText(res));
      await readSse(res.body, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        const choice = chunk.choices && chunk.choices[0];
        const delta = choice && isObj(choice.delta) ? choice.delta : {};
        const thought = typeof delta.reasoning_content === "string" ? delta.reasoning_content : "";
        const text = typeof delta.content === "string" ? delta.content : "";
        if (thought || text) { // reasoning tokens count for the first token and the speed too
          const now = performance.now();
          if (s.tFirst === null) s.tFirst = now;
          s.tLast = now;
          s.reasoning += thought;
          s.content += text;
          scheduleStreamRender();
          if (now - s.lastSave >= SAVE_EVERY_MS) saveStream(s);
        }
        if (choice && choice.finish_reason) s.finish = choice.finish_reason;
        if (chunk.usage) s.usage = chunk.usage;
      });
    } catch (e) {
      // a page going away aborts its fetches ("network error"): that is a stop, not a failure
      if (s.controller.signal.aborted || state.leaving) status = "stopped";
      else { status = "error"; error = e.message || String(e); }
    }
    const meta = s.final = finalMeta(s, status, error);
    let saved = null;
    if (state.leaving) saveOnExit(); // only a keepalive request outlives the page
    else {
      saved = await saveStream(s, meta);
      try { sessionStorage.removeItem(STREAM_STORAGE); } catch (_) { /* no storage */ }
    }
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

  // A page closed or reloaded mid-answer: save what came, marked stopped (a keepalive request
  // outlives the page, up to 64 KiB; past that the last save's reasoning, then text, stays and
  // only the rest goes).
  function saveOnExit() {
    state.leaving = true;
    const s = state.stream;
    if (!s || s.exitSaved) return;
    s.exitSaved = true;
    const meta = s.final || finalMeta(s, "stopped", null); // an answer that ended is saved as it ended
    const rest = Object.assign({}, meta); // too long to go: the last save's reasoning stays (meta is merged)
    delete rest.reasoning;
    const bodies = [{ content: s.content, meta }, { content: s.content, meta: rest }, { meta: rest }];
    const encoder = new TextEncoder();
    const body = bodies.map((b) => JSON.stringify(b)).find((b, k) =>
      k === bodies.length - 1 || encoder.encode(b).length <= KEEPALIVE_MAX);
    try {
      fetch("api/conversations/" + encodeURIComponent(s.convId) + "/messages/" + encodeURIComponent(s.msg.id), {
        method: "PATCH", keepalive: true, headers: authHeaders({ "Content-Type": "application/json" }), body,
      }).catch(() => {});
    } catch (_) { /* refused at once: the next load of this tab marks it (settleInterrupted) */ }
  }

  // The answer this tab was streaming when it was reloaded: marked stopped if the save on the way
  // out did not land (its text is what the last save kept).
  async function settleInterrupted() {
    let mark = null;
    try {
      mark = JSON.parse(sessionStorage.getItem(STREAM_STORAGE) || "null");
      sessionStorage.removeItem(STREAM_STORAGE);
    } catch (_) { return; }
    if (!isObj(mark) || typeof mark.conv !== "string" || typeof mark.msg !== "string") return;
    try {
      const conv = await api("GET", "/" + encodeURIComponent(mark.conv));
      const m = conv.messages.find((x) => x.id === mark.msg);
      if (m && metaOf(m).status === "streaming") {
        await api("PATCH", "/" + encodeURIComponent(mark.conv) + "/messages/" + encodeURIComponent(mark.msg),
          { meta: { status: "stopped" } });
      }
    } catch (e) {
      console.warn("could not mark the interrupted answer stopped", e); // deleted since, or offline
    }
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

  // Whether a model of v1/models takes images: "vision" among its capabilities (an object's
  // key holding something, or a list's item). Anything else, or no capabilities: text only.
  function takesImages(model) {
    const caps = isObj(model) ? model.capabilities : null;
    if (Array.isArray(caps)) return caps.includes("vision");
    return isObj(caps) && !!caps.vision;
  }

  // The served models (v1/models), the one in use and whether it takes images (asked again
  // while a server of one model loads it). A server of several shows a picker; the choice is
  // kept in localStorage, and a model chosen is loaded at once (api/settings?model= loads it).
  const loadModel = async function () {
    try {
      const res = await authFetch("v1/models", {});
      if (res.status === 503) setTimeout(loadModel, MODEL_RETRY_MS);
      if (!res.ok) return;
      const body = await res.json();
      const list = Array.isArray(body.data) ? body.data.filter((m) => isObj(m) && typeof m.id === "string") : [];
      state.models = list;
      const kept = localStorage.getItem(MODEL_KEY);
      const loaded = list.find((m) => isObj(m.status) && m.status.value === "loaded");
      const pick = list.find((m) => m.id === state.model) || list.find((m) => m.id === kept) || loaded || list[0];
      state.model = pick ? pick.id : null;
      state.vision = takesImages(pick);
      $("model-name").textContent = state.model || "";
      renderPicker();
    } catch (e) {
      console.warn("no model list", e);
    }
    renderAttach();
  };

  // The model picker: shown when the server has more than one model, each with its state.
  function renderPicker() {
    const picker = $("model-picker");
    const several = state.models.length > 1;
    picker.hidden = !several;
    $("model-name").hidden = several;
    if (!several) return;
    picker.replaceChildren(...state.models.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      const status = isObj(m.status) ? m.status.value : "";
      option.textContent = m.id + (status && status !== "loaded" ? " (" + status + ")" : "");
      option.selected = m.id === state.model;
      return option;
    }));
  }

  // The user picks a model: the next answers come from it; its defaults (and loading it) now.
  async function chooseModel(name) {
    state.model = name;
    localStorage.setItem(MODEL_KEY, name);
    state.defaults = null;
    const model = state.models.find((m) => m.id === name);
    state.vision = takesImages(model);
    renderAttach();
    try {
      await loadDefaults();
    } catch (e) {
      notify(e.message, true);
    }
    await loadModel(); // its state and capabilities, now that it is loaded
  }

  function readDataUrl(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error || new Error("could not read " + file.name));
      reader.readAsDataURL(file);
    });
  }

  const megabytes = (n) => (n / (1024 * 1024)).toFixed(1) + " MB";

  // Attach image ``files`` to the next message; those the model or the store would refuse are
  // named in a notice instead.
  async function attachImages(files) {
    if (!files.length) return;
    if (!state.vision) {
      notify((state.model || "This model") + " takes text only: it cannot read images.", true);
      return;
    }
    const refused = [];
    for (const file of files) {
      const name = file.name || "pasted image";
      if (!IMAGE_TYPES.includes(file.type)) {
        refused.push(name + " is not a PNG, JPEG, WebP, GIF or BMP image");
      } else if (file.size > MAX_IMAGE_BYTES) {
        refused.push(name + " is " + megabytes(file.size) + ": an image may be at most " +
          megabytes(MAX_IMAGE_BYTES));
      } else if (state.attachments.length >= MAX_IMAGES) {
        refused.push(name + ": a message takes at most " + MAX_IMAGES + " images");
      } else {
        try {
          const url = await readDataUrl(file);
          if (state.attachments.length < MAX_IMAGES) state.attachments.push({ url, name });
          else refused.push(name + ": a message takes at most " + MAX_IMAGES + " images");
        } catch (e) {
          refused.push(name + ": " + (e.message || String(e)));
        }
      }
    }
    renderAttachments();
    if (refused.length) notify("Not attached: " + refused.join("; ") + ".", true);
  }

  const imageFiles = (list) => Array.from(list || []).filter((f) => f.kind === undefined || f.kind === "file")
    .map((f) => (f.getAsFile ? f.getAsFile() : f)).filter((f) => f && f.type.startsWith("image/"));
  const carriesFiles = (e) => e.dataTransfer && Array.from(e.dataTransfer.types || []).includes("Files");

  // ------------------------------------------------------------------ wiring

  function wire() {
    $("new-chat").addEventListener("click", newChat);
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("prompt").value;
      const images = state.attachments;
      if ((!text.trim() && !images.length) || state.stream) return;
      $("prompt").value = "";
      state.attachments = [];
      renderAttachments();
      autoGrow();
      sendMessage(text.trim() ? text : "", undefined, images).catch((err) => {
        if (err.unsaved) { // not saved: give it back
          if (!$("prompt").value) $("prompt").value = text;
          if (!state.attachments.length) {
            state.attachments = images;
            renderAttachments();
          }
        }
        notify(err.message || String(err), true);
      });
    });
    $("attach").addEventListener("click", () => $("attach-file").click());
    $("attach-file").addEventListener("change", () => {
      const files = Array.from($("attach-file").files);
      $("attach-file").value = "";
      attachImages(files);
    });
    $("prompt").addEventListener("paste", (e) => {
      const data = e.clipboardData;
      // a copied image; text that comes with a picture of itself (an office document) pastes as text
      if (!data || Array.from(data.types || []).includes("text/plain")) return;
      const files = imageFiles(data.items && data.items.length ? data.items : data.files);
      if (!files.length) return;
      e.preventDefault();
      attachImages(files);
    });
    const composer = $("composer");
    composer.addEventListener("dragover", (e) => {
      if (!carriesFiles(e)) return;
      e.preventDefault();
      e.dataTransfer.dropEffect = state.vision ? "copy" : "none";
      composer.classList.add("dropping");
    });
    composer.addEventListener("dragleave", (e) => {
      if (!composer.contains(e.relatedTarget)) composer.classList.remove("dropping");
    });
    composer.addEventListener("drop", (e) => {
      composer.classList.remove("dropping");
      if (!carriesFiles(e)) return;
      e.preventDefault();
      attachImages(Array.from(e.dataTransfer.files)); // any other file is named as refused
    });
    // a file dropped beside the composer is not opened in place of the page
    window.addEventListener("dragover", (e) => { if (carriesFiles(e)) e.preventDefault(); });
    window.addEventListener("drop", (e) => { if (carriesFiles(e)) e.preventDefault(); });
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
    $("model-picker").addEventListener("change", (e) => chooseModel(e.target.value));
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
      if (!summary) return;
      document.body.classList.add("show-sidebar"); // on a narrow screen the title is edited in the sidebar
      startRename(li, summary);
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
    // beforeunload comes first: the fetches may be cut before pagehide
    window.addEventListener("beforeunload", () => {
      if (!state.stream) return;
      state.leaving = true;
      setTimeout(() => { state.leaving = false; }, 5000); // still here: it was no unload after all
    });
    window.addEventListener("pagehide", saveOnExit);
    window.addEventListener("pageshow", (e) => { if (e.persisted) state.leaving = false; }); // back from the cache
  }

  async function start() {
    wire();
    const m = /^#c=([^&]+)/.exec(location.hash); // the chat open before a reload
    setConversation(draft());
    renderHeader();
    renderMessages();
    renderAttach();
    await settleInterrupted();
    await refreshList();
    if (m) await openConversation(decodeURIComponent(m[1]));
    loadModel();
    loadDefaults().catch((e) => console.warn(e.message)); // asked again at the first answer
    document.body.dataset.ready = "1"; // for tests: the page has loaded what it shows
  }

  start();
})();
