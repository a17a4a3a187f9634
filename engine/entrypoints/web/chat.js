// The chat view: the conversation list, the messages (Markdown through markdown.js, thinking
// folded in a <details>, tool calls as they arrive) and a request streamed from POST
// /v1/chat/completions, which Stop aborts (the server aborts the request when its client goes).
"use strict";
const Chat = (() => {
  const $ = (id) => document.getElementById(id);
  let running = null;  // {controller, message} of the answer being streamed
  const shown = new WeakMap();  // message -> its <li> (not stored with the conversation)

  function node(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // ---- drawing ----
  function drawConversations() {
    const list = $("convs"), cur = ChatStore.current();
    list.textContent = "";
    for (const c of ChatStore.all()) {
      const li = node("li"), open = node("button", "conv", c.title), del = node("button", "del", "×");
      open.type = del.type = "button";
      if (c.id === cur.id) open.setAttribute("aria-current", "true");
      open.addEventListener("click", () => { ChatStore.setCurrent(c.id); draw(); });
      del.setAttribute("aria-label", `Delete conversation: ${c.title}`);
      del.addEventListener("click", () => { ChatStore.remove(c.id); draw(); });
      li.append(open, del);
      list.appendChild(li);
    }
  }
  function toolCalls(m) {
    const box = node("div", "tools");
    for (const t of m.tools || []) {
      const call = node("div", "toolcall");
      call.append(node("span", "muted", "tool call "), node("code", "", t.name || ""));
      call.appendChild(node("pre", "", t.arguments || ""));
      box.appendChild(call);
    }
    return box;
  }
  function fillMessage(li, m) {
    li.textContent = "";
    li.appendChild(node("div", "role", m.role === "user" ? "You" : m.model || "Assistant"));
    if (m.reasoning) {
      const d = node("details", "thinking"), s = node("summary", "", "Thinking");
      d.appendChild(s); d.appendChild(node("div", "thought", m.reasoning));
      li.appendChild(d);
    }
    const body = node("div", "content");
    body.appendChild(m.role === "user" ? node("p", "plain", m.content) : Markdown.render(m.content || ""));
    li.appendChild(body);
    if (m.tools && m.tools.length) li.appendChild(toolCalls(m));
    const foot = node("div", "foot muted");
    if (m.stopped) foot.appendChild(node("span", "stopped", "stopped "));
    if (m.error) foot.appendChild(node("span", "error", m.error));
    if (m.id) {
      const show = node("button", "show", "Show its blocks");
      show.type = "button";
      show.dataset.request = m.id;
      show.addEventListener("click", () => App.showRequest(m.id));
      foot.appendChild(show);
    }
    li.appendChild(foot);
  }
  function refill(m) { const li = shown.get(m); if (li && li.isConnected) fillMessage(li, m); }
  function drawMessages() {
    const list = $("messages");
    list.textContent = "";
    for (const m of ChatStore.current().messages) {
      const li = node("li", `msg ${m.role}`);
      fillMessage(li, m);
      list.appendChild(li);
      shown.set(m, li);
    }
    list.scrollTop = list.scrollHeight;
  }
  function draw() { drawConversations(); drawMessages(); }

  // ---- a request ----
  function settings() {
    const num = (id) => { const v = $(id).value.trim(); return v === "" ? null : Number(v); };
    const body = { model: $("model").value, stream: true, temperature: num("temperature"),
      top_p: num("top_p"), max_tokens: num("max_tokens") };
    const seed = num("seed"), tools = $("tools").value.trim();
    if (seed !== null) body.seed = seed;
    if (tools) {
      try { body.tools = JSON.parse(tools); } catch (e) { throw new Error(`Tools: not JSON (${e.message})`); }
    }
    return body;
  }
  function history(conv) {
    const system = $("system").value.trim(), out = system ? [{ role: "system", content: system }] : [];
    for (const m of conv.messages) if (m.content || m.role === "user") out.push({ role: m.role, content: m.content || "" });
    return out;
  }
  function apply(m, delta) {
    if (delta.content) m.content += delta.content;
    if (delta.reasoning_content) m.reasoning = (m.reasoning || "") + delta.reasoning_content;
    for (const t of delta.tool_calls || []) {
      m.tools = m.tools || [];
      const at = t.index || 0, fn = t.function || {};
      m.tools[at] = m.tools[at] || { name: "", arguments: "" };
      if (fn.name) m.tools[at].name += fn.name;
      if (fn.arguments) m.tools[at].arguments += fn.arguments;
    }
  }
  async function stream(body, m, signal) {
    const r = await Api.request("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
    });
    let pending = false;
    const redraw = () => { pending = false; refill(m); };
    await Api.readEvents(r, (_name, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) { m.error = chunk.error.message; return; }
      if (chunk.id && !m.id) { m.id = chunk.id; App.watchRequest(m.id); }
      for (const c of chunk.choices || []) apply(m, c.delta || {});
      if (!pending) { pending = true; requestAnimationFrame(redraw); }
    });
  }
  function setBusy(busy, text) {
    $("send").disabled = busy; $("stop").disabled = !busy;
    $("status").textContent = text;
  }
  async function send(text) {
    let body;
    try { body = settings(); } catch (e) { $("status").textContent = e.message; return; }
    const conv = ChatStore.current();
    conv.messages.push({ role: "user", content: text });
    if (conv.title === "New conversation") conv.title = text.slice(0, 40);
    body.messages = history(conv);
    const m = { role: "assistant", content: "", model: body.model };
    conv.messages.push(m);
    draw();
    running = { controller: new AbortController(), message: m };
    setBusy(true, "answering…");
    try {
      await stream(body, m, running.controller.signal);
      setBusy(false, "");
    } catch (e) {
      if (e.name === "AbortError") { m.stopped = true; setBusy(false, "stopped"); }
      else { m.error = e.message; setBusy(false, ""); if (e instanceof Api.AuthError) App.askKey(e.message); }
    }
    running = null;
    refill(m);
    ChatStore.save();
  }
  function stop() { if (running) running.controller.abort(); }

  function init() {
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("prompt").value.trim();
      if (!text || running) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop").addEventListener("click", stop);
    $("newchat").addEventListener("click", () => { ChatStore.create(); draw(); $("prompt").focus(); });
    draw();
  }
  return { init, draw };
})();
