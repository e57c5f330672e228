//! A space's capability policy (`ferry serve --policy policy.toml`): what a guest may be
//! granted here. Resume and migration admit `C_requested ∩ C_policy`; a request the policy
//! cannot grant is refused, with the reason, before anything runs.
//!
//! ```toml
//! version = 1
//! # Which guest mounts may be granted, and where their backing directories live on this
//! # machine (one fresh directory per session under `host`, filled from the snapshot's tree).
//! [[mount]]
//! guest = "/data"            # exact guest path, or "*" for any
//! host = "/srv/ferry/data"   # default: <store>/space/mounts
//! read_only = false          # true: granted read-only even if the guest asked for more
//! # Environment variables that may pass (absent: all; []: none).
//! env = ["LANG", "PYTHONHASHSEED"]
//! max_memory_mib = 1024      # largest guest memory: snapshots above it are refused, and a
//!                            # running guest's memory.grow beyond it fails (absent: no limit)
//! engines = ["jit", "interp"]
//! # Run a snapshot made by another version of ferry's transform with its own instrumented
//! # module even if this space did not derive it from the program (absent: false).
//! trust_instrumented = false
//! # Let clients outside the space (a browser tab, Node) take sessions over: the guest then
//! # runs where this policy does not reach (absent: false).
//! lend = false
//! ```
//!
//! Without `--policy` a space grants every mount (writable, backed by fresh directories
//! under its own data directory — never an existing host path), every variable, any memory
//! size and both engines, trusts the instrumented modules of other versions, and lends
//! sessions.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The only policy format version.
pub const POLICY_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    version: u32,
    #[serde(default)]
    mount: Vec<MountRule>,
    env: Option<Vec<String>>,
    max_memory_mib: Option<u64>,
    engines: Option<Vec<String>>,
    #[serde(default)]
    trust_instrumented: bool,
    #[serde(default)]
    lend: bool,
}

/// One `[[mount]]` rule.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountRule {
    pub guest: String,
    #[serde(default)]
    pub host: Option<PathBuf>,
    #[serde(default)]
    pub read_only: bool,
}

/// What a space grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub mounts: Vec<MountRule>,
    pub env: Option<Vec<String>>,
    pub max_memory: Option<u64>,
    pub engines: Option<Vec<String>>,
    /// Whether a snapshot of another transform version may run its own instrumented module
    /// when this space did not derive it ([`ferry_engine::OtherVersions`]).
    pub trust_instrumented: bool,
    /// Whether a session may be lent to a client outside the space (`POST
    /// /v1/sessions/{id}/lend`), where this policy does not reach.
    pub lend: bool,
    /// Where backing directories go when a rule names no `host`.
    pub default_root: PathBuf,
    /// Where the policy came from, for messages.
    pub source: String,
}

/// A granted mount: the directory that backs it here and whether it is read-only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountGrant {
    pub root: PathBuf,
    pub read_only: bool,
}

impl Policy {
    /// The policy of a space started without `--policy`.
    pub fn permissive(default_root: PathBuf) -> Self {
        Self {
            mounts: vec![MountRule {
                guest: "*".into(),
                host: None,
                read_only: false,
            }],
            env: None,
            max_memory: None,
            engines: None,
            trust_instrumented: true,
            lend: true,
            default_root,
            source: "the default policy".into(),
        }
    }

    /// Parses a policy file.
    pub fn parse(text: &str, default_root: PathBuf, source: &str) -> Result<Self, String> {
        let f: PolicyFile = toml::from_str(text).map_err(|e| format!("{source}: {e}"))?;
        if f.version != POLICY_VERSION {
            return Err(format!(
                "{source}: policy version {} (this ferry reads version {POLICY_VERSION})",
                f.version
            ));
        }
        for e in f.engines.iter().flatten() {
            e.parse::<ferry_engine::EngineKind>()
                .map_err(|e| format!("{source}: engines: {e}"))?;
        }
        for m in &f.mount {
            if m.guest != "*" && !m.guest.starts_with('/') && m.guest != "." {
                return Err(format!(
                    "{source}: mount guest path `{}` must be absolute, `.` or `*`",
                    m.guest
                ));
            }
        }
        Ok(Self {
            mounts: f.mount,
            env: f.env,
            max_memory: f.max_memory_mib.map(|m| m << 20),
            engines: f.engines,
            trust_instrumented: f.trust_instrumented,
            lend: f.lend,
            default_root,
            source: source.to_owned(),
        })
    }

