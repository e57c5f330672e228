//! The device and inode numbers the guest is shown, kept the same across moves.
//!
//! A file keeps its host inode number only as long as it stays on that host's disk: a resume
//! into a fresh directory, or in another space, writes the files anew, and the host gives them
//! new numbers. A guest that compares the numbers it saw before with those it sees after
//! (`tar` or `du` telling hard links apart, a walk that detects cycles, a tool that notices a
//! file was replaced) would then be misled. So the guest sees virtual numbers: a file's host
//! numbers the first time it is seen (unless another file already shows those), and the same
//! numbers ever after, carried by snapshots by path ([`ferry_object::WasiState::inodes`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use ferry_object::{InodeName, MAX_INODE_NAMES};

/// Where fresh inode numbers start, when a file's own would show another file's.
const FRESH: u64 = 1 << 48;

/// A host file's identity: device and inode.
type HostKey = (u64, u64);

/// Finds the host (device, inode) of mount-relative paths without following a final
/// symlink, as `lstat` of the whole path would, but through a descriptor of the parent
/// directory kept while consecutive paths share it (`fstatat`): names sorted by path come
/// grouped by directory, and the kernel then walks one component per name instead of the
/// whole path.
struct Lookup<'a> {
    roots: &'a [&'a Path],
    /// (Mount, parent path) and a descriptor of that directory (`None`: it cannot be opened).
    dir: Option<((u32, String), Option<std::fs::File>)>,
}

impl<'a> Lookup<'a> {
    fn new(roots: &'a [&'a Path]) -> Self {
        Self { roots, dir: None }
    }

    fn key(&mut self, mount: u32, path: &str) -> Option<HostKey> {
        let root = self.roots.get(mount as usize)?;
        if path.is_empty() {
            return std::fs::symlink_metadata(root)
                .ok()
                .map(|md| (md.dev(), md.ino()));
        }
        let (parent, name) = path.rsplit_once('/').unwrap_or(("", path));
        if self
            .dir
            .as_ref()
            .is_none_or(|((m, p), _)| *m != mount || p != parent)
        {
            let at = if parent.is_empty() {
                root.to_path_buf()
            } else {
                root.join(parent)
            };
            self.dir = Some(((mount, parent.to_owned()), std::fs::File::open(at).ok()));
        }
        let dir = self.dir.as_ref()?.1.as_ref()?;
        let name = std::ffi::CString::new(name).ok()?;
        use std::os::fd::AsRawFd;
        // SAFETY: `st` is ours and written by the call; `name` is a NUL-terminated string
        // that outlives it; `dir` is an open descriptor.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            let r = libc::fstatat(
                dir.as_raw_fd(),
                name.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            );
            (r == 0).then_some((st.st_dev, st.st_ino))
        }
    }
}

/// The virtual numbers of one guest's files.
///
/// Most files take no room: a file shows its host inode number on the device its host device
/// is shown as, computed each time, unless a restored file already shows that pair (then it
/// gets a fresh number, kept in the table). This holds on a *simple* host device — shown as
/// one device, which no other host device is shown as — and those are all devices but the
/// ones a restore finds sharing a shown device (two mounts once on different devices now on
/// one, or the other way round): those keep every file's numbers in the table, so that no
/// two files show the same. So the table holds the restored numbers that differ from what
/// would be computed (at most [`MAX_INODE_NAMES`]), the fresh numbers given where a file
/// would show a restored one (at most one per restored number), and the files of shared
/// devices.
#[derive(Debug, Default)]
pub(crate) struct Inodes {
    /// Host identity → the (device, inode) the guest is shown, where it is not computed.
    shown: HashMap<HostKey, (u64, u64)>,
    /// The (device, inode) pairs of `shown`: a computed pair must not be one of them.
    taken: HashSet<(u64, u64)>,
    /// (Mount, host device) → the device the guest is shown for it.
    devs: HashMap<(u32, u64), u64>,
    /// Host device → the device it is shown as in the mount that showed it first.
    first_dev: HashMap<u64, u64>,
    /// Devices shown: a host device seen for the first time is shown as one of its own.
    claimed: HashSet<u64>,
    /// Host devices that share a shown device (found by a restore): each file's numbers are
    /// kept in `shown`.
    shared: HashSet<u64>,
    /// (Mount, path) → the host file last seen there: how a capture finds each file again.
    names: BTreeMap<(u32, String), HostKey>,
    /// Counter for fresh inode numbers.
    next: u64,
}

