// Updates a big file in a mounted directory in place, a few 4 KiB pages at a time, as a
// database does. usage: pages FILE [mib] [rounds] [spin]
// Writes FILE (MIB MiB of pseudo-random bytes, MIB >= 2), then each round rewrites 8 pages
// (seven in the first 2 MiB, one in turn through the file) and reads a random one back; prints a running hash every 50 rounds and
// at the end. Deterministic: the same arguments give the same output and the same file.
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static uint64_t state = 88172645463325252ull;
static uint32_t next(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 32);
}

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : "/data/db.bin";
    long mib = argc > 2 ? atol(argv[2]) : 8;
    int rounds = argc > 3 ? atoi(argv[3]) : 400;
    int spin = argc > 4 ? atoi(argv[4]) : 1000000; // busy work per round (0: all I/O)
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) { perror("open"); return 1; }
    static uint8_t block[1 << 20];
    for (long m = 0; m < mib; m++) {
        for (size_t i = 0; i < sizeof block; i += 4) {
            uint32_t v = next();
            block[i] = v; block[i + 1] = v >> 8; block[i + 2] = v >> 16; block[i + 3] = v >> 24;
        }
        if (write(fd, block, sizeof block) != (ssize_t)sizeof block) { perror("write"); return 1; }
    }
    long pages = mib * 256;
    uint32_t h = 7;
    uint8_t page[4096];
    for (int r = 0; r < rounds; r++) {
        for (int k = 0; k < 8; k++) {
            // Seven pages in the first 2 MiB (an index's upper pages), one further on each
            // round (the table's pages, in turn).
            off_t at = k < 7 ? (off_t)(next() % 512) * 4096 : (off_t)(r % pages) * 4096;
            for (size_t i = 0; i < sizeof page; i++) page[i] = (uint8_t)(r + k + i);
            if (pwrite(fd, page, sizeof page, at) != (ssize_t)sizeof page) { perror("pwrite"); return 1; }
        }
        off_t at = (off_t)(next() % pages) * 4096;
        if (pread(fd, page, sizeof page, at) != (ssize_t)sizeof page) { perror("pread"); return 1; }
        for (size_t i = 0; i < sizeof page; i += 64) h = h * 33 + page[i];
        for (volatile int s = 0; s < spin; s++) {}
        if (r % 50 == 49) printf("round %d hash %08x\n", r, h);
    }
    close(fd);
    printf("done %08x\n", h);
    return 0;
}
