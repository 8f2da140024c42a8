//! `cairn-coordinator serve --store s3://…` with the real binaries against a
//! real S3-compatible server that checks SigV4 presigned URLs (`s3s-fs`):
//! the runner's checkpoints go to the bucket through the URLs the
//! coordinator signs (the checksum header included), restore byte for byte,
//! and garbage collection deletes from the bucket. A coordinator refuses to
//! start without the credentials or with a store URL it cannot use,
//! saying why (for gs:// and azure:// too). Fails, never skips, when `s3s-fs` is not installed.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use cairn_e2e::{
    Coordinator, TreeSnapshot, all_files, binary, json_str, json_u64, pack_files,
    populate_small_workspace, run, tempdir, write, write_pseudo_random,
};
use cairn_utils::testing::S3sFs;

const BUCKET: &str = "cairn-e2e";
const PREFIX: &str = "fleet/a";

/// Packs in the bucket, under the coordinator's prefix.
fn bucket_packs(root: &std::path::Path) -> Vec<PathBuf> {
    all_files(&root.join(BUCKET).join(PREFIX).join("packs"))
        .into_iter()
        .collect()
}

#[test]
fn checkpoints_go_to_s3_restore_byte_for_byte_and_are_collected_there() {
    let s3_dir = tempdir("s3s-fs");
    let s3 = S3sFs::start(s3_dir.path(), &[BUCKET]);
    let env = s3.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let store = format!("s3://{BUCKET}/{PREFIX}");
    // URLs live a second so the grace may be two: the test waits it out.
    let coordinator = Coordinator::start_with_env(
        &[
            "--store",
            &store,
            "--url-ttl",
            "1s",
            "--gc-grace",
            "2s",
            "--gc-interval",
            "0",
        ],
        &env,
    );
    let client = coordinator.client();
    coordinator.create_workspace("on-s3");
    client.ctl_json(&["workspace", "retention", "on-s3", "--keep-last", "1"]);

    let root = tempdir("on-s3");
    populate_small_workspace(root.path(), 11);
    write_pseudo_random(&root.path().join("assets/big.bin"), 3 << 20, 5);
    let first = client.checkpoint(root.path(), "on-s3");
    let first_snapshot = TreeSnapshot::take(root.path());
    assert!(json_u64(&first["stats"], "packs_uploaded") > 0, "{first}");
    let first_packs = bucket_packs(s3_dir.path());
    assert!(!first_packs.is_empty(), "the packs went to the bucket");
    assert!(
        pack_files(&coordinator.blobs_dir()).is_empty(),
        "and not to the embedded store"
    );

    // Restored from the bucket into an empty directory, byte for byte.
    let restored = tempdir("restored");
    let report = client.restore(restored.path(), "on-s3");
    assert_eq!(
        json_str(&report, "checkpoint_id"),
        json_str(&first, "checkpoint_id"),
        "{report}"
    );
    first_snapshot.assert_matches(restored.path(), false);

    // The next checkpoint, of a tree with nothing of the first, retires it
    // (keep-last 1): collection condemns its packs, all dead, and deletes
    // them from the bucket after the grace.
    for entry in std::fs::read_dir(root.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() && !path.is_symlink() {
            std::fs::remove_dir_all(&path).unwrap();
        } else {
            std::fs::remove_file(&path).unwrap();
        }
    }
    write_pseudo_random(&root.path().join("assets/big.bin"), 3 << 20, 6);
    write(&root.path().join("notes/turn.md"), "turn 2\n");
    let second = client.checkpoint(root.path(), "on-s3");
    let second_snapshot = TreeSnapshot::take(root.path());
    let condemned = client.ctl_json(&["gc"]);
    assert_eq!(
        json_u64(&condemned, "checkpoints_deleted"),
        1,
        "{condemned}"
    );
    assert!(json_u64(&condemned, "packs_condemned") > 0, "{condemned}");
    let before = bucket_packs(s3_dir.path()).len();
    std::thread::sleep(Duration::from_millis(2500));
    let swept = client.ctl_json(&["gc"]);
    assert_eq!(
        json_u64(&swept, "packs_swept"),
        json_u64(&condemned, "packs_condemned"),
        "{swept}"
    );
    let after = bucket_packs(s3_dir.path());
    assert_eq!(
        after.len() as u64,
        before as u64 - json_u64(&swept, "packs_swept"),
        "the swept packs left the bucket"
    );
    assert!(
        first_packs.iter().all(|p| !p.exists()),
        "the first checkpoint's packs are gone from the bucket"
    );

    // What is kept still restores exactly, and cairnctl reads it back whole.
    let again = tempdir("restored-again");
    let report = client.restore(again.path(), "on-s3");
    assert_eq!(
        json_str(&report, "checkpoint_id"),
        json_str(&second, "checkpoint_id")
    );
    second_snapshot.assert_matches(again.path(), false);
    run(client.ctl().args(["verify", "on-s3", "--read-data"])).assert_success();
}

