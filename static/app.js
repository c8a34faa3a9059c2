// The run page: polls /api/stats and re-fetches only the parts whose logs changed; charts fetch only
// the steps they do not have yet (/api/series?since_step=) and redraw in place, never blank.
// Every view is a URL: run, compared runs, tab, x axis, smoothing, log y and zoom live in the query string.
"use strict";

const body = document.body;
const token = body.dataset.token || "";
const query = new URLSearchParams(location.search);
const TRAIN_FIELDS = ["loss", "lr", "grad_norm", "tokens_per_sec", "peak_mem_mb"];
const MAX_POINTS = 4000; // per fetch; a chart re-fetches (downsampled again) once appends double that
const RUNS_EVERY = 6; // polls between refreshes of the run list and of compared runs' evaluations
const DEFAULT_WEIGHT = 0.6;

function listParam(name) {
  return query.getAll(name).flatMap((v) => v.split(",")).map((v) => v.trim()).filter(Boolean);
}
function zoomParam() {
  const parts = (query.get("zoom") || "").split(",").map(Number);
  return parts.length === 2 && parts.every(Number.isFinite) && parts[0] < parts[1] ? parts : null;
}

const state = {
  run: body.dataset.run || "",
  compare: listParam("compare"),
  tab: query.get("tab") || "charts",
  options: {
    x: ["step", "time", "tokens"].includes(query.get("x")) ? query.get("x") : "step",
    weight: query.has("smooth") && Number.isFinite(Number(query.get("smooth"))) ? Math.min(0.99, Math.max(0, Number(query.get("smooth")))) : DEFAULT_WEIGHT,
    log: query.get("log") === "1",
  },
  // ?interval= in the URL wins, then the last choice made on this browser, then the server default.
  interval: Number(query.get("interval") || localStorage.getItem("dashboard.interval") || body.dataset.interval) || 5,
  versions: {},
  resumes: null,
  timer: null,
  polls: 0,
  data: {}, // run name -> {train, eval, started, gpu}
  runList: [],
  checkpoints: null,
  markerEvents: [],
  events: null,
  eventKinds: new Set(listParam("events")),
  configAll: query.get("config") === "all",
  outputDir: "",
};

// ------------------------------------------------------------------ URL and fetch

function url(path, params = {}, run = state.run) {
  const q = new URLSearchParams();
  if (run) q.set("run", run);
  for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) q.set(k, v);
  if (token) q.set("token", token);
  const text = q.toString();
  return text ? `${path}?${text}` : path;
}

async function getJSON(path, params, run) {
  const response = await fetch(url(path, params, run), { cache: "no-store" });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}

// The view as a URL: defaults are left out, so a plain link stays short.
function writeURL() {
  const q = new URLSearchParams();
  if (state.run) q.set("run", state.run);
  if (state.compare.length) q.set("compare", state.compare.join(","));
  if (state.tab !== "charts") q.set("tab", state.tab);
  if (state.options.x !== "step") q.set("x", state.options.x);
  if (state.options.weight !== DEFAULT_WEIGHT) q.set("smooth", String(state.options.weight));
  if (state.options.log) q.set("log", "1");
  if (hub.range) q.set("zoom", hub.range.map((v) => Number(v.toPrecision(6))).join(","));
  if (state.eventKinds.size) q.set("events", [...state.eventKinds].join(","));
  if (state.configAll) q.set("config", "all");
  if (query.get("interval")) q.set("interval", query.get("interval"));
  if (token) q.set("token", token);
  history.replaceState(null, "", `?${q}`);
  document.getElementById("api-link").href = url("/api/stats");
}

// ------------------------------------------------------------------ formatting

