// Keeps the dashboard page fresh in place: polls /api/stats, and when a log's data version
// changes, re-fetches only the parts (tables, plots) that draw on that log. No full reloads.
"use strict";

const body = document.body;
const token = body.dataset.token || "";
const state = {
  run: body.dataset.run || "",
  compare: "",
  // ?interval= in the URL wins, then the last choice made on this browser, then the server default.
  interval: Number(new URLSearchParams(location.search).get("interval") ||
    localStorage.getItem("dashboard.interval") || body.dataset.interval) || 5,
  versions: {},
  timer: null,
  polls: 0,
};
const RUNS_EVERY = 6; // polls between refreshes of the run list (new runs, their status)
const plotSources = JSON.parse(document.getElementById("plot-sources").textContent);

function url(path, params = {}) {
  const query = new URLSearchParams();
  if (state.run) query.set("run", state.run);
  for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) query.set(k, v);
  if (token) query.set("token", token);
  const text = query.toString();
  return text ? `${path}?${text}` : path;
}

async function getJSON(path, params) {
  const response = await fetch(url(path, params), { cache: "no-store" });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}

// ------------------------------------------------------------------ formatting

function num(value, digits = 4) {
  if (value === null || value === undefined) return "-";
  if (typeof value !== "number") return String(value); // records are shown as the trainer wrote them
  if (Number.isInteger(value)) return value.toLocaleString("en-US");
  return Number(value.toPrecision(digits)).toString();
}
function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  seconds = Math.max(0, Math.round(seconds));
  const h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60), s = seconds % 60;
  return h ? `${h}h ${String(m).padStart(2, "0")}m` : `${m}m ${String(s).padStart(2, "0")}s`;
}
function clock(ts) {
  if (!ts) return "-";
  const d = new Date(ts * 1000);
  return d.toLocaleString();
}
function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
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

// ------------------------------------------------------------------ renderers

function renderStats(s) {
  setStat("status", s.status);
  const badge = document.getElementById("status-badge");
  badge.className = `badge status-${s.status}`;
  setStat("status_reason", s.status === "running" ? "" : `(${s.status_reason})`);
  setStat("step", num(s.step));
  setStat("total_steps", num(s.total_steps));
  setStat("progress_pct", s.progress === null ? "-" : `${(s.progress * 100).toFixed(1)}%`);
  document.getElementById("progress-fill").style.width = `${((s.progress || 0) * 100).toFixed(2)}%`;
  setStat("eta", s.status === "running" ? duration(s.eta_seconds) : (s.status === "finished" ? "done" : "-"));
  setStat("loss", s.loss_nonfinite ? "NaN" : num(s.loss));
  setStat("loss_smoothed", num(s.loss_smoothed));
  setStat("best_eval", s.best_eval ? num(s.best_eval.eval_loss) : "-");
  setStat("best_eval_step", s.best_eval ? `step ${s.best_eval.step}` : "");
  setStat("lr", num(s.lr, 3));
  setStat("grad_norm", num(s.grad_norm, 3));
  setStat("tokens_per_sec", num(s.tokens_per_sec, 5));
  setStat("steps_per_sec", num(s.steps_per_sec, 3));
  setStat("elapsed", duration(s.elapsed_seconds));
  setStat("last_record_age", s.last_record_age_seconds === null ? "-" : `${duration(s.last_record_age_seconds)} ago`);
  const ck = s.last_checkpoint;
  setStat("last_checkpoint", ck ? ck.name : "-");
  setStat("checkpoint_note", ck ? `${clock(ck.ts)}${ck.on_disk ? "" : " (pruned)"}${ck.best ? " ★ best" : ""}` : "");
  setStat("error_count", String(s.error_count));
  const bad = Object.values(s.bad_lines || {}).reduce((a, b) => a + b, 0);
  setStat("error_note", [s.nonfinite_steps ? `${s.nonfinite_steps} non-finite` : "", bad ? `${bad} bad lines skipped` : ""].filter(Boolean).join(" · "));
  setStat("model", s.model || "-");
  setStat("method", s.method || "");
  setStat("kernels", s.kernels ? s.kernels.summary : "");
  document.title = `${s.run} · ${s.status} · step ${num(s.step)}`;
  body.dataset.loaded = "1";
  body.dataset.step = s.step === null ? "" : String(s.step);
}