/// `cairn-coordinator serve` with `args` and only the `env` given of the
/// AWS variables; its output once it exited (it must not start).
fn serve_refused(args: &[&str], env: &[(&str, &str)]) -> String {
    let data = tempdir("refused");
    let mut command = Command::new(binary("cairn-coordinator"));
    command
        .arg("serve")
        .arg("--data-dir")
        .arg(data.path().join("data"))
        .args(["--listen", "127.0.0.1:0", "--blob-listen", "127.0.0.1:0"])
        .args(args);
    for (name, _) in std::env::vars() {
        if name.starts_with("AWS_")
            || name.starts_with("AZURE_")
            || name == "GOOGLE_APPLICATION_CREDENTIALS"
        {
            command.env_remove(name);
        }
    }
    command.envs(env.iter().copied());
    let outcome = run(&mut command);
    assert!(!outcome.status.success(), "it started: {outcome}");
    outcome.stderr
}

#[test]
fn a_store_without_credentials_or_with_a_bad_url_stops_the_start_naming_why() {
    let stderr = serve_refused(
        &["--store", "s3://bucket/p"],
        &[("AWS_REGION", "us-east-1")],
    );
    assert!(stderr.contains("AWS_ACCESS_KEY_ID is not set"), "{stderr}");
    let stderr = serve_refused(
        &["--store", "s3://bucket/p"],
        &[("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s")],
    );
    assert!(stderr.contains("AWS_REGION is not set"), "{stderr}");
    let stderr = serve_refused(
        &["--store", "s3://bucket/p"],
        &[
            ("AWS_ACCESS_KEY_ID", "k"),
            ("AWS_SECRET_ACCESS_KEY", "s"),
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:9"),
        ],
    );
    assert!(stderr.contains("AWS_ALLOW_HTTP=true"), "{stderr}");
    let stderr = serve_refused(
        &[
            "--store",
            "s3://bucket/p",
            "--url-ttl",
            "8days",
            "--gc-grace",
            "9days",
        ],
        &[
            ("AWS_REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", "k"),
            ("AWS_SECRET_ACCESS_KEY", "s"),
        ],
    );
    assert!(
        stderr.contains("S3 signs URLs that live from 1 second to 7 days"),
        "{stderr}"
    );
    let stderr = serve_refused(&["--store", "gs://bucket/p"], &[]);
    assert!(
        stderr.contains("GOOGLE_APPLICATION_CREDENTIALS is not set"),
        "{stderr}"
    );
    let stderr = serve_refused(&["--store", "file:///var/lib/packs"], &[]);
    assert!(stderr.contains("unknown scheme"), "{stderr}");
    let stderr = serve_refused(&["--store", "azure://container/p"], &[]);
    assert!(
        stderr.contains("AZURE_STORAGE_ACCOUNT_NAME is not set"),
        "{stderr}"
    );
    let stderr = serve_refused(&["--store", "s3://Not_A_Bucket"], &[]);
    assert!(stderr.contains("bucket name"), "{stderr}");
}
