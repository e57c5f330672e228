// BLAKE3-256 (the hash behind every κ): no dependency, runs in a browser tab and in Node
// alike. One-shot hashing of a whole buffer is all ferry's objects need. `blake3` hashes with
// a small WebAssembly module using SIMD (web/hasher/blake3.c, four 1 KiB chunks at a time:
// ~1 GB/s in V8 against ~300 MB/s) and falls back to plain JavaScript (`blake3Js`) where that
// module cannot be compiled. Both written from the BLAKE3 specification
// (github.com/BLAKE3-team/BLAKE3-specs); both checked against ferry's Rust κ in
// `crates/cli/tests/all/web.rs`.

import { WASM } from "./blake3-wasm.js";

const IV = new Uint32Array([
  0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
]);
const CHUNK_START = 1;
const CHUNK_END = 2;
const PARENT = 4;
const ROOT = 8;
const CHUNK_LEN = 1024;
// The message word order of each of the seven rounds (the permutation applied round by round).
const SCHEDULE = (() => {
  const perm = [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8];
  const rounds = [];
  let order = [...Array(16).keys()];
  for (let r = 0; r < 7; r++) {
    rounds.push(order);
    order = perm.map((p) => order[p]);
  }
  return rounds;
})();

/**
 * The compression function: writes the first 8 output words to `out`. The state is in
 * locals, not an array: V8 keeps them in registers (about twice as fast).
 */
function compress(cv, m, counter, blockLen, flags, out) {
  let v0 = cv[0], v1 = cv[1], v2 = cv[2], v3 = cv[3], v4 = cv[4], v5 = cv[5], v6 = cv[6], v7 = cv[7];
  let v8 = IV[0], v9 = IV[1], v10 = IV[2], v11 = IV[3];
  let v12 = counter >>> 0, v13 = Math.floor(counter / 0x100000000) >>> 0, v14 = blockLen, v15 = flags;
  for (let r = 0; r < 7; r++) {
    const s = SCHEDULE[r];
    v0 = (v0 + v4 + m[s[0]]) | 0; v12 ^= v0; v12 = (v12 >>> 16) | (v12 << 16);
    v8 = (v8 + v12) | 0; v4 ^= v8; v4 = (v4 >>> 12) | (v4 << 20);
    v0 = (v0 + v4 + m[s[1]]) | 0; v12 ^= v0; v12 = (v12 >>> 8) | (v12 << 24);
    v8 = (v8 + v12) | 0; v4 ^= v8; v4 = (v4 >>> 7) | (v4 << 25);
    v1 = (v1 + v5 + m[s[2]]) | 0; v13 ^= v1; v13 = (v13 >>> 16) | (v13 << 16);
    v9 = (v9 + v13) | 0; v5 ^= v9; v5 = (v5 >>> 12) | (v5 << 20);
    v1 = (v1 + v5 + m[s[3]]) | 0; v13 ^= v1; v13 = (v13 >>> 8) | (v13 << 24);
    v9 = (v9 + v13) | 0; v5 ^= v9; v5 = (v5 >>> 7) | (v5 << 25);
    v2 = (v2 + v6 + m[s[4]]) | 0; v14 ^= v2; v14 = (v14 >>> 16) | (v14 << 16);
    v10 = (v10 + v14) | 0; v6 ^= v10; v6 = (v6 >>> 12) | (v6 << 20);
    v2 = (v2 + v6 + m[s[5]]) | 0; v14 ^= v2; v14 = (v14 >>> 8) | (v14 << 24);
    v10 = (v10 + v14) | 0; v6 ^= v10; v6 = (v6 >>> 7) | (v6 << 25);
    v3 = (v3 + v7 + m[s[6]]) | 0; v15 ^= v3; v15 = (v15 >>> 16) | (v15 << 16);
    v11 = (v11 + v15) | 0; v7 ^= v11; v7 = (v7 >>> 12) | (v7 << 20);
    v3 = (v3 + v7 + m[s[7]]) | 0; v15 ^= v3; v15 = (v15 >>> 8) | (v15 << 24);
    v11 = (v11 + v15) | 0; v7 ^= v11; v7 = (v7 >>> 7) | (v7 << 25);
    v0 = (v0 + v5 + m[s[8]]) | 0; v15 ^= v0; v15 = (v15 >>> 16) | (v15 << 16);
    v10 = (v10 + v15) | 0; v5 ^= v10; v5 = (v5 >>> 12) | (v5 << 20);
    v0 = (v0 + v5 + m[s[9]]) | 0; v15 ^= v0; v15 = (v15 >>> 8) | (v15 << 24);
    v10 = (v10 + v15) | 0; v5 ^= v10; v5 = (v5 >>> 7) | (v5 << 25);
    v1 = (v1 + v6 + m[s[10]]) | 0; v12 ^= v1; v12 = (v12 >>> 16) | (v12 << 16);
    v11 = (v11 + v12) | 0; v6 ^= v11; v6 = (v6 >>> 12) | (v6 << 20);
    v1 = (v1 + v6 + m[s[11]]) | 0; v12 ^= v1; v12 = (v12 >>> 8) | (v12 << 24);
    v11 = (v11 + v12) | 0; v6 ^= v11; v6 = (v6 >>> 7) | (v6 << 25);
    v2 = (v2 + v7 + m[s[12]]) | 0; v13 ^= v2; v13 = (v13 >>> 16) | (v13 << 16);
    v8 = (v8 + v13) | 0; v7 ^= v8; v7 = (v7 >>> 12) | (v7 << 20);
    v2 = (v2 + v7 + m[s[13]]) | 0; v13 ^= v2; v13 = (v13 >>> 8) | (v13 << 24);
    v8 = (v8 + v13) | 0; v7 ^= v8; v7 = (v7 >>> 7) | (v7 << 25);
    v3 = (v3 + v4 + m[s[14]]) | 0; v14 ^= v3; v14 = (v14 >>> 16) | (v14 << 16);
    v9 = (v9 + v14) | 0; v4 ^= v9; v4 = (v4 >>> 12) | (v4 << 20);
    v3 = (v3 + v4 + m[s[15]]) | 0; v14 ^= v3; v14 = (v14 >>> 8) | (v14 << 24);
    v9 = (v9 + v14) | 0; v4 ^= v9; v4 = (v4 >>> 7) | (v4 << 25);
  }
  out[0] = v0 ^ v8; out[1] = v1 ^ v9; out[2] = v2 ^ v10; out[3] = v3 ^ v11;
  out[4] = v4 ^ v12; out[5] = v5 ^ v13; out[6] = v6 ^ v14; out[7] = v7 ^ v15;
}

