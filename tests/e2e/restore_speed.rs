//! Restore speed (issue 5): a host's pack cache makes a second restore of a
//! workspace, or of a fork of it, read from disk instead of the store, and survives a neighbour tampering with
//! it; a restore onto a baked older copy writes and downloads only what
//! differs and removes what the checkpoint lacks.

use std::fs;
use std::path::Path;
use std::process::Command;

use cairn_e2e::{
    Client, Coordinator, agent_turn, assert_trees_equal, flip_byte, json_u64,
    let_timestamps_settle, make_workspace, run, tempdir, write,
};
use serde_json::Value;

/// `cairn-runner restore --pack-cache DIR --output json` by `client`.
fn restore_with_cache(client: &Client, root: &Path, workspace: &str, cache: &Path) -> Value {
    let cache = cache.to_str().expect("test paths are UTF-8");
    client
        .try_restore(
            root,
            workspace,
            &[
                "--pack-cache",
                cache,
                "--pack-cache-size",
                "1GiB",
                "--output",
                "json",
            ],
        )
        .assert_success()
        .json()
}

fn pieces(cache: &Path) -> Vec<std::path::PathBuf> {
    fs::read_dir(cache)
        .expect("the pack cache exists")
        .map(|e| e.expect("entries read").path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("p1-"))
        })
        .collect()
}

fn copy_tree(from: &Path, to: &Path) {
    run(Command::new("cp").arg("-a").arg(from).arg(to)).assert_success();
}

#[test]
fn a_warm_host_cache_serves_a_second_restore_and_a_fork() {
    let tmp = tempdir("pack-cache");
    let root = tmp.path().join("workspace");
    make_workspace(
        &root,
        &["--files", "800", "--ignored", "800", "--transcript-mb", "1"],
    );
    let copy = tmp.path().join("copy");
    copy_tree(&root, &copy);
    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("cached");
    coordinator.client().checkpoint(&root, &workspace);
    let cache = tmp.path().join("host-pack-cache");

    // Each restore is a fresh sandbox: a new client has a new runner cache.
    let first_root = tmp.path().join("first");
    let first = restore_with_cache(&coordinator.client(), &first_root, &workspace, &cache);
    assert_trees_equal(&root, &first_root);
    let full = json_u64(&first, "bytes_downloaded");
    assert!(full > 1 << 20, "{first}");
    assert_eq!(json_u64(&first, "bytes_from_cache"), 0, "{first}");
    assert!(!pieces(&cache).is_empty());

    let second_root = tmp.path().join("second");
    let second = restore_with_cache(&coordinator.client(), &second_root, &workspace, &cache);
    assert_trees_equal(&root, &second_root);
    assert_eq!(
        json_u64(&second, "bytes_downloaded"),
        0,
        "a warm cache left nothing to download: {second}"
    );
    assert!(
        json_u64(&second, "bytes_from_cache") >= full * 9 / 10,
        "{second}"
    );

    // A fork of the workspace starts from the same checkpoint, whose packs
    // the cache holds: its first restore downloads next to nothing.
    let forked = coordinator
        .client()
        .ctl_json(&["workspace", "fork", "cached", "--count", "1"]);
    let fork = forked["workspaces"][0]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no fork in {forked}"))
        .to_owned();
    let fork_root = tmp.path().join("fork");
    let again = restore_with_cache(&coordinator.client(), &fork_root, &fork, &cache);
    assert_trees_equal(&root, &fork_root);
    assert!(
        json_u64(&again, "bytes_downloaded") * 20 < full,
        "a fork downloaded {} of {full} bytes: {again}",
        json_u64(&again, "bytes_downloaded")
    );

    // Another workspace holding the same repository shares no pack with
    // this one (its keys are its own): the cache has nothing for it, and
    // it restores exactly all the same.
    let other = coordinator.create_workspace("cached-copy");
    coordinator.client().checkpoint(&copy, &other);
    let other_root = tmp.path().join("other");
    let elsewhere = restore_with_cache(&coordinator.client(), &other_root, &other, &cache);
    assert_trees_equal(&copy, &other_root);
    assert_eq!(json_u64(&elsewhere, "bytes_from_cache"), 0, "{elsewhere}");
}

#[test]
fn a_tampered_host_cache_still_restores_exactly_from_the_store() {
    let tmp = tempdir("pack-cache-tampered");
    let root = tmp.path().join("workspace");
    make_workspace(
        &root,
        &["--files", "300", "--ignored", "300", "--transcript-mb", "1"],
    );
    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("tampered");
    coordinator.client().checkpoint(&root, &workspace);
    let cache = tmp.path().join("host-pack-cache");
    let first = restore_with_cache(
        &coordinator.client(),
        &tmp.path().join("first"),
        &workspace,
        &cache,
    );

    // A hostile sandbox of the host flips a byte in every piece and plants
    // a symlink under the name of one.
    let found = pieces(&cache);
    for piece in &found {
        let len = fs::metadata(piece).unwrap().len();
        flip_byte(piece, len / 2);
    }
    let secret = tmp.path().join("secret");
    write(&secret, "not for the restore");
    let victim = &found[0];
    fs::remove_file(victim).unwrap();
    std::os::unix::fs::symlink(&secret, victim).unwrap();

    let target = tmp.path().join("second");
    let cache_arg = cache.to_str().unwrap();
    let outcome = coordinator
        .client()
        .try_restore(
            &target,
            &workspace,
            &["--pack-cache", cache_arg, "--output", "json"],
        )
        .assert_success();
    assert_trees_equal(&root, &target);
    let report = outcome.json();
    assert!(
        report["fell_back_from"]
            .as_array()
            .is_some_and(Vec::is_empty),
        "the checkpoint itself is fine: {report}"
    );
    assert!(
        json_u64(&report, "bytes_downloaded") >= json_u64(&first, "bytes_downloaded") / 2,
        "the damaged pieces came from the store: {report}"
    );
    assert!(
        outcome.stderr.contains("dropping a damaged piece"),
        "the restore says it dropped damaged pieces: {outcome}"
    );
    assert_eq!(fs::read_to_string(&secret).unwrap(), "not for the restore");
}

