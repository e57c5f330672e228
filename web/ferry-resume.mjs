#!/usr/bin/env node
// Resumes a ferry snapshot in V8 (Node's WebAssembly engine), fetching it from a space:
//
//   node --experimental-wasm-multi-memory web/ferry-resume.mjs --space URL [--token-file F] blake3:<hex>
//
// The guest's stdout and stderr are this process's; progress goes to stderr with `-v`; the
// exit code is the guest's. Ctrl-C (SIGINT) or SIGTERM suspends it, as `ferry run` does: it
// unwinds at its next WASI call (or the safe point after), its snapshot is written to the
// space, which verifies and names it, and `suspended blake3:<hex>` is printed on stderr
// (exit 75); a second Ctrl-C exits at once. A snapshot that cannot be resumed here is refused with the reason
// (exit 65), before the guest runs; a trap prints `ferry: guest trapped: <cause>` (exit 70).
// The token comes from --token-file or FERRY_TOKEN, the space from --space or FERRY_SPACE.
// The guest runs in a worker thread with a stack of its own (--stack-mb, default 512), so a
// deep call stack can be rewound. The guest's mounts live in memory; `--write-mounts DIR`
// writes them out when it ends (mount /data into DIR/data), hard links as copies.
//
// `--session ID` takes the space's session ID over instead (docs/browser.md, "Taking a
// session over"): the space lends it (suspending it first if it runs), the guest runs here
// and its output goes to the session's log too, and at the end the session is given back —
// suspended at the snapshot written here (Ctrl-C), or ended with its exit code or trap and
// the files its mounts hold. 69 when the space cannot be told, or fences this copy (the
// session was reclaimed): the session then stays with the space. `--checkpoint-every MS`
// (default: the session's own interval, if it has one) writes a checkpoint to the space that
// often while the guest goes on, so a reclaim loses at most that much. `--lease SECS`
// (default 120; 0: none): the space takes the session back by itself once it has heard
// nothing from this process for that long (it speaks at least every quarter of it).

import { readFileSync, writeSync } from "node:fs";
import { Worker, isMainThread, parentPort, workerData } from "node:worker_threads";

const USAGE = "usage: ferry-resume.mjs --space URL [--token-file F] [--stack-mb N] [--write-mounts DIR] [-v] (blake3:<hex> | --session ID [--checkpoint-every MS] [--lease SECS])";
const EX_REFUSED = 65;
const EX_TRAP = 70;
const EX_USAGE = 64;
const EX_UNAVAILABLE = 69;
const EX_SUSPENDED = 75;

function writeAll(fd, bytes) {
  let at = 0;
  while (at < bytes.length) {
    try {
      at += writeSync(fd, bytes, at, bytes.length - at);
    } catch (e) {
      if (e.code !== "EAGAIN") throw e;
    }
  }
}

