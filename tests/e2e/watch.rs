//! `cairn-runner watch`: a resident checkpointer. `cairn-runner checkpoint`
//! finds it through its control socket and gets a checkpoint that walked and
//! read only what changed; every `--interval` it checkpoints by itself, but
//! only when something changed.

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use cairn_e2e::{
    Coordinator, json_u64, let_timestamps_settle, populate_small_workspace, run, tempdir,
};
use cairn_proto::pb;

/// A running `cairn-runner watch`, stopped (SIGTERM) when dropped.
struct Watcher(Child);

impl Drop for Watcher {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
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

    let watcher = Watcher(
        client
            .runner()
            .arg("watch")
            .arg("--root")
            .arg(&root)
            .args(["--workspace", &workspace, "--interval", "1s"])
            .arg("--socket")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cairn-runner watch starts"),
    );
    wait_until("the control socket", Duration::from_secs(20), || {
        socket.exists()
    });
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

    let ask = |reason: &str| {
        run(client
            .runner()
            .arg("checkpoint")
            .arg("--root")
            .arg(&root)
            .args([
                "--workspace",
                &workspace,
                "--reason",
                reason,
                "--output",
                "json",
            ])
            .arg("--socket")
            .arg(&socket))
        .assert_success()
        .json()
    };
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
    let if_changed = || {
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
                "json",
            ])
            .arg("--socket")
            .arg(&socket))
        .assert_success()
        .json()
    };
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
