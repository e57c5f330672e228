//! Resolving guest paths inside a mount without ever leaving it.
//!
//! A guest path is resolved lexically against the directory fd's path inside its mount:
//! absolute paths are refused, `.` is dropped, `..` pops a component and is refused when it
//! would climb above the directory fd the path is resolved against (so never out of the
//! mount). The host path is then checked again after symlinks are
//! followed (canonicalized), so a symlink inside the mount pointing outside is refused too.

use std::path::{Path, PathBuf};

use crate::Errno;

/// Joins `rel` onto `base` (both mount-relative, `/`-separated), refusing escapes.
pub(crate) fn join(base: &str, rel: &str) -> Result<String, Errno> {
    if rel.starts_with('/') {
        return Err(Errno::Notcapable);
    }
    if rel.contains('\0') {
        return Err(Errno::Inval);
    }
    let mut parts: Vec<&str> = base.split('/').filter(|s| !s.is_empty()).collect();
    // A path may not climb above the directory it is resolved against (as in WASI's
    // capability model): `..` only pops what `rel` itself pushed.
    let floor = parts.len();
    for seg in rel.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                if parts.len() == floor {
                    return Err(Errno::Notcapable);
                }
                parts.pop();
            }
            s => parts.push(s),
        }
    }
    Ok(parts.join("/"))
}

/// The host path of a mount-relative path, checked to stay inside `root` (canonical) once
/// symlinks are resolved. With `follow_last == false` the last component itself is not
/// followed (it may be a symlink or not exist yet).
pub(crate) fn host_path(root: &Path, rel: &str, follow_last: bool) -> Result<PathBuf, Errno> {
    let full = if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    };
    let (check, tail) = if follow_last || rel.is_empty() {
        (full.clone(), None)
    } else {
        (
            full.parent().map(Path::to_path_buf).unwrap_or_default(),
            full.file_name(),
        )
    };
    match check.canonicalize() {
        Ok(c) => {
            if !c.starts_with(root) {
                return Err(Errno::Notcapable);
            }
            Ok(match tail {
                Some(t) => c.join(t),
                None => c,
            })
        }
        // A missing path cannot point anywhere; its parent is checked by the caller's call.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = check.parent().map(Path::canonicalize);
            if let Some(Ok(c)) = parent
                && !c.starts_with(root)
            {
                return Err(Errno::Notcapable);
            }
            Ok(full)
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexical_escapes_are_refused() {
        assert_eq!(join("", "a/b/../c"), Ok("a/c".into()));
        assert_eq!(join("a", "b/../c"), Ok("a/c".into()));
        assert_eq!(
            join("a", "../b"),
            Err(Errno::Notcapable),
            "above the directory fd"
        );
        assert_eq!(join("a", "../../b"), Err(Errno::Notcapable));
        assert_eq!(join("", "/etc/passwd"), Err(Errno::Notcapable));
        assert_eq!(join("", "./x/."), Ok("x".into()));
    }

    #[test]
    fn symlink_escapes_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("m");
        std::fs::create_dir(&root).unwrap();
        let root = root.canonicalize().unwrap();
        std::os::unix::fs::symlink("/etc", root.join("out")).unwrap();
        assert_eq!(host_path(&root, "out/passwd", true), Err(Errno::Notcapable));
        assert!(
            host_path(&root, "out", false).is_ok(),
            "the link itself may be removed"
        );
        assert!(host_path(&root, "new-file", true).is_ok());
    }
}
