// The radix tree on a canvas: layout, pan/zoom, collapse, hit testing.
// A canvas (not SVG) so 10,000+ nodes draw in milliseconds: only nodes inside the
// viewport are drawn, and edge labels only when zoomed in far enough to read them.
"use strict";

const TreeView = (() => {
  const COL = 170;      // world px between depths
  const ROW = 16;       // world px between leaves
  const LABEL_MIN_K = 0.55;  // zoom below which edge labels are not drawn

  function create(canvas, onSelect) {
    const v = { canvas, ctx: canvas.getContext("2d"), nodes: [], byId: new Map(), root: null,
      collapsed: new Set(), kx: 1, ky: 1, x: 30, y: 20, selected: null, drawn: 0, layoutMs: 0, drawMs: 0,
      count: 0, visible: 0, onSelect, fittedCount: 0 };
    attach(v);
    return v;
  }

  // tree: /inspect/state's `tree` (nodes parents first). Rebuilds the layout.
  function setTree(v, tree) {
    const t0 = performance.now();
    v.tree = tree;
    v.byId = new Map();
    v.root = { id: tree ? tree.root : 0, depth: 0, kids: [], tokens: 0, text: "", isRoot: true,
      subtree_tokens: tree ? tree.total_tokens : 0 };
    v.byId.set(v.root.id, v.root);
    v.nodes = tree ? tree.nodes.map(n => Object.assign({ kids: [] }, n)) : [];
    for (const n of v.nodes) v.byId.set(n.id, n);
    for (const n of v.nodes) {
      const p = v.byId.get(n.parent);
      if (p) p.kids.push(n);
    }
    for (const n of v.byId.values()) n.kids.sort((a, b) => b.subtree_tokens - a.subtree_tokens);
    v.count = v.nodes.length;
    layout(v);
    v.layoutMs = performance.now() - t0;
    // fit again when the tree changed size a lot (else keep the user's pan and zoom)
    if (v.count && (!v.fittedCount || v.count > 2 * v.fittedCount || 2 * v.count < v.fittedCount)) {
      fit(v); v.fittedCount = v.count;
    }
    draw(v);
  }

  // Leaves take consecutive rows; a parent sits at the middle of its children.
  function layout(v) {
    let row = 0, visible = 0;
    for (const n of v.nodes) n.shownNow = false;  // set again below for nodes no collapse hides
    const stack = [[v.root, false]];
    while (stack.length) {
      const [n, done] = stack.pop();
      const open = !v.collapsed.has(n.id) && n.kids.length;
      if (!done) {
        n.shownNow = true;
        n.hiddenNow = !!(n.hidden_children || (!open && n.kids.length));
        n.x = n.isRoot ? 0 : (n.depth) * COL;
        visible++;
        if (!open) { n.y = row++ * ROW; continue; }
        stack.push([n, true]);
        for (let i = n.kids.length - 1; i >= 0; i--) stack.push([n.kids[i], false]);
      } else {
        n.y = (n.kids[0].y + n.kids[n.kids.length - 1].y) / 2;
      }
    }
    v.rows = row;
    v.visible = visible;
  }

  function resize(v) {
    const r = v.canvas.getBoundingClientRect();
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(200, Math.round(r.width * dpr)), h = Math.max(100, Math.round(r.height * dpr));
    if (v.canvas.width !== w || v.canvas.height !== h) { v.canvas.width = w; v.canvas.height = h; }
    return dpr;
  }

  function fit(v) {
    const dpr = resize(v);
    const W = v.canvas.width / dpr, H = v.canvas.height / dpr;
    let maxDepth = 1;
    for (const n of v.nodes) if (n.depth > maxDepth) maxDepth = n.depth;
    // depth and rows are scaled apart, so a wide or a deep tree both fill the canvas
    v.kx = Math.max(0.05, Math.min(2, (W - 60) / ((maxDepth + 1) * COL)));
    v.ky = Math.max(0.002, Math.min(2, (H - 30) / Math.max(1, v.rows * ROW)));
    v.x = 30; v.y = 15;
  }

  function color(n) {
    if (n.isRoot) return "#667";
    return n.tier === "host" ? "#e69a28" : n.tier === "storage" ? "#8e5bc8" : "#3b7dd8";
  }

  // One frame: edges, then nodes with their marks and labels; only what is in view.
  function draw(v) {
    const t0 = performance.now();
    const dpr = resize(v);
    const W = v.canvas.width / dpr, H = v.canvas.height / dpr, pad = 40;
    v.ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    v.ctx.clearRect(0, 0, W, H);
    const f = { sx: x => x * v.kx + v.x, sy: y => y * v.ky + v.y, H, k: Math.min(v.kx, v.ky),
      inView: (x, y) => x > -pad && x < W + pad && y > -pad && y < H + pad, labels: v.ky >= LABEL_MIN_K };
    const shown = [v.root, ...v.nodes.filter(n => isVisible(v, n))];
    drawEdges(v, f, shown);
    v.ctx.font = "11px ui-monospace, monospace"; v.ctx.textBaseline = "bottom";
    let drawn = 0;
    for (const n of shown) {
      if (f.inView(f.sx(n.x), f.sy(n.y))) { drawNode(v, f, n); drawn++; }
    }
    v.drawn = drawn;
    v.drawMs = performance.now() - t0;
  }

  function drawEdges(v, f, shown) {
    const ctx = v.ctx;
    ctx.strokeStyle = "#b8c2cc"; ctx.lineWidth = 1; ctx.beginPath();
    for (const n of shown) {
      if (n.isRoot) continue;
      const p = v.byId.get(n.parent);
      const x1 = f.sx(p.x), y1 = f.sy(p.y), x2 = f.sx(n.x), y2 = f.sy(n.y);
      if (!f.inView(x1, y1) && !f.inView(x2, y2) && !crosses(y1, y2, f.H)) continue;
      ctx.moveTo(x1, y1); ctx.lineTo(x1 + (x2 - x1) * 0.3, y2); ctx.lineTo(x2, y2);
    }
    ctx.stroke();
  }

  // A dot sized by log(tokens), coloured by tier; rings: locked (dark), next to evict (red,
  // with its rank), selected (black); a grey dot when children are not drawn.
  function drawNode(v, f, n) {
    const ctx = v.ctx, x = f.sx(n.x), y = f.sy(n.y);
    const r = Math.max(2, Math.min(7, 2 + Math.log2(1 + (n.tokens || 0)) * 0.6)) * Math.min(1.5, Math.max(f.k, 0.5));
    const ring = (radius, width, style) => {
      ctx.beginPath(); ctx.arc(x, y, radius, 0, 2 * Math.PI); ctx.lineWidth = width; ctx.strokeStyle = style;
      ctx.stroke();
    };
    ctx.beginPath(); ctx.arc(x, y, r, 0, 2 * Math.PI); ctx.fillStyle = color(n); ctx.fill();
    if (n.lock_ref > 0) ring(r, 2, "#1f2d3d");
    if (n.evict_rank !== null && n.evict_rank !== undefined) {
      ring(r + 3, 2, "#d83b3b");
      if (f.labels) { ctx.fillStyle = "#d83b3b"; ctx.fillText("#" + (n.evict_rank + 1), x + r + 4, y + 12); }
    }
    if (n.hiddenNow) { ctx.fillStyle = "#999"; ctx.beginPath(); ctx.arc(x + r + 5, y, 2.5, 0, 2 * Math.PI); ctx.fill(); }
    if (n.id === v.selected) ring(r + 6, 1.5, "#111");
    if (f.labels && !n.isRoot) {
      const px = f.sx(v.byId.get(n.parent).x), tx = px + (x - px) * 0.32 + 3;
      ctx.fillStyle = "#334";
      ctx.fillText(clip(n.text, Math.max(4, Math.floor((x - tx) / 6.6))), tx, y - 2);
    }
  }

  function crosses(y1, y2, H) { return (y1 < 0 && y2 > H) || (y2 < 0 && y1 > H); }

  function clip(text, n) {
    const t = JSON.stringify(text || "").slice(1, -1);
    return t.length > n ? t.slice(0, Math.max(1, n - 1)) + "…" : t;
  }

  function isVisible(v, n) {  // no collapsed ancestor (hidden nodes keep stale coordinates)
    return n.shownNow !== false;
  }

  function nodeAt(v, px, py) {
    let best = null, bestD = 100;  // within 10 screen px
    for (const n of [v.root, ...v.nodes]) {
      const d = (n.x * v.kx + v.x - px) ** 2 + (n.y * v.ky + v.y - py) ** 2;
      if (d < bestD && isVisible(v, n)) { best = n; bestD = d; }
    }
    return best;
  }

  function toggle(v, n) {
    if (!n || !n.kids.length) return;
    if (v.collapsed.has(n.id)) v.collapsed.delete(n.id); else v.collapsed.add(n.id);
    layout(v); draw(v);
  }

  function collapseBelow(v, depth) {
    v.collapsed = new Set(v.nodes.filter(n => n.depth >= depth && n.kids.length).map(n => n.id));
    layout(v); fit(v); draw(v);
  }

  function expandAll(v) { v.collapsed = new Set(); layout(v); fit(v); draw(v); }

  function attach(v) {
    const c = v.canvas;
    let drag = null, moved = false;
    c.addEventListener("mousedown", e => { drag = [e.offsetX, e.offsetY, v.x, v.y]; moved = false; });
    window.addEventListener("mouseup", () => { drag = null; });
    c.addEventListener("mousemove", e => {
      if (!drag) return;
      if (Math.abs(e.offsetX - drag[0]) + Math.abs(e.offsetY - drag[1]) > 3) moved = true;
      v.x = drag[2] + e.offsetX - drag[0]; v.y = drag[3] + e.offsetY - drag[1]; draw(v);
    });
    c.addEventListener("click", e => {
      if (moved) return;
      const n = nodeAt(v, e.offsetX, e.offsetY);
      v.selected = n ? n.id : null; draw(v); v.onSelect(n);
    });
    c.addEventListener("dblclick", e => toggle(v, nodeAt(v, e.offsetX, e.offsetY)));
    c.addEventListener("wheel", e => {
      e.preventDefault();
      const f = Math.exp(-e.deltaY * 0.0015);
      const kx = Math.min(8, Math.max(0.01, v.kx * f)), ky = Math.min(8, Math.max(0.001, v.ky * f));
      v.x = e.offsetX - (e.offsetX - v.x) * (kx / v.kx); v.y = e.offsetY - (e.offsetY - v.y) * (ky / v.ky);
      v.kx = kx; v.ky = ky; draw(v);
    }, { passive: false });
  }

  return { create, setTree, draw, fit, toggle, collapseBelow, expandAll, nodeAt };
})();
