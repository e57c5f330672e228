// Descriptors that outlive the names they were opened by: a file renamed while open, log
// rotation, a file replaced by a rename, a directory renamed while open, a directory listed
// in pieces, files deleted while open (a small one, and one of 3 MiB), a file with three names
// (hard links), whose device and inode numbers stay the same. Each step is followed by a busy
// spin, so that suspends land between steps.
// usage: handles DIR [spin] [8: only the last step]
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *dir;
static long spin_rounds = 20000000;

static void spin(void) {
    for (volatile long i = 0; i < spin_rounds; i++) {}
}

static const char *at(const char *name) {
    static char buf[4][512];
    static int n;
    char *b = buf[n++ % 4];
    snprintf(b, sizeof buf[0], "%s/%s", dir, name);
    return b;
}

static void put(int fd, const char *s) {
    if (write(fd, s, strlen(s)) != (ssize_t)strlen(s)) printf("  write failed: %s\n", strerror(errno));
}

static void show(const char *name) {
    char buf[256] = {0};
    int fd = open(at(name), O_RDONLY);
    if (fd < 0) {
        printf("  %s: %s\n", name, strerror(errno));
        return;
    }
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0) n = 0;
    buf[n] = 0;
    for (char *p = buf; *p; p++)
        if (*p == '\n') *p = '|';
    printf("  %s: \"%s\"\n", name, buf);
}

int main(int argc, char **argv) {
    dir = argc > 1 ? argv[1] : "/data";
    if (argc > 2) spin_rounds = atol(argv[2]);
    if (argc > 3 && atoi(argv[3]) == 8) goto links;

    printf("1. a file renamed while open keeps its writes\n");
    int a = open(at("a.txt"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    put(a, "one\n");
    spin();
    rename(at("a.txt"), at("b.txt"));
    spin();
    put(a, "two\n");
    spin();
    close(a);
    show("a.txt");
    show("b.txt");

    printf("2. log rotation: the old descriptor writes to the rotated file\n");
    int old = open(at("log"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    put(old, "x\n");
    rename(at("log"), at("log.1"));
    int cur = open(at("log"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    put(cur, "y\n");
    spin();
    put(old, "z\n");
    put(cur, "w\n");
    spin();
    close(old);
    close(cur);
    show("log");
    show("log.1");

    printf("3. a file replaced by a rename: its descriptor reads what it had\n");
    int r = open(at("cfg"), O_RDWR | O_CREAT | O_TRUNC, 0644);
    put(r, "old config\n");
    int n = open(at("cfg.new"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    put(n, "new config\n");
    close(n);
    rename(at("cfg.new"), at("cfg"));
    spin();
    char buf[64] = {0};
    lseek(r, 0, SEEK_SET);
    ssize_t got = read(r, buf, sizeof buf - 1);
    if (got < 0) printf("  old descriptor: %s\n", strerror(errno));
    else {
        for (char *p = buf; *p; p++)
            if (*p == '\n') *p = '|';
        printf("  old descriptor reads \"%s\"\n", buf);
    }
    close(r);
    show("cfg");

    printf("4. a directory renamed while open: names are looked up in it where it is now\n");
    mkdir(at("d"), 0755);
    int d = open(at("d"), O_RDONLY | O_DIRECTORY);
    spin();
    rename(at("d"), at("e"));
    spin();
    int f = openat(d, "inside", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (f < 0) printf("  openat: %s\n", strerror(errno));
    else {
        put(f, "in e\n");
        close(f);
    }
    close(d);
    show("e/inside");
    show("d/inside");

    printf("5. a directory listed in pieces\n");
    mkdir(at("many"), 0755);
    for (int i = 0; i < 60; i++) {
        char name[64];
        snprintf(name, sizeof name, "many/f%02d", i);
        close(open(at(name), O_WRONLY | O_CREAT, 0644));
    }
    DIR *dp = opendir(at("many"));
    int seen = 0, sum = 0;
    struct dirent *e;
    while ((e = readdir(dp))) {
        if (e->d_name[0] == 'f') {
            seen++;
            sum += atoi(e->d_name + 1);
        }
        if (seen % 10 == 5) spin_rounds /= 4, spin(), spin_rounds *= 4;
    }
    closedir(dp);
    printf("  %d entries, sum %d\n", seen, sum);

    printf("6. a file deleted while open\n");
    int t = open(at("tmp"), O_RDWR | O_CREAT | O_TRUNC, 0644);
    put(t, "scratch\n");
    unlink(at("tmp"));
    int t2 = open(at("tmp"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    put(t2, "another file\n");
    close(t2);
    spin();
    if (write(t, "more\n", 5) < 0) printf("  write to the deleted file: %s\n", strerror(errno));
    close(t);
    show("tmp");

    printf("7. a big file deleted while open\n");
    static char block[65536];
    int big = open(at("big"), O_RDWR | O_CREAT | O_TRUNC, 0644);
    for (int i = 0; i < 48; i++) {
        memset(block, 'a' + i % 26, sizeof block);
        if (write(big, block, sizeof block) != (ssize_t)sizeof block) printf("  write failed\n");
    }
    unlink(at("big"));
    spin();
    lseek(big, 0, SEEK_SET);
    unsigned h = 5381;
    long total = 0;
    ssize_t got_big;
    while ((got_big = read(big, block, sizeof block)) > 0) {
        total += got_big;
        for (ssize_t i = 0; i < got_big; i++) h = h * 33 + (unsigned char)block[i];
    }
    close(big);
    printf("  %ld bytes, hash %08x\n", total, h);

links:
    printf("8. a file with three names (hard links): a write through one shows through all\n");
    fflush(stdout);
    int l1 = open(at("first"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    put(l1, "through first\n");
    close(l1);
    mkdir(at("sub"), 0755);
    if (link(at("first"), at("second")) != 0) printf("  link: %s\n", strerror(errno));
    if (link(at("first"), at("sub/third")) != 0) printf("  link: %s\n", strerror(errno));
    struct stat s0;
    if (stat(at("first"), &s0) != 0) printf("  stat: %s\n", strerror(errno));
    printf("  linked\n");
    fflush(stdout);
    spin();
    int l2 = open(at("second"), O_WRONLY | O_APPEND);
    put(l2, "through second\n");
    close(l2);
    spin();
    int l3 = open(at("sub/third"), O_WRONLY | O_APPEND);
    put(l3, "through third\n");
    close(l3);
    show("first");
    struct stat s1, s2;
    if (stat(at("first"), &s1) == 0 && stat(at("sub/third"), &s2) == 0)
        printf("  one file: %s, %d links\n", s1.st_ino == s2.st_ino ? "yes" : "no", (int)s1.st_nlink);
    // Seen before the spins (and so, in the tests, before a move), again after.
    printf("  the same device and inode numbers as before: %s\n",
           s1.st_dev == s0.st_dev && s1.st_ino == s0.st_ino ? "yes" : "no");
    printf("done\n");
    return 0;
}
