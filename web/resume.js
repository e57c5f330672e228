// Resumes a ferry snapshot in this JavaScript engine (V8 in Node or a browser tab,
// SpiderMonkey, JavaScriptCore): the verified transition of DESIGN §1.6 as a space without a
// file system does it. Resolving and Verifying fetch the closure and re-hash every object;
// Admitting checks the profile and the host contract; Restoring writes the memories, globals
// and saved stack into a fresh instance of the instrumented module and rewinds it through
// `ferry:rewind:<entry>` (crates/instrument/src/abi.rs); then the guest runs to its end.

import { capture } from "./capture.js";
import { setBits } from "./globals.js";
import * as obj from "./objects.js";
import { Refused } from "./objects.js";
import { DirNode, Exit, Fatal, FileNode, LinkNode, Wasi } from "./wasi.js";

/** Transform versions whose modules speak host contract 1 (`abi::OLDEST_COMPATIBLE..=INSTRUMENT_VERSION`). */
export const HOST_CONTRACT_VERSIONS = [14, 19];
const RUNTIME = "ferry-host/1";
const CLASSES = ["wasm-core-2+multi-memory", "wasm-core-2+multi-memory+exceptions"];
const STATE_NORMAL = 0;
const STATE_UNWIND = 1;
const STATE_REWIND = 2;
/** The suspend cell's value that asks for a checkpoint (1 asks for a suspend). */
export const CHECKPOINT = 2;
/** Deepest directory nesting a mount's tree may have (as ferry's trees). */
const MAX_TREE_DEPTH = 64;
/** Most entries all of a snapshot's trees may hold together here (all in memory). */
const MAX_TREE_ENTRIES = 1 << 20;

/** The WebAssembly specification's wording of a trap, from this engine's message. */
export function trapCause(e) {
  const m = String(e.message ?? e);
  const known = [
    [/memory access out of bounds|out of bounds memory|offset is out of bounds|index out of bounds/i, "out of bounds memory access"],
    [/unreachable/i, "unreachable"],
    [/divide by zero|division by zero/i, "integer divide by zero"],
    [/integer overflow|divide result unrepresentable/i, "integer overflow"],
    [/float unrepresentable|invalid conversion/i, "invalid conversion to integer"],
    [/table index is out of bounds|undefined element/i, "undefined element"],
    [/null function|signature mismatch|indirect call/i, "indirect call type mismatch"],
    [/call stack|stack size exceeded|too much recursion/i, "call stack exhausted"],
  ];
  for (const [re, cause] of known) if (re.test(m)) return cause;
  return m;
}

/**
 * Pre-copy: fetches and checks the closure of snapshot `kappa` (a checkpoint of a session that
 * still runs on its space) into `source`'s keeping (`SpaceSource.keep`), so that the resume
 * of a later snapshot of it fetches only what changed. Returns the bytes fetched.
 */
export async function prefetch(source, kappa) {
  source.keep();
  const before = source.fetched;
  const k = obj.parseKappa(kappa);
  const snap = await obj.snapshot(source, k);
  const state = await obj.wasiState(source, snap.wasi);
  const budget = { entries: 0 };
  await Promise.all(state.mounts.filter((m) => !m.hostBound).map((m) => materialize(source, m.tree, budget)));
  await source.get(snap.stack, 1 << 30);
  const images = await Promise.all(snap.memories.map((m) => obj.memory(source, m)));
  await Promise.all(images.map((im) => obj.getMany(source, im.chunks.map(([, c]) => c), obj.CHUNK)));
  if (snap.output) await obj.outputLogBytes(source, snap.output);
  await source.get(snap.instrumented);
  return source.fetched - before;
}

