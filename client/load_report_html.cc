// The HTML report: one page, its data inline as JSON and its charts drawn by an inline script
// into SVG, so it opens from a file or an attachment with no network at all.
#include "absl/strings/str_replace.h"
#include "client/load_report.h"

namespace attnserve::client {
namespace {

constexpr char kHead[] = R"html(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>attnserve load test</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 6px; }
.meta { color: #555; margin-bottom: 12px; }
.charts { display: flex; flex-wrap: wrap; gap: 16px; }
.chart { border: 1px solid #ddd; border-radius: 4px; padding: 8px; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
table { border-collapse: collapse; margin-top: 8px; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f4f4f4; }
</style></head>
<body>
<h1>attnserve load test</h1>
<div class="meta" id="meta"></div>
<div class="charts">
 <div class="chart"><h2>Latency percentiles vs throughput</h2><svg id="curve" width="560" height="340"></svg></div>
 <div class="chart"><h2>Latency over time</h2><svg id="time" width="560" height="340"></svg></div>
 <div class="chart"><h2>Latency histogram</h2><svg id="hist" width="560" height="340"></svg></div>
</div>
<h2>Steps</h2>
<table id="steps"></table>
<div id="decode-section" hidden><h2>Decode sessions</h2><table id="decode"></table></div>
<script id="data" type="application/json">)html";

constexpr char kTail[] = R"html(</script>
<script>
"use strict";
const run = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#ff7f0e", "#d62728", "#2ca02c", "#9467bd"];
const M = {left: 60, right: 16, top: 16, bottom: 44};

function el(parent, name, attrs, text) {
  const e = document.createElementNS(NS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  parent.appendChild(e);
  return e;
}
function ticks(lo, hi, n) {
  const span = hi - lo || 1, raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(f => f * mag).find(s => span / s <= n) || mag * 10;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9 * span; v += step) out.push(v);
  return out;
}
function fmt(v) { return Math.abs(v) >= 100 ? v.toFixed(0) : +v.toPrecision(3) + ""; }
// Axes and a scale for one chart; logX gives a log10 x axis.
function frame(svg, xs, ys, xlabel, ylabel, logX) {
  const w = +svg.getAttribute("width"), h = +svg.getAttribute("height");
  const tx = v => logX ? Math.log10(Math.max(v, 1e-6)) : v;
  let x0 = Math.min(...xs.map(tx)), x1 = Math.max(...xs.map(tx));
  if (x0 === x1) { x0 -= 0.5; x1 += 0.5; }
  if (!logX && x0 > 0 && x0 < x1 / 2) x0 = 0;
  const y1 = Math.max(...ys) * 1.08 || 1;
  const sx = v => M.left + (tx(v) - x0) / (x1 - x0) * (w - M.left - M.right);
  const sy = v => h - M.bottom - v / y1 * (h - M.top - M.bottom);
  el(svg, "rect", {x: 0, y: 0, width: w, height: h, fill: "#fff"});
  for (const t of ticks(0, y1, 5)) {
    el(svg, "line", {x1: M.left, x2: w - M.right, y1: sy(t), y2: sy(t), stroke: "#eee"});
    el(svg, "text", {x: M.left - 6, y: sy(t) + 4, "text-anchor": "end"}, fmt(t));
  }
  // A log axis is ticked at 1, 2, 5 times powers of ten.
  const xt = !logX ? ticks(x0, x1, 6) : [];
  for (let e = Math.floor(x0); logX && e <= Math.ceil(x1); e++) {
    for (const m of (x1 - x0 > 3 ? [1] : [1, 2, 5])) {
      const t = e + Math.log10(m);
      if (t >= x0 && t <= x1) xt.push(t);
    }
  }
  for (const t of xt) {
    const v = logX ? Math.pow(10, t) : t, x = M.left + (t - x0) / (x1 - x0) * (w - M.left - M.right);
    el(svg, "line", {x1: x, x2: x, y1: h - M.bottom, y2: h - M.bottom + 4, stroke: "#333"});
    el(svg, "text", {x: x, y: h - M.bottom + 16, "text-anchor": "middle"}, fmt(v));
  }
  el(svg, "line", {x1: M.left, x2: w - M.right, y1: h - M.bottom, y2: h - M.bottom, stroke: "#333"});
  el(svg, "line", {x1: M.left, x2: M.left, y1: M.top, y2: h - M.bottom, stroke: "#333"});
  el(svg, "text", {x: (w + M.left) / 2, y: h - 8, "text-anchor": "middle"}, xlabel);
  el(svg, "text", {x: 14, y: (h - M.bottom + M.top) / 2, "text-anchor": "middle",
                   transform: `rotate(-90 14 ${(h - M.bottom + M.top) / 2})`}, ylabel);
  return {sx, sy, w, h};
}
function lines(svg, f, series) {
  series.forEach((s, i) => {
    const c = COLORS[i % COLORS.length];
    const pts = s.points.map(p => `${f.sx(p[0]).toFixed(1)},${f.sy(p[1]).toFixed(1)}`);
    el(svg, "polyline", {points: pts.join(" "), fill: "none", stroke: c, "stroke-width": 2});
    for (const p of s.points) el(svg, "circle", {cx: f.sx(p[0]), cy: f.sy(p[1]), r: 3, fill: c});
    el(svg, "rect", {x: M.left + 10 + i * 70, y: M.top, width: 10, height: 10, fill: c});
    el(svg, "text", {x: M.left + 24 + i * 70, y: M.top + 9}, s.name);
  });
}
function empty(svg, why) {
  el(svg, "text", {x: 20, y: 40}, why);
}

function drawCurve() {
  const svg = document.getElementById("curve");
  const steps = run.steps.filter(s => s.ok > 0);
  if (!steps.length) return empty(svg, "no successful calls");
  const keys = [["p50", "p50"], ["p90", "p90"], ["p99", "p99"], ["p999", "p99.9"]];
  const series = keys.map(([k, name]) => ({name,
      points: steps.map(s => [s.requests_per_second, s.latency_ms[k]])}));  // in step order
  const f = frame(svg, steps.map(s => s.requests_per_second),
                  series.flatMap(s => s.points.map(p => p[1])), "throughput (successful calls/s)",
                  "latency (ms)", false);
  lines(svg, f, series);
}
function drawTime() {
  const svg = document.getElementById("time");
  const slices = run.timeline.slices.filter(s => s.ok > 0);
  if (!slices.length) return empty(svg, "no successful calls");
  const series = [{name: "p50", points: slices.map(s => [s.t, s.p50])},
                  {name: "p99", points: slices.map(s => [s.t, s.p99])}];
  const f = frame(svg, slices.map(s => s.t), slices.map(s => s.p99),
                  "time since the window opened, by scheduled send time (s)", "latency (ms)", false);
  lines(svg, f, series);
  // A sweep's steps follow each other on this axis: mark where each one's window begins.
  let begin = 0;
  for (const step of run.steps.length > 1 ? run.steps : []) {
    const x = f.sx(begin);
    el(svg, "line", {x1: x, x2: x, y1: M.top + 14, y2: f.sy(0), stroke: "#999", "stroke-dasharray": "2 3"});
    el(svg, "text", {x: x + 3, y: f.sy(0) - 4}, step.mode === "open" ? step.offered_rate + "/s" : "c=" + step.concurrency);
    begin += step.window_seconds;
  }
}
function drawHistogram() {
  const svg = document.getElementById("hist");
  const b = run.histogram.buckets;
  if (!b.length) return empty(svg, "no successful calls");
  // Buckets merged into 60 log-spaced bins, so bars stay wide enough to see.
  const lo = Math.log10(Math.max(b[0][0], 1e-3)), hi = Math.log10(b[b.length - 1][1]);
  const n = 60, width = (hi - lo) / n || 1, bins = new Array(n).fill(0);
  for (const [l, h, c] of b) {
    const i = Math.min(n - 1, Math.max(0, Math.floor((Math.log10(Math.max((l + h) / 2, 1e-3)) - lo) / width)));
    bins[i] += c;
  }
  const edges = bins.map((_, i) => Math.pow(10, lo + i * width));
  const f = frame(svg, [edges[0], Math.pow(10, hi)], bins, "latency (ms, log scale)", "calls", true);
  bins.forEach((c, i) => {
    if (!c) return;
    const x0 = f.sx(edges[i]), x1 = f.sx(Math.pow(10, lo + (i + 1) * width));
    el(svg, "rect", {x: x0, y: f.sy(c), width: Math.max(1, x1 - x0 - 1), height: f.sy(0) - f.sy(c),
                     fill: COLORS[0]});
  });
  for (const [k, name, c] of [["p50", "p50", 1], ["p99", "p99", 2]]) {
    const x = f.sx(run.latency_ms[k]);
    el(svg, "line", {x1: x, x2: x, y1: M.top + 14, y2: f.sy(0), stroke: COLORS[c], "stroke-dasharray": "4 3"});
    const right = x > f.w - M.right - 40;  // near the edge: the label goes left of its line
    el(svg, "text", {x: right ? x - 3 : x + 3, y: M.top + 24 + 12 * c,
                     "text-anchor": right ? "end" : "start"}, name);
  }
}
function table() {
  const t = document.getElementById("steps");
  const cols = [["load", s => s.mode === "open" ? s.offered_rate + "/s" : "c=" + s.concurrency],
                ["sent", s => s.sent], ["ok", s => s.ok],
                ["failed", s => s.sent - s.ok],
                ["errors", s => Object.entries(s.errors).map(([c, n]) => c + " " + n).join(", ")],
                ["late", s => s.late], ["unsent", s => s.unsent],
                ["windows", s => s.trials_run > 1 ? s.trials_run + (s.stable ? " (stable)" : " (NOT stable)") : ""],
                ["req/s", s => s.requests_per_second.toFixed(1)],
                ["tokens/s", s => s.tokens_per_second.toFixed(0)],
                ["p50 ms", s => s.latency_ms.p50.toFixed(2)], ["p99 ms", s => s.latency_ms.p99.toFixed(2)],
                ["p99.9 ms", s => s.latency_ms.p999.toFixed(2)], ["max ms", s => s.latency_ms.max.toFixed(2)],
                ["server queue ms", s => s.server ? s.server.queue_ms.mean.toFixed(2) : ""],
                ["server compute ms", s => s.server ? s.server.compute_ms.mean.toFixed(2) : ""],
                ["calls/batch", s => s.server ? s.server.mean_batch_calls.toFixed(2) : ""]];
  const head = t.insertRow();
  for (const [name] of cols) { const th = document.createElement("th"); th.textContent = name; head.appendChild(th); }
  for (const s of run.steps) {
    const row = t.insertRow();
    for (const [, f] of cols) row.insertCell().textContent = f(s);
  }
}

// bench --decode: the sessions' figures, one row per step.
function decodeTable() {
  const steps = run.steps.filter(s => s.decode);
  if (!steps.length) return;
  document.getElementById("decode-section").hidden = false;
  const t = document.getElementById("decode");
  const ms = v => v.toFixed(3);
  const cols = [["sessions", d => d.sessions], ["B", d => d.batch], ["prompt", d => d.prompt],
                ["steps", d => d.steps + " x " + d.tokens_per_step],
                ["tokens/s", d => d.tokens_per_second.toFixed(0)],
                ["prompt tokens/s", d => d.prompt_tokens_per_second.toFixed(0)],
                ["first output p50 ms", d => ms(d.time_to_first_output_ms.p50)],
                ["first output p99 ms", d => ms(d.time_to_first_output_ms.p99)],
                ["inter-token p50 ms", d => ms(d.inter_token_latency_ms.p50)],
                ["inter-token p90 ms", d => ms(d.inter_token_latency_ms.p90)],
                ["inter-token p99 ms", d => ms(d.inter_token_latency_ms.p99)]];
  const head = t.insertRow();
  for (const [name] of cols) { const th = document.createElement("th"); th.textContent = name; head.appendChild(th); }
  for (const s of steps) {
    const row = t.insertRow();
    for (const [, f] of cols) row.insertCell().textContent = f(s.decode);
  }
}

document.getElementById("meta").textContent =
    `${run.mode} loop${run.sweep ? ", " + run.sweep + " sweep" : ""} against ${run.target} (${run.protocol}): ` +
    `${run.workload}; ${run.sent} calls sent, ${run.ok} ok` +
    (run.stopped_by_latency_limit ? `; stopped at p99 > ${run.latency_limit_ms} ms` : "");
let drawn = 0;
for (const draw of [drawCurve, drawTime, drawHistogram]) { draw(); drawn++; }
table();
decodeTable();
document.body.dataset.chartsDrawn = String(drawn);
</script>
</body></html>
)html";

}  // namespace

std::string RunHtml(const LoadRun& run) {
  // "</" would end the <script> element early; "<\/" is the same JSON string.
  const std::string data = absl::StrReplaceAll(
      RunJson(run).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
      {{"</", "<\\/"}});
  return std::string(kHead) + data + kTail;
}

}  // namespace attnserve::client
