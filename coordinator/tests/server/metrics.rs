//! `/metrics`: a scrape after commits, a refused commit and runs, read by
//! the Prometheus client library's own parser (Python's
//! `prometheus_client`).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::{Command, Stdio};

use cairn_proto::domain::PackKind;

use crate::fleet::*;
use crate::harness::*;

/// One sample: metric name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

/// Parses a scrape with `prometheus_client`'s text parser, which refuses
/// what Prometheus would.
fn parse_exposition(text: &str) -> Vec<Sample> {
    const SCRIPT: &str = "import json, sys\n\
        from prometheus_client.parser import text_string_to_metric_families\n\
        for family in text_string_to_metric_families(sys.stdin.read()):\n\
        \x20   for s in family.samples:\n\
        \x20       print(json.dumps([s.name, s.labels, s.value]))\n";
    let mut child = Command::new(python_with_prometheus_client())
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the python that imports prometheus_client runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "prometheus_client refused the scrape (or is not installed: apt-get install python3-prometheus-client):\n{}\n{text}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// A Python that imports `prometheus_client`: the one on the PATH, else
/// the system's, where Debian's python3-prometheus-client installs it (a
/// PATH may lead to another Python first).
fn python_with_prometheus_client() -> &'static str {
    ["python3", "/usr/bin/python3"]
        .into_iter()
        .find(|python| {
            Command::new(python)
                .args(["-c", "import prometheus_client"])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|status| status.success())
        })
        .expect(
            "no python3 imports prometheus_client: apt-get install python3-prometheus-client (.ci/run does)",
        )
}

/// The value of the one sample named `name` with exactly `labels`.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let labels: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let found: Vec<f64> = samples
        .iter()
        .filter(|(n, l, _)| n == name && *l == labels)
        .map(|(_, _, v)| *v)
        .collect();
    assert_eq!(found.len(), 1, "one sample {name}{labels:?} in {samples:?}");
    found[0]
}

#[tokio::test]
async fn a_scrape_counts_commits_refusals_runs_hosts_and_recovery_points() {
    let dir = data_dir();
    let (server, metrics_url) = TestServer::start_with_metrics(dir.path()).await;
    let mut client = server.client().await;

    // A commit refused (a pack never uploaded), then the same one committed.
    let ws = create_workspace(&mut client, "").await;
    let begin = begin(&mut client, &ws.id).await;
    let keys = keys_of(&begin);
    let meta = build_pack(&keys, PackKind::Meta, &[b"tree"]);
    let data = build_pack(&keys, PackKind::Data, &[b"content"]);
    let request = || commit_request(&begin, &meta, &[&meta, &data], &[&meta, &data]);
    upload(&mut client, &ws.id, &[&meta]).await;
    commit_err(&mut client, request()).await;
    upload(&mut client, &ws.id, &[&data]).await;
    commit(&mut client, request()).await;
    let committed_bytes = (meta.size + data.size) as f64;

    // A run no host can take, and one a host is assigned, on the workspace
    // just checkpointed.
    let mut clients = Clients::admin(&server).await;
    let queued = clients.create_run(&[("zone", "nowhere")]).await;
    let mut host = FakeHost::register(&server, &server.admin_token, "h", &[], 1).await;
    let active = clients.create(run_on(&ws.id)).await;
    host.beat_until_assigned(&active.id).await;

    let response = reqwest::get(&metrics_url).await.unwrap();
    assert_eq!(response.status(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let samples = parse_exposition(&response.text().await.unwrap());

    assert_eq!(
        value(&samples, "cairn_checkpoints_committed_total", &[]),
        1.0
    );
    assert_eq!(
        value(
            &samples,
            "cairn_checkpoint_commits_refused_total",
            &[("reason", "packs_missing")]
        ),
        1.0
    );
    assert_eq!(
        value(&samples, "cairn_checkpoint_pack_bytes_committed_total", &[]),
        committed_bytes
    );
    assert_eq!(
        value(
            &samples,
            "cairn_checkpoint_commit_duration_seconds_count",
            &[]
        ),
        1.0
    );

    // Every state has a series; the two runs are where they should be.
    let runs = |state: &str| value(&samples, "cairn_runs", &[("state", state)]);
    assert_eq!(runs("queued"), 1.0);
    let with_sandbox = runs("assigned") + runs("starting") + runs("running");
    assert_eq!(with_sandbox, 1.0);
    for state in ["waiting", "suspended", "succeeded", "failed", "cancelled"] {
        assert_eq!(runs(state), 0.0, "{state}");
    }
    let hosts = |state: &str| value(&samples, "cairn_hosts", &[("state", state)]);
    assert_eq!(hosts("ready"), 1.0);
    for state in ["cordoned", "draining", "lost", "stopping"] {
        assert_eq!(hosts(state), 0.0, "{state}");
    }
    assert!(value(&samples, "cairn_queued_run_oldest_age_seconds", &[]) >= 0.0);

    // The recovery point of the run with a sandbox, and of no other.
    let ages: Vec<&Sample> = samples
        .iter()
        .filter(|(name, _, _)| name == "cairn_run_checkpoint_age_seconds")
        .collect();
    assert_eq!(ages.len(), 1, "{ages:?}");
    assert_eq!(ages[0].1["run"], active.id);
    assert_eq!(ages[0].1["workspace"], ws.id);
    assert!(ages[0].2 >= 0.0);
    assert_ne!(ages[0].1["run"], queued.id);

    // The example alerts name only series the coordinator serves.
    let alerts = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/alerts.yml"),
    )
    .unwrap();
    let mut named = alerts
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("cairn_"))
        .peekable();
    assert!(named.peek().is_some(), "docs/alerts.yml names cairn series");
    for series in named {
        assert!(
            samples.iter().any(|(name, _, _)| name == series),
            "docs/alerts.yml names {series}, which the coordinator does not serve"
        );
    }
    server.stop().await;
}