    pub fn load(path: &Path, default_root: PathBuf) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the policy {}: {e}", path.display()))?;
        Self::parse(&text, default_root, &path.display().to_string())
    }

    /// How a snapshot made by another version of the transform is admitted here.
    pub fn other_versions(&self) -> ferry_engine::OtherVersions {
        if self.trust_instrumented {
            ferry_engine::OtherVersions::Trusted
        } else {
            ferry_engine::OtherVersions::Derived
        }
    }

    /// The grant for a mount at `guest` (asked writable unless `read_only`), or why not.
    pub fn mount(&self, guest: &str, read_only: bool) -> Result<MountGrant, String> {
        let rule = self
            .mounts
            .iter()
            .find(|r| r.guest == guest)
            .or_else(|| self.mounts.iter().find(|r| r.guest == "*"))
            .ok_or_else(|| {
                format!(
                    "the guest needs a directory mounted at `{guest}`; {} grants no such mount",
                    self.source
                )
            })?;
        Ok(MountGrant {
            root: rule
                .host
                .clone()
                .unwrap_or_else(|| self.default_root.clone()),
            read_only: read_only || rule.read_only,
        })
    }

    /// Every directory under which this policy puts backing directories.
    pub fn roots(&self) -> Vec<PathBuf> {
        let mut roots = vec![self.default_root.clone()];
        for r in &self.mounts {
            if let Some(h) = &r.host
                && !roots.contains(h)
            {
                roots.push(h.clone());
            }
        }
        roots
    }

    /// Every variable in `env` may pass, or the first that may not.
    pub fn env(&self, env: &[(String, String)]) -> Result<(), String> {
        let Some(allowed) = &self.env else {
            return Ok(());
        };
        match env.iter().find(|(k, _)| !allowed.contains(k)) {
            Some((k, _)) => Err(format!(
                "the guest has environment variable `{k}`, which {} does not let pass",
                self.source
            )),
            None => Ok(()),
        }
    }

    /// A guest of `bytes` of memory is admitted.
    pub fn memory(&self, bytes: u64) -> Result<(), String> {
        match self.max_memory {
            Some(max) if bytes > max => Err(format!(
                "the guest has {} MiB of memory; {} admits at most {} MiB",
                bytes >> 20,
                self.source,
                max >> 20
            )),
            _ => Ok(()),
        }
    }

    /// A guest with these needs is admitted: the engine, its environment variables (by
    /// name), its mounts (by guest path) and its memory — each only if given.
    pub fn admits(
        &self,
        engine: Option<ferry_engine::EngineKind>,
        env: &[String],
        mounts: &[String],
        memory: Option<u64>,
    ) -> Result<(), String> {
        if let Some(e) = engine {
            self.engine(e)?;
        }
        let env: Vec<(String, String)> = env.iter().map(|k| (k.clone(), String::new())).collect();
        self.env(&env)?;
        for guest in mounts {
            self.mount(guest, false)?;
        }
        if let Some(bytes) = memory {
            self.memory(bytes)?;
        }
        Ok(())
    }

    /// The engine may run guests here.
    pub fn engine(&self, engine: ferry_engine::EngineKind) -> Result<(), String> {
        match &self.engines {
            Some(list) if !list.iter().any(|e| e.parse().ok() == Some(engine)) => Err(format!(
                "{} does not allow the {engine} engine (it allows {})",
                self.source,
                list.join(", ")
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(text: &str) -> Result<Policy, String> {
        Policy::parse(text, "/var/ferry".into(), "policy.toml")
    }

    #[test]
    fn grants_what_the_file_says_and_refuses_the_rest_with_the_reason() {
        let p = policy(
            r#"
            version = 1
            env = ["LANG"]
            max_memory_mib = 64
            engines = ["interp"]
            [[mount]]
            guest = "/data"
            read_only = true
            [[mount]]
            guest = "/out"
            host = "/srv/out"
            "#,
        )
        .expect("valid");
        assert_eq!(
            p.mount("/data", false),
            Ok(MountGrant {
                root: "/var/ferry".into(),
                read_only: true
            })
        );
        assert_eq!(
            p.mount("/out", false).map(|g| g.root),
            Ok("/srv/out".into())
        );
        let e = p.mount("/etc", false).expect_err("not granted");
        assert!(e.contains("`/etc`") && e.contains("policy.toml"), "{e}");
        assert!(p.env(&[("LANG".into(), "C".into())]).is_ok());
        let e = p
            .env(&[("SECRET".into(), "x".into())])
            .expect_err("refused");
        assert!(e.contains("`SECRET`"), "{e}");
        assert!(p.memory(64 << 20).is_ok());
        assert!(p.memory(65 << 20).expect_err("too big").contains("64 MiB"));
        assert!(p.engine(ferry_engine::EngineKind::Interp).is_ok());
        assert!(p.engine(ferry_engine::EngineKind::Jit).is_err());
        // Where a session's backing directories may be: every root a grant can name.
        assert_eq!(
            p.roots(),
            vec![PathBuf::from("/var/ferry"), PathBuf::from("/srv/out")]
        );
    }

    /// Another transform version's module runs unchecked only where a policy file says so
    /// (or no policy file restricts anything).
    #[test]
    fn instrumented_modules_of_other_versions_are_trusted_only_when_told() {
        use ferry_engine::OtherVersions;
        let strict = policy("version = 1").expect("valid");
        assert_eq!(strict.other_versions(), OtherVersions::Derived);
        let trusting = policy("version = 1\ntrust_instrumented = true").expect("valid");
        assert_eq!(trusting.other_versions(), OtherVersions::Trusted);
        assert_eq!(
            Policy::permissive("/d".into()).other_versions(),
            OtherVersions::Trusted
        );
    }

    /// Sessions leave for a tab only where a policy file says so (or none restricts anything).
    #[test]
    fn sessions_are_lent_only_when_told() {
        assert!(!policy("version = 1").expect("valid").lend);
        assert!(policy("version = 1\nlend = true").expect("valid").lend);
        assert!(Policy::permissive("/d".into()).lend);
    }

    #[test]
    fn bad_files_are_refused_with_where_and_why() {
        assert!(policy("version = 2").expect_err("v2").contains("version 2"));
        assert!(policy("version = 1\nbogus = 1").is_err());
        assert!(
            policy("version = 1\n[[mount]]\nguest = \"rel\"")
                .expect_err("relative")
                .contains("`rel`")
        );
        assert!(policy("version = 1\nengines = [\"gpu\"]").is_err());
        let open = Policy::permissive("/d".into());
        assert!(open.mount("/anything", false).is_ok());
        assert!(open.env(&[("ANY".into(), "1".into())]).is_ok());
    }
}
