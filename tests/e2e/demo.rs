//! `cairnctl demo`, the README's main command, run from the debug build the
//! way a user runs it: it must tell the whole story and pass its own checks.

use std::process::Command;

use cairn_e2e::fleet::require_local_sandboxes;
use cairn_e2e::{binary, run, tempdir};
use serde_json::Value;

/// Every boolean inside `value`.
fn booleans(value: &Value, out: &mut Vec<bool>) {
    match value {
        Value::Bool(b) => out.push(*b),
        Value::Object(map) => map.values().for_each(|v| booleans(v, out)),
        Value::Array(items) => items.iter().for_each(|v| booleans(v, out)),
        _ => {}
    }
}

#[test]
fn cairnctl_demo_resumes_on_the_other_host_and_passes_its_checks() {
    require_local_sandboxes();
    let home = tempdir("demo-home");
    let out = run(Command::new(binary("cairnctl"))
        .args(["demo", "--output", "json"])
        .current_dir(home.path())
        .env("HOME", home.path())
        .env_remove("CAIRN_COORDINATOR")
        .env_remove("CAIRN_TOKEN")
        .env_remove("CAIRN_FAILPOINTS")
        // As if started directly, not by `cargo run`: the binaries are built.
        .env_remove("CARGO"));
    assert!(out.status.success(), "cairnctl demo failed: {out}");
    // The summary is the last JSON document on stdout (progress may precede it).
    let summary: Value = serde_json::from_str(out.stdout.trim())
        .or_else(|_| {
            let last = out
                .stdout
                .lines()
                .rev()
                .find(|l| l.trim_start().starts_with('{'))
                .unwrap_or_default();
            serde_json::from_str(last)
        })
        .unwrap_or_else(|e| panic!("no JSON summary on stdout ({e}): {out}"));
    if let Some(passed) = summary.get("passed") {
        assert_eq!(
            passed,
            &Value::Bool(true),
            "the demo's overall verdict: {summary}"
        );
    }
    let checks = summary
        .get("checks")
        .unwrap_or_else(|| panic!("the summary has no checks: {summary}"));
    let mut results = Vec::new();
    booleans(checks, &mut results);
    assert!(
        results.len() >= 4,
        "the demo checks the host, the restore, the session and the recall — found {checks}"
    );
    assert!(
        results.iter().all(|ok| *ok),
        "a demo check failed: {checks}"
    );
}
