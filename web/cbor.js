// A strict decoder of ferry's canonical encoding (deterministic DAG-CBOR, docs/format.md):
// shortest integer forms, definite lengths, map keys sorted by length then bytes and never
// repeated, no tags, no floats, at most 32 levels deep and 64 MiB. Anything else is refused,
// so a value has one encoding here as in ferry's Rust decoder.
//
// Values: unsigned and negative integers as Number when safe, else BigInt; byte strings as
// Uint8Array; text as string; arrays as Array; maps as Map (keys are text in ferry's objects,
// but any key is read); true, false, null.

export const MAX_DEPTH = 32;
export const MAX_OBJECT_BYTES = 64 << 20;

export class CborError extends Error {}

const utf8 = new TextDecoder("utf-8", { fatal: true });

/** Decodes one canonical item filling all of `bytes`. */
export function decode(bytes) {
  if (bytes.length > MAX_OBJECT_BYTES) {
    throw new CborError(`object is ${bytes.length} bytes, more than the limit of ${MAX_OBJECT_BYTES}`);
  }
  const r = { at: 0 };
  const value = item(bytes, r, 0);
  if (r.at !== bytes.length) throw new CborError("bytes after the object");
  return value;
}

function need(bytes, r, n) {
  if (r.at + n > bytes.length) throw new CborError("object is cut short");
}

function argument(bytes, r, info) {
  if (info < 24) return info;
  if (info > 27) throw new CborError("indefinite lengths and reserved forms are not canonical");
  const n = 1 << (info - 24);
  need(bytes, r, n);
  let x = 0n;
  for (let i = 0; i < n; i++) x = (x << 8n) | BigInt(bytes[r.at + i]);
  r.at += n;
  const min = [24n, 0x100n, 0x10000n, 0x100000000n][info - 24];
  if (x < min) throw new CborError("an integer is not in its shortest form");
  return x <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(x) : x;
}

function length(x) {
  if (typeof x !== "number" || x > MAX_OBJECT_BYTES) throw new CborError("a length is too large");
  return x;
}

function compareKeys(a, b) {
  if (a.length !== b.length) return a.length - b.length;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return a[i] - b[i];
  return 0;
}

function item(bytes, r, depth) {
  need(bytes, r, 1);
  const b = bytes[r.at++];
  const major = b >> 5;
  const info = b & 0x1f;
  switch (major) {
    case 0:
      return argument(bytes, r, info);
    case 1: {
      const x = argument(bytes, r, info);
      return typeof x === "number" && x < Number.MAX_SAFE_INTEGER ? -1 - x : -1n - BigInt(x);
    }
    case 2:
    case 3: {
      const n = length(argument(bytes, r, info));
      need(bytes, r, n);
      const raw = bytes.subarray(r.at, r.at + n);
      r.at += n;
      if (major === 2) return raw;
      try {
        return utf8.decode(raw);
      } catch {
        throw new CborError("text is not UTF-8");
      }
    }
    case 4: {
      if (depth >= MAX_DEPTH) throw new CborError(`object nests deeper than ${MAX_DEPTH} levels`);
      const n = length(argument(bytes, r, info));
      const out = [];
      for (let i = 0; i < n; i++) out.push(item(bytes, r, depth + 1));
      return out;
    }
    case 5: {
      if (depth >= MAX_DEPTH) throw new CborError(`object nests deeper than ${MAX_DEPTH} levels`);
      const n = length(argument(bytes, r, info));
      const out = new Map();
      let prev = null;
      for (let i = 0; i < n; i++) {
        const start = r.at;
        const key = item(bytes, r, depth + 1);
        const raw = bytes.subarray(start, r.at);
        if (prev !== null && compareKeys(prev, raw) >= 0) {
          throw new CborError("map keys are not in canonical order (or repeat)");
        }
        prev = raw;
        out.set(key, item(bytes, r, depth + 1));
      }
      return out;
    }
    case 6:
      throw new CborError("tags are not used by ferry's objects");
    default:
      if (b === 0xf4) return false;
      if (b === 0xf5) return true;
      if (b === 0xf6) return null;
      throw new CborError("floats and other simple values are not used by ferry's objects");
  }
}

/**
 * Encodes `value` canonically: integers (Number or BigInt) in their shortest form, text,
 * bytes (Uint8Array), arrays, maps (a Map, or a plain object whose `undefined` fields are
 * left out, as ferry leaves out absent optional fields) with keys sorted by length then
 * bytes, true, false, null.
 */
export function encode(value) {
  const w = new Writer();
  put(w, value, 0);
  return w.bytes();
}

class Writer {
  constructor() {
    this.buf = new Uint8Array(256);
    this.len = 0;
  }
  reserve(n) {
    if (this.len + n > this.buf.length) {
      const grown = new Uint8Array(Math.max(this.len + n, this.buf.length * 2));
      grown.set(this.buf.subarray(0, this.len));
      this.buf = grown;
    }
  }
  byte(b) {
    this.reserve(1);
    this.buf[this.len++] = b;
  }
  raw(bytes) {
    this.reserve(bytes.length);
    this.buf.set(bytes, this.len);
    this.len += bytes.length;
  }
  bytes() {
    return this.buf.slice(0, this.len);
  }
}

function head(w, major, n) {
  const x = BigInt(n);
  if (x < 24n) return w.byte((major << 5) | Number(x));
  const [info, size] = x < 0x100n ? [24, 1] : x < 0x10000n ? [25, 2] : x < 0x100000000n ? [26, 4] : [27, 8];
  w.byte((major << 5) | info);
  for (let i = size - 1; i >= 0; i--) w.byte(Number((x >> BigInt(8 * i)) & 0xffn));
}

const utf8Out = new TextEncoder();

function put(w, v, depth) {
  if (depth > MAX_DEPTH) throw new CborError(`value nests deeper than ${MAX_DEPTH} levels`);
  if (v === null) return w.byte(0xf6);
  if (v === true) return w.byte(0xf5);
  if (v === false) return w.byte(0xf4);
  if (typeof v === "number" || typeof v === "bigint") {
    if (typeof v === "number" && !Number.isSafeInteger(v)) throw new CborError(`${v} is not an integer ferry can encode`);
    const x = BigInt(v);
    return x >= 0n ? head(w, 0, x) : head(w, 1, -1n - x);
  }
  if (typeof v === "string") {
    const b = utf8Out.encode(v);
    head(w, 3, b.length);
    return w.raw(b);
  }
  if (v instanceof Uint8Array) {
    head(w, 2, v.length);
    return w.raw(v);
  }
  if (Array.isArray(v)) {
    head(w, 4, v.length);
    for (const x of v) put(w, x, depth + 1);
    return;
  }
  const entries = (v instanceof Map ? [...v] : Object.entries(v)).filter(([, x]) => x !== undefined);
  const keyed = entries.map(([k, x]) => [encode(k), x]).sort(([a], [b]) => compareKeys(a, b));
  head(w, 5, keyed.length);
  for (const [k, x] of keyed) {
    w.raw(k);
    put(w, x, depth + 1);
  }
}
