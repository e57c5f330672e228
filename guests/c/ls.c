// Lists /data (a benchmark guest, docs/benchmarks.md "Listing a big directory"): counts the
// entries and sums their inode numbers; with any argument it also `stat`s each entry.
#include <dirent.h>
#include <stdio.h>
#include <sys/stat.h>

int main(int argc, char **argv) {
    int also_stat = argc > 1;
    unsigned long n = 0, sum = 0;
    char path[512];
    DIR *d = opendir("/data");
    if (!d) {
        perror("/data");
        return 1;
    }
    for (struct dirent *e; (e = readdir(d));) {
        n++;
        sum += e->d_ino;
        struct stat st;
        snprintf(path, sizeof path, "/data/%s", e->d_name);
        if (also_stat && stat(path, &st) == 0) sum += st.st_ino;
    }
    closedir(d);
    printf("%lu entries\n", n);
    return 0;
}
