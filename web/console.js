// The console page (web/index.html, served by `ferry serve` at /console/): lists the space's
// sessions, resumes snapshots in this tab, in a worker (web/worker.js), and suspends them
// again into the space ("Suspend"). The token is kept
// in this tab's sessionStorage only. `#resume=blake3:…&token=…` in the address starts a
// resume at once (the fragment never reaches a server).

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
      b.onclick = () => start(s.snapshot);
      cell.append(b);
    }
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

function start(kappa) {
  if (worker) worker.terminate();
  output.replaceChildren();
  seen = { 1: [], 2: [] };
  window.ferryOutcome = undefined;
  document.title = "ferry console: resuming";
  status.textContent = `resuming ${kappa} …`;
  const started = performance.now();
  worker = new Worker(new URL("worker.js", import.meta.url), { type: "module" });
  // A suspend is asked for through shared memory: the worker is busy running the guest.
  cell = typeof SharedArrayBuffer !== "undefined" && crossOriginIsolated ? new Int32Array(new SharedArrayBuffer(4)) : null;
  $("suspend").disabled = cell === null;
  ctl = null;
  worker.onmessage = ({ data }) => {
    if (data.ctl) {
      ctl = new Int32Array(data.ctl, 0, 1);
      return;
    }
    if (data.out) return show(data.out, data.bytes, data.before);
    if (data.progress) {
      status.textContent = data.progress;
      return;
    }
    const secs = ((performance.now() - started) / 1000).toFixed(1);
    $("suspend").disabled = true;
    if (data.suspended !== undefined) status.textContent = `suspended blake3:${data.suspended}: written to this space (${data.sent} new objects); resume it here or anywhere (ferry pull, ferry resume)`;
    else if (data.refused !== undefined) status.textContent = `refused: ${data.refused}`;
    else if (data.trap !== undefined) status.textContent = `the guest trapped: ${data.trap} (${secs} s)`;
    else status.textContent = `the guest exited with code ${data.code} (${secs} s)`;
    // For whoever drives this page (a test, a script): the outcome in one place.
    window.ferryOutcome = { ...data, stdout: base64(seen[1]), stderr: base64(seen[2]) };
    document.title = `ferry console: ${data.suspended !== undefined ? "suspended" : data.refused !== undefined ? "refused" : data.trap !== undefined ? "trapped" : `exit ${data.code}`}`;
    worker.terminate();
    worker = null;
  };
  worker.onerror = (e) => {
    status.textContent = `the worker failed: ${e.message}`;
    document.title = "ferry console: failed";
  };
  worker.postMessage({ base, token, kappa, cell });
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
