// The Inspector page: polls /inspect/state about once a second and draws every panel.
// Plain DOM + canvas, nothing fetched but /inspect/state. `window.inspector` exposes
// render(snapshot) -> milliseconds, stop()/start() and the page state (for tests).
"use strict";

(() => {
  const POLL_MS = 1000;
  const HISTORY = 300;      // pool samples kept for the occupancy chart (one per poll)
  const MAX_ROWS = 300;     // table rows drawn at most
  // The tree walk is O(tree nodes) on the scheduler thread: ask for it only so often that
  // it takes at most TREE_BUDGET of the scheduler's time (every poll while it is cheap).
  const TREE_BUDGET = 0.05;
  const OWNERS = ["request_held", "step_allocated", "tree_locked", "tree_evictable", "free"];
  const OWNER_COLORS = { free: "#d9e2ec", tree_evictable: "#8fb8ea", tree_locked: "#2f5f9e",
    request_held: "#4caf7a", step_allocated: "#b58be0" };
  const $ = id => document.getElementById(id);

  const st = { snap: null, history: [], key: sessionStorage.getItem("lmprog-inspect-key") || "",
    timer: null, paused: false, nextTreeAt: 0, treeSnap: null, polls: 0, errors: 0, lastRenderMs: 0, renders: 0,
    seen: { maxBatchRows: 0, maxQueueRows: 0, treeCounts: [], poolUsed: [] }, lastError: null };
  const tree = TreeView.create($("tree-canvas"), showNode);

  async function poll() {
    if (st.paused) return;
    const max = Math.max(1, Math.min(20000, parseInt($("max-nodes").value, 10) || 2000));
    const headers = st.key ? { Authorization: "Bearer " + st.key } : {};
    try {
      const wantTree = performance.now() >= st.nextTreeAt ? 1 : 0;
      const rank = new URLSearchParams(location.search).get("dp_rank");  // /inspect?dp_rank=1
      const r = await fetch(`/inspect/state?max_nodes=${max}&tree=${wantTree}` + (rank ? `&dp_rank=${rank}` : ""),
                            { headers, cache: "no-store" });
      if (r.status === 401) { $("key-form").hidden = false; status("API key needed", true); return; }
      const body = await r.json();
      if (!r.ok) throw new Error((body.error && body.error.message) || r.statusText);
      st.polls++;
      if (body.tree_s !== null) st.nextTreeAt = performance.now() + body.tree_s * 1000 / TREE_BUDGET - POLL_MS;
      render(body);
    } catch (e) {
      st.errors++; st.lastError = String(e);
      status("error: " + e, true);
    } finally {
      schedule();
    }
  }

  function schedule() {
    clearTimeout(st.timer);
    if (!st.paused) st.timer = setTimeout(poll, POLL_MS);
  }

  function status(text, bad) { $("status").textContent = text; $("status").style.color = bad ? "#f99" : ""; }

  // Draw `snap` (an /inspect/state answer) everywhere; returns the milliseconds it took.
  function render(snap) {
    const t0 = performance.now();
    st.snap = snap;
    st.history.push({ t: snap.monotonic, pool: snap.pool });
    if (st.history.length > HISTORY) st.history.shift();
    if (snap.tree_s !== null || !snap.cache_enabled) {  // else: the tree was not asked for this time
      st.treeSnap = snap.tree;
      TreeView.setTree(tree, snap.tree);
      treeSummary(snap.tree);
    }
    batchTable(snap.running || []);
    queueTable(snap);
    stepsChart(snap.steps || []);
    poolPanel(snap.pool, snap.host_pool);
    grammarTable(snap.grammars);
    handoffTable(snap.handoffs);
    const ms = performance.now() - t0;
    st.lastRenderMs = ms; st.renders++;
    st.seen.treeCounts.push(st.treeSnap ? st.treeSnap.num_nodes : 0);
    st.seen.poolUsed.push(snap.pool ? snap.pool.total - snap.pool.free : 0);
    const replica = snap.dp_size > 1 ? `replica ${snap.dp_rank} of ${snap.dp_size} (?dp_rank=) · ` : "";
    status(replica + `updated ${new Date(snap.time * 1000).toLocaleTimeString()} · snapshot ` +
      `${(snap.snapshot_s * 1000).toFixed(1)} ms · render ${ms.toFixed(1)} ms`);
    return ms;
  }

  function treeSummary(t) {
    if (!t) { $("tree-summary").textContent = st.snap.cache_enabled ? "empty" : "radix cache off"; return; }
    const more = t.truncated ? ` (${t.truncated} smaller subtrees not shown)` : "";
    $("tree-summary").textContent = `${t.num_nodes} nodes, showing ${t.shown}${more} · ` +
      `${t.total_tokens} tokens (${t.evictable_tokens} evictable, ${t.locked_tokens} locked)` +
      (t.host_tokens !== undefined ? ` · ${t.host_tokens} on host` : "") + ` · clock ${t.clock}`;
  }

  function showNode(n) {
    const box = $("node-detail");
    if (!n) { box.innerHTML = '<p class="muted">No node here.</p>'; return; }
    if (n.isRoot) { box.innerHTML = `<p><b>root</b> · ${n.kids.length} children</p>`; return; }
    const ns = n.namespace ? `${n.namespace.cache_salt ?? "–"} / ${n.namespace.extra_key ?? "–"}` : "default";
    const rows = [["id", n.id], ["parent", n.parent], ["depth", n.depth], ["tokens", n.tokens],
      ["subtree tokens", n.subtree_tokens], ["hits", n.hits], ["lock_ref", n.lock_ref],
      ["last access", `${n.last_access} (clock ${tree.tree ? tree.tree.clock : "?"})`],
      ["tier", n.tier + (n.backed_up ? " (+ host copy)" : "")], ["namespace", ns],
      ["children", `${n.children}` + (n.hidden_children ? ` (${n.hidden_children} not in snapshot)` : "")],
      ["eviction", n.evict_rank === null ? "not next" : `#${n.evict_rank + 1} in LRU order`]];
    box.innerHTML = `<div class="text"></div><table>${rows.map(([k, v]) =>
      `<tr><td>${k}</td><td>${esc(String(v))}</td></tr>`).join("")}</table>` +
      (n.kids.length ? '<button type="button" id="node-toggle">collapse / expand</button>' : "");
    box.querySelector(".text").textContent = n.text;
    const b = $("node-toggle");
    if (b) b.onclick = () => TreeView.toggle(tree, n);
  }

  function esc(s) {
    return s.replace(/[&<>"]/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
  }

  function fill(tbody, rows) {
    tbody.innerHTML = rows.slice(0, MAX_ROWS).map(cells =>
      "<tr>" + cells.map(c => `<td>${esc(c === null || c === undefined ? "–" : String(c))}</td>`).join("") +
      "</tr>").join("");
  }

  function batchTable(running) {
    fill($("batch").tBodies[0], running.map(r => [r.rid, r.prompt_tokens, r.cached_tokens,
      `${r.generated_tokens} / ${r.max_new_tokens}`, r.kv_len, r.grammar,
      r.spec_accept_length ? r.spec_accept_length.toFixed(2) : null, r.retractions, r.age_s.toFixed(1)]));
    st.seen.maxBatchRows = Math.max(st.seen.maxBatchRows, $("batch").tBodies[0].rows.length);
    $("batch-summary").textContent = `${running.length} running · ${st.snap.overlap ? "overlap loop" : "plain loop"}` +
      (st.snap.speculative ? " · speculative" : "");
  }

  function queueTable(snap) {
    const rows = [...(snap.waiting || []), ...(snap.grammar_queue || [])];
    fill($("queue").tBodies[0], rows.map(r => [r.position >= 0 ? r.position + 1 : "", r.rid, r.prompt_tokens,
      r.generated_tokens, r.grammar, r.retractions, r.waited_s.toFixed(1), r.state]));
    st.seen.maxQueueRows = Math.max(st.seen.maxQueueRows, $("queue").tBodies[0].rows.length);
    const more = snap.waiting_truncated ? ` (+${snap.waiting_truncated} more)` : "";
    $("queue-summary").textContent = `${(snap.waiting || []).length} waiting${more}, ` +
      `${(snap.grammar_queue || []).length} compiling · policy ${snap.policy} · ${snap.retractions} retractions`;
  }

  function canvas2d(id) {
    const c = $(id), dpr = window.devicePixelRatio || 1, r = c.getBoundingClientRect();
    c.width = Math.max(100, Math.round(r.width * dpr)); c.height = Math.max(60, Math.round(r.height * dpr));
    const ctx = c.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return [ctx, c.width / dpr, c.height / dpr];
  }

  // One bar per step: forward (bottom), then CPU not overlapped; overlapped CPU and
  // mask time as thin bars beside it. Height: wall seconds, scaled to the slowest step.
  function stepsChart(steps) {
    const [ctx, W, H] = canvas2d("steps-canvas");
    ctx.clearRect(0, 0, W, H);
    const top = Math.max(1e-6, ...steps.map(s => s.step_s));
    const bw = W / Math.max(steps.length, 60), h = H - 16;
    steps.forEach((s, i) => {
      const x = i * bw, f = s.forward_s / top * h, c = s.cpu_s / top * h;
      ctx.fillStyle = "#3b7dd8"; ctx.fillRect(x, H - f, bw * 0.6, f);
      ctx.fillStyle = "#e69a28"; ctx.fillRect(x, H - f - c, bw * 0.6, c);
      ctx.fillStyle = "#4caf7a"; ctx.fillRect(x + bw * 0.6, H - s.overlapped_s / top * h, bw * 0.2, s.overlapped_s / top * h);
      ctx.fillStyle = "#d83b3b"; ctx.fillRect(x + bw * 0.8, H - s.mask_s / top * h, bw * 0.2, s.mask_s / top * h);
    });
    ctx.fillStyle = "#556"; ctx.font = "11px system-ui"; ctx.fillText(`${(top * 1000).toFixed(2)} ms`, 4, 11);
    const sum = k => steps.reduce((a, s) => a + s[k], 0);
    const n = steps.length;
    $("steps-summary").textContent = n ? `last ${n} steps · forward ${(sum("forward_s") / n * 1000).toFixed(2)} ms, ` +
      `CPU ${(sum("cpu_s") / n * 1000).toFixed(2)} ms, overlapped ${(sum("overlapped_s") / n * 1000).toFixed(2)} ms ` +
      `per step · batch ${(sum("batch") / n).toFixed(1)} · ${(sum("tokens") / n).toFixed(1)} tokens/step` : "no steps yet";
  }

  function poolPanel(pool, host) {
    if (!pool) return;
    $("pool-bar").innerHTML = OWNERS.map(o =>
      `<div class="${o}" style="width:${(100 * pool[o] / pool.total).toFixed(3)}%" title="${o}: ${pool[o]}"></div>`).join("");
    $("pool-legend").innerHTML = OWNERS.map(o => `<i class="sw ${o}"></i>${o.replace("_", " ")} ${pool[o]}`).join(" ");
    $("pool-summary").textContent = `${pool.total} slots · page ${pool.page_size} · ` +
      `${(100 * (1 - pool.free / pool.total)).toFixed(1)}% used`;
    $("host-pool").textContent = host ? `host pool (HiCache L2): ${host.tree} tokens of the tree, ` +
      `${host.prefetch_held} held by prefetches, ${host.free} free of ${host.total}` : "";
    poolChart();
  }

  // Stacked areas of the used slots by owner over the last HISTORY polls (free left out),
  // scaled to the most used at any sample, so small changes stay visible.
  function poolChart() {
    const [ctx, W, H] = canvas2d("pool-canvas");
    ctx.clearRect(0, 0, W, H);
    const hs = st.history, n = hs.length, used = OWNERS.filter(o => o !== "free");
    if (n < 2) return;
    const top = Math.max(1, ...hs.map(s => used.reduce((a, o) => a + s.pool[o], 0))) * 1.1;
    const span = Math.max(n, 60) - 1;  // fills the width as samples come (newest on the right)
    const x = i => (i + span + 1 - n) / span * W, y = v => H - v / top * (H - 14);
    let base = hs.map(() => 0);
    for (const o of used) {
      const next = hs.map((s, i) => base[i] + s.pool[o]);
      ctx.beginPath();
      next.forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
      for (let i = n - 1; i >= 0; i--) ctx.lineTo(x(i), y(base[i]));
      ctx.closePath(); ctx.fillStyle = OWNER_COLORS[o]; ctx.fill();
      base = next;
    }
    ctx.fillStyle = "#556"; ctx.font = "11px system-ui";
    ctx.fillText(`${Math.round(top)} slots (of ${hs[n - 1].pool.total}) · last ${n} polls`, 4, 11);
  }

  function grammarTable(g) {
    if (!g) return;
    fill($("grammars").tBodies[0], g.entries.map(e => [e.kind, e.spec, (e.compile_s * 1000).toFixed(1), e.hits]));
    $("grammars").tBodies[0].querySelectorAll("td:nth-child(2)").forEach(td => td.classList.add("spec"));
    const steps = (st.snap.steps || []).filter(s => s.mask_s > 0);
    const perStep = steps.length ? steps.reduce((a, s) => a + s.mask_s, 0) / steps.length : 0;
    $("grammar-summary").textContent = `${g.backend} · ${g.entries.length} cached · ${g.compiling} compiling · ` +
      `mask ${(perStep * 1000).toFixed(3)} ms per constrained step` +
      (g.mask_s_per_row ? `, ${(g.mask_s_per_row * 1e6).toFixed(0)} µs per row` : "");
  }

  function handoffTable(h) {
    if (!h) return;
    const head = $("handoffs").tHead.rows[0];
    if (head.cells.length !== h.fields.length) head.innerHTML = h.fields.map(f => `<th>${esc(f)}</th>`).join("");
    fill($("handoffs").tBodies[0], h.items.map(t => h.fields.map(f => t[f])));
    $("handoff-summary").textContent = h.enabled ? `${h.items.length} in flight`
      : "no disaggregation in this server (prefill and decode run here)";
  }

  function download() {
    const snapshot = Object.assign({}, st.snap, { tree: st.treeSnap });  // the tree as last fetched
    const blob = new Blob([JSON.stringify({ snapshot, pool_history: st.history }, null, 1)],
      { type: "application/json" });
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = `lmprog-inspect-${new Date().toISOString().replace(/[:.]/g, "-")}.json`;
    a.click();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  function wire() {
    $("download").onclick = download;
    $("pause").onclick = () => { st.paused ? start() : stop(); };
    $("tree-fit").onclick = () => { TreeView.fit(tree); TreeView.draw(tree); };
    $("tree-expand").onclick = () => TreeView.expandAll(tree);
    $("tree-collapse").onclick = () => TreeView.collapseBelow(tree, parseInt($("tree-depth").value, 10) || 12);
    $("key-form").onsubmit = e => {
      e.preventDefault();
      st.key = $("api-key").value; sessionStorage.setItem("lmprog-inspect-key", st.key);
      $("key-form").hidden = true; poll();
    };
    window.addEventListener("resize", () => TreeView.draw(tree));
  }

  function stop() { st.paused = true; clearTimeout(st.timer); $("pause").textContent = "resume"; }
  function start() { st.paused = false; $("pause").textContent = "pause"; poll(); }

  window.inspector = { render, stop, start, poll, state: st, tree };
  wire();
  poll();
})();
