//! cairnctl: workspaces, checkpoints, checkout and verify, for people
//! (tables, `-o wide`) and scripts (`-o json`, `-o yaml`); and a
//! coordinator restart that keeps everything.

use cairn_e2e::{
    Coordinator, PACK_DATA, TreeSnapshot, binary, flip_byte, ids_with_prefix, json_str, pack_files,
    pack_kind, populate_small_workspace, run, tempdir, write, write_pseudo_random,
};

#[test]
fn cairnctl_manages_workspaces_lists_checkpoints_checks_out_and_verifies() {
    let tmp = tempdir("cairnctl");
    let coordinator = Coordinator::start();
    let client = coordinator.client();

    let created = client.ctl_json(&["workspace", "create", "--name", "demo"]);
    let workspace = ids_with_prefix(&created, "ws-")
        .first()
        .cloned()
        .unwrap_or_else(|| panic!("no ws- id in {created}"));
    assert!(
        created.to_string().contains("\"demo\""),
        "the created workspace's name is not shown: {created}"
    );
    let listed = client.ctl_json(&["workspace", "list"]);
    assert_eq!(
        ids_with_prefix(&listed, "ws-"),
        vec![workspace.clone()],
        "{listed}"
    );
    let shown = client.ctl_json(&["workspace", "show", "demo"]);
    assert_eq!(
        ids_with_prefix(&shown, "ws-").first(),
        Some(&workspace),
        "show by name: {shown}"
    );
    let table = run(client.ctl().args(["workspace", "list"])).assert_success();
    assert!(
        table.stdout.contains(&workspace) && table.stdout.contains("demo"),
        "the table lacks the workspace: {table}"
    );
    let duplicate =
        run(client.ctl().args(["workspace", "create", "--name", "demo"])).assert_exit(1);
    assert!(duplicate.stderr.contains("error:"), "{duplicate}");

    let root = tmp.path().join("workspace");
    populate_small_workspace(&root, 6);
    let first = client.checkpoint(&root, "demo");
    let first_id = json_str(&first, "checkpoint_id").to_owned();
    let first_state = TreeSnapshot::take(&root);
    let packs_of_first = pack_files(&coordinator.blobs_dir());
    write_pseudo_random(&root.join("data/blob.bin"), 1 << 20, 606);
    write(&root.join("src/second.rs"), "pub fn second() {}\n");
    let second = client.checkpoint(&root, &workspace);
    let second_id = json_str(&second, "checkpoint_id").to_owned();

    let checkpoints = client.ctl_json(&["checkpoints", "demo"]);
    assert_eq!(
        ids_with_prefix(&checkpoints, "ck-"),
        vec![second_id.clone(), first_id.clone()],
        "newest first: {checkpoints}"
    );
    let table = run(client.ctl().args(["checkpoints", &workspace])).assert_success();
    assert!(
        table.stdout.contains(&first_id) && table.stdout.contains(&second_id),
        "{table}"
    );

    // checkout: the newest by default, any one on request.
    let newest = tmp.path().join("checkout-newest");
    run(coordinator
        .client()
        .ctl()
        .arg("checkout")
        .arg(&workspace)
        .arg(&newest))
    .assert_success();
    TreeSnapshot::take(&root).assert_matches(&newest, false);
    let older = tmp.path().join("checkout-first");
    let out = run(coordinator
        .client()
        .ctl()
        .arg("checkout")
        .arg("demo")
        .arg(&older)
        .args(["--checkpoint", &first_id]))
    .assert_success();
    assert!(
        out.all_output().contains(&first_id),
        "checkout does not say which checkpoint it wrote: {out}"
    );
    first_state.assert_matches(&older, false);

    run(client.ctl().args(["verify", &workspace])).assert_success();
    run(client.ctl().args(["verify", &workspace, "--read-data"])).assert_success();

    // A flipped byte in a pack only the second checkpoint uses.
    let added: Vec<_> = pack_files(&coordinator.blobs_dir())
        .difference(&packs_of_first)
        .cloned()
        .collect();
    let data_pack = added
        .iter()
        .find(|p| pack_kind(p) == PACK_DATA)
        .expect("the second checkpoint added a data pack");
    flip_byte(data_pack, std::fs::metadata(data_pack).unwrap().len() / 2);
    let verified = run(client.ctl().args(["verify", &workspace, "--read-data"])).assert_exit(1);
    let pack_id = data_pack.file_name().unwrap().to_str().unwrap();
    let output = verified.all_output();
    assert!(
        output.contains(&second_id),
        "verify does not name the damaged checkpoint: {verified}"
    );
    assert!(
        output.contains(&pack_id[..12]),
        "verify does not name the damaged pack {pack_id}: {verified}"
    );
}

