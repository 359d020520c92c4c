// The crossfill live dashboard: polls the gateway's /dashboard/api/state every POLL_MS and keeps the
// time series here (the gateway keeps no history beyond its last finished requests). Charts are uPlot.
// Every chart container carries data-series-points (points held, all series together), so a test or a
// script can tell from the DOM that the charts hold data.
"use strict";

const POLL_MS = 2000;
const MAX_POINTS = 300; // per series: 10 minutes at one poll every 2 s
const KEY_STORE = "crossfill.dashboard.key";
const COLORS = ["#4cc9f0", "#f72585", "#ffd166", "#06d6a0", "#b388ff", "#ff8c42", "#8ecae6", "#e63946"];
const ROUTE_COLORS = { local: "#06d6a0", remote: "#4cc9f0", none: "#e63946" };

// -- small DOM helpers (text only: ids and tenants come from clients, never HTML) ------------------
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("data-")) el.setAttribute(k, String(v));
    else if (k === "title") el.title = String(v);
    else if (k === "style") el.setAttribute("style", v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}
const $ = (id) => document.getElementById(id);
const fmt = (v, digits = 1) => (v === null || v === undefined || Number.isNaN(v) ? "–" : Number(v).toFixed(digits));
function bytes(n) {  // decimal units, so the chart's round ticks read as round numbers
  if (!n) return "0 B";
  const u = ["B", "kB", "MB", "GB", "TB"];
  const i = Math.max(0, Math.min(u.length - 1, Math.floor(Math.log10(Math.abs(n)) / 3)));
  return (n / 1000 ** i).toFixed(i ? 1 : 0) + " " + u[i];
}
const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });
function dot(ok, label) { return h("span", { class: "dot " + (ok ? "ok" : "bad"), title: label }); }
function bar(value, max, label, warn = true) {
  const pct = max > 0 ? Math.min(100, (100 * value) / max) : 0;
  return h("div", { class: "bar", title: label },
    h("div", { class: "bar-fill" + (warn && pct > 85 ? " hot" : ""), style: `width:${pct.toFixed(1)}%` }),
    h("span", { class: "bar-text" }, label));
}

// -- time series and charts --------------------------------------------------------------------
// A chart over time whose series (links, instances) may appear while the page runs: a new series
// rebuilds the uPlot instance, otherwise new points go in with setData.
class TimeChart {
  constructor(el, { scatter = false, colors = null, yFormat = null } = {}) {
    this.el = el;
    this.scatter = scatter;
    this.colors = colors;
    this.yFormat = yFormat;
    this.xs = [];
    this.ys = new Map(); // series name -> values aligned with xs
    this.plot = null;
    this.stale = false; // a series appeared since the last draw: rebuild the plot
  }
  add(x, values, draw = true) {
    let rebuild = this.plot === null;
    for (const name of Object.keys(values)) {
      if (!this.ys.has(name)) {
        this.ys.set(name, this.xs.map(() => null));
        rebuild = true;
      }
    }
    this.xs.push(x);
    for (const [name, arr] of this.ys) arr.push(name in values ? values[name] : null);
    if (this.xs.length > MAX_POINTS) {
      this.xs.shift();
      for (const arr of this.ys.values()) arr.shift();
    }
    this.stale = this.stale || rebuild;
    if (draw) this.draw();
  }
  draw() {
    this.render(this.stale);
    this.stale = false;
  }
  points() {
    let n = 0;
    for (const arr of this.ys.values()) for (const v of arr) if (v !== null && v !== undefined) n++;
    return n;
  }
  data() { return [this.xs, ...this.ys.values()]; }
  render(rebuild) {
    this.el.dataset.seriesPoints = String(this.points());
    this.el.dataset.series = [...this.ys.keys()].join(",");
    if (this.xs.length === 0 || this.ys.size === 0) return; // nothing measured yet (e.g. no RTT sample)
    if (rebuild || !this.plot) {
      if (this.plot) this.plot.destroy();
      this.plot = new uPlot(this.options(), this.data(), this.el);
    } else {
      this.plot.setData(this.data());
    }
  }
  options() {
    const axis = { stroke: "#9aa5b1", grid: { stroke: "#26303b", width: 1 }, ticks: { stroke: "#26303b" } };
    const names = [...this.ys.keys()];
    return {
      width: Math.max(200, this.el.clientWidth),
      height: 170,
      legend: { live: false },
      cursor: { drag: { x: false, y: false } },
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [Math.min(0, lo ?? 0), hi > 0 ? hi * 1.15 : 1] } },
      axes: [axis, { ...axis, size: 66, values: this.yFormat ? (u, vals) => vals.map(this.yFormat) : undefined }],
      series: [{}, ...names.map((name, i) => {
        const color = (this.colors && this.colors[name]) || COLORS[i % COLORS.length];
        const s = { label: name, stroke: color, width: 2, spanGaps: true, points: { show: true, size: 4, fill: color } };
        if (this.scatter) Object.assign(s, { paths: () => null, points: { show: true, size: 7, fill: color } });
        return s;
      })],
    };
  }
  resize() { if (this.plot) this.plot.setSize({ width: Math.max(200, this.el.clientWidth), height: 170 }); }
}