function renderRuns(data) {
  const picker = document.getElementById("run-picker");
  const compare = document.getElementById("compare-picker");
  picker.replaceChildren(...data.runs.map((r) => el("option", { value: r.name }, `${r.name} (${r.status})`)));
  picker.value = state.run;
  const others = data.runs.filter((r) => r.name !== state.run);
  compare.replaceChildren(el("option", { value: "" }, "(none)"), ...others.map((r) => el("option", { value: r.name }, r.name)));
  compare.value = others.some((r) => r.name === state.compare) ? state.compare : "";
  state.compare = compare.value;
}

function renderCheckpoints(data) {
  const rows = data.checkpoints.slice().reverse().map((c) => {
    const tr = el("tr", { class: `${c.best ? "best" : ""} ${c.pruned ? "pruned" : ""}`.trim() },
      el("td", {}, num(c.step)),
      el("td", {}, c.best ? el("span", { class: "star", title: "best" }, "★ ") : "", c.name),
      el("td", {}, clock(c.ts)),
      el("td", {}, bytes(c.size_bytes)),
      el("td", {}, c.metric ? `${c.metric} ${num(c.metric_value)}` : "-"),
      el("td", {}, c.on_disk ? "on disk" : "pruned"));
    tr.dataset.step = c.step;
    return tr;
  });
  document.querySelector("#checkpoint-table tbody").replaceChildren(...rows);
}

function renderEvals(data) {
  const bestStep = data.best ? data.best.step : null;
  const rows = data.evals.slice().reverse().map((e) => el("tr", { class: e.step === bestStep ? "best" : "" },
    el("td", {}, num(e.step)), el("td", {}, e.task || ""), el("td", {}, num(e.eval_loss)),
    el("td", {}, num(e.perplexity)),
    el("td", {}, e.metrics ? Object.entries(e.metrics).map(([k, v]) => `${k} ${num(v)}`).join(", ") : "")));
  document.querySelector("#eval-table tbody").replaceChildren(...rows);
  const last = data.evals[data.evals.length - 1];
  const highlights = [];
  if (data.best) highlights.push(`best eval loss ${num(data.best.eval_loss)} at step ${data.best.step}`);
  if (last) highlights.push(`latest ${num(last.eval_loss)} at step ${last.step}`);
  if (data.best && data.best.metrics) highlights.push(...Object.entries(data.best.metrics).map(([k, v]) => `best ${k} ${num(v)}`));
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
    const card = el("div", { class: "card gpu-card" },
      el("h2", {}, `${d.host ? d.host + " " : ""}${d.device}`),
      el("p", { class: "small" }, d.name || (isCpu ? "CPU" : "")),
      el("p", { class: "small" }, `util ${num(util, 3)}%`), meter((util || 0) / 100),
      el("p", { class: "small" }, `memory ${num(used, 5)} / ${num(total, 5)} MiB`), meter(total ? used / total : 0),
      el("p", { class: "small" }, [d.temp_c !== undefined ? `${num(d.temp_c, 3)} °C` : "", d.power_w !== undefined ? `${num(d.power_w, 3)} W` : ""].filter(Boolean).join(" · ")),
      el("p", { class: "small muted" }, `sampled ${clock(d.ts)}`));
    return card;
  });
  document.getElementById("gpu-cards").replaceChildren(...(cards.length ? cards : [el("p", { class: "muted" }, "no telemetry logged yet")]));
}

function eventText(e) {
  const skip = new Set(["ts", "event", "step"]);
  const details = Object.entries(e).filter(([k]) => !skip.has(k))
    .map(([k, v]) => `${k}=${typeof v === "object" && v !== null ? JSON.stringify(v) : v}`).join(" ");
  return `${clock(e.ts)} · ${e.event}${e.step !== null && e.step !== undefined ? ` @ step ${e.step}` : ""} ${details}`;
}

