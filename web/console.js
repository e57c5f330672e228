// The console page (web/index.html, served by `ferry serve` at /console/): lists the space's
// sessions, resumes snapshots in this tab, in a worker (web/worker.js), and suspends them
// again into the space ("Suspend"); or takes a session over ("Take over", web/lease.js): the
// space lends it to this tab, which sends it the guest's output as it comes and gives the
// session back when it is suspended or ends. The token is kept in this tab's sessionStorage
// only. `#resume=blake3:…&token=…` in the address starts a resume at once, `#take=SESSION`
// a take-over (the fragment never reaches a server).

import { Lease, precopy } from "./lease.js";

const base = location.origin;
const $ = (id) => document.getElementById(id);
const status = $("status");
const output = $("output");
let token = sessionStorage.getItem("ferry-token") ?? "";

const params = new URLSearchParams(location.hash.slice(1));
if (params.get("token")) {
  token = params.get("token");
  sessionStorage.setItem("ferry-token", token);
}
$("token").value = token;

$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  token = $("token").value.trim();
  sessionStorage.setItem("ferry-token", token);
  listSessions();
});

async function listSessions() {
  const body = $("sessions").tBodies[0];
  body.replaceChildren();
  const note = $("sessions-note");
  note.textContent = "";
  if (!token) {
    note.textContent = "Give the space's token to see its sessions.";
    return;
  }
  const r = await fetch(`${base}/v1/sessions`, { headers: { Authorization: `Bearer ${token}` } });
  if (!r.ok) {
    note.textContent = `The space answered ${r.status}: ${(await r.text()).trim()}`;
    return;
  }
  const sessions = await r.json();
  if (sessions.length === 0) note.textContent = "No sessions (ferry --space URL run PROG.wasm starts one).";
  for (const s of sessions) {
    const row = body.insertRow();
    for (const text of [s.id, s.program, s.state + (s.exit_code !== undefined ? ` (${s.exit_code})` : ""), s.snapshot ?? "—"]) {
      const cell = row.insertCell();
      cell.textContent = text;
    }
    const cell = row.insertCell();
    if (s.snapshot) {
      const b = document.createElement("button");
      b.textContent = "Resume here";
      b.title = "Run a copy of its latest snapshot in this tab; the space keeps the session";
      b.onclick = () => start(s.snapshot);
      cell.append(b);
    }
    if (s.state === "running" || s.state === "suspended") {
      const b = document.createElement("button");
      b.textContent = "Take over";
      b.title = "Move the session into this tab: the space suspends it and lends it here until it is suspended or ends";
      b.onclick = () => takeOver(s.id);
      cell.append(" ", b);
    }
    if (s.state === "lent") row.cells[2].textContent += ` to ${s.lent_to ?? "a client"}`;
  }
}

$("resume-form").addEventListener("submit", (e) => {
  e.preventDefault();
  start($("kappa").value.trim());
});

let worker = null;
let cell = null;
let ctl = null; // the guest's poll flag (shared memory), once the worker has it
const decoder = [null, new TextDecoder(), new TextDecoder()];
// The exact bytes of this run's stdout and stderr (after the snapshot), for whoever drives
// the page: `window.ferryOutcome` once the guest has ended.
let seen = { 1: [], 2: [] };

function base64(parts) {
  let s = "";
  for (const p of parts) for (let i = 0; i < p.length; i += 0x8000) s += String.fromCharCode(...p.subarray(i, i + 0x8000));
  return btoa(s);
}

function show(stream, bytes, before) {
  if (!before) seen[stream].push(bytes);
  const span = document.createElement("span");
  span.textContent = decoder[stream].decode(bytes, { stream: true });
  if (stream === 2) span.className = "err";
  if (before) span.className += " before";
  output.append(span);
}

async function takeOver(id) {
  if (worker) worker.terminate();
  worker = null;
  output.replaceChildren();
  window.ferryOutcome = undefined;
  document.title = "ferry console: resuming";
  status.textContent = `taking session ${id} over …`;
  const refuse = (why) => {
    status.textContent = `refused: ${why}`;
    window.ferryOutcome = { refused: why, stdout: "", stderr: "" };
    document.title = "ferry console: refused";
  };
  try {
    await Lease.check(base, token, id);
  } catch (e) {
    return refuse(e.message);
  }
  // Pre-copy: while the session still runs on the space, a checkpoint of it is fetched and
  // checked in the worker that will run it; after the lend only what changed since moves.
  const pre = new Worker(new URL("worker.js", import.meta.url), { type: "module" });
  await precopy(base, token, id, (k) => {
    status.textContent = `pre-copying ${k} while the session runs on the space …`;
    return new Promise((ok) => {
      pre.onmessage = ({ data }) => ok(data.prefetched ?? null);
      pre.postMessage({ prefetch: k, base, token });
    });
  });
  let lease;
  try {
    // A tab that is closed, or whose machine goes away, gives the session back to the space
    // by saying nothing for two minutes (a hidden tab's timers still run once a minute).
    lease = await Lease.take(base, token, id, `a browser tab (${navigator.userAgent})`, { leaseMs: 120000 });
  } catch (e) {
    pre.terminate();
    return refuse(e.message);
  }
  lease.onFailed = (why) => {
    if (worker) worker.terminate();
    worker = null;
    $("suspend").disabled = true;
    status.textContent = `${why}: this copy of session ${id} stops`;
    window.ferryOutcome = { fenced: why, stdout: base64(seen[1]), stderr: base64(seen[2]) };
    document.title = "ferry console: fenced";
  };
  start(lease.snapshot, lease, pre);
}