const num = (value, digits = 4) => (typeof value === "number" ? Charts.fmt(value, digits) : value === null || value === undefined ? "-" : String(value));
function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  seconds = Math.max(0, Math.round(seconds));
  const d = Math.floor(seconds / 86400), h = Math.floor((seconds % 86400) / 3600), m = Math.floor((seconds % 3600) / 60), s = seconds % 60;
  if (d) return `${d} day${d > 1 ? "s" : ""}${h ? ` ${h} h` : ""}`;
  if (h) return `${h} h${m ? ` ${m} min` : ""}`;
  if (m) return `${m} min${s ? ` ${s} s` : ""}`;
  return `${s} s`;
}
function clock(ts) {
  if (!ts) return "-";
  const d = new Date(ts * 1000);
  const today = new Date().toDateString() === d.toDateString();
  return today ? d.toLocaleTimeString([], { hour12: false }) : d.toLocaleString([], { hour12: false });
}
function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
// A path as the run folder sees it: relative to the run's output_dir, else its last two parts.
function shortPath(text) {
  if (typeof text !== "string" || !text.startsWith("/")) return text;
  if (state.outputDir && text.startsWith(`${state.outputDir}/`)) return text.slice(state.outputDir.length + 1);
  const parts = text.split("/").filter(Boolean);
  return parts.length > 2 ? `…/${parts.slice(-2).join("/")}` : text;
}
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(child ?? ""));
  return node;
}
function setStat(name, text) {
  document.querySelectorAll(`[data-stat="${name}"]`).forEach((node) => { node.textContent = text; });
}
// Table rows that reflow to labelled cards on a phone (CSS uses data-label).
function fillTable(table, headers, rows) {
  table.tHead.rows[0].replaceChildren(...headers.map((h) => el("th", {}, h)));
  rows.forEach((tr) => [...tr.cells].forEach((td, i) => td.setAttribute("data-label", headers[i] || "")));
  table.tBodies[0].replaceChildren(...rows);
}

// ------------------------------------------------------------------ stats, runs, tables

function renderStats(s) {
  state.outputDir = s.output_dir || "";
  setStat("status", s.status);
  document.getElementById("status-badge").className = `badge status-${s.status}`;
  document.title = `${s.run} · ${s.status} · dashboard`;
  setStat("status_reason", s.status === "running" && s.status_reason !== "evaluating" ? "" : s.status_reason || "");
  setStat("step", num(s.step));
  setStat("total_steps", num(s.total_steps));
  setStat("progress_pct", s.progress === null ? "-" : `${(s.progress * 100).toFixed(1)}%`);
  document.getElementById("progress-fill").style.width = `${((s.progress || 0) * 100).toFixed(2)}%`;
  const eta = {
    running: s.eta_seconds !== null ? `${duration(s.eta_seconds)} left` : "time left unknown",
    finished: `finished after ${duration(s.elapsed_seconds)}`,
  };
  setStat("eta", eta[s.status] || s.status);
  setStat("loss", s.loss_nonfinite ? "NaN" : num(s.loss));
  setStat("loss_smoothed", num(s.loss_smoothed));
  setStat("best_eval", s.best_eval ? num(s.best_eval.value) : "-");
  setStat("best_eval_step", s.best_eval ? `${s.best_eval.metric} at step ${s.best_eval.step}` : "");
  setStat("lr", num(s.lr, 3));
  setStat("grad_norm", num(s.grad_norm, 3));
  setStat("tokens_per_sec", num(s.tokens_per_sec, 4));
  setStat("steps_per_sec", num(s.steps_per_sec, 3));
  setStat("elapsed", duration(s.elapsed_seconds));
  setStat("last_record_age", s.last_record_age_seconds === null ? "-" : `${duration(s.last_record_age_seconds)} ago`);
  const ck = s.last_checkpoint;
  setStat("last_checkpoint", ck ? `step ${num(ck.step)}` : "-");
  setStat("checkpoint_note", ck ? `${ck.name}${ck.best ? " · best" : ""}${ck.on_disk ? "" : " · pruned"}` : "");
  setStat("error_count", String(s.error_count));
  const bad = Object.values(s.bad_lines || {}).reduce((a, b) => a + b, 0);
  setStat("error_note", [s.nonfinite_steps ? `${s.nonfinite_steps} NaN steps` : "", bad ? `${bad} bad log lines skipped` : ""].filter(Boolean).join(" · "));
  setStat("model", s.model || "-");
  setStat("method", s.method || "");
  setStat("kernels", s.kernels ? s.kernels.summary : "");
  body.dataset.loaded = "1";
}

