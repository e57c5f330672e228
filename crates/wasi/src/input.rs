//! Input that arrives while the guest runs: the stdin of an interactive session of a space
//! (`ferry --space URL run --interactive`, `ferry --space URL attach`), or of a snapshot of
//! one resumed by a local `ferry resume`.
//!
//! An [`InputLog`] holds every byte sent so far, in order, and whether the sender has ended
//! it. The guest reads it from its position ([`WasiCtx`](crate::WasiCtx)'s `stdin_bytes`);
//! a read with nothing there waits — and can be suspended meanwhile, as a wait for a
//! terminal can. A snapshot carries the whole log received so far (`WasiState::stdin_input`,
//! with `stdin_open` while more may come) — up to 1 MiB as a blob, over it as a
//! [`FileChunks`] of 1 MiB pieces ([`store_log`], `stdin_chunked`), so a snapshot taken after
//! more input arrived stores only the new pieces —, so input sent but not yet read goes with
//! the guest wherever it moves: nothing the sender was told arrived is lost by a suspend.

use std::io::Read;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry_kappa::Kappa;
use ferry_object::{FILE_CHUNK_SIZE, FileChunks};
use ferry_store::{Store, StoreError};

/// The most input one session's stdin takes in all (as `run --stdin FILE`): every snapshot
/// carries it whole.
pub const MAX_INPUT: u64 = 1 << 30;

/// Why the input a snapshot carries cannot be read ([`StoredInput::read`]).
#[derive(Debug, thiserror::Error)]
pub enum StoredInputError {
    #[error("the stored input cannot be read: {0}")]
    Store(#[from] StoreError),
    #[error("the stored input {0} is malformed: {1}")]
    Malformed(Kappa, String),
}

/// Where a snapshot's stdin input is stored (`WasiState::stdin_input`, `stdin_chunked`): a
/// blob, or a [`FileChunks`] of 1 MiB pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredInput {
    pub kappa: Kappa,
    pub chunked: bool,
}

impl StoredInput {
    /// The input `state` carries, if any.
    pub fn of(state: &ferry_object::WasiState) -> Option<Self> {
        state.stdin_input.map(|kappa| Self {
            kappa,
            chunked: state.stdin_chunked,
        })
    }

    /// A blob's.
    pub fn blob(kappa: Kappa) -> Self {
        Self {
            kappa,
            chunked: false,
        }
    }

    /// The bytes: the blob, or the pieces joined. Refuses more than [`MAX_INPUT`] bytes and
    /// pieces that do not add up to the length their list gives.
    pub fn read(&self, store: &dyn Store) -> Result<Vec<u8>, StoredInputError> {
        let malformed = |why: String| StoredInputError::Malformed(self.kappa, why);
        if !self.chunked {
            let data = store.get(&self.kappa)?;
            if data.len() as u64 > MAX_INPUT {
                return Err(malformed(format!("over {MAX_INPUT} bytes")));
            }
            return Ok(data);
        }
        let file = self.pieces(store)?;
        let mut data = Vec::with_capacity(file.len as usize);
        for (i, c) in file.chunks.iter().enumerate() {
            let piece = store.get(c)?;
            if piece.len() as u64 != file.chunk_len(i) {
                return Err(malformed(format!(
                    "piece {i} has {} bytes, not {}",
                    piece.len(),
                    file.chunk_len(i)
                )));
            }
            data.extend_from_slice(&piece);
        }
        Ok(data)
    }

    /// The list of pieces of chunked input, checked to add up and to hold at most
    /// [`MAX_INPUT`] bytes.
    fn pieces(&self, store: &dyn Store) -> Result<FileChunks, StoredInputError> {
        let malformed = |why: String| StoredInputError::Malformed(self.kappa, why);
        let file: FileChunks =
            ferry_object::decode(&store.get(&self.kappa)?).map_err(|e| malformed(e.to_string()))?;
        file.check().map_err(malformed)?;
        if file.len > MAX_INPUT {
            return Err(malformed(format!("{} bytes, over {MAX_INPUT}", file.len)));
        }
        Ok(file)
    }

