// Reads stdin line by line, working on each: stdin consumed before a suspend must not be
// read again after the resume, nor lost. `lines [SPIN]`: the work per line (a busy loop of
// SPIN rounds, 30,000,000 when not given).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 30000000;
    char line[256];
    uint32_t h = 5381;
    int n = 0;
    while (fgets(line, sizeof line, stdin)) {
        for (size_t i = 0; line[i]; i++) h = h * 33 + (unsigned char)line[i];
        for (volatile int spin = 0; spin < rounds; spin++) {}
        printf("line %d: %zu bytes, hash %08x\n", ++n, strlen(line), h);
        fflush(stdout);
    }
    printf("done %d lines\n", n);
    return 0;
}
