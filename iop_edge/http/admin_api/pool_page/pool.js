// The live pool page: polls the admin API's read-only documents and redraws.
// No framework, no build step, nothing from elsewhere; every value from the Edge is
// written with textContent (never parsed as HTML).
"use strict";

const POLL_MS = 1000;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function bar(used, total, label) {
  const ratio = total > 0 ? Math.min(used / total, 1) : 0;
  const level = ratio >= 1 ? "full" : ratio >= 0.75 ? "high" : "ok";
  const fill = el("span", { class: `fill ${level}` });
  fill.style.width = `${(ratio * 100).toFixed(1)}%`;
  return el("span", { class: "bar", title: label, "data-load": `${used}/${total}` },
    fill, el("span", { class: "bar-text" }, `${used}/${total}`));
}

function healthCell(provider) {
  const health = provider.connected ? provider.health : "unavailable";
  const shown = provider.cooling_down ? `${health} (cooldown)`
    : provider.rate_limited_s != null ? `${health} (rate-limited)` : health;
  const cell = el("td", {},
    el("span", { class: `health ${health}`, "data-health": health }, shown));
  if (provider.health_reason) {
    cell.append(el("div", { class: "reason" }, provider.health_reason));
  }
  return cell;
}

function replaceRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

// A fleet has tens of thousands of providers: the page shows them counted by health
// (/catalog/summary) and lists one page of them (/catalog?limit=&cursor=), filtered by
// health, Node or model as the operator chooses.
const PROVIDERS_PAGE = 50;
const providerView = { cursors: [null], filters: {} };

function providersPath() {
  const query = new URLSearchParams({ limit: String(PROVIDERS_PAGE) });
  for (const [name, value] of Object.entries(providerView.filters)) {
    if (value) query.set(name, value);
  }
  const cursor = providerView.cursors[providerView.cursors.length - 1];
  if (cursor) query.set("cursor", cursor);
  return `/catalog?${query}`;
}

function drawProviderSummary(summary) {
  const parts = Object.entries(summary.by_health).map(([health, count]) =>
    el("span", { class: `health ${health}`, "data-health-count": health }, `${count} ${health}`));
  const line = document.getElementById("provider-summary");
  line.replaceChildren(`${summary.providers} providers on ${summary.nodes} nodes: `);
  parts.forEach((part, index) => line.append(index ? " · " : "", part));
}

// Which served models the runtime holds (design §18), where it says: "smol-a loaded",
// and which of them are pinned there ("smol-a loaded, pinned": placement never evicts it);
// then the models a refresh gave it that its Node does not serve yet (design §5 step 6).
const UNAPPLIED = {
  pending: ["not applied yet", "its Node has not applied the refresh that gave it this model"],
  refused: ["refused by its node", "its Node refused the refresh that gave it this model"],
};

function modelStates(p) {
  const unapplied = Object.entries(p.unapplied || {});
  if (!p.model_states && !unapplied.length) return "";
  const pinned = new Set(p.pinned || []);
  const states = (p.model_states || []).map((s) => el("span", {
    class: `model-state ${s.state}`, "data-model-state": `${s.name}=${s.state}`,
    "data-pinned": pinned.has(s.name) ? "yes" : "no",
    title: s.reason || (pinned.has(s.name) ? "pinned: kept loaded here" : ""),
  }, `${s.name} ${s.state}${pinned.has(s.name) ? ", pinned" : ""}`));
  for (const [name, how] of unapplied) {
    const [text, title] = UNAPPLIED[how] || [how, ""];
    states.push(el("span", {
      class: `model-state unapplied ${how}`, "data-unapplied": `${name}=${how}`, title,
    }, `${name} ${text}`));
  }
  const line = el("div", { class: "reason" });
  states.forEach((state, index) => line.append(index ? " · " : "", state));
  if (p.max_loaded) line.append(el("span", { class: "meta" }, ` (holds ${p.max_loaded})`));
  return line;
}

