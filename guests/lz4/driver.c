// A compression workload over the LZ4 library (lz4.c and lz4hc.c as shipped in the PyPI sdist
// of `lz4`; BSD licence; fetched and built by scripts/fetch-programs.sh, never committed).
// usage: lz4-bench [MiB] [rounds]
// Builds a semi-compressible buffer (words, numbers, noise), then per round compresses it with
// the fast compressor and with LZ4HC at levels 4 and 9, decompresses each result, checks it,
// and prints the sizes and a checksum.
#include "workload.h"

#include "lz4.h"
#include "lz4hc.h"

int main(int argc, char **argv) {
    int mib = argc > 1 ? atoi(argv[1]) : 8;
    int rounds = argc > 2 ? atoi(argv[2]) : 3;
    static const char *const words[] = {"ferry", "snapshot", "resume", "the", "of", "memory",
                                        "stack", "frame", "wasm", "engine", "kappa", "store", "and"};
    int n = mib << 20;
    unsigned char *src = make_input((size_t)n, words, 13);
    if (!src) return 2;
    int cap = LZ4_compressBound(n);
    unsigned char *dst = malloc((size_t)cap), *back = malloc((size_t)n);
    if (!dst || !back) return 2;
    static const int levels[] = {0, 4, 9};
    for (int round = 0; round < rounds; round++) {
        src[(size_t)round * 4099 % (size_t)n] ^= (unsigned char)(round + 1);
        for (int l = 0; l < 3; l++) {
            int c = levels[l] == 0
                        ? LZ4_compress_default((const char *)src, (char *)dst, n, cap)
                        : LZ4_compress_HC((const char *)src, (char *)dst, n, cap, levels[l]);
            if (c <= 0) { fprintf(stderr, "compress failed at level %d\n", levels[l]); return 1; }
            int d = LZ4_decompress_safe((const char *)dst, (char *)back, c, n);
            if (d != n || memcmp(back, src, (size_t)n) != 0) {
                fprintf(stderr, "round trip failed at level %d\n", levels[l]);
                return 1;
            }
            printf("round %d level %d: %d -> %d bytes, checksum %08x\n", round, levels[l], n, c,
                   fnv(dst, (size_t)c));
        }
    }
    free(src); free(dst); free(back);
    return 0;
}