impl Inodes {
    /// The (device, inode) the guest is shown for the host file `md`, found in mount `mount`
    /// at `path` when the path is known to name it.
    pub(crate) fn show(
        &mut self,
        mount: u32,
        path: Option<&str>,
        md: &std::fs::Metadata,
    ) -> (u64, u64) {
        self.show_key(mount, path, (md.dev(), md.ino()))
    }

    /// [`Self::show`] for a host (device, inode) pair.
    pub(crate) fn show_key(&mut self, mount: u32, path: Option<&str>, key: HostKey) -> (u64, u64) {
        if let Some(p) = path {
            let name = (mount, p.to_owned());
            if self.names.len() < MAX_INODE_NAMES || self.names.contains_key(&name) {
                self.names.insert(name, key);
            }
        }
        if let Some(v) = self.shown.get(&key) {
            return *v;
        }
        let dev = self.dev(mount, key.0);
        let mut v = (dev, key.1);
        if !self.shared.contains(&key.0) && key.1 < FRESH && !self.taken.contains(&v) {
            // No other file can show `v`: other host devices are shown as other devices,
            // `taken` holds every pair given out here otherwise, and a fresh number is at
            // least FRESH. Nor will one later: `taken` only gains fresh numbers now.
            return v;
        }
        while self.taken.contains(&v) {
            self.next += 1;
            v = (dev, FRESH + self.next);
        }
        self.taken.insert(v);
        self.shown.insert(key, v);
        v
    }

    /// The device the guest is shown for host device `host` in `mount`: the one it is shown
    /// as in another mount, else its own number unless that is shown already (then the
    /// next one that is not).
    fn dev(&mut self, mount: u32, host: u64) -> u64 {
        if let Some(d) = self.devs.get(&(mount, host)) {
            return *d;
        }
        let d = match self.first_dev.get(&host) {
            Some(d) => *d,
            None => {
                let mut d = host;
                while self.claimed.contains(&d) {
                    d = d.wrapping_add(1);
                }
                self.claimed.insert(d);
                self.first_dev.insert(host, d);
                d
            }
        };
        self.devs.insert((mount, host), d);
        d
    }

    /// The numbers file `key`, already shown (perhaps in another mount than `mount`: the
    /// guest renamed it there), shows.
    fn shown_of(&self, mount: u32, key: HostKey) -> (u64, u64) {
        if let Some(v) = self.shown.get(&key) {
            return *v;
        }
        let dev = self
            .devs
            .get(&(mount, key.0))
            .or_else(|| self.first_dev.get(&key.0));
        (dev.copied().unwrap_or(key.0), key.1)
    }

    /// The guest renamed `from` to `to` (each a mount and a path in it): what was named under
    /// `from` is now under `to`, and what `to` named is gone.
    pub(crate) fn renamed(&mut self, from: (u32, &str), to: (u32, &str)) {
        self.remove_under(to.0, to.1);
        let moved = self.remove_under(from.0, from.1);
        for (p, key) in moved {
            let rest = &p[from.1.len()..];
            self.names.insert((to.0, format!("{}{rest}", to.1)), key);
        }
    }

    /// The guest removed `path` in `mount` (a file, or an empty directory).
    pub(crate) fn removed(&mut self, mount: u32, path: &str) {
        self.names.remove(&(mount, path.to_owned()));
    }

    /// Forgets the names `path` and everything under it in `mount`, returning them.
    fn remove_under(&mut self, mount: u32, path: &str) -> Vec<(String, HostKey)> {
        let mut gone = Vec::new();
        if let Some(k) = self.names.remove(&(mount, path.to_owned())) {
            gone.push((path.to_owned(), k));
        }
        let prefix = if path.is_empty() {
            String::new()
        } else {
            format!("{path}/")
        };
        let under: Vec<String> = self
            .names
            .range((mount, prefix.clone())..)
            .take_while(|((m, p), _)| *m == mount && p.starts_with(&prefix))
            .map(|((_, p), _)| p.clone())
            .collect();
        for p in under {
            if let Some(k) = self.names.remove(&(mount, p.clone())) {
                gone.push((p, k));
            }
        }
        gone
    }

    /// What a snapshot keeps: each name that still leads to the file last seen there (not
    /// following a final symlink), with the numbers the guest was shown. `roots` are the
    /// mounts' host directories, in mount order; each mount's own directory is always kept,
    /// so that its device number is too.
    pub(crate) fn capture(&mut self, roots: &[&Path]) -> Vec<InodeName> {
        for (i, root) in roots.iter().enumerate() {
            if let Ok(md) = std::fs::metadata(root) {
                self.show(i as u32, Some(""), &md);
            }
        }
        let mut kept = Vec::new();
        let mut stale = Vec::new();
        let mut lookup = Lookup::new(roots);
        for ((mount, path), key) in &self.names {
            if lookup.key(*mount, path) != Some(*key) {
                // Removed or replaced by another program: forgotten, so that names do not
                // pile up.
                stale.push((*mount, path.clone()));
                continue;
            }
            let (dev, ino) = self.shown_of(*mount, *key);
            kept.push(InodeName {
                mount: *mount,
                path: path.clone(),
                dev,
                ino,
            });
        }
        for name in stale {
            self.names.remove(&name);
        }
        kept
    }

