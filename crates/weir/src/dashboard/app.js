// The weir dashboard: polls the admin API every 1.5 s and redraws what changed. Every
// request that changes something carries the session's CSRF token. No framework, no build.
"use strict";

const CSRF = document.querySelector('meta[name="csrf"]').content;
const EVERY_MS = 1500;
const OPEN_AT_FIRST = 12;
let tab = "waiting";
const runs = {}; // flow id -> run id being followed

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) e.append(c);
  return e;
}

async function api(method, path, body) {
  const headers = { "X-CSRF-Token": CSRF, "X-Weir-Client": "dashboard" };
  if (body !== undefined) headers["content-type"] = "application/json";
  const r = await fetch(path, {
    method,
    headers,
    credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (r.status === 401) {
    location.reload(); // the session ended: the login form
    throw new Error("not logged in");
  }
  const text = await r.text();
  let data = text;
  try { data = JSON.parse(text); } catch (_) { /* SVG, or plain text */ }
  if (!r.ok) throw new Error((data && data.error) || `${method} ${path}: ${r.status}`);
  return data;
}

function showError(e) {
  const p = document.getElementById("error");
  p.textContent = e ? String(e.message || e) : "";
  p.hidden = !e;
}

function age(ms) {
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  if (s < 86400) return `${Math.round(s / 3600)} h`;
  return `${Math.round(s / 86400)} d`;
}

async function act(method, path, body) {
  try {
    const r = await api(method, path, body);
    showError(null);
    await refresh();
    return r;
  } catch (e) {
    showError(e);
  }
}

function flowCard(f) {
  let card = document.getElementById(`flow-${f.id}`);
  if (!card) {
    const name = el("h3", {}, f.id);
    const badge = el("span", { class: "badge" });
    const parked = el("span", { class: "parked" });
    const pause = el("button", { "data-action": "pause", "data-flow": f.id }, "Pause");
    const resume = el("button", { "data-action": "resume", "data-flow": f.id }, "Resume");
    const step = el("button", { "data-action": "step", "data-flow": f.id }, "Step");
    pause.onclick = () => act("POST", `/api/flows/${encodeURIComponent(f.id)}/pause`);
    resume.onclick = () => act("POST", `/api/flows/${encodeURIComponent(f.id)}/resume`);
    step.onclick = () => act("POST", `/api/flows/${encodeURIComponent(f.id)}/step`);
    const bar = el("summary", { class: "bar" }, name, badge, parked, pause, resume, step);
    // Open at first for the first few flows only: a closed card's graph is not fetched.
    const shown = document.querySelectorAll("#flow-list .flow").length;
    card = el("details", { class: "flow", id: `flow-${f.id}`, "data-flow": f.id, open: shown < OPEN_AT_FIRST }, bar);
    card.addEventListener("toggle", () => { if (card.open) refresh(); });
    if (f.description) card.append(el("p", { class: "desc" }, f.description));
    card.append(el("div", { class: "graph-box" }));
    if (f.nodes.some((n) => n.type === "manual")) {
      const input = el("textarea", { "aria-label": `input of a run of ${f.id}`, value: "{}" });
      const out = el("pre", { class: "run-status" }, "");
      const start = el("button", { "data-action": "run", "data-flow": f.id }, "Start a run");
      start.onclick = async () => {
        let body;
        try { body = JSON.parse(input.value || "null"); } catch (e) { showError(`the run's input is not JSON: ${e.message}`); return; }
        const r = await act("POST", `/api/flows/${encodeURIComponent(f.id)}/runs`, body);
        if (r && r.run_id) { runs[f.id] = r.run_id; out.textContent = `run ${r.run_id}: queued`; }
      };
      card.append(el("div", { class: "run" }, input, start, out));
    }
    document.getElementById("flow-list").append(card);
  }
  const badge = card.querySelector(".badge");
  badge.textContent = f.paused ? "paused" : "running";
  badge.classList.toggle("paused", f.paused);
  card.dataset.state = f.paused ? "paused" : "running";
  card.querySelector('[data-action="pause"]').disabled = f.paused;
  card.querySelector('[data-action="resume"]').disabled = !f.paused;
  card.querySelector('[data-action="step"]').disabled = !f.paused;
  return card;
}

async function refreshFlow(f) {
  const card = flowCard(f);
  const n = f.parked || 0;
  card.querySelector(".parked").textContent = n ? `${n} parked` : "";
  if (card.open) {
    const svg = await api("GET", `/api/flows/${encodeURIComponent(f.id)}/graph.svg`);
    const box = card.querySelector(".graph-box");
    if (box.dataset.svg !== svg) { box.innerHTML = svg; box.dataset.svg = svg; }
  }
  const run = runs[f.id];
  if (run) {
    const r = await api("GET", `/api/runs/${run}`);
    card.querySelector(".run-status").textContent =
      `run ${run}: ${r.status}` + (r.error ? `\n${r.error}` : "") +
      (r.outputs && r.outputs.length ? `\noutputs: ${JSON.stringify(r.outputs, null, 1)}` : "");
    if (r.status === "done" || r.status === "failed") delete runs[f.id];
  }
}

function itemRow(v) {
  const it = v.item;
  let state = v.state;
  let reason = "";
  if (v.state === "in_flight") state = `in flight at ${v.consumer}`;
  if (v.state === "delayed") state = `due in ${Math.max(0, Math.round((v.due - Date.now()) / 1000))} s`;
  if (v.state === "dead") reason = v.reason;
  if (v.state === "finished") reason = v.outcome;
  const actions = el("td", { class: "actions" });
  const id = encodeURIComponent(it.id);
  if (["waiting", "delayed", "parked"].includes(v.state)) {
    const b = el("button", { "data-action": "cancel" }, "Cancel");
    b.onclick = () => act("DELETE", `/api/queue/${id}`);
    actions.append(b);
  }
  if (v.state === "dead") {
    const r = el("button", { "data-action": "replay" }, "Replay");
    r.onclick = () => act("POST", `/api/dead-letters/${id}/replay`);
    const d = el("button", { "data-action": "discard" }, "Discard");
    d.onclick = () => act("DELETE", `/api/dead-letters/${id}`);
    actions.append(r, " ", d);
  }
  return el("tr", { "data-id": it.id, "data-state": v.state },
    el("td", { class: "id", title: it.cause || "" }, it.id),
    el("td", {}, it.flow),
    el("td", {}, it.node),
    el("td", {}, age(it.first_enqueued_at || it.enqueued_at)),
    el("td", {}, String(it.deliveries)),
    el("td", { class: reason ? "reason" : "" }, reason || state),
    actions);
}

async function refreshItems() {
  let rows;
  if (tab === "dead") rows = await api("GET", "/api/dead-letters?limit=100");
  else if (tab === "ended") rows = (await api("GET", "/api/outcomes?limit=500"))
    .filter((v) => /by hand/.test(v.outcome || "")).reverse().slice(0, 100);
  else rows = await api("GET", `/api/queue?state=${tab}&limit=100`);
  const body = document.querySelector("#items tbody");
  // A row already shown for the same item in the same state is kept, its text brought up
  // to date: a button being clicked as the table refreshes stays the button clicked.
  const shown = body.dataset.tab === tab
    ? new Map([...body.querySelectorAll("tr[data-id]")].map((tr) => [tr.dataset.id, tr]))
    : new Map();
  body.dataset.tab = tab;
  const keep = (fresh) => {
    const tr = shown.get(fresh.dataset.id);
    if (!tr || tr.dataset.state !== fresh.dataset.state) return fresh;
    [...fresh.cells].slice(0, -1).forEach((td, i) => {
      const old = tr.cells[i];
      if (old.textContent !== td.textContent) old.textContent = td.textContent;
      old.className = td.className;
      old.title = td.title;
    });
    return tr;
  };
  body.replaceChildren(...(rows.length ? rows.map((v) => keep(itemRow(v)))
    : [el("tr", {}, el("td", { class: "empty", colSpan: 7 }, "nothing here"))]));
}

let busy = false;
let again = false; // asked for while one was running (a button pressed): one more after it
async function refresh() {
  if (busy) { again = true; return; }
  busy = true;
  try {
    const [stats, flows] = await Promise.all([api("GET", "/api/stats"), api("GET", "/api/flows")]);
    for (const li of document.querySelectorAll("#counts li")) {
      const n = stats[li.dataset.state] ?? 0;
      li.querySelector("b").textContent = n;
      li.classList.toggle("some", n > 0);
    }
    await Promise.all(flows.map((f) => refreshFlow(f)));
    await refreshItems();
    document.getElementById("live").classList.remove("stale");
    document.body.dataset.ready = "1";
  } catch (e) {
    document.getElementById("live").classList.add("stale");
    showError(e);
  } finally {
    busy = false;
    if (again) { again = false; refresh(); }
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("logout").hidden = CSRF === "";
  for (const b of document.querySelectorAll("#tabs button")) {
    b.onclick = () => {
      tab = b.dataset.tab;
      for (const o of document.querySelectorAll("#tabs button")) o.classList.toggle("on", o === b);
      refreshItems().catch(showError);
    };
  }
  refresh();
  setInterval(refresh, EVERY_MS);
});
