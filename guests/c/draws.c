// Prints a random draw at each step, with pauses: two runs print different numbers, so a
// copy that ran part of the program twice (a take-over from an older checkpoint) would show
// different lines for the same steps.
// usage: draws [steps]
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 20;
    for (int i = 0; i < steps; i++) {
        unsigned long long r;
        if (getentropy(&r, sizeof r) != 0) {
            return 2;
        }
        usleep(30000);
        printf("step %d draw %016llx\n", i, r);
        fflush(stdout);
    }
    return 0;
}
