//! Running a guest: from the start or from a snapshot, until it exits or is suspended.

use std::sync::Arc;

use ferry_instrument::abi;
use ferry_kappa::Kappa;
use ferry_store::Store;
use ferry_wasi::WasiCtx;
use tracing::info;

use crate::control::{Control, Hold, Request};
use crate::error::{EngineError, Stage};
use crate::host::HostState;
use crate::prepare::{Prepared, Runtime};
use crate::seam::{Compiled, Instance, Stop, Value};
use crate::snapshot::{self, Loaded};

/// Where a run begins.
#[derive(Debug)]
pub enum Start {
    /// At `_start`.
    Fresh,
    /// Where a snapshot stopped (already verified by [`snapshot::load`]).
    Restore(Box<Loaded>),
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The guest exited with this code.
    Exited(i32),
    /// The guest was suspended; this is its snapshot.
    Suspended(Kappa),
}

/// A module compiled without instrumentation.
#[derive(Clone)]
pub struct PlainModule(Arc<dyn Compiled>);

impl std::fmt::Debug for PlainModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PlainModule")
    }
}

/// Facts recorded in each snapshot the run writes.
#[derive(Debug, Clone)]
pub struct SnapshotMeta {
    pub program: String,
    pub parent: Option<Kappa>,
    pub generation: u64,
    /// A reactor's entry export, called after `_initialize` (`None`: a command's `_start`).
    /// A restored run takes it from its snapshot.
    pub main: Option<String>,
}

impl SnapshotMeta {
    /// For a run from the start: no parent, generation 0.
    pub fn fresh(program: impl Into<String>) -> Self {
        Self {
            program: program.into(),
            parent: None,
            generation: 0,
            main: None,
        }
    }
}

/// Detaches the control word before the memory it points into is freed.
struct Attached<'a>(&'a Control);

impl Drop for Attached<'_> {
    fn drop(&mut self) {
        self.0.detach();
    }
}