/**
 * Resumes snapshot `kappa` (`blake3:<hex>`) from `source` (a `SpaceSource`). `io`: stdout and
 * stderr (each called with a Uint8Array), progress (called with a line of text), stdin (a
 * Uint8Array, or null: end of file), realtime (a function giving ns since the epoch as BigInt),
 * suspendCell (an Int32Array over a SharedArrayBuffer: another thread stores 1 in it and
 * notifies to ask for a suspend), sink (a `SpaceSink` the snapshot is written to), onCtl
 * (given the guest's shared poll-flag memory, for another thread to raise) and history (given
 * a space session's earlier output, as records [stream, bytes], before the guest runs). A guest
 * suspended that way unwinds at its next WASI call or safe point after one (a sleep wakes at
 * once), and the result is {suspended: κ hex, sent, bytes}. With CHECKPOINT (2) in the cell
 * instead, the snapshot is written the same way and the guest goes on: onCheckpoint is called
 * with {kappa: κ hex, sent, bytes}, and the cell is 0 again.
 * Returns {code} when the guest exits, {trap} when it traps, each with `mounts` (the guest's
 * mounted directories as it left them: {guestPath, root: DirNode}); throws `Refused` when
 * the snapshot cannot be resumed here, before the guest runs.
 */
export async function resume(source, kappa, io) {
  const say = io.progress ?? (() => {});
  const k = obj.parseKappa(kappa);
  // Resolving and Verifying: every object of the closure, re-hashed on arrival.
  const snap = await obj.snapshot(source, k);
  admit(snap);
  const state = await obj.wasiState(source, snap.wasi);
  for (const m of state.mounts) {
    if (m.hostBound) throw new Refused(`mount ${m.guestPath} is passed through from a host directory (host-bound); only a space with that directory can resume it`);
  }
  const budget = { entries: 0 };
  const roots = await Promise.all(state.mounts.map((m) => materialize(source, m.tree, budget)));
  const unnamed = new Map();
  for (const [, f] of state.fds) {
    if (f.unnamed) unnamed.set(f.unnamed, await unnamedNode(source, f.unnamed, budget));
  }
  const stack = await source.get(snap.stack, 1 << 30);
  const images = await Promise.all(snap.memories.map((m) => obj.memory(source, m)));
  say(`fetching ${images.reduce((n, im) => n + im.chunks.length, 0)} memory chunks`);
  const chunks = await Promise.all(images.map(async (im) => {
    const got = await obj.getMany(source, im.chunks.map(([, c]) => c), obj.CHUNK);
    return got.map((b, j) => {
      if (b.length !== obj.CHUNK) throw new Refused(`memory chunk blake3:${im.chunks[j][1]} is ${b.length} bytes, not 65536`);
      return [im.chunks[j][0], b];
    });
  }));
  const stdin = !state.stdinInput ? io.stdin ?? null
    : state.stdinChunked ? await fileBytes(source, { mode: "file-chunks", object: state.stdinInput })
    : await source.get(state.stdinInput);
  // A space session's earlier output: shown first (`io.history`), and carried on, with what
  // follows, by a snapshot written here.
  const history = snap.output && (io.sink || io.history) ? await obj.outputLogBytes(source, snap.output) : null;
  if (history && io.history) io.history(obj.parseRecords(history));
  say(`fetching the instrumented module`);
  const code = await source.get(snap.instrumented);
  say(`verified ${(source.fetched / 1048576).toFixed(1)} MiB; compiling`);
  // What a pre-copy kept is in use now; nothing more to keep.
  source.drop?.();
  // With `ferry:ctl` shared, another thread can raise the poll flag while the guest runs.
  const shared = canShare() ? shareCtl(code) : null;
  let module;
  try {
    module = await WebAssembly.compile(shared ?? code);
  } catch (e) {
    throw new Refused(`this engine cannot compile the instrumented module: ${e.message}${/multi|memory/i.test(e.message) ? " (it needs the multi-memory proposal)" : ""}`);
  }

  // Admitting: the guest's mounts from the snapshot's trees, its descriptors, its numbers.
  const mounts = state.mounts.map((m, i) => ({ guestPath: m.guestPath, root: roots[i], readOnly: m.readOnly, dev: 0 }));
  const inodes = [];
  for (const n of state.inodes) {
    const mount = mounts[n.mount];
    if (!mount) throw new Refused(`an inode name names mount ${n.mount}, which the snapshot lacks`);
    if (n.path === "") mount.dev = n.dev;
    const node = lookup(mount.root, n.path);
    if (node && node.ino === null && !inodes.some((x) => x.ino === n.ino)) {
      node.ino = n.ino;
      inodes.push({ node, ino: n.ino });
    }
  }
  mounts.forEach((m, i) => {
    if (m.dev === 0) m.dev = 0x10000 + i;
  });
  const fds = new Map();
  for (const [n, f] of state.fds) fds.set(n, restoreFd(f, mounts, unnamed));
  const wasi = new Wasi({
    args: state.args,
    env: state.env,
    mounts,
    fds,
    monotonicNs: state.monotonicNs,
    sleepDeadlineNs: state.sleepDeadlineNs,
    stdout: io.stdout,
    stderr: io.stderr,
    stdin,
    realtime: io.realtime,
    inodes,
    stdoutBytes: state.stdoutBytes,
    stderrBytes: state.stderrBytes,
    recordOutput: history !== null && Boolean(io.sink),
    suspendCell: io.suspendCell,
  });
  wasi.stdinAt = state.stdinBytes;

  // Restoring.
  let instance;
  const startUnwind = () => {
    ex["ferry:state"].value = STATE_UNWIND;
    ex["ferry:sp"].value = 0;
    ctl()[0] = 1; // raised throughout the unwind (abi.rs)
  };
  const guest = {
    beforeCall(name) {
      const state = ex["ferry:state"].value;
      if ((name === "poll_oneoff" || name === "fd_read") && state === STATE_REWIND) {
        finishRewind();
        wasi.rewinding = true;
      } else if (state === STATE_NORMAL && wasi.suspendAsked()) {
        ctl()[0] = 1; // the next safe point unwinds
      }
    },
    startUnwind,
  };
  const finishRewind = () => {
    if (ex["ferry:sp"].value !== 0) throw new Fatal("corrupt saved stack: frames left over after the rewind reached its target");
    ex["ferry:state"].value = STATE_NORMAL;
    ctl()[0] = wasi.suspendAsked() ? 1 : 0;
  };
  const imports = {
    wasi_snapshot_preview1: wasi.imports(guest),
    ferry: {
      poll() {
        if (ex["ferry:state"].value === STATE_REWIND) finishRewind();
        else if (wasi.suspendAsked()) startUnwind();
        else {
          // Lowered, then looked at again: a suspend asked for in between (by another
          // thread that raised the flag) raises it back, so it is not lost.
          Atomics.store(ctl(), 0, 0);
          if (wasi.suspendAsked()) Atomics.store(ctl(), 0, 1);
        }
      },
    },
    host: { call: () => -1 },
  };
  try {
    instance = await WebAssembly.instantiate(module, imports);
  } catch (e) {
    throw new Refused(`cannot instantiate the instrumented module here: ${e.message}`);
  }
  const ex = instance.exports;
  const ctl = () => new Int32Array(ex["ferry:ctl"].buffer, 0, 1);
  if (shared && io.onCtl) io.onCtl(ex["ferry:ctl"].buffer);
  wasi.memory = ex.memory;
  if (!(wasi.memory instanceof WebAssembly.Memory)) throw new Refused("the module exports no `memory`");
  images.forEach((im, i) => restoreMemory(ex, i, im, chunks[i]));
  for (const g of snap.globals) setGlobal(ex, g);
  const stackMem = ex["ferry:stack"];
  if (!(stackMem instanceof WebAssembly.Memory)) throw new Refused("the module has no saved-stack memory");
  if (stack.length > stackMem.buffer.byteLength) {
    stackMem.grow(Math.ceil((stack.length - stackMem.buffer.byteLength) / 65536));
  }
  new Uint8Array(stackMem.buffer).set(stack);
  ex["ferry:sp"].value = stack.length;
  ex["ferry:state"].value = STATE_REWIND;
  ctl()[0] = 1;
  if (state.unshownStdout.length) io.stdout(state.unshownStdout);
  if (state.unshownStderr.length) io.stderr(state.unshownStderr);

  const entries = (snap.main === null ? ["ferry:start", "_start"] : ["ferry:start", "_initialize", snap.main])
    .filter((n) => typeof ex[n] === "function");
  let phase = entries.indexOf(snap.entry);
  if (phase < 0) throw new Refused(`the snapshot was taken in \`${snap.entry}\`, which the module does not export`);
  say(`restored; the guest runs`);
  let rewinding = true;
  // What the next snapshot written here goes on from.
  let parent = k;
  try {
    let result;
    for (; phase < entries.length; phase++) {
      const name = rewinding ? `ferry:rewind:${entries[phase]}` : entries[phase];
      if (typeof ex[name] !== "function") throw new Refused(`\`${entries[phase]}\` has no rewind copy`);
      result = ex[name]();
      if (ex["ferry:state"].value === STATE_REWIND) throw new Fatal("corrupt saved stack: the rewind never reached its call site");
      if (ex["ferry:state"].value === STATE_UNWIND) {
        if (!io.sink) throw new Fatal("the guest unwound, and there is nowhere to write its snapshot");
        // 2 in the cell asks for a checkpoint: the snapshot is written and the guest goes on.
        const checkpoint = io.suspendCell && Atomics.load(io.suspendCell, 0) === CHECKPOINT;
        say(`the guest unwound; writing its ${checkpoint ? "checkpoint" : "snapshot"}`);
        const written = capture({ ex, wasi, snap, state, entry: entries[phase], history, parent });
        say(`pushing ${written.objects.size} objects`);
        const sent = await io.sink.push(written.kappa, written.objects);
        if (!checkpoint) return { suspended: written.kappa, ...sent, mounts };
        // Rewound from where it unwound, as a resume would: the saved stack is in place, a
        // sleep it was in keeps its deadline. A suspend asked for meanwhile stays asked.
        parent = written.kappa;
        Atomics.compareExchange(io.suspendCell, 0, CHECKPOINT, 0);
        wasi.sleepDeadline = wasi.suspendedSleep;
        wasi.suspendedSleep = null;
        ex["ferry:state"].value = STATE_REWIND;
        ctl()[0] = 1;
        if (io.onCheckpoint) io.onCheckpoint({ kappa: written.kappa, ...sent });
        rewinding = true;
        phase--;
        continue;
      }
      rewinding = false;
    }
    return { code: typeof result === "number" ? result : 0, mounts };
  } catch (e) {
    if (e instanceof Exit) return { code: e.code, mounts };
    if (e instanceof WebAssembly.RuntimeError || e instanceof RangeError) return { trap: trapCause(e), mounts };
    throw e;
  }
}

