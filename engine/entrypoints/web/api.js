// The page's side of this server's API: the API key (asked once, kept in localStorage when
// "remember" is ticked, else sessionStorage), fetch with it, and server-sent events read from a
// fetch's ReadableStream (EventSource cannot send a key).
"use strict";
const Api = (() => {
  const KEY = "pagedllm.apiKey";
  let needsKey = false;

  function key() { return localStorage.getItem(KEY) || sessionStorage.getItem(KEY) || ""; }
  function setKey(value, remember) {
    localStorage.removeItem(KEY); sessionStorage.removeItem(KEY);
    (remember ? localStorage : sessionStorage).setItem(KEY, value);
  }
  function forgetKey() { localStorage.removeItem(KEY); sessionStorage.removeItem(KEY); }

  class AuthError extends Error {}

  async function request(path, options) {
    const headers = Object.assign({}, (options && options.headers) || {});
    if (needsKey && key()) headers.Authorization = `Bearer ${key()}`;
    const r = await fetch(path, Object.assign({}, options, { headers }));
    if (r.status === 401) throw new AuthError("the API key was refused");
    if (!r.ok) {
      let message = `${r.status} ${r.statusText}`;
      try { message = (await r.json()).error.message || message; } catch (e) { /* not JSON */ }
      throw new Error(message);
    }
    return r;
  }
  async function json(path) { return (await request(path)).json(); }

  // Calls onEvent(name, data) per server-sent event of a response body until it ends; "data:"
  // lines joined, "[DONE]" passed as is.
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        let name = "message"; const data = [];
        for (const line of block.split(/\r?\n/)) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) onEvent(name, data.join("\n"));
      }
    }
  }

  return {
    key, setKey, forgetKey, request, json, readEvents, AuthError,
    setNeedsKey: (yes) => { needsKey = yes; },
    needsKey: () => needsKey,
  };
})();
