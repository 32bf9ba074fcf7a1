// The browser side of nbpar.view.livechart.LiveChart: panels of series over training
// steps, drawn with uPlot (https://github.com/leeoniya/uPlot, MIT, see uPlot.LICENSE),
// whose source livechart.py puts before this text, so nothing is fetched at run time.
//
// The kernel sends only the new points, as numbered "chunks" in the `chunk` trait:
//   {seq, reset?, spec?, x: [step...], cols: {panel: [[value per step] per series]},
//    notes: {panel: text}}
// Every view of one widget draws from one store. A view that finds a gap in the
// numbering (a reloaded page, a second frontend) asks the kernel once for everything.

const STORES = new Map();
const HEIGHT = 190;

function storeOf(model) {
  const uid = model.get("uid");
  let store = STORES.get(uid);
  if (!store) {
    store = { seq: -1, spec: { panels: [] }, x: [], cols: {}, points: {}, notes: {},
              views: new Set(), resyncing: false };
    STORES.set(uid, store);
  }
  return store;
}

function append(target, values) {
  for (let i = 0; i < values.length; i++) target.push(values[i]);
}

function nulls(n) {
  return new Array(Math.max(0, n)).fill(null);
}

// "applied", "old" (seen already) or "gap" (a chunk is missing: resync)
function apply(store, chunk) {
  if (!chunk || typeof chunk.seq !== "number") return "old";
  if (chunk.reset) {
    store.x = [];
    store.cols = {};
    store.points = {};
    store.notes = {};
    store.status = null;
    store.resyncing = false;
  } else if (chunk.seq <= store.seq) {
    return "old";
  } else if (chunk.seq !== store.seq + 1) {
    return "gap";
  }
  if (chunk.spec) store.spec = chunk.spec;
  const start = store.x.length;
  append(store.x, chunk.x || []);
  const added = store.x.length - start;
  for (const panel of store.spec.panels) {
    const cols = store.cols[panel.id] || (store.cols[panel.id] = []);
    const incoming = (chunk.cols || {})[panel.id] || [];
    panel.series.forEach((_, i) => {
      const col = cols[i] || (cols[i] = nulls(start));
      append(col, incoming[i] || nulls(added));
    });
    // steps with at least one value in this panel (what the page shows as data-points)
    let count = store.points[panel.id] || 0;
    for (let j = start; j < store.x.length; j++) {
      if (cols.some((col) => col[j] !== null && col[j] !== undefined)) count++;
    }
    store.points[panel.id] = count;
  }
  Object.assign(store.notes, chunk.notes || {});
  if (chunk.times) store.times = chunk.times;
  if (chunk.status) store.status = chunk.status;
  store.sent = chunk.sent;
  store.seq = chunk.seq;
  return "applied";
}

function receive(model) {
  const store = storeOf(model);
  const outcome = apply(store, model.get("chunk"));
  if (outcome === "gap" && !store.resyncing) {
    store.resyncing = true;
    model.send({ type: "resync" });
  } else if (outcome === "applied") {
    for (const view of store.views) view.schedule();
  }
}

// -- numbers as people read them -------------------------------------------------
// bytes in B/kB/MB/GB; `step` (the axis' tick increment) asks for enough decimals that
// neighbouring ticks read differently
function bytes(v, step) {
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  let x = Math.abs(v);
  while (x >= 1000 && i < units.length - 1) { x /= 1000; i++; }
  const sign = v < 0 ? "-" : "";
  let digits = i === 0 ? 0 : x < 100 ? 1 : 0;
  if (step && i > 0) {
    const scaled = step / 1000 ** i;
    digits = Math.min(3, Math.max(digits, Math.ceil(-Math.log10(scaled))));
  }
  return `${sign}${x.toFixed(digits)} ${units[i]}`;
}

function short(v) {
  const a = Math.abs(v);
  if (a >= 1e6) return `${(v / 1e6).toPrecision(3)}M`;
  if (a >= 1e4) return `${(v / 1e3).toPrecision(3)}k`;
  if (a === 0) return "0";
  return `${+v.toPrecision(3)}`;
}

function fmt(unit, v, step) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (unit === "B") return bytes(v, step);
  if (unit === "s") return v < 1 ? `${+(v * 1e3).toPrecision(3)} ms` : `${+v.toPrecision(3)} s`;
  return unit ? `${short(v)} ${unit}` : short(v);
}

