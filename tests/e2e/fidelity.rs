//! Fidelity: a checkpoint restored on another machine (a fresh runner cache)
//! is the same workspace, down to git's view of it.

use std::fs;
use std::path::Path;

use cairn_e2e::{
    Coordinator, TreeSnapshot, append, git, json_str, json_u64, run, set_mode, symlink, tempdir,
    write, write_pseudo_random,
};
use serde_json::Value;

const TRANSCRIPT: &str =
    ".cairn/state/claude/projects/-workspace-app/0b7e5a52-3c1d-4f8e-9a61-2d4c8e1f7a90.jsonl";

/// A repository with every state git can be in at once, plus the kinds of
/// files a workspace holds outside of git.
fn build_workspace(root: &Path, origin: &Path) {
    let app = root.join("app");
    fs::create_dir_all(&app).unwrap();
    git(
        root,
        &[
            "init",
            "-q",
            "--bare",
            "-b",
            "main",
            origin.to_str().unwrap(),
        ],
    );
    git(&app, &["init", "-q", "-b", "main"]);

    write(&app.join("README.md"), "# demo\n");
    write(
        &app.join("src/lib.rs"),
        "pub fn answer() -> u32 {\n    42\n}\n",
    );
    write(&app.join("run.sh"), "#!/bin/sh\necho run\n");
    set_mode(&app.join("run.sh"), 0o755);
    symlink("README.md", &app.join("readme-link"));
    write(
        &app.join("dir with spaces/file name.txt"),
        "spaces in names\n",
    );
    write(&app.join("ünïcödé/日本語.txt"), "non-ASCII names\n");
    write(&app.join(".gitignore"), "*.log\nbuild/\n");
    git(&app, &["add", "-A"]);
    git(&app, &["commit", "-q", "-m", "initial"]);
    git(&app, &["remote", "add", "origin", origin.to_str().unwrap()]);
    git(&app, &["push", "-q", "-u", "origin", "main"]);

    // Two commits that exist nowhere else.
    append(&app.join("src/lib.rs"), "pub fn second() {}\n");
    git(&app, &["commit", "-q", "-a", "-m", "second, not pushed"]);
    write(&app.join("src/extra.rs"), "pub fn extra() {}\n");
    git(&app, &["add", "src/extra.rs"]);
    git(&app, &["commit", "-q", "-m", "third, not pushed"]);

    append(&app.join("README.md"), "stashed change\n");
    git(&app, &["stash", "push", "-q", "-m", "wip: stashed readme"]);
    append(&app.join("src/extra.rs"), "pub fn staged() {}\n");
    git(&app, &["add", "src/extra.rs"]);
    append(&app.join("src/lib.rs"), "pub fn unstaged() {}\n");
    write(&app.join("notes.txt"), "untracked notes\n");
    write(&app.join("debug.log"), "ignored log\n");
    write_pseudo_random(&app.join("build/out.bin"), 100_000, 11);
    fs::create_dir_all(app.join("empty-in-repo")).unwrap();

    // Outside the repository.
    write_pseudo_random(&root.join("data/big.bin"), 64 << 20, 0x5eed);
    write(&root.join("empty.txt"), "");
    write(&root.join("data/also-empty"), "");
    fs::create_dir_all(root.join("empty-dir/nested/deeper")).unwrap();
    symlink("../app/README.md", &root.join("links/relative"));
    symlink("../nowhere/at/all", &root.join("links/dangling"));
    symlink("../app/src", &root.join("links/to-dir"));
    write(&root.join("name with spaces.txt"), "top-level spaces\n");
    write(&root.join("ñandú/café ☕.md"), "more non-ASCII\n");
    write(&root.join("bin/tool"), "#!/bin/sh\necho tool\n");
    set_mode(&root.join("bin/tool"), 0o755);
    write(&root.join("readonly.txt"), "read only\n");
    set_mode(&root.join("readonly.txt"), 0o444);
    write(&root.join("private/secret"), "not for others\n");
    set_mode(&root.join("private/secret"), 0o600);
    set_mode(&root.join("private"), 0o700);

    let mut transcript = String::new();
    for i in 0..200 {
        let role = ["user", "assistant", "tool_result"][i % 3];
        transcript.push_str(&format!(
            "{{\"type\":\"{role}\",\"sessionId\":\"0b7e5a52-3c1d-4f8e-9a61-2d4c8e1f7a90\",\"n\":{i},\"text\":\"turn {i} of the conversation\"}}\n"
        ));
    }
    write(&root.join(TRANSCRIPT), transcript);
    write(
        &root.join(".cairn/session"),
        "0b7e5a52-3c1d-4f8e-9a61-2d4c8e1f7a90\n",
    );
}

