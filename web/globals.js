// A guest's mutable globals to the bit, both ways. JavaScript reads and writes `i32`/`i64`
// exactly, but a float may lose a NaN's bits on the way through a JavaScript number and a
// `v128` cannot be held at all; so each global goes through a module of a few bytes that
// imports it and exports `mem` and `move`: `(global.set 0 (T.load (i32.const 0)))` to set it
// from that memory, `(T.store (i32.const 0) (global.get 0))` to read it into that memory.

/** Per type: its value type byte, its load and store instructions (with alignment), its size. */
const TYPES = {
  i32: [0x7f, [0x28, 2], [0x36, 2], 4],
  i64: [0x7e, [0x29, 3], [0x37, 3], 8],
  f32: [0x7d, [0x2a, 2], [0x38, 2], 4],
  f64: [0x7c, [0x2b, 3], [0x39, 3], 8],
  v128: [0x7b, [0xfd, 0x00, 4], [0xfd, 0x0b, 4], 16],
};

const modules = new Map();

/** An instance moving `global` (of type `ty`) one `way`: `set` (into it) or `get` (out of it). */
function instance(global, ty, way) {
  const key = `${ty}:${way}`;
  let mod = modules.get(key);
  if (!mod) {
    const [valtype, load, store] = TYPES[ty];
    const body = way === "set"
      ? [0x41, 0x00, ...load, 0x00, 0x24, 0x00]
      : [0x41, 0x00, 0x23, 0x00, ...store, 0x00];
    const code = [0x00, ...body, 0x0b];
    const section = (id, bytes) => [id, bytes.length, ...bytes];
    mod = new WebAssembly.Module(new Uint8Array([
      0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00,
      ...section(1, [0x01, 0x60, 0x00, 0x00]),
      ...section(2, [0x01, 0x01, 0x6d, 0x01, 0x67, 0x03, valtype, 0x01]), // import "m" "g"
      ...section(3, [0x01, 0x00]),
      ...section(5, [0x01, 0x00, 0x01]),
      ...section(7, [0x02, 0x03, 0x6d, 0x65, 0x6d, 0x02, 0x00, 0x04, 0x6d, 0x6f, 0x76, 0x65, 0x00, 0x00]), // "mem", "move"
      ...section(10, [0x01, code.length, ...code]),
    ]));
    modules.set(key, mod);
  }
  return new WebAssembly.Instance(mod, { m: { g: global } }).exports;
}

/** Sets `global` (a WebAssembly.Global of type `ty`) to exactly `bits` (little-endian). */
export function setBits(global, ty, bits) {
  const ex = instance(global, ty, "set");
  new Uint8Array(ex.mem.buffer).set(bits);
  ex.move();
}

/** The exact bits of `global` (of type `ty`), little-endian. */
export function getBits(global, ty) {
  const ex = instance(global, ty, "get");
  ex.move();
  return new Uint8Array(ex.mem.buffer, 0, TYPES[ty][3]).slice();
}