const block = new Uint32Array(16);

// Whether this engine stores words little-endian (every engine on x86 and ARM does): then
// whole blocks of a 4-byte-aligned input are read as words at once.
const LITTLE = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;
let words = null; // a Uint32Array over the input being hashed, when aligned

/** Loads up to 64 bytes of `bytes` at `at` into `block`, zero-padded. */
function load(bytes, at, len) {
  if (len === 64 && words !== null) {
    const w = at >> 2;
    for (let i = 0; i < 16; i++) block[i] = words[w + i];
    return;
  }
  if (len === 64) {
    for (let i = 0; i < 16; i++) {
      const j = at + 4 * i;
      block[i] = bytes[j] | (bytes[j + 1] << 8) | (bytes[j + 2] << 16) | (bytes[j + 3] << 24);
    }
    return;
  }
  block.fill(0);
  for (let i = 0; i < len; i++) block[i >> 2] |= bytes[at + i] << (8 * (i & 3));
}

/**
 * Compresses all of one chunk but its last block into `cv`, and leaves the last block in
 * `block`; returns that block's length and flags.
 */
function chunkBody(bytes, at, len, counter, cv) {
  cv.set(IV);
  let flags = CHUNK_START;
  let off = 0;
  while (len - off > 64) {
    load(bytes, at + off, 64);
    compress(cv, block, counter, 64, flags, cv);
    flags = 0;
    off += 64;
  }
  load(bytes, at + off, len - off);
  return [len - off, flags | CHUNK_END];
}