fn repo_entry<'a>(checkpoint: &'a Value, path: &str) -> &'a Value {
    let repos = checkpoint["repos"]
        .as_array()
        .unwrap_or_else(|| panic!("no repos array in {checkpoint}"));
    repos
        .iter()
        .find(|r| r["path"].as_str() == Some(path))
        .unwrap_or_else(|| panic!("no repo with path {path:?} in {}", checkpoint["repos"]))
}

#[test]
fn a_restored_workspace_is_the_same_workspace_on_a_fresh_machine() {
    let tmp = tempdir("fidelity");
    let root = tmp.path().join("workspace");
    let restored = tmp.path().join("restored");
    build_workspace(&root, &tmp.path().join("origin.git"));
    let before = TreeSnapshot::take(&root);

    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("fidelity");
    let checkpoint = coordinator.client().checkpoint(&root, &workspace);

    // Cutting a checkpoint changes nothing in the workspace (not even .git/index).
    before.assert_matches(&root, true);

    let checkpoint_id = json_str(&checkpoint, "checkpoint_id").to_owned();
    assert_eq!(json_str(&checkpoint, "workspace_id"), workspace);
    assert_eq!(json_u64(&checkpoint, "sequence"), 1);
    assert_eq!(json_u64(&checkpoint, "stats.files"), before.files() as u64);
    let symlinks = before
        .nodes
        .values()
        .filter(|n| matches!(n.kind, cairn_e2e::NodeKind::Symlink { .. }))
        .count();
    assert_eq!(json_u64(&checkpoint, "stats.symlinks"), symlinks as u64);
    assert!(
        json_u64(&checkpoint, "stats.total_bytes") >= 64 << 20,
        "{checkpoint}"
    );

    let app = root.join("app");
    let repo = repo_entry(&checkpoint, "app");
    assert_eq!(json_str(repo, "branch"), "main", "{repo}");
    assert_eq!(
        json_str(repo, "head"),
        git(&app, &["rev-parse", "HEAD"]).trim(),
        "{repo}"
    );
    assert_eq!(json_str(repo, "upstream"), "origin/main", "{repo}");
    assert_eq!(json_u64(repo, "ahead"), 2, "{repo}");
    assert_eq!(json_u64(repo, "behind"), 0, "{repo}");
    assert_eq!(json_u64(repo, "staged"), 1, "{repo}");
    assert_eq!(json_u64(repo, "unstaged"), 1, "{repo}");
    assert_eq!(json_u64(repo, "untracked"), 1, "{repo}");
    assert_eq!(json_u64(repo, "stashes"), 1, "{repo}");

    // Another machine: a runner that has never seen this workspace.
    let report = coordinator.client().restore(&restored, &workspace);
    assert_eq!(json_str(&report, "checkpoint_id"), checkpoint_id);
    assert_eq!(
        report["fell_back_from"].as_array().map(Vec::len),
        Some(0),
        "{report}"
    );
    assert_eq!(json_u64(&report, "files"), before.files() as u64);
    before.assert_matches(&restored, true);

    let restored_app = restored.join("app");
    for args in [
        &["status", "--porcelain=v1", "--branch"][..],
        &["stash", "list"],
        &["log", "--oneline", "--all"],
        &["diff", "--cached"],
        &["rev-parse", "HEAD", "@{upstream}"],
    ] {
        assert_eq!(
            git(&restored_app, args),
            git(&app, args),
            "`git {}` differs after restore",
            args.join(" ")
        );
    }
    assert!(
        git(&restored_app, &["status", "--porcelain=v1", "--branch"]).contains("[ahead 2]"),
        "the unpushed commits are still unpushed"
    );
    assert_eq!(
        git(&restored_app, &["stash", "show", "-p", "stash@{0}"]),
        git(&app, &["stash", "show", "-p", "stash@{0}"])
    );
    let fsck = run(cairn_e2e::git_command(&restored_app).args(["fsck", "--full"])).assert_success();
    let output = fsck.all_output().to_lowercase();
    for word in ["error", "missing", "broken", "corrupt"] {
        assert!(!output.contains(word), "git fsck reports a problem: {fsck}");
    }
    assert_eq!(
        fs::read(restored.join(TRANSCRIPT)).unwrap(),
        fs::read(root.join(TRANSCRIPT)).unwrap()
    );
}
