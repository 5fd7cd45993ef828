// The jaxtrain dashboard's page: polls the JSON API every second and draws what it gets.
// Plain JavaScript, no build step, no outside resources. Text from the runs is only ever set
// as textContent, never parsed as HTML.
"use strict";

const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
// Metrics whose curves are not drawn: they say where the run is, not how it learns.
const NOT_CURVES = new Set(["step", "total_steps"]);

// The run page's state: its name, the rounds already drawn, the chosen log rank.
const view = { run: null, since: 0, series: {}, logRank: null, attempts: [] };

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function status(text) {
  const word = String(text || "?").split(" ")[0];
  return el("span", { class: "status " + word }, text || "?");
}

function when(t) { return t ? new Date(t * 1000).toLocaleString() : "-"; }

function seconds(s) {
  if (s === null || s === undefined) return "-";
  if (s < 60) return s.toFixed(1) + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(Math.floor(s % 60)).padStart(2, "0") + "s";
  if (s < 86400) return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
  return Math.floor(s / 86400) + "d" + String(Math.floor(s % 86400 / 3600)).padStart(2, "0") + "h";
}

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function num(v) {
  if (typeof v !== "number") return String(v);
  return Math.abs(v) >= 1e5 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(3)
    : String(Math.round(v * 1e4) / 1e4);
}

// A straggler period (the API's attempt "stragglers", rank "straggler"), in words.
function stragglerText(p) {
  const step = (s) => typeof s !== "number" ? "-" : s < 1 ? num(1000 * s) + " ms" : seconds(s);
  return "rank " + p.rank + " straggler: step time " + step(p.step_time_s) +
    ", the other ranks' median " + step(p.median_step_time_s) + ", from " + when(p.start_time) +
    (p.end_time ? " to " + when(p.end_time) : "");
}

function progressCell(p) {
  if (!p || p.fraction === null) {
    return el("span", {}, p && p.step !== null ? "step " + p.step : "round " + (p ? p.round : 0));
  }
  const bar = el("span", { class: "bar" }, el("span", { style: "width:" + (100 * p.fraction) + "%" }));
  return el("span", {}, bar, p.done + " / " + p.total + " (" + Math.round(100 * p.fraction) + "%)");
}

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store", credentials: "same-origin" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

// --- the list of runs -----------------------------------------------------------------------

function drawRuns(data) {
  $("source").textContent = data.source;
  const body = $("runs").tBodies[0];
  body.replaceChildren(...data.runs.map((r) => {
    const link = el("a", { href: "#/run/" + encodeURIComponent(r.name) }, r.name);
    const end = r.status === "RUNNING" ? data.now : r.end_time;
    return el("tr", { "data-run": r.name, "data-status": r.status },
      el("td", {}, link), el("td", {}, status(r.status)), el("td", {}, progressCell(r.progress)),
      el("td", {}, seconds(r.progress.eta_s)), el("td", {}, r.attempts),
      el("td", {}, r.world_size ?? "?"), el("td", {}, r.rounds), el("td", {}, when(r.start_time)),
      el("td", {}, r.start_time && end ? seconds(end - r.start_time) : "-"));
  }));
  $("no-runs").hidden = data.runs.length > 0;
}

// --- one run --------------------------------------------------------------------------------

function card(label, value) {
  return el("div", { class: "card" }, el("div", { class: "label" }, label),
    el("div", { class: "value" }, value));
}

function drawSummary(run) {
  $("run-name").textContent = run.name;
  $("run-status").replaceChildren(status(run.status));
  $("run-status").setAttribute("data-status", run.status);
  const end = run.status === "RUNNING" ? run.now : run.end_time;
  const cards = [
    card("progress", progressCell(run.progress)),
    card("ETA", seconds(run.progress.eta_s)),
    card("rounds", run.rounds),
    card("attempts", run.attempts),
    card("workers", (run.world_size ?? "?") + " (" + (run.platform || "?") + ")"),
    card("started", when(run.start_time)),
    card("duration", run.start_time && end ? seconds(end - run.start_time) : "-"),
  ];
  if (run.driver) cards.push(card("driver", run.driver));
  if (run.error) cards.push(card("error", run.error));
  $("run-summary").replaceChildren(...cards);
}