/** Whether this engine can make a memory shared (SharedArrayBuffer; a browser page only when cross-origin isolated). */
function canShare() {
  if (typeof SharedArrayBuffer === "undefined") return false;
  return typeof crossOriginIsolated === "undefined" || crossOriginIsolated;
}

/**
 * The module with its `ferry:ctl` memory made shared (`(memory 1 1)` → `(memory 1 1
 * shared)`: one flag byte, nothing moves), so that a thread other than the guest's can raise
 * the poll flag while the guest computes — the time to a safe point is then bounded by the
 * guest's polls, as natively. Null when the module is not as the transform makes it (the
 * resume then goes on with a suspend seen at the guest's next WASI call).
 */
export function shareCtl(code) {
  try {
    const r = { at: 8 };
    const leb = () => {
      let x = 0;
      let shift = 0;
      for (;;) {
        const b = code[r.at++];
        x += (b & 0x7f) * 2 ** shift;
        shift += 7;
        if ((b & 0x80) === 0) return x;
        if (shift > 35) throw new Error("LEB128 too long");
      }
    };
    const sections = new Map();
    while (r.at < code.length) {
      const id = code[r.at++];
      const size = leb();
      if (!sections.has(id)) sections.set(id, r.at);
      r.at += size;
    }
    const name = () => {
      const n = leb();
      const s = new TextDecoder().decode(code.subarray(r.at, r.at + n));
      r.at += n;
      return s;
    };
    let importedMemories = 0;
    if (sections.has(2)) {
      r.at = sections.get(2);
      for (let n = leb(); n > 0; n--) {
        name();
        name();
        if (code[r.at++] !== 0) return null; // ferry's modules import functions only
        leb();
      }
    }
    let ctl = -1;
    r.at = sections.get(7);
    for (let n = leb(); n > 0; n--) {
      const field = name();
      const kind = code[r.at++];
      const index = leb();
      if (field === "ferry:ctl" && kind === 2) ctl = index - importedMemories;
    }
    if (ctl < 0 || !sections.has(5)) return null;
    r.at = sections.get(5);
    const count = leb();
    for (let i = 0; i < count; i++) {
      const flagAt = r.at;
      const flags = code[r.at++];
      leb();
      if (flags & 1) leb();
      if (i === ctl) {
        if (flags !== 0x01) return null;
        const out = code.slice();
        out[flagAt] = 0x03;
        return out;
      }
    }
    return null;
  } catch {
    return null;
  }
}

