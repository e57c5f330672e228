// Prototypes for guests/sqlite/wasi_stubs.c, force-included into the SQLite shell build
// (wasi-libc does not declare them).
#include <sys/types.h>
char *realpath(const char *path, char *resolved);
int chmod(const char *path, mode_t mode);