/** Tells the space how a session taken over ended here; what to show of it. */
async function giveBack(lease, data) {
  const outcome = data.suspended !== undefined ? { snapshot: `blake3:${data.suspended}` }
    : data.refused !== undefined ? { refused: data.refused }
    : data.trap !== undefined ? { trap: data.trap, files: data.files }
    : { exit_code: data.code, files: data.files };
  try {
    const s = await lease.giveBack(outcome);
    return { note: `; session ${s.id} is ${s.state} on the space again`, returned: s.state };
  } catch (e) {
    return { note: `; the space did not take session ${lease.id} back: ${e.message} (ferry --space URL reclaim ${lease.id} takes it back at its last snapshot)`, returnError: e.message };
  }
}

function start(kappa, lease = null, ready = null) {
  if (worker) worker.terminate();
  output.replaceChildren();
  seen = { 1: [], 2: [] };
  window.ferryOutcome = undefined;
  document.title = "ferry console: resuming";
  status.textContent = `resuming ${kappa} …`;
  const started = performance.now();
  worker = ready ?? new Worker(new URL("worker.js", import.meta.url), { type: "module" });
  // A suspend is asked for through shared memory: the worker is busy running the guest.
  cell = typeof SharedArrayBuffer !== "undefined" && crossOriginIsolated ? new Int32Array(new SharedArrayBuffer(4)) : null;
  $("suspend").disabled = cell === null;
  ctl = null;
  // A session taken over is checkpointed as often as the space would (its interval).
  const every = lease?.checkpointEveryMs;
  if (every && cell) {
    const mine = cell;
    const timer = setInterval(() => {
      if (cell !== mine) return clearInterval(timer);
      if (Atomics.compareExchange(mine, 0, 0, 2) !== 0) return;
      Atomics.notify(mine, 0);
      if (ctl) Atomics.store(ctl, 0, 1);
    }, every);
  }
  worker.onmessage = ({ data }) => {
    if (data.ctl) {
      ctl = new Int32Array(data.ctl, 0, 1);
      return;
    }
    if (data.out) {
      if (lease && !data.before) lease.write(data.out, data.bytes);
      return show(data.out, data.bytes, data.before);
    }
    if (data.progress) {
      status.textContent = data.progress;
      return;
    }
    if (data.checkpoint) {
      if (lease) lease.checkpointed(`blake3:${data.checkpoint}`, (why) => (status.textContent = `the space refused a checkpoint: ${why}`));
      return;
    }
    ended(data);
  };
  const ended = async (data) => {
    const secs = ((performance.now() - started) / 1000).toFixed(1);
    $("suspend").disabled = true;
    if (worker) worker.terminate();
    worker = null;
    const back = lease ? await giveBack(lease, data) : { note: "" };
    if (data.suspended !== undefined) status.textContent = `suspended blake3:${data.suspended}: written to this space (${data.sent} new objects)${lease ? "" : "; resume it here or anywhere (ferry pull, ferry resume)"}`;
    else if (data.refused !== undefined) status.textContent = `refused: ${data.refused}`;
    else if (data.trap !== undefined) status.textContent = `the guest trapped: ${data.trap} (${secs} s)`;
    else status.textContent = `the guest exited with code ${data.code} (${secs} s)`;
    status.textContent += back.note;
    // For whoever drives this page (a test, a script): the outcome in one place.
    const { note, ...told } = back;
    window.ferryOutcome = { ...data, ...told, stdout: base64(seen[1]), stderr: base64(seen[2]) };
    document.title = `ferry console: ${data.suspended !== undefined ? "suspended" : data.refused !== undefined ? "refused" : data.trap !== undefined ? "trapped" : `exit ${data.code}`}`;
  };
  worker.onerror = (e) => {
    status.textContent = `the worker failed: ${e.message}`;
    document.title = "ferry console: failed";
  };
  worker.postMessage({ base, token, kappa, cell, lease: lease !== null });
}

$("suspend").addEventListener("click", () => {
  if (!cell) return;
  status.textContent = "suspending at the guest's next safe point …";
  Atomics.store(cell, 0, 1);
  Atomics.notify(cell, 0);
  if (ctl) Atomics.store(ctl, 0, 1);
});

listSessions();
if (params.get("resume")) start(params.get("resume"));
else if (params.get("take")) takeOver(params.get("take"));