function cachedCell(provider) {
  // The recent share of its prompt tokens its runtime took from its prefix cache.
  const share = provider.cached_share;
  const text = share === null || share === undefined ? "-" : `${Math.round(share * 100)}%`;
  return el("td", { class: "num", "data-cached-share": share ?? "" }, text);
}

function drawProviders(catalog) {
  const rows = catalog.providers.map((p) => {
    const long = p.long_context_slots === null
      ? el("span", { class: "meta", title: "long-context runs need only a regular slot" }, "shared")
      : bar(p.long_in_flight, p.long_context_slots, "long-context runs in flight / long slots");
    return el("tr", { "data-provider": p.id, class: p.enabled ? "" : "disabled" },
      el("td", {}, el("strong", {}, p.id), modelStates(p)),
      el("td", {}, p.node_id, p.connected ? "" : el("span", { class: "meta" }, " (disconnected)")),
      healthCell(p),
      el("td", {}, bar(p.in_flight, p.capacity, "runs in flight / capacity")),
      el("td", {}, long),
      el("td", {}, p.type),
      el("td", { "data-protocols": (p.protocols || []).join(" ") }, (p.protocols || []).join(", ")),
      el("td", { class: "num" }, p.priority),
      cachedCell(p));
  });
  replaceRows(document.getElementById("providers"), rows);
  const page = providerView.cursors.length;
  providerView.next = catalog.next;
  document.getElementById("providers-page").textContent =
    `page ${page} · ${rows.length} shown${catalog.next ? "" : " · last page"}`;
  document.getElementById("providers-prev").disabled = page === 1;
  document.getElementById("providers-next").disabled = !catalog.next;
}

function setupProviderControls() {
  const restart = () => { providerView.cursors = [null]; pollNow(); };
  const form = document.getElementById("provider-filters");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const data = new FormData(form);
    providerView.filters = {
      health: data.get("health") || "", node: (data.get("node") || "").trim(),
      model: (data.get("model") || "").trim(),
    };
    restart();
  });
  form.addEventListener("change", (event) => {
    if (event.target.name === "health") form.requestSubmit();
  });
  document.getElementById("providers-next").addEventListener("click", () => {
    if (providerView.next) { providerView.cursors.push(providerView.next); pollNow(); }
  });
  document.getElementById("providers-prev").addEventListener("click", () => {
    if (providerView.cursors.length > 1) { providerView.cursors.pop(); pollNow(); }
  });
}

// A model of a fleet is served by thousands of providers: the table names a few.
const MODEL_PROVIDERS_SHOWN = 4;

function drawModels(catalog, readiness) {
  const servable = new Set(readiness.servable_models || []);
  const rows = catalog.models.map((m) => {
    const entries = Object.entries(m.providers);
    const mapping = entries.slice(0, MODEL_PROVIDERS_SHOWN).map(([pid, served]) => `${pid} → ${served}`);
    const more = entries.length - mapping.length;
    const ok = servable.has(m.id);
    return el("tr", { "data-model": m.id },
      el("td", {}, el("strong", {}, m.id)),
      el("td", {}, m.display_name || ""),
      el("td", { "data-providers": entries.length },
        mapping.join(", "), more > 0 ? el("span", { class: "meta" }, ` and ${more} more`) : ""),
      el("td", { class: "num", "data-queue": m.queued }, m.queued),
      el("td", {}, el("span", { class: `health ${ok ? "available" : "unavailable"}` }, ok ? "yes" : "no")));
  });
  replaceRows(document.getElementById("models"), rows);
}

function limitCell(left, limit) {
  if (limit === null || limit === undefined) return el("span", { class: "meta" }, "–");
  return bar(limit - left, limit, "used / limit");
}

