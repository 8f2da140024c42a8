//! Incremental cost: after one agent turn a checkpoint uploads a sliver of
//! the first one, and a second workspace holding the same repository uploads
//! only what differs (deduplication is tenant-wide).

use std::path::Path;

use cairn_e2e::{
    Coordinator, agent_turn, json_u64, let_timestamps_settle, make_workspace, run, tempdir,
};

fn copy_tree(from: &Path, to: &Path) {
    run(std::process::Command::new("cp").arg("-a").arg(from).arg(to)).assert_success();
}

#[test]
fn one_turn_uploads_under_five_percent_and_a_copy_dedupes_across_workspaces() {
    let tmp = tempdir("incremental");
    let root = tmp.path().join("workspace");
    let copy = tmp.path().join("copy");
    make_workspace(
        &root,
        &[
            "--files",
            "2000",
            "--ignored",
            "3000",
            "--transcript-mb",
            "2",
        ],
    );
    // The same repository in another workspace, as another sandbox would hold it.
    copy_tree(&root, &copy);
    let_timestamps_settle();

    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("incremental");
    let client = coordinator.client();

    let first = client.checkpoint(&root, &workspace);
    let first_uploaded = json_u64(&first, "stats.uploaded_bytes");
    assert!(
        first_uploaded > 10 << 20,
        "the first checkpoint uploads the workspace: {first}"
    );

    agent_turn(&root, 1);
    let second = client.checkpoint(&root, &workspace);
    let second_uploaded = json_u64(&second, "stats.uploaded_bytes");
    assert_eq!(json_u64(&second, "sequence"), 2);
    assert!(
        second_uploaded * 20 < first_uploaded,
        "after one turn the checkpoint uploaded {second_uploaded} bytes, not under 5% of the first's {first_uploaded}: {second}"
    );
    // The fingerprint cache: only what the turn touched is read again
    // (10 edited files, 2 new ones, the transcript, git's bookkeeping).
    assert!(
        json_u64(&second, "stats.files_read") < 100,
        "unchanged files were read again: {second}"
    );

    // A fresh machine (empty cache) with the same repository, other workspace.
    let other_workspace = coordinator.create_workspace("incremental-copy");
    let third = coordinator.client().checkpoint(&copy, &other_workspace);
    let third_uploaded = json_u64(&third, "stats.uploaded_bytes");
    assert_eq!(json_u64(&third, "sequence"), 1);
    assert!(
        third_uploaded * 20 < first_uploaded,
        "a copy of a checkpointed workspace uploaded {third_uploaded} bytes, not under 5% of {first_uploaded}: {third}"
    );
}
