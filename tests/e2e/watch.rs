//! `cairn-runner watch`: a resident checkpointer. `cairn-runner checkpoint`
//! finds it through its control socket and gets a checkpoint that walked and
//! read only what changed; every `--interval` it checkpoints by itself, but
//! only when something changed.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use cairn_e2e::{
    Client, Coordinator, json_u64, let_timestamps_settle, populate_small_workspace, run, tempdir,
};
use cairn_proto::pb;

/// A running `cairn-runner watch`, stopped (SIGTERM) when dropped.
struct Watcher(Child);

impl Watcher {
    /// Starts `cairn-runner watch` on `root` and waits for its socket.
    fn start(client: &Client, root: &Path, workspace: &str, interval: &str, socket: &Path) -> Self {
        let watcher = Watcher(
            client
                .runner()
                .arg("watch")
                .arg("--root")
                .arg(root)
                .args(["--workspace", workspace, "--interval", interval])
                .arg("--socket")
                .arg(socket)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("cairn-runner watch starts"),
        );
        wait_until("the control socket", Duration::from_secs(20), || {
            socket.exists()
        });
        watcher
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

/// `cairn-runner checkpoint --output json ARGS` through the watcher's socket.
fn ask_watcher(
    client: &Client,
    root: &Path,
    workspace: &str,
    socket: &Path,
    args: &[&str],
) -> serde_json::Value {
    run(client
        .runner()
        .arg("checkpoint")
        .arg("--root")
        .arg(root)
        .args(["--workspace", workspace, "--output", "json"])
        .args(args)
        .arg("--socket")
        .arg(socket))
    .assert_success()
    .json()
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn checkpoints_go_through_the_watcher_and_intervals_skip_an_unchanged_workspace() {
    let tmp = tempdir("watch");
    let root = tmp.path().join("workspace");
    populate_small_workspace(&root, 7);
    // Files written within two seconds of a walk are read again every time.
    let_timestamps_settle();
    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("watched");
    let client = coordinator.client();
    let socket = client.cache_dir().join("watch-test.sock");
    // Checkpointed before the watcher starts: its first intervals find the
    // workspace unchanged since.
    client.checkpoint(&root, &workspace);

    let watcher = Watcher::start(&client, &root, &workspace, "1s", &socket);
    let interval_checkpoints = || {
        coordinator
            .list_checkpoints(&workspace)
            .iter()
            .filter(|c| c.reason == pb::CheckpointReason::Interval as i32)
            .count()
    };
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(
        interval_checkpoints(),
        0,
        "the workspace was unchanged since its newest checkpoint"
    );

    let ask =
        |reason: &str| ask_watcher(&client, &root, &workspace, &socket, &["--reason", reason]);
    let first = ask("manual");
    assert_eq!(first["reason"], "manual", "{first}");
    let files = json_u64(&first, "stats.files");
    assert!(files > 3, "{first}");

    std::fs::write(
        root.join("notes.txt"),
        "written after the first checkpoint\n",
    )
    .unwrap();
    let second = ask("turn");
    assert_eq!(second["reason"], "turn", "{second}");
    assert_eq!(json_u64(&second, "stats.files"), files + 1, "{second}");
    assert_eq!(
        json_u64(&second, "stats.files_read"),
        1,
        "only the new file is read: {second}"
    );

    // --if-changed on an unchanged workspace: the watcher settles it from
    // its change tracker, and nothing is committed.
    let before = coordinator.list_checkpoints(&workspace).len();
    let if_changed = || ask_watcher(&client, &root, &workspace, &socket, &["--if-changed"]);
    let unchanged = if_changed();
    assert_eq!(
        unchanged["unchanged_since"], second["checkpoint_id"],
        "{unchanged}"
    );
    assert_eq!(coordinator.list_checkpoints(&workspace).len(), before);
    std::fs::write(root.join("notes.txt"), "changed again\n").unwrap();
    let changed = if_changed();
    assert_eq!(json_u64(&changed, "stats.files_read"), 1, "{changed}");
    assert_eq!(coordinator.list_checkpoints(&workspace).len(), before + 1);

    // Interval checkpoints: one after a change, none while nothing changes.
    std::fs::write(root.join("later.txt"), "changed while nobody asked\n").unwrap();
    wait_until("an interval checkpoint", Duration::from_secs(30), || {
        interval_checkpoints() == 1
    });
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        interval_checkpoints(),
        1,
        "an unchanged workspace made another interval checkpoint"
    );

    // A request for another workspace is refused, naming both.
    let other = run(client
        .runner()
        .arg("checkpoint")
        .arg("--root")
        .arg(&root)
        .args(["--workspace", "someone-else"])
        .arg("--socket")
        .arg(&socket));
    assert!(!other.status.success(), "{other}");
    assert!(
        other.stderr.contains("checkpoints workspace") && other.stderr.contains("someone-else"),
        "{other}"
    );

    // Once the watcher is gone, a named socket that nobody answers is an error.
    drop(watcher);
    let gone = run(client
        .runner()
        .arg("checkpoint")
        .arg("--root")
        .arg(&root)
        .args(["--workspace", &workspace])
        .arg("--socket")
        .arg(&socket));
    assert!(!gone.status.success(), "{gone}");
    assert!(gone.stderr.contains("no resident runner answers"), "{gone}");
}

/// Every checkpoint a resident watcher cuts restores to exactly the tree it
/// saw, while it takes what it found before for every directory in which
/// nothing happened since: edits in place of the same size, a file written
/// and checkpointed within the same second, new and removed directories, a
/// rename, commits (loose trees stored as deltas), one after the other.
#[test]
fn each_watcher_checkpoint_restores_what_it_saw_while_unchanged_directories_are_not_read_again() {
    let tmp = tempdir("watch-turns");
    let root = tmp.path().join("workspace");
    cairn_e2e::make_workspace(
        &root,
        &["--files", "600", "--ignored", "400", "--transcript-mb", "1"],
    );
    let_timestamps_settle();
    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("turns");
    let client = coordinator.client();
    let socket = client.cache_dir().join("turns.sock");
    client.checkpoint(&root, &workspace);
    // Started after the checkpoint: it works out what that one holds from
    // its cache, so its first checkpoint too reads only what changed.
    let _watcher = Watcher::start(&client, &root, &workspace, "24h", &socket);
    let ask = || ask_watcher(&client, &root, &workspace, &socket, &[]);
    let snapshots = tmp.path().join("snapshots");
    std::fs::create_dir(&snapshots).unwrap();
    let mut cut = Vec::new();
    let mut keep = |report: serde_json::Value| {
        let id = report["checkpoint_id"].as_str().unwrap().to_owned();
        let copy = snapshots.join(cut.len().to_string());
        run(std::process::Command::new("cp")
            .arg("-a")
            .arg(&root)
            .arg(&copy))
        .assert_success();
        cut.push((id, copy));
        report
    };
    let app = root.join("app");

    let fresh = app.join("scratch/fresh.md");
    cairn_e2e::write(&fresh, "written just before the checkpoint\n");
    let first = keep(ask());
    assert_eq!(json_u64(&first, "stats.files_read"), 1, "{first}");

    // Rewritten in place at once, same size: only its event tells.
    cairn_e2e::write(&fresh, "WRITTEN JUST BEFORE THE CHECKPOINT\n");
    cairn_e2e::write(&app.join("scratch/other.md"), "another file\n");
    let second = keep(ask());
    assert_eq!(
        json_u64(&second, "stats.files_read"),
        2,
        "the file written just before the first checkpoint is not read again, \
         the rewritten one is: {second}"
    );

    // A commit, new and removed directories, a rename, a deletion.
    cairn_e2e::agent_turn(&root, 2);
    cairn_e2e::write(&app.join("src/brand/new/deep.rs"), "fn deep() {}\n");
    let scratch = app.join("scratch");
    std::fs::rename(scratch.join("other.md"), scratch.join("renamed.md")).unwrap();
    std::fs::remove_file(&fresh).unwrap();
    keep(ask());
    cairn_e2e::agent_turn(&root, 3);
    std::fs::remove_dir_all(app.join("src/brand")).unwrap();
    keep(ask());
    cairn_e2e::agent_turn(&root, 4);
    let last = keep(ask());
    assert!(
        json_u64(&last, "stats.files_read") * 10 < json_u64(&last, "stats.files"),
        "{last}"
    );

    // Checkpoints of an unchanged workspace (a run's pause, end, destroy)
    // are committed, read nothing, and leave the fingerprint cache the
    // last one wrote as it is: a runner ending next waits for no write.
    let fingerprints = cairn_engine::cache::FingerprintCache::path_for(
        &client.cache_dir(),
        &workspace.parse().expect("a workspace id"),
    );
    let written = |path: &Path| {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).expect("the fingerprint cache is on disk");
        (meta.ino(), meta.mtime(), meta.mtime_nsec())
    };
    let unchanged = keep(ask());
    let before = written(&fingerprints);
    let again = keep(ask());
    for report in [&unchanged, &again] {
        assert_eq!(json_u64(report, "stats.files_read"), 0, "{report}");
        assert_ne!(report["checkpoint_id"], last["checkpoint_id"], "{report}");
    }
    assert_eq!(
        written(&fingerprints),
        before,
        "the cache was written again"
    );
    cairn_e2e::write(&app.join("scratch/after.md"), "after the unchanged ones\n");
    let changed = keep(ask());
    let read = json_u64(&changed, "stats.files_read");
    assert!(
        read >= 1 && read * 10 < json_u64(&changed, "stats.files"),
        "{changed}"
    );
    wait_until(
        "the cache written after a change",
        Duration::from_secs(20),
        || written(&fingerprints) != before,
    );

    for (n, (id, snapshot)) in cut.iter().enumerate() {
        let restored = tmp.path().join(format!("restored-{n}"));
        client
            .try_restore(&restored, &workspace, &["--checkpoint", id])
            .assert_success();
        cairn_e2e::assert_trees_equal(snapshot, &restored);
        let fsck = run(std::process::Command::new("git")
            .args(["fsck", "--strict"])
            .current_dir(restored.join("app")));
        assert!(fsck.status.success(), "git fsck of checkpoint {n}: {fsck}");
    }
}
