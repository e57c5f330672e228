//! WASI errno values (the subset ferry returns) and the mapping from host I/O errors.

/// A WASI preview 1 errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Errno {
    Success = 0,
    TooBig = 1,
    Access = 2,
    Badf = 8,
    Busy = 10,
    Exist = 20,
    Fault = 21,
    Fbig = 22,
    Inval = 28,
    Io = 29,
    Isdir = 31,
    Loop = 32,
    Nametoolong = 37,
    Noent = 44,
    Nospc = 51,
    Nosys = 52,
    Notdir = 54,
    Notempty = 55,
    Notsock = 57,
    Notsup = 58,
    Perm = 63,
    Pipe = 64,
    Rofs = 69,
    Spipe = 70,
    Notcapable = 76,
}

impl From<std::io::Error> for Errno {
    fn from(e: std::io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::EACCES) => Errno::Access,
            Some(libc::EBADF) => Errno::Badf,
            Some(libc::EBUSY) => Errno::Busy,
            Some(libc::EEXIST) => Errno::Exist,
            Some(libc::EINVAL) => Errno::Inval,
            Some(libc::EISDIR) => Errno::Isdir,
            Some(libc::ELOOP) => Errno::Loop,
            Some(libc::ENAMETOOLONG) => Errno::Nametoolong,
            Some(libc::ENOENT) => Errno::Noent,
            Some(libc::ENOSPC) => Errno::Nospc,
            Some(libc::ENOTDIR) => Errno::Notdir,
            Some(libc::ENOTEMPTY) => Errno::Notempty,
            Some(libc::EPERM) => Errno::Perm,
            Some(libc::EFBIG) => Errno::Fbig,
            Some(libc::EROFS) => Errno::Rofs,
            Some(libc::EPIPE) => Errno::Pipe,
            Some(libc::ESPIPE) => Errno::Spipe,
            _ => match e.kind() {
                std::io::ErrorKind::NotFound => Errno::Noent,
                std::io::ErrorKind::PermissionDenied => Errno::Access,
                std::io::ErrorKind::AlreadyExists => Errno::Exist,
                _ => Errno::Io,
            },
        }
    }
}