function drawAttempts(run) {
  const attempts = run.attempt_list;
  view.attempts = attempts;
  const width = 1000, row = 22, height = 24 + row * attempts.length;
  const t0 = Math.min(...attempts.map((a) => a.start_time || run.now), run.start_time || run.now);
  const live = run.status === "RUNNING";
  const t1 = Math.max(live ? run.now : run.end_time || 0, ...attempts.map((a) => a.end_time || run.now));
  const x = (t) => 110 + (width - 120) * (t - t0) / Math.max(t1 - t0, 1e-9);
  const chart = svg("svg", { viewBox: "0 0 " + width + " " + height, role: "img" });
  attempts.forEach((a, i) => {
    const y = 6 + i * row;
    const end = a.end_time || run.now;
    const g = svg("g", { class: "attempt", "data-attempt": a.attempt, "data-status": a.status });
    const label = svg("text", { x: 4, y: y + 14 });
    label.textContent = "attempt " + a.attempt;
    const colour = { RUNNING: "#1565c0", FINISHED: "#1a7f37", ABORTED: "#b26a00" }[a.status] || "#c62828";
    const bar = svg("rect", { x: x(a.start_time), y: y, height: row - 6, rx: 3, fill: colour,
      width: Math.max(2, x(end) - x(a.start_time)) });
    const title = svg("title", {});
    title.textContent = a.status + (a.failure ? ": rank " + a.failure.rank + " " +
      a.failure.cause + ": " + a.failure.message : "");
    bar.append(title);
    g.append(label, bar);
    // Each straggler period: a thin amber band under the attempt's bar.
    for (const p of a.stragglers || []) {
      const band = svg("rect", { class: "straggler", "data-rank": p.rank, x: x(p.start_time),
        y: y + row - 8, height: 3, width: Math.max(2, x(p.end_time || end) - x(p.start_time)) });
      const tip = svg("title", {});
      tip.textContent = stragglerText(p);
      band.append(tip);
      g.append(band);
    }
    if (a.failure) {
      const cause = svg("text", { x: Math.min(x(end) + 4, width - 200), y: y + 14 });
      cause.textContent = "rank " + a.failure.rank + ": " + a.failure.cause;
      g.append(cause);
    }
    chart.append(g);
  });
  const axis = svg("text", { x: 110, y: height - 4 });
  axis.textContent = when(t0) + "  \u2192  " + when(t1);
  chart.append(axis);
  $("timeline").replaceChildren(chart);

  $("attempts").replaceChildren(...attempts.map((a) => {
    const item = el("li", { "data-attempt": a.attempt, "data-status": a.status },
      status(a.queued ? "queued" : a.status), " ", when(a.start_time), ", ",
      seconds((a.end_time || run.now) - a.start_time) + (a.end_time ? "" : "+"));
    if (a.queue_wait_s > 0) item.append(", queued " + seconds(a.queue_wait_s));
    if (a.restored_from) item.append(", restored from " + a.restored_from);
    if (a.failure) {
      const f = a.failure;
      item.append(" \u2014 ", el("span", { class: "cause", "data-cause": f.cause },
        "rank " + f.rank + (f.host ? " (host " + f.host + ")" : "") + " " + f.cause),
      ": " + f.message);
      if (f.decision) item.append(" [" + f.decision.action + ": " + f.decision.reason + "]");
      if (f.stacks) {
        item.append(" [every rank's stacks: ", el("code", { class: "stacks" }, f.stacks + "/"), "]");
      }
    }
    for (const p of a.stragglers || []) {
      item.append(" \u2014 ", el("span", { class: "straggler", "data-rank": p.rank }, stragglerText(p)));
    }
    return item;
  }));
}

