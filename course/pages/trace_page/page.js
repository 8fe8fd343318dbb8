"use strict";
const T = JSON.parse(document.getElementById("trace-data").textContent);
const F = T.frames, BS = T.block_size, LAST = F.length - 1;
const STATE = {".": "free", "e": "cached", "h": "held", "H": "held-cached", "!": "inconsistent"};
const PALETTE = ["#56B4E9", "#E69F00", "#009E73", "#F0E442", "#CC79A7", "#0072B2", "#D55E00", "#9ad0a0",
                 "#c8a2e8", "#f4b183", "#8fb8de", "#e3c26f"];
// Past a palette's worth of requests the colours come back with a pattern over them, so that no
// two requests shown look alike by hue alone (r0 plain, r12 striped, r24 striped the other way...).
const PATTERNS = ["none",
                  "repeating-linear-gradient(45deg, rgba(255,255,255,0.6) 0 3px, transparent 3px 8px)",
                  "repeating-linear-gradient(-45deg, rgba(0,0,0,0.35) 0 2px, transparent 2px 7px)",
                  "radial-gradient(circle, rgba(255,255,255,0.75) 1.5px, transparent 2px)",
                  "repeating-linear-gradient(0deg, rgba(0,0,0,0.3) 0 2px, transparent 2px 6px)",
                  "repeating-linear-gradient(90deg, rgba(255,255,255,0.6) 0 2px, transparent 2px 6px)"];
const IDS = Object.keys(T.requests);
const COLOR = {}, PATTERN = {};
IDS.forEach((id, i) => {
  COLOR[id] = PALETTE[i % PALETTE.length];
  PATTERN[id] = PATTERNS[Math.floor(i / PALETTE.length) % PATTERNS.length];
});
const $ = (id) => document.getElementById(id);
let cur = T.open, sel = null, timer = null;

