"""The cluster page the coordinator serves at GET /: one HTML document, its CSS and JS inline, no build
step and nothing fetched from elsewhere. It polls GET /cluster (console.py) every POLL_MS and keeps
the last HISTORY points for its plots; the playground streams from POST /v1/completions; a trace's
waterfall comes from GET /traces/<id>. With an API key set, the key typed into its form is kept in
the tab's sessionStorage and sent as `Authorization: Bearer` on each of those calls.
"""

HTML = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>knot cluster</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d232b}
header{background:#1d232b;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:baseline}
header h1{font-size:16px;margin:0} header span{opacity:.75}
main{display:grid;grid-template-columns:1fr 1fr;gap:12px;padding:12px}
section{background:#fff;border:1px solid #d8dde3;border-radius:6px;padding:10px}
section.wide{grid-column:1/3} h2{font-size:14px;margin:0 0 8px}
.figs{display:grid;grid-template-columns:repeat(5,1fr);gap:8px}
.fig{border:1px solid #e4e7eb;border-radius:4px;padding:4px 6px} .fig b{font-size:18px;display:block}
.fig small{color:#5b6570} svg text{font:11px system-ui,sans-serif}
table{border-collapse:collapse;width:100%} td,th{text-align:left;padding:2px 6px;border-bottom:1px solid #eee}
textarea{width:100%;box-sizing:border-box;height:60px} label{margin-right:10px}
input[type=number]{width:70px} pre{white-space:pre-wrap;background:#f0f2f4;padding:6px;min-height:40px;margin:6px 0}
#login{display:none;padding:12px} .err{color:#b3261e} a{color:#0b57d0;cursor:pointer}
</style></head><body>
<header><h1>knot cluster</h1><span id="model">connecting…</span><span id="status"></span></header>
<div id="login"><form id="login-form">This cluster needs its API key:
 <input id="key" type="password" autocomplete="current-password" size="40"> <button>Open</button>
 <span class="err" id="login-error"></span></form></div>
<main id="main">
<section class="wide"><h2>Topology</h2><svg id="topology" width="100%" height="250"></svg></section>
<section class="wide"><h2>Live figures (last <span id="span-min">5</span> minutes)</h2><div class="figs" id="figs"></div></section>
<section><h2>Requests in flight</h2><table><thead><tr><th>request</th><th>tokens</th><th>elapsed</th><th>at</th></tr></thead>
<tbody id="in-flight"></tbody></table></section>
<section><h2>Recent traces</h2><table><thead><tr><th>trace</th><th>request</th><th>ms</th><th>spans</th></tr></thead>
<tbody id="traces"></tbody></table></section>
<section><h2>Playground</h2>
<textarea id="prompt">def fibonacci(n):</textarea><div>
<label>temperature <input id="temperature" type="number" step="0.1" min="0" value="0"></label>
<label>max_tokens <input id="max-tokens" type="number" min="1" value="32"></label>
<label>seed <input id="seed" type="number" placeholder="none"></label>
<button id="run">Generate</button></div><pre id="answer"></pre><div id="answer-meta"></div></section>
<section><h2>Waterfall <span id="wf-id"></span></h2><svg id="waterfall" width="100%" height="40"></svg></section>
</main>
<script>
"use strict";
const POLL_MS = 1000, HISTORY = 300, COLORS = {ready: "#2e7d32", streaming: "#1565c0", degraded: "#ef8f00",
  restarting: "#7b1fa2", down: "#c62828", unknown: "#9e9e9e"};
const NS = "http://www.w3.org/2000/svg";
const history = [];
let polling = null;

function key() { return sessionStorage.getItem("knot_api_key"); }
function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (key()) h["Authorization"] = "Bearer " + key();
  return h;
}
async function api(path, init) {
  const r = await fetch(path, Object.assign({}, init || {}, {headers: headers((init || {}).headers)}));
  if (r.status === 401) { showLogin("the key was refused"); throw new Error("401"); }
  return r;
}
function showLogin(why) {
  document.getElementById("login").style.display = "block";
  document.getElementById("login-error").textContent = key() ? why : "";
}
document.getElementById("login-form").onsubmit = (e) => {
  e.preventDefault();
  sessionStorage.setItem("knot_api_key", document.getElementById("key").value);
  document.getElementById("login").style.display = "none";
  poll();
};
function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function sum(samples, name, want) {
  const s = samples[name]; if (!s) return null;
  let t = 0;
  for (const [labels, v] of Object.entries(s)) if (v !== null && (!want || labels.includes(want))) t += v;
  return t;
}
function mib(b) { return b == null ? "?" : (b / 1048576).toFixed(0) + " MiB"; }

function drawTopology(nodes) {
  const svg = document.getElementById("topology");
  svg.innerHTML = "";
  const rows = {coordinator: 0, station: 1, shard: 2, layer_warden: 3, cobordism_warden: 3, bucket: 3, drafter: 3};
  const col = {}, W = 170, H = 46;
  // a row is as tall as its most replicated node: replicas stand one below the other
  const depth = [0, 1, 2, 3].map(row => Math.max(1, ...nodes.filter(n => (rows[n.role] ?? 3) === row)
                                                              .map(n => n.replicas.length)));
  const top = depth.map((_, row) => 6 + depth.slice(0, row).reduce((a, d) => a + d * (H + 4) + 10, 0));
  for (const n of nodes) {
    const row = rows[n.role] ?? 3, i = col[row] = (col[row] ?? -1) + 1;
    n.replicas.forEach((r, k) => {
      const x = 8 + i * (W + 12), y = top[row] + k * (H + 4);
      const g = el("g", {"data-node": n.name, "data-health": r.health, "data-binding": r.binding}, svg);
      el("rect", {x, y, width: W, height: H, rx: 5, fill: COLORS[r.health] || COLORS.unknown, opacity: .9}, g);
      const s = r.stats || {};
      let detail = "";
      if (n.role === "station" && n.layers) {
        const m = s.memory || {};
        detail = `layers ${n.layers[0]}–${n.layers[1]} · ${m.profile || "?"} · ${mib(s.budget_bytes)} · ` +
                 `${m.resident_fraction == null ? "?" : Math.round(m.resident_fraction * 100)}% resident`;
      } else if (n.role === "shard") detail = `vocab ${n.vocab[0]}–${n.vocab[1]}`;
      else if (n.role === "coordinator") detail = s.model || "";
      else if (n.role === "bucket") detail = s.note || "";
      if (r.down_for_s != null) detail = `no answer for ${r.down_for_s.toFixed(0)} s`;
      const name = k ? `${n.name} r${k}` : n.name;
      el("text", {x: x + 6, y: y + 16, fill: "#fff", "font-weight": "bold"}, g, `${name} · ${r.health}`);
      el("text", {x: x + 6, y: y + 33, fill: "#fff"}, g, detail.slice(0, 34));
      el("title", {}, g, `${r.binding}${r.restarts ? ` · restarted ${r.restarts}×` : ""}\n` +
                          JSON.stringify(s, null, 1).slice(0, 1500));
    });
  }
  // wide layouts (many shards) shrink to the section's width rather than overflow it
  const width = 8 + (Math.max(...Object.values(col)) + 1) * (W + 12);
  const height = top[3] + depth[3] * (H + 4) + 6;
  svg.setAttribute("viewBox", `0 0 ${Math.max(width, 600)} ${height}`);
  svg.setAttribute("height", height * Math.min(1, (svg.clientWidth || width) / Math.max(width, 600)));
}

const FIGURES = [
  ["tok/s", (d, p, dt) => p && (sum(d.samples, "knot_tokens_total", "kind=completion") - sum(p.samples, "knot_tokens_total", "kind=completion")) / dt],
  ["requests active", d => sum(d.samples, "knot_requests_active")],
  ["requests queued", d => sum(d.samples, "knot_requests_queued")],
  ["TTFT ms (mean)", (d, p) => p && meanMs(d, p, "knot_time_to_first_token_seconds")],
  ["TTFT ms (p95, bucket bound)", (d, p) => p && quantileMs(d, p, "knot_time_to_first_token_seconds", "", 0.95)],
  ["inter-token ms", (d, p) => p && meanMs(d, p, "knot_inter_token_latency_seconds")],
  ["station hop ms", (d, p) => p && meanMs(d, p, "knot_hop_latency_seconds", "hop=station")],
  ["station hop ms (p95)", (d, p) => p && quantileMs(d, p, "knot_hop_latency_seconds", "hop=station", 0.95)],
  ["logits hop ms (p95)", (d, p) => p && quantileMs(d, p, "knot_hop_latency_seconds", "hop=logits", 0.95)],
  ["logits hop ms", (d, p) => p && meanMs(d, p, "knot_hop_latency_seconds", "hop=logits")],
  ["embed hop ms", (d, p) => p && meanMs(d, p, "knot_hop_latency_seconds", "hop=embed")],
  ["warden hit ratio", d => { const s = d.samples.knot_warden_hit_ratio; if (!s) return null;
     const v = Object.values(s).filter(x => x !== null); return v.length ? v.reduce((a, b) => a + b) / v.length : null; }],
  ["integrity rejects", d => sum(d.samples, "knot_cache_rejects_total")],
  ["replays", d => sum(d.samples, "knot_session_replays_total")],
  ["degradations", d => sum(d.samples, "knot_shard_degradations_total")],
];
function meanMs(d, p, name, want) {
  const n = sum(d.samples, name + "_count", want) - sum(p.samples, name + "_count", want);
  return n > 0 ? 1000 * (sum(d.samples, name + "_sum", want) - sum(p.samples, name + "_sum", want)) / n : null;
}
// the q-quantile of what a histogram observed between two snapshots: the upper bound of the first
// bucket whose cumulative count reaches q of them (buckets are cumulative, labelled le=BOUND)
function quantileMs(d, p, name, want, q) {
  const now = d.samples[name + "_bucket"] || {}, then = p.samples[name + "_bucket"] || {}, by = {};
  for (const [labels, v] of Object.entries(now)) {
    if (want && !labels.includes(want)) continue;
    const le = labels.match(/le=([^,]+)/)[1];
    by[le] = (by[le] || 0) + v - (then[labels] || 0);
  }
  const les = Object.keys(by).sort((a, b) => parseFloat(a) - parseFloat(b)), total = by["+Inf"] || 0;
  if (!total) return null;
  const le = les.find(k => by[k] >= q * total);
  return le === "+Inf" ? null : 1000 * parseFloat(le);  // past the last bound: no number to show
}
function drawFigures() {
  const box = document.getElementById("figs");
  if (!box.children.length) for (const [name] of FIGURES) {
    const f = document.createElement("div"); f.className = "fig"; f.dataset.figure = name;
    f.innerHTML = `<small>${name}</small><b>–</b><svg width="100%" height="30" viewBox="0 0 ${HISTORY} 30" preserveAspectRatio="none"></svg>`;
    box.appendChild(f);
  }
  FIGURES.forEach(([name], i) => {
    const f = box.children[i], vals = history.map(h => h.figures[i]);
    const last = vals[vals.length - 1];
    f.querySelector("b").textContent = last == null ? "–" : (Math.abs(last) < 10 ? last.toFixed(2) : last.toFixed(0));
    const max = Math.max(1e-9, ...vals.filter(v => v != null)), svg = f.querySelector("svg");
    const pts = vals.map((v, k) => v == null ? null : `${k + HISTORY - vals.length},${29 - 27 * v / max}`).filter(Boolean);
    svg.innerHTML = `<polyline fill="none" stroke="#1565c0" stroke-width="1.5" vector-effect="non-scaling-stroke" points="${pts.join(" ")}"/>`;
  });
}
function drawInFlight(list) {
  document.getElementById("in-flight").innerHTML = list.map(r =>
    `<tr><td><a data-trace="${r.trace_id}">${r.request_id.slice(0, 8)}</a></td><td>${r.tokens}/${r.max_tokens}` +
    `<progress max="${r.max_tokens}" value="${r.tokens}"></progress></td><td>${r.elapsed_s.toFixed(1)} s</td><td>${r.at || ""}</td></tr>`).join("");
}
async function drawTraces() {
  const r = await api("/traces"); if (!r.ok) return;
  const list = (await r.json()).traces.slice(0, 12);
  document.getElementById("traces").innerHTML = list.map(t =>
    `<tr><td><a data-trace="${t.trace_id}">${t.trace_id.slice(0, 12)}</a></td><td>${t.name || ""}</td>` +
    `<td>${t.in_flight ? "…" : (t.duration_ms ?? 0).toFixed(0)}</td><td>${t.spans}</td></tr>`).join("");
}
document.addEventListener("click", e => { const t = e.target.dataset && e.target.dataset.trace; if (t) waterfall(t); });

async function waterfall(traceId) {
  const r = await api("/traces/" + traceId); if (!r.ok) return;
  const t = await r.json(), svg = document.getElementById("waterfall");
  document.getElementById("wf-id").textContent = traceId;
  svg.innerHTML = "";
  const spans = t.spans.slice(0, 400), ROW = 14, LABEL = 260, width = svg.clientWidth || 600;
  const end = Math.max(1e-3, ...spans.map(s => s.start_ms + s.duration_ms));
  const scale = (width - LABEL - 10) / end;
  spans.forEach((s, i) => {
    const y = 2 + i * ROW, g = el("g", {"class": "span", "data-name": s.name, "data-peer": s.peer}, svg);
    const bad = !/^(2\d\d|ok)$/.test(s.status);
    el("text", {x: s.span_id ? 2 : 12, y: y + 10}, g,
       `${s.peer} ${s.name}${s.count > 1 ? " ×" + s.count : ""}`.slice(0, 44));
    el("rect", {x: LABEL + s.start_ms * scale, y, width: Math.max(1, s.duration_ms * scale), height: ROW - 3,
                fill: bad ? COLORS.down : (s.span_id ? "#1565c0" : "#90caf9")}, g);
    el("title", {}, g, `${s.name} @ ${s.peer}: ${s.duration_ms.toFixed(2)} ms from ${s.start_ms.toFixed(2)} ms, ${s.status}`);
  });
  svg.setAttribute("height", 4 + spans.length * ROW);
}

async function poll() {
  clearTimeout(polling);
  try {
    const r = await api("/cluster");
    if (!r.ok) throw new Error(`GET /cluster: HTTP ${r.status}`);
    const d = await r.json(), p = history.length ? history[history.length - 1].data : null;
    const dt = p ? Math.max(1e-3, d.now - p.now) : 1;
    history.push({data: d, figures: FIGURES.map(([, f]) => { try { return f(d, p, dt); } catch (e) { return null; } })});
    if (history.length > HISTORY) history.shift();
    document.getElementById("model").textContent = `${d.model} · ${d.hparams.n_layer} layers · vocab ${d.hparams.vocab_size}`;
    document.getElementById("status").textContent = "";
    drawTopology(d.nodes); drawFigures(); drawInFlight(d.in_flight); await drawTraces();
  } catch (e) {
    if (e.message === "401") return;
    document.getElementById("status").textContent = "unreachable: " + e.message;
  }
  polling = setTimeout(poll, POLL_MS);
}

document.getElementById("run").onclick = async () => {
  const out = document.getElementById("answer"), meta = document.getElementById("answer-meta");
  out.textContent = ""; meta.textContent = "";
  const body = {prompt: document.getElementById("prompt").value, stream: true,
                max_tokens: +document.getElementById("max-tokens").value,
                temperature: +document.getElementById("temperature").value};
  const seed = document.getElementById("seed").value;
  if (seed !== "") body.seed = +seed;
  const r = await api("/v1/completions", {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  const traceId = r.headers.get("X-Trace-Id");
  if (!r.ok) { meta.textContent = `HTTP ${r.status}: ${await r.text()}`; return; }
  const reader = r.body.getReader(), dec = new TextDecoder();
  let buf = "", finish = null;
  for (;;) {
    const {done, value} = await reader.read();
    if (done) break;
    buf += dec.decode(value, {stream: true});
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const ev = buf.slice(0, i); buf = buf.slice(i + 2);
      const data = ev.split("\n").filter(l => l.startsWith("data: ")).map(l => l.slice(6)).join("");
      if (!data || data === "[DONE]") continue;
      const j = JSON.parse(data);
      if (j.error) { meta.textContent = j.error.message; continue; }
      for (const c of j.choices || []) { out.textContent += c.text || ""; finish = c.finish_reason || finish; }
    }
  }
  meta.dataset.done = "1";
  meta.innerHTML = `finish: ${finish} · trace <a data-trace="${traceId}">${traceId}</a>`;
  if (traceId) waterfall(traceId);
};
poll();
</script></body></html>
"""