function renderRuns(data) {
  state.runList = data.runs;
  const picker = document.getElementById("run-picker");
  picker.replaceChildren(...data.runs.map((r) => el("option", { value: r.name }, `${r.name} (${r.status})`)));
  picker.value = state.run;
  renderCompare();
}

function renderCompare() {
  const picker = document.getElementById("compare-picker");
  const candidates = state.runList.filter((r) => r.name !== state.run && !state.compare.includes(r.name));
  picker.replaceChildren(el("option", { value: "" }, "+ add a run"), ...candidates.map((r) => el("option", { value: r.name }, r.name)));
  picker.value = "";
  const chips = [state.run, ...state.compare].map((name, i) => {
    const chip = el("span", { class: "chip", "data-run": name }, el("span", { class: "swatch" }), name);
    chip.firstChild.style.background = Charts.PALETTE[i % Charts.PALETTE.length];
    if (i > 0) {
      const remove = el("button", { type: "button", "aria-label": `stop comparing ${name}` }, "×");
      remove.addEventListener("click", () => setCompare(state.compare.filter((n) => n !== name)));
      chip.append(remove);
    }
    return chip;
  });
  document.getElementById("compare-chips").replaceChildren(...(state.compare.length ? chips : []));
}

function renderCheckpoints(data) {
  state.checkpoints = data;
  const rows = data.checkpoints.slice().reverse().map((c) => {
    const tr = el("tr", { class: `${c.best ? "best" : ""} ${c.pruned ? "pruned" : ""}`.trim() },
      el("td", {}, num(c.step)),
      el("td", {}, c.best ? el("span", { class: "star", title: "best" }, "★ ") : "", c.name),
      el("td", {}, clock(c.ts)),
      el("td", {}, bytes(c.size_bytes)),
      el("td", {}, c.metric ? `${c.metric} ${num(c.metric_value)}` : "-"),
      el("td", {}, c.on_disk ? (c.best ? "on disk · best" : "on disk") : "pruned"));
    tr.dataset.step = c.step;
    return tr;
  });
  fillTable(document.getElementById("checkpoint-table"), ["step", "name", "saved", "size", "metric", "state"], rows);
}

function renderEvals(data) {
  const bestStep = data.best ? data.best.step : null;
  const hasTask = data.evals.some((e) => e.task);
  const metricNames = [...new Set(data.evals.flatMap((e) => (e.metrics ? Object.keys(e.metrics) : [])))];
  const headers = ["step", ...(hasTask ? ["task"] : []), "eval loss", "perplexity", ...metricNames];
  const rows = data.evals.slice().reverse().map((e) => el("tr", { class: e.step === bestStep ? "best" : "" },
    el("td", {}, num(e.step)), ...(hasTask ? [el("td", {}, e.task || "-")] : []),
    el("td", {}, num(e.eval_loss)), el("td", {}, num(e.perplexity)),
    ...metricNames.map((m) => el("td", {}, num(e.metrics ? e.metrics[m] : null)))));
  fillTable(document.getElementById("eval-table"), headers, rows);
  const last = data.evals[data.evals.length - 1];
  const highlights = [];
  if (data.best) highlights.push(`best ${data.best.metric} ${num(data.best.value)} at step ${data.best.step}`);
  if (last) highlights.push(`latest eval loss ${num(last.eval_loss)} at step ${last.step}`);
  if (!data.evals.length) highlights.push("no evaluations logged yet");
  document.getElementById("eval-highlights").replaceChildren(...highlights.map((h) => el("span", { class: "highlight" }, h)));
}

function meter(fraction) {
  const bar = el("div", { class: "meter" }, el("div"));
  bar.firstChild.style.width = `${Math.max(0, Math.min(1, fraction || 0)) * 100}%`;
  return bar;
}

