// ferry's objects as a JavaScript space reads them (docs/format.md): fetched by κ from a
// space over its HTTP API, each re-hashed before it is used, decoded strictly, every kind and
// version checked, unknown fields refused, every count bounded — a snapshot from a peer is
// untrusted here as in ferry itself.

import { blake3, fromHex, hex } from "./blake3.js";
import { decode } from "./cbor.js";

/** A snapshot this space cannot resume, and why (what a user can act on). */
export class Refused extends Error {}

const KAPPA = /^blake3:([0-9a-f]{64})$/;

/** The 64 hex digits of `blake3:<hex>`; refused otherwise. */
export function parseKappa(text) {
  const m = KAPPA.exec(String(text).trim());
  if (!m) throw new Refused(`\`${text}\` is not a full κ (blake3: and 64 lower-case hex digits)`);
  return m[1];
}

const kappaOf = (bytes, what) => {
  if (!(bytes instanceof Uint8Array) || bytes.length !== 32) {
    throw new Refused(`${what} is not a κ (32 bytes)`);
  }
  return hex(bytes);
};

/**
 * `method path` on the space at `base` with its bearer token, refused with the reason when the
 * space cannot be reached or does not answer 2xx: `what` names the request in the message,
 * `missing` (if given) is the whole message for a 404.
 */
export async function spaceRequest(base, token, method, path, body, what, missing) {
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  if (body) headers["Content-Type"] = typeof body === "string" ? "application/json" : "application/octet-stream";
  let r;
  try {
    r = await fetch(`${base}${path}`, { method, headers, body });
  } catch (e) {
    throw new Refused(`cannot reach the space at ${base}: ${e.cause?.message ?? e.message}`);
  }
  if (r.ok) return r;
  const text = (await r.text()).trim();
  if (r.status === 404 && missing) throw new Refused(missing(text));
  if (r.status === 401) throw new Refused(`the space refused the token (401): ${text}`);
  throw new Refused(`the space answered ${r.status} to ${what}: ${text}`);
}

/** Objects from a ferry space (`ferry serve`): `GET /v1/objects/{κ}` with its bearer token. */
export class SpaceSource {
  constructor(base, token, { concurrency = 16 } = {}) {
    this.base = base.replace(/\/+$/, "");
    this.token = token;
    this.slots = concurrency;
    this.waiting = [];
    this.fetched = 0;
    /** Objects kept once checked (κ hex → bytes), while `keep()` is on: a pre-copy. */
    this.cache = null;
  }

  /** Keeps every object fetched from now on, so a later resume fetches only what it lacks. */
  keep() {
    this.cache ??= new Map();
  }

  /** Stops keeping objects, and frees those kept. */
  drop() {
    this.cache = null;
  }

  /** The kept object `k`, if there is one (of at most `max` bytes). */
  kept(k, max) {
    const b = this.cache?.get(k);
    if (b !== undefined && b.length > max) throw new Refused(`object blake3:${k} is ${b.length} bytes, over the ${max} allowed for it`);
    return b;
  }

  async slot() {
    if (this.slots > 0) {
      this.slots--;
      return;
    }
    await new Promise((ok) => this.waiting.push(ok));
  }
  release() {
    const next = this.waiting.shift();
    if (next) next();
    else this.slots++;
  }

