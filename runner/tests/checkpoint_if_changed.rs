//! `checkpoint_if_changed` against a real coordinator: an unchanged
//! workspace commits nothing, a change commits, and a baseline that is no
//! longer the newest checkpoint never suppresses a commit.
//!
//! Needs the `cairn-coordinator` binary next to this test's target dir
//! (`cargo build -p cairn-coordinator`); without it the test says so and
//! passes vacuously — the end-to-end suite builds and runs everything.

mod attempt_support;

use std::fs;
use std::time::Duration;

use attempt_support::{coordinator_binary, start_coordinator};

use cairn_proto::domain::CheckpointReason;
use cairn_proto::pb;
use cairn_runner::checkpoint::{self, Baseline, CheckpointOptions};
use cairn_runner::client::Coordinator;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_changed_workspace_is_committed() {
    let Some(binary) = coordinator_binary() else {
        println!(
            "skipped: no cairn-coordinator binary next to the tests (cargo build -p cairn-coordinator)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_server, grpc, token) =
        start_coordinator(&binary, &dir.path().join("data"), Duration::from_secs(60));
    let coordinator = Coordinator::connect(&grpc, Some(&token)).await.unwrap();
    let workspace = coordinator
        .workspaces
        .clone()
        .create_workspace(pb::CreateWorkspaceRequest {
            name: "if-changed".into(),
        })
        .await
        .unwrap()
        .into_inner();

    let root = dir.path().join("root");
    fs::create_dir_all(&root).unwrap();
    fs::write(root.join("a.txt"), "one\n").unwrap();
    let first_mtime = fs::metadata(root.join("a.txt"))
        .unwrap()
        .modified()
        .unwrap();
    let opts = CheckpointOptions {
        coordinator: grpc.clone(),
        token: Some(token.clone()),
        workspace: workspace.id.clone(),
        root: root.clone(),
        reason: CheckpointReason::Interval,
        cache_dir: dir.path().join("cache"),
        skip_ignored: false,
        excludes: vec![],
        generation: 0,
        harness: None,
        limits: Default::default(),
        resident: None,
    };
    let first = checkpoint::checkpoint(opts.clone()).await.unwrap();
    let baseline = Baseline {
        checkpoint_id: first.checkpoint_id.clone(),
        root_tree: first.root_tree,
    };

    let unchanged = checkpoint::checkpoint_if_changed(opts.clone(), &baseline)
        .await
        .unwrap();
    assert!(unchanged.is_none(), "nothing changed, nothing committed");

    fs::write(root.join("a.txt"), "two\n").unwrap();
    let changed = checkpoint::checkpoint_if_changed(opts.clone(), &baseline)
        .await
        .unwrap()
        .expect("a change commits");
    assert_eq!(
        changed.sequence,
        first.sequence + 1,
        "the skipped one took no sequence number"
    );
    assert_ne!(changed.root_tree, first.root_tree);

    // Back to the first content and mtime: equal to the baseline's tree,
    // but the baseline is no longer the newest checkpoint, so this commits.
    fs::write(root.join("a.txt"), "one\n").unwrap();
    fs::File::options()
        .write(true)
        .open(root.join("a.txt"))
        .unwrap()
        .set_modified(first_mtime)
        .unwrap();
    let reverted = checkpoint::checkpoint_if_changed(opts, &baseline)
        .await
        .unwrap()
        .expect("committed");
    assert_eq!(
        reverted.root_tree, first.root_tree,
        "equal content, equal root tree"
    );
    assert_eq!(reverted.sequence, changed.sequence + 1);
}
