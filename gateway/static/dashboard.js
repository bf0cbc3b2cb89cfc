// tiergate dashboard: reads GET /admin/events (server-sent events) with the admin key as a bearer
// header. EventSource cannot send headers, so the stream is read with fetch and a ReadableStream
// reader. The key lives in sessionStorage only (this tab), never in a URL. See docs/DASHBOARD.md.
"use strict";

const KEY = "tiergate.adminKey";
const SVG = "http://www.w3.org/2000/svg";
const MAX_EVENTS = 200;
const TIMELINE_S = 300;
const KIND_LABEL = {
  load_started: "loading", load_finished: "loaded", load_failed: "load failed", engine_failed: "engine failed",
  eviction: "eviction", refusal: "refusal", batch_paused: "batch paused", batch_resumed: "batch resumed",
  oom_relief: "out of memory", limits_changed: "slo guard", loop_stall: "loop stall",
};
const KIND_CLASS = {
  load_started: "load", load_finished: "load", load_failed: "oom", engine_failed: "oom", eviction: "eviction",
  refusal: "refusal", batch_paused: "batch", batch_resumed: "batch", oom_relief: "oom", limits_changed: "limits",
  loop_stall: "oom",
};

let state = null;          // the last snapshot
let stateAt = 0;           // when it arrived (ms, this clock)
const events = new Map();  // id -> event, the timeline

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n >= 100 || i === 0 ? n.toFixed(0) : n.toFixed(1)} ${units[i]}`;
}

function secs(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  return `${s.toFixed(s < 10 ? 2 : 1)} s`;
}

// one formatter for every time shown: toLocaleTimeString makes a new one per call, which a
// timeline of 200 events redrawn pays 400 times (the same output: hour, minute, second)
const CLOCK = new Intl.DateTimeFormat([], { hour12: false, hour: "numeric", minute: "numeric", second: "numeric" });

function clock(unix) {
  return CLOCK.format(new Date(unix * 1000));
}

// -- the key and the connection -------------------------------------------------------------

function setStatus(name, text) {
  const pill = $("status");
  pill.dataset.state = name;
  pill.textContent = text || name;
}

function showLogin(message) {
  $("board").hidden = true;
  $("forget").hidden = true;
  $("login").hidden = false;
  $("login-error").hidden = !message;
  $("login-error").textContent = message || "";
  setStatus("idle", "not connected");
  $("key").focus();
}

let controller = null;
const HEADER_VALUE = /^[\t\x20-\x7e\x80-\xff]*$/;  // what fetch sends in a header: ISO-8859-1, no controls

async function connect() {
  const key = sessionStorage.getItem(KEY);
  if (!key) { showLogin(); return; }
  if (!HEADER_VALUE.test(key)) {  // fetch would throw, and the page would "reconnect" every 2 s for ever
    sessionStorage.removeItem(KEY);
    showLogin("that key has characters an HTTP header cannot carry (pasted with a stray character?)");
    return;
  }
  $("login").hidden = true;
  $("forget").hidden = false;
  setStatus("connecting");
  controller = new AbortController();
  let response;
  try {
    response = await fetch("/admin/events", {
      headers: { Authorization: `Bearer ${key}`, Accept: "text/event-stream" },
      cache: "no-store", signal: controller.signal,
    });
  } catch (err) {
    if (err.name === "AbortError") return;
    return retry(`cannot reach the server (${err.message})`);
  }
  if (response.status === 401 || response.status === 403) {
    sessionStorage.removeItem(KEY);
    const body = await response.json().catch(() => null);
    showLogin(body?.error?.message || `refused (${response.status})`);
    return;
  }
  if (!response.ok || !response.body) return retry(`the server answered ${response.status}`);
  setStatus("live");
  try {
    await readStream(response.body);
    retry("the stream ended");
  } catch (err) {
    if (err.name !== "AbortError") retry(`the stream broke (${err.message})`);
  }
}

function retry(why) {
  setStatus("reconnecting", "reconnecting…");
  $("updated").textContent = why;
  setTimeout(connect, 2000);
}

async function readStream(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      onMessage(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
    }
  }
}

function onMessage(block) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue; // heartbeat comment
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") name = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return;
  const payload = JSON.parse(data.join("\n"));
  if (name === "state") onState(payload);
  else if (name === "event") { addEvent(payload); eventsArrived(); }
}

// Events are drawn at most every EVENTS_EVERY_MS, not once each: a burst (clients retrying a
// refused request in a loop make hundreds of refusals a second) redrawn per event froze the page
// for tens of seconds, and for good while they kept coming.
const EVENTS_EVERY_MS = 250;
let eventsDue = null;  // the timer that draws the events that arrived since they were last drawn
let eventsDrawnAt = 0;

function eventsArrived() {
  if (eventsDue !== null) return;
  const wait = Math.max(0, eventsDrawnAt + EVENTS_EVERY_MS - Date.now());
  eventsDue = setTimeout(() => { eventsDue = null; renderEvents(); }, wait);
}

function onState(snapshot) {
  // a restarted server numbers its events from 1 again: the old process's are not its
  if (state && state.started_at !== snapshot.started_at) events.clear();
  state = snapshot;
  stateAt = Date.now();
  for (const e of snapshot.events) addEvent(e);
  $("board").hidden = false;
  $("updated").textContent = `updated ${clock(snapshot.time)}`;
  render();
}

function addEvent(e) {
  events.set(e.id, e);
  if (events.size > MAX_EVENTS) events.delete(events.keys().next().value);
}

// -- rendering ----------------------------------------------------------------------------------

function render() {
  if (!state) return;
  renderMemory();
  renderModels();
  renderTiers();
  renderEvents();
  renderBatches();
  renderFineTuning();
}

function elapsed() {
  return (Date.now() - stateAt) / 1000;
}

function drawBar(target, total, parts, emptyLabel) {
  target.replaceChildren();
  const width = target.clientWidth || 800;
  const height = 34;
  target.setAttribute("viewBox", `0 0 ${width} ${height}`);
  target.append(svg("rect", { x: 0, y: 0, width, height, rx: 6, class: "free" }));
  let x = 0;
  for (const part of parts) {
    const w = total > 0 ? Math.max(2, (part.bytes / total) * width) : 0;
    const g = svg("g", { "data-model": part.model, "data-place": part.place });
    g.append(svg("rect", { x: x + 1, y: 2, width: Math.max(1, w - 2), height: height - 4, rx: 5, class: `place ${part.place}` }));
    g.append(svg("title", {}, `${part.model}: ${bytes(part.bytes)} (${part.place})`));
    if (w > 60) g.append(svg("text", { x: x + 8, y: height / 2 + 4 }, `${part.model}${part.pinned ? " · pinned" : ""}`));
    target.append(g);
    x += w;
  }
  if (!parts.length) target.append(svg("text", { x: 10, y: height / 2 + 4, class: "empty" }, emptyLabel));
}

function renderMemory() {
  const { vram, host_cache: host, models } = state;
  const onDevice = models.filter((m) => m.place === "resident" || m.place === "loading")
    .map((m) => ({ model: m.id, place: m.place, bytes: m.footprint_bytes, pinned: m.pinned }));
  const warm = models.filter((m) => m.place === "warm")
    .map((m) => ({ model: m.id, place: "warm", bytes: m.host_bytes, pinned: m.pinned }));
  drawBar($("vram-bar"), vram.budget_bytes, onDevice, "no model on the device");
  drawBar($("host-bar"), host.budget_bytes, warm, "no warm copies");
  $("vram-text").textContent = `${bytes(vram.used_bytes)} of ${bytes(vram.budget_bytes)} on ${vram.device}`;
  $("host-text").textContent = `${bytes(host.used_bytes)} of ${bytes(host.budget_bytes)}`;
}

function protectionLeft(m) {
  return Math.max(0, m.protected_until_s - elapsed());
}

function renderModels() {
  const rows = state.models.map((m) => {
    const marks = el("td", { class: "marks" });
    if (m.pinned) marks.append(el("span", { class: "mark pinned" }, "pinned"));
    const left = protectionLeft(m);
    if (left > 0) {
      const from = Object.keys(m.protected_from);
      marks.append(el("span", { class: "mark protected", title: `no eviction by ${from.join(", ")}` },
        `protected ${Math.ceil(left)} s`));
    }
    return el("tr", { "data-model": m.id, "data-place": m.place, "data-pinned": String(m.pinned),
                      "data-protected-s": left.toFixed(1) },
      el("td", {}, el("span", { class: `dot ${m.place}` }), m.id),
      el("td", {}, m.kind),
      el("td", { "data-field": "place" }, m.place),
      el("td", { class: "num" }, bytes(m.footprint_bytes)),
      el("td", { class: "num" }, m.running),
      el("td", {}, m.last_tier ?? "–"),
      marks);
  });
  $("models").tBodies[0].replaceChildren(...rows);
}

function renderTiers() {
  const rows = state.tiers.map((t) => {
    const reasons = Object.entries(t.refused_by_reason_per_min).map(([r, n]) => `${r} ${n}`).join(", ");
    const ratio = t.p99_s === null ? 0 : t.p99_s / t.latency_target_s;
    const fill = el("span", { class: ratio > 0.8 ? "hot" : "" });
    fill.style.width = `${Math.min(100, ratio * 100).toFixed(1)}%`;
    const limit = t.limit < t.max_inflight ? ` (guard: ${t.limit})` : "";
    return el("tr", { "data-tier": t.name },
      el("td", {}, t.name, t.batch ? el("span", { class: "muted" }, " batch") : ""),
      el("td", { class: "num", "data-field": "in_flight" }, `${t.in_flight} / ${t.max_inflight}${limit}`),
      el("td", { class: "num", "data-field": "queued" }, `${t.queued} / ${t.max_queued}`),
      el("td", { class: "num", "data-field": "realtime_sessions" }, t.realtime_sessions),
      el("td", { class: "num", "data-field": "admitted_per_min" }, t.admitted_per_min),
      el("td", { class: `num ${t.refused_per_min ? "refused" : ""}`, "data-field": "refused_per_min", title: reasons },
        t.refused_per_min),
      el("td", { class: "num", "data-field": "p50" }, secs(t.p50_s)),
      el("td", { class: "num", "data-field": "p99" }, secs(t.p99_s)),
      el("td", { title: `target ${t.latency_target_s} s` }, el("div", { class: "target" }, fill)));
  });
  $("tiers").tBodies[0].replaceChildren(...rows);
}

function describe(e) {
  const by = e.by_tier ? ` by a ${e.by_tier} request for ${e.by_model} (${e.reason})` : " by an admin";
  switch (e.kind) {
    case "load_started": return `loading ${e.model} from ${e.from_place} for ${e.tier}`;
    case "load_finished": return `loaded ${e.model} from ${e.from_place} in ${secs(e.seconds)} (${bytes(e.footprint_bytes)})`;
    case "load_failed": return `loading ${e.model} failed: ${e.reason}`;
    case "engine_failed": return `${e.model} failed: ${e.reason}; it is loaded again on demand`;
    case "eviction": return `evicted ${e.model} to ${e.to_place}${by}`;
    case "refusal": return `refused ${e.tier}${e.model ? ` for ${e.model}` : ""}: ${e.reason}` +
      (e.retry_after_s ? ` (retry in ${e.retry_after_s} s)` : "");
    case "batch_paused": return `batch work paused on ${e.model}`;
    case "batch_resumed": return `batch work resumed on ${e.model}`;
    case "oom_relief": return `out of memory on ${e.model} (${e.tier}): evicting ${e.victim}`;
    case "limits_changed": return "SLO guard: " + Object.entries(e.limits)
      .filter(([t, n]) => n !== e.before[t]).map(([t, n]) => `${t} ${e.before[t]} → ${n}`).join(", ");
    case "loop_stall": return `the event loop ran ${secs(e.lag_s)} late ` + (e.where ? `in ${e.where}`
      : e.cause === "gc" ? `during full garbage collections (${secs(e.gc_s)})`
      : e.cause === "waiting" ? "waiting for the interpreter lock or a CPU" : "(not sampled: C code held the lock)");
    default: return e.kind;
  }
}

function renderEvents() {
  eventsDrawnAt = Date.now();
  const list = [...events.values()].sort((a, b) => b.id - a.id);
  $("events").replaceChildren(...list.map((e) => el("li", { "data-kind": e.kind, "data-event-id": e.id },
    el("time", {}, clock(e.at)),
    el("span", { class: `kind ${KIND_CLASS[e.kind] || ""}` }, KIND_LABEL[e.kind] || e.kind),
    el("span", { class: "what" }, describe(e)))));
  renderTimeline(list);
}

function renderTimeline(list) {
  const target = $("timeline");
  target.replaceChildren();
  const width = target.clientWidth || 600;
  const height = 46;
  target.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const now = state ? state.time + elapsed() : Date.now() / 1000;
  target.append(svg("line", { x1: 0, y1: 20, x2: width, y2: 20, class: "axis" }));
  for (const m of [5, 4, 3, 2, 1, 0]) {
    const x = width - 4 - (m * 60 / TIMELINE_S) * (width - 8);
    const anchor = m === 5 ? "start" : m === 0 ? "end" : "middle";
    target.append(svg("text", { x, y: 42, "text-anchor": anchor }, m ? `-${m} min` : "now"));
  }
  for (const e of list) {
    const age = now - e.at;
    if (age > TIMELINE_S || age < -5) continue;
    const x = width - 4 - (Math.max(0, age) / TIMELINE_S) * (width - 8);
    const dot = svg("circle", { cx: x, cy: 20, r: 5, class: `kind ${KIND_CLASS[e.kind] || ""}` });
    dot.append(svg("title", {}, `${clock(e.at)} ${describe(e)}`));
    target.append(dot);
  }
}

function renderBatches() {
  const rows = state.batches.map((b) => {
    const bar = el("div", { class: "progress" });
    const ok = el("span", { class: "ok" });
    const bad = el("span", { class: "bad" });
    ok.style.width = `${b.total ? (b.completed / b.total) * 100 : 0}%`;
    bad.style.width = `${b.total ? (b.failed / b.total) * 100 : 0}%`;
    bar.append(ok, bad);
    return el("tr", { "data-batch": b.id, "data-status": b.status },
      el("td", {}, b.id),
      el("td", {}, b.status),
      el("td", {}, b.endpoint),
      el("td", {}, bar, `${b.completed + b.failed} / ${b.total}` + (b.failed ? ` (${b.failed} failed)` : "")));
  });
  $("batches").tBodies[0].replaceChildren(...rows);
  $("no-batches").hidden = rows.length > 0;
  $("no-batches").textContent = state.batches_error || "No batch jobs.";
}

function renderFineTuning() {
  const rows = (state.fine_tuning || []).map((j) => {
    let progress = j.fine_tuned_model || "";
    if (j.total_steps) {
      const bar = el("div", { class: "progress" });
      const ok = el("span", { class: "ok" });
      ok.style.width = `${(j.step / j.total_steps) * 100}%`;
      bar.append(ok);
      progress = [bar, `step ${j.step} / ${j.total_steps}`];
    } else if (j.status === "running") {
      progress = "waiting for the trainer, or running in another process";
    }
    return el("tr", { "data-job": j.id, "data-status": j.status },
      el("td", {}, j.id),
      el("td", {}, j.method === "dpo" ? `${j.model} (DPO)` : j.model),
      el("td", {}, j.status),
      el("td", {}, ...[].concat(progress)));
  });
  $("fine-tuning").tBodies[0].replaceChildren(...rows);
  $("no-fine-tuning").hidden = rows.length > 0;
  $("no-fine-tuning").textContent = state.fine_tuning_error || "No fine-tuning jobs.";
}

// -- start --------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("connect").addEventListener("click", () => {
    const key = $("key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    $("key").value = "";
    connect();
  });
  $("key").addEventListener("keydown", (e) => { if (e.key === "Enter") $("connect").click(); });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    if (controller) controller.abort();
    state = null;
    events.clear();
    showLogin();
  });
  setInterval(() => { if (state) { renderModels(); renderTimeline([...events.values()]); } }, 1000);
  window.addEventListener("resize", render);
  connect();
});
