// Heap growth: allocate MiB by MiB up to a target, fill, and checksum repeatedly.
// usage: heap [MiB] [passes]
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>

int main(int argc, char **argv) {
    int mib = argc > 1 ? atoi(argv[1]) : 256;
    int passes = argc > 2 ? atoi(argv[2]) : 4;
    uint32_t **blocks = calloc((size_t)mib, sizeof *blocks);
    const size_t words = (1u << 20) / sizeof(uint32_t);
    for (int b = 0; b < mib; b++) {
        blocks[b] = malloc(words * sizeof(uint32_t));
        if (!blocks[b]) { fprintf(stderr, "out of memory at %d MiB\n", b); return 2; }
        for (size_t i = 0; i < words; i++) blocks[b][i] = (uint32_t)(b * 2654435761u) ^ (uint32_t)i;
        if (b % 32 == 31) printf("allocated %d MiB\n", b + 1);
    }
    for (int p = 0; p < passes; p++) {
        uint32_t h = 0;
        for (int b = 0; b < mib; b++)
            for (size_t i = 0; i < words; i++) {
                blocks[b][i] += (uint32_t)p;
                h = h * 31 + blocks[b][i];
            }
        printf("pass %d checksum %08x\n", p, h);
    }
    return 0;
}
