// CPU-bound loop: a sieve and a checksum, printing progress lines.
// usage: cpu [rounds]
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>

static uint32_t mix(uint32_t h, uint32_t v) {
    h ^= v + 0x9e3779b9u + (h << 6) + (h >> 2);
    return h;
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 40;
    enum { N = 200000 };
    static unsigned char composite[N];
    uint32_t h = 1;
    for (int r = 0; r < rounds; r++) {
        for (int i = 0; i < N; i++) composite[i] = 0;
        int count = 0;
        for (int i = 2; i < N; i++) {
            if (composite[i]) continue;
            count++;
            h = mix(h, (uint32_t)i * (uint32_t)(r + 1));
            for (int j = 2 * i; j < N; j += i) composite[j] = 1;
        }
        for (int k = 0; k < 8000000; k++) h = mix(h, (uint32_t)k);
        printf("round %d primes %d hash %08x\n", r, count, h);
    }
    return 0;
}
