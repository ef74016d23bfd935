// pagedserve dashboard: polls /dashboard/state and draws the KV pool, the sequences and the charts.
// Plain JS, no dependency. An API key comes from the page's #key=... (never sent to the server in the URL)
// or ?key=..., and goes to the state endpoint as an Authorization header.
"use strict";

const POLL_MS = 500;
// The charts span the samples there are, at least one minute and at most five.
const CHART_MIN_S = 60;
const CHART_MAX_S = 300;
const MAX_CHIPS = 64;
const STATE_NAMES = {
  f: "free", u: "used", s: "shared", c: "cached", n: "null (sliding tables name it before their window)",
  "?": "unknown",
};

const $ = (id) => document.getElementById(id);
const grid = $("grid");
const seqList = $("seqs");
let cells = [];
let states = "";
let refcounts = new Uint8Array(0);
let sequences = [];
let hovered = null;
let updates = 0;

function apiKey() {
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
  return fromHash || new URLSearchParams(location.search).get("key");
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function pct(x) {
  return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";
}

function setStatus(text, error) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("error", Boolean(error));
}

// pool grid

function cellState(i) {
  const state = states[i];
  return state === "u" && refcounts[i] > 1 ? "s" : state;
}

function resizeGrid(n) {
  grid.replaceChildren();
  cells = [];
  const area = grid.clientWidth * Math.max(window.innerHeight * 0.42, 200);
  const size = Math.max(5, Math.min(22, Math.floor(Math.sqrt(area / Math.max(n, 1))) - 2));
  grid.style.setProperty("--cell", size + "px");
  const fragment = document.createDocumentFragment();
  for (let i = 0; i < n; i++) {
    const cell = el("div", "cell f");
    cell.dataset.id = i;
    fragment.appendChild(cell);
    cells.push(cell);
  }
  grid.appendChild(fragment);
}

function drawPool(pool) {
  if (!pool) return;
  if (cells.length !== pool.num_blocks) resizeGrid(pool.num_blocks);
  states = pool.states;
  const raw = atob(pool.refcounts);
  refcounts = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) refcounts[i] = raw.charCodeAt(i);
  for (let i = 0; i < cells.length; i++) {
    const wanted = "cell " + cellState(i);
    const cell = cells[i];
    const lit = cell.classList.contains("hl");
    if (cell.className !== wanted + (lit ? " hl" : "")) cell.className = wanted + (lit ? " hl" : "");
  }
  const counts = pool.counts;
  $("n-free").textContent = counts.free;
  $("n-used").textContent = counts.used - counts.shared;
  $("n-shared").textContent = counts.shared;
  $("n-cached").textContent = counts.cached;
  $("pool-size").textContent = `${pool.num_blocks} blocks × ${pool.block_size} tokens`;
  drawImageStore(pool.image_store);
}

function drawImageStore(store) {
  $("t-images-tile").hidden = !store;
  if (!store) return;
  const mib = (bytes) => (bytes / 2 ** 20).toFixed(1);
  $("t-images").textContent = `${store.stored_images} images`;
  $("t-images-sub").textContent = `${mib(store.stored_bytes)} of ${mib(store.capacity_bytes)} MiB · ` +
    `${store.hits} hits · ${store.misses} misses · ${store.evictions} evicted`;
}

function describeBlock(i) {
  const holders = sequences.filter((seq) => seq.blocks.includes(i)).map((seq) => seq.id.slice(0, 8));
  const held = holders.length ? ` · in ${holders.join(", ")}` : "";
  return `block ${i}: ${STATE_NAMES[cellState(i)] || "?"} · refcount ${refcounts[i]}${held}`;
}

grid.addEventListener("mouseover", (event) => {
  const id = event.target.dataset && event.target.dataset.id;
  if (id !== undefined) $("block-info").textContent = describeBlock(Number(id));
});

// sequences

// The blocks a sequence holds K/V in, every KV group's (the null block is no one's).
function heldBlocks(seq) {
  return seq.blocks.filter((id) => states[id] !== "n");
}

