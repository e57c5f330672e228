// Memory that changes slowly: fill MiB of heap with pseudo-random bytes, print "ready", then
// every tick rewrite `permille`/1000 of its 64 KiB pages and sleep 100 ms.
// usage: dirty [MiB] [ticks] [permille] [seed] (a seed other than 0 makes other bytes)
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <unistd.h>

static uint64_t state = 88172645463325252ull;
static uint64_t next(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? (size_t)atoi(argv[1]) : 64;
    int ticks = argc > 2 ? atoi(argv[2]) : 50;
    int permille = argc > 3 ? atoi(argv[3]) : 10;
    if (argc > 4 && atoi(argv[4]) != 0) state ^= (uint64_t)atoi(argv[4]) * 0x9E3779B97F4A7C15ull;
    size_t bytes = mib << 20;
    uint64_t *mem = malloc(bytes);
    if (!mem) { fprintf(stderr, "cannot allocate %zu MiB\n", mib); return 2; }
    size_t words = bytes / 8;
    for (size_t i = 0; i < words; i++) mem[i] = next();
    printf("ready\n");
    fflush(stdout);
    size_t pages = bytes >> 16;
    size_t per_tick = pages * (size_t)permille / 1000;
    uint64_t sum = 0;
    for (int t = 0; t < ticks; t++) {
        for (size_t k = 0; k < per_tick; k++) {
            size_t page = next() % pages;
            size_t at = (page << 13) + (next() & 8191);
            sum += mem[at];
            mem[at] = next();
        }
        usleep(100000);
        printf("tick %d %016llx\n", t, (unsigned long long)sum);
        fflush(stdout);
    }
    // Reading everything back keeps the compiler from eliding the allocation.
    for (size_t i = 0; i < words; i++) sum ^= mem[i];
    printf("checksum %016llx\n", (unsigned long long)sum);
    return 0;
}
