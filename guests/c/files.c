// File I/O in a mounted directory: create, append, seek, read back, rename, delete.
// usage: files DIR [rounds]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "/data";
    int rounds = argc > 2 ? atoi(argv[2]) : 200;
    char path[256], tmp[256];
    snprintf(path, sizeof path, "%s/log.txt", dir);
    FILE *log = fopen(path, "w");
    if (!log) { perror("open log"); return 1; }
    uint32_t h = 7;
    for (int r = 0; r < rounds; r++) {
        fprintf(log, "line %d\n", r);
        fflush(log);
        snprintf(tmp, sizeof tmp, "%s/round-%d.bin", dir, r % 5);
        FILE *f = fopen(tmp, "w+");
        if (!f) { perror("open round"); return 1; }
        for (int i = 0; i < 2000; i++) fprintf(f, "%d,", i * r);
        fseek(f, 100, SEEK_SET);
        char buf[64] = {0};
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        for (size_t i = 0; i < n; i++) h = h * 33 + (unsigned char)buf[i];
        for (volatile int spin = 0; spin < 3000000; spin++) {}
        if (r % 20 == 19) printf("round %d hash %08x\n", r, h);
    }
    fclose(log);
    snprintf(tmp, sizeof tmp, "%s/log-final.txt", dir);
    if (rename(path, tmp) != 0) { perror("rename"); return 1; }
    snprintf(tmp, sizeof tmp, "%s/round-0.bin", dir);
    remove(tmp);
    printf("done %08x\n", h);
    return 0;
}