function highlight() {
  for (const cell of grid.querySelectorAll(".cell.hl")) cell.classList.remove("hl");
  for (const row of seqList.querySelectorAll(".seq.hl")) row.classList.remove("hl");
  const seq = sequences.find((s) => s.id === hovered);
  grid.classList.toggle("focus", Boolean(seq));
  if (!seq) return;
  const held = heldBlocks(seq);
  for (const id of held) if (cells[id]) cells[id].classList.add("hl");
  const row = seqList.querySelector(`.seq[data-seq="${CSS.escape(seq.id)}"]`);
  if (row) row.classList.add("hl");
  $("block-info").textContent = `${seq.id.slice(0, 8)}: ${held.length} blocks [${held.join(", ")}]`;
}

function seqRow(seq) {
  const row = el("div", seq.own ? "seq own" : "seq other");
  row.dataset.seq = seq.id;
  const top = el("div", "top");
  const name = seq.index ? `${seq.id.slice(0, 8)}…/${seq.index}` : seq.id.slice(0, 8);
  top.appendChild(el("span", "id", seq.own ? name : seq.id));
  top.appendChild(el("span", `badge ${seq.status}`, seq.status));
  if (seq.preemptions) top.appendChild(el("span", "badge preempted", `preempted ×${seq.preemptions}`));
  top.appendChild(el("span", "req", seq.request_id ? `request ${seq.request_id}` : ""));
  // NOTE: a pool of several KV groups: blocks held per group, in the groups' order (full attention first).
  const perGroup = seq.tables.length > 1
    ? ` · per KV group ${seq.tables.map((t) => t.filter((id) => states[id] !== "n").length).join(" / ")}` : "";
  top.appendChild(
    el("span", "nums",
      `prompt ${seq.prompt_tokens} · generated ${seq.generated_tokens} · cached ${seq.cached_tokens}${perGroup}`));
  row.appendChild(top);
  const table = el("div", "table");
  const held = heldBlocks(seq);
  for (const id of held.slice(0, MAX_CHIPS)) table.appendChild(el("span", "blk " + cellState(id), id));
  if (held.length > MAX_CHIPS) table.appendChild(el("span", "hint", `+${held.length - MAX_CHIPS}`));
  if (!held.length) table.appendChild(el("span", "hint", "no blocks"));
  row.appendChild(table);
  return row;
}

function drawSequences(state) {
  sequences = state.sequences;
  const rows = sequences.map(seqRow);
  const hidden = state.num_waiting - sequences.filter((s) => s.status === "waiting").length;
  if (state.listed && hidden > 0) rows.push(el("div", "empty", `and ${hidden} more waiting`));
  if (!state.listed) rows.push(el("div", "empty", "listing the sequences from the next step…"));
  else if (!rows.length) rows.push(el("div", "empty", "no sequence running or waiting"));
  seqList.replaceChildren(...rows);
  highlight();
}

seqList.addEventListener("mouseover", (event) => {
  const row = event.target.closest(".seq");
  const id = row ? row.dataset.seq : null;
  if (id !== hovered) {
    hovered = id;
    highlight();
  }
});
seqList.addEventListener("mouseleave", () => {
  hovered = null;
  highlight();
});

// charts

