// A compression workload over the zstd library (the single-file zstd.c that the PyPI sdist of
// `zstandard` ships; BSD licence; fetched and built by scripts/fetch-zstd.sh, never committed).
// usage: zstd-bench [MiB] [rounds]
// Builds a semi-compressible buffer (words from a small vocabulary, numbers, noise), then per
// round compresses it at levels 1, 3 and 9, decompresses each result, checks it, and prints
// the sizes and a checksum.
#include "workload.h"

#include "zstd.h"

int main(int argc, char **argv) {
    int mib = argc > 1 ? atoi(argv[1]) : 8;
    int rounds = argc > 2 ? atoi(argv[2]) : 3;
    static const char *const words[] = {"ferry", "snapshot", "resume", "the", "of", "memory",
                                        "stack", "frame", "wasm", "engine", "κ", "store", "and"};
    size_t n = (size_t)mib << 20;
    unsigned char *src = make_input(n, words, 13);
    if (!src) return 2;
    size_t cap = ZSTD_compressBound(n);
    unsigned char *dst = malloc(cap), *back = malloc(n);
    if (!dst || !back) return 2;
    static const int levels[] = {1, 3, 9};
    for (int round = 0; round < rounds; round++) {
        src[(size_t)round * 4099 % n] ^= (unsigned char)(round + 1);
        for (int l = 0; l < 3; l++) {
            size_t c = ZSTD_compress(dst, cap, src, n, levels[l]);
            if (ZSTD_isError(c)) { fprintf(stderr, "compress: %s\n", ZSTD_getErrorName(c)); return 1; }
            size_t d = ZSTD_decompress(back, n, dst, c);
            if (ZSTD_isError(d) || d != n || memcmp(back, src, n) != 0) {
                fprintf(stderr, "round trip failed at level %d\n", levels[l]);
                return 1;
            }
            printf("round %d level %d: %zu -> %zu bytes, checksum %08x\n", round, levels[l], n, c,
                   fnv(dst, c));
        }
    }
    free(src); free(dst); free(back);
    return 0;
}
