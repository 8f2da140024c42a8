//! `cairn-runner run` refuses to start without what it needs, and says what.

use std::process::Command;

const RUNNER: &str = env!("CARGO_BIN_EXE_cairn-runner");

#[test]
fn run_without_a_run_token_names_the_variable() {
    let out = Command::new(RUNNER)
        .args(["run", "--root", "/nonexistent"])
        .env("CAIRN_COORDINATOR", "http://127.0.0.1:9")
        .env_remove("CAIRN_RUN_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "error: no run token: set CAIRN_RUN_TOKEN"
    );
}