// -- drawing ------------------------------------------------------------------------
// Seconds from zero up to twice the 95th percentile of the steps after the first two:
// their one-off set-up (several normal steps long) would squash every later step into
// the bottom of the panel; a spike above that runs off the top.
function secondsRange(data, hi) {
  const vals = [];
  for (let k = 1; k < data.length; k++) {
    for (let i = 2; i < data[k].length; i++) {
      const v = data[k][i];
      if (v !== null && v !== undefined && Number.isFinite(v)) vals.push(v);
    }
  }
  if (vals.length < 5) return [0, Math.max(hi, 1e-6) * 1.1];
  vals.sort((a, b) => a - b);
  const top = 2 * vals[Math.floor(0.95 * (vals.length - 1))];
  return [0, Math.max(Math.min(hi, top), 1e-6) * 1.1];
}

function options(panel, width, ink) {
  const grid = { stroke: "rgba(128,128,128,0.18)", width: 1 };
  // ticks: bytes and seconds with their unit, rates as plain numbers (the title says the unit)
  const tick = panel.unit === "B" || panel.unit === "s" ? panel.unit : "";
  const yvalues = (u, vals, axis, space, incr) => vals.map((v) => fmt(tick, v, incr));
  // memory from zero: levels read as amounts, and a flat line is not blown up into noise
  const y = panel.unit === "B" ? { range: (u, lo, hi) => [0, Math.max(hi, 1) * 1.15] }
    : panel.unit === "s" ? { range: (u, lo, hi) => secondsRange(u.data, hi) } : {};
  return {
    width, height: HEIGHT,
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: false }, y },
    legend: { show: true, live: false },  // labels only: no DOM writes on every draw
    axes: [
      { label: "step", stroke: ink, grid, size: 40, labelSize: 18, font: "12px sans-serif",
        labelFont: "12px sans-serif" },
      { stroke: ink, grid, size: 70, values: yvalues, font: "12px sans-serif" },
    ],
    series: [
      { label: "step", value: (u, v) => (v === null ? "–" : `${v}`) },
      ...panel.series.map((s) => ({
        label: s.label, stroke: s.color, width: s.width || 1.5, dash: s.dash || undefined,
        spanGaps: true, points: { show: false }, value: (u, v) => fmt(panel.unit, v),
      })),
    ],
  };
}

// At most ~one point per 2 pixels: a run of thousands of steps is drawn as the mean of
// each bucket of `size` steps (a power of two, so buckets stay put as the run grows).
// Drawing every step of a noisy series costs the browser ~5x more CPU, CPU the engines
// next to it need.
function decimate(x, cols, target) {
  let size = 1;
  while (x.length / size > target) size *= 2;
  if (size === 1) return { size, data: [x, ...cols] };
  const bx = [];
  const bcols = cols.map(() => []);
  for (let start = 0; start < x.length; start += size) {
    const end = Math.min(x.length, start + size);
    bx.push(x[end - 1]);
    cols.forEach((col, k) => {
      let sum = 0;
      let count = 0;
      for (let i = start; i < end; i++) {
        if (col[i] !== null && col[i] !== undefined) { sum += col[i]; count++; }
      }
      bcols[k].push(count ? sum / count : null);
    });
  }
  return { size, data: [bx, ...bcols] };
}

function setText(el, text) {
  if (el.textContent !== text) el.textContent = text;
}

// Reads no layout: widths come from the ResizeObserver, so a draw never forces the
// page (all of JupyterLab) to lay out again.
function build(store, view) {
  for (const p of view.panels.values()) if (p.plot) p.plot.destroy();
  view.panels.clear();
  view.resize.disconnect();
  view.root.replaceChildren();
  view.ink = getComputedStyle(view.root).color || "#222";
  for (const panel of store.spec.panels) {
    const box = document.createElement("div");
    box.className = "nbpar-panel";
    box.dataset.panel = panel.id;
    box.dataset.points = "0";
    const title = document.createElement("div");
    title.className = "nbpar-panel-title";
    title.textContent = panel.title;
    const waiting = document.createElement("div");
    waiting.className = "nbpar-waiting";
    waiting.textContent = store.spec.waiting || "waiting for the first step";
    const plotEl = document.createElement("div");
    plotEl.className = "nbpar-plot";
    const note = document.createElement("div");
    note.className = "nbpar-note";
    box.append(title, waiting, plotEl, note);
    view.root.append(box);
    view.panels.set(panel.id, { box, waiting, plotEl, note, plot: null, width: 0 });
    view.resize.observe(box);
  }
}

