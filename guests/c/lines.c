// Reads stdin line by line, working on each: stdin consumed before a suspend must not be
// read again after the resume, nor lost.
#include <stdio.h>
#include <string.h>
#include <stdint.h>

int main(void) {
    char line[256];
    uint32_t h = 5381;
    int n = 0;
    while (fgets(line, sizeof line, stdin)) {
        for (size_t i = 0; line[i]; i++) h = h * 33 + (unsigned char)line[i];
        for (volatile int spin = 0; spin < 30000000; spin++) {}
        printf("line %d: %zu bytes, hash %08x\n", ++n, strlen(line), h);
        fflush(stdout);
    }
    printf("done %d lines\n", n);
    return 0;
}
