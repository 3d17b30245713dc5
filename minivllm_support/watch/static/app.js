// The page: one EventSource, one snapshot per engine step, drawn with plain DOM, SVG and canvas.
// Nothing is fetched but /dashboard/events: the page works with no network beyond the engine.
"use strict";
const $ = (id) => document.getElementById(id);
const STEPS_KEPT = 120;            // bars in the "last steps" chart
const HISTORY_S = 300;             // seconds in the "last minutes" chart
const state = { steps: [], seconds: new Map(), maxRef: 0, preemptions: 0, finished: new Set(),
                seen: new Map(), events: 0, lastKv: null };
window.watchState = state;         // for the browser test and the curious

function ownerColour(id) {         // a stable colour per request id
  const hue = (id * 137.508) % 360;
  return `hsl(${hue}, 62%, 48%)`;
}

function log(text, cls) {
  const li = document.createElement("li");
  li.textContent = text;
  if (cls) li.className = cls;
  $("log").prepend(li);
  while ($("log").children.length > 200) $("log").lastChild.remove();
}

function drawRequests(ev) {
  const body = $("requests");
  const rows = ev.requests;
  while (body.children.length > rows.length) body.lastChild.remove();
  while (body.children.length < rows.length) body.appendChild(document.createElement("tr"));
  rows.forEach((r, i) => {
    const tr = body.children[i];
    tr.dataset.id = r.id; tr.dataset.phase = r.phase; tr.dataset.queue = r.queue;
    tr.dataset.preemptions = r.preemptions;
    tr.className = r.queue;
    const ttft = r.ttft_ms === null ? "" : r.ttft_ms.toFixed(1);
    const phase = r.phase + (r.phase.startsWith("prefill") ? ` +${r.scheduled}` : "");
    tr.innerHTML = `<td style="color:${ownerColour(r.id)}">${r.id}</td><td>${r.queue}</td>` +
      `<td><span class="phase ${r.phase}">${phase}</span>${r.finish ? " " + r.finish : ""}</td>` +
      `<td>${r.prompt}</td><td>${r.output}</td><td>${r.computed}</td><td>${r.blocks}</td>` +
      `<td>${r.preemptions || ""}</td><td>${ttft}</td>`;
  });
}

function drawKv(ev) {
  const grid = $("kv-grid"), kv = ev.kv;
  if (!kv) { grid.textContent = ""; return; }
  while (grid.children.length > kv.num_blocks) grid.lastChild.remove();
  while (grid.children.length < kv.num_blocks) grid.appendChild(document.createElement("i"));
  const names = { u: "used", c: "cached", f: "free", s: "scratch" };
  for (let b = 0; b < kv.num_blocks; b++) {
    const cell = grid.children[b], s = kv.state[b], ref = kv.ref[b], owner = kv.owner[b];
    const cls = "cell " + names[s] + (ref > 1 ? " shared" : "");
    if (cell.className !== cls) cell.className = cls;
    cell.dataset.ref = ref;
    cell.style.background = s === "u" && owner >= 0 ? ownerColour(owner) : "";
    const label = ref > 1 ? String(ref) : "";
    if (cell.textContent !== label) cell.textContent = label;
    cell.title = `block ${b}: ${names[s]}` + (owner >= 0 ? `, request ${owner}` : "") + `, ref ${ref}`;
  }
  grid.classList.toggle("big", kv.num_blocks <= 256);
  $("max-ref").textContent = state.maxRef;
  $("kv-counts").innerHTML = `<span id="kv-used">${kv.used}</span> used, <span id="kv-cached">${kv.cached}</span>` +
    ` cached, <span id="kv-free">${kv.free}</span> free, <span id="kv-scratch">${kv.scratch}</span> scratch` +
    ` of <span id="kv-total">${kv.num_blocks}</span> blocks (${kv.block_size} tokens each)`;
}

