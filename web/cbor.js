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
