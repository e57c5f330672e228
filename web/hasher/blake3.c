// BLAKE3-256 for the JavaScript space (web/blake3.js), four chunks at a time with WebAssembly
// SIMD (128-bit lanes: one chunk per 32-bit lane). Written from the BLAKE3 specification
// (github.com/BLAKE3-team/BLAKE3-specs), as web/blake3.js's plain JavaScript is; built by
// web/hasher/build.sh into web/blake3-wasm.js. No libc: `hash(len)` hashes the `len` bytes
// the caller put at `input()` and returns where the 32-byte digest is.

#include <stdint.h>
#include <wasm_simd128.h>

#define CHUNK_LEN 1024
#define CHUNK_START 1u
#define CHUNK_END 2u
#define PARENT 4u
#define ROOT 8u

static const uint32_t IV[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

// The message word order of each of the seven rounds.
static const uint8_t MSG[7][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8},
    {3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1},
    {10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6},
    {12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4},
    {9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7},
    {11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13},
};

extern unsigned char __heap_base;
static uint8_t digest[32];

static inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static inline uint32_t load32(const uint8_t *p) {
  uint32_t v;
  __builtin_memcpy(&v, p, 4); // WebAssembly is little-endian, as BLAKE3's words are
  return v;
}

#define G1(a, b, c, d, x, y)                                                            \
  a = a + b + (x); d = rotr(d ^ a, 16); c = c + d; b = rotr(b ^ c, 12);                 \
  a = a + b + (y); d = rotr(d ^ a, 8);  c = c + d; b = rotr(b ^ c, 7);

// The compression function, one block: the first 8 words of its output into `out`.
static void compress(const uint32_t cv[8], const uint32_t m[16], uint64_t counter,
                     uint32_t len, uint32_t flags, uint32_t out[8]) {
  uint32_t v0 = cv[0], v1 = cv[1], v2 = cv[2], v3 = cv[3];
  uint32_t v4 = cv[4], v5 = cv[5], v6 = cv[6], v7 = cv[7];
  uint32_t v8 = IV[0], v9 = IV[1], v10 = IV[2], v11 = IV[3];
  uint32_t v12 = (uint32_t)counter, v13 = (uint32_t)(counter >> 32), v14 = len, v15 = flags;
  for (int r = 0; r < 7; r++) {
    const uint8_t *s = MSG[r];
    G1(v0, v4, v8, v12, m[s[0]], m[s[1]]);
    G1(v1, v5, v9, v13, m[s[2]], m[s[3]]);
    G1(v2, v6, v10, v14, m[s[4]], m[s[5]]);
    G1(v3, v7, v11, v15, m[s[6]], m[s[7]]);
    G1(v0, v5, v10, v15, m[s[8]], m[s[9]]);
    G1(v1, v6, v11, v12, m[s[10]], m[s[11]]);
    G1(v2, v7, v8, v13, m[s[12]], m[s[13]]);
    G1(v3, v4, v9, v14, m[s[14]], m[s[15]]);
  }
  out[0] = v0 ^ v8; out[1] = v1 ^ v9; out[2] = v2 ^ v10; out[3] = v3 ^ v11;
  out[4] = v4 ^ v12; out[5] = v5 ^ v13; out[6] = v6 ^ v14; out[7] = v7 ^ v15;
}

static void load_block(const uint8_t *p, uint32_t len, uint32_t m[16]) {
  for (int i = 0; i < 16; i++) m[i] = 0;
  for (uint32_t i = 0; i < len; i++) m[i >> 2] |= (uint32_t)p[i] << (8 * (i & 3));
}

// All of one chunk (`len` <= 1024 bytes) but its last block into `cv`; that block into `m`,
// its length into `*last` and its flags as the result.
static uint32_t chunk_body(const uint8_t *p, uint32_t len, uint64_t counter, uint32_t cv[8],
                           uint32_t m[16], uint32_t *last) {
  for (int i = 0; i < 8; i++) cv[i] = IV[i];
  uint32_t flags = CHUNK_START, off = 0;
  while (len - off > 64) {
    load_block(p + off, 64, m);
    compress(cv, m, counter, 64, flags, cv);
    flags = 0;
    off += 64;
  }
  load_block(p + off, len - off, m);
  *last = len - off;
  return flags | CHUNK_END;
}