function renderGpu(data) {
  const cards = data.devices.map((d) => {
    const isCpu = d.device === "cpu";
    const util = isCpu ? d.cpu_pct : d.util_pct;
    const used = isCpu ? d.ram_used_mb : d.mem_used_mb;
    const total = isCpu ? d.ram_total_mb : d.mem_total_mb;
    return el("div", { class: "card gpu-card" },
      el("h2", {}, `${d.host ? d.host + " " : ""}${d.device}`),
      el("p", { class: "small" }, d.name || (isCpu ? "CPU" : "")),
      el("p", { class: "small" }, `${isCpu ? "CPU busy" : "utilisation"} ${num(util, 3)}%`), meter((util || 0) / 100),
      el("p", { class: "small" }, `${isCpu ? "machine RAM in use (all processes)" : "memory"} ${num(used, 4)} / ${num(total, 4)} MiB`), meter(total ? used / total : 0),
      isCpu && d.proc_rss_mb !== undefined ? el("p", { class: "small" }, `training process RSS ${num(d.proc_rss_mb, 4)} MiB${d.children_rss_mb ? ` + workers ${num(d.children_rss_mb, 4)} MiB` : ""}`) : "",
      el("p", { class: "small" }, [d.temp_c !== undefined ? `${num(d.temp_c, 3)} °C` : "", d.power_w !== undefined ? `${num(d.power_w, 3)} W` : ""].filter(Boolean).join(" · ")),
      el("p", { class: "small muted" }, `sampled ${clock(d.ts)}`));
  });
  document.getElementById("gpu-cards").replaceChildren(...(cards.length ? cards : [el("p", { class: "muted" }, "no telemetry logged yet")]));
}

// ------------------------------------------------------------------ events timeline

function detailValue(value) {
  if (typeof value === "number") return num(value);
  if (typeof value === "string") return shortPath(value);
  if (Array.isArray(value)) return value.length > 6 ? `${value.slice(0, 6).map(detailValue).join(", ")}, … (${value.length})` : value.map(detailValue).join(", ");
  if (value && typeof value === "object") return Object.entries(value).map(([k, v]) => `${k} ${detailValue(v)}`).join(", ");
  return String(value);
}

function renderEvents(data) {
  state.events = data;
  const filter = document.getElementById("event-filter");
  const kinds = Object.entries(data.counts).sort((a, b) => a[0].localeCompare(b[0]));
  filter.replaceChildren(...kinds.map(([kind, count]) => {
    const box = el("input", { type: "checkbox", value: kind });
    box.checked = !state.eventKinds.size || state.eventKinds.has(kind);
    box.addEventListener("change", () => {
      const chosen = [...filter.querySelectorAll("input:checked")].map((i) => i.value);
      state.eventKinds = new Set(chosen.length === kinds.length ? [] : chosen);
      writeURL();
      renderEvents(state.events);
    });
    return el("label", { class: `chip ev-${kind}` }, box, ` ${kind.replaceAll("_", " ")} (${count})`);
  }));
  const skip = new Set(["ts", "event", "step"]);
  const shown = data.events.filter((e) => !state.eventKinds.size || state.eventKinds.has(e.event));
  const items = shown.slice().reverse().map((e) => {
    const details = Object.entries(e).filter(([k, v]) => !skip.has(k) && v !== null && v !== undefined && v !== "");
    return el("li", { class: `ev-${e.event}` },
      el("time", {}, clock(e.ts)),
      el("span", { class: "ev-kind" }, e.event.replaceAll("_", " ")),
      e.step !== null && e.step !== undefined ? el("span", { class: "ev-step" }, `step ${num(e.step)}`) : "",
      el("span", { class: "ev-details" }, ...details.map(([k, v]) => el("span", { class: "ev-detail" }, el("b", {}, k.replaceAll("_", " ")), ` ${detailValue(v)}`))));
  });
  document.getElementById("event-timeline").replaceChildren(...(items.length ? items : [el("li", { class: "muted" }, "no events")]));
}

function renderErrors(data) {
  const panel = document.getElementById("error-panel");
  panel.hidden = data.count === 0;
  if (!data.count) return;
  const last = data.errors[data.errors.length - 1];
  document.getElementById("error-summary").textContent =
    `${data.count} error(s); last at step ${last.step ?? "-"} on rank ${last.rank ?? "-"}: ${last.type}: ${last.message}`;
  document.getElementById("error-traceback").textContent = last.traceback || "";
}