#[test]
fn a_restarted_coordinator_keeps_workspaces_checkpoints_and_the_admin_token() {
    let tmp = tempdir("restart");
    let mut coordinator = Coordinator::start();
    let token = coordinator.admin_token().to_owned();
    let workspace = coordinator.create_workspace("durable");
    let root = tmp.path().join("workspace");
    populate_small_workspace(&root, 7);
    let checkpoint = coordinator.client().checkpoint(&root, &workspace);

    coordinator.restart();
    assert_eq!(
        coordinator.admin_token(),
        token,
        "the admin token changed across a restart"
    );
    let listed = coordinator.client().ctl_json(&["checkpoints", "durable"]);
    assert_eq!(
        ids_with_prefix(&listed, "ck-"),
        vec![json_str(&checkpoint, "checkpoint_id").to_owned()]
    );
    let restored = tmp.path().join("restored");
    coordinator.client().restore(&restored, &workspace);
    TreeSnapshot::take(&root).assert_matches(&restored, false);
}

/// `-o yaml` is the JSON document in YAML, for every listing; `-o wide`
/// adds columns to the table; a document on stdout leaves stderr quiet.
#[test]
fn yaml_is_the_json_document_and_wide_tables_add_columns() {
    let tmp = tempdir("shapes");
    let coordinator = Coordinator::start();
    let client = coordinator.client();
    let workspace = coordinator.create_workspace("shapes");
    let root = tmp.path().join("workspace");
    populate_small_workspace(&root, 9);
    client.checkpoint(&root, &workspace);
    client.ctl_json(&["tokens", "create", "--scope", "client"]);

    for args in [
        &["workspace", "list"][..],
        &["workspace", "show", "shapes"],
        &["checkpoints", "shapes"],
        &["tokens", "list"],
        &["storage"],
    ] {
        let json = client.ctl_json(args);
        let yaml = run(client.ctl().args(["-o", "yaml"]).args(args)).assert_success();
        let parsed: serde_json::Value = yaml_serde::from_str(&yaml.stdout)
            .unwrap_or_else(|e| panic!("`{}` is not YAML ({e}): {yaml}", args.join(" ")));
        assert_eq!(parsed, json, "`{}`: YAML and JSON differ", args.join(" "));
        assert!(
            yaml.stderr.is_empty(),
            "nothing but the document for scripts: {yaml}"
        );
    }

    let header = |output: &str| {
        run(client.ctl().args(["-o", output, "checkpoints", "shapes"]))
            .assert_success()
            .stdout
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    let (table, wide) = (header("table"), header("wide"));
    for column in ["GEN", "PARENT", "STORED", "KEY"] {
        assert!(wide.contains(column), "-o wide lacks {column}: {wide}");
        assert!(!table.contains(column), "the table has {column}: {table}");
    }

    let verified = run(client.ctl().args(["-o", "json", "verify", "shapes"])).assert_success();
    assert!(
        verified.stderr.is_empty(),
        "no progress for scripts: {verified}"
    );
    assert_eq!(verified.json()["ok"], true, "{verified}");
}

/// `cairnctl completions bash` completes subcommands in a real bash.
#[test]
fn bash_completes_cairnctl_subcommands() {
    let script = run(std::process::Command::new(binary("cairnctl")).args(["completions", "bash"]))
        .assert_success()
        .stdout;
    let tmp = tempdir("completions");
    let file = tmp.path().join("cairnctl.bash");
    write(&file, &script);
    // What bash does on `cairnctl ru<TAB>`, then `cairnctl runs w<TAB>`.
    let complete = |line: &str| {
        let words: Vec<&str> = line.split(' ').collect();
        let program = format!(
            "source {}; COMP_WORDS=({}); COMP_CWORD={}; COMP_LINE='{line}'; COMP_POINT={}; _cairnctl cairnctl '{}' '{}'; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            file.display(),
            line,
            words.len() - 1,
            line.len(),
            words[words.len() - 1],
            words[words.len() - 2],
        );
        run(std::process::Command::new("bash").args(["-c", &program]))
            .assert_success()
            .stdout
    };
    let offered = complete("cairnctl ru");
    assert_eq!(offered.trim(), "runs", "cairnctl ru<TAB>: {offered}");
    let offered = complete("cairnctl runs w");
    assert_eq!(offered.trim(), "watch", "cairnctl runs w<TAB>: {offered}");
}

/// Refusals and failed connections say what happened and what to do.
#[test]
fn errors_name_the_cause_and_the_next_step() {
    // Nothing listens on port 1 of the loopback.
    let unreachable = run(std::process::Command::new(binary("cairnctl"))
        .args(["--coordinator", "http://127.0.0.1:1", "workspace", "list"])
        .env_remove("CAIRN_CA")
        .env_remove("CAIRN_TOKEN")
        .env_remove("CAIRN_COORDINATOR"))
    .assert_exit(1);
    assert!(
        unreachable.stderr.contains(
            "error: cannot reach the coordinator at http://127.0.0.1:1: connection refused"
        ),
        "{unreachable}"
    );
    assert!(
        unreachable
            .stderr
            .contains("hint: is cairn-coordinator running and listening there?")
            && unreachable.stderr.contains("CAIRN_COORDINATOR"),
        "{unreachable}"
    );

    let coordinator = Coordinator::start();
    let admin = coordinator.client();
    let anonymous = run(coordinator
        .client_with_token(None)
        .ctl()
        .args(["workspace", "list"]))
    .assert_exit(1);
    assert!(
        anonymous
            .stderr
            .contains("hint: no token was given: set --token or CAIRN_TOKEN"),
        "{anonymous}"
    );

    let minted = admin.ctl_json(&["tokens", "create", "--scope", "client"]);
    let (token, id) = (json_str(&minted, "token"), json_str(&minted, "id"));
    let client = coordinator.client_with_token(Some(token));
    let denied = run(client.ctl().args(["hosts", "list"])).assert_exit(1);
    assert!(
        denied.stderr.contains("permission denied")
            && denied.stderr.contains("need the admin token"),
        "a client token on an admin command: {denied}"
    );
    run(admin.ctl().args(["tokens", "revoke", id])).assert_success();
    let revoked = run(client.ctl().args(["workspace", "list"])).assert_exit(1);
    assert!(
        revoked.stderr.contains("hint: the token was revoked"),
        "{revoked}"
    );

    let missing = run(admin.ctl().args(["workspace", "show", "no-such-workspace"])).assert_exit(1);
    assert!(
        missing
            .stderr
            .contains("hint: check the id or name: `cairnctl workspace list`"),
        "{missing}"
    );
}

/// A TLS coordinator reached without its CA is a TLS failure, with the
/// variable that fixes it.
#[test]
fn a_coordinator_certificate_nobody_trusts_is_named_with_cairn_ca() {
    let tmp = tempdir("ctl-tls");
    let files = cairn_e2e::tls::TlsFiles::generate(tmp.path());
    let coordinator = Coordinator::start_tls(&files, false, &[]);
    let untrusting = run(coordinator
        .client()
        .ctl()
        .args(["workspace", "list"])
        .env_remove("CAIRN_CA"))
    .assert_exit(1);
    assert!(
        untrusting.stderr.contains(&format!(
            "error: the TLS handshake with the coordinator at {} failed",
            coordinator.grpc_url()
        )),
        "{untrusting}"
    );
    assert!(
        untrusting.stderr.contains("hint: set CAIRN_CA"),
        "{untrusting}"
    );
}
