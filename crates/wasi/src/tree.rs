//! Mounted directories as content-addressed trees: import a host directory into the store,
//! materialize a tree back into an empty directory.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use ferry_kappa::Kappa;
use ferry_object::{Tree, TreeEntry};
use ferry_store::Store;

/// Deepest directory nesting imported or materialized.
pub const MAX_DEPTH: usize = 64;

/// Why a tree could not be imported or materialized.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error(transparent)]
    Store(#[from] ferry_store::StoreError),
    #[error(transparent)]
    Object(#[from] ferry_object::ObjectError),
    #[error("{0}: nested deeper than {MAX_DEPTH} directories")]
    TooDeep(String),
    #[error("tree entry name `{0}` is not a plain file name")]
    BadName(String),
}

fn io(p: &Path) -> impl FnOnce(std::io::Error) -> TreeError + '_ {
    move |e| TreeError::Io(p.display().to_string(), e)
}

/// Stores the content of `dir` and returns the κ of its tree.
pub fn import(store: &dyn Store, dir: &Path) -> Result<Kappa, TreeError> {
    import_at(store, dir, 0)
}

fn import_at(store: &dyn Store, dir: &Path, depth: usize) -> Result<Kappa, TreeError> {
    if depth > MAX_DEPTH {
        return Err(TreeError::TooDeep(dir.display().to_string()));
    }
    let (kind, v) = ferry_object::header::<Tree>();
    let mut tree = Tree {
        kind,
        v,
        entries: Default::default(),
    };
    for e in fs::read_dir(dir).map_err(io(dir))? {
        let e = e.map_err(io(dir))?;
        let p = e.path();
        let md = fs::symlink_metadata(&p).map_err(io(&p))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let entry = if md.is_dir() {
            TreeEntry {
                mode: "dir".into(),
                object: import_at(store, &p, depth + 1)?,
            }
        } else if md.file_type().is_symlink() {
            let t = fs::read_link(&p).map_err(io(&p))?;
            TreeEntry {
                mode: "symlink".into(),
                object: store.put(t.to_string_lossy().as_bytes())?,
            }
        } else if md.is_file() {
            let bytes = fs::read(&p).map_err(io(&p))?;
            let mode = if md.permissions().mode() & 0o111 != 0 {
                "exec"
            } else {
                "file"
            };
            TreeEntry {
                mode: mode.into(),
                object: store.put(&bytes)?,
            }
        } else {
            continue;
        };
        tree.entries.insert(name, entry);
    }
    Ok(store.put(&ferry_object::encode(&tree))?)
}

/// Writes tree κ into `dir` (created if missing; existing files are overwritten).
pub fn materialize(store: &dyn Store, kappa: &Kappa, dir: &Path) -> Result<(), TreeError> {
    materialize_at(store, kappa, dir, 0)
}

fn materialize_at(
    store: &dyn Store,
    kappa: &Kappa,
    dir: &Path,
    depth: usize,
) -> Result<(), TreeError> {
    if depth > MAX_DEPTH {
        return Err(TreeError::TooDeep(dir.display().to_string()));
    }
    let tree: Tree = ferry_object::decode(&store.get(kappa)?)?;
    fs::create_dir_all(dir).map_err(io(dir))?;
    for (name, e) in &tree.entries {
        if name.is_empty()
            || name == "."
            || name == ".."
            || name.contains('/')
            || name.contains('\0')
        {
            return Err(TreeError::BadName(name.clone()));
        }
        let p = dir.join(name);
        match e.mode.as_str() {
            "dir" => materialize_at(store, &e.object, &p, depth + 1)?,
            "symlink" => {
                let t = String::from_utf8_lossy(&store.get(&e.object)?).into_owned();
                let _ = fs::remove_file(&p);
                std::os::unix::fs::symlink(t, &p).map_err(io(&p))?;
            }
            mode => {
                fs::write(&p, store.get(&e.object)?).map_err(io(&p))?;
                if mode == "exec" {
                    fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).map_err(io(&p))?;
                }
            }
        }
    }
    Ok(())
}
