// The live view: GET /v1/engine/events (engine/entrypoints/live_events.py) drawn as it comes,
// the block pool with pool_view.js (the drawing the run replay shares), the queues, the last
// steps' batches, the selected request's page table and (a mixture of experts) the router's
// choices since the last frame. Frames hold ids and counts only.
"use strict";
const Live = (() => {
  const $ = (id) => document.getElementById(id);
  let meta = null, frame = null, controller = null, selected = null;  // selected: a request id
  const order = {};  // request id -> the order it was first seen in (its colour)
  const recent = [];  // the last steps' summaries, newest last
  let specLast = null;

  function short(req) { return req.length > 10 ? req.slice(0, 8) + "…" : req; }
  function seqs() { return frame ? frame.seqs : []; }
  function bySid() { const m = {}; for (const s of seqs()) m[s[0]] = s; return m; }
  function colourOf(req) {
    if (!(req in order)) order[req] = Object.keys(order).length;
    return PoolView.colour(order[req]);
  }
  function node(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // ---- drawing ----
  function drawPool() {
    const sid = bySid(), tabs = {}, cpus = {};
    for (const s of seqs()) {  // every KV group's blocks of a sequence
      tabs[s[0]] = s[5].concat(...(s[7] || []));
      cpus[s[0]] = s[6].concat(...(s[8] || []));
    }
    const how = { colour: (i) => colourOf(sid[i][1]), label: (i) => `${sid[i][1]} (seq ${i})`,
      selected: (i) => sid[i][1] === selected, cached: new Set(frame.cfree || []) };
    PoolView.paintGrid($("live-pool"), PoolView.owners(tabs, meta.num_blocks), how);
    if (meta.num_cpu_blocks) PoolView.paintGrid($("live-cpupool"), PoolView.owners(cpus, meta.num_cpu_blocks), how);
  }
  function chip(s) {
    const b = node("button", "chip", `${short(s[1])} · seq ${s[0]}`);
    b.type = "button"; b.dataset.request = s[1]; b.style.borderColor = colourOf(s[1]);
    b.title = `${s[1]}: ${s[3]} prompt tokens, ${s[4]} output tokens, ${s[5].length} blocks`;
    if (s[1] === selected) b.classList.add("sel");
    b.addEventListener("click", () => select(s[1]));
    return b;
  }
  function drawQueues() {
    const el = $("live-queues"), sid = bySid();
    el.textContent = "";
    for (const name of ["running", "waiting", "swapped"]) {
      const row = node("div", "queue");
      row.appendChild(node("span", "qname", `${name} (${frame[name].length})`));
      for (const i of frame[name]) if (sid[i]) row.appendChild(chip(sid[i]));
      el.appendChild(row);
    }
    const used = meta.num_blocks - frame.free;
    el.appendChild(node("div", "muted", `${used} of ${meta.num_blocks} blocks in use, ${frame.free} free` +
      (frame.cfree ? ` (${frame.cfree.length} of them hold a cached prefix)` : "")));
  }
  function stepLine(s) {
    const kinds = { d: [], p: [], s: [] };
    for (const [i, n, k] of s.run) kinds[k].push([i, n]);
    const parts = [`step ${s.n}: ${kinds.d.length} decode tokens`];
    if (kinds.p.length) parts.push("prefill chunks " + kinds.p.map(([i, n]) => `${n} (seq ${i})`).join(", "));
    if (kinds.s.length) parts.push(`${kinds.s.length} speculated`);
    if (s.pre) parts.push("preempted " + s.pre.map(([i, m]) => `seq ${i} (${m === "s" ? "swap" : "recompute"})`).join(", "));
    if (s.hit) parts.push("prefix hits " + s.hit.map(([i, n]) => `seq ${i}: ${n} blocks`).join(", "));
    if (s.spec) parts.push("drafts " + s.spec.map(([i, n]) => `seq ${i}: ${n}`).join(", "));
    return parts.join("; ");
  }
  function drawSteps() {
    const el = $("live-steps");
    el.textContent = "";
    const list = node("ol", "steps");
    for (const s of recent.slice(-8).reverse()) list.appendChild(node("li", "", stepLine(s)));
    el.appendChild(list);
    const notes = [];
    if (frame.dropped) notes.push(`${frame.dropped} frames dropped (the page read slower than the engine stepped)`);
    if (frame.spec) {
      if (specLast) notes.push(`speculation: ${frame.spec[1] - specLast[1]} of ${frame.spec[0] - specLast[0]} draft tokens accepted since the last frame`);
      specLast = frame.spec;
    }
    for (const n of notes) el.appendChild(node("div", "muted", n));
  }
  function drawRequest() {
    const s = seqs().find((x) => x[1] === selected);
    $("live-req").textContent = selected === null ? "(none selected)" : selected;
    const info = $("live-reqinfo");
    if (!s) {
      info.textContent = selected === null ? "Choose a request in the queues, a block, or “Show its blocks” under an answer."
        : "not in the engine now (finished, or not yet seen): it holds no blocks";
      PoolView.pageTable($("live-pagetable"), [], [], meta ? meta.block_size : 1);
      return;
    }
    const state = { W: "waiting", R: "running", S: "swapped", F: "finished" }[s[2]];
    info.textContent = `seq ${s[0]}, ${state}: ${s[3]} prompt tokens, ${s[4]} output tokens, ${s[5].length} blocks`;
    const groups = meta.kv_groups ? meta.kv_groups.map((w, g) =>
      [w ? `sliding ${w}` : "full", g ? (s[7] || [])[g - 1] || [] : s[5]]) : null;
    PoolView.pageTable($("live-pagetable"), s[5], s[6], meta.block_size, groups);
  }
  let expertsLast = null;  // the router's counts at the frame before
  function drawExperts() {
    if (!frame.experts) return;
    const before = {};
    for (const [layer, ...n] of expertsLast || []) before[layer] = n;
    const since = frame.experts.map(([layer, ...n]) => [layer, ...n.map((v, e) => v - ((before[layer] || [])[e] || 0))]);
    PoolView.router($("live-experts"), since, frame.experts);
    expertsLast = frame.experts;
  }
  function draw() {
    if (!meta || !frame) return;
    drawPool(); drawQueues(); drawSteps(); drawRequest(); drawExperts();
    document.body.dataset.liveStep = frame.step;
  }

  // ---- the stream ----
  function hello(m) {
    if (!m.available) { $("live-status").textContent = `No live view: ${m.why}.`; return; }
    meta = m;
    $("live-count").textContent = m.num_blocks;
    $("live-status").textContent = `${m.model} on ${m.backend}: ${m.num_blocks} blocks of ${m.block_size} tokens, ` +
      `max ${m.max_num_seqs} sequences and ${m.max_num_batched_tokens} tokens a step` +
      (m.speculative ? `, speculative decoding (${m.speculative.method})` : "") +
      (m.experts ? `, ${m.experts.num} experts (top ${m.experts.top_k}) per sparse layer` : "") + ". Waiting for the engine to step…";
    const pick = (own) => select(bySid()[own[0]][1]);
    PoolView.makeGrid($("live-pool"), m.num_blocks, "GPU", pick);
    $("live-cpuwrap").hidden = !m.num_cpu_blocks;
    $("live-routerwrap").hidden = !m.experts;
    if (m.num_cpu_blocks) PoolView.makeGrid($("live-cpupool"), m.num_cpu_blocks, "CPU", pick);
  }
  function onFrame(f) {
    frame = f;
    recent.push(...f.steps);
    recent.splice(0, Math.max(0, recent.length - 64));
    $("live-status").textContent = `live: step ${f.step}, ${(f.t / 1000).toFixed(1)} s`;
    draw();
  }
  async function start() {
    if (controller) return;
    const mine = controller = new AbortController();
    try {
      const r = await Api.request("/v1/engine/events", { signal: mine.signal });
      await Api.readEvents(r, (name, data) => (name === "hello" ? hello : onFrame)(JSON.parse(data)));
    } catch (e) {
      if (e.name !== "AbortError") $("live-status").textContent = `The live view stopped: ${e.message}`;
      if (e instanceof Api.AuthError) App.askKey(e.message);
    }
    if (controller === mine) controller = null;
  }
  function stop() { if (controller) { controller.abort(); controller = null; } }
  function select(req) { selected = req; draw(); if (!frame) drawRequest(); }
  return { start, stop, select };
})();