#[test]
fn a_restore_onto_a_baked_older_copy_downloads_and_writes_only_the_difference() {
    let tmp = tempdir("baked");
    let root = tmp.path().join("workspace");
    make_workspace(
        &root,
        &[
            "--files",
            "2000",
            "--ignored",
            "2000",
            "--transcript-mb",
            "2",
        ],
    );
    write(&root.join("app/settled.txt"), "settled content\n");
    // The image baked the workspace as it was before the agent's turn, plus
    // files the checkpoint does not have.
    let baked = tmp.path().join("baked");
    copy_tree(&root, &baked);
    write(
        &baked.join("app/BAKED_ONLY.md"),
        "left by the image build\n",
    );
    write(&baked.join("app/image-cache/a/b.bin"), vec![7u8; 50_000]);
    agent_turn(&root, 1);
    let_timestamps_settle();

    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("baked");
    coordinator.client().checkpoint(&root, &workspace);

    let empty = tmp.path().join("empty");
    let full = coordinator.client().restore(&empty, &workspace);
    assert_trees_equal(&root, &empty);

    // A fresh runner cache: nothing is known about the baked files but what
    // is on disk.
    let onto = coordinator.client().restore(&baked, &workspace);
    assert_trees_equal(&root, &baked);
    assert!(!baked.join("app/BAKED_ONLY.md").exists());
    assert!(!baked.join("app/image-cache").exists());
    let (full_down, onto_down) = (
        json_u64(&full, "bytes_downloaded"),
        json_u64(&onto, "bytes_downloaded"),
    );
    assert!(
        onto_down * 10 < full_down,
        "onto the baked copy {onto_down} bytes were downloaded, into an empty directory {full_down}: {onto}"
    );
    assert!(
        json_u64(&onto, "bytes_written") * 10 < json_u64(&full, "bytes_written"),
        "{onto}"
    );
    assert!(
        json_u64(&onto, "files_reused") * 10 > json_u64(&onto, "files") * 9,
        "most files were reused: {onto}"
    );
    assert!(json_u64(&onto, "entries_removed") >= 2, "{onto}");

    // A file changed behind its mtime (by a tool that sets mtimes back)
    // passes the size-and-mtime check; --verify-existing reads it.
    let settled = baked.join("app/settled.txt");
    let mtime = fs::metadata(&settled).unwrap().modified().unwrap();
    write(&settled, "SETTLED CONTENT\n");
    fs::File::options()
        .write(true)
        .open(&settled)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let trusting = coordinator.client().restore(&baked, &workspace);
    assert_eq!(json_u64(&trusting, "bytes_written"), 0, "{trusting}");
    assert_eq!(fs::read_to_string(&settled).unwrap(), "SETTLED CONTENT\n");
    let verifying = coordinator
        .client()
        .try_restore(
            &baked,
            &workspace,
            &["--verify-existing", "--output", "json"],
        )
        .assert_success()
        .json();
    assert_trees_equal(&root, &baked);
    assert_eq!(json_u64(&verifying, "bytes_written"), 16, "{verifying}");

    // Onto an exact copy nothing is written, git trees stored as deltas
    // included: a loose tree is checked by its name.
    let again = coordinator.client().restore(&empty, &workspace);
    assert_trees_equal(&root, &empty);
    assert_eq!(json_u64(&again, "bytes_written"), 0, "{again}");
    assert_eq!(
        json_u64(&again, "files_reused"),
        json_u64(&again, "files"),
        "{again}"
    );
}

#[test]
fn a_restore_says_when_its_checkpoint_was_taken_and_warns_when_it_is_too_old() {
    let tmp = tempdir("restore-age");
    let root = tmp.path().join("workspace");
    write(&root.join("notes.txt"), "work\n");
    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("aged");
    let client = coordinator.client();
    client.checkpoint(&root, &workspace);

    let fresh = client
        .try_restore(&tmp.path().join("fresh"), &workspace, &["--output", "json"])
        .assert_success();
    let taken = fresh.json()["checkpoint_created_at"]
        .as_str()
        .map(humantime::parse_rfc3339)
        .expect("the JSON says when the checkpoint was taken")
        .expect("in RFC 3339");
    let age = std::time::SystemTime::now()
        .duration_since(taken)
        .unwrap_or_default();
    assert!(age < std::time::Duration::from_secs(600), "{age:?}");
    assert!(!fresh.stderr.contains("warning"), "{}", fresh.stderr);

    std::thread::sleep(std::time::Duration::from_millis(1100));
    let stale = client
        .try_restore(
            &tmp.path().join("stale"),
            &workspace,
            &["--warn-older-than", "1s"],
        )
        .assert_success();
    assert!(
        stale.stderr.contains("warning: the restored checkpoint")
            && stale.stderr.contains("more than 1s"),
        "{}",
        stale.stderr
    );
    assert!(
        stale.stdout.contains("restored checkpoint"),
        "{}",
        stale.stdout
    );
}
