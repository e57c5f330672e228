// A compression workload over the Brotli library (c/common, c/enc, c/dec as shipped in the
// PyPI sdist of `Brotli`; MIT licence; fetched and built by scripts/fetch-programs.sh, never
// committed). usage: brotli-bench [KiB] [rounds]
// Builds a semi-compressible buffer (words, numbers, noise), then per round compresses it at
// qualities 1, 5 and 9, decompresses each result, checks it, and prints sizes and a checksum.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <brotli/decode.h>
#include <brotli/encode.h>

static uint32_t rng = 2463534242u;
static uint32_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}

static uint32_t fnv(const uint8_t *p, size_t n) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

int main(int argc, char **argv) {
    int kib = argc > 1 ? atoi(argv[1]) : 2048;
    int rounds = argc > 2 ? atoi(argv[2]) : 2;
    static const char *words[] = {"ferry", "snapshot", "resume", "the", "of", "memory",
                                  "stack", "frame", "wasm", "engine", "kappa", "store", "and"};
    size_t n = (size_t)kib << 10;
    uint8_t *src = malloc(n);
    if (!src) return 2;
    size_t at = 0;
    while (at < n) {
        char tmp[64];
        int len;
        uint32_t r = next();
        if (r % 7 == 0) len = snprintf(tmp, sizeof tmp, "%u ", next() % 100000);
        else if (r % 31 == 0) { tmp[0] = (char)(next() & 0xff); len = 1; }
        else len = snprintf(tmp, sizeof tmp, "%s ", words[r % 13]);
        if (at + (size_t)len > n) len = (int)(n - at);
        memcpy(src + at, tmp, (size_t)len);
        at += (size_t)len;
    }
    size_t cap = BrotliEncoderMaxCompressedSize(n);
    uint8_t *dst = malloc(cap), *back = malloc(n);
    if (!dst || !back) return 2;
    static const int qualities[] = {1, 5, 9};
    for (int round = 0; round < rounds; round++) {
        src[(size_t)round * 4099 % n] ^= (uint8_t)(round + 1);
        for (int q = 0; q < 3; q++) {
            size_t c = cap;
            if (!BrotliEncoderCompress(qualities[q], BROTLI_DEFAULT_WINDOW, BROTLI_MODE_GENERIC, n,
                                       src, &c, dst)) {
                fprintf(stderr, "compress failed at quality %d\n", qualities[q]);
                return 1;
            }
            size_t d = n;
            if (BrotliDecoderDecompress(c, dst, &d, back) != BROTLI_DECODER_RESULT_SUCCESS ||
                d != n || memcmp(back, src, n) != 0) {
                fprintf(stderr, "round trip failed at quality %d\n", qualities[q]);
                return 1;
            }
            printf("round %d quality %d: %zu -> %zu bytes, checksum %08x\n", round,
                   qualities[q], n, c, fnv(dst, c));
        }
    }
    free(src); free(dst); free(back);
    return 0;
}