if (isMainThread) {
  const args = process.argv.slice(2);
  const opts = { space: process.env.FERRY_SPACE, token: process.env.FERRY_TOKEN, stackMb: 512, verbose: false };
  let kappa = null;
  for (let i = 0; i < args.length; i++) {
    const a = args[i];
    if (a === "--space") opts.space = args[++i];
    else if (a === "--token-file") opts.token = readFileSync(args[++i], "utf8").trim();
    else if (a === "--stack-mb") opts.stackMb = Number(args[++i]);
    else if (a === "-v") opts.verbose = true;
    else if (a === "--write-mounts") opts.writeMounts = args[++i];
    else if (a === "--session") opts.session = args[++i];
    else if (a === "--checkpoint-every") opts.checkpointEvery = Number(args[++i]);
    else if (a === "--lease") opts.lease = Number(args[++i]);
    else if (a === "-h" || a === "--help") {
      console.log(USAGE);
      process.exit(0);
    } else if (kappa === null && !a.startsWith("-")) kappa = a;
    else {
      console.error(`ferry-resume: unexpected argument \`${a}\`\n${USAGE}`);
      process.exit(EX_USAGE);
    }
  }
  if (!opts.space || (kappa === null) === !opts.session) {
    console.error(`ferry-resume: ${!opts.space ? "no space (--space or FERRY_SPACE)" : kappa ? "a snapshot or --session, not both" : "no snapshot named"}\n${USAGE}`);
    process.exit(EX_USAGE);
  }
  const say = (line) => writeAll(2, Buffer.from(`ferry: ${line}\n`));
  if (opts.lease !== undefined && !(opts.lease === 0 || opts.lease >= 1)) {
    say("--lease takes seconds, at least 1 (0: none)");
    process.exit(EX_USAGE);
  }
  if (opts.checkpointEvery !== undefined && !(opts.checkpointEvery >= 100)) {
    say("--checkpoint-every takes milliseconds, at least 100");
    process.exit(EX_USAGE);
  }
  let lease = null;
  const reclaimHint = () => `\`ferry --space ${opts.space} reclaim ${opts.session}\` takes it back at its last snapshot`;
  // The session's end, told to the space; exits with `code` once it heard, 69 if it did not.
  const giveBack = async (outcome, code) => {
    try {
      await lease.giveBack(outcome);
    } catch (e) {
      say(`the space did not take session ${opts.session} back: ${e.message}; ${reclaimHint()}`);
      process.exit(EX_UNAVAILABLE);
    }
    if (opts.verbose) say(`session ${opts.session} given back to ${opts.space}`);
    process.exit(code);
  };
  const cell = new Int32Array(new SharedArrayBuffer(4));
  let ctl = null; // the guest's poll flag, once the worker has it
  let asked = false;
  const suspend = () => {
    // Before the lend nothing was taken: the session runs on where it was.
    if (opts.session && !lease) process.exit(130);
    if (asked) {
      if (lease) say(`session ${opts.session} stays lent to this process, which is gone; ${reclaimHint()}`);
      process.exit(130);
    }
    asked = true;
    Atomics.store(cell, 0, 1);
    Atomics.notify(cell, 0);
    if (ctl) Atomics.store(ctl, 0, 1);
  };
  process.on("SIGINT", suspend);
  process.on("SIGTERM", suspend);
  const worker = new Worker(new URL(import.meta.url), {
    workerData: { ...opts, kappa, cell, lease: Boolean(opts.session) },
    resourceLimits: { stackSizeMb: opts.stackMb },
  });
  worker.on("error", (e) => {
    writeAll(2, Buffer.from(`ferry: ${e.stack ?? e}\n`));
    process.exit(1);
  });
  if (opts.session) {
    const { Lease, precopy } = await import("./lease.js");
    const { hostname } = await import("node:os");
    try {
      await Lease.check(opts.space, opts.token, opts.session);
    } catch (e) {
      say(`refused: ${e.message}`);
      process.exit(EX_REFUSED);
    }
    // Pre-copy: while the session still runs on the space, checkpoints of it are fetched and
    // checked here, round after round; after the lend only what changed since moves.
    const rounds = await precopy(opts.space, opts.token, opts.session, (k) => new Promise((ok) => {
      worker.once("message", (m) => ok(m.prefetched ?? null));
      worker.postMessage({ prefetch: k });
    }));
    if (opts.verbose) {
      for (const r of rounds) say(`pre-copied checkpoint ${r.snapshot} (${(r.bytes / 1048576).toFixed(1)} MiB) while the session ran on (${r.ms} ms)`);
    }
    const t1 = performance.now();
    try {
      const leaseMs = opts.lease === 0 ? null : (opts.lease ?? 120) * 1000;
      lease = await Lease.take(opts.space, opts.token, opts.session, `node ${process.version} (${process.arch}, pid ${process.pid}) on ${hostname()}`, { leaseMs });
    } catch (e) {
      say(`refused: ${e.message}`);
      process.exit(EX_REFUSED);
    }
    kappa = lease.snapshot;
    if (opts.verbose) say(`took session ${opts.session} over from ${opts.space} at epoch ${lease.epoch} (the lend took ${Math.round(performance.now() - t1)} ms): resuming ${kappa}`);
    worker.postMessage({ resume: kappa });
  }
  const every = lease ? opts.checkpointEvery ?? lease.checkpointEveryMs : null;
  if (every) {
    // A checkpoint asked for as a suspend is (2 instead of 1), unless one is asked already.
    setInterval(() => {
      if (Atomics.compareExchange(cell, 0, 0, 2) !== 0) return;
      Atomics.notify(cell, 0);
      if (ctl) Atomics.store(ctl, 0, 1);
    }, every).unref();
  }
  if (lease) {
    // Fenced (reclaimed) or out of reach for good: this copy stops at once.
    lease.onFailed = (why) => {
      worker.terminate();
      say(`${why}; this copy of session ${opts.session} stops`);
      process.exit(EX_UNAVAILABLE);
    };
  }
  worker.on("message", (m) => {
    if (m.ctl) {
      ctl = new Int32Array(m.ctl, 0, 1);
      if (asked) Atomics.store(ctl, 0, 1);
      return;
    }
    if (m.out) {
      lease.write(m.out, m.bytes);
      return;
    }
    if (m.checkpoint) {
      if (opts.verbose) say(`checkpoint blake3:${m.checkpoint} written to ${opts.space}`);
      lease.checkpointed(`blake3:${m.checkpoint}`, (why) => say(`the space refused a checkpoint: ${why}`));
      return;
    }
    if (m.refused) {
      writeAll(2, Buffer.from(`ferry: refused: ${m.refused}\n`));
      if (lease) return giveBack({ refused: m.refused }, EX_REFUSED);
      process.exit(EX_REFUSED);
    }
    if (m.suspended) {
      const mib = (m.bytes / 1048576).toFixed(1);
      if (lease) {
        writeAll(2, Buffer.from(`suspended blake3:${m.suspended}\nferry: written to ${opts.space} (${m.sent} objects, ${mib} MiB new); session ${opts.session} is suspended there again\n`));
        return giveBack({ snapshot: `blake3:${m.suspended}` }, EX_SUSPENDED);
      }
      writeAll(2, Buffer.from(`suspended blake3:${m.suspended}\nferry: written to ${opts.space} (${m.sent} objects, ${mib} MiB new); resume it there, here (node web/ferry-resume.mjs … blake3:${m.suspended}), or with \`ferry pull blake3:${m.suspended.slice(0, 12)}… --from ${opts.space}\` and \`ferry resume\`\n`));
      process.exit(EX_SUSPENDED);
    }
    if (m.trap) {
      writeAll(2, Buffer.from(`ferry: guest trapped: ${m.trap}\n`));
      if (lease) return giveBack({ trap: m.trap, files: m.files }, EX_TRAP);
      process.exit(EX_TRAP);
    }
    if (lease) return giveBack({ exit_code: m.code, files: m.files }, m.code);
    process.exit(m.code);
  });
} else {
  const { prefetch, resume } = await import("./resume.js");
  const { Refused, SpaceSource } = await import("./objects.js");
  const { SpaceSink, mountTrees } = await import("./capture.js");
  const { space, token, kappa, verbose, writeMounts, cell, lease } = workerData;
  const source = new SpaceSource(space, token);
  const sink = new SpaceSink(space, token);
  const run = async (kappa) => {
    const t0 = performance.now();
    try {
      const r = await resume(source, kappa, {
        suspendCell: cell,
        onCtl: (buffer) => parentPort.postMessage({ ctl: buffer }),
        onCheckpoint: ({ kappa }) => parentPort.postMessage({ checkpoint: kappa }),
        sink,
        // Taken over: each record goes to the session's log too (through the main thread).
        stdout: (b) => {
          writeAll(1, b);
          if (lease) parentPort.postMessage({ out: 1, bytes: b });
        },
        stderr: (b) => {
          writeAll(2, b);
          if (lease) parentPort.postMessage({ out: 2, bytes: b });
        },
        progress: verbose ? (line) => writeAll(2, Buffer.from(`ferry: ${line} (${Math.round(performance.now() - t0)} ms)\n`)) : undefined,
      });
      if (writeMounts) {
        const { join } = await import("node:path");
        for (const m of r.mounts) await writeTree(m.root, join(writeMounts, m.guestPath));
      }
      // A session taken over and ended here: what its mounts hold goes back with it.
      let files;
      if (lease && !r.suspended) {
        const m = mountTrees(r.mounts);
        await sink.send(m.objects);
        files = m.trees;
      }
      parentPort.postMessage({ code: r.code, trap: r.trap, suspended: r.suspended, sent: r.sent, bytes: r.bytes, files });
    } catch (e) {
      if (e instanceof Refused) parentPort.postMessage({ refused: e.message });
      else throw e;
    }
  };
  if (kappa) await run(kappa);
  else {
    // Taking a session over: a pre-copy perhaps, then the snapshot lent.
    parentPort.on("message", async (m) => {
      if (m.prefetch) {
        try {
          parentPort.postMessage({ prefetched: await prefetch(source, m.prefetch) });
        } catch (e) {
          source.drop();
          parentPort.postMessage({ prefetchFailed: e.message });
        }
      } else if (m.resume) {
        parentPort.removeAllListeners("message");
        await run(m.resume);
      }
    });
  }
}

/** Writes in-memory directory `dir` (web/wasi.js) out to host directory `to`. */
async function writeTree(dir, to) {
  const fs = await import("node:fs");
  const { join } = await import("node:path");
  fs.mkdirSync(to, { recursive: true });
  for (const [name, node] of dir.entries) {
    const p = join(to, name);
    if (node.type === "dir") await writeTree(node, p);
    else if (node.type === "symlink") fs.symlinkSync(node.target, p);
    else {
      fs.writeFileSync(p, node.data.subarray(0, node.size), { mode: node.exec ? 0o755 : 0o644 });
      const ms = Number(node.mtime / 1000000n);
      fs.utimesSync(p, new Date(ms), new Date(ms));
    }
  }
}
