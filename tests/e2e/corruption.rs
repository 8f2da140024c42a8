//! Corruption: a flipped byte in a stored pack makes restore fall back to the
//! previous checkpoint and say so; with every pack gone, restore fails loudly
//! and presents nothing as restored.

use std::fs;

use cairn_e2e::{
    Coordinator, PACK_DATA, TreeSnapshot, dir_names, flip_byte, json_str, pack_files, pack_kind,
    populate_small_workspace, tempdir, write, write_pseudo_random,
};

#[test]
fn a_corrupt_pack_falls_back_to_the_previous_checkpoint_and_missing_packs_fail_loudly() {
    let tmp = tempdir("corruption");
    let root = tmp.path().join("workspace");
    populate_small_workspace(&root, 2);

    let coordinator = Coordinator::start();
    let workspace = coordinator.create_workspace("corruption");
    let client = coordinator.client();
    let first = client.checkpoint(&root, &workspace);
    let first_id = json_str(&first, "checkpoint_id").to_owned();
    let first_state = TreeSnapshot::take(&root);
    let packs_of_first = pack_files(&coordinator.blobs_dir());

    write_pseudo_random(&root.join("data/blob.bin"), 1 << 20, 2002);
    write(&root.join("README.md"), "# second version\n");
    write(&root.join("src/new.rs"), "pub fn new() {}\n");
    let second = client.checkpoint(&root, &workspace);
    let second_id = json_str(&second, "checkpoint_id").to_owned();

    let added: Vec<_> = pack_files(&coordinator.blobs_dir())
        .difference(&packs_of_first)
        .cloned()
        .collect();
    let data_pack = added
        .iter()
        .find(|p| pack_kind(p) == PACK_DATA)
        .unwrap_or_else(|| panic!("the second checkpoint added no data pack: {added:?}"));
    // The middle of a data pack lies inside a sealed chunk of the new content.
    let size = fs::metadata(data_pack).unwrap().len();
    flip_byte(data_pack, size / 2);

    // Text output names the checkpoint used and the one skipped.
    let text_target = tmp.path().join("restored-text");
    let text = coordinator
        .client()
        .try_restore(&text_target, &workspace, &[])
        .assert_success();
    let output = text.all_output();
    assert!(
        output.contains(&first_id),
        "restore does not name the checkpoint it used: {text}"
    );
    assert!(
        output.contains(&second_id),
        "restore does not name the checkpoint it skipped: {text}"
    );
    first_state.assert_matches(&text_target, false);

    let json_target = tmp.path().join("restored-json");
    let report = coordinator.client().restore(&json_target, &workspace);
    assert_eq!(json_str(&report, "checkpoint_id"), first_id, "{report}");
    let skipped = report["fell_back_from"]
        .as_array()
        .unwrap_or_else(|| panic!("no fell_back_from in {report}"));
    assert_eq!(skipped.len(), 1, "{report}");
    assert_eq!(json_str(&skipped[0], "checkpoint_id"), second_id);
    assert!(
        !json_str(&skipped[0], "reason").trim().is_empty(),
        "a fallback without a reason: {report}"
    );
    first_state.assert_matches(&json_target, false);

    // Every pack gone: nothing can be restored, and nothing pretends it was.
    for pack in pack_files(&coordinator.blobs_dir()) {
        fs::remove_file(pack).unwrap();
    }
    let target = tmp.path().join("restored-nothing");
    let failed = coordinator
        .client()
        .try_restore(&target, &workspace, &[])
        .assert_exit(1);
    let stderr = failed.stderr.to_lowercase();
    assert!(stderr.contains("error:"), "{failed}");
    assert!(
        stderr.contains(&format!(
            "no checkpoint of workspace {}",
            workspace.to_lowercase()
        )),
        "the error does not say that nothing could be restored: {failed}"
    );
    assert!(
        failed.stderr.contains(&first_id) && failed.stderr.contains(&second_id),
        "{failed}"
    );
    assert!(
        ["missing", "not in the store", "404"]
            .iter()
            .any(|w| stderr.contains(w)),
        "the error does not say that packs are missing: {failed}"
    );
    assert!(
        dir_names(&target).is_empty(),
        "a failed restore left files in {}: {:?}",
        target.display(),
        dir_names(&target)
    );
}
