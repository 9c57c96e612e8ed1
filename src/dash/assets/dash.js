// The AgentJet-RS dashboard: renders /api/live, then follows /api/events (server-sent
// events: "live" every second, "points" with each run's new lines). No library, nothing
// loaded from another site. Every text that came from the swarm is escaped.
"use strict";

const TRAIN_CURVES = [
  ["reward_mean", "reward"], ["accuracy", "held-out accuracy"], ["loss", "loss"],
  ["kl", "KL"], ["entropy", "entropy"], ["clip_frac", "clip fraction"],
  ["tokens_per_s", "tokens/s"], ["grad_norm", "grad norm"],
];
const MAX_POINTS = 5000;
const runs = {}; // name -> {kind, points: []}
let liveState = null;

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, c => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;",
  }[c]));
}
function num(v, digits) {
  return (typeof v === "number" && isFinite(v)) ? v.toFixed(digits) : "–";
}
function short(peer) { return peer.length > 14 ? "…" + peer.slice(-10) : peer; }
function $(id) { return document.getElementById(id); }

// What the peer's certificate of the trusted run grants (see swarm::trust), or why it has none.
function certified(p) {
  const c = p.certified;
  if (c) {
    const what = [c.serve ? "serve" : "", c.train ? `train in ${esc(c.group)}` : ""].filter(x => x).join(", ");
    return `<span class="cert yes" title="until ${esc(new Date(1000 * c.until_unix).toISOString())}">yes: ${esc(c.model)} (${what})</span>`;
  }
  if (p.cert_problem) return `<span class="cert no" title="${esc(p.cert_problem)}">no</span>`;
  return '<span class="muted">– (no run)</span>';
}

// Whether other hosts can dial the peer (public, relayed, unreachable, local, unknown), and
// whether it relays for peers behind NAT.
function reach(p) {
  const x = p.extra || {};
  return `${esc(x.reach || "–")}${x.relay === "1" ? ' <span class="muted">+ relay</span>' : ""}`;
}

function renderSwarm(st) {
  const rows = st.view.map(p => {
    const models = (p.models || []).map(m =>
      `${esc(m.name)} <span class="muted">v${esc(m.policy_version)} · step ${esc(m.train_step)}</span>`
    ).join("<br>");
    const cache = (p.models || []).map(m => m.cache
      ? `${num(100 * m.cache.hit_rate, 0)}% hit · ${num(m.cache.bytes / 1e6, 1)} MB` : "").join("<br>");
    return `<tr data-peer="${esc(p.peer)}" class="${p.self ? "self" : ""}">
      <td><code title="${esc(p.peer)}">${esc(short(p.peer))}</code>${p.self ? " (this peer)" : ""}</td>
      <td>${esc(p.role)}</td><td>${reach(p)}</td><td>${models || '<span class="muted">–</span>'}</td>
      <td>${p.role === "server" ? num(100 * p.load, 0) + "%" : "–"}</td>
      <td>${p.role === "server" ? esc(p.queue_depth) : "–"}</td><td>${cache || "–"}</td>
      <td>${esc(p.episodes)}</td><td>${num(p.age_s, 1)} s ago</td><td>${certified(p)}</td></tr>`;
  });
  $("swarm").tBodies[0].innerHTML = rows.join("");
  const links = st.links || {};
  $("swarm-count").textContent = `${st.view.length} peers · trusts ${st.trust || "?"} · this peer: ${st.reach || "?"}` +
    ` (connections: ${links.direct || 0} direct, ${links.hole_punched || 0} hole-punched, ${links.relayed || 0} relayed)`;
}

function renderGroups(st) {
  const groups = {};
  for (const p of st.view) {
    for (const m of p.models || []) {
      if (!m.group) continue;
      const g = m.group;
      const key = `${g.name}/${g.epoch}/${g.mode}`;
      const row = groups[key] || (groups[key] = { g, model: m.name, peers: [] });
      row.peers.push(p.peer);
    }
  }
  const rows = Object.values(groups).map(({ g, model, peers }) => `<tr>
    <td>${esc(g.name)}</td><td>${esc(model)}</td><td>${esc(g.mode)}</td>
    <td>${g.epoch === 0 ? "forming" : esc(g.epoch)}</td><td>${esc(g.members)}</td>
    <td><code>${esc(g.param_hash)}</code></td>
    <td>${g.allreduce_ms > 0 ? num(g.allreduce_ms, 0) + " ms · " + num(g.allreduce_gbps, 2) + " GB/s" : "–"}</td>
    <td>${peers.map(p => `<code>${esc(short(p))}</code>`).join(" ")}</td></tr>`);
  $("groups").tBodies[0].innerHTML = rows.join("") ||
    '<tr><td colspan="8" class="muted">no training group in the view</td></tr>';
}

// Episode counts seen per client peer: [time ms, episodes], for the rate per minute.
const seenEpisodes = {};