function resized(view, entries) {
  for (const entry of entries) {
    const p = view.panels.get(entry.target.dataset.panel);
    const width = Math.floor(entry.contentRect.width);
    if (p && Math.abs(p.width - width) > 2) {
      p.width = width;
      view.schedule();
    }
  }
}

function drawStatus(store, view) {
  const status = store.status || { text: "", value: 0, max: 1, style: "" };
  setText(view.text, status.text);
  const width = `${(100 * Math.min(1, status.value / Math.max(1, status.max))).toFixed(1)}%`;
  if (view.fill.style.width !== width) view.fill.style.width = width;
  const cls = `nbpar-bar-fill ${status.style ? `nbpar-${status.style}` : ""}`;
  if (view.fill.className !== cls) view.fill.className = cls;
}

function draw(store, view) {
  const started = performance.now();
  view.frame = 0;
  drawStatus(store, view);
  const key = JSON.stringify(store.spec);
  if (key !== view.specKey) {
    build(store, view);
    view.specKey = key;
  }
  const n = store.x.length;
  for (const panel of store.spec.panels) {
    const p = view.panels.get(panel.id);
    const cols = store.cols[panel.id] || [];
    setText(p.note, store.notes[panel.id] || "");
    const shown = panel.series.length ? store.points[panel.id] || 0 : 0;
    if (!shown || p.width < 100) {  // nothing to draw yet, or not on the page yet
      p.waiting.style.display = shown ? "none" : "";
      continue;
    }
    p.waiting.style.display = "none";
    const { size, data } = decimate(store.x, cols, Math.max(50, Math.floor(p.width / 2)));
    if (!p.plot) {
      p.plot = new uPlot(options(panel, p.width, view.ink), data, p.plotEl);
    } else {
      p.plot.setData(data);
      if (Math.abs(p.plot.width - p.width) > 2) p.plot.setSize({ width: p.width, height: HEIGHT });
    }
    const axis = size > 1 ? `step (each point: mean of ${size} steps)` : "step";
    if (p.plot.axes[0].label !== axis) {
      p.plot.axes[0].label = axis;
      p.plot.redraw(false, true);
    }
    p.box.dataset.points = String(shown);
  }
  const root = view.root.dataset;
  root.seq = String(store.seq);
  if (store.times) {  // wall-clock time of the first and the newest step drawn
    root.firstTime = String(store.times[0]);
    root.lastTime = String(store.times[1]);
    root.sentTime = String(store.sent);
  }
  // what drawing costs this page: draws so far and the slowest one (ms)
  view.draws = (view.draws || 0) + 1;
  view.slowest = Math.max(view.slowest || 0, performance.now() - started);
  root.draws = String(view.draws);
  root.slowestDrawMs = view.slowest.toFixed(1);
}

function initialize({ model }) {
  const onChunk = () => receive(model);
  model.on("change:chunk", onChunk);
  receive(model);
  return () => model.off("change:chunk", onChunk);
}

function render({ model, el }) {
  const store = storeOf(model);
  if (store.seq < 0) receive(model);
  const head = document.createElement("div");
  head.className = "nbpar-progress";
  head.innerHTML = "<div class='nbpar-bar'><div class='nbpar-bar-fill'></div></div>" +
    "<span class='nbpar-progress-text'></span>";
  const root = document.createElement("div");
  root.className = "nbpar-live";
  el.append(head, root);
  const view = { root, panels: new Map(), frame: 0, specKey: null,
                 fill: head.querySelector(".nbpar-bar-fill"),
                 text: head.querySelector(".nbpar-progress-text") };
  // a view scrolled out of sight (or hidden) is not drawn until it shows again
  view.visible = true;
  view.schedule = () => {
    if (view.visible && !view.frame) view.frame = requestAnimationFrame(() => draw(store, view));
  };
  view.resize = new ResizeObserver((entries) => resized(view, entries));
  const sight = new IntersectionObserver((entries) => {
    view.visible = entries.some((e) => e.isIntersecting);
    view.schedule();
  });
  sight.observe(el);
  store.views.add(view);
  draw(store, view);
  return () => {
    store.views.delete(view);
    sight.disconnect();
    view.resize.disconnect();
    if (view.frame) cancelAnimationFrame(view.frame);
    for (const p of view.panels.values()) if (p.plot) p.plot.destroy();
  };
}

export default { initialize, render };