    /// Its full pieces (every piece but a shorter last one): what [`store_log`] need not
    /// store again for a run resumed from it. Empty for a blob, or when the list cannot be
    /// read (every piece is then stored afresh).
    pub fn full_pieces(&self, store: &dyn Store) -> Vec<Kappa> {
        if !self.chunked {
            return Vec::new();
        }
        let Ok(file) = self.pieces(store) else {
            return Vec::new();
        };
        let full = (file.len / u64::from(FILE_CHUNK_SIZE)) as usize;
        file.chunks.into_iter().take(full).collect()
    }
}

/// Stores what `log` holds now for a snapshot; returns where (a [`FileChunks`] over 1 MiB)
/// and whether the log was ended. `pieces` are the κ of full 1 MiB pieces
/// already stored, from the start of the log (by this run's snapshots, or carried by the
/// snapshot it resumed): each is kept if the store still has it, and the full pieces beyond
/// them are stored and added. Only the log's new bytes (and a shorter last piece) are hashed,
/// whatever its length. The log only grows, so the pieces of its first bytes never change.
pub fn store_log(
    store: &dyn Store,
    log: &InputLog,
    pieces: &mut Vec<Kappa>,
) -> Result<(StoredInput, bool), StoreError> {
    let (len, ended) = log.len();
    let size = u64::from(FILE_CHUNK_SIZE);
    if len <= size {
        let (data, _) = log.contents_from(0, len as usize);
        return Ok((StoredInput::blob(store.put(&data)?), ended));
    }
    let full = (len / size) as usize;
    pieces.truncate(full);
    // A piece the store lost (a collection that did not see this run) is stored again.
    if let Some(gone) = pieces.iter().position(|p| !store.has(p).unwrap_or(false)) {
        pieces.truncate(gone);
    }
    // New full pieces go to the store 16 at a time (packed, hashed on both cores).
    while pieces.len() < full {
        let batch: Vec<Vec<u8>> = (pieces.len()..full.min(pieces.len() + 16))
            .map(|i| log.contents_from(i as u64 * size, size as usize).0)
            .collect();
        let batch: Vec<&[u8]> = batch.iter().map(Vec::as_slice).collect();
        pieces.extend(store.put_many(&batch)?);
    }
    let mut chunks = pieces.clone();
    if len % size != 0 {
        let (piece, _) = log.contents_from(full as u64 * size, (len % size) as usize);
        chunks.push(store.put(&piece)?);
    }
    let kappa = store.put(&ferry_object::encode(&FileChunks::new(len, chunks)))?;
    Ok((
        StoredInput {
            kappa,
            chunked: true,
        },
        ended,
    ))
}

/// Why input was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    /// The sender ended the input before.
    #[error("its stdin was ended before")]
    Ended,
    /// Taking it would pass [`MAX_INPUT`].
    #[error("its stdin would pass {MAX_INPUT} bytes ({0} already)")]
    TooMuch(u64),
    /// The log is sealed while a move of its session is under way.
    #[error("it is being moved")]
    Sealed,
    /// The sender's bytes start past the end of what was received (at the length given):
    /// something it sent before is missing.
    #[error("the input received so far ends at byte {0}, before where this starts")]
    Gap(u64),
    /// The sender's bytes overlap what was received (up to the length given) but differ
    /// from it: another sender's input is there.
    #[error("other input was received up to byte {0}")]
    Differs(u64),
}

#[derive(Debug, Default)]
struct Inner {
    data: Vec<u8>,
    ended: bool,
    sealed: bool,
    starving: Option<Starving>,
}

/// What [`InputLog::wait`] calls when it finds nothing to read ([`InputLog::on_starving`]).
#[derive(Clone)]
struct Starving(Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for Starving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Starving")
    }
}

