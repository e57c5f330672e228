// A snapshot written by the JavaScript space: once the guest has unwound (DESIGN §1.3), its
// memories, globals, saved stack and WASI state become ferry's objects (docs/format.md),
// encoded canonically, so that a native ferry — or this space again — verifies and resumes
// them like any other. `capture` builds the objects; `SpaceSink` sends those the space lacks
// and has the space verify the closure and name the snapshot.

import { blake3, fromHex, hex } from "./blake3.js";
import { encode } from "./cbor.js";
import { getBits } from "./globals.js";
import { CHUNK, Refused, spaceRequest } from "./objects.js";
import { byName } from "./wasi.js";

const FILE_CHUNK = 1 << 20;
/** As `ferry_object::UNNAMED_ENTRY`: the one entry of a tree holding a file no path names. */
const UNNAMED_ENTRY = "content";
/** As ferry: at most this many inode names are kept. */
const MAX_INODES = 100000;

/** The objects of one snapshot being written: κ hex → bytes. */
class Objects {
  constructor() {
    this.map = new Map();
  }
  put(bytes) {
    const k = hex(blake3(bytes));
    if (!this.map.has(k)) this.map.set(k, bytes);
    return fromHex(k);
  }
  object(value) {
    return this.put(encode(value));
  }
}

/**
 * Captures the unwound guest. `g`: {ex (the instance's exports), wasi (web/wasi.js), snap
 * (the snapshot it was resumed from), state (that snapshot's `ferry.wasi`), entry (the export
 * it unwound out of), history (its output log's bytes, for a space session), parent (κ hex)}.
 * Returns {kappa (hex), objects (Map κ hex → bytes)}.
 */
export function capture(g) {
  const objs = new Objects();
  const { ex, wasi, snap, state } = g;
  const memories = [];
  for (let i = 0; ; i++) {
    const mem = ex[`ferry:memory:${i}`];
    if (!(mem instanceof WebAssembly.Memory)) break;
    memories.push(objs.object(memoryImage(new Uint8Array(mem.buffer), objs)));
  }
  const globals = [];
  for (const name of Object.keys(ex)) {
    if (!name.startsWith("ferry:global:")) continue;
    const index = Number(name.slice("ferry:global:".length));
    const known = snap.globals.find((x) => x.index === index);
    if (!known) throw new Refused(`global ${index} is not one the snapshot named: cannot tell its type`);
    globals.push({ index, ty: known.ty, bits: getBits(ex[name], known.ty) });
  }
  globals.sort((a, b) => a.index - b.index);
  const sp = ex["ferry:sp"].value >>> 0;
  const stack = new Uint8Array(ex["ferry:stack"].buffer, 0, sp).slice();

  const trees = wasi.mounts.map((m) => treeOf(m.root, "", new Map(), objs));
  const paths = wasi.mounts.map((m) => pathsOf(m.root));
  const fds = [];
  for (const [n, f] of [...wasi.fds].sort(([a], [b]) => a - b)) {
    const base = state.fds.find(([m]) => m === n)?.[1];
    let path = "";
    let unnamed;
    if (f.node) {
      path = paths[f.mount].get(f.node);
      if (path === undefined) {
        // No path names it any more: deleted (or replaced by a rename) while open.
        path = f.path ?? base?.path ?? "";
        unnamed = f.node.type === "file" ? objs.object(unnamedTree(f.node, objs)) : objs.object(tree({}));
      }
    }
    fds.push([n, {
      what: f.kind,
      mount: f.mount,
      path,
      offset: f.kind === "file" ? f.offset : 0,
      fdflags: f.fdflags,
      read: f.read,
      write: f.write,
      unnamed,
    }]);
  }
  const inodes = [];
  // What the guest asked about (a stat), what it holds open, and what the snapshot kept.
  const asked = new Set(wasi.asked);
  for (const f of wasi.fds.values()) if (f.node) asked.add(f.node);
  wasi.mounts.forEach((m, i) => {
    for (const node of asked) {
      const p = paths[i].get(node);
      if (p !== undefined && node.ino !== null) inodes.push({ mount: i, path: p, dev: m.dev, ino: node.ino });
    }
    if (!asked.has(m.root)) inodes.push({ mount: i, path: "", dev: m.dev, ino: wasi.ino(m.root) });
  });
  inodes.sort((a, b) => a.mount - b.mount || byName(a.path, b.path));
  const wasiState = {
    kind: "ferry.wasi",
    v: 1,
    args: state.args,
    env: state.env,
    mounts: wasi.mounts.map((m, i) => ({
      guest_path: m.guestPath,
      host_hint: state.mounts[i].hostHint,
      tree: trees[i],
      read_only: m.readOnly,
      not_carried: state.mounts[i].notCarried.length ? state.mounts[i].notCarried : undefined,
    })),
    fds,
    monotonic_ns: wasi.monotonicNs(),
    stdout_bytes: wasi.shown[0],
    stderr_bytes: wasi.shown[1],
    stdin_bytes: wasi.stdinAt,
    sleep_deadline_ns: wasi.suspendedSleep,
    stdin_input: state.stdinInput ? fromHex(state.stdinInput) : undefined,
    stdin_chunked: state.stdinChunked || undefined,
    inodes: inodes.length ? inodes.slice(0, MAX_INODES) : undefined,
  };
  let output;
  if (g.history) output = objs.object(outputLog(g.history, wasi.records, objs));
  const snapshot = {
    kind: "ferry.snapshot",
    v: 1,
    program: snap.program,
    module: fromHex(snap.module),
    instrumented: fromHex(snap.instrumented),
    instrument_version: snap.instrumentVersion,
    memories,
    globals,
    stack: objs.put(stack),
    entry: g.entry,
    wasi: objs.object(wasiState),
    profile: {
      runtime: snap.profile.runtime,
      engine_class: snap.profile.engineClass,
      capabilities: snap.profile.capabilities,
      host_bound: false,
    },
    parent: fromHex(g.parent),
    generation: snap.generation + 1,
    output,
    main: snap.main ?? undefined,
  };
  const k = hex(objs.object(snapshot));
  return { kappa: k, objects: objs.map };
}