function esc(s) {
  const entity = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
  return String(s).replace(/[&<>"']/g, (c) => entity[c]);
}
function textColor(hex) {
  const n = parseInt(hex.slice(1), 16), r = n >> 16, g = (n >> 8) & 255, b = n & 255;
  return (0.299 * r + 0.587 * g + 0.114 * b) > 140 ? "#111111" : "#ffffff";
}
function swatch(id) {  // a request's colour and pattern, as an element's style
  const c = COLOR[id] || "#dddddd", p = PATTERN[id] || "none";
  const size = p.startsWith("radial") ? "background-size:6px 6px;" : "";
  return `background-color:${c};background-image:${p};${size}color:${textColor(c)}`;
}
function chip(id, extra) {
  return `<li class="chip${id === sel ? " sel" : ""}" data-request="${esc(id)}" style="${swatch(id)}">` +
         `${esc(id)}${extra || ""}</li>`;
}
function plural(n, word) { return `${n} ${word}${n === 1 ? "" : "s"}`; }

// Each request's outputs up to frame n, and where it stands then: all read from the frames.
function outputsUpTo(n) {
  const out = {};
  for (const id of IDS) out[id] = [];
  for (let k = 0; k <= n; k++) for (const [id, toks] of Object.entries(F[k].sampled)) out[id].push(...toks);
  return out;
}
function statusAt(n) {
  const st = {}, f = F[n];
  for (let k = 0; k <= n; k++) {
    for (const id of F[k].arrived) st[id] = "waiting";
    for (const [id, why] of Object.entries(F[k].finished)) st[id] = "finished (" + why + ")";
  }
  for (const id of f.waiting) st[id] = "waiting";
  for (const id of f.running) st[id] = "running";
  return st;
}
function eventsUpTo(n, id) {
  let preemptions = 0;
  const admissions = [];
  for (let k = 0; k <= n; k++) {
    preemptions += F[k].preempted.filter((p) => p.id === id).length;
    if (id in F[k].admitted) admissions.push(`step ${k}` + (T.engine.enable_prefix_caching ?
      ` (prefix-cache hit: ${F[k].admitted[id]} tokens)` : ""));
  }
  return {preemptions, admissions};
}

function drawHeader() {
  $("look-for").textContent = "What to look for: " + T.look_for;
  const e = T.engine, m = T.model;
  $("config").textContent = `${T.prog}'s LLMEngine: ${e.num_blocks} blocks of ${e.block_size} tokens, ` +
    `max_num_seqs ${e.max_num_seqs}, max_num_batched_tokens ${e.max_num_batched_tokens}, prefix caching ` +
    `${e.enable_prefix_caching ? "on" : "off"}; a toy GPT-2 (${m.n_layer} layers, ${m.n_embd} wide, vocabulary ` +
    `${m.vocab_size}, context ${m.n_positions}); ${IDS.length} requests, ${LAST} steps. ` +
    `A step's frame is the state after it; step 0 is before the first.`;
  $("slider").max = LAST;
}

function drawTimeline() {
  const svg = $("timeline"), w = svg.clientWidth || 1240, h = 46, n = F.length, bw = w / n;
  let body = "";
  F.forEach((f, k) => {
    const used = [...f.state].filter((c) => c === "h" || c === "H").length / f.state.length;
    body += `<rect x="${(k * bw).toFixed(2)}" y="${(h - 4 - used * 34).toFixed(2)}" width="${Math.max(bw - 0.3, 0.6)
      .toFixed(2)}" height="${(used * 34).toFixed(2)}" fill="#9ab8d0"/>`;
    if (f.preempted.length) body += `<rect x="${(k * bw).toFixed(2)}" y="2" width="${Math.max(bw, 2).toFixed(2)}"` +
      ` height="8" fill="#D55E00"/>`;
    if (f.problems.length) body += `<rect x="${(k * bw).toFixed(2)}" y="${h - 4}" width="${Math.max(bw, 2)
      .toFixed(2)}" height="4" fill="#000000"/>`;
  });
  body += `<rect id="cursor" x="0" y="0" width="${Math.max(bw, 2).toFixed(2)}" height="${h}" fill="none" ` +
          `stroke="#000000" stroke-width="1.5"/>`;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.innerHTML = `<title>blocks in use per step (blue), preemptions (red ticks)</title>` + body;
  svg.onclick = (ev) => go(Math.floor(ev.offsetX / bw));
}

function drawPlan(f) {
  $("step-title").textContent = f.step === 0 ? "Before the first step" :
    `Step ${f.step}: ${plural(f.ran.length, "request")} ran, ` +
    `${f.ran.reduce((a, r) => a + r.n, 0)} of ${T.engine.max_num_batched_tokens} batched tokens`;
  let rows = "";
  for (const r of f.ran) {
    const toks = f.sampled[r.id] || [];
    const hit = !(r.id in f.admitted) ? "" : T.engine.enable_prefix_caching ?
      `admitted, prefix-cache hit: ${f.admitted[r.id]} tokens` : "admitted";
    const what = r.kind === "decode" ? "decode" : `${r.kind} ${r.start}..${r.start + r.n - 1}` +
      (r.samples ? "" : " (chunk)");
    rows += `<tr data-scheduled="${esc(r.id)}" data-tokens="${r.n}" data-kind="${r.kind}" data-start="${r.start}"` +
      ` data-sampled="${toks.join(" ")}"><td><ol class="queue" style="margin:0">${chip(r.id)}</ol></td>` +
      `<td><span class="kind ${r.kind}">${esc(what)}</span> <span class="muted">${hit}</span></td>` +
      `<td class="num">${r.n}</td><td class="num mono">${toks.length ? toks.join(" ") : "&ndash;"}</td></tr>`;
  }
  $("plan").innerHTML = f.ran.length ? `<table><thead><tr><th>request</th><th>what ran (positions)</th>` +
    `<th class="num">tokens</th><th class="num">sampled</th></tr></thead><tbody>${rows}</tbody></table>` :
    `<p class="muted">Nothing has run yet.</p>`;
  const ev = [];
  if (f.arrived.length) {
    ev.push(`<li data-event="arrived">arrived before this step: ${f.arrived.map(esc).join(", ")}</li>`);
  }
  for (const p of f.preempted) ev.push(`<li data-preempted="${esc(p.id)}" data-reason="${esc(p.reason)}">` +
    `<b style="color:#D55E00">preempted ${esc(p.id)}</b>: ${esc(p.reason)}</li>`);
  for (const [id, why] of Object.entries(f.finished)) {
    ev.push(`<li data-finished="${esc(id)}">${esc(id)} finished (${esc(why)})</li>`);
  }
  const copies = f.copies.map((c) => `block ${c[0]} &rarr; ${c[1]}`).join(", ");
  ev.push(`<li data-event="copies">copy-on-write: ${copies || "none"}</li>`);
  const pool = Object.entries(f.blocks).filter(([, ids]) => ids.length)
    .map(([kind, ids]) => `${kind.replace("_", " ")} ${ids.join(", ")}`).join("; ");
  ev.push(`<li data-event="blocks">the pool's events: ${pool || "none"}</li>`);
  const c = f.cache;
  if (T.engine.enable_prefix_caching) ev.push(`<li data-event="cache">prefix cache so far: ${c[1]} hits of ${c[0]} ` +
    `lookups, ${plural(c[2], "eviction")}</li>`);
  $("events").innerHTML = `<ul class="events">${ev.join("")}</ul>`;
}

function drawQueues(f) {
  $("waiting").innerHTML = f.waiting.map((id) => chip(id)).join("") || `<li class="muted">empty</li>`;
  $("running").innerHTML = f.running.map((id) => chip(id)).join("") || `<li class="muted">empty</li>`;
  const st = statusAt(cur);
  const done = IDS.filter((id) => (st[id] || "").startsWith("finished"));
  $("finished").innerHTML = done.map((id) => chip(id)).join("") || `<li class="muted">none yet</li>`;
}

function owners(f) {
  const own = {};
  for (const [id, t] of Object.entries(f.tables)) for (const b of t.blocks) (own[b] = own[b] || []).push(id);
  return own;
}

function drawPool(f) {
  const own = owners(f), mine = sel && f.tables[sel] ? new Set(f.tables[sel].blocks) : null;
  const fresh = new Set(Object.values(f.grew).flat());
  let cells = "";
  for (let b = 0; b < f.state.length; b++) {
    const st = STATE[f.state[b]], ref = f.ref[b], who = own[b] || [];
    let style = "", cls = `block ${st}`;
    if ((st === "held" || st === "held-cached") && who.length) {
      style = ` style="${who.length === 1 ? swatch(who[0]) : "background:#bdbdbd;color:#111111"}"`;
    }
    if (fresh.has(b)) cls += " new";
    if (mine) cls += mine.has(b) ? " hl" : " dim";
    const label = who.length === 1 ? esc(who[0]) : "";
    cells += `<div class="${cls}" data-block="${b}" data-state="${st}" data-refcount="${ref}"${style} ` +
      `title="block ${b}: ${st}, reference count ${ref}${who.length ? ", held by " + who.map(esc).join(", ") : ""}">` +
      `<span class="bid">${b}</span><span class="own">${label}</span>` +
      `<span class="ref">${ref > 1 ? "&times;" + ref : ""}</span></div>`;
  }
  $("pool").innerHTML = cells;
  const counts = {free: 0, cached: 0, held: 0};
  for (const ch of f.state) counts[ch === "." ? "free" : ch === "e" ? "cached" : "held"] += 1;
  $("pool-title").textContent = `The block pool: ${f.state.length} blocks of ${BS} tokens; ${counts.held} held, ` +
    `${counts.cached} cached and evictable, ${counts.free} free`;
}

function drawTables(f) {
  const rows = [];
  for (const [id, t] of Object.entries(f.tables)) {
    const grew = new Set(f.grew[id] || []);
    const cells = t.blocks.map((b, j) => `<span class="cell${f.ref[b] > 1 || f.state[b] === "H" ? " shared" : ""}` +
      `${grew.has(b) ? " new" : ""}" title="block_ids[${j}] = ${b}: positions ${j * BS}..${Math.min((j + 1) * BS,
      t.tokens) - 1}">${b}</span>`).join("");
    rows.push(`<div class="row" data-table="${esc(id)}" data-blocks="${t.blocks.join(" ")}" ` +
      `data-tokens="${t.tokens}">` +
      `<ol class="queue" style="margin:0">${chip(id)}</ol>${cells}<span class="muted">${t.tokens} tokens in ` +
      `${plural(t.blocks.length, "block")}</span></div>`);
  }
  $("tables").innerHTML = rows.join("") || `<p class="muted">No table holds a block.</p>`;
}

function drawDetail(f) {
  if (!sel || !(sel in T.requests)) {
    $("detail-title").textContent = "Click a request to follow it";
    $("detail").innerHTML = `<p class="muted">Its blocks light up in the pool, and its block table, positions ` +
      `to blocks and slots, is drawn here.</p>`;
    $("detail-section").removeAttribute("data-request");
    return;
  }
  const req = T.requests[sel], st = statusAt(cur)[sel] || "not arrived yet", out = outputsUpTo(cur)[sel];
  const ev = eventsUpTo(cur, sel), now = f.sampled[sel] || [];
  $("detail-section").setAttribute("data-request", sel);
  $("detail-title").textContent = `${sel}: ${st}`;
  const t = f.tables[sel];
  let rows = "";
  if (t) {
    const slotOf = (pos) => {
      if (t.slots === null) return t.blocks[Math.floor(pos / BS)] * BS + pos % BS;  // what slots() returned
      for (const [p, s, n] of t.slots) if (pos >= p && pos < p + n) return s + pos - p;
      return "?";
    };
    t.blocks.forEach((b, j) => {
      const lo = j * BS, hi = Math.min((j + 1) * BS, t.tokens) - 1;
      rows += `<tr data-row="${j}" data-block="${b}" data-positions="${lo}-${hi}" ` +
        `data-slots="${slotOf(lo)}-${slotOf(hi)}">` +
        `<td class="num">${j}</td><td class="num">${b}</td><td class="num">${lo}..${hi}</td>` +
        `<td class="num">${slotOf(lo)}..${slotOf(hi)}</td><td class="num">${hi - lo + 1} of ${BS}</td>` +
        `<td class="num">${f.ref[b]}</td></tr>`;
    });
  }
  const salt = req.salt ? `, cache_salt ${esc(req.salt)}` : "";
  const outText = out.map((tok, i) => i >= out.length - now.length ? `<span class="tok-new">${tok}</span>` : tok)
    .join(" ");
  $("detail").innerHTML =
    `<p>prompt ${req.prompt.length} tokens, max_tokens ${req.max_tokens}${salt}; ` +
    `admitted: ${ev.admissions.length ? ev.admissions.join(", then ") : "not yet"}; ` +
    `preempted ${ev.preemptions} time${ev.preemptions === 1 ? "" : "s"} so far.</p>` +
    `<p class="tokens mono"><span class="tok-prompt">${req.prompt.join(" ")}</span> | ` +
    `<span data-output="${esc(sel)}">${outText || "<span class='muted'>no output yet</span>"}</span></p>` +
    (t ? `<table class="detail" data-table-detail="${esc(sel)}" data-computed="${t.computed}"><thead><tr>` +
      `<th class="num">j</th><th class="num">block_ids[j]</th><th class="num">positions</th>` +
      `<th class="num">slots</th>` +
      `<th class="num">filled</th><th class="num">ref</th></tr></thead><tbody>${rows}</tbody></table>` +
      `<p class="muted">slot = block &times; ${BS} + offset; ${t.tokens} tokens in the table, ` +
      `${t.computed} computed.</p>` : `<p class="muted">It holds no block now.</p>`);
}

function drawBanners(f) {
  const b = [];
  if (T.error && cur === LAST) {
    b.push(`<div class="banner bad" data-banner="error">The run stopped: ${esc(T.error)}</div>`);
  }
  if (T.truncated && cur === LAST) b.push(`<div class="banner bad" data-banner="truncated">The run had not finished ` +
    `after ${LAST} steps; the trace stops here.</div>`);
  if (f.problems.length) b.push(`<div class="banner bad" data-banner="problems">The pool's invariants are broken ` +
    `at this step:<ul>${f.problems.map((p) => `<li>${esc(p)}</li>`).join("")}</ul></div>`);
  $("banners").innerHTML = b.join("");
}

function render() {
  const f = F[cur];
  $("view").setAttribute("data-step", cur);
  if (sel) $("view").setAttribute("data-selected", sel); else $("view").removeAttribute("data-selected");
  $("slider").value = cur;
  $("step-label").textContent = `step ${cur} of ${LAST}`;
  drawBanners(f); drawPlan(f); drawQueues(f); drawPool(f); drawTables(f); drawDetail(f);
  const cursor = document.getElementById("cursor");
  if (cursor) cursor.setAttribute("x", (cur * (parseFloat($("timeline").getAttribute("viewBox").split(" ")[2]) /
    F.length)).toFixed(2));
  const hash = `#step=${cur}` + (sel ? `&request=${encodeURIComponent(sel)}` : "");
  if (location.hash !== hash) { try { history.replaceState(null, "", hash); } catch (e) { /* file:// may refuse */ } }
}

function go(n) { cur = Math.max(0, Math.min(LAST, n | 0)); render(); }
function play() {
  if (timer) { clearInterval(timer); timer = null; $("play").innerHTML = "&#x25B6;"; return; }
  if (cur === LAST) cur = 0;
  $("play").innerHTML = "&#x275A;&#x275A;";
  timer = setInterval(() => { if (cur >= LAST) play(); else go(cur + 1); }, 450);
}
function fromHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  const n = parseInt(p.get("step"), 10);
  cur = Number.isFinite(n) ? Math.max(0, Math.min(LAST, n)) : cur;
  const r = p.get("request");
  sel = r && r in T.requests ? r : null;
  render();
}

$("first").onclick = () => go(0);
$("back").onclick = () => go(cur - 1);
$("next").onclick = () => go(cur + 1);
$("play").onclick = play;
$("slider").oninput = (e) => go(parseInt(e.target.value, 10));
document.addEventListener("click", (e) => {
  const c = e.target.closest("[data-request]");
  if (c && c.classList.contains("chip")) { sel = sel === c.dataset.request ? null : c.dataset.request; render(); }
});
document.addEventListener("keydown", (e) => {
  if (e.target.tagName === "INPUT" && e.key !== " ") return;
  if (e.key === "ArrowRight") go(cur + 1); else if (e.key === "ArrowLeft") go(cur - 1);
  else if (e.key === "Home") go(0); else if (e.key === "End") go(LAST);
  else if (e.key === " ") { e.preventDefault(); play(); } else return;
});
window.addEventListener("hashchange", fromHash);
drawHeader();
drawTimeline();
fromHash();
