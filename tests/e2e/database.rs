//! The metadata database flag (issue 32): a location the coordinator cannot
//! use stops it at start with the reason, and never with a password in it.
//! (Every other end-to-end test runs on PostgreSQL too when
//! `CAIRN_TEST_DATABASE` is set; `scripts/test` does that.)

use std::process::Command;

use cairn_e2e::{binary, tempdir};

fn serve(args: &[&str]) -> (bool, String) {
    let home = tempdir("database");
    let output = Command::new(binary("cairn-coordinator"))
        .arg("serve")
        .arg("--data-dir")
        .arg(home.path().join("data"))
        .args(["--listen", "127.0.0.1:0", "--blob-listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("CAIRN_DATABASE")
        .output()
        .expect("cairn-coordinator runs");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn an_unusable_database_stops_the_start_with_the_reason() {
    let (ok, stderr) = serve(&["--database", "mysql://db/cairn"]);
    assert!(!ok);
    assert!(
        stderr.contains("database scheme \"mysql\" is not supported"),
        "{stderr}"
    );

    // Nothing listens on port 1: the refusal names the connection, and the
    // password stays out of it.
    let (ok, stderr) = serve(&["--database", "postgres://cairn:hunter2@127.0.0.1:1/cairn"]);
    assert!(!ok);
    assert!(stderr.contains("Connection refused"), "{stderr}");
    assert!(stderr.contains("cairn:***@127.0.0.1:1"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");

    let (ok, stderr) = serve(&[
        "--database",
        "postgres://cairn@127.0.0.1:1/cairn",
        "--database-schema",
        "Robert'); DROP TABLE runs;--",
    ]);
    assert!(!ok);
    assert!(stderr.contains("is not a plain identifier"), "{stderr}");
}