// ------------------------------------------------------------------ config and comparison

async function refreshConfig() {
  const runs = [state.run, ...state.compare];
  const data = await getJSON("/api/config", { run: runs.join(","), all: state.configAll ? "1" : "" }, "");
  const table = document.getElementById("config-table");
  const several = runs.length > 1;
  document.getElementById("config-all-label").hidden = !several;
  const missing = data.runs.filter((_, i) => !data.found[i]);
  const note = [];
  if (several) note.push(state.configAll ? `all ${data.keys.length} keys` : `${data.keys.length} of ${data.total_keys} keys differ`);
  if (missing.length) note.push(`no config.yaml in ${missing.join(", ")}`);
  document.getElementById("config-note").textContent = note.join(" · ");
  const rows = data.keys.map((key) => {
    const values = data.values[key];
    const differs = new Set(values.map((v) => JSON.stringify(v))).size > 1;
    return el("tr", { class: differs && several ? "differs" : "" }, el("td", {}, el("code", {}, key)),
      ...values.map((v) => el("td", {}, v === null || v === undefined ? "-" : typeof v === "object" ? JSON.stringify(v) : num(v))));
  });
  fillTable(table, ["key", ...data.runs], rows);
}

// ------------------------------------------------------------------ charts

const hub = {
  range: zoomParam(),
  options: state.options,
  charts: {},
  zoom(range) {
    this.range = range;
    document.getElementById("reset-zoom").disabled = !range;
    for (const chart of Object.values(this.charts)) {
      if (!chart.plot || chart.xMode !== state.options.x) continue;
      if (range) chart.plot.setScale("x", { min: range[0], max: range[1] });
      else chart.plot.setData(chart.plot.data, true);
    }
    writeURL();
  },
};

const CHART_SPECS = {
  loss: { name: "loss", field: "loss", label: "loss", log: "train", smooth: true, evalField: "eval_loss", csv: ["loss"] },
  lr: { name: "lr", field: "lr", label: "learning rate", log: "train", smooth: false, csv: ["lr"] },
  throughput: { name: "throughput", field: "tokens_per_sec", label: "tokens/s", log: "train", smooth: true, csv: ["tokens_per_sec"] },
  grad_norm: { name: "grad_norm", field: "grad_norm", label: "grad norm", log: "train", smooth: true, csv: ["grad_norm"] },
  memory: { name: "memory", field: "peak_mem_mb", label: "peak MiB", log: "train", smooth: false, csv: ["peak_mem_mb"] },
  gpu_util: { name: "gpu_util", devices: ["util_pct", "cpu_pct"], hideWhenEmpty: true },
  // A CPU run's own memory is its process's RSS; the node's RAM in use (all processes) stays as a second line.
  gpu_memory: { name: "gpu_memory", devices: ["mem_used_mb", "proc_rss_mb", "ram_used_mb"], hideWhenEmpty: true,
    labels: { proc_rss_mb: "training process RSS", ram_used_mb: "machine RAM in use (all processes)" } },
};

function chartFor(name) {
  if (!hub.charts[name]) {
    const figure = document.querySelector(`figure[data-chart="${name}"]`);
    if (!figure) return null;
    hub.charts[name] = new Charts.Chart(CHART_SPECS[name], figure, hub);
  }
  return hub.charts[name];
}

// An evaluation metric (metrics.<name>) gets its own chart after the loss, made on first sight.
function evalChart(field) {
  const name = `eval:${field}`;
  if (!CHART_SPECS[name]) {
    const label = field.replace(/^metrics\./, "");
    CHART_SPECS[name] = { name, field, label, log: "eval", smooth: false, csv: [field] };
    const figure = el("figure", { class: "plot plot-eval", "data-chart": name },
      el("figcaption", {}, el("span", { class: "chart-title" }, `eval ${label}`),
        el("span", { class: "downloads" }, el("a", { class: "csv", href: "#", download: "" }, "CSV"))),
      el("div", { class: "chart-box" }), el("p", { class: "chart-empty muted" }, "no data logged yet"));
    document.querySelector('figure[data-chart="loss"]').after(figure);
  }
  return chartFor(name);
}

