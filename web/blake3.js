// BLAKE3-256 (the hash behind every κ), in plain JavaScript: no dependency, runs in a browser
// tab and in Node alike. One-shot hashing of a whole buffer is all ferry's objects need.
// Written from the BLAKE3 specification (github.com/BLAKE3-team/BLAKE3-specs); checked
// against ferry's Rust κ in `crates/cli/tests/all/web.rs`.

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

const v = new Uint32Array(16);

/** The compression function: writes the first 8 output words to `out`. */
function compress(cv, m, counter, blockLen, flags, out) {
  v[0] = cv[0]; v[1] = cv[1]; v[2] = cv[2]; v[3] = cv[3];
  v[4] = cv[4]; v[5] = cv[5]; v[6] = cv[6]; v[7] = cv[7];
  v[8] = IV[0]; v[9] = IV[1]; v[10] = IV[2]; v[11] = IV[3];
  v[12] = counter >>> 0;
  v[13] = Math.floor(counter / 0x100000000) >>> 0;
  v[14] = blockLen;
  v[15] = flags;
  for (let r = 0; r < 7; r++) {
    const s = SCHEDULE[r];
    g(0, 4, 8, 12, m[s[0]], m[s[1]]);
    g(1, 5, 9, 13, m[s[2]], m[s[3]]);
    g(2, 6, 10, 14, m[s[4]], m[s[5]]);
    g(3, 7, 11, 15, m[s[6]], m[s[7]]);
    g(0, 5, 10, 15, m[s[8]], m[s[9]]);
    g(1, 6, 11, 12, m[s[10]], m[s[11]]);
    g(2, 7, 8, 13, m[s[12]], m[s[13]]);
    g(3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (let i = 0; i < 8; i++) out[i] = v[i] ^ v[i + 8];
}

function g(a, b, c, d, x, y) {
  let va = v[a], vb = v[b], vc = v[c], vd = v[d];
  va = (va + vb + x) | 0;
  vd ^= va; vd = (vd >>> 16) | (vd << 16);
  vc = (vc + vd) | 0;
  vb ^= vc; vb = (vb >>> 12) | (vb << 20);
  va = (va + vb + y) | 0;
  vd ^= va; vd = (vd >>> 8) | (vd << 24);
  vc = (vc + vd) | 0;
  vb ^= vc; vb = (vb >>> 7) | (vb << 25);
  v[a] = va; v[b] = vb; v[c] = vc; v[d] = vd;
}

const block = new Uint32Array(16);

/** Loads up to 64 bytes of `bytes` at `at` into `block`, zero-padded. */
function load(bytes, at, len) {
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

/** BLAKE3-256 of `bytes` (a Uint8Array): 32 bytes. */
export function blake3(bytes) {
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

/** Lower-case hex of `bytes`. */
export function hex(bytes) {
  let s = "";
  for (const b of bytes) s += b.toString(16).padStart(2, "0");
  return s;
}
