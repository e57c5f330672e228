#!/usr/bin/env node
// Unit checks of the JavaScript space's own codecs, run by `cargo test` (crates/cli/tests/all/web.rs):
//
//   node web/test.mjs VECTORS.json [SPACE_URL TOKEN blake3:<snapshot>...]
//
// VECTORS.json: [{"len": N, "kappa": "<hex>"}] — κ of the bytes i % 251 for i < N, computed
// by ferry's Rust κ. With a space and snapshots in it: every structured object of their
// closures (snapshot, WASI state, memory images, trees, output logs) re-encoded by cbor.js
// must be the very bytes ferry wrote, and mutated copies of them must be refused cleanly
// (a `Refused` or `CborError`, never another exception). Prints `ok N` per passed check and
// exits 1 on the first failure.

import { readFileSync } from "node:fs";
import { HASHER, blake3, blake3Js, hex } from "./blake3.js";
import { CborError, decode, encode } from "./cbor.js";
import * as objects from "./objects.js";
import { MapSource, Refused, SpaceSource, snapshot } from "./objects.js";
import { byName } from "./wasi.js";

let n = 0;
function check(what, ok) {
  if (!ok) {
    console.log(`FAILED: ${what}`);
    process.exit(1);
  }
  console.log(`ok ${++n} ${what}`);
}
function refuses(what, f, Kind, text) {
  try {
    f();
  } catch (e) {
    check(`${what} (${e.message})`, e instanceof Kind && e.message.includes(text));
    return;
  }
  check(`${what}: no refusal`, false);
}
async function refusesAsync(what, f, text) {
  try {
    await f();
  } catch (e) {
    check(`${what} (${e.message})`, e instanceof Refused && e.message.includes(text));
    return;
  }
  check(`${what}: no refusal`, false);
}

for (const { len, kappa } of JSON.parse(readFileSync(process.argv[2], "utf8"))) {
  const b = new Uint8Array(len);
  for (let i = 0; i < len; i++) b[i] = i % 251;
  check(`BLAKE3 of ${len} bytes is ferry's κ (${HASHER})`, hex(blake3(b)) === kappa);
  check(`BLAKE3 of ${len} bytes in plain JavaScript is ferry's κ`, hex(blake3Js(b)) === kappa);
  // Not at the start of its buffer, not 4-byte aligned.
  const off = new Uint8Array(len + 3);
  off.set(b, 3);
  check(`BLAKE3 of ${len} unaligned bytes is ferry's κ`, hex(blake3(off.subarray(3))) === kappa && hex(blake3Js(off.subarray(3))) === kappa);
}
check("the hasher is the WebAssembly one", HASHER === "wasm-simd");

const bytes = (...xs) => new Uint8Array(xs);
// {"a": 1, "bb": [true, null, h'01']}
const good = decode(bytes(0xa2, 0x61, 0x61, 0x01, 0x62, 0x62, 0x62, 0x83, 0xf5, 0xf6, 0x41, 0x01));
check("a canonical map decodes", good.get("a") === 1 && good.get("bb")[0] === true && good.get("bb")[2][0] === 1);
refuses("an integer in a longer form than needed", () => decode(bytes(0x18, 0x05)), CborError, "shortest");
refuses("map keys out of order", () => decode(bytes(0xa2, 0x62, 0x62, 0x62, 0x01, 0x61, 0x61, 0x01)), CborError, "order");
refuses("a repeated map key", () => decode(bytes(0xa2, 0x61, 0x61, 0x01, 0x61, 0x61, 0x02)), CborError, "order");
refuses("an indefinite length", () => decode(bytes(0x9f, 0xff)), CborError, "indefinite");
refuses("a float", () => decode(bytes(0xf9, 0x3c, 0x00)), CborError, "floats");
refuses("a tag", () => decode(bytes(0xd8, 0x2a, 0x40)), CborError, "tags");
refuses("bytes after the object", () => decode(bytes(0x01, 0x01)), CborError, "after");
refuses("an object cut short", () => decode(bytes(0x62, 0x61)), CborError, "short");
refuses("text that is not UTF-8", () => decode(bytes(0x61, 0xff)), CborError, "UTF-8");
refuses("nesting deeper than 32 levels", () => decode(new Uint8Array([...Array(40).fill(0x81), 0x01])), CborError, "deeper");
const huge = bytes(0x5b, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff);
refuses("a length past the input", () => decode(huge), CborError, "too large");