function runsShown() {
  return [state.run, ...state.compare].map((name, i) => ({ name, color: Charts.PALETTE[i % Charts.PALETTE.length], ...(state.data[name] || {}) }));
}

function markers() {
  const primary = state.data[state.run];
  if (!primary || !primary.train || !primary.train.step.length) return [];
  const xs = Charts.xColumn(primary.train, state.options.x, primary.started);
  const at = (step) => Charts.stepToX(primary.train, xs, step);
  const out = [];
  for (const c of (state.checkpoints ? state.checkpoints.checkpoints : [])) if (c.step !== null) out.push({ x: at(c.step), kind: c.best ? "best" : "checkpoint" });
  for (const e of state.markerEvents) if (typeof e.step === "number") out.push({ x: at(e.step), kind: e.event === "resume" ? "resume" : "skipped" });
  return out;
}

function drawCharts() {
  const runs = runsShown();
  const fields = new Set(runs.flatMap((r) => (r.eval ? Object.keys(r.eval.series).filter((f) => f.startsWith("metrics.")) : [])));
  fields.forEach(evalChart);
  for (const [name, spec] of Object.entries(CHART_SPECS)) {
    const chart = chartFor(name);
    if (!chart) continue;
    let built;
    if (spec.devices) {
      const gpu = state.data[state.run] && state.data[state.run].gpu;
      built = Charts.buildDevices(gpu, spec.devices, state.data[state.run] && state.data[state.run].started, Charts.PALETTE, state.options.log, spec.labels);
    } else {
      built = Charts.build(spec, runs, state.options);
    }
    chart.update(built, state.options, name === "loss" ? markers() : []);
  }
  updateDownloads();
  document.getElementById("reset-zoom").disabled = !hub.range;
  body.dataset.charts = String(Date.now());
}

function updateDownloads() {
  const png = { smoothing: state.options.weight > 0 ? "ema" : "off", weight: state.options.weight > 0 ? String(state.options.weight) : "", log: state.options.log ? "1" : "" };
  document.querySelectorAll("a.png[data-plot]").forEach((a) => {
    const compare = a.dataset.plot === "loss" && state.compare.length ? { compare: state.compare[0] } : {};
    a.href = url(`/api/plots/${a.dataset.plot}.png`, { ...png, ...compare });
  });
  document.querySelectorAll("figure[data-chart]").forEach((figure) => {
    const spec = CHART_SPECS[figure.dataset.chart];
    const link = figure.querySelector("a.csv");
    if (!spec || !link) return;
    link.href = spec.devices
      ? url("/api/gpu", { field: spec.devices.join(","), max_points: "0", format: "csv" })
      : url("/api/metrics", { field: spec.csv.join(","), log: spec.log, max_points: "0", format: "csv" });
  });
}

function appendColumns(table, more) {
  table.step.push(...more.step);
  table.wall.push(...more.wall);
  if (table.tokens_seen && more.tokens_seen) table.tokens_seen.push(...more.tokens_seen);
  for (const f of Object.keys(table.series)) table.series[f].push(...(more.series[f] || more.step.map(() => null)));
}

// Training series of one run: everything once, then only steps after the last one held.
async function refreshTrain(name, full) {
  const held = state.data[name] || (state.data[name] = {});
  const last = held.train && held.train.step.length ? held.train.step[held.train.step.length - 1] : null;
  if (full || last === null || held.train.step.length > 2 * MAX_POINTS) {
    const table = await getJSON("/api/series", { field: TRAIN_FIELDS.join(","), max_points: MAX_POINTS }, name);
    held.train = table;
    held.started = table.started_at ?? (table.wall.length ? table.wall[0] : null);
    return true;
  }
  const more = await getJSON("/api/series", { field: TRAIN_FIELDS.join(","), since_step: last + 1, max_points: MAX_POINTS }, name);
  if (!more.step.length) return false;
  appendColumns(held.train, more);
  return true;
}