const charts = {
  rtt: new TimeChart($("chart-rtt")),
  bw: new TimeChart($("chart-bw")),
  loss: new TimeChart($("chart-loss")),
  queue: new TimeChart($("chart-queue")),
  kvUse: new TimeChart($("chart-kv-use")),
  ttft: new TimeChart($("chart-ttft"), { scatter: true, colors: ROUTE_COLORS }),
  throughput: new TimeChart($("chart-throughput")),
  kv: new TimeChart($("chart-kv"), { yFormat: bytes }),
};
window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.resize()));

// -- what the page remembers between polls ------------------------------------------------------
const seen = { seq: 0, previous: null, entries: [] };

function onState(s) {
  // The time axis is this browser's clock; the gateway's timestamps (request ends) are moved onto it
  // by the offset seen at this poll, so a skewed clock on either side does not bend the charts.
  const t = Date.now() / 1000;
  const shift = t - s.time;
  const cluster = s.cluster;
  if (cluster) {
    const links = cluster.links || {};
    const rtt = {}, bw = {}, loss = {};
    for (const [dc, lk] of Object.entries(links)) {
      if (lk.rtt_ms !== null && lk.rtt_ms !== undefined) rtt[dc] = lk.rtt_ms;
      if (lk.bandwidth_gbps !== null && lk.bandwidth_gbps !== undefined) bw[`${dc} estimate`] = lk.bandwidth_gbps;
      const cap = lk.bandwidth_override_gbps ?? lk.configured_bandwidth_gbps;
      if (cap !== null && cap !== undefined) bw[`${dc} capacity`] = cap;
      loss[`${dc} loss`] = lk.loss_rate ?? 0;
      loss[`${dc} retransmit`] = lk.retransmit_rate ?? 0;
    }
    if (Object.keys(links).length) {
      charts.rtt.add(t, rtt);
      charts.bw.add(t, bw);
      charts.loss.add(t, loss);
    }
    const queues = { gateway: s.gateway.in_flight };
    const kvUse = {};
    for (const [name, inst] of Object.entries(cluster.instances || {})) {
      queues[name] = inst.queue_depth;
      if (inst.kv && inst.kv.blocks_total) kvUse[name] = (100 * inst.kv.blocks_used) / inst.kv.blocks_total;
    }
    charts.queue.add(t, queues);
    charts.kvUse.add(t, kvUse);
  }
  // Requests finished since the last poll (seq only grows) feed the per-request TTFT chart.
  const fresh = s.recent.filter((e) => e.seq > seen.seq);
  if (s.recent.length && s.recent[s.recent.length - 1].seq < seen.seq) fresh.push(...s.recent); // gateway restarted
  for (const e of fresh) {
    if (e.ttft_ms !== null && e.ttft_ms !== undefined) charts.ttft.add(e.time + shift, { [e.route]: e.ttft_ms }, false);
  }
  if (fresh.length) charts.ttft.draw();
  if (s.recent.length) seen.seq = s.recent[s.recent.length - 1].seq;
  seen.entries = s.recent;
  const tot = s.totals || {};
  if (seen.previous && s.time > seen.previous.time) {
    const dt = s.time - seen.previous.time, p = seen.previous.totals;  // the gateway's clock: real seconds
    const d = (k) => Math.max(0, (tot[k] || 0) - (p[k] || 0)) / dt;
    charts.throughput.add(t, { "output tokens/s": d("completion_tokens"), "requests/s": d("requests") });
  }
  seen.previous = { time: s.time, totals: tot };
  charts.kv.add(t, { raw: tot.kv_raw_bytes || 0, wire: tot.kv_wire_bytes || 0 });
  $("kv-ratio").textContent = tot.kv_wire_bytes ? `· compression ${(tot.kv_raw_bytes / tot.kv_wire_bytes).toFixed(2)}×` : "";

  renderSummary(s);
  renderDatacenters(s);
  renderReasons(s.recent);
  renderErrors(s.recent);
  renderRoutes(s.recent);
  const err = $("cluster-error");
  err.hidden = !s.cluster_error;
  err.textContent = s.cluster_error ? `Scheduler state unavailable: ${s.cluster_error}` : "";
}