    /// The numbers a snapshot kept ([`Self::capture`]), for the files now at those paths under
    /// `roots`. Names that lead nowhere now are passed over, and so is a name whose numbers
    /// another file already shows; the guest sees fresh numbers for those files.
    pub(crate) fn restore(kept: &[InodeName], roots: &[&Path]) -> Result<Self, String> {
        if kept.len() > MAX_INODE_NAMES {
            return Err(format!(
                "the snapshot keeps inode numbers for {} names (at most {MAX_INODE_NAMES})",
                kept.len()
            ));
        }
        let mut me = Self::default();
        let mut lookup = Lookup::new(roots);
        // Each mount's own directory first: it gives the mount's device number.
        let mut order: Vec<&InodeName> = kept.iter().collect();
        order.sort_by_key(|n| !n.path.is_empty());
        for n in order {
            if !n.path.is_empty() && crate::path::join("", &n.path).is_err() {
                return Err(format!(
                    "the snapshot keeps an inode number for an unsafe path `{}`",
                    n.path
                ));
            }
            if roots.get(n.mount as usize).is_none() {
                return Err(format!(
                    "the snapshot keeps an inode number in mount {}, which does not exist",
                    n.mount
                ));
            }
            let Some(key) = lookup.key(n.mount, &n.path) else {
                continue;
            };
            me.devs.entry((n.mount, key.0)).or_insert(n.dev);
            let v = (n.dev, n.ino);
            match me.shown.get(&key) {
                Some(_) => {}
                None if me.taken.contains(&v) => continue,
                None => {
                    me.shown.insert(key, v);
                    me.taken.insert(v);
                }
            }
            me.names.insert((n.mount, n.path.clone()), key);
        }
        me.settle();
        Ok(me)
    }