function drawChart(canvas, times, values, options) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const numbers = values.filter((v) => v !== null);
  const top = options.max || Math.max(1, ...numbers) * 1.15;
  const now = times.length ? times[times.length - 1] : 0;
  const span = Math.min(CHART_MAX_S, Math.max(CHART_MIN_S, times.length ? now - times[0] : 0));
  const x = (t) => width - ((now - t) / span) * width;
  const y = (v) => height - 14 - (v / top) * (height - 22);
  ctx.strokeStyle = "#e2e5eb";
  ctx.lineWidth = 1;
  for (const fraction of [0, 0.5, 1]) {
    ctx.beginPath();
    ctx.moveTo(0, y(top * fraction) + 0.5);
    ctx.lineTo(width, y(top * fraction) + 0.5);
    ctx.stroke();
  }
  ctx.strokeStyle = options.color;
  ctx.fillStyle = options.color + "33";
  ctx.lineWidth = 1.5;
  let path = [];
  const flush = () => {
    if (path.length > 1) {
      ctx.beginPath();
      ctx.moveTo(path[0][0], y(0));
      for (const [px, py] of path) ctx.lineTo(px, py);
      ctx.lineTo(path[path.length - 1][0], y(0));
      ctx.fill();
      ctx.beginPath();
      path.forEach(([px, py], i) => (i ? ctx.lineTo(px, py) : ctx.moveTo(px, py)));
      ctx.stroke();
    }
    path = [];
  };
  times.forEach((t, i) => (values[i] === null ? flush() : path.push([x(t), y(values[i])])));
  flush();
  ctx.fillStyle = "#6b7385";
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(options.format(top), 2, 10);
  ctx.fillText(`last ${Math.round(span / 60)} min`, 2, height - 2);
  const last = values.length ? values[values.length - 1] : null;
  const label = last === null ? "–" : options.format(last);
  ctx.fillStyle = options.color;
  ctx.font = "600 12px system-ui, sans-serif";
  ctx.fillText(label, width - ctx.measureText(label).width - 2, 11);
}

function drawCharts(history) {
  const t = history.t;
  const whole = (v) => v.toFixed(v < 10 ? 1 : 0);
  drawChart($("c-tps"), t, history.tokens_per_s, { color: "#3d7be0", format: whole });
  drawChart($("c-usage"), t, history.kv_usage, { color: "#8a4fd6", max: 1, format: pct });
  drawChart($("c-hit"), t, history.hit_rate, { color: "#2fae6a", max: 1, format: pct });
  const perSecond = history.preemptions.map((n) => n / history.interval_s);
  drawChart($("c-preempt"), t, perSecond, { color: "#d0542b", format: whole });
}

// tiles

function drawTiles(state) {
  const pool = state.pool;
  $("t-usage").textContent = pct(state.kv_usage);
  $("t-blocks").textContent = pool
    ? `${pool.counts.used} used · ${pool.counts.cached} cached · ${pool.counts.free} free`
    : "pool unknown";
  const totals = state.totals;
  $("t-hit").textContent = pct(totals.hit_rate);
  $("t-hit-sub").textContent = `${totals.cached_tokens} of ${totals.prompt_tokens} prompt tokens`;
  const tps = state.history.tokens_per_s;
  $("t-tps").textContent = tps.length ? tps[tps.length - 1].toFixed(1) : "–";
  $("t-generated").textContent = `${totals.generated_tokens} tokens generated`;
  $("t-preempt").textContent = totals.preemptions;
  $("t-seqs").textContent = `${state.num_running} · ${state.num_waiting}`;
  const viewer = state.viewer ? ` · viewing as ${state.viewer}` : "";
  const epoch = state.attached_epoch ? ` · pool ${state.attached_epoch.slice(0, 8)}` : " · not attached";
  $("meta").textContent = `${state.model || "model loading"}${epoch}${viewer}`;
}

// polling

async function poll() {
  const key = apiKey();
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const reply = await fetch("/dashboard/state", { headers, cache: "no-store" });
    if (reply.status === 401) {
      setStatus("this gateway needs an API key: open /dashboard#key=YOUR_KEY", true);
      return;
    }
    if (!reply.ok) {
      setStatus(`the gateway answered ${reply.status}`, true);
      return;
    }
    const state = await reply.json();
    drawPool(state.pool);
    drawSequences(state);
    drawTiles(state);
    drawCharts(state.history);
    updates += 1;
    document.body.dataset.updates = updates;
    const when = new Date(state.time * 1000).toLocaleTimeString();
    if (state.pool_error) setStatus(state.pool_error, true);
    else setStatus(`live · ${when}`, false);
  } catch (err) {
    setStatus(`cannot reach the gateway (${err.message}); retrying`, true);
  }
}

async function loop() {
  await poll();
  setTimeout(loop, POLL_MS);
}

window.addEventListener("resize", () => {
  cells = [];
});
loop();
