// What the compression drivers (guests/{zstd,lz4,brotli}/driver.c) share: a deterministic,
// semi-compressible input and a checksum. Header-only; each driver is one program.
#ifndef FERRY_WORKLOAD_H
#define FERRY_WORKLOAD_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t rng = 2463534242u;
static uint32_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}

static uint32_t fnv(const unsigned char *p, size_t n) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

// n bytes of words (from `words`, `nw` of them), numbers and some noise; NULL if out of memory.
static unsigned char *make_input(size_t n, const char *const *words, uint32_t nw) {
    unsigned char *src = malloc(n);
    if (!src) return NULL;
    size_t at = 0;
    while (at < n) {
        char tmp[64];
        int len;
        uint32_t r = next();
        if (r % 7 == 0) len = snprintf(tmp, sizeof tmp, "%u ", next() % 100000);
        else if (r % 31 == 0) { tmp[0] = (char)(next() & 0xff); len = 1; }
        else len = snprintf(tmp, sizeof tmp, "%s ", words[r % nw]);
        if (at + (size_t)len > n) len = (int)(n - at);
        memcpy(src + at, tmp, (size_t)len);
        at += (size_t)len;
    }
    return src;
}

#endif
