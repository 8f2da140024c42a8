//! Retention, deletion and garbage collection with the real binaries: the
//! store shrinks to what is kept, everything kept restores byte for byte,
//! forks outlive their source, and a sweep cut short by a crash finishes.

use std::path::Path;
use std::time::Duration;

use cairn_e2e::{
    Client, Coordinator, TreeSnapshot, json_str, json_u64, pack_files, populate_small_workspace,
    run, tempdir, write, write_pseudo_random,
};
use serde_json::Value;

/// Signed URLs live a second, so the grace may be two: the test waits it
/// out instead of moving a clock.
const GC_FLAGS: &[&str] = &["--url-ttl", "1s", "--gc-grace", "2s", "--gc-interval", "0"];

fn wait_out_the_grace() {
    std::thread::sleep(Duration::from_millis(2500));
}

fn store_bytes(coordinator: &Coordinator) -> u64 {
    pack_files(&coordinator.blobs_dir())
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum()
}

fn gc(client: &Client) -> Value {
    client.ctl_json(&["gc"])
}

/// `cairnctl checkout WS DEST --checkpoint CID` matches `expected`.
fn assert_restores(client: &Client, workspace: &str, checkpoint: &str, expected: &TreeSnapshot) {
    let dest = tempdir("restored");
    run(client
        .ctl()
        .args(["checkout", workspace])
        .arg(dest.path())
        .args(["--checkpoint", checkpoint]))
    .assert_success();
    expected.assert_matches(dest.path(), false);
}

fn assert_verifies(client: &Client, workspace: &str) {
    run(client.ctl().args(["verify", workspace, "--read-data"])).assert_success();
}

/// One agent turn: the same files rewritten, so what the turn before wrote
/// dies with the checkpoints that held it. (A turn that also adds a file
/// that lives on leaves packs partly dead: compaction's case, not this.)
fn churn(root: &Path, turn: u64) {
    for file in 0..4 {
        write_pseudo_random(
            &root.join(format!("src/churn{file}.bin")),
            48 * 1024,
            turn * 10 + file,
        );
    }
    write(&root.join("notes/turn.md"), format!("turn {turn}\n"));
}

#[test]
fn twenty_checkpoints_with_churn_keep_last_three_shrink_the_store_to_what_is_kept() {
    let coordinator = Coordinator::start_with(GC_FLAGS);
    let client = coordinator.client();
    coordinator.create_workspace("churn");
    let root = tempdir("churn");
    populate_small_workspace(root.path(), 7);
    let mut made = Vec::new();
    for turn in 0..20 {
        churn(root.path(), turn);
        let report = client.checkpoint(root.path(), "churn");
        made.push((
            json_str(&report, "checkpoint_id").to_owned(),
            TreeSnapshot::take(root.path()),
        ));
    }
    client.ctl_json(&["workspace", "retention", "churn", "--keep-last", "3"]);
    let pinned = &made[4].0;
    client.ctl_json(&["checkpoints", "pin", pinned, "--reason", "replay"]);
    let listed = client.ctl_json(&["checkpoints", "churn"]);
    let going = listed
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["retention"]["kept_by"].as_array().unwrap().is_empty())
        .count();
    assert_eq!(going, 16, "{listed}");

    let before = store_bytes(&coordinator);
    let dry = client.ctl_json(&["gc", "--dry-run"]);
    assert_eq!(json_u64(&dry, "checkpoints_deleted"), 16, "{dry}");
    assert_eq!(store_bytes(&coordinator), before, "a dry run frees nothing");

    let first = gc(&client);
    assert_eq!(json_u64(&first, "checkpoints_deleted"), 16, "{first}");
    assert!(json_u64(&first, "packs_condemned") > 0, "{first}");
    assert_eq!(
        store_bytes(&coordinator),
        before,
        "nothing is freed before the grace"
    );
    wait_out_the_grace();
    let second = gc(&client);
    assert!(json_u64(&second, "bytes_swept") > 0, "{second}");

    let after = store_bytes(&coordinator);
    let storage = client.ctl_json(&["storage"]);
    assert_eq!(json_u64(&storage, "condemned_bytes"), 0, "{storage}");
    assert_eq!(
        json_u64(&storage, "stored_bytes"),
        after,
        "the store holds exactly the packs the kept checkpoints reference"
    );
    let shown = client.ctl_json(&["workspace", "show", "churn"]);
    assert_eq!(
        json_u64(&shown["storage"], "referenced_bytes"),
        after,
        "what is left is what the 4 kept checkpoints reference: {shown}"
    );
    assert!(after < before, "before {before}, after {after}");
    println!(
        "store: {before} bytes for 20 checkpoints, {after} bytes for the 4 kept ({:.2}×)",
        after as f64 / before as f64
    );

    let kept: Vec<&(String, TreeSnapshot)> = [4, 17, 18, 19].iter().map(|&i| &made[i]).collect();
    for (checkpoint, snapshot) in kept {
        assert_restores(&client, "churn", checkpoint, snapshot);
    }
    assert_verifies(&client, "churn");
    let gone = run(client
        .ctl()
        .args(["checkout", "churn"])
        .arg(tempdir("gone").path())
        .args(["--checkpoint", &made[10].0]));
    assert!(!gone.status.success(), "{gone}");
}