function addRounds(rounds) {
  for (const r of rounds) {
    for (const [name, value] of Object.entries(r.metrics)) {
      if (NOT_CURVES.has(name)) continue;
      (view.series[name] = view.series[name] || []).push([r.round, value, r.time]);
    }
    view.since = Math.max(view.since, r.round);
  }
}

function drawCharts() {
  const names = Object.keys(view.series).sort((a, b) =>
    (b === "loss") - (a === "loss") || a.localeCompare(b));
  const box = $("charts");
  for (const name of names) {
    let chart = box.querySelector('[data-metric="' + CSS.escape(name) + '"]');
    if (!chart) {
      chart = el("div", { class: "chart", "data-metric": name }, el("h3", {}, name));
      box.append(chart);
    }
    chart.setAttribute("data-points", view.series[name].length);
    const old = chart.querySelector("svg");
    const fresh = curve(view.series[name]);
    if (old) old.replaceWith(fresh); else chart.append(fresh);
  }
  if (!names.length && !box.firstChild) box.append(el("p", { class: "muted" }, "No metrics reported yet."));
  else if (names.length) for (const p of box.querySelectorAll("p")) p.remove();
}

// One metric's curve against the round, with the restarts' first rounds dashed.
function curve(points) {
  const W = 400, H = 180, L = 48, B = 18;
  const drawn = points.length > 2 * W ? points.filter((_, i) => i % Math.ceil(points.length / (2 * W)) === 0
    || i === points.length - 1) : points;
  const xs = drawn.map((p) => p[0]), ys = drawn.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const x = (v) => L + (W - L - 6) * (x1 > x0 ? (v - x0) / (x1 - x0) : 0.5);
  const y = (v) => 6 + (H - B - 12) * (y1 > y0 ? (y1 - v) / (y1 - y0) : 0.5);
  const chart = svg("svg", { viewBox: "0 0 " + W + " " + H, preserveAspectRatio: "none" });
  chart.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W, y2: H - B }),
    svg("line", { class: "axis", x1: L, y1: 0, x2: L, y2: H - B }));
  for (const [v, yy] of [[y1, 12], [y0, H - B]]) {
    const t = svg("text", { x: 2, y: yy }); t.textContent = num(v); chart.append(t);
  }
  for (const [v, xx, anchor] of [[x0, L, "start"], [x1, W - 2, "end"]]) {
    const t = svg("text", { x: xx, y: H - 4, "text-anchor": anchor });
    t.textContent = "round " + v; chart.append(t);
  }
  for (const a of view.attempts.slice(1)) {
    const first = points.find((p) => p[2] >= a.start_time);
    if (first) chart.append(svg("line", { class: "restart", x1: x(first[0]), x2: x(first[0]), y1: 0, y2: H - B }));
  }
  chart.append(svg("polyline", { points: drawn.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ") }));
  return chart;
}

function drawGoodput(goodput) {
  // GOODPUT: jaxtrain.goodput's parts, drawn generically: numbers in seconds, one bar.
  $("goodput-section").hidden = !goodput;
  if (!goodput) return;
  if (goodput.error) { $("goodput").replaceChildren(el("p", { class: "error" }, goodput.error)); return; }
  const parts = Object.entries(goodput.parts || goodput).filter(([k, v]) =>
    typeof v === "number" && !/fraction|goodput$/.test(k));
  const total = parts.reduce((s, [, v]) => s + v, 0) || 1;
  const colours = ["#1a7f37", "#1565c0", "#b26a00", "#c62828", "#6a1b9a", "#00838f", "#6b7280", "#ad1457"];
  const bar = el("div", { class: "goodput-bar" }, ...parts.map(([k, v], i) =>
    el("span", { title: k + ": " + seconds(v), style: "width:" + (100 * v / total) + "%;background:" + colours[i % colours.length] })));
  const rows = parts.map(([k, v], i) => el("tr", {}, el("td", { style: "color:" + colours[i % colours.length] }, "\u25A0 " + k),
    el("td", {}, seconds(v)), el("td", {}, Math.round(100 * v / total) + "%")));
  const fraction = goodput.fraction ?? goodput.goodput;
  $("goodput").replaceChildren(
    el("p", {}, "goodput: " + (typeof fraction === "number" ? Math.round(1000 * fraction) / 10 + "%" : "-")),
    bar, el("table", {}, el("tbody", {}, ...rows)));
}

function drawRanks(ranks) {
  $("ranks").tBodies[0].replaceChildren(...ranks.map((r) => el("tr", { "data-rank": r.rank },
    el("td", {}, r.rank), el("td", {}, r.host || "-"),
    el("td", {}, status(r.state), ...(r.straggler ? [" ", el("span",
      { class: "straggler", "data-rank": r.rank, title: stragglerText(r.straggler) }, "straggler")] : [])),
    el("td", {}, r.last_report_age_s === null ? "-" : seconds(r.last_report_age_s) + " ago"),
    el("td", {}, r.last_output_age_s === null ? "-" : seconds(r.last_output_age_s) + " ago"),
    el("td", {}, r.step_time_s === null ? "-" : seconds(r.step_time_s)))));
  const select = $("log-rank");
  if (select.options.length !== ranks.length) {
    select.replaceChildren(...ranks.map((r) => el("option", { value: r.rank }, "rank " + r.rank)));
    if (view.logRank !== null) select.value = view.logRank;
  }
}

function drawCheckpoints(list) {
  $("checkpoints").tBodies[0].replaceChildren(...list.slice().reverse().map((c) =>
    el("tr", { class: c.best ? "best" : null, "data-checkpoint": c.dir_name },
      el("td", {}, c.dir_name), el("td", {}, c.round ?? "-"), el("td", {}, when(c.time)),
      el("td", {}, bytes(c.bytes)),
      el("td", {}, c.score_attribute ? c.score_attribute + " = " + (c.score === null ? "-" : num(c.score)) : "-"),
      el("td", {}, c.latest ? "latest" : ""))));
  $("no-checkpoints").hidden = list.length > 0;
}

async function drawLog(run) {
  const rank = $("log-rank").value || "0";
  view.logRank = rank;
  const log = $("log");
  const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  try {
    const data = await getJSON("/api/runs/" + encodeURIComponent(run) + "/logs/" + rank);
    log.textContent = data.text ?? "(rank " + rank + " has printed nothing yet)";
  } catch (e) {
    log.textContent = e.message;
  }
  if (atBottom) log.scrollTop = log.scrollHeight;
}

// --- polling --------------------------------------------------------------------------------

function route() {
  const m = location.hash.match(/^#\/run\/(.+)$/);
  const run = m ? decodeURIComponent(m[1]) : null;
  if (run !== view.run) {
    Object.assign(view, { run: run, since: 0, series: {}, logRank: null, attempts: [] });
    $("charts").replaceChildren();
    $("log-rank").replaceChildren();
    $("log").textContent = "";
  }
  $("runs-view").hidden = run !== null;
  $("run-view").hidden = run === null;
}

async function poll() {
  route();
  try {
    if (view.run === null) {
      drawRuns(await getJSON("/api/runs"));
    } else {
      const run = view.run;
      const data = await getJSON("/api/runs/" + encodeURIComponent(run) + "?since=" + view.since);
      if (run !== view.run) return;
      drawSummary(data);
      drawAttempts(data);
      addRounds(data.metrics);
      drawCharts();
      drawGoodput(data.goodput);
      drawRanks(data.ranks);
      drawCheckpoints(data.checkpoints);
      await drawLog(run);
    }
    $("error").hidden = true;
    $("connection").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    $("error").textContent = e.message;
    $("error").hidden = false;
  }
}

async function loop() {
  await poll();
  setTimeout(loop, POLL_MS);
}

window.addEventListener("hashchange", poll);
$("log-rank").addEventListener("change", () => { if (view.run) drawLog(view.run); });
loop();
