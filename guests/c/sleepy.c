// Sleeps between outputs, writes to stderr too, and exits with a chosen code.
// usage: sleepy [steps] [exit-code]
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 20;
    int code = argc > 2 ? atoi(argv[2]) : 3;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < steps; i++) {
        usleep(30000);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (t1.tv_sec < t0.tv_sec || (t1.tv_sec == t0.tv_sec && t1.tv_nsec < t0.tv_nsec)) {
            printf("monotonic clock went backwards!\n");
            return 99;
        }
        t0 = t1;
        printf("tick %d\n", i);
        if (i % 4 == 0) fprintf(stderr, "warn %d\n", i);
    }
    fflush(stdout);
    return code;
}