  /** Up to 256 objects in one request (see `getMany`). */
  async fetchBatch(ks, max) {
    await this.slot();
    try {
      const ask = new Uint8Array(32 * ks.length);
      ks.forEach((k, i) => ask.set(fromHex(k), 32 * i));
      const r = await spaceRequest(this.base, this.token, "POST", "/v1/objects/fetch?codec=raw", ask, "a fetch",
        (text) => `the space lacks an object of the snapshot: ${text}`);
      const body = new Uint8Array(await r.arrayBuffer());
      const view = new DataView(body.buffer, body.byteOffset, body.length);
      const out = [];
      let at = 0;
      for (const k of ks) {
        // [32] κ, u8 codec, u64 length, u64 stored length, stored bytes
        if (at + 49 > body.length) throw new Refused("the space's answer to a fetch is cut short");
        const got = hex(body.subarray(at, at + 32));
        const codec = body[at + 32];
        const len = Number(view.getBigUint64(at + 33, true));
        const stored = Number(view.getBigUint64(at + 41, true));
        if (got !== k) throw new Refused("the space answered a fetch with other objects than asked");
        if (codec !== 0 || stored !== len) throw new Refused(`object blake3:${k} came compressed, though asked for raw`);
        if (len > max || at + 49 + len > body.length) throw new Refused(`object blake3:${k} is too large or cut short`);
        const bytes = body.subarray(at + 49, at + 49 + len);
        if (hex(blake3(bytes)) !== k) throw new Refused(`object blake3:${k} does not hash to its κ (corrupt in transit or in the space)`);
        this.fetched += len;
        this.cache?.set(k, bytes);
        out.push(bytes);
        at += 49 + len;
      }
      if (at !== body.length) throw new Refused("the space's answer to a fetch has bytes after the objects asked");
      return out;
    } finally {
      this.release();
    }
  }

  /** The bytes of object `k` (hex), checked against their κ; at most `max` bytes. */
  async get(k, max = 1 << 30) {
    const had = this.kept(k, max);
    if (had !== undefined) return had;
    await this.slot();
    try {
      const r = await spaceRequest(this.base, this.token, "GET", `/v1/objects/blake3:${k}`, undefined, `blake3:${k}`,
        () => `object blake3:${k} is missing from the space`);
      // A browser decodes the zstd it asked for itself; Node does not ask for it.
      const bytes = new Uint8Array(await r.arrayBuffer());
      if (bytes.length > max) throw new Refused(`object blake3:${k} is ${bytes.length} bytes, over the ${max} allowed for it`);
      if (hex(blake3(bytes)) !== k) {
        const coded = r.headers.get("content-encoding");
        throw new Refused(`object blake3:${k} does not hash to its κ (corrupt in transit or in the space${coded ? `, or sent as ${coded}, which this engine did not decode` : ""})`);
      }
      this.fetched += bytes.length;
      this.cache?.set(k, bytes);
      return bytes;
    } finally {
      this.release();
    }
  }
}

/**
 * Objects `ks` (hex) of at most `max` bytes each, in the order asked, each checked against its
 * κ: 256 to a request (`POST /v1/objects/fetch?codec=raw`), a few requests in flight — what
 * a snapshot's thousands of memory chunks need. `source.get` one by one for another source.
 */
export async function getMany(source, ks, max) {
  if (!(source instanceof SpaceSource)) return Promise.all(ks.map((k) => source.get(k, max)));
  // What a pre-copy kept is not fetched again.
  const out = ks.map((k) => source.kept(k, max));
  const todo = [];
  out.forEach((b, i) => {
    if (b === undefined) todo.push(i);
  });
  const parts = [];
  for (let i = 0; i < todo.length; i += 256) {
    const at = todo.slice(i, i + 256);
    parts.push(source.fetchBatch(at.map((j) => ks[j]), max).then((got) => got.forEach((b, n) => (out[at[n]] = b))));
  }
  await Promise.all(parts);
  return out;
}

/** Objects held in memory (tests, and a page that was handed them): `Map` hex → bytes. */
export class MapSource {
  constructor(map) {
    this.map = map;
    this.fetched = 0;
  }
  async get(k) {
    const bytes = this.map.get(k);
    if (!bytes) throw new Refused(`object blake3:${k} is missing`);
    if (hex(blake3(bytes)) !== k) throw new Refused(`object blake3:${k} does not hash to its κ`);
    this.fetched += bytes.length;
    return bytes;
  }
}

const MAX_STRUCTURED = 64 << 20;

/** Decodes a structured object of `kind`, version in `versions`, with exactly the fields allowed. */
function structured(bytes, k, kind, versions, required, optional = []) {
  let m;
  try {
    m = decode(bytes);
  } catch (e) {
    throw new Refused(`object blake3:${k} is not a valid ${kind}: ${e.message}`);
  }
  if (!(m instanceof Map)) throw new Refused(`object blake3:${k} is not a ${kind}`);
  if (m.get("kind") !== kind) throw new Refused(`object blake3:${k} is a \`${m.get("kind")}\`, not a \`${kind}\``);
  const v = m.get("v");
  if (!versions.includes(v)) {
    throw new Refused(`\`${kind}\` object has format version ${v}; this space reads version ${versions.join(", ")}`);
  }
  const allowed = new Set(["kind", "v", ...required, ...optional]);
  for (const key of m.keys()) {
    if (!allowed.has(key)) throw new Refused(`\`${kind}\` object has an unknown field \`${key}\``);
  }
  for (const key of required) {
    if (!m.has(key)) throw new Refused(`\`${kind}\` object lacks the field \`${key}\``);
  }
  return m;
}