async function refreshEval(name) {
  const held = state.data[name] || (state.data[name] = {});
  let table = await getJSON("/api/series", { log: "eval", field: "eval_loss" }, name);
  const metrics = table.fields.filter((f) => f.startsWith("metrics."));
  if (metrics.length) table = await getJSON("/api/series", { log: "eval", field: ["eval_loss", ...metrics].join(",") }, name);
  held.eval = table;
}

async function refreshGpu() {
  const held = state.data[state.run] || (state.data[state.run] = {});
  held.gpu = await getJSON("/api/gpu", { field: "util_pct,cpu_pct,mem_used_mb,proc_rss_mb,ram_used_mb", max_points: "1000" });
}

// The expert heatmap stays a matplotlib image (a layer x expert grid, not a series); shown for MoE runs.
async function refreshExperts(version) {
  const experts = await getJSON("/api/experts");
  const figure = document.querySelector('figure[data-chart="experts"]');
  figure.hidden = !experts.windows;
  if (experts.windows) document.getElementById("plot-experts").src = url("/api/plots/experts.png", { v: version });
}

// ------------------------------------------------------------------ polling

const sections = {
  checkpoints: { sources: ["events", "run"], path: "/api/checkpoints", render: renderCheckpoints },
  evals: { sources: ["eval"], path: "/api/evals", render: renderEvals },
  gpu: { sources: ["gpu"], path: "/api/gpu", params: { series: "0" }, render: renderGpu },
  events: { sources: ["events"], path: "/api/events", params: { limit: "500" }, render: renderEvents },
  markers: { sources: ["events", "markers"], path: "/api/events", params: { event: "resume,step_skipped", limit: "5000" }, render: (d) => { state.markerEvents = d.events; } },
  errors: { sources: ["errors"], path: "/api/errors", render: renderErrors },
};

async function refreshSections(changed) {
  const jobs = Object.values(sections)
    .filter((s) => !changed || s.sources.some((src) => changed.has(src)))
    .map((s) => getJSON(s.path, s.params).then(s.render));
  await Promise.allSettled(jobs);
}

async function refreshCharts(changed, stats) {
  const jobs = [];
  const resumed = stats && state.resumes !== null && stats.resumes !== state.resumes;
  if (!changed || changed.has("train")) jobs.push(refreshTrain(state.run, !changed || resumed));
  if (!changed || changed.has("eval")) jobs.push(refreshEval(state.run));
  if (!changed || changed.has("gpu")) jobs.push(refreshGpu());
  const compareTick = !changed || state.polls % RUNS_EVERY === 0;
  for (const name of state.compare) {
    jobs.push(refreshTrain(name, !changed));
    if (compareTick || !(state.data[name] && state.data[name].eval)) jobs.push(refreshEval(name));
  }
  await Promise.allSettled(jobs);
  drawCharts();
}

async function poll() {
  clearTimeout(state.timer);
  try {
    if (!state.run || state.polls % RUNS_EVERY === 0) {
      const runs = await getJSON("/api/runs", {}, "");
      if (!runs.latest) return;
      if (!state.run) {
        state.run = runs.latest;
        document.getElementById("empty-root")?.remove();
        writeURL();
      }
      renderRuns(runs);
    }
    state.polls += 1;
    const stats = await getJSON("/api/stats");
    renderStats(stats);
    const changed = new Set(Object.keys(stats.versions).filter((k) => stats.versions[k] !== state.versions[k]));
    const first = !Object.keys(state.versions).length;
    state.versions = stats.versions;
    if (changed.size || state.compare.length) {
      await refreshSections(first ? null : changed);
      if (first || changed.has("experts")) await refreshExperts(stats.versions.experts);
      await refreshCharts(first ? null : changed, stats);
      if (changed.has("run") && state.tab === "config") await refreshConfig();
    }
    state.resumes = stats.resumes;
    body.dataset.error = "";
  } catch (error) {
    body.dataset.error = String(error.message || error);
  } finally {
    state.timer = setTimeout(poll, state.interval * 1000);
  }
}

