//! The crate layout ARCHITECTURE.md promises, read from the manifests: the
//! engine knows nothing of command lines, and the coordinator (the server)
//! depends on no part of the runner.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The workspace's root directory.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn manifest(dir: &Path) -> toml::Table {
    let path = dir.join("Cargo.toml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.parse()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The crate directory of each workspace dependency that has a path.
fn workspace_paths() -> Vec<(String, PathBuf)> {
    let root_manifest = manifest(&root());
    root_manifest["workspace"]["dependencies"]
        .as_table()
        .unwrap()
        .iter()
        .filter_map(|(name, spec)| {
            let path = spec.get("path")?.as_str()?;
            Some((name.clone(), root().join(path)))
        })
        .collect()
}

/// What the crate in `dir` declares under `[dependencies]` (not optional),
/// and the same of every workspace crate among them, recursively (dev and
/// build dependencies are not part of what the crate ships).
fn declared_closure(dir: &Path) -> BTreeSet<String> {
    let paths = workspace_paths();
    let mut seen = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let deps = manifest(&dir)
            .get("dependencies")
            .and_then(|d| d.as_table().cloned())
            .unwrap_or_default();
        for (name, spec) in &deps {
            // An optional dependency is there only with a feature; the
            // features a crate turns on are checked where they matter.
            let optional = spec.get("optional").and_then(|o| o.as_bool()) == Some(true);
            if !optional
                && seen.insert(name.clone())
                && let Some((_, path)) = paths.iter().find(|(n, _)| n == name)
            {
                stack.push(path.clone());
            }
        }
    }
    seen
}

#[test]
fn the_coordinator_depends_on_no_part_of_the_runner() {
    let deps = declared_closure(&root().join("coordinator"));
    assert!(deps.contains("cairn-proto"), "{deps:?}");
    for runner_side in [
        "cairn-engine",
        "cairn-runner",
        "cairn-host",
        "git2",
        "notify",
        "zstd",
    ] {
        assert!(
            !deps.contains(runner_side),
            "cairn-coordinator depends on {runner_side}: {deps:?}"
        );
    }
}

#[test]
fn the_engine_knows_nothing_of_programs() {
    let engine = root().join("runner/engine");
    let deps = declared_closure(&engine);
    assert!(deps.contains("git2"), "{deps:?}");
    for program_side in [
        "clap",
        "tracing-subscriber",
        "indicatif",
        "anyhow",
        "cairn-runner",
        "cairn-host",
        "cairn-coordinator",
        "cairnctl",
    ] {
        assert!(
            !deps.contains(program_side),
            "cairn-engine depends on {program_side}: {deps:?}"
        );
    }
    // cairn-utils, but without its `cli` feature (the logging setup and flag).
    let utils = &manifest(&engine)["dependencies"]["cairn-utils"];
    assert!(utils.get("features").is_none(), "{utils:?}");
}