function renderClients(st) {
  const now = Date.now();
  const rows = st.view.filter(p => p.role === "client").map(p => {
    const hist = seenEpisodes[p.peer] || (seenEpisodes[p.peer] = []);
    hist.push([now, p.episodes]);
    while (hist.length > 2 && now - hist[1][0] >= 60000) hist.shift();
    const [t0, e0] = hist[0];
    const rate = now - t0 >= 5000 ? 60000 * (p.episodes - e0) / (now - t0) : NaN;
    const extra = p.extra || {};
    const pick = prefix => Object.entries(extra).filter(([k]) => k.startsWith(prefix))
      .map(([k, v]) => `${esc(k.slice(prefix.length))}: ${esc(v)}`).join("<br>");
    return `<tr data-client="${esc(p.peer)}"><td><code title="${esc(p.peer)}">${esc(short(p.peer))}</code>${p.self ? " (this peer)" : ""}</td>
      <td>${esc(p.episodes)}</td><td>${num(rate, 1)}</td><td>${esc(extra.aborted ?? "–")}</td>
      <td>${pick("reward/") || "–"}</td><td>${pick("source/") || "–"}</td></tr>`;
  });
  $("clients").tBodies[0].innerHTML = rows.join("") ||
    '<tr><td colspan="6" class="muted">no client in the view</td></tr>';
}

function sourceStats(points) {
  const by = {};
  for (const e of points) {
    const s = by[e.source ?? "tasks"] || (by[e.source ?? "tasks"] = { n: 0, aborted: 0, rewards: [] });
    s.n += 1;
    if (e.status === "aborted") s.aborted += 1;
    else if (typeof e.reward === "number") s.rewards.push(e.reward);
  }
  return by;
}

function renderClient(st) {
  const live = st.live || {};
  if (live.kind !== "client") return;
  $("client-section").hidden = false;
  $("episodes-section").hidden = false;
  $("client-run-id").textContent = live.run ? `(${live.run})` : "";
  const run = live.run_name ? runs[live.run_name] : null;
  const points = run ? run.points : [];
  const now = Date.now();
  const lastMinute = points.filter(e => now - (e.ended_unix_ms || 0) <= 60000).length;
  const aborted = points.filter(e => e.status === "aborted").length;
  $("client-figures").innerHTML = [
    ["episodes done", points.length], ["running", (live.running || []).length],
    ["aborted", aborted], ["episodes in the last minute", lastMinute],
    ["calls", live.calls ?? "–"],
  ].map(([k, v]) => `<div>${esc(k)}<b>${esc(v)}</b></div>`).join("");
  const by = sourceStats(points);
  $("sources").tBodies[0].innerHTML = Object.entries(by).map(([name, s]) => {
    const mean = a => a.length ? a.reduce((x, y) => x + y, 0) / a.length : NaN;
    return `<tr><td>${esc(name)}</td><td>${s.n}</td><td>${s.aborted}</td>
      <td>${num(mean(s.rewards), 3)}</td><td>${num(mean(s.rewards.slice(-32)), 3)}</td></tr>`;
  }).join("") || '<tr><td colspan="5" class="muted">no episode has ended yet</td></tr>';
  const running = (live.running || []).map(e => `<tr><td><code>${esc(e.id)}</code></td>
    <td>${esc(e.task)}</td><td>${esc(e.source)}</td><td>running</td><td>–</td>
    <td>${esc(e.calls)}</td><td>–</td><td>${num((now - e.started_unix_ms) / 1000, 0)}</td><td></td></tr>`);
  const recent = points.slice(-40).reverse().map(e => {
    const tl = Object.values(e.timeline || {}).reduce(
      (a, t) => ({ c: a.c + (t.continued || 0), b: a.b + (t.breaks || 0) }), { c: 0, b: 0 });
    const logs = (e.logs || []).map(f =>
      `<a href="/api/runs/${encodeURIComponent(live.run_name)}/logs/${encodeURIComponent(f)}">${esc(f.split(".").slice(1).join("."))}</a>`
    ).join(" ");
    const reward = typeof e.reward === "number" ? num(e.reward, 3)
      : Object.entries(e.rewards || {}).map(([m, r]) => `${esc(m)} ${num(r, 3)}`).join(", ") || "–";
    return `<tr><td><code>${esc(e.episode)}</code></td><td>${esc(e.task)}</td><td>${esc(e.source)}</td>
      <td class="${e.status === "finished" ? "ok" : "bad"}" title="${esc(e.reason)}">${esc(e.status)}</td>
      <td>${reward}</td><td>${esc(e.calls)}</td>
      <td>${tl.c} continued · ${tl.b} breaks</td><td>${num(e.seconds, 1)}</td><td>${logs}</td></tr>`;
  });
  $("episodes").tBodies[0].innerHTML = running.concat(recent).join("");
}

