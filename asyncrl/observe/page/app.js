// The dashboard: polls the control API (same origin, the token is a same-site cookie) every POLL_MS
// and redraws. Records come from /metrics by byte offset, so each is fetched once.
"use strict";

const POLL_MS = 2000;
const PHASES = [["trainer", "forward_backward"], ["trainer", "wait_batch"], ["inference", "generate"],
                ["inference", "recompute_kv"], ["orchestrator", "cpu"]];
const state = { offset: 0, steps: [], evals: [], charts: {}, keys: null };

function chart(id, series, xLabel) {
  const el = document.getElementById(id);
  const opts = { width: 540, height: 220, scales: { x: { time: false } },
                 axes: [{ label: xLabel }, {}], series: [{ label: xLabel }, ...series] };
  return new uPlot(opts, [[], ...series.map(() => [])], el);
}

function setUp() {
  const line = (label, stroke, extra = {}) => ({ label, stroke, width: 1.5, ...extra });
  state.charts.reward = chart("reward", [line("train reward", "#1f77b4"),
    line("held-out accuracy", "#000", { points: { show: true }, spanGaps: true })], "step");
  state.charts.staleness = chart("staleness", [line("mean", "#1f77b4"), line("max", "#ff7f0e")], "step");
  state.charts.throughput = chart("throughput", [line("generation", "#2ca02c"), line("training", "#d62728")],
                                  "step");
  const colors = ["#1f77b4", "#aec7e8", "#2ca02c", "#98df8a", "#9467bd"];
  state.charts.time = chart("time", PHASES.map(([r, p], i) => line(`${r} ${p}`, colors[i])), "step");
  document.getElementById("set").addEventListener("submit", (e) => {
    e.preventDefault();
    send("/set", { key: document.getElementById("key").value, value: document.getElementById("value").value });
  });
  for (const name of ["eval", "checkpoint", "pause", "resume", "stop"]) {
    document.getElementById(name).addEventListener("click", () => send("/" + name));
  }
}

async function send(path, body) {
  const answer = document.getElementById("answer");
  const response = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json" },
                                       body: body ? JSON.stringify(body) : null });
  const data = await response.json();
  answer.className = response.ok ? "" : "refused";
  answer.textContent = response.ok
    ? (data.key ? `${data.key} = ${data.value}: recorded (change ${data.id}), from step ${data.from_step}`
       : "paused" in data ? (data.paused ? "paused: no new rollouts" : "resumed")
       : `evaluating version ${data.version}`)
    : data.error;
  poll();
}

function redraw() {
  const s = state.steps, x = s.map((r) => r.step);
  const evalAt = new Map(state.evals.map((e) => [e.eval_version - 1, e.eval_accuracy]));
  state.charts.reward.setData([x, s.map((r) => r.reward), x.map((step) => evalAt.get(step) ?? null)]);
  state.charts.staleness.setData([x, s.map((r) => r.staleness_mean), s.map((r) => r.staleness_max)]);
  state.charts.throughput.setData([x, s.map((r) => r.gen_tokens_per_s), s.map((r) => r.train_tokens_per_s)]);
  state.charts.time.setData([x, ...PHASES.map(([r, p]) => s.map((rec) => rec[`time/${r}/${p}`] ?? null))]);
}

function rows(table, header, lines) {
  table.innerHTML = header + lines.map((cells) => "<tr>" + cells.map((c) => `<td>${c}</td>`).join("") + "</tr>")
    .join("");
}

function escape(value) {
  return String(value).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

async function poll() {
  try {
    const [metrics, status, roles] = await Promise.all(
      [`/metrics?offset=${state.offset}`, "/status", "/roles"].map((u) => fetch(u).then((r) => r.json())));
    state.offset = metrics.offset;
    for (const r of metrics.records) {
      if ("eval_accuracy" in r) state.evals.push(r);
      else if ("step" in r) state.steps.push(r);
    }
    redraw();
    const last = state.steps[state.steps.length - 1];
    document.getElementById("where").textContent =
      `step ${status.step} of ${status.steps} assembling · version ${status.served_version} served · ` +
      `${state.steps.length} steps trained` + (last ? ` · reward ${last.reward.toFixed(3)}` : "") +
      (status.paused ? " · PAUSED" : "");
    if (!state.keys) {
      state.keys = Object.keys(status.settings);
      document.getElementById("key").innerHTML = state.keys.map((k) => `<option>${k}</option>`).join("");
    }
    rows(document.getElementById("settings"), "",
         Object.entries(status.settings).map(([k, v]) => [escape(k), escape(v)]));
    rows(document.getElementById("changes"), "<tr><th>#</th><th>key</th><th>value</th><th>from step</th></tr>",
         status.changes.map((c) => [c.id, escape(c.key), escape(c.value), c.step ?? "pending"]));
    rows(document.getElementById("roles"), "<tr><th>role</th><th>pid</th><th>heartbeat</th><th>restarts</th></tr>",
         roles.map((r) => [escape(r.role), r.pid,
                           r.heartbeat_age === null ? "—" : `${r.heartbeat_age.toFixed(1)} s ago`, r.restarts]));
  } catch (e) {
    document.getElementById("where").textContent = `the run does not answer (${e}); it may have ended`;
  }
}

setUp();
poll();
setInterval(poll, POLL_MS);