function fieldsOf(m, what, required, optional = []) {
  if (!(m instanceof Map)) throw new Refused(`${what} is not a map`);
  const allowed = new Set([...required, ...optional]);
  for (const key of m.keys()) if (!allowed.has(key)) throw new Refused(`${what} has an unknown field \`${key}\``);
  for (const key of required) if (!m.has(key)) throw new Refused(`${what} lacks \`${key}\``);
  return m;
}

const uint = (x, what) => {
  if (typeof x === "number" && Number.isInteger(x) && x >= 0) return x;
  if (typeof x === "bigint" && x >= 0n) return x;
  throw new Refused(`${what} is not an unsigned integer`);
};
const text = (x, what) => {
  if (typeof x !== "string") throw new Refused(`${what} is not text`);
  return x;
};
const list = (x, what, max) => {
  if (!Array.isArray(x)) throw new Refused(`${what} is not a list`);
  if (x.length > max) throw new Refused(`${what} has ${x.length} entries, over ${max}`);
  return x;
};

export async function snapshot(source, k) {
  const m = structured(await source.get(k, MAX_STRUCTURED), k, "ferry.snapshot", [1],
    ["program", "module", "instrumented", "instrument_version", "memories", "globals", "stack",
      "entry", "wasi", "profile", "parent", "generation"], ["output", "main"]);
  const profile = fieldsOf(m.get("profile"), "the snapshot's profile", ["runtime", "engine_class", "capabilities", "host_bound"]);
  return {
    kappa: k,
    program: text(m.get("program"), "program"),
    module: kappaOf(m.get("module"), "module"),
    instrumented: kappaOf(m.get("instrumented"), "instrumented"),
    instrumentVersion: uint(m.get("instrument_version"), "instrument_version"),
    memories: list(m.get("memories"), "memories", 16).map((x) => kappaOf(x, "a memory")),
    globals: list(m.get("globals"), "globals", 1 << 20).map((g) => {
      const f = fieldsOf(g, "a global", ["index", "ty", "bits"]);
      const bits = f.get("bits");
      if (!(bits instanceof Uint8Array)) throw new Refused("a global's bits are not bytes");
      return { index: uint(f.get("index"), "a global's index"), ty: text(f.get("ty"), "a global's type"), bits };
    }),
    stack: kappaOf(m.get("stack"), "stack"),
    entry: text(m.get("entry"), "entry"),
    wasi: kappaOf(m.get("wasi"), "wasi"),
    profile: {
      runtime: text(profile.get("runtime"), "runtime"),
      engineClass: text(profile.get("engine_class"), "engine_class"),
      capabilities: list(profile.get("capabilities"), "capabilities", 1024).map((c) => text(c, "a capability")),
      hostBound: profile.get("host_bound") === true,
    },
    main: m.has("main") ? text(m.get("main"), "main") : null,
    generation: Number(uint(m.get("generation"), "generation")),
    output: m.has("output") ? kappaOf(m.get("output"), "output") : null,
  };
}

export const CHUNK = 65536;

export async function memory(source, k) {
  const m = structured(await source.get(k, MAX_STRUCTURED), k, "ferry.memory", [1], ["len", "chunk_size", "chunks"]);
  const len = uint(m.get("len"), "a memory's len");
  if (typeof len !== "number" || len % CHUNK !== 0 || len > 2 ** 32) throw new Refused(`a memory's length ${len} is not a multiple of 65536 up to 4 GiB`);
  if (m.get("chunk_size") !== CHUNK) throw new Refused(`a memory's chunk size is ${m.get("chunk_size")}, not 65536`);
  let prev = -1;
  const chunks = list(m.get("chunks"), "a memory's chunks", len / CHUNK).map((e) => {
    const [i, c] = list(e, "a memory chunk", 2);
    const index = uint(i, "a chunk index");
    if (index <= prev || index >= len / CHUNK) throw new Refused("a memory's chunks are out of order or past its length");
    prev = index;
    return [index, kappaOf(c, "a chunk")];
  });
  return { len, chunks };
}

