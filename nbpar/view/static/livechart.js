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
    store = { seq: -1, spec: { panels: [] }, x: [], cols: {}, notes: {},
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
    store.notes = {};
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
  }
  Object.assign(store.notes, chunk.notes || {});
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
function bytes(v) {
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  let x = Math.abs(v);
  while (x >= 1000 && i < units.length - 1) { x /= 1000; i++; }
  const sign = v < 0 ? "-" : "";
  return i === 0 ? `${sign}${x.toFixed(0)} B` : `${sign}${x.toFixed(x < 100 ? 1 : 0)} ${units[i]}`;
}

function short(v) {
  const a = Math.abs(v);
  if (a >= 1e6) return `${(v / 1e6).toPrecision(3)}M`;
  if (a >= 1e4) return `${(v / 1e3).toPrecision(3)}k`;
  if (a === 0) return "0";
  return `${+v.toPrecision(3)}`;
}

function fmt(unit, v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (unit === "B") return bytes(v);
  if (unit === "s") return v < 1 ? `${+(v * 1e3).toPrecision(3)} ms` : `${+v.toPrecision(3)} s`;
  return unit ? `${short(v)} ${unit}` : short(v);
}

// -- drawing ------------------------------------------------------------------------
function options(panel, width, ink) {
  const grid = { stroke: "rgba(128,128,128,0.18)", width: 1 };
  const yvalues = (u, vals) => vals.map((v) => fmt(panel.unit, v));
  return {
    width, height: HEIGHT,
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: false } },
    legend: { show: true, live: true },
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

function build(store, view) {
  for (const p of view.panels.values()) if (p.plot) p.plot.destroy();
  view.panels.clear();
  view.root.replaceChildren();
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
    view.panels.set(panel.id, { box, waiting, plotEl, note, plot: null });
  }
}

function pointsWithData(cols, n) {
  let count = 0;
  for (let i = 0; i < n; i++) {
    if (cols.some((col) => col[i] !== null && col[i] !== undefined)) count++;
  }
  return count;
}

function draw(store, view) {
  view.frame = 0;
  const key = JSON.stringify(store.spec);
  if (key !== view.specKey) {
    build(store, view);
    view.specKey = key;
  }
  const ink = getComputedStyle(view.root).color || "#222";
  const n = store.x.length;
  for (const panel of store.spec.panels) {
    const p = view.panels.get(panel.id);
    const cols = store.cols[panel.id] || [];
    p.note.textContent = store.notes[panel.id] || "";
    const shown = panel.series.length ? pointsWithData(cols, n) : 0;
    const width = Math.floor(p.box.clientWidth);
    if (!shown || width < 100) {  // nothing to draw yet, or not on the page yet
      p.waiting.style.display = shown ? "none" : "";
      if (!shown) p.box.dataset.points = "0";
      continue;
    }
    p.waiting.style.display = "none";
    const data = [store.x, ...cols];
    if (!p.plot) {
      p.plot = new uPlot(options(panel, width, ink), data, p.plotEl);
    } else {
      p.plot.setData(data);
      if (Math.abs(p.plot.width - width) > 2) p.plot.setSize({ width, height: HEIGHT });
    }
    p.box.dataset.points = String(shown);
  }
  view.root.dataset.seq = String(store.seq);
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
  const root = document.createElement("div");
  root.className = "nbpar-live";
  el.append(root);
  const view = { root, panels: new Map(), frame: 0, specKey: null };
  view.schedule = () => {
    if (!view.frame) view.frame = requestAnimationFrame(() => draw(store, view));
  };
  store.views.add(view);
  const resize = new ResizeObserver(() => view.schedule());
  resize.observe(root);
  draw(store, view);
  return () => {
    store.views.delete(view);
    resize.disconnect();
    if (view.frame) cancelAnimationFrame(view.frame);
    for (const p of view.panels.values()) if (p.plot) p.plot.destroy();
  };
}

export default { initialize, render };