function renderEvents(data) {
  const items = data.events.slice(-200).reverse().map((e) => el("li", { class: `ev-${e.event}` }, eventText(e)));
  document.getElementById("event-timeline").replaceChildren(...items);
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

// ------------------------------------------------------------------ plots

function plotParams() {
  const params = {
    smoothing: document.getElementById("smoothing").value,
    weight: document.getElementById("weight").value,
    ma_window: document.getElementById("ma-window").value,
    log: document.getElementById("log-y").checked ? "1" : "",
  };
  return params;
}

function refreshPlots(changed, only = null) {
  const params = plotParams();
  document.querySelectorAll("img[data-plot]").forEach((img) => {
    const name = img.dataset.plot;
    const sources = plotSources[name] || [];
    if (only && name !== only) return;
    if (changed && !sources.some((s) => changed.has(s))) return;
    const version = sources.map((s) => state.versions[s]).join("-");
    const extra = name === "loss" ? { compare: state.compare } : {};
    img.src = url(`/api/plots/${name}.png`, { ...params, ...extra, v: version });
  });
}

// ------------------------------------------------------------------ polling

const sections = {
  checkpoints: { sources: ["events", "run"], path: "/api/checkpoints", render: renderCheckpoints },
  evals: { sources: ["eval"], path: "/api/evals", render: renderEvals },
  gpu: { sources: ["gpu"], path: "/api/gpu", params: { series: "0" }, render: renderGpu },
  events: { sources: ["events"], path: "/api/events", params: { limit: "200" }, render: renderEvents },
  errors: { sources: ["errors"], path: "/api/errors", render: renderErrors },
};

async function refreshSections(changed) {
  const jobs = Object.values(sections)
    .filter((s) => !changed || s.sources.some((src) => changed.has(src)))
    .map((s) => getJSON(s.path, s.params).then(s.render));
  await Promise.allSettled(jobs);
}

async function poll() {
  clearTimeout(state.timer);
  try {
    if (!state.run || state.polls % RUNS_EVERY === 0) {
      const runs = await getJSON("/api/runs");
      if (!runs.latest) return;
      if (!state.run) {
        state.run = runs.latest;
        document.getElementById("empty-root")?.remove();
      }
      renderRuns(runs);
    }
    state.polls += 1;
    const stats = await getJSON("/api/stats");
    renderStats(stats);
    const changed = new Set(Object.keys(stats.versions).filter((k) => stats.versions[k] !== state.versions[k]));
    state.versions = stats.versions;
    if (changed.size) {
      await refreshSections(changed);
      refreshPlots(changed);
    }
    body.dataset.error = "";
  } catch (error) {
    body.dataset.error = String(error.message || error);
  } finally {
    state.timer = setTimeout(poll, state.interval * 1000);
  }
}

async function switchRun(name) {
  state.run = name;
  state.versions = {};
  const query = new URLSearchParams(location.search);
  query.set("run", name);
  history.replaceState(null, "", `?${query}`);
  renderRuns(await getJSON("/api/runs"));
  await poll();
}

function start() {
  const initial = JSON.parse(document.getElementById("initial-data").textContent);
  if (initial) {
    renderRuns(initial.runs);
    renderStats(initial.stats);
    renderCheckpoints(initial.checkpoints);
    renderEvals(initial.evals);
    renderGpu(initial.gpu);
    renderEvents(initial.events);
    renderErrors(initial.errors);
    state.versions = initial.stats.versions;
    refreshPlots(null);
  }
  const intervalPicker = document.getElementById("interval-picker");
  if ([...intervalPicker.options].some((o) => Number(o.value) === state.interval)) intervalPicker.value = String(state.interval);
  intervalPicker.addEventListener("change", () => {
    state.interval = Number(intervalPicker.value);
    localStorage.setItem("dashboard.interval", intervalPicker.value);
    poll();
  });
  document.getElementById("run-picker").addEventListener("change", (e) => switchRun(e.target.value));
  document.getElementById("compare-picker").addEventListener("change", (e) => {
    state.compare = e.target.value;
    refreshPlots(null, "loss");
  });
  for (const id of ["smoothing", "weight", "ma-window", "log-y"]) {
    document.getElementById(id).addEventListener("change", () => refreshPlots(null));
  }
  document.getElementById("api-link").href = url("/api/stats");
  state.timer = setTimeout(poll, initial ? state.interval * 1000 : 0);
}

start();