function drawTree(ev) {
  const svg = $("tree"), p = ev.prefix;
  svg.textContent = "";
  if (!p) return;
  $("prefix-kind").textContent = `${p.kind === "radix" ? "advanced 05's radix tree" : "lesson 13's hash chain"}: ` +
    `${p.total} cached nodes` + (p.total > p.nodes.length ? `, the ${p.nodes.length} most used shown` : "");
  const kids = new Map(), roots = [];
  p.nodes.forEach((n) => { kids.set(n.id, []); });
  p.nodes.forEach((n) => (n.parent && kids.has(n.parent) ? kids.get(n.parent).push(n) : roots.push(n)));
  const W = 46, H = 16, pos = new Map();
  let row = 0, depthMax = 0;
  const place = (n, depth) => {               // depth left to right, one row per leaf
    depthMax = Math.max(depthMax, depth);
    const children = kids.get(n.id);
    if (!children.length) { pos.set(n.id, [depth, row++]); return; }
    const first = row;
    children.forEach((c) => place(c, depth + 1));
    pos.set(n.id, [depth, (first + row - 1) / 2]);
  };
  roots.forEach((r) => place(r, 0));
  svg.setAttribute("width", Math.max(640, (depthMax + 1) * W + 10));
  svg.setAttribute("height", Math.max(40, row * H + 6));
  const ns = "http://www.w3.org/2000/svg", add = (tag, attrs, text) => {
    const el = document.createElementNS(ns, tag);
    for (const k in attrs) el.setAttribute(k, attrs[k]);
    if (text !== undefined) el.textContent = text;
    svg.appendChild(el); return el;
  };
  p.nodes.forEach((n) => {
    const [d, r] = pos.get(n.id);
    if (n.parent && pos.has(n.parent)) {
      const [pd, pr] = pos.get(n.parent);
      add("line", { x1: pd * W + 40, y1: pr * H + 10, x2: d * W + 2, y2: r * H + 10, stroke: "#90a4ae" });
    }
    const g = add("g", { class: "node", "data-hits": n.hits ?? "", "data-ref": n.ref });
    const rect = document.createElementNS(ns, "rect");
    Object.entries({ x: d * W + 2, y: r * H + 3, width: 38, height: 13, rx: 3,
      fill: n.ref > 0 ? "#1e88e5" : "#fff", stroke: n.known_parent ? "#546e7a" : "#bbb" })
      .forEach(([k, v]) => rect.setAttribute(k, v));
    g.appendChild(rect);
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", d * W + 5); t.setAttribute("y", r * H + 13);
    t.setAttribute("fill", n.ref > 0 ? "#fff" : "#333");
    t.textContent = `b${n.block}` + (n.hits ? ` ×${n.hits}` : "");
    g.appendChild(t);
    const tip = document.createElementNS(ns, "title");
    tip.textContent = `block ${n.block}, ${n.tokens} tokens, hits ${n.hits ?? "-"}, ref ${n.ref}`;
    g.appendChild(tip);
  });
}

function bars(ctx, w, h, values, max, colour, x0, bw, base) {
  values.forEach((v, i) => {
    const bh = max ? (v / max) * (h - 14) : 0;
    ctx.fillStyle = colour;
    ctx.fillRect(x0 + i * bw, h - (base[i] || 0) - bh, Math.max(1, bw - 1), bh);
    base[i] = (base[i] || 0) + bh;
  });
}

function line(ctx, h, values, max, colour, bw, dot) {
  ctx.strokeStyle = ctx.fillStyle = colour;
  ctx.beginPath();
  values.forEach((v, i) => {
    const x = i * bw + bw / 2, y = h - (max ? (v / max) * (h - 14) : 0);
    if (dot) ctx.fillRect(x - 1.5, y - 1.5, 3, 3); else if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
  });
  if (!dot) ctx.stroke();
}

function drawCharts() {
  const c = $("steps"), ctx = c.getContext("2d"), s = state.steps, bw = c.width / STEPS_KEPT;
  ctx.clearRect(0, 0, c.width, c.height);
  const tokMax = Math.max(1, ...s.map((e) => e.prefill + e.decode));
  const base = [];
  bars(ctx, c.width, c.height, s.map((e) => e.decode), tokMax, "#43a047", 0, bw, base);
  bars(ctx, c.width, c.height, s.map((e) => e.prefill), tokMax, "#1565c0", 0, bw, base);
  const msMax = Math.max(1e-3, ...s.map((e) => e.ms));
  line(ctx, c.height, s.map((e) => e.ms), msMax, "#ef6c00", bw, false);
  line(ctx, c.height, s.map((e) => e.size), Math.max(1, ...s.map((e) => e.size)), "#6a1b9a", bw, true);
  ctx.fillStyle = "#333";
  ctx.fillText(`max ${tokMax} tokens, ${msMax.toFixed(1)} ms`, 4, 10);
  const hc = $("history"), hx = hc.getContext("2d");
  hx.clearRect(0, 0, hc.width, hc.height);
  const now = Math.floor(state.lastT || 0), secs = [];
  const span = Math.min(HISTORY_S, Math.max(30, now - Math.floor(state.firstT || 0) + 1));
  for (let t = now - span + 1; t <= now; t++) secs.push(state.seconds.get(t) || { tokens: 0, kv: null });
  const tw = hc.width / span, tMax = Math.max(1, ...secs.map((x) => x.tokens));
  bars(hx, hc.width, hc.height, secs.map((x) => x.tokens), tMax, "#43a047", 0, tw, []);
  line(hx, hc.height, secs.map((x) => (x.kv === null ? 0 : x.kv)), 100, "#c62828", tw, false);
  hx.fillStyle = "#333";
  hx.fillText(`last ${span} s: max ${tMax} tokens/s; KV line: 0-100 %`, 4, 10);
}