// -- panels -------------------------------------------------------------------------------------
function renderSummary(s) {
  const tot = s.totals || {};
  const g = s.gateway;
  $("summary").replaceChildren(
    h("span", {}, dot(g.ready, g.reason), " gateway ", g.ready ? "ready" : g.reason),
    h("span", {}, "model ", h("b", {}, g.model)),
    h("span", {}, "local DC ", h("b", {}, g.local_datacenter)),
    h("span", {}, "in flight ", h("b", {}, g.in_flight)),
    h("span", {}, "requests ", h("b", {}, tot.requests || 0), " (local ", tot.route_local || 0, ", remote ",
      tot.route_remote || 0, ", errors ", tot.errors || 0, ")"),
    s.cluster ? h("span", {}, "threshold ", h("b", {}, s.cluster.threshold_tokens), " tokens") : null,
  );
}

function renderDatacenters(s) {
  const cluster = s.cluster || { instances: {}, links: {} };
  const local = s.gateway.local_datacenter;
  const dcs = new Set(s.datacenters);
  for (const inst of Object.values(cluster.instances)) dcs.add(inst.datacenter);
  const cards = [...dcs].sort((a, b) => (a === local ? -1 : b === local ? 1 : a.localeCompare(b))).map((dc) => {
    const rows = Object.entries(cluster.instances).filter(([, i]) => i.datacenter === dc).map(([name, i]) => {
      const kv = i.kv || {};
      const up = i.healthy && i.ready;
      return h("tr", { "data-instance": name, "data-role": i.role, "data-ready": i.ready },
        h("td", {}, dot(up, i.last_error || (i.ready ? "healthy and ready" : "not ready")), name),
        h("td", {}, h("span", { class: "badge " + i.role }, i.role), i.state !== "active" ? h("span", { class: "badge warn" }, i.state) : null),
        h("td", {}, i.healthy ? (i.ready ? "ready" : "not ready") : "unhealthy"),
        h("td", {}, bar(i.queue_depth, i.capacity, `${i.queue_depth} / ${i.capacity}`)),
        h("td", {}, kv.blocks_total ? bar(kv.blocks_used, kv.blocks_total, `${kv.blocks_used} / ${kv.blocks_total} blocks`) : "–"));
    });
    const services = dc === local ? h("div", { class: "muted small" }, "gateway and scheduler run here") : null;
    const lk = cluster.links[dc];
    const link = lk ? h("div", { class: "link", "data-link": dc, "data-usable": lk.usable },
      h("div", {}, dot(lk.usable, (lk.reasons || []).join("; ") || "usable"), h("b", {}, `link ${dc} ↔ ${local}`),
        lk.usable ? " usable" : ` not usable: ${(lk.reasons || []).join("; ") || lk.reason || ""}`),
      h("div", { class: "link-stats" },
        h("span", {}, "RTT ", h("b", {}, fmt(lk.rtt_ms, 1)), " ms"),
        h("span", {}, "bandwidth ", h("b", {}, fmt(lk.bandwidth_gbps, 2)), " / ",
          fmt(lk.bandwidth_override_gbps ?? lk.configured_bandwidth_gbps, 2), " Gbit/s"),
        h("span", {}, "loss ", h("b", {}, fmt(100 * (lk.loss_rate || 0), 2)), " %"),
        h("span", {}, "retransmit ", h("b", {}, fmt(100 * (lk.retransmit_rate || 0), 2)), " %"),
        h("span", {}, "breaker ", h("b", {}, lk.breaker)),
        h("span", {}, "in flight ", h("b", {}, bytes(lk.in_flight_bytes || 0)))))
      : null;
    return h("div", { class: "card", "data-datacenter": dc },
      h("h3", {}, dc, dc === local ? h("span", { class: "badge local" }, "local") : h("span", { class: "badge remote" }, "remote")),
      services,
      h("table", { class: "table compact" },
        h("thead", {}, h("tr", {}, ["instance", "role", "state", "queue", "KV use"].map((c) => h("th", {}, c)))),
        h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { class: "muted" }, "no prefill or decode instance")))),
      link);
  });
  $("datacenters").replaceChildren(...cards);
}

function renderReasons(recent) {
  const counts = new Map();
  for (const e of recent) {
    if (e.route === "none") continue;
    const key = `${e.route}\u0000${e.rule || "(no rule given)"}`;
    counts.set(key, (counts.get(key) || 0) + 1);
  }
  const max = Math.max(1, ...counts.values());
  const rows = [...counts.entries()].sort((a, b) => b[1] - a[1]).map(([key, n]) => {
    const [route, rule] = key.split("\u0000");
    return h("tr", { "data-route": route, "data-rule": rule },
      h("td", {}, h("span", { class: "badge " + route }, route)), h("td", { class: "mono" }, rule),
      h("td", { class: "num" }, n), h("td", { class: "wide" }, bar(n, max, "", false)));
  });
  $("reasons").replaceChildren(
    h("thead", {}, h("tr", {}, ["route", "rule", "requests", ""].map((c) => h("th", {}, c)))),
    h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { class: "muted" }, "no request yet"))));
}

