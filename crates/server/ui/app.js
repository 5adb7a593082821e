// Sandman's dashboard: one page, no dependencies. It reads the server's v1 API, `/metrics` and
// the dashboard's own calls under /ui/api/, with the token from this tab's session storage.
// Live updates come from one follower of /v1/events (the page that is shown refreshes, at most
// once a second, when events arrive) and a scrape of /metrics every 5 s for the charts; nothing
// is asked per sandbox. Everything from the server is put in the page as text, never as HTML.
'use strict';

const TOKEN_KEY = 'sandman.token';
const STATES = ['queued', 'creating', 'ready', 'paused', 'releasing', 'gone', 'failed'];
const LIVE_STATES = ['queued', 'creating', 'ready', 'paused', 'releasing'];
const PALETTE = ['#f87171', '#fbbf24', '#a78bfa', '#f472b6', '#fb923c', '#38bdf8', '#4ade80', '#e879f9', '#facc15', '#2dd4bf'];
const PAGE_SIZE = 50;
const METRICS_EVERY_MS = 5000;
const HISTORY = 180; // samples of the metrics kept for the charts: 15 min at 5 s
const REFRESH_MS = 1000; // the shown page refreshes at most this often on events

let token = sessionStorage.getItem(TOKEN_KEY);
let view = null; // { refresh(), stop() } of the page shown
let dirty = false;
let lastRefresh = 0;
const recent = []; // the latest events, newest last
const samples = []; // metrics samples
let follower = null;
let metricsTimer = null;

// ---- DOM helpers: text only ----

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.className = v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

const SVG = 'http://www.w3.org/2000/svg';
function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== undefined && v !== null) el.setAttribute(k, String(v));
  append(el, children);
  return el;
}

const $ = (sel) => document.querySelector(sel);
const main = () => $('#main');