// Every event is noted (bars, totals, the log); the page is drawn at most every DRAW_MS, from
// the newest event, so a fast engine (a step every few ms) cannot swamp the browser.
const DRAW_MS = 80;

function note(ev) {
  state.events++;
  for (const r of ev.requests) {
    const before = state.seen.get(r.id);
    if (before !== undefined && r.preemptions > before) {
      state.preemptions += r.preemptions - before;
      log(`step ${ev.step}: request ${r.id} preempted (its KV blocks freed; it recomputes later)`, "preempt");
    }
    if (r.queue === "finished" && !state.finished.has(r.id)) {
      state.finished.add(r.id);
      const ttft = r.ttft_ms === null ? "-" : r.ttft_ms.toFixed(1);
      log(`step ${ev.step}: request ${r.id} finished (${r.finish}), ${r.output} tokens, TTFT ${ttft} ms`);
    }
    state.seen.set(r.id, r.preemptions);
  }
  if (ev.kv) {
    const maxRef = ev.kv.ref.reduce((a, b) => Math.max(a, b), 0);
    if (maxRef > state.maxRef) {
      state.maxRef = maxRef;
      if (maxRef > 1) log(`step ${ev.step}: a block is shared by ${maxRef} requests (prefix cache)`, "share");
    }
  }
  if (ev.batch) {
    state.steps.push({ prefill: ev.batch.prefill_tokens, decode: ev.batch.decode_tokens,
                       ms: ev.step_ms || 0, size: ev.batch.size });
    if (state.steps.length > STEPS_KEPT) state.steps.shift();
    const sec = Math.floor(ev.t), slot = state.seconds.get(sec) || { tokens: 0, kv: null };
    slot.tokens += ev.batch.prefill_tokens + ev.batch.decode_tokens;
    state.seconds.set(sec, slot);
  }
  if (ev.kv) {
    const slot = state.seconds.get(Math.floor(ev.t)) || { tokens: 0, kv: null };
    slot.kv = (100 * ev.kv.used) / Math.max(1, ev.kv.num_blocks - ev.kv.scratch);
    state.seconds.set(Math.floor(ev.t), slot);
  }
  state.lastT = ev.t;
  if (state.firstT === undefined) state.firstT = ev.t;
  for (const k of state.seconds.keys()) if (k < ev.t - HISTORY_S) state.seconds.delete(k);
}

function render(ev) {
  $("engine").textContent = ev.engine;
  $("step").textContent = ev.step;
  $("total-finished").textContent = ev.totals.finished;
  $("total-preemptions").textContent = ev.totals.preemptions;
  const q = ev.totals.prefix_queries;
  $("hit-rate").textContent = q ? `${(100 * ev.totals.prefix_hits / q).toFixed(1)} % of ${q} tokens` : "-";
  drawRequests(ev);
  drawKv(ev);
  drawTree(ev);
  drawCharts();
}

function onEvent(ev) {
  note(ev);
  state.latest = ev;
  if (!state.timer) state.timer = setTimeout(() => { state.timer = null; render(state.latest); }, DRAW_MS);
}

function connect() {
  const source = new EventSource("/dashboard/events");
  source.onopen = () => { $("status").textContent = "live"; $("status").className = "status on"; };
  source.onerror = () => { $("status").textContent = "disconnected (retrying)"; $("status").className = "status off"; };
  source.onmessage = (m) => onEvent(JSON.parse(m.data));
}
connect();
