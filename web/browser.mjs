#!/usr/bin/env node
// Resumes a ferry snapshot in a browser tab — a headless Chromium opening the space's console
// (`ferry serve` at /console/, web/index.html) — with the arguments and exit codes of
// ferry-resume.mjs, so a test can run either:
//
//   node web/browser.mjs --space URL [--token-file F] [--chromium PATH] [--timeout SECS] [--suspend-after MS] blake3:<hex>
//
// The guest's stdout and stderr, exactly as the page received them, go to this process's;
// the exit code is the guest's (65 refused, 70 trapped, as ferry-resume.mjs).
// `--suspend-after MS` presses the page's Suspend button MS after the guest began to run: the tab
// writes the snapshot to the space, and this prints `suspended blake3:<hex>` (exit 75). It speaks the
// Chrome DevTools Protocol over the WebSocket Chromium opens (Node 22+ has WebSocket built
// in), so nothing but Chromium itself is needed. 1 on a timeout or a browser failure.

import { spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const args = process.argv.slice(2);
const opt = (name, dflt) => {
  const i = args.indexOf(name);
  if (i < 0) return dflt;
  const v = args[i + 1];
  args.splice(i, 2);
  return v;
};
const chromium = opt("--chromium", process.env.FERRY_CHROMIUM ?? "chromium-headless-shell");
const timeout = Number(opt("--timeout", "300")) * 1000;
const space = opt("--space", process.env.FERRY_SPACE);
const tokenFile = opt("--token-file");
const suspendAfter = opt("--suspend-after");
const session = opt("--session");
const token = tokenFile ? readFileSync(tokenFile, "utf8").trim() : process.env.FERRY_TOKEN ?? "";
const kappa = args[0];
if (!space || !kappa === !session) {
  console.error("usage: browser.mjs --space URL [--token-file F] [--chromium PATH] [--timeout SECS] [--suspend-after MS] (blake3:<hex> | --session ID)");
  process.exit(64);
}
const what = session ? { take: session } : { resume: kappa };
const url = `${space.replace(/\/+$/, "")}/console/#${new URLSearchParams({ ...what, token })}`;

const profile = mkdtempSync(join(tmpdir(), "ferry-chromium-"));
const browser = spawn(chromium, [
  "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
  `--user-data-dir=${profile}`, "--remote-debugging-port=0", "about:blank",
], { stdio: ["ignore", "ignore", "pipe"], detached: true });
// Chromium is a tree of processes (Debian's command is a script that starts the browser,
// which starts its zygotes, GPU and renderer processes): all of it goes, as a process group.
const done = (code) => {
  try {
    process.kill(-browser.pid, "SIGKILL");
  } catch {
    browser.kill("SIGKILL");
  }
  rmSync(profile, { recursive: true, force: true });
  process.exit(code);
};
setTimeout(() => {
  console.error(`browser.mjs: no outcome within ${timeout / 1000} s`);
  done(1);
}, timeout).unref();
// Stopped from outside (Ctrl-C, `timeout`): the browser goes too.
process.on("SIGINT", () => done(130));
process.on("SIGTERM", () => done(143));

// Chromium prints `DevTools listening on ws://…` once it is ready.
const wsUrl = await new Promise((ok, fail) => {
  let seen = "";
  browser.stderr.on("data", (d) => {
    seen += d;
    const m = /DevTools listening on (ws:\/\/\S+)/.exec(seen);
    if (m) ok(m[1]);
  });
  browser.on("exit", (c) => fail(new Error(`chromium exited (${c}) before it listened: ${seen.trim()}`)));
}).catch((e) => {
  console.error(`browser.mjs: ${e.message}`);
  done(1);
});

const ws = new WebSocket(wsUrl);
await new Promise((ok) => ws.addEventListener("open", ok, { once: true }));
let nextId = 1;
const pending = new Map();
ws.addEventListener("message", ({ data }) => {
  const m = JSON.parse(data);
  if (m.id && pending.has(m.id)) {
    pending.get(m.id)(m);
    pending.delete(m.id);
  }
});
const send = (method, params = {}, sessionId) => new Promise((ok) => {
  const id = nextId++;
  pending.set(id, ok);
  ws.send(JSON.stringify({ id, method, params, sessionId }));
});

const { result: { targetId } } = await send("Target.createTarget", { url: "about:blank" });
const { result: { sessionId } } = await send("Target.attachToTarget", { targetId, flatten: true });
await send("Page.enable", {}, sessionId);
await send("Page.navigate", { url }, sessionId);
const evaluate = async (expression) => (await send("Runtime.evaluate", { expression, returnByValue: true }, sessionId)).result?.result?.value;

let pressed = false;
let runningSince = null;
for (;;) {
  await new Promise((ok) => setTimeout(ok, suspendAfter ? 20 : 100));
  if (suspendAfter && !pressed && (await evaluate("document.title")) === "ferry console: resuming") {
    const running = await evaluate("document.getElementById('status').textContent.startsWith('restored')");
    if (running && runningSince === null) runningSince = Date.now();
    if (running && Date.now() - runningSince >= Number(suspendAfter)) {
      await evaluate("document.getElementById('suspend').click()");
      pressed = true;
    }
  }
  const outcome = await evaluate("window.ferryOutcome");
  if (!outcome) continue;
  const write = (fd, b64) => {
    const bytes = Buffer.from(b64, "base64");
    for (let at = 0; at < bytes.length; ) at += writeSync(fd, bytes, at);
  };
  write(1, outcome.stdout);
  write(2, outcome.stderr);
  // A session taken over: the space must have taken it back (69 if it did not, or fenced the tab).
  const back = (code) => {
    if (outcome.fenced !== undefined || outcome.returnError !== undefined) {
      write(2, Buffer.from(`ferry: ${outcome.fenced ?? `the space did not take the session back: ${outcome.returnError}`}\n`).toString("base64"));
      done(69);
    }
    done(code);
  };
  if (outcome.suspended !== undefined) {
    write(2, Buffer.from(`suspended blake3:${outcome.suspended}\n`).toString("base64"));
    back(75);
  } else if (outcome.fenced !== undefined) {
    back(69);
  } else if (outcome.refused !== undefined) {
    write(2, Buffer.from(`ferry: refused: ${outcome.refused}\n`).toString("base64"));
    back(65);
  } else if (outcome.trap !== undefined) {
    write(2, Buffer.from(`ferry: guest trapped: ${outcome.trap}\n`).toString("base64"));
    back(70);
  } else back(outcome.code);
  break;
}