function admit(snap) {
  const p = snap.profile;
  if (p.runtime !== RUNTIME) throw new Refused(`the snapshot needs runtime \`${p.runtime}\`; this space provides ${RUNTIME}`);
  if (!CLASSES.includes(p.engineClass)) throw new Refused(`the snapshot needs engine class \`${p.engineClass}\`; this space provides ${CLASSES.join(", ")}`);
  if (p.hostBound) throw new Refused("the snapshot is host-bound (a directory passed through with --bind): only a space with that directory can resume it");
  const [lo, hi] = HOST_CONTRACT_VERSIONS;
  if (snap.instrumentVersion < lo || snap.instrumentVersion > hi) {
    throw new Refused(`the snapshot's module was made by transform version ${snap.instrumentVersion}; this space speaks the host contract of versions ${lo} to ${hi}`);
  }
}

function restoreMemory(ex, i, image, chunks) {
  const mem = ex[`ferry:memory:${i}`];
  if (!(mem instanceof WebAssembly.Memory)) throw new Refused(`module has no memory ${i}`);
  const cur = mem.buffer.byteLength;
  if (image.len < cur) throw new Refused(`memory ${i} of the snapshot is smaller (${image.len}) than the instance's (${cur})`);
  if (image.len > cur) {
    try {
      mem.grow((image.len - cur) / obj.CHUNK);
    } catch (e) {
      throw new Refused(`memory ${i}: cannot grow to ${image.len} bytes here: ${e.message}`);
    }
  }
  const data = new Uint8Array(mem.buffer);
  // Data segments were applied at instantiation: what the snapshot lists not is zero.
  data.fill(0, 0, cur);
  for (const [index, bytes] of chunks) data.set(bytes, index * obj.CHUNK);
}

