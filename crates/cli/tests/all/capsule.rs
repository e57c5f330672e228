//! `ferry export` / `ferry import`: a suspended guest moved to a store that shares nothing
//! with the first one continues byte-identically; damaged capsules are refused.

use crate::harness::{
    Env, dir_contents, guest, resume_to_end, resume_to_end_with, run_and_suspend, session_of,
};

/// A CPU guest suspended in a new environment: the environment, what an uninterrupted run
/// prints, what this one printed before it was suspended, and its snapshot.
fn suspended_cpu_guest() -> (Env, Vec<u8>, Vec<u8>, String) {
    let here = Env::new();
    let g = guest("wasm/cpu.wasm");
    let args = [g.to_str().unwrap(), "--", "120"];
    let plain = here.plain(&args);
    let (seen, k) = run_and_suspend(&here, &args, 300);
    (here, plain.stdout, seen, k)
}

#[test]
fn a_snapshot_moves_to_another_store_through_a_capsule() {
    let (here, plain, mut seen, k) = suspended_cpu_guest();
    let there = Env::new();
    let capsule = here.path("moved.ferry");
    let (_, err, code) = here.output(&["export", &k, "-o", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("ferry: exported "), "{err}");
    // A session stands for its last snapshot, as for `resume` and `inspect`.
    let session = session_of(&here, &k);
    let by_session = here.path("by-session.ferry");
    let (_, err, code) = here.output(&["export", &session, "-o", by_session.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(std::fs::read(&by_session).unwrap() == std::fs::read(&capsule).unwrap());
    // The other store has never seen the program.
    let (_, err, code) = there.output(&["resume", &k]);
    assert_eq!(code, 1);
    assert!(err.contains("resume refused while resolving"), "{err}");
    let (out, err, code) = there.output(&["import", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("imported {k}"));
    // Garbage collection keeps an imported snapshot; the store verifies.
    let (_, err, code) = there.output(&["store", "gc"]);
    assert_eq!(code, 0, "{err}");
    let (out, _, code) = there.output(&["store", "verify"]);
    assert_eq!(code, 0, "{out}");
    seen.extend(resume_to_end(&there, &k));
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain)
    );
}

/// A guest writing files in a mount moves through a capsule to a store (and a directory)
/// that share nothing with the first: `import` says which directory to grant, the resume
/// fills the empty one from the snapshot, and the guest ends with the files and output of an
/// uninterrupted run.
#[test]
fn a_guest_with_a_mount_moves_through_a_capsule() {
    let here = Env::new();
    let g = guest("wasm/files.wasm");
    let (plain_dir, pd) = here.data_dir("plain-data");
    let (_, cd) = here.data_dir("data");
    let plain = here.plain(&["--dir", &pd, g.to_str().unwrap(), "/data", "2000"]);
    let (mut seen, k) = run_and_suspend(
        &here,
        &["--dir", &cd, g.to_str().unwrap(), "/data", "2000"],
        400,
    );
    let capsule = here.path("moved.ferry");
    let (_, err, code) = here.output(&["export", &k, "-o", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let there = Env::new();
    let (out, err, code) = there.output(&["import", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("imported {k}"));
    let short = &k[..19];
    assert!(
        err.contains(&format!(
            "resume it with `ferry resume --dir HOST::/data {short}`"
        )),
        "{err}"
    );
    let (there_dir, td) = there.data_dir("data");
    seen.extend(resume_to_end_with(&there, &["--dir", &td], &k));
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain.stdout)
    );
    assert_eq!(dir_contents(&there_dir), dir_contents(&plain_dir));
}

/// `ferry export κ -o - | ferry import -`: the capsule streams through a pipe (as through
/// `ssh`); a capsule cut short in the pipe is refused.
#[test]
fn a_capsule_goes_through_a_pipe() {
    use std::io::Write;
    use std::process::Stdio;
    let (here, plain, mut seen, k) = suspended_cpu_guest();
    let there = Env::new();
    let mut export = here
        .ferry()
        .args(["export", &k, "-o", "-"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let import = there
        .ferry()
        .args(["import", "-"])
        .stdin(export.stdout.take().unwrap())
        .output()
        .unwrap();
    let exported = export.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&exported.stderr);
    assert_eq!(exported.status.code(), Some(0), "{err}");
    assert!(err.contains("to stdout"), "{err}");
    let stderr = String::from_utf8_lossy(&import.stderr);
    assert_eq!(import.status.code(), Some(0), "{stderr}");
    assert_eq!(
        String::from_utf8_lossy(&import.stdout).trim(),
        format!("imported {k}")
    );
    seen.extend(resume_to_end(&there, &k));
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain)
    );

    // Cut short on the way.
    let capsule = here
        .ferry()
        .args(["export", &k, "-o", "-"])
        .output()
        .unwrap()
        .stdout;
    assert!(
        capsule.starts_with(b"FERRYCAP"),
        "the capsule itself is on stdout"
    );
    let other = Env::new();
    let mut import = other
        .ferry()
        .args(["import", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = import.stdin.take().unwrap();
    stdin.write_all(&capsule[..capsule.len() / 2]).unwrap();
    drop(stdin);
    let out = import.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot import the capsule on stdin"), "{err}");
    assert!(err.contains("truncated"), "{err}");
}

#[test]
fn damaged_capsules_and_unknown_snapshots_are_refused() {
    let env = Env::new();
    let g = guest("wasm/cpu.wasm");
    let (_, k) = run_and_suspend(&env, &[g.to_str().unwrap(), "--", "120"], 200);
    let capsule = env.path("c.ferry");
    let (_, err, code) = env.output(&["export", &k, "-o", capsule.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let good = std::fs::read(&capsule).unwrap();

    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 1;
    let bad = env.path("bad.ferry");
    std::fs::write(&bad, &flipped).unwrap();
    let other = Env::new();
    let (_, err, code) = other.output(&["import", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("capsule is corrupt"), "{err}");

    std::fs::write(&bad, &good[..good.len() - 10]).unwrap();
    let (_, err, code) = other.output(&["import", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("capsule is corrupt: truncated"), "{err}");

    std::fs::write(&bad, b"not a capsule").unwrap();
    let (_, err, code) = other.output(&["import", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("not a ferry capsule"), "{err}");

    let unknown = "blake3:0000000000000000000000000000000000000000000000000000000000000000";
    let (_, err, code) = env.output(&["export", unknown, "-o", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("is missing from the store"), "{err}");

    // A directory is not a capsule's name: refused before anything is written.
    let dir = env.path("a-directory");
    std::fs::create_dir(&dir).unwrap();
    let (_, err, code) = env.output(&["export", &k, "-o", dir.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("is a directory: give the capsule a file name"),
        "{err}"
    );
    assert!(!env.path("a-directory.ferry-partial").exists());
}

/// `ferry import SOURCE` in `there` brings snapshot `k`, which resumed there prints the rest
/// of what an uninterrupted run (`plain`) printed after `seen`.
fn imports_and_ends_like_plain(
    there: &Env,
    source: &str,
    k: &str,
    seen: &mut Vec<u8>,
    plain: &[u8],
) {
    let (out, err, code) = there.output(&["import", source]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("imported {k}"));
    seen.extend(resume_to_end(there, k));
    assert_eq!(
        String::from_utf8_lossy(seen),
        String::from_utf8_lossy(plain)
    );
}

/// The blobs of the OCI layout `dir`: each file name must be the SHA-256 of its content.
fn check_blobs(dir: &std::path::Path) -> usize {
    use sha2::Digest;
    let mut n = 0;
    for e in std::fs::read_dir(dir.join("blobs/sha256")).unwrap() {
        let e = e.unwrap();
        let bytes = std::fs::read(e.path()).unwrap();
        assert_eq!(
            hex::encode(sha2::Sha256::digest(&bytes)),
            e.file_name().to_string_lossy(),
            "a blob named by another digest"
        );
        n += 1;
    }
    n
}

/// `export -o oci:DIR:TAG` writes an OCI image layout (the directory form registries' tools
/// read): capsules as its layers (the program, the memory, then the rest), under the tag, every
/// blob named by its SHA-256; a second snapshot in the same layout is added under its own
/// tag and shares the first one's program layer. `import oci:DIR:TAG` in a
/// store that shares nothing brings the snapshot back, and it resumes byte-identically.
/// Asked without a tag, a layout of two is refused with its tags; a damaged layer, a digest
/// that is no SHA-256 (it would name a path), a missing tag and a manifest naming another
/// snapshot than its capsule holds are refused.
#[test]
fn a_snapshot_moves_through_an_oci_layout() {
    let (here, plain, mut seen, k) = suspended_cpu_guest();
    let layout = here.path("layout");
    let at = |tag: &str| format!("oci:{}:{tag}", layout.display());
    let (_, err, code) = here.output(&["export", &k, "-o", &at("v1")]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("to the OCI layout"), "{err}");
    assert_eq!(
        std::fs::read_to_string(layout.join("oci-layout")).unwrap(),
        r#"{"imageLayoutVersion":"1.0.0"}"#
    );
    let v1 = layers_of(&layout, "v1");
    let parts: Vec<&str> = v1.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        parts,
        ["program", "memory", "state"],
        "a small memory: one region"
    );
    assert_eq!(
        check_blobs(&layout),
        5,
        "manifest, empty config, the program's capsule, the memory's and the state's"
    );
    // A second snapshot, taken further on, under another tag.
    let (_, k2) = crate::harness::resume_and_suspend(&here, &[&k], 300);
    let (_, err, code) = here.output(&["export", &k2, "-o", &at("v2")]);
    assert_eq!(code, 0, "{err}");
    let mut digests: Vec<_> = v1
        .iter()
        .chain(&layers_of(&layout, "v2"))
        .map(|(_, d)| d.clone())
        .collect();
    digests.sort();
    digests.dedup();
    assert_eq!(
        digests.len(),
        5,
        "the program's layer is shared: {digests:?}"
    );
    assert_eq!(check_blobs(&layout), 2 + 1 + digests.len());
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let tags: Vec<&str> = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m["annotations"]["org.opencontainers.image.ref.name"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(tags, ["v1", "v2"]);

    let there = Env::new();
    let bare = format!("oci:{}", layout.display());
    let (_, err, code) = there.output(&["import", &bare]);
    assert_eq!(code, 1);
    assert!(
        err.contains("holds 2 manifests") && err.contains("tags: v1, v2"),
        "{err}"
    );
    let (_, err, code) = there.output(&["import", &at("v3")]);
    assert_eq!(code, 1);
    assert!(err.contains("no manifest tagged `v3`"), "{err}");
    imports_and_ends_like_plain(&there, &at("v1"), &k, &mut seen, &plain);

    // Damaged: v2's capsule with one byte changed (in a copy of the layout).
    let layer = |dir: &std::path::Path| {
        let m = manifest_of(dir, "v2");
        let hex = m["layers"][1]["digest"].as_str().unwrap()[7..].to_owned();
        dir.join("blobs/sha256").join(hex)
    };
    let copy = |name: &str| {
        let d = here.path(name);
        std::fs::create_dir_all(d.join("blobs/sha256")).unwrap();
        for f in ["oci-layout", "index.json"] {
            std::fs::copy(layout.join(f), d.join(f)).unwrap();
        }
        for e in std::fs::read_dir(layout.join("blobs/sha256")).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), d.join("blobs/sha256").join(e.file_name())).unwrap();
        }
        d
    };
    assert_eq!(
        manifest_of(&layout, "v1")["layers"][0]["digest"],
        manifest_of(&layout, "v2")["layers"][0]["digest"],
        "one program layer for both snapshots"
    );
    let damaged = copy("damaged");
    let mut bytes = std::fs::read(layer(&damaged)).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(layer(&damaged), bytes).unwrap();
    let (_, err, code) = there.output(&["import", &format!("oci:{}:v2", damaged.display())]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot import"), "{err}");
    // A digest that would name a path outside the layout.
    let escaping = copy("escaping");
    let index = std::fs::read_to_string(escaping.join("index.json")).unwrap();
    let first = index.find("sha256:").unwrap();
    let index = format!(
        "{}sha256:../../../../etc/passwd{}",
        &index[..first],
        &index[first + 71..]
    );
    std::fs::write(escaping.join("index.json"), index).unwrap();
    let (_, err, code) = there.output(&["import", &format!("oci:{}:v1", escaping.display())]);
    assert_eq!(code, 1);
    assert!(err.contains("is not a SHA-256 digest"), "{err}");
    // A manifest that names another snapshot than its capsule holds.
    let lying = copy("lying");
    let mut m = manifest_of(&lying, "v2");
    m["annotations"]["dev.ferry.snapshot"] = k.clone().into();
    let bytes = serde_json::to_vec(&m).unwrap();
    use sha2::Digest;
    let hex = hex::encode(sha2::Sha256::digest(&bytes));
    std::fs::write(lying.join("blobs/sha256").join(&hex), &bytes).unwrap();
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(lying.join("index.json")).unwrap()).unwrap();
    index["manifests"][1]["digest"] = format!("sha256:{hex}").into();
    index["manifests"][1]["size"] = bytes.len().into();
    std::fs::write(
        lying.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    let (_, err, code) = there.output(&["import", &format!("oci:{}:v2", lying.display())]);
    assert_eq!(code, 1);
    assert!(
        err.contains(&format!("names the snapshot {k}, but no layer holds it")),
        "{err}"
    );
}

/// The manifest tagged `tag` in the OCI layout `dir`.
fn manifest_of(dir: &std::path::Path, tag: &str) -> serde_json::Value {
    let m = index_entry(dir, tag);
    let hex = m["digest"]
        .as_str()
        .unwrap()
        .strip_prefix("sha256:")
        .unwrap();
    serde_json::from_slice(&std::fs::read(dir.join("blobs/sha256").join(hex)).unwrap()).unwrap()
}

/// An export's layers, as (part, digest): `dev.ferry.part` and the layer's digest.
fn layers_of(layout: &std::path::Path, tag: &str) -> Vec<(String, String)> {
    let manifest = manifest_of(layout, tag);
    manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["annotations"]["dev.ferry.part"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
                l["digest"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// The memory goes into the OCI layout in layers of 32 MiB regions: a second snapshot of a
/// guest that left its big heap alone (`dirty` rewriting no pages: it only sleeps and
/// prints) shares the first one's layers of every region but those its stack and stdio
/// buffer are in, so a registry is sent only those; imported elsewhere, it resumes and ends
/// as an uninterrupted run.
#[test]
fn memory_regions_that_did_not_change_are_shared_layers() {
    let here = Env::new();
    let g = guest("wasm/dirty.wasm");
    let args = [g.to_str().unwrap(), "--", "96", "20", "0"];
    let plain = here.plain(&args).stdout;
    // Suspended once the heap is filled ("ready").
    let (mut seen, mut k) = run_and_suspend(&here, &args, 800);
    while !String::from_utf8_lossy(&seen).contains("ready") {
        let (more, k2) = crate::harness::resume_and_suspend(&here, &[&k], 800);
        seen.extend(more);
        k = k2;
    }
    let layout = here.path("layout");
    let at = |tag: &str| format!("oci:{}:{tag}", layout.display());
    let (_, err, code) = here.output(&["export", &k, "-o", &at("v1")]);
    assert_eq!(code, 0, "{err}");
    let (more, k2) = crate::harness::resume_and_suspend(&here, &[&k], 400);
    seen.extend(more);
    let (_, err, code) = here.output(&["export", &k2, "-o", &at("v2")]);
    assert_eq!(code, 0, "{err}");
    let (v1, v2) = (layers_of(&layout, "v1"), layers_of(&layout, "v2"));
    let parts: Vec<&str> = v2.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(parts.first(), Some(&"program"));
    assert_eq!(parts.last(), Some(&"state"));
    let memory = |l: &[(String, String)]| -> Vec<String> {
        l.iter()
            .filter(|(p, _)| p == "memory")
            .map(|(_, d)| d.clone())
            .collect()
    };
    let (m1, m2) = (memory(&v1), memory(&v2));
    assert!(m2.len() >= 3, "96 MiB of heap in 32 MiB regions: {parts:?}");
    let shared = m2.iter().filter(|d| m1.contains(d)).count();
    assert!(
        shared >= m2.len() - 2 && shared >= 1,
        "{shared} of {} memory layers shared",
        m2.len()
    );
    assert_ne!(v1.last(), v2.last(), "the state differs");
    let there = Env::new();
    imports_and_ends_like_plain(&there, &at("v2"), &k2, &mut seen, &plain);
}

/// Mounted files go into OCI layers of their own, grouped by content: a second snapshot
/// after a small file was added to the mount shares every files layer of the first but the
/// one the new file falls in, and its import resumes into an empty directory and ends as an
/// uninterrupted run, the directory holding the same files.
#[test]
fn mounted_files_that_did_not_change_are_shared_layers() {
    let here = Env::new();
    let g = guest("wasm/cpu.wasm");
    let (dir, d) = here.data_dir("data");
    for i in 0..12 {
        std::fs::write(
            dir.join(format!("big-{i}.bin")),
            crate::harness::varied_bytes(8 << 20, i),
        )
        .unwrap();
    }
    let args = ["--dir", &d, g.to_str().unwrap(), "--", "120"];
    let plain = here.plain(&args).stdout;
    let (mut seen, k) = run_and_suspend(&here, &args, 300);
    let layout = here.path("layout");
    let at = |tag: &str| format!("oci:{}:{tag}", layout.display());
    let (_, err, code) = here.output(&["export", &k, "-o", &at("v1")]);
    assert_eq!(code, 0, "{err}");
    std::fs::write(dir.join("note.txt"), "added while suspended\n").unwrap();
    let (more, k2) =
        crate::harness::resume_and_suspend(&here, &["--dir", &d, "--allow-changed-dirs", &k], 300);
    seen.extend(more);
    let (_, err, code) = here.output(&["export", &k2, "-o", &at("v2")]);
    assert_eq!(code, 0, "{err}");
    let files = |tag: &str| -> Vec<String> {
        layers_of(&layout, tag)
            .into_iter()
            .filter(|(p, _)| p == "files")
            .map(|(_, d)| d)
            .collect()
    };
    let (f1, f2) = (files("v1"), files("v2"));
    assert!(
        f1.len() >= 3,
        "96 MiB of files in groups of ~16 MiB: {f1:?}"
    );
    let new = f2.iter().filter(|d| !f1.contains(d)).count();
    assert!(new <= 1, "{new} of {} files layers new", f2.len());
    assert!(f2.len() - new >= f1.len() - 1, "{f1:?} then {f2:?}");
    let there = Env::new();
    let (out, err, code) = there.output(&["import", &at("v2")]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("imported {k2}"));
    let (there_dir, td) = there.data_dir("data");
    seen.extend(resume_to_end_with(&there, &["--dir", &td], &k2));
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain)
    );
    assert!(dir_contents(&there_dir) == dir_contents(&dir));
}

/// Through a real container registry: `ferry export -o oci:…`, `skopeo copy` to a registry
/// (Debian's `docker-registry`, the CNCF distribution registry, on a local port) and back
/// into another layout, `ferry import oci:…` in a store that shares nothing, and the guest
/// resumes byte-identically. (`scripts/setup.sh` installs skopeo and unpacks the registry.)
#[test]
fn a_snapshot_moves_through_a_container_registry() {
    let tool = |name: &str| {
        crate::harness::tool(name)
            .unwrap_or_else(|| panic!("{name} is missing: run scripts/setup.sh"))
    };
    let (skopeo_bin, registry_bin) = (tool("skopeo"), tool("docker-registry"));
    let (here, plain, mut seen, k) = suspended_cpu_guest();
    // A registry on a free port, storing in this test's directory.
    let port = crate::harness::free_port();
    let config = here.path("registry.yml");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            here.path("registry").display()
        ),
    )
    .unwrap();
    let mut registry = std::process::Command::new(&registry_bin)
        .args(["serve", config.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _registry = Killed(std::mem::replace(
        &mut registry,
        std::process::Command::new("true").spawn().unwrap(),
    ));
    crate::harness::wait_for_port(port, "the registry");
    let out = here.path("out");
    let (_, err, code) = here.output(&["export", &k, "-o", &format!("oci:{}:snap", out.display())]);
    assert_eq!(code, 0, "{err}");
    let skopeo = |args: &[&str]| {
        let o = std::process::Command::new(&skopeo_bin)
            .args([
                "--insecure-policy",
                "copy",
                "--src-tls-verify=false",
                "--dest-tls-verify=false",
            ])
            .args(args)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "skopeo {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    let remote = format!("docker://127.0.0.1:{port}/ferry/cpu:snap");
    skopeo(&[&format!("oci:{}:snap", out.display()), &remote]);
    let back = here.path("back");
    skopeo(&[&remote, &format!("oci:{}:snap", back.display())]);
    let source = format!("oci:{}:snap", back.display());
    imports_and_ends_like_plain(&Env::new(), &source, &k, &mut seen, &plain);
}

/// Through an S3-compatible bucket (moto's server, checking the signature of every request):
/// `export -o s3://BUCKET/PREFIX:TAG` writes the OCI layout there, every blob named by its
/// SHA-256; a later snapshot of the same run sends only the layers the bucket lacks (its
/// program is there), and exporting it again sends none. `import s3://…` in a store that
/// shares nothing brings it back, and it resumes byte-identically. A wrong secret is refused
/// with the store's reason; a layer changed in the bucket is refused on import.
#[test]
fn a_snapshot_moves_through_an_s3_bucket() {
    let s3 = crate::harness::S3Server::start();
    let (here, plain, mut seen, k) = suspended_cpu_guest();
    let here = s3.for_ferry(here);
    let at = |tag: &str| format!("s3://ferry-test/snaps/cpu:{tag}");
    let (_, err, code) = here.output(&["export", &k, "-o", &at("v1")]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("to the OCI layout in s3://ferry-test/snaps/cpu, tag `v1`"),
        "{err}"
    );
    let layers = crate::harness::number_after(&err, "; sent all ")
        .unwrap_or_else(|| panic!("every layer sent to an empty bucket: {err}"));
    assert!(layers >= 3, "program, memory, state: {err}");
    let (more, k2) = crate::harness::resume_and_suspend(&here, &[&k], 300);
    seen.extend(more);
    let (_, err, code) = here.output(&["export", &k2, "-o", &at("v2")]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(" layers (")
            && err.contains("the bucket held the rest (")
            && err.contains(" known from earlier exports: not built again)"),
        "the program layer is not sent again, nor built again: {err}"
    );
    let (_, err, code) = here.output(&["export", &k2, "-o", &at("again")]);
    assert_eq!(code, 0, "{err}");
    // This store built every layer of k2 for v2: none is built again.
    let held = crate::harness::number_after(&err, "the bucket held all ")
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        err.contains(&format!(
            "already: none sent ({held} known from earlier exports: not built again)"
        )),
        "{err}"
    );
    // Every blob is named by the SHA-256 of its bytes; the index holds the three tags.
    let checked = s3.boto(
        r#"
import hashlib
n = 0
for o in s3.list_objects_v2(Bucket="ferry-test", Prefix="snaps/cpu/blobs/sha256/")["Contents"]:
    body = s3.get_object(Bucket="ferry-test", Key=o["Key"])["Body"].read()
    assert hashlib.sha256(body).hexdigest() == o["Key"].rsplit("/", 1)[1], o["Key"]
    n += 1
index = json.loads(s3.get_object(Bucket="ferry-test", Key="snaps/cpu/index.json")["Body"].read())
print(n, sorted(m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]))
"#,
    );
    assert!(checked.contains("['again', 'v1', 'v2']"), "{checked}");
    // A wrong secret: the store's refusal, and nothing imported.
    let wrong = s3
        .for_ferry(Env::new())
        .with_var("AWS_SECRET_ACCESS_KEY", "not-the-secret");
    let (_, err, code) = wrong.output(&["import", &at("v2")]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("403 SignatureDoesNotMatch"), "{err}");
    let there = s3.for_ferry(Env::new());
    imports_and_ends_like_plain(&there, &at("v2"), &k2, &mut seen, &plain);
    // One byte of v1's last layer (its state) changed in the bucket: refused on import.
    s3.boto(
        r#"
get = lambda key: s3.get_object(Bucket="ferry-test", Key="snaps/cpu/" + key)["Body"].read()
index = json.loads(get("index.json"))
v1 = [m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == "v1"][0]
layer = json.loads(get("blobs/sha256/" + v1["digest"][7:]))["layers"][-1]["digest"][7:]
body = bytearray(get("blobs/sha256/" + layer))
body[len(body) // 2] ^= 1
s3.put_object(Bucket="ferry-test", Key="snaps/cpu/blobs/sha256/" + layer, Body=bytes(body))
"#,
    );
    let fresh = s3.for_ferry(Env::new());
    let (_, err, code) = fresh.output(&["import", &at("v1")]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("cannot import s3://ferry-test/snaps/cpu:v1")
            && err.contains("capsule is corrupt"),
        "{err}"
    );
    let (_, err, code) = fresh.output(&["resume", &k]);
    assert_eq!(code, 1, "nothing was named: {err}");
}

/// `run --checkpoint-every 300ms --export-to s3://…` exports each checkpoint into the bucket
/// in the background, under the session's name: once the bucket's index names it, the run
/// is killed (`SIGKILL`: the machine is lost), and a store that shares nothing imports the
/// session's tag and resumes it — printing the rest of what an uninterrupted run prints,
/// from that checkpoint on. A suspend ends once its snapshot is exported: its tag in the
/// bucket names that very snapshot, which resumes elsewhere to the end.
#[test]
fn checkpoints_exported_to_a_bucket_resume_elsewhere_after_the_machine_is_lost() {
    use std::process::Stdio;
    let s3 = crate::harness::S3Server::start();
    let here = s3.for_ferry(Env::new());
    let g = guest("wasm/cpu.wasm");
    let g = g.to_str().unwrap();
    let plain = here.plain(&[g, "--", "400"]).stdout;
    let mut child = here
        .ferry()
        .args(["run", "--session", "lost", "--checkpoint-every", "300ms"])
        .args(["--export-to", "s3://ferry-test/runs", g, "--", "400"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let tagged = |tag: &str| {
        s3.boto(
            r#"
try:
    index = json.loads(s3.get_object(Bucket="ferry-test", Key="runs/index.json")["Body"].read())
    print([m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]])
except s3.exceptions.NoSuchKey:
    print([])
"#,
        )
        .contains(&format!("'{tag}'"))
    };
    crate::migrate::eventually("a checkpoint is in the bucket", || tagged("lost"));
    // `ps` shows where the run exports and how recently a snapshot got there.
    crate::migrate::eventually("ps shows the export", || {
        let (out, _, _) = here.output(&["ps", "--json"]);
        let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
        let row = rows.as_array().unwrap().iter().find(|r| r["id"] == "lost");
        let e = &row.unwrap()["export"];
        e["to"] == "s3://ferry-test/runs:lost" && e["exported"]["snapshot"].is_string()
    });
    let (table, _, _) = here.output(&["ps"]);
    let row = table.lines().find(|l| l.starts_with("lost ")).unwrap();
    assert!(
        table.lines().next().unwrap().ends_with("  EXPORTED")
            && row.contains(" ago blake3:")
            && row.contains("s ago"),
        "{table}"
    );
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("could not export"), "{err}");
    let there = s3.for_ferry(Env::new());
    let (imported, err, code) = there.output(&["import", "s3://ferry-test/runs:lost"]);
    assert_eq!(code, 0, "{err}");
    let k = imported
        .trim()
        .strip_prefix("imported ")
        .unwrap()
        .to_owned();
    let rest = resume_to_end(&there, &k);
    assert!(
        !rest.is_empty() && rest.len() < plain.len() && plain.ends_with(&rest),
        "resumed from a checkpoint, it prints the rest of the run: {}",
        String::from_utf8_lossy(&rest)
    );
    // Suspended: the tag names the suspend's own snapshot once ferry has ended.
    let (out, k) = crate::harness::suspend_after_output(
        &here,
        "run",
        &[
            "--session",
            "sus",
            "--export-to",
            "s3://ferry-test/runs",
            g,
            "--",
            "400",
        ],
        500,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "ferry: exported {k} to the OCI layout in s3://ferry-test/runs, tag `sus`"
        )) && err
            .contains("`ferry resume s3://ferry-test/runs:sus --export-to s3://ferry-test/runs` on another machine goes on from it")
            && err.contains(&format!(
                "resume it with `ferry resume --export-to s3://ferry-test/runs:sus {}`",
                &k[..19]
            )),
        "{err}"
    );
    let (listed, _, _) = here.output(&["ps", "--all", "--json"]);
    let rows: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let sus = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == "sus")
        .unwrap();
    assert_eq!(sus["export"]["exported"]["snapshot"], k.as_str(), "{sus}");
    assert!(sus["export"]["exporting"].is_null() && sus["export"]["error"].is_null());
    // `resume s3://…` imports and resumes in one step.
    let mut seen = out.stdout;
    let elsewhere = s3.for_ferry(Env::new());
    let resumed = elsewhere
        .ferry()
        .args(["resume", "s3://ferry-test/runs:sus"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&resumed.stderr);
    assert_eq!(resumed.status.code(), Some(0), "{err}");
    assert!(
        err.contains(&format!(
            "ferry: imported {k} from s3://ferry-test/runs:sus ("
        )),
        "{err}"
    );
    seen.extend(resumed.stdout);
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain)
    );
    // A place that is neither: refused before anything runs; so is a run on a space.
    let (_, err, code) = here.output(&["run", "--export-to", "/tmp/x", g]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("neither s3://BUCKET/PREFIX[:TAG] nor oci:DIR[:TAG]"),
        "{err}"
    );
    let (_, err, code) = Env::new().with_var("FERRY_TOKEN", "t").output(&[
        "--space",
        "http://127.0.0.1:9",
        "run",
        "--export-to",
        "s3://ferry-test/runs",
        g,
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--export-to is for local runs"), "{err}");
}

/// Names and last-modified times of the files of `layout`'s `blobs/sha256`.
fn blob_times(
    layout: &std::path::Path,
) -> std::collections::BTreeMap<String, std::time::SystemTime> {
    std::fs::read_dir(layout.join("blobs/sha256"))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = e.metadata().unwrap().modified().unwrap();
            (e.file_name().to_string_lossy().into_owned(), m)
        })
        .collect()
}

/// Sets the last-modified time of `path` to `ago` before now.
fn age_file(path: &std::path::Path, ago: std::time::Duration) {
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - ago)
        .unwrap();
}

/// A checkpoint exported again under the same tag leaves the first one's layers in the
/// layout; `ferry prune` deletes what no tag needs once it is older than the grace (after a
/// dry run that says the same and deletes nothing), keeps what is younger, and touches
/// nothing a tag needs: the tag still imports and resumes to the end like a plain run. A
/// layer an export reuses is made new, so a prune running beside it does not take it.
/// `--untag` drops a tag and what only it needed; a tag, a missing tag or a place that is
/// no layout are refused with their reason.
#[test]
fn prune_deletes_what_no_tag_needs_from_an_oci_layout() {
    let (here, plain, mut seen, k) = suspended_cpu_guest();
    let layout = here.path("layout");
    let at = format!("oci:{}", layout.display());
    let tagged = |tag: &str| format!("{at}:{tag}");
    let (_, err, code) = here.output(&["export", &k, "-o", &tagged("cpu")]);
    assert_eq!(code, 0, "{err}");
    let first = blob_times(&layout);
    let (more, k2) = crate::harness::resume_and_suspend(&here, &[&k], 300);
    seen.extend(more);
    let (_, err, code) = here.output(&["export", &k2, "-o", &tagged("cpu")]);
    assert_eq!(code, 0, "{err}");
    let needed: std::collections::BTreeSet<String> = layers_of(&layout, "cpu")
        .into_iter()
        .map(|(_, d)| d[7..].to_owned())
        .collect();
    let all = blob_times(&layout);
    // Of the first export, what the second did not write again: its manifest, its state.
    let stale: Vec<&String> = first
        .keys()
        .filter(|b| !needed.contains(*b) && all.contains_key(*b))
        .filter(|b| {
            let m = manifest_of(&layout, "cpu");
            m["config"]["digest"].as_str() != Some(&format!("sha256:{b}"))
        })
        .collect();
    assert!(
        stale.len() >= 2,
        "the old manifest and state at least: {stale:?}"
    );
    let foreign = layout.join("blobs/sha256/README");
    std::fs::write(&foreign, "not a blob").unwrap();
    let partial = layout.join("blobs/sha256/.ferry-partial-left");
    std::fs::write(&partial, "an export that ended early").unwrap();
    // All within the default grace (1h): kept.
    let (_, err, code) = here.output(&["prune", &at]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!("ferry: {at}: deleted 0 blobs"))
            && err.contains(&format!("and {} blobs (", stale.len() + 1))
            && err.contains("written in the last 1h"),
        "{err}"
    );
    // Old, and no tag needs them: what a dry run lists, and then deletes. A layer the tag
    // needs is as old, yet kept; so is what is not a blob.
    for b in &stale {
        age_file(
            &layout.join("blobs/sha256").join(b),
            std::time::Duration::from_secs(7200),
        );
    }
    age_file(&partial, std::time::Duration::from_secs(7200));
    age_file(&foreign, std::time::Duration::from_secs(7200));
    let kept = needed.iter().next().unwrap();
    age_file(
        &layout.join("blobs/sha256").join(kept),
        std::time::Duration::from_secs(7200),
    );
    let (_, err, code) = here.output(&["prune", &at, "--dry-run"]);
    assert_eq!(code, 0, "{err}");
    let doomed = stale.len() + 1;
    assert!(
        err.contains(&format!(": would delete {doomed} blobs (")),
        "{err}"
    );
    assert_eq!(
        blob_times(&layout).len(),
        all.len() + 2,
        "a dry run deletes nothing"
    );
    // An export that reuses the old layer the tag needs makes it new again.
    let (_, err, code) = here.output(&["export", &k2, "-o", &tagged("cpu")]);
    assert_eq!(code, 0, "{err}");
    let age = blob_times(&layout)[kept].elapsed().unwrap();
    assert!(
        age < std::time::Duration::from_secs(600),
        "touched: {age:?}"
    );
    let (_, err, code) = here.output(&["prune", &at]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!(": deleted {doomed} blobs (")) && err.contains("its 1 tag needs"),
        "{err}"
    );
    let left = blob_times(&layout);
    assert!(stale.iter().all(|b| !left.contains_key(*b)) && !partial.exists());
    assert!(needed.iter().all(|b| left.contains_key(b)) && foreign.exists());
    // Refusals, each with its reason.
    for (args, reason) in [
        (
            vec!["prune", &tagged("cpu")],
            "prune takes a whole layout, not a tag",
        ),
        (
            vec!["prune", &at, "--untag", "nope"],
            "has no tag `nope` (tags: cpu)",
        ),
        (
            vec!["prune", "oci:/nonexistent/layout"],
            "is not an OCI image layout",
        ),
        (
            vec!["prune", "layout"],
            "is not a layout: give oci:DIR or s3://BUCKET/PREFIX",
        ),
    ] {
        let (_, err, code) = here.output(&args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains(reason), "{args:?}: {err}");
    }
    let there = Env::new();
    imports_and_ends_like_plain(&there, &tagged("cpu"), &k2, &mut seen, &plain);
    // The tag dropped: every blob goes (the grace 0: no export runs now).
    let (_, err, code) = here.output(&["prune", &at, "--untag", "cpu", "--grace", "0"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("removed tag `cpu`, deleted "), "{err}");
    assert_eq!(
        blob_times(&layout).into_keys().collect::<Vec<_>>(),
        ["README"]
    );
    let (_, err, code) = Env::new().output(&["import", &tagged("cpu")]);
    assert_eq!(code, 1);
    assert!(err.contains("has no manifest tagged `cpu`"), "{err}");
}

/// The same in a bucket: a checkpoint exported again under its tag, the first one's layers
/// pruned once the grace is over (the bucket's listing and clock), the tag still imported
/// and resumed to the end elsewhere; an object copied onto itself (how an export makes a
/// reused layer new) keeps its bytes and gets a new time; `--untag` empties the layout.
#[test]
fn prune_deletes_what_no_tag_needs_from_a_bucket() {
    let s3 = crate::harness::S3Server::start();
    let (here, plain, mut seen, k) = suspended_cpu_guest();
    let here = s3.for_ferry(here);
    let at = "s3://ferry-test/snaps";
    let (_, err, code) = here.output(&["export", &k, "-o", &format!("{at}:cpu")]);
    assert_eq!(code, 0, "{err}");
    let (more, k2) = crate::harness::resume_and_suspend(&here, &[&k], 300);
    seen.extend(more);
    let (_, err, code) = here.output(&["export", &k2, "-o", &format!("{at}:cpu")]);
    assert_eq!(code, 0, "{err}");
    let count = || {
        s3.boto(
            r#"print(len(s3.list_objects_v2(Bucket="ferry-test", Prefix="snaps/blobs/sha256/").get("Contents", [])))"#,
        )
        .trim()
        .parse::<usize>()
        .unwrap()
    };
    let before = count();
    // The bucket's times are whole seconds: a second later, all is older than 1ms.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let (_, err, code) = here.output(&["prune", at, "--dry-run", "--grace", "1ms"]);
    assert_eq!(code, 0, "{err}");
    let doomed =
        crate::harness::number_after(&err, ": would delete ").unwrap_or_else(|| panic!("{err}"));
    assert!(doomed >= 2, "the old manifest and state at least: {err}");
    assert_eq!(count(), before);
    let (_, err, code) = here.output(&["prune", at]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(": deleted 0 blobs") && err.contains("written in the last 1h"),
        "{err}"
    );
    let (_, err, code) = here.output(&["prune", at, "--grace", "1ms"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!(": deleted {doomed} blobs (")),
        "{err}"
    );
    assert_eq!(count(), before - doomed as usize);
    // Copied onto itself: the same bytes, a new time.
    let key = "snaps/oci-layout";
    let when = || {
        s3.boto(&format!(
            r#"o = s3.head_object(Bucket="ferry-test", Key="{key}"); print(o["LastModified"].timestamp(), o["ContentLength"])"#
        ))
    };
    let was = when();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let bucket = ferry_space::s3::Bucket::new(
        "ferry-test",
        Some(&s3.endpoint),
        "us-east-1",
        Some(ferry_space::s3::Credentials {
            access_key: s3.access_key.clone(),
            secret: s3.secret.clone(),
            token: None,
        }),
    )
    .unwrap();
    assert!(bucket.touch(key).unwrap());
    let now = when();
    assert_ne!(was, now);
    assert_eq!(was.split_whitespace().nth(1), now.split_whitespace().nth(1));
    assert!(!bucket.touch("snaps/not-there").unwrap());
    let there = s3.for_ferry(Env::new());
    imports_and_ends_like_plain(&there, &format!("{at}:cpu"), &k2, &mut seen, &plain);
    let (_, err, code) = here.output(&["prune", at, "--untag", "cpu", "--grace", "0"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("removed tag `cpu`, deleted ") && err.contains("its 0 tags need"),
        "{err}"
    );
    assert_eq!(count(), 0);
    // A bucket that is not there is said to be so, not taken for an empty layout.
    for args in [
        ["import", "s3://no-such-bucket/snaps:cpu"],
        ["prune", "s3://no-such-bucket/snaps"],
    ] {
        let (_, err, code) = here.output(&args);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("404 NoSuchBucket"), "{args:?}: {err}");
    }
}

/// `run --export-to oci:DIR --export-prune GRACE`: each export also deletes what no tag
/// needs and is older than GRACE, so a run checkpointed many times leaves in the layout
/// only what its tag needs — where the same run without it leaves every checkpoint's
/// manifest and state behind. The suspend's snapshot, exported last, resumes to the end.
#[test]
fn a_run_that_exports_and_prunes_leaves_only_what_its_tag_needs() {
    let here = Env::new();
    let g = guest("wasm/cpu.wasm");
    let g = g.to_str().unwrap();
    let plain = here.plain(&[g, "--", "400"]).stdout;
    let blobs = |dir: &std::path::Path| -> std::collections::BTreeSet<String> {
        blob_times(dir).into_keys().collect()
    };
    let needed = |dir: &std::path::Path, tag: &str| -> std::collections::BTreeSet<String> {
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
        let m = &index["manifests"][0];
        assert_eq!(m["annotations"]["org.opencontainers.image.ref.name"], tag);
        let manifest = manifest_of(dir, tag);
        layers_of(dir, tag)
            .into_iter()
            .map(|(_, d)| d)
            .chain([
                m["digest"].as_str().unwrap().to_owned(),
                manifest["config"]["digest"].as_str().unwrap().to_owned(),
            ])
            .map(|d| d[7..].to_owned())
            .collect()
    };
    let run = |session: &str, prune: &[&str]| {
        let layout = here.path(session);
        let to = format!("oci:{}", layout.display());
        let mut args = vec!["--session", session, "--checkpoint-every", "100ms"];
        args.extend(["--export-to", &to]);
        args.extend(prune);
        args.extend([g, "--", "400"]);
        let (out, k) = crate::harness::suspend_after_output(&here, "run", &args, 1500);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("ferry: exported {k} to")), "{err}");
        assert!(!err.contains("could not"), "{err}");
        (layout, out.stdout, k)
    };
    let (kept, _, _) = run("kept", &[]);
    assert!(
        blobs(&kept).len() > needed(&kept, "kept").len() + 2,
        "checkpoints' layers are left behind without --export-prune"
    );
    let (pruned, mut seen, k) = run("pruned", &["--export-prune", "1ms"]);
    assert_eq!(blobs(&pruned), needed(&pruned, "pruned"));
    let there = Env::new();
    let source = format!("oci:{}:pruned", pruned.display());
    imports_and_ends_like_plain(&there, &source, &k, &mut seen, &plain);
    // Not without --export-to.
    let (_, err, code) = here.output(&["run", "--export-prune", "1h", g]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--export-to"), "{err}");
}

/// A connection to the bucket that breaks in the middle of a layer (a proxy cuts it once)
/// does not fail the import: the rest of the layer is asked for where it broke (a range of
/// the same object, by its ETag), and the snapshot, every byte checked, resumes to the end.
#[test]
fn an_import_goes_on_where_the_connection_to_the_bucket_broke() {
    let s3 = crate::harness::S3Server::start();
    let (here, plain, mut seen, k) = suspended_cpu_guest();
    let here = s3.for_ferry(here);
    let (_, err, code) = here.output(&["export", &k, "-o", "s3://ferry-test/cut:v1"]);
    assert_eq!(code, 0, "{err}");
    let upstream: u16 = s3.endpoint.rsplit(':').next().unwrap().parse().unwrap();
    let (port, cut) = crate::harness::cutting_proxy(upstream, 12_000);
    let there = s3
        .for_ferry(Env::new())
        .with_var("AWS_ENDPOINT_URL", &format!("http://127.0.0.1:{port}"));
    let (out, err, code) = there.output(&["import", "s3://ferry-test/cut:v1"]);
    assert_eq!(code, 0, "{err}");
    assert!(cut.load(std::sync::atomic::Ordering::SeqCst));
    assert!(
        err.contains("reading s3://ferry-test/cut/blobs/sha256/")
            && err.contains("; asking for the rest"),
        "the cut came in the middle of a layer: {err}"
    );
    assert_eq!(out.trim(), format!("imported {k}"));
    seen.extend(resume_to_end(&there, &k));
    assert_eq!(
        String::from_utf8_lossy(&seen),
        String::from_utf8_lossy(&plain)
    );
}

/// The entry of `tag` in the index of the directory layout `dir`.
fn index_entry(dir: &std::path::Path, tag: &str) -> serde_json::Value {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
    index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
        .unwrap()
        .clone()
}

/// A resume from a tag whose run is still going (it renews the tag's lease) waits, sees the
/// lease renewed and refuses: the session runs there. With --take-over it takes the lease at
/// once, and the run it took over — a machine cut off, not lost — finds the lease taken at
/// its next renewal, exports no more and suspends; resumed where it was, it is refused
/// before it runs.
#[test]
fn a_run_resumed_elsewhere_from_its_tag_takes_it_over_and_the_first_run_stops() {
    use std::process::Stdio;
    let here = Env::new();
    let g = guest("wasm/cpu.wasm");
    let g = g.to_str().unwrap();
    let plain = here.plain(&[g, "--", "600"]).stdout;
    let layout = here.path("home");
    let to = format!("oci:{}", layout.display());
    let every = [
        "--checkpoint-every",
        "200ms",
        "--export-to",
        &to,
        "--export-lease",
        "4s",
    ];
    let first = here
        .ferry()
        .args(["run", "--session", "job"])
        .args(every)
        .args([g, "--", "600"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    crate::migrate::eventually("the first run exported", || {
        layout.join("index.json").exists()
    });
    assert_eq!(
        index_entry(&layout, "job")["annotations"]["dev.ferry.epoch"],
        "1"
    );
    let there = Env::new();
    let tag = format!("{to}:job");
    // A tag a run holds is not untagged: its next export would tag it again.
    let (_, err, code) = there.output(&["prune", &to, "--untag", "job"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("tag `job` of ") && err.contains("is held by a run that is still going"),
        "{err}"
    );
    let (_, err, code) = there.output(&[&["resume", &tag][..], &every[..]].concat());
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("is held by a run (writer ")
            && err.contains("waiting up to")
            && err.contains("renewed its lease while this one waited): the session runs there"),
        "{err}"
    );
    let second = there
        .ferry()
        .args(["resume", &tag, "--take-over"])
        .args(every)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(0), "{err}");
    assert!(
        !err.contains("could not export") && !err.contains("taken over"),
        "{err}"
    );
    assert!(
        !second.stdout.is_empty() && plain.ends_with(&second.stdout),
        "the run that took over prints the rest of the run"
    );
    let first = first.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&first.stderr);
    assert_eq!(first.status.code(), Some(75), "{err}");
    assert!(
        err.contains("ferry: tag `job` was taken over by another run (writer ")
            && err.contains(", epoch 2) of ")
            && err.contains(": the session goes on there; this run exports no more and suspends"),
        "{err}"
    );
    assert!(
        err.contains(&format!("it goes on from {tag} elsewhere (a resume of ")),
        "{err}"
    );
    assert!(
        !err.contains("resume it with"),
        "a run taken over does not suggest resuming it: {err}"
    );
    assert!(
        first.stdout.len() < plain.len(),
        "the first run stopped early"
    );
    let entry = index_entry(&layout, "job");
    assert_eq!(entry["annotations"]["dev.ferry.epoch"], "2", "{entry}");
    // The first run resumed where it was: refused before it runs.
    let (out, err, code) = here.output(&[&["resume", "job"][..], &every[..]].concat());
    assert_eq!(code, 1, "{err}");
    assert!(
        out.is_empty() && err.contains("was taken over by another run (writer "),
        "{err}"
    );
    // The run that took over gave the lease up as it ended: a resume from the tag is refused,
    // since it would run the end again.
    let (_, err, code) = Env::new().output(&[&["resume", &tag][..], &every[..]].concat());
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("exited(0)") && err.contains("would run its end again"),
        "{err}"
    );
    assert_eq!(
        index_entry(&layout, "job")["annotations"]["dev.ferry.epoch"],
        "2"
    );
    // Once it ended, the tag is untagged, and its lease goes with it.
    assert!(layout.join("ferry-leases/job").exists());
    let (_, err, code) = there.output(&["prune", &to, "--untag", "job", "--grace", "0"]);
    assert_eq!(code, 0, "{err}");
    assert!(!layout.join("ferry-leases/job").exists(), "{err}");
}

/// A run cut off from the bucket it exports to (its network gone, not its machine) cannot
/// renew its lease on its tag: it suspends itself within half the lease's time to live, and a
/// resume from the tag on another machine waits for the lease to lapse before it takes the
/// session over — so the second run prints nothing before the first has stopped.
#[test]
fn a_run_cut_off_from_its_bucket_stops_before_a_run_elsewhere_takes_its_session_over() {
    use std::io::Read;
    use std::process::Stdio;
    let s3 = crate::harness::S3Server::start();
    let upstream: u16 = s3.endpoint.rsplit(':').next().unwrap().parse().unwrap();
    let (port, cut) = crate::harness::switched_proxy(upstream);
    let here = s3
        .for_ferry(Env::new())
        .with_var("AWS_ENDPOINT_URL", &format!("http://127.0.0.1:{port}"));
    let g = guest("wasm/cpu.wasm");
    let g = g.to_str().unwrap();
    let plain = here.plain(&[g, "--", "600"]).stdout;
    let lease = ["--export-to", "s3://ferry-test/cut", "--export-lease", "4s"];
    let first = here
        .ferry()
        .args(["run", "--session", "job", "--checkpoint-every", "300ms"])
        .args(lease)
        .args([g, "--", "600"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    crate::migrate::eventually("the first run exported", || {
        s3.boto(
            r#"
try:
    s3.head_object(Bucket="ferry-test", Key="cut/index.json")
    print("there")
except Exception:
    print("not yet")
"#,
        )
        .contains("there")
    });
    // An import while the run goes on is a copy, and says so.
    let (_, err, code) = s3
        .for_ferry(Env::new())
        .output(&["import", "s3://ferry-test/cut:job"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("tag `job` of s3://ferry-test/cut is held by a run that is still going")
            && err.contains("this is a copy of its last export, not the session"),
        "{err}"
    );
    cut.store(true, std::sync::atomic::Ordering::SeqCst);
    let first = std::thread::spawn(move || {
        let out = first.wait_with_output().unwrap();
        (out, std::time::Instant::now())
    });
    // Bound to a name: the store must outlive the process.
    let there = s3.for_ferry(Env::new());
    let mut second = there
        .ferry()
        .args(["resume", "s3://ferry-test/cut:job"])
        .args(lease)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = second.stdout.take().unwrap();
    let printing = std::thread::spawn(move || {
        let mut out = vec![0u8; 1];
        let read = stdout.read_exact(&mut out);
        let began = std::time::Instant::now();
        stdout.read_to_end(&mut out).unwrap();
        (read.map(|()| out), began)
    });
    let second = second.wait_with_output().unwrap();
    let (printed, began) = printing.join().unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(0), "{err}");
    let printed = printed.unwrap();
    assert!(
        err.contains("is held by a run (writer ")
            && err.contains("waiting up to")
            && err.contains("the lease of tag `job` lapsed after"),
        "{err}"
    );
    assert!(
        plain.ends_with(&printed),
        "the run that took over prints the rest of the run"
    );
    let (first, stopped) = first.join().unwrap();
    let err = String::from_utf8_lossy(&first.stderr);
    assert_eq!(first.status.code(), Some(75), "{err}");
    assert!(
        err.contains("could not be renewed for")
            && err.contains("this run exports no more and suspends"),
        "{err}"
    );
    assert!(
        first.stdout.len() < plain.len() && plain.starts_with(&first.stdout),
        "the first run stopped early"
    );
    assert!(
        stopped < began,
        "the first run ended before the second printed anything"
    );
    // `ps` says why the first run's exports stopped.
    let (listed, _, _) = here.output(&["ps", "--all", "--json"]);
    let rows: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let row = rows.as_array().unwrap().iter().find(|r| r["id"] == "job");
    assert_eq!(
        row.unwrap()["export"]["error"],
        "this run lost its lease on the tag",
        "{listed}"
    );
}
