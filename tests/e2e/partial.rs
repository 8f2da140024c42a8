//! Partial checkpoints: a runner killed after its packs are uploaded but
//! before the commit leaves no checkpoint behind, and the previous one
//! restores exactly.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use cairn_e2e::{
    Coordinator, TreeSnapshot, describe, ids_with_prefix, json_str, json_u64, pack_files,
    populate_small_workspace, tempdir, write, write_pseudo_random,
};

const MARKER: &str = "failpoint checkpoint-before-commit reached";

#[test]
fn a_runner_killed_before_commit_leaves_the_previous_checkpoint_intact() {
    let tmp = tempdir("partial");
    let root = tmp.path().join("workspace");
    populate_small_workspace(&root, 1);

    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("partial");
    let client = coordinator.client();
    let first = client.checkpoint(&root, &workspace);
    let first_id = json_str(&first, "checkpoint_id").to_owned();
    let first_state = TreeSnapshot::take(&root);

    write(
        &root.join("README.md"),
        "# changed after the first checkpoint\n",
    );
    write_pseudo_random(&root.join("data/new.bin"), 3 << 20, 99);
    std::fs::remove_file(root.join("src/main.rs")).unwrap();
    let packs_before = pack_files(&coordinator.blobs_dir());

    let mut command = client.runner();
    command
        .arg("checkpoint")
        .arg("--root")
        .arg(&root)
        .args(["--workspace", &workspace, "--output", "json"])
        .env("CAIRN_FAILPOINTS", "checkpoint-before-commit=pause")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let shown = describe(&command);
    let mut runner = command.spawn().expect("cairn-runner starts");
    let (lines_tx, lines_rx) = mpsc::channel();
    let stderr = runner.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    loop {
        match lines_rx.recv_timeout(Duration::from_secs(120)) {
            Ok(line) if line.contains(MARKER) => break,
            Ok(line) => seen.push(line),
            Err(_) => {
                let _ = runner.kill();
                let status = runner.wait().unwrap();
                panic!(
                    "`{shown}` never reached the failpoint ({status}); stderr:\n{}",
                    seen.join("\n")
                );
            }
        }
    }
    runner.kill().expect("SIGKILL the paused runner");
    runner.wait().unwrap();
    drop(lines_rx);
    reader.join().unwrap();

    let packs_after = pack_files(&coordinator.blobs_dir());
    assert!(
        packs_after.len() > packs_before.len(),
        "the runner was killed after uploading its packs, yet none reached the store"
    );

    // The checkpoint did not happen: neither cairnctl nor the API shows it.
    let listed = ids_with_prefix(&client.ctl_json(&["checkpoints", &workspace]), "ck-");
    assert_eq!(listed, vec![first_id.clone()]);
    let via_api = coordinator.list_checkpoints(&workspace);
    assert_eq!(via_api.len(), 1);
    assert_eq!(via_api[0].id, first_id);

    let restored = tmp.path().join("restored");
    let report = coordinator.client().restore(&restored, &workspace);
    assert_eq!(json_str(&report, "checkpoint_id"), first_id);
    first_state.assert_matches(&restored, false);

    // The workspace is not wedged: the next checkpoint commits as #2.
    let next = client.checkpoint(&root, &workspace);
    assert_eq!(json_u64(&next, "sequence"), 2);
    let current = TreeSnapshot::take(&root);
    let again = tmp.path().join("restored-again");
    coordinator.client().restore(&again, &workspace);
    current.assert_matches(&again, false);
}