    /// Once the restored numbers are in: finds the host devices that share a shown device,
    /// and forgets the restored numbers that [`Self::show_key`] computes the same.
    fn settle(&mut self) {
        let mut shown_as: HashMap<u64, HashSet<u64>> = HashMap::new();
        let mut shown_for: HashMap<u64, HashSet<u64>> = HashMap::new();
        let mut devs: Vec<_> = self.devs.iter().map(|(&(m, h), &d)| (m, h, d)).collect();
        devs.sort_unstable();
        for &(_, host, dev) in &devs {
            shown_as.entry(host).or_default().insert(dev);
            shown_for.entry(dev).or_default().insert(host);
            self.first_dev.entry(host).or_insert(dev);
            self.claimed.insert(dev);
        }
        for (host, as_) in &shown_as {
            if as_.len() > 1 || as_.iter().any(|d| shown_for[d].len() > 1) {
                self.shared.insert(*host);
            }
        }
        self.claimed.extend(self.shown.values().map(|v| v.0));
        let (shared, first_dev) = (&self.shared, &self.first_dev);
        self.shown.retain(|key, v| {
            shared.contains(&key.0)
                || key.1 >= FRESH
                || first_dev.get(&key.0).is_none_or(|d| *v != (*d, key.1))
        });
        self.taken = self.shown.values().copied().collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_keeps_its_numbers_and_no_two_files_share_them() {
        let mut i = Inodes::default();
        assert_eq!(i.show_key(0, Some("a"), (5, 10)), (5, 10));
        assert_eq!(i.show_key(0, Some("a"), (5, 10)), (5, 10));
        // As after a resume onto device 7: file (7, 10) shows (5, 10), so the device shows
        // as 5, and a new file whose own inode number 10 or 21 is taken gets a fresh one.
        let mut j = Inodes::default();
        j.shown.insert((7, 10), (5, 10));
        j.devs.insert((0, 7), 5);
        j.settle();
        assert_eq!(j.show_key(0, Some("b"), (7, 11)), (5, 11));
        assert_eq!(j.show_key(0, Some("c"), (7, 20)), (5, 20));
        assert_eq!(j.show_key(0, Some("c2"), (7, 10)), (5, 10));
        j.taken.insert((5, 21));
        assert_eq!(j.show_key(0, Some("d"), (7, 21)), (5, FRESH + 1));
        assert_eq!(j.show_key(0, Some("b"), (7, 11)), (5, 11));
    }

    /// Files show numbers computed from their host ones and take no room, moved or not; the
    /// table holds what differs, and every file of host devices that share a shown device.
    #[test]
    fn most_files_take_no_room() {
        let mut i = Inodes::default();
        for ino in 0..1000 {
            assert_eq!(i.show_key(0, None, (5, ino)), (5, ino));
        }
        assert!(i.shown.is_empty() && i.taken.is_empty());
        // Moved: mount 0 was on device 5 and is now on 7; its file written anew as inode 20
        // showed (5, 10).
        let mut m = Inodes::default();
        m.shown.insert((7, 2), (5, 2));
        m.shown.insert((7, 20), (5, 10));
        m.devs.insert((0, 7), 5);
        m.settle();
        assert_eq!(m.shown.len(), 1, "(7, 2) shows what would be computed");
        for ino in 0..1000 {
            let want = match ino {
                10 => (5, FRESH + 1),
                20 => (5, 10),
                _ => (5, ino),
            };
            assert_eq!(m.show_key(0, None, (7, ino)), want);
        }
        assert_eq!(m.show_key(0, None, (7, 20)), (5, 10));
        assert_eq!(m.show_key(0, None, (7, 10)), (5, FRESH + 1));
        assert_eq!(
            m.shown.len(),
            2,
            "the restored number and the one fresh number"
        );
        // A host device first seen now, whose number is shown for another: another one.
        assert_eq!(m.show_key(0, None, (5, 1)), (6, 1));
        assert_eq!(m.show_key(1, None, (5, 2)), (6, 2));
        assert_eq!(m.shown.len(), 2);

        // Shared: mount 0 was on device 5 and is now on 7; mount 1 is on 5 and kept its
        // numbers; mount 2 on 9 and kept its numbers too.
        let mut j = Inodes::default();
        j.shown.insert((7, 10), (5, 10));
        j.shown.insert((5, 3), (5, 3));
        j.shown.insert((9, 4), (9, 4));
        j.devs.extend([((0, 7), 5), ((1, 5), 5), ((2, 9), 9)]);
        j.settle();
        assert_eq!(j.shown.len(), 2, "(9, 4) needs no room");
        assert_eq!(j.show_key(1, None, (5, 10)), (5, FRESH + 1));
        assert_eq!(j.show_key(0, None, (7, 3)), (5, FRESH + 2));
        assert_eq!(j.show_key(1, None, (5, 3)), (5, 3));
        assert_eq!(j.show_key(0, None, (7, 11)), (5, 11));
        assert_eq!(j.show_key(1, None, (5, 11)), (5, FRESH + 3));
        assert_eq!(j.show_key(2, None, (9, 11)), (9, 11));
        assert_eq!(j.show_key(2, None, (9, 4)), (9, 4));
        assert_eq!(j.shown.len(), 6);
    }

    /// A capture keeps the names that still lead to the file seen there and forgets the
    /// others (removed, or replaced by another program).
    #[test]
    fn a_capture_forgets_names_that_lead_elsewhere() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        for f in ["a", "b", "c"] {
            std::fs::write(root.join(f), f).unwrap();
        }
        let mut i = Inodes::default();
        for f in ["a", "b", "c"] {
            i.show(0, Some(f), &std::fs::metadata(root.join(f)).unwrap());
        }
        std::fs::remove_file(root.join("b")).unwrap();
        // Made while `c` still holds its inode, so the new file cannot be given that one.
        std::fs::write(root.join("c.new"), "new").unwrap();
        std::fs::rename(root.join("c.new"), root.join("c")).unwrap();
        let kept: Vec<String> = i.capture(&[root]).into_iter().map(|n| n.path).collect();
        assert_eq!(kept, ["", "a"]);
        let names: Vec<&str> = i.names.keys().map(|(_, p)| p.as_str()).collect();
        assert_eq!(names, ["", "a"]);
    }

    #[test]
    fn renames_move_the_names_under_them() {
        let mut i = Inodes::default();
        i.show_key(0, Some("d/x"), (1, 1));
        i.show_key(0, Some("d/y/z"), (1, 2));
        i.show_key(0, Some("dz"), (1, 3));
        i.show_key(0, Some("e"), (1, 4));
        i.renamed((0, "d"), (0, "e"));
        let names: Vec<_> = i.names.keys().map(|(_, p)| p.as_str()).collect();
        assert_eq!(names, ["dz", "e/x", "e/y/z"]);
    }
}
