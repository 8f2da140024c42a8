//! Incremental cost: after one agent turn a checkpoint uploads a sliver of
//! the first one, a turn that commits costs about as much as one that does
//! not (git's loose blobs dedupe with the working tree), and a second
//! workspace holding the same repository shares nothing with the first:
//! it has keys and a deduplication scope of its own, so it uploads its own
//! copy (forks are what share; see fork.rs).

use std::path::Path;

use cairn_e2e::{
    Coordinator, agent_turn, json_u64, let_timestamps_settle, make_workspace, run, tempdir,
};

fn copy_tree(from: &Path, to: &Path) {
    run(std::process::Command::new("cp").arg("-a").arg(from).arg(to)).assert_success();
}

#[test]
fn one_turn_uploads_under_five_percent_and_a_copy_elsewhere_shares_nothing() {
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

    // A turn that commits: `git add` wrote every edited file again as a
    // loose object, which is stored by its content and so dedupes with the
    // working-tree file (before format v3 it cost as much again).
    agent_turn(&root, 2);
    let commit_turn = client.checkpoint(&root, &workspace);
    let commit_uploaded = json_u64(&commit_turn, "stats.uploaded_bytes");
    assert!(
        commit_uploaded < second_uploaded * 2,
        "the commit turn uploaded {commit_uploaded} bytes, the edit-only turn {second_uploaded}: \
         staged files were stored twice: {commit_turn}"
    );
    let restored = tmp.path().join("restored");
    let new_host = coordinator.client();
    new_host.restore(&restored, &workspace);
    cairn_e2e::assert_trees_equal(&root, &restored);
    // The restore told the fingerprint cache what it wrote: the first
    // checkpoint after a resume does not read the workspace again (only
    // files changed within seconds of the restore, whose times cannot yet
    // prove them unchanged, are read).
    let after_resume = new_host.checkpoint(&restored, &workspace);
    assert!(
        json_u64(&after_resume, "stats.files_read") * 20 < json_u64(&after_resume, "stats.files"),
        "the checkpoint after a restore read the workspace again: {after_resume}"
    );
    assert!(
        json_u64(&after_resume, "stats.uploaded_bytes") < 300_000,
        "{after_resume}"
    );
    let fsck = run(std::process::Command::new("git")
        .args(["fsck", "--strict"])
        .current_dir(restored.join("app")));
    assert!(fsck.status.success(), "git fsck after the restore: {fsck}");

    // An edit-only turn after the commit: the commit's loose trees are as
    // the cache knows them, so their bases come from the cache, not from a
    // walk of the history; they must still restore byte for byte.
    agent_turn(&root, 3);
    let after_commit = client.checkpoint(&root, &workspace);
    assert!(
        json_u64(&after_commit, "stats.uploaded_bytes") < 300_000,
        "{after_commit}"
    );
    let restored_again = tmp.path().join("restored-again");
    coordinator.client().restore(&restored_again, &workspace);
    cairn_e2e::assert_trees_equal(&root, &restored_again);
    let fsck = run(std::process::Command::new("git")
        .args(["fsck", "--strict"])
        .current_dir(restored_again.join("app")));
    assert!(
        fsck.status.success(),
        "git fsck after the third restore: {fsck}"
    );

    // A fresh machine (empty cache) with the same repository, other
    // workspace: nothing of the first workspace's is found for it.
    let other_workspace = coordinator.create_workspace("incremental-copy");
    let third = coordinator.client().checkpoint(&copy, &other_workspace);
    let third_uploaded = json_u64(&third, "stats.uploaded_bytes");
    assert_eq!(json_u64(&third, "sequence"), 1);
    assert!(
        third_uploaded * 10 > first_uploaded * 9,
        "a copy in another workspace uploaded {third_uploaded} bytes of the first's \
         {first_uploaded}: it deduplicated against a workspace it may not read: {third}"
    );
}
