#!/usr/bin/env node
// Unit checks of the JavaScript space's own codecs, run by `cargo test` (crates/cli/tests/all/web.rs):
//
//   node web/test.mjs VECTORS.json
//
// VECTORS.json: [{"len": N, "kappa": "<hex>"}] — κ of the bytes i % 251 for i < N, computed
// by ferry's Rust κ. Prints `ok N` per passed check and exits 1 on the first failure.

import { readFileSync } from "node:fs";
import { blake3, hex } from "./blake3.js";
import { CborError, decode } from "./cbor.js";
import { MapSource, Refused, snapshot } from "./objects.js";
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
  check(`BLAKE3 of ${len} bytes is ferry's κ`, hex(blake3(b)) === kappa);
}

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

check("names sort by code point, as ferry's byte order", ["b", "\u{1F600}", "a", "\uFFFD", "B"].sort(byName).join(",") === ["B", "a", "b", "\uFFFD", "\u{1F600}"].join(","));
console.log(`${n} checks passed`);
