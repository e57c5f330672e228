// Functions the SQLite shell links against that WASI preview 1 does not provide.
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

// No symlink resolution in the shell's uses (file names for .open/.import): the path as given.
char *realpath(const char *path, char *resolved) {
    if (!path) { errno = EINVAL; return NULL; }
    size_t n = strlen(path);
    if (n >= PATH_MAX) { errno = ENAMETOOLONG; return NULL; }
    char *out = resolved ? resolved : malloc(PATH_MAX);
    if (!out) { errno = ENOMEM; return NULL; }
    memcpy(out, path, n + 1);
    return out;
}

// WASI p1 has no permission bits.
int chmod(const char *path, mode_t mode) { (void)path; (void)mode; return 0; }
