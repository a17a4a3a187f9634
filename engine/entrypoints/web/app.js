// The page's start: the server's settings (/web/config.json: is there an API key, is there a
// live view), the key prompt, the served models (GET /v1/models, adapters included) and the two
// views' tabs (arrow keys move between them).
"use strict";
const App = (() => {
  const $ = (id) => document.getElementById(id);
  let config = { auth: false, live: false };

  function askKey(why) {
    $("keyform").hidden = false;
    $("keyerror").textContent = why || "";
    $("keyinput").focus();
  }
  async function loadModels() {
    const select = $("model"), keep = select.value || localStorage.getItem("pagedllm.model");
    const body = await Api.json("/v1/models");
    select.textContent = "";
    for (const m of body.data) {
      const o = document.createElement("option");
      o.value = o.textContent = m.id;
      if (m.parent) o.textContent = `${m.id} (adapter of ${m.parent})`;
      select.appendChild(o);
    }
    if (keep && body.data.some((m) => m.id === keep)) select.value = keep;
  }
  async function connect() {
    try {
      await loadModels();
      $("keyform").hidden = true;
    } catch (e) {
      if (e instanceof Api.AuthError) askKey(Api.key() ? e.message : "");
      else $("status").textContent = `Could not list the models: ${e.message}`;
    }
  }
  function showTab(name) {
    for (const t of ["chat", "live"]) {
      const on = t === name, tab = $(`tab-${t}`);
      tab.setAttribute("aria-selected", on); tab.tabIndex = on ? 0 : -1;
      $(`view-${t}`).hidden = !on;
    }
    document.body.dataset.view = name;
    if (name === "live") Live.start(); else Live.stop();
  }
  function showRequest(chatId) {
    showTab("live");
    $("tab-live").focus();
    Live.select(chatId.replace(/^chatcmpl-/, ""));
  }
  function watchRequest(chatId) { Live.select(chatId.replace(/^chatcmpl-/, "")); }
  function initTabs() {
    const tabs = ["chat", "live"];
    tabs.forEach((t, i) => {
      const tab = $(`tab-${t}`);
      tab.addEventListener("click", () => showTab(t));
      tab.addEventListener("keydown", (e) => {
        const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
        if (!step) return;
        const next = tabs[(i + step + tabs.length) % tabs.length];
        showTab(next); $(`tab-${next}`).focus();
      });
    });
    showTab("chat");
  }
  function initKey() {
    $("keyform").addEventListener("submit", (e) => {
      e.preventDefault();
      Api.setKey($("keyinput").value, $("keyremember").checked);
      $("keyinput").value = "";
      connect();
    });
  }
  async function init() {
    try { config = await (await fetch("/web/config.json")).json(); } catch (e) { /* defaults */ }
    Api.setNeedsKey(config.auth);
    $("who").textContent = config.auth ? "This server needs an API key." :
      "Single-user server: no API key, anyone who can reach it can use it.";
    initKey(); initTabs(); Chat.init();
    if (config.auth && !Api.key()) askKey("");
    else connect();
    $("model").addEventListener("change", () => localStorage.setItem("pagedllm.model", $("model").value));
  }
  document.addEventListener("DOMContentLoaded", init);
  return { askKey, showRequest, watchRequest };
})();