function setGlobal(ex, g) {
  const global = ex[`ferry:global:${g.index}`];
  if (!(global instanceof WebAssembly.Global)) throw new Refused(`module has no global ${g.index}`);
  const need = { i32: 4, i64: 8, f32: 4, f64: 8, v128: 16 }[g.ty];
  if (need === undefined || g.bits.length !== need) throw new Refused(`global ${g.index} has a malformed value`);
  const v = new DataView(g.bits.buffer, g.bits.byteOffset, need);
  try {
    if (g.ty === "i32") global.value = v.getInt32(0, true);
    else if (g.ty === "i64") global.value = v.getBigInt64(0, true);
    // Floats and vectors through WebAssembly itself (globals.js).
    else setBits(global, g.ty, g.bits);
  } catch (e) {
    throw new Refused(`global ${g.index}: ${e.message}`);
  }
}

/** The in-memory directory written from tree `k`, its files' bytes fetched and checked. */
async function materialize(source, k, budget) {
  const root = new DirNode(null, 0n);
  const links = [];
  await fill(source, k, root, "", 0, budget, links);
  // Hard links: each `link` entry names the path of a file held earlier in the tree.
  for (const { dir, name, target } of links) {
    const node = lookup(root, target);
    if (!node || node.type !== "file") throw new Refused(`tree link \`${name}\` names \`${target}\`, which the tree does not hold as a file`);
    dir.entries.set(name, node);
    node.nlink++;
  }
  return root;
}

