// A compression workload over the Brotli library (c/common, c/enc, c/dec as shipped in the
// PyPI sdist of `Brotli`; MIT licence; fetched and built by scripts/fetch-programs.sh, never
// committed). usage: brotli-bench [KiB] [rounds]
// Builds a semi-compressible buffer (words, numbers, noise), then per round compresses it at
// qualities 1, 5 and 9, decompresses each result, checks it, and prints sizes and a checksum.
#include "workload.h"

#include <brotli/decode.h>
#include <brotli/encode.h>

int main(int argc, char **argv) {
    int kib = argc > 1 ? atoi(argv[1]) : 2048;
    int rounds = argc > 2 ? atoi(argv[2]) : 2;
    static const char *const words[] = {"ferry", "snapshot", "resume", "the", "of", "memory",
                                        "stack", "frame", "wasm", "engine", "kappa", "store", "and"};
    size_t n = (size_t)kib << 10;
    uint8_t *src = make_input(n, words, 13);
    if (!src) return 2;
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