function drawPrincipals(report) {
  const principals = report.principals || [];
  document.getElementById("principals-section").hidden = principals.length === 0;
  document.getElementById("principals-note").textContent = report.replicas > 1
    ? `each against its limits (per-minute and concurrency: this replica's share of ${report.replicas})`
    : "each against its limits";
  const rows = principals.map((p) => el("tr", { "data-principal": p.principal_ref },
    el("td", {}, el("strong", {}, p.principal_ref),
      p.models ? el("div", { class: "reason" }, `models: ${p.models.join(", ")}`) : ""),
    el("td", {}, p.limited_by || el("span", { class: "meta" }, "none")),
    el("td", { "data-in-flight": p.in_flight }, p.max_concurrent
      ? bar(p.in_flight, p.max_concurrent, "runs in flight / max_concurrent")
      : String(p.in_flight)),
    el("td", { class: "num", "data-queued": p.queued }, p.queued),
    el("td", {}, limitCell(p.requests_remaining, p.requests_per_minute)),
    el("td", {}, limitCell(p.tokens_remaining, p.tokens_per_minute)),
    el("td", {}, p.tokens_per_day === null
      ? String(p.tokens_today)
      : bar(p.tokens_today, p.tokens_per_day, "tokens metered today (UTC) / tokens_per_day")),
    el("td", { class: "num" }, p.weight)));
  replaceRows(document.getElementById("principals"), rows);
}

// The Nodes table lists the ones that need a look - not connected, or behind the
// running revision - up to NODES_SHOWN; the rest are counted.
const NODES_SHOWN = 100;

function drawNodes(status) {
  const nodes = status.nodes;
  const connected = nodes.filter((n) => n.connected).length;
  const behind = (n) => n.connected && (n.applied_revision ?? 0) < status.revision;
  const notable = nodes.filter((n) => !n.connected || behind(n));
  const shown = (notable.length || nodes.length <= NODES_SHOWN ? notable : nodes)
    .slice(0, NODES_SHOWN);
  const lagging = nodes.filter(behind).length;
  document.getElementById("nodes-summary").textContent =
    `${nodes.length} nodes: ${connected} connected, ${lagging} behind revision ${status.revision}` +
    (notable.length > shown.length ? ` · first ${shown.length} of ${notable.length} shown` : "");
  const rows = (nodes.length <= NODES_SHOWN ? nodes : shown).map((n) => el("tr", { "data-node": n.id },
    el("td", {}, el("strong", {}, n.id)),
    el("td", {}, el("span", { class: `health ${n.connected ? "available" : "unavailable"}` },
      n.connected ? "yes" : "no")),
    el("td", { class: "num" }, n.applied_revision ?? "–")));
  replaceRows(document.getElementById("nodes"), rows);
}

function drawActivity(activity) {
  document.getElementById("rps").textContent = activity.requests_per_s.toFixed(2);
  document.getElementById("errors").textContent = activity.errors_last_minute;
  document.getElementById("rejected").textContent = activity.rejected_last_minute;
  const peak = Math.max(1, ...activity.buckets.map((b) => b.requests));
  const columns = activity.buckets.map((b) => {
    const column = el("span", {
      class: "column",
      title: `${new Date(b.start * 1000).toLocaleTimeString()}: ${b.requests} requests, ` +
        `${b.errors} errors, ${b.rejected} rejected`,
    });
    for (const [part, count] of [["ok", b.ok], ["rejected", b.rejected], ["errors", b.errors]]) {
      if (count > 0) {
        const segment = el("span", { class: `segment ${part}` });
        segment.style.height = `${(count / peak) * 100}%`;
        column.append(segment);
      }
    }
    return column;
  });
  document.getElementById("activity").replaceChildren(...columns);
}

// --- per-model charts: small inline SVG, drawn here (no library) ---------------------

const SVG_NS = "http://www.w3.org/2000/svg";
const CHART_W = 220;
const CHART_H = 56;
const PAD = 4;

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  node.append(...children);
  return node;
}

function chartX(index, count) {
  return PAD + (count > 1 ? (index * (CHART_W - 2 * PAD)) / (count - 1) : 0);
}