async function fill(source, k, dir, path, depth, budget, links) {
  if (depth > MAX_TREE_DEPTH) throw new Refused(`a mount's tree nests deeper than ${MAX_TREE_DEPTH} levels`);
  const entries = await obj.tree(source, k);
  budget.entries += entries.length;
  if (budget.entries > MAX_TREE_ENTRIES) throw new Refused(`the snapshot's trees hold over ${MAX_TREE_ENTRIES} entries, more than this space keeps in memory`);
  await Promise.all(entries.map(async (e) => {
    const mtime = e.mtimeNs ?? 0n;
    const at = path ? `${path}/${e.name}` : e.name;
    switch (e.mode) {
      case "dir": {
        const sub = new DirNode(dir, mtime);
        dir.entries.set(e.name, sub);
        await fill(source, e.object, sub, at, depth + 1, budget, links);
        break;
      }
      case "symlink": {
        const t = new TextDecoder().decode(await source.get(e.object, 4096));
        dir.entries.set(e.name, new LinkNode(t, mtime));
        break;
      }
      case "link": {
        const t = new TextDecoder().decode(await source.get(e.object, 4096));
        if (t.startsWith("/") || t.split("/").includes("..")) throw new Refused(`tree link \`${at}\` names an unsafe path`);
        links.push({ dir, name: e.name, target: t });
        break;
      }
      default: {
        const node = new FileNode(await fileBytes(source, e), mtime);
        node.exec = e.mode.startsWith("exec");
        node.nlink = 1;
        dir.entries.set(e.name, node);
      }
    }
  }));
}

async function fileBytes(source, e) {
  if (!e.mode.endsWith("-chunks")) return source.get(e.object, 1 << 20);
  const f = await obj.fileChunks(source, e.object);
  if (f.len > 1 << 30) throw new Refused(`a mounted file of ${f.len} bytes is more than this space keeps in memory (1 GiB)`);
  const data = new Uint8Array(f.len);
  await Promise.all(f.chunks.map(async (c, i) => {
    const piece = await source.get(c, 1 << 20);
    const want = Math.min(1 << 20, f.len - i * (1 << 20));
    if (piece.length !== want) throw new Refused(`a piece of a chunked file has ${piece.length} bytes, not ${want}`);
    data.set(piece, i * (1 << 20));
  }));
  return data;
}

async function unnamedNode(source, k, budget) {
  const dir = new DirNode(null, 0n);
  await fill(source, k, dir, "", 0, budget, []);
  const only = [...dir.entries.values()];
  if (only.length === 0) {
    const gone = new DirNode(null, 0n);
    gone.removed = true;
    return gone;
  }
  if (only.length !== 1 || only[0].type !== "file") throw new Refused("an unnamed descriptor's tree is not one file");
  only[0].nlink = 0;
  return only[0];
}

/** Walks mount-relative `path` without following links; undefined if absent. */
function lookup(root, path) {
  let node = root;
  for (const seg of path.split("/").filter((s) => s !== "")) {
    if (!node || node.type !== "dir") return undefined;
    node = node.entries.get(seg);
  }
  return node;
}

function restoreFd(f, mounts, unnamed) {
  const base = { kind: f.what, mount: f.mount, path: f.path, offset: f.offset, fdflags: f.fdflags, read: f.read, write: f.write };
  if (["stdin", "stdout", "stderr"].includes(f.what)) return base;
  const mount = mounts[f.mount];
  if (!mount) throw new Refused(`a descriptor names mount ${f.mount}, which the snapshot lacks`);
  const node = f.unnamed ? unnamed.get(f.unnamed) : lookup(mount.root, f.path);
  if (!node) throw new Refused(`a descriptor was open on \`${mount.guestPath}/${f.path}\`, which the snapshot's tree does not hold`);
  const want = f.what === "file" ? "file" : "dir";
  if (!["preopen", "dir", "file"].includes(f.what)) throw new Refused(`a descriptor of unknown kind \`${f.what}\``);
  if (node.type !== want) throw new Refused(`a descriptor was open on \`${mount.guestPath}/${f.path}\` as a ${want}, and the tree holds something else there`);
  return { ...base, node };
}