/// A growing stdin: what was sent so far and whether it has ended. Clones share it.
#[derive(Debug, Clone, Default)]
pub struct InputLog(Arc<(Mutex<Inner>, Condvar)>);

impl InputLog {
    /// A log holding `data`, ended or open for more.
    pub fn new(data: Vec<u8>, ended: bool) -> Self {
        Self(Arc::new((
            Mutex::new(Inner {
                data,
                ended,
                sealed: false,
                starving: None,
            }),
            Condvar::new(),
        )))
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.0.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends `bytes` (and ends the input when `end`); returns the length received since
    /// the start. With `at`, the bytes are those of the input from byte `at` on: what of
    /// them was received already (a sender repeating a piece whose answer it never got) must
    /// match and is taken once, and a start past the end is refused — so a sender that
    /// repeats what it is not sure arrived neither loses nor doubles any. `check(had, new)`
    /// runs under the log's lock before anything changes, with the bytes to be appended at
    /// `had` (a space writes them to its disk there, so that nothing is taken that a crash
    /// could lose); its error changes nothing.
    pub fn append<E: From<InputError>>(
        &self,
        at: Option<u64>,
        bytes: &[u8],
        end: bool,
        check: impl FnOnce(u64, &[u8]) -> Result<(), E>,
    ) -> Result<u64, E> {
        let mut g = self.inner();
        let had = g.data.len() as u64;
        let start = at.unwrap_or(had);
        if start > had {
            return Err(InputError::Gap(had).into());
        }
        // What of `bytes` is there already.
        let overlap = ((had - start) as usize).min(bytes.len());
        let from = start as usize;
        if g.data[from..from + overlap] != bytes[..overlap] {
            return Err(InputError::Differs(had).into());
        }
        let new = &bytes[overlap..];
        if new.is_empty() && (!end || g.ended) {
            return Ok(had);
        }
        if g.ended {
            return Err(InputError::Ended.into());
        }
        if g.sealed {
            return Err(InputError::Sealed.into());
        }
        if had + new.len() as u64 > MAX_INPUT {
            return Err(InputError::TooMuch(had).into());
        }
        check(had, new)?;
        g.data.extend_from_slice(new);
        g.ended |= end;
        self.0.1.notify_all();
        Ok(g.data.len() as u64)
    }

    /// Refuses input from now on ([`InputError::Sealed`]) until [`InputLog::unseal`]: a move
    /// takes the log as it is then.
    pub fn seal(&self) {
        self.inner().sealed = true;
    }

    pub fn unseal(&self) {
        self.inner().sealed = false;
    }

    /// Bytes received so far, and whether the input has ended.
    pub fn len(&self) -> (u64, bool) {
        let g = self.inner();
        (g.data.len() as u64, g.ended)
    }

    /// Whether nothing was received yet.
    pub fn is_empty(&self) -> bool {
        self.inner().data.is_empty()
    }

    /// A copy of everything received, and whether the input has ended.
    pub fn contents(&self) -> (Vec<u8>, bool) {
        let g = self.inner();
        (g.data.clone(), g.ended)
    }

    /// A copy of at most `max` bytes of what was received from byte `pos` on (nothing if
    /// `pos` is past the end), and whether the input has ended after them.
    pub fn contents_from(&self, pos: u64, max: usize) -> (Vec<u8>, bool) {
        let g = self.inner();
        let from = usize::try_from(pos).unwrap_or(usize::MAX).min(g.data.len());
        let to = from.saturating_add(max).min(g.data.len());
        (g.data[from..to].to_vec(), g.ended && to == g.data.len())
    }

    /// Whether the log holds `prefix` at its start.
    pub fn starts_with(&self, prefix: &[u8]) -> bool {
        self.inner().data.starts_with(prefix)
    }

    /// Calls `f` (on the waiting thread, outside the log's lock) each time a wait finds
    /// nothing to read: the guest has read all the input and wants more. A space uses it to
    /// show the output written so far, the answer to that input, at once. Replaces the one
    /// given before.
    pub fn on_starving(&self, f: impl Fn() + Send + Sync + 'static) {
        self.inner().starving = Some(Starving(Arc::new(f)));
    }

    /// Waits at most `timeout` until there is input past byte `pos` or the input has ended;
    /// says whether there is (a read at `pos` then does not block).
    pub fn wait(&self, pos: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let starving = {
            let g = self.inner();
            if g.data.len() as u64 > pos || g.ended {
                return true;
            }
            g.starving.clone()
        };
        if let Some(Starving(f)) = starving {
            f();
        }
        let mut g = self.inner();
        loop {
            if g.data.len() as u64 > pos || g.ended {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self
                .0
                .1
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// A reader of the log from byte `pos` on: it reads what is there, waits while there is
    /// nothing and the input has not ended, and reads end of file once it has.
    pub fn reader(&self, pos: u64) -> InputReader {
        InputReader {
            log: self.clone(),
            pos,
        }
    }
}

/// Reads an [`InputLog`] from a position on.
#[derive(Debug)]
pub struct InputReader {
    log: InputLog,
    pos: u64,
}

impl Read for InputReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut g = self.log.inner();
        loop {
            let len = g.data.len() as u64;
            if len > self.pos {
                let at = self.pos as usize;
                let n = buf.len().min(g.data.len() - at);
                buf[..n].copy_from_slice(&g.data[at..at + n]);
                self.pos += n as u64;
                return Ok(n);
            }
            if g.ended || buf.is_empty() {
                return Ok(0);
            }
            g = self.log.0.1.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(log: &InputLog, b: &[u8], end: bool) -> Result<u64, InputError> {
        log.append(None, b, end, |_, _| Ok::<(), InputError>(()))
    }

    #[test]
    fn a_reader_waits_for_input_then_reads_its_end() {
        let log = InputLog::new(b"ab".to_vec(), false);
        let mut r = log.reader(1);
        let mut buf = [0u8; 8];
        assert_eq!(r.read(&mut buf).unwrap(), 1);
        assert_eq!(&buf[..1], b"b");
        assert!(!log.wait(2, Duration::from_millis(10)));
        let l2 = log.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            take(&l2, b"cd", false).unwrap();
            take(&l2, b"", true).unwrap();
        });
        assert_eq!(r.read(&mut buf).unwrap(), 2);
        assert_eq!(&buf[..2], b"cd");
        assert_eq!(r.read(&mut buf).unwrap(), 0);
        t.join().unwrap();
        assert!(log.wait(4, Duration::ZERO));
        assert_eq!(log.len(), (4, true));
    }

    #[test]
    fn an_ended_or_sealed_log_refuses_input_and_a_failed_check_changes_nothing() {
        let log = InputLog::new(Vec::new(), false);
        assert_eq!(take(&log, b"x", false), Ok(1));
        let failed = log.append(None, b"yy", false, |had, new| {
            assert_eq!((had, new), (1, &b"yy"[..]));
            Err(InputError::TooMuch(had))
        });
        assert!(failed.is_err());
        assert_eq!(log.contents(), (b"x".to_vec(), false));
        log.seal();
        assert_eq!(take(&log, b"y", false), Err(InputError::Sealed));
        log.unseal();
        assert_eq!(take(&log, b"y", true), Ok(2));
        assert_eq!(take(&log, b"z", false), Err(InputError::Ended));
        // Ending it again is no error: a sender may repeat an end it is not sure arrived.
        assert_eq!(take(&log, b"", true), Ok(2));
        assert!(log.starts_with(b"xy"));
    }

    #[test]
    fn a_wait_that_finds_nothing_to_read_says_so() {
        let log = InputLog::new(b"a".to_vec(), false);
        let starved = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let s = starved.clone();
        log.on_starving(move || {
            s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        let count = || starved.load(std::sync::atomic::Ordering::SeqCst);
        assert!(log.wait(0, Duration::from_millis(1)));
        assert_eq!(count(), 0, "there was input to read");
        assert!(!log.wait(1, Duration::from_millis(1)));
        assert_eq!(count(), 1);
        take(&log, b"", true).unwrap();
        assert!(log.wait(1, Duration::from_millis(1)));
        assert_eq!(count(), 1, "the end is there to read");
    }

    #[test]
    fn a_piece_sent_again_is_taken_once_and_a_gap_or_other_input_is_refused() {
        let log = InputLog::new(b"abc".to_vec(), false);
        let at = |at: u64, b: &[u8], end: bool| {
            log.append(Some(at), b, end, |had, new| {
                assert_eq!(had as usize + new.len(), at as usize + b.len());
                Ok::<(), InputError>(())
            })
        };
        assert_eq!(at(1, b"bc", false), Ok(3), "all of it there already");
        assert_eq!(at(2, b"cde", false), Ok(5), "only `de` is new");
        assert_eq!(log.contents().0, b"abcde");
        assert_eq!(log.contents_from(3, 8), (b"de".to_vec(), false));
        assert_eq!(log.contents_from(1, 2), (b"bc".to_vec(), false));
        assert_eq!(log.contents_from(9, 8), (Vec::new(), false), "past the end");
        assert_eq!(at(7, b"x", false), Err(InputError::Gap(5)));
        assert_eq!(at(3, b"Xe", false), Err(InputError::Differs(5)));
        log.seal();
        assert_eq!(
            at(3, b"de", false),
            Ok(5),
            "a repeat is answered while sealed"
        );
        assert_eq!(at(5, b"f", false), Err(InputError::Sealed));
        log.unseal();
        assert_eq!(at(5, b"", true), Ok(5));
        assert_eq!(at(5, b"", true), Ok(5), "the end repeated");
        assert_eq!(log.contents_from(3, 2), (b"de".to_vec(), true));
        assert_eq!(
            log.contents_from(3, 1),
            (b"d".to_vec(), false),
            "not up to the end"
        );
        assert_eq!(at(5, b"f", false), Err(InputError::Ended));
    }

    /// A store that counts the bytes put into it.
    #[derive(Debug, Default)]
    struct Counting {
        inner: ferry_store::MemStore,
        put: std::sync::atomic::AtomicU64,
    }

    impl Store for Counting {
        fn put(&self, bytes: &[u8]) -> Result<Kappa, StoreError> {
            self.put
                .fetch_add(bytes.len() as u64, std::sync::atomic::Ordering::SeqCst);
            self.inner.put(bytes)
        }
        fn get(&self, kappa: &Kappa) -> Result<Vec<u8>, StoreError> {
            self.inner.get(kappa)
        }
        fn has(&self, kappa: &Kappa) -> Result<bool, StoreError> {
            self.inner.has(kappa)
        }
        fn list(&self) -> Result<Vec<Kappa>, StoreError> {
            self.inner.list()
        }
        fn remove(&self, kappa: &Kappa) -> Result<(), StoreError> {
            self.inner.remove(kappa)
        }
        fn get_ref(&self, name: &str) -> Result<Option<ferry_store::RefValue>, StoreError> {
            self.inner.get_ref(name)
        }
        fn cas_ref(
            &self,
            name: &str,
            expected: Option<ferry_store::RefValue>,
            new: Option<ferry_store::RefValue>,
        ) -> Result<(), StoreError> {
            self.inner.cas_ref(name, expected, new)
        }
        fn list_refs(&self) -> Result<Vec<(String, ferry_store::RefValue)>, StoreError> {
            self.inner.list_refs()
        }
    }

    impl Counting {
        /// Bytes put since the last call.
        fn taken(&self) -> u64 {
            self.put.swap(0, std::sync::atomic::Ordering::SeqCst)
        }
    }

    const MIB: usize = 1 << 20;

    /// `n` bytes of a pattern that differs from piece to piece.
    fn bytes(from: usize, n: usize) -> Vec<u8> {
        (from..from + n)
            .map(|i| (i % 251) as u8 ^ (i / MIB) as u8)
            .collect()
    }

    #[test]
    fn input_up_to_1_mib_is_stored_as_a_blob() {
        let store = Counting::default();
        let log = InputLog::new(bytes(0, MIB), true);
        let mut pieces = Vec::new();
        let (stored, ended) = store_log(&store, &log, &mut pieces).unwrap();
        assert!(ended);
        assert!(!stored.chunked);
        assert_eq!(stored, StoredInput::blob(Kappa::of(&bytes(0, MIB))));
        assert_eq!(stored.read(&store).unwrap(), bytes(0, MIB));
        assert!(pieces.is_empty());
    }

    /// Over 1 MiB the input is stored in pieces, and a later snapshot stores only the
    /// pieces that are new (the full ones before are neither hashed nor stored again); a
    /// run resumed from it starts from its full pieces.
    #[test]
    fn input_over_1_mib_is_stored_in_pieces_and_only_new_ones_again() {
        let store = Counting::default();
        let log = InputLog::new(bytes(0, 3 * MIB + 10), false);
        let mut pieces = Vec::new();
        let (first, ended) = store_log(&store, &log, &mut pieces).unwrap();
        assert!(!ended);
        assert!(first.chunked);
        assert_eq!(pieces.len(), 3);
        assert_eq!(first.read(&store).unwrap(), bytes(0, 3 * MIB + 10));
        assert!(store.taken() >= 3 * MIB as u64 + 10);

        // Unchanged: the short last piece and the list again, nothing else.
        let (same, _) = store_log(&store, &log, &mut pieces).unwrap();
        assert_eq!(same, first);
        assert!(
            store.taken() < 1024,
            "only the list and the 10-byte last piece"
        );

        // 1 MiB more: one full piece (the old short one grown) and a new short one.
        take(&log, &bytes(3 * MIB + 10, MIB), true).unwrap();
        let (second, ended) = store_log(&store, &log, &mut pieces).unwrap();
        assert!(ended);
        assert_eq!(pieces.len(), 4);
        let put = store.taken();
        assert!(put > MIB as u64 && put < MIB as u64 + 1024, "{put}");
        assert_eq!(second.read(&store).unwrap(), bytes(0, 4 * MIB + 10));

        // Resumed from it: its full pieces need not be stored again; a piece the store lost
        // meanwhile is.
        let mut resumed = second.full_pieces(&store);
        assert_eq!(resumed, pieces);
        store.remove(&resumed[2]).unwrap();
        let (again, _) = store_log(&store, &log, &mut resumed).unwrap();
        assert_eq!(again, second);
        let put = store.taken();
        assert!(
            put >= 2 * MIB as u64 && put < 2 * MIB as u64 + 1024,
            "{put}"
        );
        assert_eq!(again.read(&store).unwrap(), bytes(0, 4 * MIB + 10));
    }

    /// A list of pieces that does not add up is refused, not read as input.
    #[test]
    fn stored_input_whose_pieces_do_not_add_up_is_refused() {
        let store = ferry_store::MemStore::new();
        let short = store.put(b"short").unwrap();
        let file = FileChunks::new(2 * MIB as u64, vec![short, short]);
        let k = store.put(&ferry_object::encode(&file)).unwrap();
        let chunked = StoredInput {
            kappa: k,
            chunked: true,
        };
        let err = chunked.read(&store).unwrap_err().to_string();
        assert!(err.contains("piece 0 has 5 bytes"), "{err}");
        // The same κ read as a blob would be the list's bytes: the flag decides.
        assert_ne!(StoredInput::blob(k).read(&store).unwrap(), b"short");
        let not_a_list = StoredInput {
            kappa: short,
            chunked: true,
        };
        assert!(matches!(
            not_a_list.read(&store),
            Err(StoredInputError::Malformed(..))
        ));
    }
}