#define ROT(x, n) wasm_v128_or(wasm_u32x4_shr(x, n), wasm_i32x4_shl(x, 32 - n))
#define ROT16(x) wasm_i8x16_shuffle(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#define ROT8(x) wasm_i8x16_shuffle(x, x, 1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12)
#define ADD wasm_i32x4_add
#define XOR wasm_v128_xor
#define G4(a, b, c, d, x, y)                                                            \
  a = ADD(ADD(a, b), x); d = ROT16(XOR(d, a)); c = ADD(c, d); b = ROT(XOR(b, c), 12);   \
  a = ADD(ADD(a, b), y); d = ROT8(XOR(d, a));  c = ADD(c, d); b = ROT(XOR(b, c), 7);
#define ROUND4(r)                                                                       \
  G4(v[0], v[4], v[8], v[12], m[MSG[r][0]], m[MSG[r][1]]);                              \
  G4(v[1], v[5], v[9], v[13], m[MSG[r][2]], m[MSG[r][3]]);                              \
  G4(v[2], v[6], v[10], v[14], m[MSG[r][4]], m[MSG[r][5]]);                             \
  G4(v[3], v[7], v[11], v[15], m[MSG[r][6]], m[MSG[r][7]]);                             \
  G4(v[0], v[5], v[10], v[15], m[MSG[r][8]], m[MSG[r][9]]);                             \
  G4(v[1], v[6], v[11], v[12], m[MSG[r][10]], m[MSG[r][11]]);                           \
  G4(v[2], v[7], v[8], v[13], m[MSG[r][12]], m[MSG[r][13]]);                            \
  G4(v[3], v[4], v[9], v[14], m[MSG[r][14]], m[MSG[r][15]]);

// Four whole chunks at `p` (1024 bytes apart), numbered `counter` to `counter + 3`: their
// chaining values into `cvs`.
static void chunks4(const uint8_t *p, uint64_t counter, uint32_t cvs[4][8]) {
  v128_t h[8], m[16], v[16];
  for (int i = 0; i < 8; i++) h[i] = wasm_i32x4_splat(IV[i]);
  const v128_t lo = wasm_i32x4_make((uint32_t)counter, (uint32_t)(counter + 1),
                                    (uint32_t)(counter + 2), (uint32_t)(counter + 3));
  const v128_t hi = wasm_i32x4_make((uint32_t)(counter >> 32), (uint32_t)((counter + 1) >> 32),
                                    (uint32_t)((counter + 2) >> 32),
                                    (uint32_t)((counter + 3) >> 32));
  for (int b = 0; b < 16; b++) {
    // Transpose: word k of the block of lane j is lane j of m[k].
    for (int k = 0; k < 4; k++) {
      const uint8_t *q = p + 64 * b + 16 * k;
      v128_t r0 = wasm_v128_load(q), r1 = wasm_v128_load(q + CHUNK_LEN);
      v128_t r2 = wasm_v128_load(q + 2 * CHUNK_LEN), r3 = wasm_v128_load(q + 3 * CHUNK_LEN);
      v128_t t0 = wasm_i32x4_shuffle(r0, r1, 0, 4, 1, 5);
      v128_t t1 = wasm_i32x4_shuffle(r0, r1, 2, 6, 3, 7);
      v128_t t2 = wasm_i32x4_shuffle(r2, r3, 0, 4, 1, 5);
      v128_t t3 = wasm_i32x4_shuffle(r2, r3, 2, 6, 3, 7);
      m[4 * k] = wasm_i32x4_shuffle(t0, t2, 0, 1, 4, 5);
      m[4 * k + 1] = wasm_i32x4_shuffle(t0, t2, 2, 3, 6, 7);
      m[4 * k + 2] = wasm_i32x4_shuffle(t1, t3, 0, 1, 4, 5);
      m[4 * k + 3] = wasm_i32x4_shuffle(t1, t3, 2, 3, 6, 7);
    }
    for (int i = 0; i < 8; i++) v[i] = h[i];
    for (int i = 0; i < 4; i++) v[8 + i] = wasm_i32x4_splat(IV[i]);
    v[12] = lo;
    v[13] = hi;
    v[14] = wasm_i32x4_splat(64);
    v[15] = wasm_i32x4_splat((b == 0 ? CHUNK_START : 0) | (b == 15 ? CHUNK_END : 0));
    ROUND4(0) ROUND4(1) ROUND4(2) ROUND4(3) ROUND4(4) ROUND4(5) ROUND4(6)
    for (int i = 0; i < 8; i++) h[i] = XOR(v[i], v[i + 8]);
  }
  uint32_t w[8][4];
  for (int i = 0; i < 8; i++) wasm_v128_store(w[i], h[i]);
  for (int j = 0; j < 4; j++)
    for (int i = 0; i < 8; i++) cvs[j][i] = w[i][j];
}