const obj = (b) => [hex(blake3(b)), b];
const notSnapshot = bytes(0xa2, 0x61, 0x76, 0x01, 0x64, 0x6b, 0x69, 0x6e, 0x64, 0x6a, ...new TextEncoder().encode("ferry.tree"));
const [k1, b1] = obj(notSnapshot);
await refusesAsync("an object of another kind", () => snapshot(new MapSource(new Map([[k1, b1]])), k1), "not a `ferry.snapshot`");
const damaged = new Map([[k1, bytes(...b1.slice(0, -1), 0x21)]]);
await refusesAsync("an object that does not hash to its κ", () => snapshot(new MapSource(damaged), k1), "does not hash");
await refusesAsync("an object that is missing", () => snapshot(new MapSource(new Map()), k1), "missing");
const v2 = bytes(0xa2, 0x61, 0x76, 0x02, 0x64, 0x6b, 0x69, 0x6e, 0x64, 0x6e, ...new TextEncoder().encode("ferry.snapshot"));
const [k2, b2] = obj(v2);
await refusesAsync("a newer format version", () => snapshot(new MapSource(new Map([[k2, b2]])), k2), "format version 2");

// A few thousand random inputs: the decoder refuses or decodes, nothing else.
let seed = 0x2545f491;
const rand = () => {
  seed ^= seed << 13;
  seed ^= seed >>> 17;
  seed ^= seed << 5;
  return (seed >>> 0) / 2 ** 32;
};
let odd = null;
for (let i = 0; i < 5000 && odd === null; i++) {
  const b = new Uint8Array(1 + Math.floor(rand() * 64));
  for (let j = 0; j < b.length; j++) b[j] = rand() < 0.5 ? Math.floor(rand() * 256) : [0xa1, 0x81, 0x61, 0x18, 0x5b, 0xf6, 0x40][Math.floor(rand() * 7)];
  try {
    decode(b);
  } catch (e) {
    if (!(e instanceof CborError)) odd = `${hex(b)}: ${e}`;
  }
}
check(`5000 random inputs are decoded or refused with a CborError${odd ? `: ${odd}` : ""}`, odd === null);

check("names sort by code point, as ferry's byte order", ["b", "\u{1F600}", "a", "\uFFFD", "B"].sort(byName).join(",") === ["B", "a", "b", "\uFFFD", "\u{1F600}"].join(","));
const [space, token, ...snaps] = process.argv.slice(3);
if (space) {
  const source = new SpaceSource(space, token);
  const seen = new Map(); // κ → bytes, every structured object of the closures
  const take = async (k) => {
    const b = await source.get(k);
    seen.set(k, b);
    return b;
  };
  const walkTree = async (k) => {
    await take(k);
    for (const e of await objects.tree(source, k)) {
      if (e.mode === "dir") await walkTree(e.object);
      if (e.mode.endsWith("-chunks")) await take(e.object);
    }
  };
  for (const s of snaps) {
    const k = objects.parseKappa(s);
    await take(k);
    const snap = await snapshot(source, k);
    await take(snap.wasi);
    const state = await objects.wasiState(source, snap.wasi);
    for (const m of snap.memories) await take(m);
    for (const m of state.mounts) await walkTree(m.tree);
    for (const [, f] of state.fds) if (f.unnamed) await walkTree(f.unnamed);
    if (snap.output) await take(snap.output);
  }
  let same = 0;
  for (const [k, b] of seen) {
    const again = encode(decode(b));
    if (hex(again) !== hex(b)) check(`blake3:${k} re-encodes to other bytes`, false);
    same++;
  }
  check(`${same} structured objects of ${snaps.length} snapshots re-encode to ferry's very bytes`, same >= snaps.length * 2);
  // Mutated copies: refused cleanly, whatever the mutation.
  const readers = { "ferry.snapshot": snapshot, "ferry.wasi": objects.wasiState, "ferry.memory": objects.memory, "ferry.tree": objects.tree, "ferry.file": objects.fileChunks };
  let tried = 0;
  let strange = null;
  for (const [, b] of seen) {
    const kind = decode(b).get("kind");
    const read = readers[kind];
    if (!read) continue;
    for (let i = 0; i < 200 && strange === null; i++) {
      const m = b.slice();
      for (let j = 0; j < 1 + Math.floor(rand() * 3); j++) m[Math.floor(rand() * m.length)] = Math.floor(rand() * 256);
      const km = hex(blake3(m));
      try {
        await read(new MapSource(new Map([[km, m]])), km);
      } catch (e) {
        if (!(e instanceof Refused)) strange = `${kind}: ${e.stack}`;
      }
      tried++;
    }
  }
  check(`${tried} mutated objects are read or refused with the reason${strange ? `: ${strange}` : ""}`, strange === null && tried > 0);
}
console.log(`${n} checks passed`);