// One chart as inline SVG: x against y, its point count in data-points.
function chart(run, metric, title, pts) {
  const w = 300, h = 150, pad = 30;
  const fin = pts.filter(([x, y]) => isFinite(x) && isFinite(y));
  let [xmin, xmax, ymin, ymax] = [Infinity, -Infinity, Infinity, -Infinity];
  for (const [x, y] of fin) {
    xmin = Math.min(xmin, x); xmax = Math.max(xmax, x);
    ymin = Math.min(ymin, y); ymax = Math.max(ymax, y);
  }
  if (!fin.length) { xmin = 0; xmax = 1; ymin = 0; ymax = 1; }
  if (xmax === xmin) { xmax = xmin + 1; }
  if (ymax === ymin) { ymax = ymin + Math.max(1e-6, Math.abs(ymin) * 0.1); ymin -= 0; }
  const px = x => pad + (w - pad - 8) * (x - xmin) / (xmax - xmin);
  const py = y => h - 18 - (h - 18 - 22) * (y - ymin) / (ymax - ymin);
  const line = fin.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" ");
  const dot = fin.length === 1 ? `<circle cx="${px(fin[0][0])}" cy="${py(fin[0][1])}" r="3" fill="#3d7bd9"/>` : "";
  const last = fin.length ? fin[fin.length - 1][1] : NaN;
  return `<svg class="chart" width="${w}" height="${h}" data-run="${esc(run)}" data-metric="${esc(metric)}" data-points="${fin.length}">
    <text x="${pad}" y="14">${esc(title)}: ${num(last, 4)}</text>
    <text x="2" y="${py(ymax) + 4}">${num(ymax, 2)}</text><text x="2" y="${py(ymin)}">${num(ymin, 2)}</text>
    <text x="${w - 8}" y="${h - 4}" text-anchor="end">${num(xmax, 0)}</text>
    <line x1="${pad}" y1="${h - 18}" x2="${w - 8}" y2="${h - 18}" stroke="#ccc"/>
    <polyline points="${line}"/>${dot}</svg>`;
}

function rolling(values, window) {
  return values.map((_, i) => {
    const w = values.slice(Math.max(0, i + 1 - window), i + 1);
    return w.reduce((a, b) => a + b, 0) / w.length;
  });
}

function renderCurves() {
  const names = Object.keys(runs).sort();
  if (!names.length) return;
  $("curves").innerHTML = names.map(name => {
    const r = runs[name];
    let charts;
    if (r.kind === "train") {
      charts = TRAIN_CURVES.map(([field, title]) => chart(name, field, title,
        r.points.filter(p => typeof p[field] === "number").map(p => [p.step, p[field]])))
        .join("");
    } else {
      const done = r.points.filter(e => e.status === "finished" && typeof e.reward === "number");
      const avg = rolling(done.map(e => e.reward), 16);
      const t0 = r.points.length ? r.points[0].ended_unix_ms || 0 : 0;
      charts = chart(name, "reward", "episode reward (mean of 16)", avg.map((v, i) => [i + 1, v])) +
        chart(name, "episodes", "episodes over minutes", r.points.map((e, i) =>
          [((e.ended_unix_ms || t0) - t0) / 60000, i + 1])) +
        chart(name, "calls", "calls per episode", r.points.map((e, i) => [i + 1, e.calls]));
    }
    return `<div class="run"><h3>${esc(name)} <span class="muted">${esc(r.kind)} run, ${r.points.length} points</span></h3>
      <div class="charts">${charts}</div></div>`;
  }).join("");
}

function renderLive(st) {
  liveState = st;
  $("role").textContent = st.role;
  $("peer").innerHTML = `peer <code>${esc(st.peer)}</code>`;
  for (const r of st.runs || []) {
    if (!runs[r.name]) runs[r.name] = { kind: r.kind, points: [] };
  }
  renderSwarm(st);
  renderGroups(st);
  renderClients(st);
  renderClient(st);
}

function addPoints(batch) {
  for (const [name, b] of Object.entries(batch)) {
    const r = runs[name] || (runs[name] = { kind: b.kind, points: [] });
    if (b.reset) r.points = [];
    r.points = r.points.concat(b.points).slice(-MAX_POINTS);
  }
  renderCurves();
  if (liveState) renderClient(liveState);
}

function follow() {
  const es = new EventSource("/api/events");
  es.addEventListener("live", ev => { renderLive(JSON.parse(ev.data)); $("conn").textContent = "live"; });
  es.addEventListener("points", ev => addPoints(JSON.parse(ev.data)));
  es.onerror = () => { $("conn").textContent = "disconnected; retrying…"; };
}

// The first render from /boot.js (loaded before this script), then the event stream once
// the page has loaded.
function start() {
  const boot = window.AGENTJET_BOOT;
  if (boot) {
    renderLive(boot.live);
    addPoints(boot.points || {});
  } else {
    $("conn").textContent = "no first state (boot.js); waiting for the event stream";
  }
  if (document.readyState === "complete") follow();
  else window.addEventListener("load", follow);
}

start();