function memoryImage(data, objs) {
  const chunks = [];
  const words = new BigUint64Array(data.buffer, data.byteOffset, data.length / 8);
  for (let i = 0; i < data.length / CHUNK; i++) {
    let zero = true;
    for (let w = (i * CHUNK) / 8, end = ((i + 1) * CHUNK) / 8; w < end; w++) {
      if (words[w] !== 0n) {
        zero = false;
        break;
      }
    }
    if (!zero) chunks.push([i, objs.put(data.slice(i * CHUNK, (i + 1) * CHUNK))]);
  }
  return { kind: "ferry.memory", v: 1, len: data.length, chunk_size: CHUNK, chunks };
}

function tree(entries) {
  const es = Object.values(entries);
  const v = es.some((e) => e.mode === "link") ? 4 : es.some((e) => e.mtime_ns !== undefined) ? 3 : es.some((e) => e.mode.endsWith("-chunks")) ? 2 : 1;
  return { kind: "ferry.tree", v, entries: new Map(Object.entries(entries)) };
}

/** A file's entry: its content as one blob up to 1 MiB, else a `ferry.file` of 1 MiB pieces. */
function fileEntry(node, objs, exec) {
  const data = node.data.subarray(0, node.size);
  if (node.size <= FILE_CHUNK) return { mode: exec ? "exec" : "file", object: objs.put(data.slice()), mtime_ns: node.mtime };
  const chunks = [];
  for (let at = 0; at < node.size; at += FILE_CHUNK) chunks.push(objs.put(data.slice(at, Math.min(node.size, at + FILE_CHUNK))));
  const file = { kind: "ferry.file", v: 1, len: node.size, chunk_size: FILE_CHUNK, chunks };
  return { mode: exec ? "exec-chunks" : "file-chunks", object: objs.object(file), mtime_ns: node.mtime };
}

/**
 * The tree of `dir` (κ bytes): names in ferry's order, depth first; a file met again (hard
 * links) is a `link` to the path it was first met at.
 */
function treeOf(dir, path, first, objs) {
  const entries = {};
  const enc = new TextEncoder();
  for (const name of [...dir.entries.keys()].sort(byName)) {
    const node = dir.entries.get(name);
    const at = path ? `${path}/${name}` : name;
    if (node.type === "dir") entries[name] = { mode: "dir", object: treeOf(node, at, first, objs) };
    else if (node.type === "symlink") entries[name] = { mode: "symlink", object: objs.put(enc.encode(node.target)) };
    else if (first.has(node)) entries[name] = { mode: "link", object: objs.put(enc.encode(first.get(node))) };
    else {
      first.set(node, at);
      entries[name] = fileEntry(node, objs, node.exec);
    }
  }
  return objs.object(tree(entries));
}