/** The WebAssembly hasher, or null where it cannot be compiled (no SIMD, a page's policy). */
const simd = (() => {
  // `FERRY_HASHER=javascript` (Node): plain JavaScript, to measure one against the other.
  if (globalThis.process?.env?.FERRY_HASHER === "javascript") return null;
  try {
    const bin = atob(WASM);
    const code = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) code[i] = bin.charCodeAt(i);
    const { exports } = new WebAssembly.Instance(new WebAssembly.Module(code), {});
    return { memory: exports.memory, at: exports.input(), hash: exports.hash };
  } catch {
    return null;
  }
})();

/** Which implementation `blake3` uses: "wasm-simd" or "javascript". */
export const HASHER = simd ? "wasm-simd" : "javascript";

/** BLAKE3-256 of `bytes` (a Uint8Array): 32 bytes. */
export function blake3(bytes) {
  if (simd === null) return blake3Js(bytes);
  const { memory, at, hash } = simd;
  const need = at + bytes.length;
  if (need > memory.buffer.byteLength) {
    try {
      memory.grow(Math.ceil((need - memory.buffer.byteLength) / 65536));
    } catch {
      return blake3Js(bytes); // no room for a copy of this much: hash it where it is
    }
  }
  new Uint8Array(memory.buffer, at, bytes.length).set(bytes);
  return new Uint8Array(memory.buffer, hash(bytes.length), 32).slice();
}

/** BLAKE3-256 of `bytes` in plain JavaScript. */
export function blake3Js(bytes) {
  words = LITTLE && bytes.byteOffset % 4 === 0 ? new Uint32Array(bytes.buffer, bytes.byteOffset, bytes.length >> 2) : null;
  try {
    return hash(bytes);
  } finally {
    words = null;
  }
}

function hash(bytes) {
  const n = Math.max(1, Math.ceil(bytes.length / CHUNK_LEN));
  const stack = [];
  const cv = new Uint32Array(8);
  for (let i = 0; i < n - 1; i++) {
    const [len, flags] = chunkBody(bytes, i * CHUNK_LEN, CHUNK_LEN, i, cv);
    compress(cv, block, i, len, flags, cv);
    let node = cv.slice();
    let total = i + 1;
    while ((total & 1) === 0) {
      node = parent(stack.pop(), node, 0);
      total >>= 1;
    }
    stack.push(node);
  }
  // The last chunk, then the parents above it, the topmost of which is the root.
  const last = (n - 1) * CHUNK_LEN;
  let [len, flags] = chunkBody(bytes, last, bytes.length - last, n - 1, cv);
  let inCv = cv.slice();
  let counter = n - 1;
  let words = block.slice();
  while (stack.length > 0) {
    const out = new Uint32Array(8);
    compress(inCv, words, counter, len, flags, out);
    const left = stack.pop();
    words = new Uint32Array(16);
    words.set(left, 0);
    words.set(out, 8);
    inCv = IV;
    counter = 0;
    len = 64;
    flags = PARENT;
  }
  const out = new Uint32Array(8);
  compress(inCv, words, counter, len, flags | ROOT, out);
  const digest = new Uint8Array(32);
  for (let i = 0; i < 8; i++) {
    digest[4 * i] = out[i];
    digest[4 * i + 1] = out[i] >>> 8;
    digest[4 * i + 2] = out[i] >>> 16;
    digest[4 * i + 3] = out[i] >>> 24;
  }
  return digest;
}

function parent(left, right, flags) {
  const words = new Uint32Array(16);
  words.set(left, 0);
  words.set(right, 8);
  const out = new Uint32Array(8);
  compress(IV, words, 0, 64, PARENT | flags, out);
  return out;
}

/** The bytes of lower-case hex `h`. */
export function fromHex(h) {
  const b = new Uint8Array(h.length / 2);
  for (let i = 0; i < b.length; i++) b[i] = parseInt(h.substr(2 * i, 2), 16);
  return b;
}

/** Lower-case hex of `bytes`. */
export function hex(bytes) {
  let s = "";
  for (const b of bytes) s += b.toString(16).padStart(2, "0");
  return s;
}