#[test]
fn a_fork_of_three_outlives_its_deleted_source() {
    let coordinator = Coordinator::start_with(GC_FLAGS);
    let client = coordinator.client();
    coordinator.create_workspace("source");
    let root = tempdir("source");
    populate_small_workspace(root.path(), 11);
    churn(root.path(), 1);
    client.checkpoint(root.path(), "source");
    let forked_state = TreeSnapshot::take(root.path());
    let forked = client.ctl_json(&["workspace", "fork", "source", "--count", "3"]);
    let forks: Vec<String> = forked["workspaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| json_str(w, "id").to_owned())
        .collect();
    assert_eq!(forks.len(), 3);
    // The source goes on alone, then is deleted.
    churn(root.path(), 2);
    client.checkpoint(root.path(), "source");
    let deleted = client.ctl_json(&["workspace", "delete", "source"]);
    assert_eq!(json_str(&deleted, "state"), "deleted");
    let before = store_bytes(&coordinator);
    gc(&client);
    wait_out_the_grace();
    let swept = gc(&client);
    assert!(json_u64(&swept, "packs_swept") > 0, "{swept}");
    assert!(store_bytes(&coordinator) < before);
    for fork in &forks {
        let checkpoints = client.ctl_json(&["checkpoints", fork]);
        let id = json_str(&checkpoints[0], "id").to_owned();
        assert_restores(&client, fork, &id, &forked_state);
        assert_verifies(&client, fork);
        let shown = client.ctl_json(&["workspace", "show", fork]);
        assert!(json_u64(&shown["storage"], "shared_bytes") > 0, "{shown}");
    }
}

#[test]
fn a_sweep_cut_short_by_a_crash_finishes_at_the_next_cycle() {
    let mut coordinator = Coordinator::start_with_env(
        GC_FLAGS,
        &[("CAIRN_FAILPOINTS", "gc-before-store-deletes=exit")],
    );
    let client = coordinator.client();
    coordinator.create_workspace("crashy");
    client.ctl_json(&["workspace", "retention", "crashy", "--keep-last", "1"]);
    // Two checkpoints that share nothing: the first one's packs all die.
    let root = tempdir("crashy");
    churn(root.path(), 1);
    client.checkpoint(root.path(), "crashy");
    churn(root.path(), 2);
    let newest = client.checkpoint(root.path(), "crashy");
    let newest = json_str(&newest, "checkpoint_id").to_owned();
    let newest_state = TreeSnapshot::take(root.path());
    let condemned = gc(&client);
    assert!(json_u64(&condemned, "packs_condemned") > 0, "{condemned}");
    let before = pack_files(&coordinator.blobs_dir());
    wait_out_the_grace();

    // The sweep removes the records, writes its deletions, and dies before
    // it deletes a single object.
    let cut = run(client.ctl().arg("gc"));
    assert!(!cut.status.success(), "{cut}");
    let status = coordinator.wait_for_exit(Duration::from_secs(30));
    assert_eq!(status.code(), Some(101), "{}", coordinator.log_tail());
    assert_eq!(
        pack_files(&coordinator.blobs_dir()),
        before,
        "no object went yet"
    );

    coordinator.restart_without_env();
    let client = coordinator.client();
    // The newest checkpoint was never in danger.
    assert_restores(&client, "crashy", &newest, &newest_state);
    let finished = gc(&client);
    assert_eq!(
        json_u64(&finished, "packs_swept"),
        json_u64(&condemned, "packs_condemned"),
        "{finished}"
    );
    let after = pack_files(&coordinator.blobs_dir());
    assert!(after.len() < before.len());
    assert_eq!(
        json_u64(&gc(&client), "packs_swept"),
        0,
        "nothing left over"
    );
    assert_restores(&client, "crashy", &newest, &newest_state);
    assert_verifies(&client, "crashy");
}

/// One agent turn that also leaves a file that lives on: each turn's pack
/// then holds one live blob among dead ones, and keeps them all.
fn churn_and_note(root: &Path, turn: u64) {
    churn(root, turn);
    write(
        &root.join(format!("notes/kept-{turn}.md")),
        format!("what turn {turn} learned\n").repeat(40),
    );
}

/// Ten checkpoints with keep-last 2 whose packs are mostly dead but each
/// hold a live note: the store after retention and collection.
fn mostly_dead_packs(
    coordinator: &Coordinator,
    client: &Client,
    workspace: &str,
) -> Vec<(String, TreeSnapshot)> {
    coordinator.create_workspace(workspace);
    client.ctl_json(&["workspace", "retention", workspace, "--keep-last", "2"]);
    let root = tempdir(workspace);
    populate_small_workspace(root.path(), 5);
    let mut made = Vec::new();
    for turn in 0..10 {
        churn_and_note(root.path(), turn);
        let report = client.checkpoint(root.path(), workspace);
        made.push((
            json_str(&report, "checkpoint_id").to_owned(),
            TreeSnapshot::take(root.path()),
        ));
    }
    gc(client);
    wait_out_the_grace();
    gc(client);
    made.split_off(8)
}

#[test]
fn compaction_frees_what_partly_dead_packs_held_and_every_kept_checkpoint_restores() {
    let coordinator = Coordinator::start_with(GC_FLAGS);
    let client = coordinator.client();
    let kept = mostly_dead_packs(&coordinator, &client, "notes");
    let shown = client.ctl_json(&["workspace", "show", "notes"]);
    let referenced = json_u64(&shown["storage"], "referenced_bytes");
    assert_eq!(
        store_bytes(&coordinator),
        referenced,
        "collection left only referenced packs"
    );

    let dry = client.ctl_json(&["compact", "notes", "--dry-run"]);
    assert!(json_u64(&dry, "packs_rewritten") > 0, "{dry}");
    assert_eq!(
        store_bytes(&coordinator),
        referenced,
        "a dry run writes nothing"
    );
    let compacted = client.ctl_json(&["compact", "notes"]);
    assert_eq!(
        json_u64(&compacted, "checkpoints_updated"),
        2,
        "{compacted}"
    );
    assert!(json_u64(&compacted, "bytes_written") < json_u64(&compacted, "bytes_rewritten"));
    for (checkpoint, snapshot) in &kept {
        assert_restores(&client, "notes", checkpoint, snapshot);
    }

    gc(&client);
    wait_out_the_grace();
    let swept = gc(&client);
    assert_eq!(
        json_u64(&swept, "packs_swept"),
        json_u64(&compacted, "packs_rewritten"),
        "{swept}"
    );
    let after = store_bytes(&coordinator);
    let shown = client.ctl_json(&["workspace", "show", "notes"]);
    assert_eq!(json_u64(&shown["storage"], "referenced_bytes"), after);
    assert!(
        after < referenced,
        "compaction freed nothing: {after} of {referenced}"
    );
    println!(
        "compaction: {referenced} bytes referenced before, {after} after ({:.2}×)",
        after as f64 / referenced as f64
    );
    for (checkpoint, snapshot) in &kept {
        assert_restores(&client, "notes", checkpoint, snapshot);
    }
    assert_verifies(&client, "notes");
    // A second compaction finds nothing left to do.
    let again = client.ctl_json(&["compact", "notes"]);
    assert_eq!(json_u64(&again, "packs_rewritten"), 0, "{again}");
}

#[test]
fn a_compaction_that_crashes_before_it_records_its_packs_loses_nothing() {
    let coordinator = Coordinator::start_with(GC_FLAGS);
    let client = coordinator.client();
    let kept = mostly_dead_packs(&coordinator, &client, "crashing");
    let before = pack_files(&coordinator.blobs_dir());

    let crashed = run(client
        .ctl()
        .env("CAIRN_FAILPOINTS", "compact-before-record=exit")
        .args(["compact", "crashing"]));
    assert_eq!(crashed.status.code(), Some(101), "{crashed}");
    // Its uploads are in the store, recorded nowhere; everything restores
    // from the packs as they were.
    assert!(pack_files(&coordinator.blobs_dir()).len() > before.len());
    for (checkpoint, snapshot) in &kept {
        assert_restores(&client, "crashing", checkpoint, snapshot);
    }
    wait_out_the_grace();
    let swept = gc(&client);
    assert!(json_u64(&swept, "orphans_swept") > 0, "{swept}");
    assert_eq!(pack_files(&coordinator.blobs_dir()), before);
    assert_verifies(&client, "crashing");

    // Run again, it goes through.
    let compacted = client.ctl_json(&["compact", "crashing"]);
    assert!(json_u64(&compacted, "packs_rewritten") > 0, "{compacted}");
    for (checkpoint, snapshot) in &kept {
        assert_restores(&client, "crashing", checkpoint, snapshot);
    }
    assert_verifies(&client, "crashing");
}