function renderErrors(recent) {
  const errs = recent.filter((e) => e.outcome !== "ok").slice(-8).reverse();
  $("errors").replaceChildren(
    h("thead", {}, h("tr", {}, ["time", "request", "outcome", "error code", "route"].map((c) => h("th", {}, c)))),
    h("tbody", {}, errs.length ? errs.map((e) => h("tr", { "data-error": e.error_code || e.outcome },
      h("td", {}, clock(e.time)), h("td", { class: "mono" }, e.request_id || "(refused before admission)"),
      h("td", {}, e.outcome), h("td", { class: "error-text" }, e.error_code || "–"), h("td", {}, e.route)))
      : h("tr", {}, h("td", { class: "muted" }, "no error among the recent requests"))));
}

function renderRoutes(recent) {
  const rows = recent.slice(-14).reverse().map((e) => h("tr", { "data-request-id": e.request_id, "data-route": e.route, "data-outcome": e.outcome },
    h("td", {}, clock(e.time)),
    h("td", { class: "mono" }, e.request_id),
    h("td", {}, h("span", { class: "badge " + e.route }, e.route)),
    h("td", { class: "mono" }, `${e.prefill_instance || "–"} → ${e.decode_instance || "–"}`),
    h("td", { class: "reason", title: e.reason || "" }, h("span", { class: "mono" }, e.rule || "–"),
      e.reason ? h("div", { class: "muted small" }, e.reason) : null, e.degradation_reason ? h("div", { class: "warn-text" }, e.degradation_reason) : null),
    h("td", { class: "num" }, fmt(e.ttft_ms, 0)),
    h("td", { class: "num" }, `${e.prompt_tokens} / ${e.completion_tokens}`),
    h("td", { class: "num" }, e.kv_wire_bytes ? `${bytes(e.kv_raw_bytes)} / ${bytes(e.kv_wire_bytes)}` : "–"),
    h("td", { class: e.outcome === "ok" ? "" : "error-text" }, e.outcome === "ok" ? "ok" : e.error_code || e.outcome)));
  $("routes").replaceChildren(
    h("thead", {}, h("tr", {}, ["time", "request", "route", "prefill → decode", "rule (degradation)", "TTFT ms",
      "tokens in / out", "KV raw / wire", "result"].map((c) => h("th", {}, c)))),
    h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { class: "muted" }, "no request yet"))));
}

// -- polling and the admin key ------------------------------------------------------------------
function takeKeyFromUrl() {
  const params = new URLSearchParams(location.search);
  const key = params.get("key");
  if (key) {
    sessionStorage.setItem(KEY_STORE, key);
    params.delete("key"); // out of the address bar and the history
    history.replaceState(null, "", location.pathname + (params.toString() ? "?" + params : ""));
  }
}

function askForKey(message) {
  document.body.dataset.state = "auth";
  $("key-form").hidden = false;
  $("key-message").textContent = message;
  $("status").textContent = "an admin API key is needed";
}

let timer = null;
async function poll() {
  clearTimeout(timer);
  const key = sessionStorage.getItem(KEY_STORE);
  try {
    const r = await fetch("api/state", { headers: key ? { Authorization: `Bearer ${key}` } : {}, cache: "no-store" });
    const body = await r.json().catch(() => null);
    if (r.status === 401 || r.status === 403) {
      askForKey((body && body.error && body.error.message) || `HTTP ${r.status}`);
      return; // wait for a key: polling without one only fills the audit log
    }
    if (!r.ok || !body) throw new Error((body && body.error && body.error.message) || `HTTP ${r.status}`);
    $("key-form").hidden = true;
    onState(body);
    document.body.dataset.state = "ok";
    document.body.dataset.polls = String(Number(document.body.dataset.polls) + 1);
    $("status").textContent = `updated ${clock(body.time)}`;
    $("status").className = "status";
  } catch (e) {
    document.body.dataset.state = "error";
    $("status").textContent = `cannot read the gateway: ${e.message}`;
    $("status").className = "status error-text";
  }
  timer = setTimeout(poll, POLL_MS);
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const key = $("key-input").value.trim();
  if (key) sessionStorage.setItem(KEY_STORE, key);
  $("key-input").value = "";
  poll();
});

takeKeyFromUrl();
poll();