function chartY(value, top) {
  return CHART_H - PAD - (Math.min(value, top) / top) * (CHART_H - 2 * PAD);
}

// A line through the values; null leaves a gap (no sample in that bucket).
function linePath(values, top) {
  let path = "";
  let drawing = false;
  values.forEach((value, index) => {
    if (value === null || value === undefined) {
      drawing = false;
      return;
    }
    const point = `${chartX(index, values.length).toFixed(1)} ${chartY(value, top).toFixed(1)}`;
    path += drawing ? ` L ${point}` : ` M ${point}`;
    drawing = true;
  });
  return path.trim();
}

function frame(label, top, unit) {
  const chart = svg("svg", {
    viewBox: `0 0 ${CHART_W} ${CHART_H}`, role: "img", "aria-label": label,
    preserveAspectRatio: "none",
  }, svg("title", {}, `${label} (scale 0 to ${top}${unit})`));
  chart.append(svg("line", {
    class: "axis", x1: PAD, x2: CHART_W - PAD, y1: CHART_H - PAD, y2: CHART_H - PAD,
  }));
  return chart;
}

function niceTop(values, floor) {
  const peak = Math.max(floor, ...values.filter((v) => v !== null && v !== undefined));
  const magnitude = 10 ** Math.floor(Math.log10(peak));
  for (const step of [1, 2, 2.5, 5, 10]) {
    if (peak <= step * magnitude) return step * magnitude;
  }
  return peak;
}

// A dot per sample: a bucket whose neighbours have none still shows.
function dots(values, top, cls) {
  const group = svg("g", { class: cls });
  values.forEach((value, index) => {
    if (value !== null && value !== undefined) {
      group.append(svg("circle", {
        cx: chartX(index, values.length).toFixed(1), cy: chartY(value, top).toFixed(1), r: 1.6,
      }));
    }
  });
  return group;
}

function lastValue(values) {
  for (let i = values.length - 1; i >= 0; i -= 1) {
    if (values[i] !== null && values[i] !== undefined) return values[i];
  }
  return null;
}

