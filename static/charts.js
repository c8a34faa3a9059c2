// Interactive charts on uPlot (static/uPlot.iife.min.js, MIT, vendored: no CDN, works offline).
// Builds chart-ready data from /api/series columns: x by step, relative time or tokens seen, TensorBoard's
// debiased EMA, several runs overlaid in one colour each, and markers (checkpoints, best, resumes,
// skipped steps) drawn on the loss chart. Hover shows every series' value in the legend; drag zooms
// every chart at once, double-click or "reset zoom" zooms out; legend entries toggle their series.
"use strict";

const Charts = (() => {
  // Distinct on white and on the dark theme; run i of the page always gets PALETTE[i].
  const PALETTE = ["#1f77b4", "#e8590c", "#2f9e44", "#c2255c", "#7048e8", "#0c8599", "#a0522d", "#e03131", "#5c940d", "#868e96"];
  const X_LABELS = { step: "step", time: "time since start", tokens: "tokens seen" };

  // TensorBoard's smoothing: bias-corrected EMA; missing and non-finite points pass through untouched.
  function ema(values, weight) {
    if (!(weight > 0)) return values.slice();
    const out = new Array(values.length);
    let last = 0, count = 0;
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (v === null || !Number.isFinite(v)) { out[i] = v; continue; }
      last = last * weight + (1 - weight) * v;
      count += 1;
      out[i] = last / (1 - Math.pow(weight, count));
    }
    return out;
  }

  // The dashboard's one number format, the same rule as the server's `num` filter (dashboard/views.py):
  // from 1,000 up a whole number with thousands separators (40,981 tokens/s), below that `digits`
  // significant digits (0.1235), below 0.001 an exponent (3e-4); missing or not finite: "-".
  function fmt(value, digits = 4) {
    if (typeof value !== "number" || !Number.isFinite(value)) return "-";
    if (value !== 0 && Math.abs(value) < 1e-3) {
      const [mantissa, exponent] = value.toExponential(digits - 1).split("e");
      return `${Number(mantissa)}e${Number(exponent)}`;
    }
    const rounded = Number(value.toPrecision(digits));
    if (Number.isInteger(value) || Math.abs(rounded) >= 1000) return Math.round(value).toLocaleString("en-US");
    return String(rounded);
  }
  function compact(value) { // axis ticks: 1.2k, 3.4M
    const abs = Math.abs(value);
    if (abs >= 1e9) return `${fmt(value / 1e9, 3)}G`;
    if (abs >= 1e6) return `${fmt(value / 1e6, 3)}M`;
    if (abs >= 1e4) return `${fmt(value / 1e3, 3)}k`;
    return fmt(value, 3);
  }
  function clockSpan(seconds) { // relative time ticks: 45s, 12m, 1h05, 2d3h
    if (seconds === null || !Number.isFinite(seconds)) return "-";
    const s = Math.round(seconds);
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m${s % 60 ? String(s % 60).padStart(2, "0") : ""}`;
    if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}`;
    return `${Math.floor(s / 86400)}d${Math.floor((s % 86400) / 3600)}h`;
  }
  const xValue = (mode) => (mode === "time" ? clockSpan : compact);

  // The x column of one run's table for the chosen axis; falls back to steps where it cannot be had.
  function xColumn(table, mode, started) {
    if (mode === "tokens" && table.tokens_seen && table.tokens_seen.every((v) => v !== null)) return table.tokens_seen.slice();
    if (mode === "time" && table.wall.length && table.wall.every((v) => v !== null)) {
      const origin = started ?? table.wall[0];
      let previous = -Infinity; // keep it ascending (uPlot needs that) across clock hiccups
      return table.wall.map((w) => (previous = Math.max(previous, w - origin)));
    }
    return table.step.slice();
  }

  // Step -> x on the chosen axis, by the nearest logged step at or before it.
  function stepToX(table, xs, step) {
    const steps = table.step;
    if (!steps.length) return null;
    let lo = 0, hi = steps.length - 1;
    if (step <= steps[0]) return xs[0];
    if (step >= steps[hi]) return xs[hi];
    while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (steps[mid] <= step) lo = mid; else hi = mid - 1; }
    return xs[lo];
  }

  function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }
  function alpha(hex, a) {
    const n = parseInt(hex.slice(1), 16);
    return `rgba(${n >> 16}, ${(n >> 8) & 255}, ${n & 255}, ${a})`;
  }

  // Positive values only on a log axis (uPlot cannot place zero or negatives there).
  const forLog = (values, log) => (log ? values.map((v) => (v !== null && v > 0 ? v : null)) : values);

  // One chart's uPlot data and series from the runs' tables. spec: {name, field, log: "train"|"eval",
  // smooth, evalField}; runs: [{name, color, train, eval, started}] (primary first).
  function build(spec, runs, options) {
    const tables = [];
    const series = [];
    runs.forEach((run, index) => {
      const source = spec.log === "eval" ? run.eval : run.train;
      if (!source || !source.step.length || !(spec.field in source.series)) return;
      const trainXs = run.train && run.train.step.length ? xColumn(run.train, options.x, run.started) : null;
      // Evaluations sit on the training run's x axis: their steps mapped through its table.
      const xs = spec.log === "eval" ? (trainXs ? source.step.map((s) => stepToX(run.train, trainXs, s)) : source.step.slice()) : trainXs;
      const raw = source.series[spec.field];
      if (!raw.some((v) => v !== null)) return;
      const label = runs.length > 1 ? run.name : spec.label;
      const columns = [xs];
      if (spec.smooth && options.weight > 0) {
        columns.push(forLog(raw, options.log), forLog(ema(raw, options.weight), options.log));
        series.push({ label: `${label} (raw)`, stroke: alpha(run.color, 0.28), width: 1, run: run.name, raw: true });
        series.push({ label, stroke: run.color, width: 2, run: run.name });
      } else {
        columns.push(forLog(raw, options.log));
        series.push({ label, stroke: run.color, width: 2, run: run.name, dots: spec.log === "eval" });
      }
      tables.push(columns);
      if (spec.evalField && run.eval && run.eval.step.length && spec.evalField in run.eval.series) {
        // Evaluations drawn as points on the same x axis: eval steps mapped through this run's table.
        const evalXs = run.eval.step.map((s) => stepToX(source, xs, s));
        const order = evalXs.map((x, i) => [x, run.eval.series[spec.evalField][i]]).filter(([x, y]) => x !== null && y !== null);
        const unique = new Map(order); // one point per x
        const sorted = [...unique.entries()].sort((a, b) => a[0] - b[0]);
        if (sorted.length && spec.log !== "eval") {
          tables.push([sorted.map((p) => p[0]), forLog(sorted.map((p) => p[1]), options.log)]);
          series.push({ label: runs.length > 1 ? `${run.name} eval` : "eval loss", stroke: run.color, width: 0, run: run.name, points: true });
        }
      }
      if (index === 0) run._xs = xs;
    });
    if (!tables.length) return null;
    const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
    return { data, series, x: options.x };
  }

  // Telemetry charts: one series per device, x = seconds since the run started (samples carry no step).
  // Device charts: one line per device and listed field that has points; `labels` names a field's line
  // (the CPU record's "training process RSS" against "machine RAM in use"), unlabelled fields read as the device.
  function buildDevices(gpu, fields, started, colors, log, labels = {}) {
    const tables = [];
    const series = [];
    const devices = Object.keys((gpu && gpu.series) || {});
    devices.forEach((device) => {
      for (const field of fields) {
        const column = gpu.series[device][field];
        if (!column || !column.points.length) continue;
        const points = column.points;
        const origin = started ?? points[0][0];
        tables.push([points.map((p) => p[0] - origin), forLog(points.map((p) => p[1]), log)]);
        const label = labels[field] ? `${device} ${labels[field]}` : device;
        series.push({ label, stroke: colors[series.length % colors.length], width: 2 });
      }
    });
    if (!tables.length) return null;
    return { data: tables.length === 1 ? tables[0] : uPlot.join(tables), series, x: "time" };
  }

  function axisStyle() {
    const text = cssVar("--muted") || "#6e7781";
    const grid = cssVar("--grid") || "#e9ecef";
    return { stroke: text, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 }, font: "12px system-ui, sans-serif", labelFont: "12px system-ui, sans-serif" };
  }

  // Vertical marker lines: [{x, kind}] with kind checkpoint | best | resume | skipped.
  const MARKER_STYLE = {
    checkpoint: { color: "#868e96", dash: [2, 4], width: 1 },
    best: { color: "#f59f00", dash: [], width: 2 },
    resume: { color: "#e03131", dash: [6, 4], width: 1.5 },
    skipped: { color: "#e03131", dash: [1, 2], width: 1 },
  };
  function drawMarkers(u, markers) {
    const { ctx } = u;
    const { left, top, width, height } = u.bbox;
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top, width, height);
    ctx.clip();
    for (const m of markers) {
      const style = MARKER_STYLE[m.kind];
      const x = Math.round(u.valToPos(m.x, "x", true));
      if (!style || x < left || x > left + width) continue;
      ctx.strokeStyle = style.color;
      ctx.lineWidth = style.width * devicePixelRatio;
      ctx.setLineDash(style.dash.map((d) => d * devicePixelRatio));
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
    }
    ctx.restore();
  }

  // A chart on the page: keeps its uPlot instance across refreshes, so it never blanks while data loads.
  class Chart {
    constructor(spec, figure, hub) {
      this.spec = spec;
      this.figure = figure;
      this.box = figure.querySelector(".chart-box");
      this.hub = hub;
      this.plot = null;
      this.signature = "";
      this.markers = [];
    }

    width() { return Math.max(240, Math.floor(this.box.clientWidth || this.figure.clientWidth || 600)); }
    height() { return this.spec.name === "loss" ? (window.innerWidth < 600 ? 260 : 320) : (window.innerWidth < 600 ? 200 : 220); }

    options(series, opts, xMode) {
      const self = this;
      const style = axisStyle();
      return {
        width: this.width(),
        height: this.height(),
        scales: { x: { time: false }, y: opts.log ? { distr: 3, log: 10 } : { auto: true } },
        legend: { live: true },
        cursor: { drag: { x: true, y: false, setScale: false }, sync: { key: "dashboard", setSeries: false }, points: { size: 7 } },
        series: [
          { label: X_LABELS[xMode], value: (u, v) => (v === null || v === undefined ? "-" : xValue(xMode)(v)) },
          ...series.map((s) => ({
            label: s.label,
            stroke: s.stroke,
            width: s.width,
            spanGaps: !s.points,
            value: (u, v) => fmt(v),
            ...(s.points ? { paths: () => null, points: { show: true, size: 8, fill: s.stroke, stroke: s.stroke } } : { points: { show: !!s.dots, size: 6, fill: s.stroke } }),
          })),
        ],
        axes: [
          { ...style, values: (u, splits) => splits.map(xValue(xMode)), size: 32 },
          { ...style, values: (u, splits) => splits.map(compact), size: 54 },
        ],
        hooks: {
          draw: [(u) => drawMarkers(u, self.markers)],
          setSelect: [(u) => {
            if (u.select.width < 4) return;
            const min = u.posToVal(u.select.left, "x");
            const max = u.posToVal(u.select.left + u.select.width, "x");
            u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
            if (self.xMode !== self.hub.options.x) u.setScale("x", { min, max }); // telemetry: its own zoom
            else self.hub.zoom([min, max]);
          }],
        },
      };
    }

    // Redraw with new data; rebuilds the uPlot instance only when its series or axis options change.
    update(built, opts, markers) {
      this.figure.hidden = !built && this.spec.hideWhenEmpty;
      this.figure.classList.toggle("empty", !built);
      if (!built) { if (this.plot) { this.plot.destroy(); this.plot = null; } this.signature = ""; return; }
      this.markers = markers || [];
      this.xMode = built.x;
      const signature = JSON.stringify([built.series.map((s) => [s.label, s.stroke, !!s.points]), built.x, opts.log]);
      if (!this.plot || signature !== this.signature) {
        const hidden = this.plot ? this.plot.series.slice(1).filter((s) => !s.show).map((s) => s.label) : [];
        if (this.plot) this.plot.destroy();
        this.plot = new uPlot(this.options(built.series, opts, built.x), built.data, this.box);
        this.plot.over.addEventListener("dblclick", () => (this.xMode === this.hub.options.x ? this.hub.zoom(null) : this.plot.setData(this.plot.data, true)));
        this.plot.series.forEach((s, i) => { if (i && hidden.includes(s.label)) this.plot.setSeries(i, { show: false }); });
        this.signature = signature;
      } else {
        this.plot.setData(built.data, true);
      }
      // Zoom applies to the step/time/token axis the user zoomed on; telemetry charts keep their own.
      if (this.hub.range && built.x === opts.x) this.plot.setScale("x", { min: this.hub.range[0], max: this.hub.range[1] });
      this.figure.dataset.points = String(built.data[0].length);
    }

    resize() { if (this.plot) this.plot.setSize({ width: this.width(), height: this.height() }); }
  }

  return { Chart, PALETTE, ema, fmt, compact, clockSpan, xColumn, stepToX, build, buildDevices };
})();
window.Charts = Charts;