export async function wasiState(source, k) {
  const m = structured(await source.get(k, MAX_STRUCTURED), k, "ferry.wasi", [1],
    ["args", "env", "mounts", "fds", "monotonic_ns", "stdout_bytes", "stderr_bytes", "stdin_bytes", "sleep_deadline_ns"],
    ["unshown_stdout", "unshown_stderr", "stdin_input", "stdin_open", "stdin_chunked", "inodes"]);
  if (m.get("stdin_open") === true) {
    throw new Refused("the guest reads input sent to its interactive session while it runs, which this " +
      "JavaScript space cannot give it: resume it with a native ferry (`ferry resume`, or a space)");
  }
  const bytesOr = (key) => {
    const b = m.get(key);
    if (b === undefined) return new Uint8Array(0);
    if (!(b instanceof Uint8Array) || b.length > 1 << 20) throw new Refused(`\`${key}\` is not up to 1 MiB of bytes`);
    return b;
  };
  const mounts = list(m.get("mounts"), "mounts", 1024).map((x) => {
    const f = fieldsOf(x, "a mount", ["guest_path", "host_hint", "tree", "read_only"], ["host_bound", "not_carried"]);
    return {
      guestPath: text(f.get("guest_path"), "a mount's guest path"),
      hostHint: text(f.get("host_hint"), "a mount's host hint"),
      notCarried: list(f.get("not_carried") ?? [], "not_carried", 16).map((p) => text(p, "a path not carried")),
      tree: kappaOf(f.get("tree"), "a mount's tree"),
      readOnly: f.get("read_only") === true,
      hostBound: f.get("host_bound") === true,
    };
  });
  const fds = list(m.get("fds"), "fds", 1 << 20).map((e) => {
    const [fd, s] = list(e, "an fd", 2);
    const f = fieldsOf(s, "an fd's state", ["what", "mount", "path", "offset", "fdflags", "read", "write"], ["unnamed"]);
    const path = text(f.get("path"), "an fd's path");
    if (path.startsWith("/") || path.split("/").includes("..")) throw new Refused(`an fd's path \`${path}\` is not safe`);
    return [uint(fd, "an fd number"), {
      what: text(f.get("what"), "an fd's kind"),
      mount: uint(f.get("mount"), "an fd's mount"),
      path,
      offset: Number(uint(f.get("offset"), "an fd's offset")),
      fdflags: uint(f.get("fdflags"), "an fd's flags"),
      read: f.get("read") === true,
      write: f.get("write") === true,
      unnamed: f.has("unnamed") ? kappaOf(f.get("unnamed"), "an unnamed file") : null,
    }];
  });
  const inodes = list(m.get("inodes") ?? [], "inodes", 100000).map((x) => {
    const f = fieldsOf(x, "an inode name", ["mount", "path", "dev", "ino"]);
    return { mount: uint(f.get("mount"), "mount"), path: text(f.get("path"), "path"), dev: f.get("dev"), ino: f.get("ino") };
  });
  const pair = (e) => list(e, "an environment entry", 2).map((s) => text(s, "an environment entry"));
  const deadline = m.get("sleep_deadline_ns");
  return {
    args: list(m.get("args"), "args", 1 << 20).map((a) => text(a, "an argument")),
    env: list(m.get("env"), "env", 1 << 20).map(pair),
    mounts,
    fds,
    monotonicNs: BigInt(uint(m.get("monotonic_ns"), "monotonic_ns")),
    stdoutBytes: Number(uint(m.get("stdout_bytes"), "stdout_bytes")),
    stderrBytes: Number(uint(m.get("stderr_bytes"), "stderr_bytes")),
    stdinBytes: Number(uint(m.get("stdin_bytes"), "stdin_bytes")),
    sleepDeadlineNs: deadline === null ? null : BigInt(uint(deadline, "sleep_deadline_ns")),
    unshownStdout: bytesOr("unshown_stdout"),
    unshownStderr: bytesOr("unshown_stderr"),
    stdinInput: m.has("stdin_input") ? kappaOf(m.get("stdin_input"), "stdin_input") : null,
    // The input in 1 MiB pieces (a `ferry.file`), not a blob.
    stdinChunked: m.get("stdin_chunked") === true,
    inodes,
  };
}