static uint32_t stack[64][8];
static int depth;

static void parent(const uint32_t left[8], const uint32_t right[8], uint32_t out[8]) {
  uint32_t m[16];
  for (int i = 0; i < 8; i++) m[i] = left[i], m[8 + i] = right[i];
  compress(IV, m, 0, 64, PARENT, out);
}

// Chunk number `total - 1`'s chaining value: merged with the complete subtrees it ends.
static void push(const uint32_t cv[8], uint64_t total) {
  uint32_t node[8];
  for (int i = 0; i < 8; i++) node[i] = cv[i];
  while ((total & 1) == 0) {
    parent(stack[--depth], node, node);
    total >>= 1;
  }
  for (int i = 0; i < 8; i++) stack[depth][i] = node[i];
  depth++;
}

/** Where the caller puts the bytes to hash. */
__attribute__((export_name("input"))) uint8_t *input(void) { return &__heap_base; }

/** BLAKE3-256 of the `len` bytes at `input()`: returns where its 32 bytes are. */
__attribute__((export_name("hash"))) uint8_t *hash(uint32_t len) {
  const uint8_t *in = &__heap_base;
  uint64_t n = len == 0 ? 1 : (len + CHUNK_LEN - 1) / CHUNK_LEN;
  uint32_t cv[8], m[16], last;
  uint64_t i = 0;
  depth = 0;
  // Every chunk but the last: none of them, nor a subtree of them, is the root.
  for (; i + 4 <= n - 1; i += 4) {
    uint32_t cvs[4][8];
    chunks4(in + i * CHUNK_LEN, i, cvs);
    for (int j = 0; j < 4; j++) push(cvs[j], i + j + 1);
  }
  for (; i < n - 1; i++) {
    uint32_t flags = chunk_body(in + i * CHUNK_LEN, CHUNK_LEN, i, cv, m, &last);
    compress(cv, m, i, last, flags, cv);
    push(cv, i + 1);
  }
  // The last chunk, then the parents above it, the topmost of which is the root.
  uint32_t flags = chunk_body(in + i * CHUNK_LEN, len - (uint32_t)(i * CHUNK_LEN), i, cv, m, &last);
  uint64_t counter = i;
  uint32_t out[8];
  while (depth > 0) {
    compress(cv, m, counter, last, flags, out);
    depth--;
    for (int k = 0; k < 8; k++) m[k] = stack[depth][k], m[8 + k] = out[k], cv[k] = IV[k];
    counter = 0;
    last = 64;
    flags = PARENT;
  }
  compress(cv, m, counter, last, flags | ROOT, out);
  for (int k = 0; k < 8; k++) {
    digest[4 * k] = (uint8_t)out[k];
    digest[4 * k + 1] = (uint8_t)(out[k] >> 8);
    digest[4 * k + 2] = (uint8_t)(out[k] >> 16);
    digest[4 * k + 3] = (uint8_t)(out[k] >> 24);
  }
  return digest;
}
