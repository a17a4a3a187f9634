// The KV block pool, a sequence's page table and a mixture's router, drawn as DOM nodes: shared
// by the run replay
// (engine/frontend/replay.html, which recorder.py fills with this file's text) and the server's
// live view (engine/entrypoints/web/live.js, which loads it from /web/pool_view.js).
// Text goes in with textContent only; no innerHTML.
"use strict";
const PoolView = (() => {
  // one hue per request, by the order requests were seen (golden angle: neighbours differ)
  function colour(order, light) {
    return `hsl(${((order * 137.508) % 360).toFixed(1)}, 62%, ${light || 62}%)`;
  }
  // per block, the sequences (keys of tables) whose table holds it
  function owners(tables, n) {
    const own = Array.from({ length: n }, () => []);
    for (const i in tables) for (const b of tables[i]) if (b >= 0 && b < n) own[b].push(+i);
    return own;
  }
  // n cells; pick(owner list) when one that is held is clicked (or Enter on it)
  function makeGrid(el, n, kind, pick) {
    const size = n <= 64 ? 34 : n <= 256 ? 24 : n <= 1024 ? 18 : 10;  // cells fill the panel
    el.textContent = "";
    el.style.gridTemplateColumns = `repeat(auto-fill, minmax(${size}px, 1fr))`;
    for (let b = 0; b < n; b++) {
      const d = document.createElement("div");
      d.className = "block"; d.style.height = d.style.lineHeight = `${size}px`;
      d.dataset.block = b; d.dataset.owner = ""; d.textContent = b; d.title = `${kind} block ${b}`;
      d.addEventListener("click", () => { const o = d.dataset.owner; if (o) pick(o.split(",").map(Number)); });
      el.appendChild(d);
    }
  }
  // own: per block its owners; how: {colour(i), label(i), selected(i), cached: Set of free
  // blocks that still hold a cached prefix}
  function paintGrid(el, own, how) {
    el.childNodes.forEach((d, b) => {
      const o = own[b], cached = !o.length && how.cached && how.cached.has(b);
      d.dataset.owner = o.join(",");
      d.classList.toggle("shared", o.length > 1);
      d.classList.toggle("cachedfree", !!cached);
      d.classList.toggle("sel", o.some((i) => how.selected(i)));
      d.style.backgroundColor = o.length ? how.colour(o[0]) : "";
      d.title = o.length ? `block ${b}: ` + o.map(how.label).join(", ")
        : cached ? `block ${b}: free, holds a cached prefix` : `block ${b}: free`;
    });
  }
  function cell(tr, tag, text) {
    const c = document.createElement(tag); c.textContent = text; tr.appendChild(c);
  }
  // logical block -> physical block, with the tokens each covers; groups (optional, KV groups):
  // [name, table] per group, a physical column each ("—" where a sliding group gave it back)
  function pageTable(el, table, cpu, bs, groups) {
    el.textContent = "";
    const t = document.createElement("table"), head = document.createElement("tr");
    const cols = groups && groups.length > 1 ? groups : null;
    ["logical", ...(cols ? cols.map(([name]) => name) : ["physical"]), "tokens"]
      .forEach((h) => cell(head, "th", h));
    t.appendChild(head);
    const row = (lb, phys) => {
      const tr = document.createElement("tr");
      cell(tr, "td", lb);
      phys.forEach((p) => cell(tr, "td", p === undefined || p < 0 ? "—" : p));
      cell(tr, "td", `${lb * bs}–${lb * bs + bs - 1}`);
      t.appendChild(tr);
    };
    table.forEach((b, lb) => row(lb, cols ? cols.map(([, tab]) => tab[lb]) : [b]));
    (cpu || []).forEach((b, lb) => row(lb, [`cpu ${b}`]));
    el.appendChild(t);
    if (!table.length && !(cpu || []).length) {
      const none = document.createElement("div"); none.className = "muted"; none.textContent = "no blocks";
      el.appendChild(none);
    }
  }
  // a mixture of experts' router: rows [layer, rows sent to each expert] (this step's, or since
  // the last frame), a row of cells per layer, each shaded by its count against the largest;
  // totals (optional): the same shape, counted since the start, for the cells' titles
  function router(el, rows, totals) {
    el.textContent = "";
    el.className = "experts";
    const most = Math.max(1, ...rows.flatMap(([, ...n]) => n));
    rows.forEach(([layer, ...n], r) => {
      const row = document.createElement("div"), name = document.createElement("span");
      row.className = "row"; name.className = "layer"; name.textContent = `layer ${layer}`;
      row.appendChild(name);
      n.forEach((d, e) => {
        const c = document.createElement("span");
        c.className = "cell"; c.style.opacity = (0.06 + 0.94 * d / most).toFixed(3);
        c.title = `layer ${layer}, expert ${e}: ${d} rows` + (totals ? `, ${totals[r][e + 1]} in all` : "");
        row.appendChild(c);
      });
      el.appendChild(row);
    });
  }
  return { colour, owners, makeGrid, paintGrid, pageTable, router };
})();
