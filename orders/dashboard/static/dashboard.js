// The orders dashboard: fills the page from api/events (server-sent events) and answers
// the user search from api/user, both relative to the page, so that it works wherever the
// dashboard is mounted (/ or /ops/orders/). Every value from the server is written as text
// (textContent), never as HTML: order and user ids are whatever checkout code chose, and
// a payment reference whatever the payment callback passed on, a resource id whatever
// set_capacity was given, a unit name whatever set_units was given.
"use strict";

const $ = (selector, root = document) => root.querySelector(selector);

function field(name, text, bad = false) {
  for (const el of document.querySelectorAll(`[data-field="${name}"]`)) {
    el.textContent = text;
    el.classList.toggle("bad", bad);
  }
}

function showError(part, section) {
  const el = $(`[data-error="${part}"]`);
  if (!el) return false;
  const failed = section && typeof section === "object" && "error" in section;
  el.hidden = !failed;
  el.textContent = failed ? section.error : "";
  return failed;
}

const num = (n) => (n === null || n === undefined ? "-" : Number(n).toLocaleString("en"));

function duration(ms) {
  if (ms === null || ms === undefined) return "-";
  const sign = ms < 0 ? "-" : "";
  ms = Math.abs(ms);
  if (ms < 1000) return `${sign}${ms} ms`;
  const s = ms / 1000;
  if (s < 120) return `${sign}${s.toFixed(s < 10 ? 2 : 1)} s`;
  // Whole seconds first: 599.6 s is "10 min 0 s", never "9 min 60 s".
  const whole = Math.round(s);
  if (whole < 7200) return `${sign}${Math.floor(whole / 60)} min ${whole % 60} s`;
  return `${sign}${(s / 3600).toFixed(1)} h`;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

const clock = (ms) => (ms === null || ms === undefined ? "-" : new Date(ms).toISOString().slice(11, 23));

function fillTable(id, rows, cells, rowClass = () => "") {
  const body = $(`#${id} tbody`);
  if (!rows.length) {
    const td = document.createElement("td");
    td.colSpan = $(`#${id} thead tr`).children.length;
    td.className = "muted";
    td.textContent = $(`#${id}`).dataset.empty || "none";
    const tr = document.createElement("tr");
    tr.className = "empty";
    tr.append(td);
    body.replaceChildren(tr);
    return;
  }
  body.replaceChildren(...rows.map((row) => {
    const tr = document.createElement("tr");
    const cls = rowClass(row);
    if (cls) tr.className = cls;
    for (const [text, tdClass] of cells(row)) {
      const td = document.createElement("td");
      td.textContent = text;
      if (tdClass) td.className = tdClass;
      tr.append(td);
    }
    return tr;
  }));
}

const SVG = "http://www.w3.org/2000/svg";

function chart(upcoming) {
  const box = $("#expiries");
  // Drawn at the box's own width in pixels, so the labels keep their shape.
  const width = Math.max(240, box.clientWidth), height = 160, bottom = 18, top = 14;
  const max = Math.max(1, ...upcoming.map(([, count]) => count));
  const slot = width / Math.max(1, upcoming.length);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  upcoming.forEach(([startS, count], i) => {
    const h = ((height - bottom - top) * count) / max;
    const rect = document.createElementNS(SVG, "rect");
    rect.setAttribute("x", String(i * slot + 2));
    rect.setAttribute("y", String(height - bottom - h));
    rect.setAttribute("width", String(Math.max(1, slot - 4)));
    rect.setAttribute("height", String(h));
    rect.dataset.count = String(count);
    const title = document.createElementNS(SVG, "title");
    title.textContent = `${count} due from +${startS} s`;
    rect.append(title);
    svg.append(rect);
    const label = document.createElementNS(SVG, "text");
    label.setAttribute("x", String(i * slot + slot / 2));
    label.setAttribute("y", String(height - bottom - h - 3));
    label.setAttribute("text-anchor", "middle");
    label.textContent = count ? String(count) : "";
    svg.append(label);
    if (i % Math.ceil(upcoming.length / 10) === 0) {
      const tick = document.createElementNS(SVG, "text");
      tick.setAttribute("x", String(i * slot + 2));
      tick.setAttribute("y", String(height - 4));
      tick.textContent = `+${Math.round(startS / 60 * 10) / 10} min`;
      svg.append(tick);
    }
  });
  box.replaceChildren(svg);
}

function renderPause(pause, at) {
  const el = $("#pause");
  const open = pause && typeof pause === "object" && !("error" in pause);
  el.hidden = !open;
  if (!open) return;
  const state = pause.resuming ? "Resuming" : "Paused";
  const by = pause.actor ? ` by ${pause.actor}` : "";
  el.textContent = `${state} for ${duration(at - pause.started_at_ms)}${by}: ${pause.reason}` +
    " (nothing closes by expiry)";
}

function render(data) {
  const at = data.at_ms;
  field("at", clock(at));
  renderPause(data.pause, at);
  const sql = data.sql;
  if (!showError("sql", sql)) {
    const s = sql.stats;
    field("unpaid", num(s.by_status.unpaid));
    field("open_unpaid", num(s.open_unpaid));
    field("backlog", num(s.backlog), s.backlog > 0);
    field("paid", num(s.by_status.paid));
    field("cancelled", num(s.by_status.cancelled));
    field("closed", num(s.by_status.closed));
    field("reminded", num(s.reminded_in_window));
    field("replaced", num(s.replaced_in_window));
    field("own_limits", num(s.users_with_own_limit));
    field("lag_p50", duration(s.lag_p50_ms));
    field("lag_p99", duration(s.lag_p99_ms));
    field("lag_max", duration(s.lag_max_ms));
    chart(s.upcoming);
    fillTable("recent-closes", sql.recent_closes, (c) => [
      [c.order_id], [c.user_id], [clock(c.closed_at_ms)], [duration(c.lag_ms), "num"],
    ]);
  }
  const sched = data.scheduling;
  if (!showError("scheduling", sched)) {
    field("lease_owner", sched.lease_owner || "nobody", !sched.lease_owner);
    field("lease_ttl", sched.lease_ttl_ms === null ? "-" : duration(sched.lease_ttl_ms));
    fillTable("schedulers", sched.schedulers, (b) => [
      [b.owner], [b.active ? "active" : "standby"],
      [b.last_sweep_ms === null ? "never" : `${duration(at - b.last_sweep_ms)} ago`],
      [b.lease_expires_ms === null ? "-" : clock(b.lease_expires_ms)],
      [`${duration(at - b.seen_ms)} ago`],
    ]);
  }
  const consumers = data.consumers;
  if (!showError("consumers", consumers)) {
    fillTable("consumers", consumers, (c) => [
      [c.name], [c.cursor], [`${num(c.lag_events)}${c.lag_capped ? "+" : ""}`, "num"],
      [duration(c.oldest_unread_age_ms)],
      [num(c.retrying), "num"], [num(c.parked), c.parked > 0 ? "num bad" : "num"],
    ]);
  }
  const refunds = data.refunds;
  if (!showError("refunds", refunds)) {
    const owed = `${num(refunds.owed)}${refunds.owed_capped ? "+" : ""}`;
    field("refunds_owed", owed, refunds.owed > 0);
    field("refunds_oldest", refunds.oldest_age_ms === null ? "-" : `${duration(refunds.oldest_age_ms)} ago`);
    fillTable("refunds", refunds.newest, (r) => [
      [r.order_id], [r.user_id ?? "-"], r.payment_ref === null ? ["none", "ref muted"] : [r.payment_ref, "ref"],
      [r.reason], [r.amount === null ? "-" : `${r.amount} ${r.currency || ""}`.trim(), "num"],
      [`${duration(r.age_ms)} ago`],
    ]);
  }
  renderResources(data.resources);
  renderWaiting(data.waiting);
  const redis = data.redis;
  if (!showError("redis", redis)) {
    field("redis_memory", bytes(redis.used_memory_bytes));
    field("redis_keys", num(redis.keys));
    field("redis_servers", num(redis.servers));
  }
}

// A named resource's free count says "seats", and its first free names follow (a few:
// the server sends FREE_NAMES at most); a counted resource has no names.
function freeCell(r) {
  if (r.sold_out) return ["0 sold out", "num bad"];
  return [r.named ? `${num(r.free)} seats` : num(r.free), "num"];
}

function firstFree(r) {
  if (!r.named || r.first_free.length === 0) return [""];
  const more = r.free > r.first_free.length ? ", …" : "";
  return [`${r.first_free.join(", ")}${more}`, "ref"];
}

function rankedNote(name, part, what) {
  const note = $(`[data-field="${name}"]`);
  note.hidden = !part.capped;
  note.textContent = part.capped ? `ranked among the first ${num(part.ranked_cap)} ${what} only` : "";
}

function renderResources(resources) {
  if (showError("resources", resources)) return;
  fillTable("resources", resources.running_out, (r) => [
    [r.id, "ref"], [num(r.capacity), "num"], [num(r.held), "num"], [num(r.sold), "num"],
    freeCell(r), firstFree(r),
  ], (r) => (r.sold_out ? "soldout" : ""));
  rankedNote("resources_ranked", resources, "resources by id");
}

function renderWaiting(waiting) {
  if (showError("waiting", waiting)) return;
  fillTable("waiting", waiting.longest, (q) => [
    [q.resource_id, "ref"], [num(q.entries), "num"], [num(q.units), "num"],
    [duration(q.oldest_age_ms), "num"], [num(q.free), "num"],
  ]);
  rankedNote("waiting_ranked", waiting, "waiting entries by resource");
}

async function lookUp(userId) {
  const summary = $("#user-summary");
  const table = $("#user-slots");
  const reply = await fetch(`api/user?user_id=${encodeURIComponent(userId)}`, { credentials: "same-origin" });
  const body = await reply.json();
  if (!reply.ok) {
    summary.textContent = body.error;
    table.hidden = true;
    return;
  }
  const at = body.at_ms;
  summary.textContent = `${body.user_id}: ${body.rows.length} unpaid (limit ${body.limit}), ` +
    `${body.differences} difference${body.differences === 1 ? "" : "s"}`;
  table.dataset.differences = String(body.differences);
  fillTable("user-slots", body.rows, (r) => [
    [r.order_id], [r.slot === null ? "-" : String(r.slot)],
    [r.sql_expires_at_ms === null ? "absent" : `${clock(r.sql_expires_at_ms)} ${r.sql_status}`],
    [r.index_expires_at_ms === null ? "absent" : clock(r.index_expires_at_ms)],
    [duration(r.time_left_ms), "num"], [body.states[r.state] || r.state, "state"],
  ], (r) => (r.state === "same" ? "" : "diff"));
  table.hidden = false;
}

function connect() {
  const live = $("#live");
  const events = new EventSource("api/events");
  events.addEventListener("overview", (event) => {
    render(JSON.parse(event.data));
    live.dataset.state = "live";
    live.textContent = "live";
  });
  events.onerror = () => {
    live.dataset.state = "lost";
    live.textContent = "reconnecting";
  };
}

document.addEventListener("DOMContentLoaded", () => {
  $("#user-search").addEventListener("submit", (event) => {
    event.preventDefault();
    lookUp(new FormData(event.target).get("user_id").trim());
  });
  connect();
});