function unnamedTree(node, objs) {
  return tree({ [UNNAMED_ENTRY]: fileEntry(node, objs, false) });
}

/** Every node of the mount under `root`, by the first path that names it ("" for the root). */
function pathsOf(root) {
  const out = new Map([[root, ""]]);
  const walk = (dir, path) => {
    for (const name of [...dir.entries.keys()].sort(byName)) {
      const node = dir.entries.get(name);
      const at = path ? `${path}/${name}` : name;
      if (!out.has(node)) out.set(node, at);
      if (node.type === "dir") walk(node, at);
    }
  };
  walk(root, "");
  return out;
}

/**
 * The guest's mounts as it left them (`mounts`: resume()'s {guestPath, root}), as ferry's
 * trees: {objects (Map κ hex → bytes), trees: [{guest, tree: "blake3:…"}]} — what a session
 * taken over from a space gives back as its final files.
 */
export function mountTrees(mounts) {
  const objs = new Objects();
  const trees = mounts.map((m) => ({ guest: m.guestPath, tree: `blake3:${hex(treeOf(m.root, "", new Map(), objs))}` }));
  return { objects: objs.map, trees };
}

/** A space session's output log: what it had, and the records written since, in 64 KiB chunks. */
function outputLog(history, records, objs) {
  const extra = records.reduce((n, [, b]) => n + 5 + b.length, 0);
  const all = new Uint8Array(history.length + extra);
  all.set(history);
  let at = history.length;
  for (const [stream, bytes] of records) {
    all[at] = stream;
    new DataView(all.buffer).setUint32(at + 1, bytes.length, true);
    all.set(bytes, at + 5);
    at += 5 + bytes.length;
  }
  const chunks = [];
  for (let i = 0; i < all.length; i += CHUNK) chunks.push(objs.put(all.slice(i, Math.min(all.length, i + CHUNK))));
  return { kind: "ferry.log", v: 1, len: all.length, chunk_size: CHUNK, chunks };
}

/** Sends a snapshot's objects to a space and has it verify and name the snapshot. */
export class SpaceSink {
  constructor(base, token) {
    this.base = base.replace(/\/+$/, "");
    this.token = token;
  }

  async call(method, path, body) {
    const r = await spaceRequest(this.base, this.token, method, path, body, `${method} ${path}`);
    return new Uint8Array(await r.arrayBuffer());
  }

  /** Sends what the space lacks of `objects`, then names snapshot `kappa`. Returns {sent, bytes}. */
  async push(kappa, objects) {
    const sent = await this.send(objects);
    await this.call("POST", `/v1/snapshots/blake3:${kappa}`, new Uint8Array(0));
    return sent;
  }

  /** Sends what the space lacks of `objects` (each verified there on receipt). Returns {sent, bytes}. */
  async send(objects) {
    const all = [...objects.keys()];
    const missing = [];
    for (let i = 0; i < all.length; i += 1 << 16) {
      const ask = new Uint8Array(32 * Math.min(1 << 16, all.length - i));
      all.slice(i, i + (1 << 16)).forEach((k, j) => ask.set(fromHex(k), 32 * j));
      const lack = await this.call("POST", "/v1/objects/missing", ask);
      for (let j = 0; j < lack.length; j += 32) missing.push(hex(lack.subarray(j, j + 32)));
    }
    let bytes = 0;
    for (let i = 0; i < missing.length; ) {
      // Batches of about 16 MiB: [32] κ, u8 codec (0: raw), u64 length, u64 stored length, bytes.
      const batch = [];
      let size = 0;
      while (i < missing.length && (batch.length === 0 || size < 16 << 20)) {
        const b = objects.get(missing[i]);
        batch.push([missing[i], b]);
        size += 49 + b.length;
        i++;
      }
      const body = new Uint8Array(size);
      const view = new DataView(body.buffer);
      let at = 0;
      for (const [k, b] of batch) {
        body.set(fromHex(k), at);
        body[at + 32] = 0;
        view.setBigUint64(at + 33, BigInt(b.length), true);
        view.setBigUint64(at + 41, BigInt(b.length), true);
        body.set(b, at + 49);
        at += 49 + b.length;
      }
      await this.call("POST", "/v1/objects", body);
      bytes += size;
    }
    return { sent: missing.length, bytes };
  }
}