impl Runtime {
    /// Runs `prepared` until it exits or a suspend completes. Every snapshot taken (suspend or
    /// checkpoint) is reported to `on_snapshot`; a snapshot that fails to be written is
    /// reported too and the guest keeps running (nothing is lost: the previous snapshot stays
    /// as it was).
    ///
    /// A restored guest may run while the snapshot's last checks do
    /// ([`Control::check_while_running`]); the run then ends only once they have, refused if
    /// one failed, whatever the guest did meanwhile.
    #[allow(clippy::too_many_arguments)] // one call site per CLI verb; a builder adds nothing
    pub fn run(
        &self,
        prepared: &Prepared,
        wasi: WasiCtx,
        control: Arc<Control>,
        start: Start,
        store: &dyn Store,
        meta: SnapshotMeta,
        on_snapshot: &mut dyn FnMut(Result<Kappa, EngineError>, Request),
    ) -> Result<Outcome, EngineError> {
        let r = self.run_checked(
            prepared,
            wasi,
            control.clone(),
            start,
            store,
            meta,
            on_snapshot,
        );
        control.wait_checked()?;
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn run_checked(
        &self,
        prepared: &Prepared,
        wasi: WasiCtx,
        control: Arc<Control>,
        start: Start,
        store: &dyn Store,
        mut meta: SnapshotMeta,
        on_snapshot: &mut dyn FnMut(Result<Kappa, EngineError>, Request),
    ) -> Result<Outcome, EngineError> {
        let host = HostState::new(wasi, control.clone());
        // A run that must count safe points runs the counting build (same frames).
        let compiled = if control.counting() {
            self.counting_build(store, prepared)?
        } else {
            prepared.compiled.clone()
        };
        let mut inst = compiled.instantiate(host, true)?;
        let inst = inst.as_mut();
        // A fresh run calls the former start function, then `_start` (a reactor: its
        // `_initialize`, then its entry); a restored run re-enters the one it was suspended in
        // (through its rewind copy).
        if let Start::Restore(loaded) = &start {
            meta.main = loaded.snapshot.main.clone();
        }
        let main = meta.main.clone().unwrap_or_else(|| "_start".to_owned());
        let entries: Vec<&str> = match meta.main {
            None => vec![abi::START_EXPORT, "_start"],
            Some(_) => vec![abi::START_EXPORT, "_initialize", &main],
        };
        let entries: Vec<&str> = entries.into_iter().filter(|n| inst.has_func(n)).collect();
        if entries.last() != Some(&main.as_str()) {
            let hint = match (&meta.main, inst.has_func("_initialize")) {
                (None, true) => "; it is a reactor: name the export to call (`--invoke`)",
                _ => "",
            };
            return Err(EngineError::Instantiate(format!(
                "module has no `{main}` function{hint}"
            )));
        }
        let mut phase = 0;
        let mut rewinding = false;
        let mut dirty = crate::incremental::Incremental::default();

        let ctl = inst.memory_mut(abi::CTL_MEMORY).ok_or_else(|| {
            EngineError::Instantiate("instrumented module lacks `ferry:ctl`".into())
        })?;
        control.attach(ctl.as_mut_ptr() as usize);
        let _attached = Attached(&control);

        if let Start::Restore(loaded) = start {
            let class = &loaded.snapshot.profile.engine_class;
            if !self.backend.engine_classes().contains(&class.as_str()) {
                return Err(EngineError::refused(
                    Stage::Admitting,
                    format!(
                        "the snapshot needs engine class `{class}`; the {} engine provides {}",
                        self.kind(),
                        self.backend.engine_classes().join(", ")
                    ),
                ));
            }
            phase = entries
                .iter()
                .position(|n| *n == loaded.snapshot.entry)
                .ok_or_else(|| {
                    EngineError::refused(
                        Stage::Restoring,
                        format!(
                            "snapshot was taken inside `{}`, which this module lacks",
                            loaded.snapshot.entry
                        ),
                    )
                })?;
            // A held guest (a migration's destination) is checked in full before it is asked
            // about: the move must not commit on a snapshot that fails later.
            let gate = control.take_gate();
            let defer = control.runs_while_checking() && gate.is_none();
            if let Some(check) = snapshot::restore_into(inst, &loaded, store, defer)? {
                spawn_check(check, &control);
            }
            let mut current = loaded;
            if let Some(mut gate) = gate {
                loop {
                    match gate() {
                        Hold::Run => break,
                        Hold::Abort => {
                            return Err(EngineError::refused(
                                Stage::Restoring,
                                "held after restoring and then released without running (the \
                                 move did not commit)",
                            ));
                        }
                        Hold::Refuse(stage, why) => return Err(EngineError::refused(stage, why)),
                        Hold::Patch(next, wasi) => {
                            if next.snapshot.instrumented != current.snapshot.instrumented {
                                return Err(EngineError::refused(
                                    Stage::Restoring,
                                    "a held guest can only be brought forward to a snapshot of \
                                     the same module",
                                ));
                            }
                            phase = entries
                                .iter()
                                .position(|n| *n == next.snapshot.entry)
                                .ok_or_else(|| {
                                    EngineError::refused(
                                        Stage::Restoring,
                                        format!("no entry `{}`", next.snapshot.entry),
                                    )
                                })?;
                            snapshot::patch_into(inst, &current, &next, store)?;
                            inst.host().wasi = *wasi;
                            meta.parent = Some(next.kappa);
                            meta.generation = next.snapshot.generation;
                            current = next;
                        }
                    }
                }
            }
            dirty.seed(inst, &current.memories);
            begin_rewind(inst)?;
            rewinding = true;
            info!(
                snapshot = %meta.parent.map(|k| k.to_string()).unwrap_or_default(),
                engine = %self.kind(),
                checking = control.checks_pending(),
                "running"
            );
        }

        // Pre-writing reads the guest's memory from another thread while the guest runs:
        // only where it never moves (see `incremental`).
        let stays_put = inst.memory_stays_put();
        let every = control.pre_write();
        if every.is_some() && !stays_put {
            info!(
                engine = %self.kind(),
                "pre-writing needs a memory that stays in place; not pre-writing"
            );
        }
        let waker = Arc::new(crate::incremental::Waker::default());
        let first = dirty.first();
        // The carried mounts, whose settled files a thread of the run stores ahead of
        // snapshots when it pre-writes (into `pre_stored`, which each snapshot takes in).
        let mounts = crate::incremental::carried_mounts(&inst.host().wasi);
        // The guest's changes to the big mounted files earlier snapshots stored in pieces are
        // recorded from the start, so that even this run's first snapshot (which loads the
        // store's import cache) reads them again only where they changed
        // (`ferry_wasi::written`).
        let roots: Vec<&std::path::Path> = mounts.iter().map(|(d, _)| d.as_path()).collect();
        inst.host()
            .wasi
            .record_writes_to(ferry_wasi::tree::ImportCache::saved_in_pieces_under(
                store, &roots,
            ));
        let pre_stored = std::sync::Mutex::new(ferry_wasi::tree::ImportCache::default());
        std::thread::scope(|s| {
            if control.pre_writes() && !mounts.is_empty() {
                let (control, waker) = (&control, &waker);
                let files = crate::incremental::PreStore {
                    mounts: &mounts,
                    found: &pre_stored,
                };
                let _ = std::thread::Builder::new()
                    .name("ferry-pre-store".into())
                    .spawn_scoped(s, move || {
                        crate::incremental::pre_store(store, control, waker, files)
                    })
                    .inspect_err(|e| tracing::warn!("cannot start pre-storing: {e}"));
            }
            if stays_put && control.pre_writes() {
                let (control, waker) = (&control, &waker);
                let _ = std::thread::Builder::new()
                    .name("ferry-pre-write".into())
                    .spawn_scoped(s, move || {
                        crate::incremental::pre_write(first, store, control, every, waker)
                    })
                    .inspect_err(|e| tracing::warn!("cannot start pre-writing: {e}"));
            }
            // However the loop ends, the pre-writer stops before the scope waits for it.
            let _ends = crate::incremental::EndsPreWriting {
                control: &control,
                waker: &waker,
            };
            loop {
                let name = entries[phase];
                let call = if std::mem::take(&mut rewinding) {
                    let rewind = abi::rewind_export(name);
                    if !inst.has_func(&rewind) {
                        return Err(EngineError::refused(
                            Stage::Restoring,
                            format!("`{name}` has no rewind copy"),
                        ));
                    }
                    rewind
                } else {
                    name.to_owned()
                };
                match inst.call(&call) {
                    Ok(code) => {
                        let state = global_i32(inst, abi::STATE_GLOBAL)?;
                        if state == abi::STATE_REWIND {
                            return Err(EngineError::refused(
                                Stage::Restoring,
                                "corrupt saved stack: the rewind never reached its call site",
                            ));
                        }
                        if state != abi::STATE_UNWIND {
                            phase += 1;
                            if phase < entries.len() {
                                continue;
                            }
                            inst.host().wasi.flush();
                            return Ok(Outcome::Exited(code.unwrap_or(0)));
                        }
                        // Serve whatever was asked (the request stays pending until the unwind
                        // reaches here: see `host::start_unwind`).
                        let mut reason = control.take();
                        if reason == Request::None && control.throttle_due() {
                            // A throttle's tick: held here, then on — or, if a snapshot was
                            // asked for meanwhile, it is written now (the guest is unwound).
                            control.settle();
                            if matches!(control.pending(), Request::Checkpoint | Request::Suspend) {
                                reason = control.take();
                            }
                        }
                        if matches!(reason, Request::None | Request::Probe) {
                            // Nothing to write (a probe, or a request already served): go on.
                            begin_rewind(inst)?;
                            rewinding = true;
                            continue;
                        }
                        // Nothing is written from a guest whose snapshot is still being checked.
                        control.wait_checked()?;
                        // What was pre-stored of the mounts, and is still whole (a `--keep`
                        // prune deletes what no snapshot names), is not read again.
                        let found = std::mem::take(
                            &mut *pre_stored.lock().unwrap_or_else(|p| p.into_inner()),
                        );
                        dirty.trees.update_from_stored(&found, store);
                        let writing = control.begin_writing();
                        let written = snapshot::write(
                            inst,
                            store,
                            &meta,
                            prepared,
                            name,
                            &mut dirty,
                            writing.files_read(),
                        );
                        drop(writing);
                        let ok = written.as_ref().ok().copied();
                        let failed = written.as_ref().err().map(ToString::to_string);
                        on_snapshot(written, reason);
                        if let Some(e) = failed
                            && reason == Request::Suspend
                            && control.ends_without_snapshot()
                        {
                            inst.host().wasi.flush();
                            return Err(EngineError::Unsaved(e));
                        }
                        if let Some(k) = ok {
                            meta.parent = Some(k);
                            meta.generation += 1;
                            if reason == Request::Suspend {
                                return Ok(Outcome::Suspended(k));
                            }
                        }
                        begin_rewind(inst)?;
                        rewinding = true;
                    }
                    Err(stop) => {
                        inst.host().wasi.flush();
                        return match stop {
                            Stop::Exit(code) => Ok(Outcome::Exited(code)),
                            Stop::Trap(mut report) => {
                                // Frames still in their rewind copies (after a resume) are
                                // named from the instrumented module, read only now.
                                if report.frames.iter().any(|f| f.name.is_none())
                                    && let Ok(wasm) = store.get(&prepared.instrumented)
                                {
                                    report.name_rewind_copies(&wasm);
                                }
                                Err(EngineError::Trap(report.to_string()))
                            }
                            Stop::Fatal(m) => Err(EngineError::Host(m)),
                        };
                    }
                }
            }
        })
    }

    /// Compiles a module as it is, without instrumentation (the benchmark baseline).
    pub fn compile_plain(&self, wasm: &[u8]) -> Result<PlainModule, EngineError> {
        // Cached like instrumented code (a 95 MB interpreter takes minutes to compile).
        let key = format!("plain-{}", Kappa::of(wasm).to_hex());
        self.backend
            .compile(Some(&key), &mut || Ok(wasm.to_vec()), &|_| {})
            .map(PlainModule)
    }

    /// Runs an uninstrumented module to completion with the same WASI. Returns its exit code.
    /// `main` names a reactor's entry (called after `_initialize`); `None` runs `_start`.
    pub fn run_plain(
        &self,
        module: &PlainModule,
        wasi: WasiCtx,
        main: Option<&str>,
    ) -> Result<i32, EngineError> {
        let host = HostState::new(wasi, Arc::new(Control::new()));
        let mut inst = module.0.instantiate(host, false)?;
        let entries: &[&str] = match main {
            None => &["_start"],
            Some(m) => &["_initialize", m],
        };
        let mut code = None;
        for (i, name) in entries.iter().enumerate() {
            let last = i + 1 == entries.len();
            if !inst.has_func(name) {
                if !last {
                    continue;
                }
                return Err(EngineError::Instantiate(format!(
                    "module has no `{name}` function"
                )));
            }
            match inst.call(name) {
                Ok(c) => code = c,
                Err(Stop::Exit(c)) => {
                    inst.host().wasi.flush();
                    return Ok(c);
                }
                Err(Stop::Trap(report)) => {
                    inst.host().wasi.flush();
                    return Err(EngineError::Trap(report.to_string()));
                }
                Err(Stop::Fatal(m)) => {
                    inst.host().wasi.flush();
                    return Err(EngineError::Host(m));
                }
            }
        }
        inst.host().wasi.flush();
        Ok(code.unwrap_or(0))
    }
}

/// Runs `check` on a thread of its own while the guest runs; its end (or failure) is
/// reported to `control`.
fn spawn_check(check: snapshot::DeferredCheck, control: &Arc<Control>) {
    control.begin_check();
    let c = control.clone();
    let chunks = check.chunks();
    let started = std::time::Instant::now();
    let work = move || {
        crate::fault_pause("check-mapped");
        let r = check.run();
        let ms = started.elapsed().as_millis() as u64;
        match &r {
            Ok(()) => info!(chunks, ms, "mapped chunks checked"),
            Err(e) => tracing::warn!(chunks, ms, "a mapped chunk failed its check: {e}"),
        }
        c.end_check(r.map_err(|e| (Stage::Restoring, e.to_string())));
    };
    let _ = std::thread::Builder::new()
        .name("ferry-check".into())
        .spawn(work)
        .map_err(|e| {
            control.end_check(Err((
                Stage::Restoring,
                format!("cannot start the check of the mapped chunks: {e}"),
            )))
        });
}

pub(crate) fn global_i32(inst: &mut dyn Instance, name: &str) -> Result<i32, EngineError> {
    match inst.global(name) {
        Some(Value::I32(v)) => Ok(v),
        _ => Err(EngineError::Instantiate(format!(
            "instrumented module lacks the i32 global `{name}`"
        ))),
    }
}

/// Arms a rewind of the frames saved in `ferry:stack`: the next entry call re-enters them.
fn begin_rewind(inst: &mut dyn Instance) -> Result<(), EngineError> {
    inst.set_global(abi::STATE_GLOBAL, Value::I32(abi::STATE_REWIND))
        .map_err(EngineError::Host)?;
    let ctl = inst
        .memory_mut(abi::CTL_MEMORY)
        .ok_or_else(|| EngineError::Host("no `ferry:ctl` memory".into()))?;
    ctl[..4].copy_from_slice(&1u32.to_le_bytes());
    Ok(())
}