async function switchRun(name) {
  state.run = name;
  state.compare = state.compare.filter((n) => n !== name);
  state.versions = {};
  state.resumes = null;
  state.data = {};
  hub.range = null;
  writeURL();
  renderCompare();
  await poll();
  if (state.tab === "config") await refreshConfig();
}

async function setCompare(names) {
  state.compare = names;
  writeURL();
  renderCompare();
  await refreshCharts(null, null);
  if (state.tab === "config") await refreshConfig();
}

function showTab(tab) {
  if (!document.getElementById(`panel-${tab}`)) tab = "charts";
  state.tab = tab;
  document.querySelectorAll("[role=tab]").forEach((b) => b.setAttribute("aria-selected", String(b.dataset.tab === tab)));
  document.querySelectorAll(".tab-panel").forEach((p) => { p.hidden = p.id !== `panel-${tab}`; });
  if (tab === "charts") Object.values(hub.charts).forEach((c) => c.resize());
  if (tab === "config") refreshConfig().catch((e) => { body.dataset.error = String(e.message || e); });
  writeURL();
}

function start() {
  const initial = JSON.parse(document.getElementById("initial-data").textContent);
  const controls = { x: document.getElementById("x-axis"), smoothing: document.getElementById("smoothing"), log: document.getElementById("log-y") };
  controls.x.value = state.options.x;
  controls.smoothing.value = String(state.options.weight);
  document.getElementById("smoothing-value").textContent = String(state.options.weight);
  controls.log.checked = state.options.log;
  if (initial) {
    state.outputDir = (initial.stats && initial.stats.output_dir) || "";
    renderRuns(initial.runs);
    renderStats(initial.stats);
    renderCheckpoints(initial.checkpoints);
    renderEvals(initial.evals);
    renderGpu(initial.gpu);
    renderEvents(initial.events);
    renderErrors(initial.errors);
    state.versions = initial.stats.versions;
    state.resumes = initial.stats.resumes;
    const firstCharts = async () => {
      await refreshSections(new Set(["markers"]));
      await refreshCharts(null, null);
      if (initial.experts && initial.experts.windows) await refreshExperts(initial.stats.versions.experts);
    };
    firstCharts().catch((e) => { body.dataset.error = String(e.message || e); });
  }
  showTab(state.tab);
  const intervalPicker = document.getElementById("interval-picker");
  if ([...intervalPicker.options].some((o) => Number(o.value) === state.interval)) intervalPicker.value = String(state.interval);
  intervalPicker.addEventListener("change", () => {
    state.interval = Number(intervalPicker.value);
    localStorage.setItem("dashboard.interval", intervalPicker.value);
    poll();
  });
  document.getElementById("run-picker").addEventListener("change", (e) => switchRun(e.target.value));
  document.getElementById("compare-picker").addEventListener("change", (e) => { if (e.target.value) setCompare([...state.compare, e.target.value]); });
  document.querySelectorAll("[role=tab]").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  controls.x.addEventListener("change", () => { state.options.x = controls.x.value; hub.range = null; writeURL(); drawCharts(); });
  controls.log.addEventListener("change", () => { state.options.log = controls.log.checked; writeURL(); drawCharts(); });
  controls.smoothing.addEventListener("input", () => {
    state.options.weight = Number(controls.smoothing.value);
    document.getElementById("smoothing-value").textContent = controls.smoothing.value;
    writeURL();
    drawCharts();
  });
  document.getElementById("reset-zoom").addEventListener("click", () => hub.zoom(null));
  document.getElementById("config-all").checked = state.configAll;
  document.getElementById("config-all").addEventListener("change", (e) => { state.configAll = e.target.checked; writeURL(); refreshConfig(); });
  let resizeTimer = null;
  window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(() => Object.values(hub.charts).forEach((c) => c.resize()), 100); });
  writeURL();
  state.timer = setTimeout(poll, initial ? state.interval * 1000 : 0);
}

window.dashboard = { state, hub, Charts };
start();
