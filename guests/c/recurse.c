// Deep recursion: the call stack, not just the heap, must survive a suspend.
// usage: recurse [depth] [repeats]
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>

static uint64_t walk(int depth, uint64_t acc) {
    if (depth == 0) return acc;
    volatile uint64_t local = acc * 6364136223846793005ull + (uint64_t)depth;
    uint64_t r = walk(depth - 1, local);
    return r ^ (local >> 7);
}

static int ack(int m, int n) {
    if (m == 0) return n + 1;
    if (n == 0) return ack(m - 1, 1);
    return ack(m - 1, ack(m, n - 1));
}

int main(int argc, char **argv) {
    int depth = argc > 1 ? atoi(argv[1]) : 20000;
    int repeats = argc > 2 ? atoi(argv[2]) : 30;
    for (int i = 0; i < repeats; i++) {
        uint64_t w = walk(depth, (uint64_t)i);
        int a = ack(2, 2000 + i);
        printf("repeat %d walk %016llx ack %d\n", i, (unsigned long long)w, a);
    }
    return 0;
}
