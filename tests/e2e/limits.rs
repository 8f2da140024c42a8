//! Per-checkpoint limits and `--if-changed` without a resident runner:
//! files above a limit are left out of the checkpoint with a warning that
//! names them (on the runner's output and on the checkpoint's record);
//! repository files are kept whatever their size; a run's own limits
//! (`cairnctl runs create --max-file-size`) reach its runner; an unchanged
//! workspace commits nothing when asked `--if-changed`.

use cairn_e2e::fleet::{Fleet, HostOptions};
use cairn_e2e::{
    Coordinator, git, ids_with_prefix, let_timestamps_settle, run, tempdir, write,
    write_pseudo_random,
};
use cairn_proto::runs::RunState;

#[test]
fn files_above_the_limits_are_left_out_with_warnings_and_repositories_are_kept() {
    let tmp = tempdir("limits");
    let root = tmp.path().join("workspace");
    write(&root.join("app/src/main.rs"), "fn main() {}\n");
    write_pseudo_random(&root.join("app/assets/model.bin"), 3 << 20, 1);
    git(&root.join("app"), &["init", "-q", "-b", "main"]);
    git(&root.join("app"), &["add", "."]);
    git(
        &root.join("app"),
        &["commit", "-q", "-m", "with a large asset"],
    );
    // Outside the repository: one file above the per-file limit, and two
    // that together exceed the total.
    write_pseudo_random(&root.join("data/dump.bin"), 2 << 20, 2);
    write_pseudo_random(&root.join("data/half-a.bin"), 900 << 10, 3);
    write_pseudo_random(&root.join("data/half-b.bin"), 800 << 10, 4);
    write(&root.join("notes.md"), "keep me\n");
    let_timestamps_settle();

    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("limited");
    let client = coordinator.client();
    let report = run(client
        .runner()
        .arg("checkpoint")
        .arg("--root")
        .arg(&root)
        .args([
            "--workspace",
            &workspace,
            "--max-file-size",
            "1MiB",
            "--max-total-size",
            "1200KiB",
            "--output",
            "json",
        ]))
    .assert_success()
    .json();
    let warnings: Vec<String> = report["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap().to_owned())
        .collect();
    let says = |text: &str| warnings.iter().any(|w| w.contains(text));
    assert!(
        says("left out data/dump.bin (2.0 MiB): larger than the per-file limit of 1.0 MiB"),
        "{warnings:?}"
    );
    assert!(
        says("left out app/assets/model.bin (3.0 MiB)"),
        "a large working-tree file of a repository is an ordinary file: {warnings:?}"
    );
    assert!(
        says(
            "left out data/half-a.bin (900.0 KiB): the checkpoint would exceed its limit of 1.2 MiB"
        ),
        "{warnings:?}"
    );
    assert!(!says("half-b.bin"), "one file was enough: {warnings:?}");
    assert!(
        says("kept app/.git/objects/"),
        "the repository's 3 MiB object is kept: {warnings:?}"
    );

    // The record carries the warnings, for whoever looks at the checkpoint.
    let listed = coordinator.list_checkpoints(&workspace);
    assert_eq!(listed.len(), 1);
    assert!(
        listed[0]
            .warnings
            .iter()
            .any(|w| w.contains("left out data/dump.bin")),
        "{:?}",
        listed[0].warnings
    );

    let restored = tmp.path().join("restored");
    client.restore(&restored, &workspace);
    for gone in ["data/dump.bin", "data/half-a.bin", "app/assets/model.bin"] {
        assert!(!restored.join(gone).exists(), "{gone} was left out");
    }
    for kept in ["data/half-b.bin", "notes.md", "app/src/main.rs"] {
        assert!(restored.join(kept).is_file(), "{kept} is restored");
    }
    // The history is whole: the left-out file comes back from git.
    git(&restored.join("app"), &["fsck", "--strict"]);
    git(
        &restored.join("app"),
        &["checkout", "--", "assets/model.bin"],
    );
    assert_eq!(
        std::fs::read(restored.join("app/assets/model.bin")).unwrap(),
        std::fs::read(root.join("app/assets/model.bin")).unwrap()
    );
}

#[test]
fn a_runs_own_limits_leave_files_out_of_its_checkpoints() {
    let mut fleet = Fleet::start();
    fleet.start_host("a", HostOptions::default());
    let client = fleet.coordinator.client();
    let binary = format!("binary={}", fleet.agent_binary().display());
    let prompt = "run mkdir -p data && head -c 300000 /dev/urandom > data/big.bin\n\
                  untracked data/small.txt small enough";
    let created = client.ctl_json(&[
        "runs",
        "create",
        "--new-workspace",
        "--name",
        "limited-run",
        "--harness",
        "claude",
        "--harness-config",
        &binary,
        "--prompt",
        prompt,
        "--max-file-size",
        "100KiB",
    ]);
    let run_id = ids_with_prefix(&created, "run-")
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no run id in {created}"));
    assert_eq!(
        created["checkpoint_limits"]["max_file_bytes"], 102_400,
        "{created}"
    );
    assert!(
        created["checkpoint_limits"]["max_total_bytes"].is_null(),
        "{created}"
    );
    let done = fleet.wait_for_state(&run_id, RunState::Succeeded);

    let newest = fleet.checkpoints(&done.workspace_id)[0].clone();
    assert_eq!(newest.id, done.last_checkpoint_id);
    assert!(
        newest
            .warnings
            .iter()
            .any(|w| w.starts_with("left out data/big.bin (")
                && w.ends_with("larger than the per-file limit of 100.0 KiB")),
        "the run's limit reached its runner: {:?}",
        newest.warnings
    );
    let (_checkout, files) = fleet.checkout(&done.workspace_id, &newest.id);
    assert!(!files.join("data/big.bin").exists());
    assert_eq!(
        std::fs::read_to_string(files.join("data/small.txt")).unwrap(),
        "small enough\n"
    );

    let shown = run(client.ctl().args(["runs", "show", &run_id])).assert_success();
    assert!(
        shown
            .stdout
            .lines()
            .any(|l| l.starts_with("checkpoint limits") && l.ends_with("files up to 100.0 KiB")),
        "{shown}"
    );
    let refused = run(client.ctl().args([
        "runs",
        "create",
        "--new-workspace",
        "--harness",
        "claude",
        "--prompt",
        "hello",
        "--max-total-size",
        "0",
    ]));
    assert!(
        !refused.status.success() && refused.stderr.contains("would leave out every file"),
        "{refused}"
    );
}

#[test]
fn if_changed_commits_nothing_for_an_unchanged_workspace() {
    let tmp = tempdir("if-changed");
    let root = tmp.path().join("workspace");
    write(&root.join("a.txt"), "one\n");
    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("if-changed");
    let client = coordinator.client();
    let if_changed = |output: &str| {
        run(client
            .runner()
            .arg("checkpoint")
            .arg("--root")
            .arg(&root)
            .args([
                "--workspace",
                &workspace,
                "--if-changed",
                "--output",
                output,
            ]))
        .assert_success()
    };
    let first = if_changed("json").json();
    assert!(
        first["checkpoint_id"].is_string(),
        "a workspace without checkpoints gets its first: {first}"
    );
    let again = if_changed("json").json();
    assert_eq!(again["unchanged_since"], first["checkpoint_id"], "{again}");
    assert!(again.get("stats").is_none(), "{again}");
    let text = if_changed("text");
    assert!(
        text.stdout.starts_with(&format!(
            "unchanged since checkpoint {}: nothing committed",
            first["checkpoint_id"].as_str().unwrap()
        )),
        "{text}"
    );
    assert_eq!(coordinator.list_checkpoints(&workspace).len(), 1);

    write(&root.join("a.txt"), "two\n");
    let changed = if_changed("json").json();
    assert_ne!(
        changed["checkpoint_id"], first["checkpoint_id"],
        "{changed}"
    );
    assert_eq!(coordinator.list_checkpoints(&workspace).len(), 2);
}
