// The conversations, kept in this browser's localStorage: [{id, title, messages}], each message
// {role, content, reasoning, tools: [{name, arguments}], id (the completion's), stopped, error}.
"use strict";
const ChatStore = (() => {
  const KEY = "pagedllm.conversations", CURRENT = "pagedllm.current";
  let convs = [];
  try { convs = JSON.parse(localStorage.getItem(KEY) || "[]"); } catch (e) { convs = []; }
  if (!Array.isArray(convs)) convs = [];

  function save() {
    try { localStorage.setItem(KEY, JSON.stringify(convs)); } catch (e) { /* full: kept in memory */ }
  }
  function create() {
    const conv = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`,
      title: "New conversation", messages: [] };
    convs.unshift(conv); save(); setCurrent(conv.id);
    return conv;
  }
  function current() {
    const id = localStorage.getItem(CURRENT);
    return convs.find((c) => c.id === id) || convs[0] || create();
  }
  function setCurrent(id) { localStorage.setItem(CURRENT, id); }
  function remove(id) {
    convs = convs.filter((c) => c.id !== id); save();
  }
  function all() { return convs; }
  return { all, create, current, setCurrent, remove, save };
})();