const MODES = ["file", "exec", "dir", "symlink", "file-chunks", "exec-chunks", "link"];

export async function tree(source, k) {
  const m = structured(await source.get(k, MAX_STRUCTURED), k, "ferry.tree", [1, 2, 3, 4], ["entries"]);
  const entries = m.get("entries");
  if (!(entries instanceof Map)) throw new Refused("a tree's entries are not a map");
  const out = [];
  for (const [name, e] of entries) {
    text(name, "a tree entry's name");
    if (name === "" || name === "." || name === ".." || name.includes("/") || name.includes("\0")) {
      throw new Refused(`a tree entry's name \`${name}\` is not a plain name`);
    }
    const f = fieldsOf(e, `tree entry \`${name}\``, ["mode", "object"], ["mtime_ns"]);
    const mode = text(f.get("mode"), "a mode");
    if (!MODES.includes(mode)) throw new Refused(`tree entry \`${name}\` has an unknown mode \`${mode}\``);
    out.push({ name, mode, object: kappaOf(f.get("object"), "a tree entry's object"), mtimeNs: f.has("mtime_ns") ? BigInt(f.get("mtime_ns")) : null });
  }
  return out;
}

export async function fileChunks(source, k) {
  const m = structured(await source.get(k, MAX_STRUCTURED), k, "ferry.file", [1], ["len", "chunk_size", "chunks"]);
  const len = Number(uint(m.get("len"), "a file's len"));
  if (m.get("chunk_size") !== 1 << 20) throw new Refused("a chunked file's chunk size is not 1 MiB");
  const chunks = list(m.get("chunks"), "a file's chunks", Math.ceil(len / (1 << 20))).map((c) => kappaOf(c, "a file chunk"));
  if (chunks.length !== Math.ceil(len / (1 << 20))) throw new Refused("a chunked file has the wrong number of pieces");
  return { len, chunks };
}

/** The bytes of a `ferry.log`: its records, as written. */
export async function outputLogBytes(source, k) {
  const m = structured(await source.get(k, MAX_STRUCTURED), k, "ferry.log", [1], ["len", "chunk_size", "chunks"]);
  const len = uint(m.get("len"), "a log's len");
  if (typeof len !== "number" || len > 1 << 30) throw new Refused("an output log is over 1 GiB");
  if (m.get("chunk_size") !== CHUNK) throw new Refused("an output log's chunk size is not 65536");
  const chunks = list(m.get("chunks"), "a log's chunks", Math.ceil(len / CHUNK)).map((c) => kappaOf(c, "a log chunk"));
  if (chunks.length !== Math.ceil(len / CHUNK)) throw new Refused("an output log has the wrong number of chunks");
  const all = new Uint8Array(len);
  await Promise.all(chunks.map(async (c, i) => {
    const b = await source.get(c, CHUNK);
    if (b.length !== Math.min(CHUNK, len - i * CHUNK)) throw new Refused("an output log's chunk has the wrong size");
    all.set(b, i * CHUNK);
  }));
  return all;
}

/**
 * The records of a space session's output log (the bytes `outputLogBytes` gives): [stream
 * (1 stdout, 2 stderr), bytes], in the order the guest wrote them.
 */
export function parseRecords(all) {
  const len = all.length;
  const records = [];
  const view = new DataView(all.buffer);
  for (let at = 0; at < len; ) {
    if (at + 5 > len) throw new Refused("an output log ends inside a record");
    const stream = all[at];
    const n = view.getUint32(at + 1, true);
    if ((stream !== 1 && stream !== 2) || at + 5 + n > len) throw new Refused("an output log holds a malformed record");
    records.push([stream, all.subarray(at + 5, at + 5 + n)]);
    at += 5 + n;
  }
  return records;
}
