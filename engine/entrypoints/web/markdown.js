// A small Markdown renderer that builds DOM nodes: model output never becomes HTML. Text goes in
// through textContent only; links are not made (a model's URL stays text). It knows fenced code
// blocks, headings, bullet and numbered lists, block quotes, paragraphs, and inline `code`,
// **bold** and *italic*.
"use strict";
const Markdown = (() => {
  function el(tag, text) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  // inline: `code`, **bold**, *italic*, the rest plain text
  function inline(parent, text) {
    const re = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\s][^*\n]*\*)/g;
    let at = 0, m;
    while ((m = re.exec(text)) !== null) {
      if (m.index > at) parent.appendChild(document.createTextNode(text.slice(at, m.index)));
      const t = m[0];
      if (t[0] === "`") parent.appendChild(el("code", t.slice(1, -1)));
      else if (t.startsWith("**")) parent.appendChild(el("strong", t.slice(2, -2)));
      else parent.appendChild(el("em", t.slice(1, -1)));
      at = m.index + t.length;
    }
    if (at < text.length) parent.appendChild(document.createTextNode(text.slice(at)));
    return parent;
  }
  const LIST = /^\s*([-*+]|\d+[.)])\s+/;
  // the block that starts at lines[i]: [node, next i]
  function block(lines, i) {
    const line = lines[i];
    const fence = line.match(/^\s*(```|~~~)\s*([\w+-]*)/);
    if (fence) {
      const body = [];
      let j = i + 1;
      while (j < lines.length && !lines[j].trim().startsWith(fence[1])) body.push(lines[j++]);
      const pre = el("pre"), code = el("code", body.join("\n"));
      if (fence[2]) code.dataset.lang = fence[2];
      pre.appendChild(code);
      return [pre, j + 1];
    }
    const head = line.match(/^(#{1,6})\s+(.*)$/);
    if (head) return [inline(el(`h${Math.min(head[1].length + 2, 6)}`), head[2]), i + 1];
    if (LIST.test(line)) {
      const ordered = /^\s*\d/.test(line), list = el(ordered ? "ol" : "ul");
      let j = i;
      while (j < lines.length && LIST.test(lines[j])) list.appendChild(inline(el("li"), lines[j++].replace(LIST, "")));
      return [list, j];
    }
    if (line.startsWith(">")) {
      const quote = el("blockquote"), body = [];
      let j = i;
      while (j < lines.length && lines[j].startsWith(">")) body.push(lines[j++].replace(/^>\s?/, ""));
      inline(quote, body.join("\n"));
      return [quote, j];
    }
    const para = [];
    let j = i;
    while (j < lines.length && lines[j].trim() && !/^(\s*(```|~~~)|#{1,6}\s|>)/.test(lines[j]) && !LIST.test(lines[j])) para.push(lines[j++]);
    if (j === i) para.push(lines[j++]);  // never stand still
    return [inline(el("p"), para.join("\n")), j];
  }
  // text -> a fragment of DOM nodes
  function render(text) {
    const out = document.createDocumentFragment(), lines = text.split("\n");
    let i = 0;
    while (i < lines.length) {
      if (!lines[i].trim()) { i++; continue; }
      const [node, next] = block(lines, i);
      out.appendChild(node);
      i = next;
    }
    return out;
  }
  return { render };
})();