function fmtNum(n, digits = 0) {
  if (n === undefined || n === null || Number.isNaN(n)) return '–';
  return Number(n).toLocaleString('en-US', { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

function fmtDur(ms) {
  if (ms === undefined || ms === null) return '–';
  const neg = ms < 0;
  let sec = Math.abs(ms) / 1000;
  let out;
  if (sec < 1) out = `${Math.round(sec * 1000)} ms`;
  else if (sec < 60) out = `${sec.toFixed(sec < 10 ? 1 : 0)} s`;
  else if (sec < 3600) out = `${Math.floor(sec / 60)} m ${Math.floor(sec % 60)} s`;
  else if (sec < 86400) out = `${Math.floor(sec / 3600)} h ${Math.floor((sec % 3600) / 60)} m`;
  else out = `${Math.floor(sec / 86400)} d ${Math.floor((sec % 86400) / 3600)} h`;
  return neg ? `-${out}` : out;
}

function fmtTime(ms) {
  return ms ? new Date(ms).toLocaleTimeString('en-GB') : '–';
}

function fmtBytes(kib) {
  if (kib === undefined || kib === null) return '–';
  if (!kib) return '–';
  const units = ['KiB', 'MiB', 'GiB', 'TiB'];
  let v = kib;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(v < 10 ? 1 : 0)} ${units[i]}`;
}

function stateBadge(state) {
  return h('span', { class: `state ${state}` }, state);
}

function colorOf(name) {
  let x = 0;
  for (const c of name) x = (x * 31 + c.charCodeAt(0)) >>> 0;
  return PALETTE[x % PALETTE.length];
}

// ---- the server ----

class Unauthorized extends Error {}

async function call(path, opts = {}) {
  const headers = Object.assign({}, opts.headers, { Authorization: `Bearer ${token}` });
  const resp = await fetch(path, Object.assign({}, opts, { headers }));
  const text = await resp.text();
  let body = text;
  try { body = JSON.parse(text); } catch (_) { /* metrics are text */ }
  if (resp.status === 401) {
    signOut('The server refused the token.');
    throw new Unauthorized('unauthorized');
  }
  if (!resp.ok) {
    const e = new Error((body && body.error && body.error.message) || `${resp.status} ${resp.statusText}`);
    e.status = resp.status;
    e.body = body;
    throw e;
  }
  return body;
}

// Prometheus text: name → [{labels, value}].
function parseMetrics(text) {
  const out = {};
  for (const line of text.split('\n')) {
    if (!line || line[0] === '#') continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    if (m[3]) for (const l of m[3].matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    (out[m[1]] = out[m[1]] || []).push({ labels, value: Number(m[4]) });
  }
  return out;
}

function sum(metrics, name, pred) {
  return (metrics[name] || []).filter((x) => !pred || pred(x.labels)).reduce((a, x) => a + x.value, 0);
}

// The q-quantile of a cumulative histogram, by linear interpolation inside the bucket.
function quantile(metrics, name, q) {
  const buckets = (metrics[`${name}_bucket`] || [])
    .map((b) => ({ le: b.labels.le === '+Inf' ? Infinity : Number(b.labels.le), n: b.value }))
    .sort((a, b) => a.le - b.le);
  const total = buckets.length ? buckets[buckets.length - 1].n : 0;
  if (!total) return null;
  const rank = q * total;
  let prevLe = 0;
  let prevN = 0;
  for (const b of buckets) {
    if (b.n >= rank) {
      if (b.le === Infinity) return prevLe;
      return prevLe + (b.le - prevLe) * ((rank - prevN) / Math.max(b.n - prevN, 1));
    }
    prevLe = b.le;
    prevN = b.n;
  }
  return prevLe;
}

async function scrape() {
  let text;
  try { text = await call('/metrics'); } catch (e) { return; }
  const m = parseMetrics(String(text));
  const t = Date.now();
  const sample = {
    t,
    allowed: sum(m, 'sandman_create_rate_allowed_per_second'),
    achieved: sum(m, 'sandman_create_rate_achieved_per_second'),
    depth: sum(m, 'sandman_admission_queue_depth'),
    claims: sum(m, 'sandman_pool_claims_total'),
    admitted: sum(m, 'sandman_creates_admitted_total'),
    created: sum(m, 'sandman_sandboxes_created_total'),
    rejected: sum(m, 'sandman_admission_rejected_total'),
    readyP50: quantile(m, 'sandman_create_to_ready_seconds', 0.5),
    readyP95: quantile(m, 'sandman_create_to_ready_seconds', 0.95),
    waitP95: quantile(m, 'sandman_admission_queue_wait_seconds', 0.95),
    claimP50: quantile(m, 'sandman_pool_claim_seconds', 0.5),
  };
  const prev = samples[samples.length - 1];
  const dt = prev ? (t - prev.t) / 1000 : 0;
  sample.claimRate = prev && dt > 0 ? Math.max(0, (sample.claims - prev.claims) / dt) : 0;
  sample.coldRate = prev && dt > 0 ? Math.max(0, (sample.admitted - prev.admitted) / dt) : 0;
  samples.push(sample);
  if (samples.length > HISTORY) samples.shift();
  if (view && view.onMetrics) view.onMetrics(sample);
}

// One follower of the events stream for the whole page.
async function follow(after) {
  const ctl = new AbortController();
  follower = ctl;
  const badge = $('#live');
  let seq = after;
  while (!ctl.signal.aborted) {
    try {
      const resp = await fetch(`/v1/events?follow=true&after=${seq}`, {
        headers: { Authorization: `Bearer ${token}` },
        signal: ctl.signal,
      });
      if (resp.status === 401) { signOut('The server refused the token.'); return; }
      if (!resp.ok || !resp.body) throw new Error(`events: ${resp.status}`);
      badge.textContent = 'events: live';
      badge.className = 'live';
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let nl;
        while ((nl = buf.indexOf('\n')) >= 0) {
          const line = buf.slice(0, nl);
          buf = buf.slice(nl + 1);
          if (!line.trim()) continue;
          let ev;
          try { ev = JSON.parse(line); } catch (_) { continue; }
          if (ev.event === 'keepalive' || !ev.seq) continue;
          seq = Math.max(seq, ev.seq);
          recent.push(ev);
          if (recent.length > 200) recent.shift();
          dirty = true;
        }
      }
    } catch (e) {
      if (ctl.signal.aborted) return;
    }
    badge.textContent = 'events: reconnecting';
    badge.className = 'live off';
    await new Promise((r) => setTimeout(r, 2000));
  }
}

// Refreshes the shown page when events came, at most once a second.
setInterval(() => {
  if (!dirty || !view || !view.refresh) return;
  if (Date.now() - lastRefresh < REFRESH_MS) return;
  dirty = false;
  lastRefresh = Date.now();
  view.refresh().catch(() => {});
}, 250);

// ---- charts: plain SVG ----

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// Swatches get their colour through the CSSOM: the CSP allows no inline style attribute.
function legend(items) {
  return h('div', { class: 'legend' }, items.map(([name, color]) => {
    const sw = h('i');
    sw.style.background = color;
    return h('span', {}, sw, name);
  }));
}

// Lines over time: series = [{name, color, points: [[t, v]...]}].
function lineChart(series, opts = {}) {
  const W = 640;
  const H = opts.height || 180;
  const L = 44;
  const B = 20;
  const all = series.flatMap((x) => x.points);
  const svg = s('svg', { class: 'chart', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': opts.label || 'chart' });
  if (all.length < 2) {
    svg.append(s('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle' }, 'gathering samples…'));
    return h('div', {}, svg, legend(series.map((x) => [x.name, x.color])));
  }
  const t0 = Math.min(...all.map((p) => p[0]));
  const t1 = Math.max(...all.map((p) => p[0]));
  const ymax = niceMax(Math.max(...all.map((p) => p[1]), opts.minMax || 0));
  const X = (t) => L + ((t - t0) / Math.max(t1 - t0, 1)) * (W - L - 8);
  const Y = (v) => H - B - (v / ymax) * (H - B - 8);
  for (let i = 0; i <= 4; i++) {
    const v = (ymax * i) / 4;
    svg.append(s('line', { class: 'grid', x1: L, x2: W - 8, y1: Y(v), y2: Y(v) }));
    svg.append(s('text', { x: L - 6, y: Y(v) + 4, 'text-anchor': 'end' }, fmtNum(v, v < 10 ? 1 : 0)));
  }
  svg.append(s('text', { x: L, y: H - 4 }, fmtTime(t0)));
  svg.append(s('text', { x: W - 8, y: H - 4, 'text-anchor': 'end' }, fmtTime(t1)));
  for (const x of series) {
    if (!x.points.length) continue;
    const d = x.points.map((p, i) => `${i ? 'L' : 'M'}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join('');
    svg.append(s('path', { d, fill: 'none', stroke: x.color, 'stroke-width': 2, 'stroke-dasharray': x.dash }));
  }
  return h('div', {}, svg, legend(series.map((x) => [x.name, x.color])));
}

// Stacked columns: labels = bucket labels; series = [{name, color, values: [...] }].
function stackedColumns(labels, series, opts = {}) {
  const W = 640;
  const H = opts.height || 180;
  const L = 44;
  const B = 20;
  const n = labels.length;
  const totals = labels.map((_, i) => series.reduce((a, x) => a + (x.values[i] || 0), 0));
  const ymax = niceMax(Math.max(...totals, 1));
  const svg = s('svg', { class: 'chart', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': opts.label || 'chart' });
  const Y = (v) => H - B - (v / ymax) * (H - B - 8);
  for (let i = 0; i <= 4; i++) {
    const v = (ymax * i) / 4;
    svg.append(s('line', { class: 'grid', x1: L, x2: W - 8, y1: Y(v), y2: Y(v) }));
    svg.append(s('text', { x: L - 6, y: Y(v) + 4, 'text-anchor': 'end' }, fmtNum(v, v < 10 ? 1 : 0)));
  }
  const bw = (W - L - 8) / n;
  for (let i = 0; i < n; i++) {
    let acc = 0;
    for (const x of series) {
      const v = x.values[i] || 0;
      if (!v) continue;
      const y0 = Y(acc);
      const y1 = Y(acc + v);
      svg.append(s('rect', { x: L + i * bw + 1, y: y1, width: Math.max(bw - 2, 1), height: Math.max(y0 - y1, 1), fill: x.color },
        s('title', {}, `${labels[i]} ${x.name}: ${v}`)));
      acc += v;
    }
  }
  svg.append(s('text', { x: L, y: H - 4 }, labels[0]));
  svg.append(s('text', { x: W - 8, y: H - 4, 'text-anchor': 'end' }, labels[n - 1]));
  if (!series.length) svg.append(s('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle' }, opts.empty || 'none'));
  return h('div', {}, svg, legend(series.map((x) => [x.name, x.color])));
}

// A horizontal bar split by state.
function stateBar(byState, total, states = LIVE_STATES) {
  const bar = h('div', { class: 'bar', title: states.map((st) => `${st}: ${byState[st] || 0}`).join(', ') });
  for (const st of states) {
    const n = byState[st] || 0;
    if (!n) continue;
    const span = h('span', { class: st });
    span.style.width = `${(100 * n) / Math.max(total, 1)}%`;
    bar.append(span);
  }
  return bar;
}

// ---- pages ----

const pages = {
  overview: overviewPage,
  jobs: jobsPage,
  sandboxes: sandboxesPage,
  sandbox: sandboxPage,
  pools: poolsPage,
  prepare: preparePage,
};

function route() {
  if (view && view.stop) view.stop();
  view = null;
  const hash = location.hash.replace(/^#\/?/, '') || 'overview';
  const [path, query] = hash.split('?');
  const parts = path.split('/').map(decodeURIComponent);
  let name = parts[0];
  let arg = parts[1];
  if (name === 'sandboxes' && arg) name = 'sandbox';
  if (!pages[name]) name = 'overview';
  for (const a of document.querySelectorAll('#nav a')) {
    a.classList.toggle('active', a.dataset.page === (name === 'sandbox' ? 'sandboxes' : name));
  }
  main().replaceChildren(h('p', { class: 'muted' }, 'Loading…'));
  view = pages[name](arg, new URLSearchParams(query || ''));
  view.refresh().catch(showError);
}

function showError(e) {
  if (e instanceof Unauthorized) return;
  main().prepend(h('p', { class: 'error', role: 'alert' }, `error: ${e.message}`));
}

function overviewPage() {
  let summary = null;
  const render = () => {
    if (!summary) return;
    const bs = summary.by_state;
    const live = LIVE_STATES.reduce((a, st) => a + (bs[st] || 0), 0);
    const tiles = h('div', { class: 'tiles' },
      h('div', { class: 'tile' }, h('div', { class: 'n' }, fmtNum(live)), h('div', { class: 'l' }, 'live sandboxes')),
      STATES.map((st) => h('a', { class: `tile ${st}`, href: `#/sandboxes?state=${st}` },
        h('div', { class: 'n', 'data-state': st }, fmtNum(bs[st] || 0)), h('div', { class: 'l' }, st))));
    const last = samples[samples.length - 1] || {};
    const oldest = summary.oldest_queued_ms ? summary.now_ms - summary.oldest_queued_ms : null;

    const jobs = summary.jobs.slice(0, 15);
    const maxJob = Math.max(1, ...jobs.map((j) => j.live));
    const jobsPanel = h('div', { class: 'panel' }, h('h2', {}, 'Live sandboxes by job'),
      jobs.length ? h('table', {}, h('tbody', {}, jobs.map((j) => h('tr', {},
        h('td', {}, h('a', { href: `#/sandboxes?job=${encodeURIComponent(j.job)}` }, j.job)),
        h('td', { class: 'num' }, fmtNum(j.live)),
        h('td', {}, stateBar(j.by_state, maxJob)),
        h('td', { class: 'muted' }, LIVE_STATES.filter((st) => j.by_state[st]).map((st) => `${st} ${j.by_state[st]}`).join(' · '))))))
        : h('p', { class: 'empty' }, 'No job has live sandboxes.'),
      summary.jobs.length > jobs.length ? h('p', { class: 'muted' }, `and ${summary.jobs.length - jobs.length} more jobs`) : null,
      legend(LIVE_STATES.map((st) => [st, getComputedStyle(document.body).getPropertyValue(`--${st}`).trim()])));

    const rate = h('div', { class: 'panel' }, h('h2', {}, 'Create rate: allowed vs achieved (per second)'),
      h('div', { class: 'stats' },
        h('div', {}, h('div', { class: 'big' }, fmtNum(last.achieved, 1)), h('div', { class: 'l' }, 'achieved')),
        h('div', {}, h('div', { class: 'big' }, last.allowed ? fmtNum(last.allowed, 1) : 'unlimited'), h('div', { class: 'l' }, 'allowed'))),
      lineChart([
        { name: 'allowed', color: '#94a3b8', dash: '5 4', points: samples.filter((x) => x.allowed > 0).map((x) => [x.t, x.allowed]) },
        { name: 'achieved', color: '#34d399', points: samples.map((x) => [x.t, x.achieved]) },
      ], { label: 'create rate' }));

    const queue = h('div', { class: 'panel' }, h('h2', {}, 'Admission queue'),
      h('div', { class: 'stats' },
        h('div', {}, h('div', { class: 'big', id: 'queue-depth' }, fmtNum(bs.queued || 0)), h('div', { class: 'l' }, 'queued now')),
        h('div', {}, h('div', { class: 'big' }, oldest === null ? '–' : fmtDur(oldest)), h('div', { class: 'l' }, 'oldest wait')),
        h('div', {}, h('div', { class: 'big' }, last.waitP95 === null || last.waitP95 === undefined ? '–' : fmtDur(last.waitP95 * 1000)), h('div', { class: 'l' }, 'queue wait p95')),
        h('div', {}, h('div', { class: 'big' }, fmtNum(last.rejected || 0)), h('div', { class: 'l' }, 'refused (queue full)'))),
      lineChart([{ name: 'queue depth', color: '#a78bfa', points: samples.map((x) => [x.t, x.depth]) }], { label: 'queue depth' }));

    const claims = h('div', { class: 'panel' }, h('h2', {}, 'Warm-pool claims vs cold creates (per second)'),
      h('div', { class: 'stats' },
        h('div', {}, h('div', { class: 'big' }, fmtNum(last.claims || 0)), h('div', { class: 'l' }, 'claims')),
        h('div', {}, h('div', { class: 'big' }, fmtNum(last.admitted || 0)), h('div', { class: 'l' }, 'cold creates admitted')),
        h('div', {}, h('div', { class: 'big' }, last.readyP50 == null ? '–' : fmtDur(last.readyP50 * 1000)), h('div', { class: 'l' }, 'create→ready p50')),
        h('div', {}, h('div', { class: 'big' }, last.readyP95 == null ? '–' : fmtDur(last.readyP95 * 1000)), h('div', { class: 'l' }, 'p95'))),
      lineChart([
        { name: 'claims', color: '#60a5fa', points: samples.slice(1).map((x) => [x.t, x.claimRate]) },
        { name: 'cold creates', color: '#fbbf24', points: samples.slice(1).map((x) => [x.t, x.coldRate]) },
      ], { label: 'claims vs cold creates' }));

    const f = summary.failures;
    const labels = [];
    for (let i = 0; i < 60; i++) labels.push(fmtTime(f.end_ms - (60 - i) * f.bucket_ms).slice(0, 5));
    const reasons = Object.keys(f.by_reason).sort();
    const failed = reasons.reduce((a, r) => a + f.by_reason[r].reduce((x, y) => x + y, 0), 0);
    const failures = h('div', { class: 'panel' }, h('h2', {}, `Failures and reclaims by reason, last hour (${fmtNum(failed)})`),
      stackedColumns(labels, reasons.map((r) => ({ name: r, color: colorOf(r), values: f.by_reason[r] })),
        { label: 'failures by reason', empty: 'no failure in the last hour' }));

    const events = h('div', { class: 'panel wide' }, h('h2', {}, 'Latest events'), eventsTable(recent.slice(-30).reverse(), true));
    main().replaceChildren(h('h1', {}, 'Overview'), tiles,
      h('div', { class: 'grid' }, jobsPanel, queue, rate, claims, failures, events));
  };
  return {
    async refresh() { summary = await call('/ui/api/summary'); render(); },
    onMetrics() { render(); },
  };
}

function eventsTable(events, withSandbox) {
  if (!events.length) return h('p', { class: 'empty' }, 'No events yet.');
  return h('div', { class: 'events' }, h('table', {}, h('thead', {}, h('tr', {},
    h('th', {}, 'time'), withSandbox ? h('th', {}, 'sandbox') : null, h('th', {}, 'job'), h('th', {}, 'state'), h('th', {}, 'reason'), h('th', {}, 'message'))),
  h('tbody', {}, events.map((e) => h('tr', {},
    h('td', { class: 'mono' }, fmtTime(e.time_ms)),
    withSandbox ? h('td', { class: 'mono' }, e.sandbox ? h('a', { href: `#/sandboxes/${encodeURIComponent(e.sandbox)}` }, e.sandbox) : (e.kind || '')) : null,
    h('td', {}, e.job || ''),
    h('td', {}, e.state ? stateBadge(e.state) : (e.phase || '')),
    h('td', {}, e.reason || ''),
    h('td', { class: 'muted' }, e.queue_position ? `position ${e.queue_position}, about ${fmtDur(e.estimated_wait_ms)}` : (e.message || e.image || '')))))));
}

function jobsPage() {
  let jobs = null;
  const render = () => {
    if (!jobs.length) {
      main().replaceChildren(h('h1', {}, 'Jobs'), h('p', { class: 'empty' }, 'No jobs: PUT /v1/jobs/{job} sets a quota; creates that name a job make it appear here.'));
      return;
    }
    const rows = jobs.map((j) => {
      const u = j.usage || {};
      const sp = j.spec || {};
      const release = h('button', { class: 'danger', 'data-job': j.name, disabled: !j.live && !(j.by_state.queued) ? true : null,
        async onclick() {
          if (!confirm(`Release all ${j.live} live sandboxes of job "${j.name}" (queued creates included) and forget its quota?`)) return;
          release.disabled = true;
          try {
            const r = await call(`/v1/jobs/${encodeURIComponent(j.name)}`, { method: 'DELETE' });
            flash(`Released ${r.sandboxes} sandboxes of ${j.name}.`);
          } catch (e) { showError(e); }
          await this_.refresh();
        } }, 'Release all');
      return h('tr', {},
        h('td', {}, h('a', { href: `#/sandboxes?job=${encodeURIComponent(j.name)}` }, j.name)),
        h('td', { class: 'num' }, sp.max_sandboxes ?? '–'),
        h('td', { class: 'num' }, sp.create_rate ?? '–'),
        h('td', { class: 'num' }, sp.weight ?? 1),
        h('td', { class: 'num' }, sp.lease_s ? fmtDur(sp.lease_s * 1000) : '–'),
        h('td', { class: 'num' }, fmtNum(j.live)),
        h('td', { class: 'num' }, fmtNum(j.by_state.queued || 0)),
        h('td', {}, stateBar(j.by_state, Math.max(j.live, 1))),
        h('td', { class: 'num' }, fmtNum(j.created)),
        h('td', { class: 'num' }, fmtNum(u.cpu_seconds || 0, 1)),
        h('td', { class: 'num' }, fmtBytes(u.peak_memory_kib)),
        h('td', { class: 'num' }, fmtNum(u.sandbox_seconds || 0)),
        h('td', { class: 'muted' }, Object.entries(u.by_reason || {}).map(([r, n]) => `${r} ${n}`).join(' · ')),
        h('td', { class: 'mono' }, j.last_heartbeat_ms ? `${fmtDur(Date.now() - j.last_heartbeat_ms)} ago` : '–'),
        h('td', {}, release));
    });
    main().replaceChildren(h('h1', {}, 'Jobs'), h('div', { class: 'panel' }, h('table', {},
      h('thead', {}, h('tr', {}, ['job', 'max', 'rate/s', 'weight', 'lease', 'live', 'queued', 'states', 'created', 'cpu-s', 'peak mem', 'sandbox-s', 'ended by reason', 'heartbeat', '']
        .map((t, i) => h('th', { class: i >= 1 && i <= 12 && i !== 7 ? 'num' : null }, t)))),
      h('tbody', {}, rows))),
    h('p', { class: 'muted' }, 'cpu-s, peak mem and sandbox-s sum the accounting records of ended sandboxes.'));
  };
  const this_ = { async refresh() { jobs = (await call('/ui/api/jobs')).jobs; render(); } };
  return this_;
}

function flash(text) {
  main().prepend(h('p', { class: 'muted', role: 'status' }, text));
}

function sandboxesPage(_, params) {
  const state = {
    q: params.get('q') || '',
    job: params.get('job') || '',
    state: params.get('state') || '',
    page: Math.max(0, Number(params.get('page') || 0) | 0),
  };
  let result = null;
  let seq = 0;
  const search = h('input', { type: 'search', placeholder: 'search id, image, job, reason, label…', value: state.q, 'aria-label': 'search' });
  const job = h('input', { type: 'text', placeholder: 'job', value: state.job, list: 'job-names', 'aria-label': 'job' });
  const jobNames = h('datalist', { id: 'job-names' });
  const stateSel = h('select', { 'aria-label': 'state' }, h('option', { value: '' }, 'any state'), h('option', { value: 'live' }, 'live'),
    STATES.map((st) => h('option', { value: st }, st)));
  stateSel.value = state.state;
  const count = h('span', { class: 'muted' });
  const tbody = h('tbody');
  const prev = h('button', { class: 'quiet', onclick() { state.page--; sync(); } }, '← newer');
  const next = h('button', { class: 'quiet', onclick() { state.page++; sync(); } }, 'older →');
  const where = h('span', { class: 'muted' });
  let timer = null;
  const changed = () => { clearTimeout(timer); timer = setTimeout(() => { state.page = 0; sync(); }, 250); };
  search.addEventListener('input', changed);
  job.addEventListener('input', changed);
  stateSel.addEventListener('change', changed);

  // Keep the filter in the address (never the token), so that a view can be shared.
  function sync() {
    const p = new URLSearchParams();
    state.q = search.value.trim();
    state.job = job.value.trim();
    state.state = stateSel.value;
    if (state.q) p.set('q', state.q);
    if (state.job) p.set('job', state.job);
    if (state.state) p.set('state', state.state);
    if (state.page) p.set('page', state.page);
    replaceAddress(`#/sandboxes${p.toString() ? `?${p}` : ''}`);
    load().catch(showError);
  }

  async function load() {
    const p = new URLSearchParams({ offset: state.page * PAGE_SIZE, limit: PAGE_SIZE });
    if (state.q) p.set('q', state.q);
    if (state.job) p.set('job', state.job);
    if (state.state) p.set('state', state.state);
    const mine = ++seq;
    const r = await call(`/ui/api/sandboxes?${p}`);
    if (mine !== seq) return; // a newer query answered first
    result = r;
    render();
  }

  function render() {
    const now = Date.now();
    tbody.replaceChildren(...result.sandboxes.map((sb) => h('tr', { class: 'link', 'data-id': sb.id, onclick() { location.hash = `#/sandboxes/${encodeURIComponent(sb.id)}`; } },
      h('td', { class: 'mono' }, h('a', { href: `#/sandboxes/${encodeURIComponent(sb.id)}` }, sb.id)),
      h('td', { class: 'mono' }, sb.image),
      h('td', {}, sb.job || ''),
      h('td', {}, stateBadge(sb.state)),
      h('td', {}, sb.reason || ''),
      h('td', { class: 'num' }, fmtDur(now - sb.created_at_ms)),
      h('td', { class: 'num' }, sb.lease_expires_at_ms ? fmtDur(sb.lease_expires_at_ms - now) : '–'),
      h('td', {}, Object.entries(sb.labels || {}).map(([k, v]) => h('span', { class: 'label' }, `${k}=${v}`))))));
    if (!result.sandboxes.length) tbody.append(h('tr', {}, h('td', { colspan: 8, class: 'empty' }, 'No sandbox matches.')));
    const first = result.total ? result.offset + 1 : 0;
    const lastRow = result.offset + result.sandboxes.length;
    count.textContent = `${fmtNum(result.total)} sandboxes match`;
    where.textContent = `${fmtNum(first)}–${fmtNum(lastRow)} of ${fmtNum(result.total)}`;
    prev.disabled = state.page === 0;
    next.disabled = lastRow >= result.total;
  }

  main().replaceChildren(h('h1', {}, 'Sandboxes'),
    h('div', { class: 'toolbar' }, search, job, jobNames, stateSel, count),
    h('div', { class: 'panel' }, h('table', {}, h('thead', {}, h('tr', {},
      ['id', 'image', 'job', 'state', 'reason', 'age', 'lease left', 'labels'].map((t) => h('th', { class: ['age', 'lease left'].includes(t) ? 'num' : null }, t)))), tbody),
    h('div', { class: 'pager' }, prev, where, next)));
  call('/ui/api/summary').then((sm) => jobNames.replaceChildren(...sm.jobs.map((j) => h('option', { value: j.job })))).catch(() => {});
  return { refresh: load, stop() { clearTimeout(timer); } };
}

function replaceAddress(hash) {
  // replaceState does not fire hashchange: the page stays, only the address follows it.
  window.history.replaceState(null, '', hash);
}

function sandboxPage(id) {
  let conditions = null;
  let conditionsError = null;
  let processes = null;
  let processesError = null;
  let sb = null;
  let events = [];
  const url = `/v1/sandboxes/${encodeURIComponent(id)}`;

  async function takeConditions() {
    try { conditions = await call(`${url}/conditions`); conditionsError = null; } catch (e) { conditionsError = e.message; }
    render();
  }
  async function listProcesses() {
    try { processes = (await call(`${url}/processes`)).processes; processesError = null; } catch (e) { processesError = e.message; }
    render();
  }

  function render() {
    const now = Date.now();
    const live = !['gone', 'failed'].includes(sb.state);
    const release = h('button', { class: 'danger', id: 'release', disabled: !live || null, async onclick() {
      if (!confirm(`Release sandbox ${sb.id}? Its processes are killed and its files are gone.`)) return;
      release.disabled = true;
      try { await call(url, { method: 'DELETE' }); } catch (e) { showError(e); }
      await me.refresh();
    } }, 'Release');
    const kv = (pairs) => h('dl', { class: 'kv' }, pairs.filter((p) => p[1] !== undefined && p[1] !== null && p[1] !== '').map(([k, v]) => [h('dt', {}, k), h('dd', {}, v)]));
    const details = h('div', { class: 'panel' }, h('h2', {}, 'Sandbox'), kv([
      ['state', stateBadge(sb.state)],
      ['reason', sb.reason ? h('strong', { id: 'reason' }, sb.reason) : null],
      ['message', sb.message],
      ['image', h('span', { class: 'mono' }, sb.image)],
      ['job', sb.job ? h('a', { href: `#/sandboxes?job=${encodeURIComponent(sb.job)}` }, sb.job) : null],
      ['provider', `${sb.provider}${sb.isolation ? ` (${sb.isolation})` : ''}`],
      ['profile', `${sb.profile}, network ${sb.network}`],
      ['resources', Object.entries(sb.resources || {}).map(([k, v]) => `${k} ${v}`).join(', ') || 'none asked'],
      ['user', sb.user],
      ['created', `${fmtTime(sb.created_at_ms)} (${fmtDur(now - sb.created_at_ms)} ago)`],
      ['ready', sb.ready_at_ms ? `${fmtTime(sb.ready_at_ms)} (after ${fmtDur(sb.ready_at_ms - sb.created_at_ms)})` : null],
      ['ended', sb.ended_at_ms ? fmtTime(sb.ended_at_ms) : null],
      ['lease left', sb.lease_expires_at_ms ? `${fmtDur(sb.lease_expires_at_ms - now)} (lease ${fmtDur(sb.lease_s * 1000)})` : null],
      ['idle left', sb.idle_expires_at_ms ? fmtDur(sb.idle_expires_at_ms - now) : null],
      ['lifetime left', sb.ttl_expires_at_ms ? fmtDur(sb.ttl_expires_at_ms - now) : null],
      ['labels', Object.keys(sb.labels || {}).length ? Object.entries(sb.labels).map(([k, v]) => h('span', { class: 'label' }, `${k}=${v}`)) : null],
    ]), h('p', {}, release));

    let cond;
    if (conditions) cond = conditionsView(conditions.record);
    else if (conditionsError) cond = h('p', { class: 'muted' }, conditionsError);
    else cond = h('div', {}, h('p', { class: 'muted' }, 'An eval sandbox has its record from the start; another is recorded at the first ask, and the record is then kept.'),
      h('button', { class: 'quiet', disabled: !live || null, onclick: takeConditions }, 'Take the conditions record'));

    let procs;
    if (processes) {
      procs = processes.length ? h('table', {}, h('thead', {}, h('tr', {}, ['id', 'tag', 'pid', 'command', 'state', 'started', 'exit', 'stdout', 'stderr'].map((t) => h('th', {}, t)))),
        h('tbody', {}, processes.map((p) => h('tr', {},
          h('td', { class: 'mono' }, p.id), h('td', {}, p.tag || ''), h('td', { class: 'num' }, p.pid),
          h('td', { class: 'mono' }, (p.argv || []).join(' ')), h('td', {}, p.state), h('td', {}, fmtTime(p.started_at_ms)),
          h('td', {}, p.exit ? JSON.stringify(p.exit) : ''), h('td', { class: 'num' }, fmtNum(p.stdout_bytes)), h('td', { class: 'num' }, fmtNum(p.stderr_bytes))))))
        : h('p', { class: 'empty' }, 'No background processes.');
      procs = h('div', {}, procs, h('button', { class: 'quiet', onclick: listProcesses }, 'Refresh'));
    } else if (processesError) procs = h('p', { class: 'muted' }, processesError);
    else procs = h('div', {}, h('p', { class: 'muted' }, 'Asking the daemon is a call on the sandbox: it renews the lease and counts as activity.'),
      h('button', { class: 'quiet', id: 'list-processes', disabled: !live || null, onclick: listProcesses }, 'List background processes'));

    main().replaceChildren(h('h1', {}, h('a', { href: '#/sandboxes' }, 'Sandboxes'), ' / ', h('span', { class: 'mono' }, sb.id)),
      h('div', { class: 'grid' }, details,
        h('div', { class: 'panel' }, h('h2', {}, 'Conditions record'), cond),
        h('div', { class: 'panel wide' }, h('h2', {}, 'Background processes'), procs),
        h('div', { class: 'panel wide' }, h('h2', {}, 'Events'), eventsTable(events.slice().reverse(), false))));
  }

  const me = {
    async refresh() {
      sb = await call(url);
      events = (await call(`/ui/api/sandboxes/${encodeURIComponent(id)}/events`)).events;
      if (!conditions && !conditionsError && sb.profile === 'eval' && sb.state === 'ready') {
        await takeConditions();
        return;
      }
      render();
    },
  };
  return me;
}

// Applied against observed, field by field, with the record's mismatches highlighted.
function conditionsView(rec) {
  const a = rec.applied || {};
  const o = rec.observed || {};
  const bad = new Set((rec.mismatches || []).map((m) => m.field));
  const rows = [
    ['image', rec.asked.image, a.image, ''],
    ['cpu', JSON.stringify(rec.asked.resources.cpu ?? null), a.cpu, o.cgroup_cpu_limit],
    ['memory', rec.asked.resources.memory, a.memory, o.cgroup_memory_limit],
    ['swap', '', a.swap, o.cgroup_swap_limit],
    ['pids', rec.asked.resources.pids, a.pids, o.cgroup_pids_limit],
    ['network', rec.asked.network, a.network, (o.network_interfaces || []).join(', ')],
    ['timezone', '', a.timezone, o.timezone],
    ['locale', '', a.locale, o.locale],
  ];
  const show = (v) => (v === undefined || v === null || v === 'null' ? '–' : String(v));
  return h('div', {},
    h('p', {}, (rec.mismatches || []).length
      ? h('strong', { class: 'error' }, `${rec.mismatches.length} mismatch${rec.mismatches.length > 1 ? 'es' : ''} between what was applied and what the daemon observes`)
      : h('span', {}, 'What the provider applied and what the daemon observes agree.')),
    h('table', {}, h('thead', {}, h('tr', {}, ['field', 'asked', 'applied', 'observed'].map((t) => h('th', {}, t)))),
      h('tbody', {}, rows.map(([f, asked, ap, ob]) => h('tr', { class: bad.has(f) ? 'mismatch' : null }, h('td', {}, f), h('td', { class: 'mono' }, show(asked)),
        h('td', { class: 'mono' }, show(ap)), h('td', { class: 'mono' }, show(ob)))))),
    (rec.mismatches || []).length ? h('table', {}, h('tbody', {}, rec.mismatches.map((m) => h('tr', { class: 'mismatch' },
      h('td', {}, m.field), h('td', {}, `applied ${m.applied}`), h('td', {}, `observed ${m.observed}`))))) : null,
    h('p', { class: 'muted' }, `provider ${rec.provider}, kernel ${o.kernel || '?'}, recorded ${fmtTime(rec.recorded_ms)}; signed, checked by sandman verify`));
}

function poolsPage() {
  let pools = null;
  const render = () => {
    if (!pools.length) {
      main().replaceChildren(h('h1', {}, 'Pools'), h('p', { class: 'empty' }, 'No warm pools: PUT /v1/pools/{name} makes one.'));
      return;
    }
    main().replaceChildren(h('h1', {}, 'Pools'), h('div', { class: 'panel' }, h('table', {},
      h('thead', {}, h('tr', {}, ['pool', 'image', 'ready / target', '', 'creating', 'claimed', 'claims', 'claims/s', 'refill', 'max', 'last error'].map((t) => h('th', {}, t)))),
      h('tbody', {}, pools.map((p) => {
        const bar = h('div', { class: 'bar', title: `ready ${p.ready}, creating ${p.creating} of target ${p.target}` });
        const scale = Math.max(p.target, p.ready + p.creating, 1);
        for (const [cls, n] of [['ready', p.ready], ['creating', p.creating]]) {
          const span = h('span', { class: cls });
          span.style.width = `${(100 * n) / scale}%`;
          bar.append(span);
        }
        return h('tr', {},
          h('td', {}, h('a', { href: `#/sandboxes?q=${encodeURIComponent(`sandman.dev/pool=${p.name}`)}` }, p.name)),
          h('td', { class: 'mono' }, p.spec.image),
          h('td', { class: 'num' }, `${p.ready} / ${p.target}`), h('td', {}, bar),
          h('td', { class: 'num' }, p.creating), h('td', { class: 'num' }, p.claimed), h('td', { class: 'num' }, fmtNum(p.claims)),
          h('td', { class: 'num' }, p.claim_rate == null ? '–' : fmtNum(p.claim_rate, 2)),
          h('td', { class: 'num' }, p.refill_seconds == null ? '–' : fmtDur(p.refill_seconds * 1000)),
          h('td', { class: 'num' }, p.spec.max ?? p.spec.min_ready),
          h('td', { class: 'error' }, p.last_error || ''));
      })))));
  };
  return { async refresh() { pools = (await call('/v1/pools')).pools; render(); } };
}

function preparePage() {
  let runs = null;
  const render = () => {
    if (!runs.length) {
      main().replaceChildren(h('h1', {}, 'Prepare runs'), h('p', { class: 'empty' }, 'No image preparation among the recent events: POST /v1/prepare (sandman prepare) starts one.'));
      return;
    }
    main().replaceChildren(h('h1', {}, 'Prepare runs'), ...runs.map((r) => {
      const total = r.nodes_total || 0;
      const ready = r.nodes_ready || 0;
      const bar = h('div', { class: 'bar', title: `${ready} of ${total} nodes` });
      const span = h('span', { class: r.phase === 'failed' ? 'queued' : 'ready' });
      span.style.width = `${total ? (100 * ready) / total : (r.phase === 'ready' ? 100 : 0)}%`;
      bar.append(span);
      return h('div', { class: 'panel run' },
        h('h2', {}, h('span', { class: 'mono' }, r.image), r.job ? ` for job ${r.job}` : '', ' — ', h('span', { class: `state ${r.phase === 'ready' ? 'ready' : r.phase === 'failed' ? 'failed' : 'creating'}` }, r.phase)),
        h('div', { class: 'stats' },
          h('div', {}, h('div', { class: 'big' }, total ? `${ready} / ${total}` : '–'), h('div', { class: 'l' }, 'nodes ready')),
          h('div', {}, h('div', { class: 'big' }, fmtTime(r.started_ms)), h('div', { class: 'l' }, 'started')),
          h('div', {}, h('div', { class: 'big' }, fmtDur(r.updated_ms - r.started_ms)), h('div', { class: 'l' }, 'took so far'))),
        bar, r.message ? h('p', { class: r.phase === 'failed' ? 'error' : 'muted' }, r.message) : null,
        Object.keys(r.nodes).length ? h('table', {}, h('thead', {}, h('tr', {}, h('th', {}, 'node'), h('th', {}, 'latest'), h('th', {}, 'at'))),
          h('tbody', {}, Object.entries(r.nodes).map(([n, l]) => h('tr', {}, h('td', { class: 'mono' }, n), h('td', {}, l.message), h('td', { class: 'mono' }, fmtTime(l.time_ms)))))) : null);
    }));
  };
  return { async refresh() { runs = (await call('/ui/api/prepare')).runs; render(); } };
}

// ---- sign in and out ----

function signOut(why) {
  token = null;
  sessionStorage.removeItem(TOKEN_KEY);
  if (follower) follower.abort();
  follower = null;
  clearInterval(metricsTimer);
  if (view && view.stop) view.stop();
  view = null;
  $('#top').hidden = true;
  main().replaceChildren();
  $('#login').hidden = false;
  $('#login-error').textContent = why || '';
  $('#token').value = '';
  $('#token').focus();
}

async function start() {
  let summary;
  try {
    summary = await call('/ui/api/summary');
  } catch (e) {
    if (!(e instanceof Unauthorized)) $('#login-error').textContent = `cannot reach the server: ${e.message}`;
    return;
  }
  $('#login').hidden = true;
  $('#top').hidden = false;
  $('#server').textContent = `${summary.provider} · v${summary.version}`;
  follow(summary.last_seq);
  scrape();
  metricsTimer = setInterval(scrape, METRICS_EVERY_MS);
  route();
}

$('#login-form').addEventListener('submit', (e) => {
  e.preventDefault();
  token = $('#token').value.trim();
  if (!token) return;
  sessionStorage.setItem(TOKEN_KEY, token);
  $('#login-error').textContent = '';
  start();
});
$('#logout').addEventListener('click', () => signOut(''));
window.addEventListener('hashchange', () => { if (token) route(); });

if (token) start();
else signOut('');