function seconds(value) {
  if (value === null) return "–";
  return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(2)} s`;
}

function ttftCell(m) {
  const top = niceTop([...m.ttft_p95_s, ...m.ttft_p50_s], 0.05);
  const chart = frame(`time to first token of ${m.model}`, top * 1000, " ms");
  chart.append(svg("path", { class: "p95", d: linePath(m.ttft_p95_s, top) }));
  chart.append(svg("path", { class: "p50", d: linePath(m.ttft_p50_s, top) }));
  chart.append(dots(m.ttft_p95_s, top, "p95-dots"), dots(m.ttft_p50_s, top, "p50-dots"));
  const p50 = lastValue(m.ttft_p50_s);
  const p95 = lastValue(m.ttft_p95_s);
  return el("td", { "data-ttft-p50": p50 ?? "", "data-ttft-p95": p95 ?? "" },
    el("div", { class: "chart" }, chart,
      el("span", { class: "now" },
        el("div", {}, el("span", { class: "key p50" }), "p50 ", el("strong", {}, seconds(p50))),
        el("div", {}, el("span", { class: "key p95" }), "p95 ", el("strong", {}, seconds(p95))))));
}

function rateCell(m) {
  const values = m.tokens_per_s;
  const top = niceTop(values, 1);
  const chart = frame(`output tokens per second of ${m.model}`, top, " tokens/s");
  const line = linePath(values, top);
  if (line) {
    const baseline = (CHART_H - PAD).toFixed(1);
    const first = chartX(0, values.length).toFixed(1);
    const last = chartX(values.length - 1, values.length).toFixed(1);
    chart.append(svg("path", { class: "rate", d: `M ${first} ${baseline} ${line.replace(/^M/, "L")} L ${last} ${baseline} Z` }));
  }
  const minute = m.tokens_per_s_last_minute;
  return el("td", { "data-tokens-per-s": minute },
    el("div", { class: "chart" }, chart,
      el("span", { class: "now", title: "output tokens per second over the last minute" },
        el("strong", {}, minute.toFixed(1)), " tokens/s")));
}

function queueCell(m) {
  const values = m.queue_depth;
  const top = niceTop(values, 1);
  const chart = frame(`deepest queue of ${m.model}`, top, " requests");
  const width = (CHART_W - 2 * PAD) / values.length;
  values.forEach((depth, index) => {
    if (depth > 0) {
      const y = chartY(depth, top);
      chart.append(svg("rect", {
        class: "depth", x: (PAD + index * width).toFixed(1), y: y.toFixed(1),
        width: Math.max(width - 1, 1).toFixed(1), height: (CHART_H - PAD - y).toFixed(1),
      }));
    }
  });
  const deepest = Math.max(0, ...values);
  return el("td", { "data-queue-max": deepest, "data-queue-now": values[values.length - 1] ?? 0 },
    el("div", { class: "chart" }, chart,
      el("span", { class: "now" }, "max ", el("strong", {}, deepest))));
}

function drawModelCharts(activity) {
  const models = activity.models || [];
  document.getElementById("model-charts-section").hidden = models.length === 0;
  const rows = models.map((m) => el("tr", { "data-model-chart": m.model },
    el("td", {}, el("strong", {}, m.model),
      el("div", { class: "reason" }, `${m.streams.reduce((a, b) => a + b, 0)} streams timed`)),
    ttftCell(m), rateCell(m), queueCell(m)));
  replaceRows(document.getElementById("model-charts"), rows);
}

function drawHeader(status, readiness) {
  const ready = document.getElementById("ready");
  ready.textContent = readiness.status === "ready" ? "ready" : "not ready";
  ready.className = `badge ${readiness.status === "ready" ? "good" : "bad"}`;
  ready.title = readiness.reason || "";
  document.getElementById("revision").textContent =
    `revision ${status.revision} · config ${status.config_sha256.slice(0, 12)}`;
  const pending = document.getElementById("pending");
  pending.hidden = status.pending_restart.length === 0;
  pending.textContent = `restart pending: ${status.pending_restart.length} change(s)`;
  pending.title = status.pending_restart.join("\n");
  document.getElementById("servable").textContent =
    `${(readiness.servable_models || []).length}/${readiness.models ?? "?"}`;
}

async function getJson(path) {
  const response = await fetch(path, { cache: "no-store", credentials: "omit" });
  if (!response.ok && response.status !== 503) {
    throw new Error(`${path}: HTTP ${response.status}`);
  }
  return response.json();
}

// One poll at a time: a control that changes what is shown asks for one at once
// (`pollNow`), which runs after the one in flight if there is one.
let pollTimer = null;
let polling = false;
let pollAgain = false;

function pollNow() {
  if (polling) {
    pollAgain = true;
  } else {
    poll();
  }
}

async function poll() {
  polling = true;
  clearTimeout(pollTimer);
  const live = document.getElementById("live");
  try {
    const [catalog, summary, status, activity, readiness, principals] = await Promise.all(
      [providersPath(), "/catalog/summary", "/status", "/activity", "/readyz", "/principals"]
        .map(getJson));
    drawHeader(status, readiness);
    drawActivity(activity);
    drawModelCharts(activity);
    drawProviderSummary(summary);
    drawProviders(catalog);
    drawModels(catalog, readiness);
    drawNodes(status);
    drawPrincipals(principals);
    live.textContent = `live · updated ${new Date().toLocaleTimeString()}`;
    live.className = "meta";
    document.body.dataset.updated = String(Date.now());
  } catch (error) {
    live.textContent = `cannot reach the Edge (${error.message}); retrying`;
    live.className = "meta bad-text";
  } finally {
    polling = false;
    if (pollAgain) {
      pollAgain = false;
      poll();
    } else {
      pollTimer = setTimeout(poll, POLL_MS);
    }
  }
}

setupProviderControls();
poll();
