//! `/metrics`: a scrape after commits, a refused commit, a restore
//! manifest, runs and a garbage collection cycle, read by the Prometheus
//! client library's own parser (Python's `prometheus_client`).

use cairn_proto::domain::PackKind;
use cairn_proto::pb;
use cairn_proto::pb::admin_service_client::AdminServiceClient;
use cairn_proto::pb::host_service_client::HostServiceClient;
use cairn_utils::testing::{Sample, parse_prometheus, sample_value as value};

use crate::fleet::*;
use crate::harness::*;

#[tokio::test]
async fn a_scrape_counts_commits_refusals_runs_hosts_storage_gc_and_recovery_points() {
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
    manifest(&mut client, &ws.id, "").await;
    AdminServiceClient::new(client.auth_channel())
        .collect_garbage(pb::CollectGarbageRequest { dry_run: false })
        .await
        .unwrap();
    // A dry run deletes nothing and is not a cycle.
    AdminServiceClient::new(client.auth_channel())
        .collect_garbage(pb::CollectGarbageRequest { dry_run: true })
        .await
        .unwrap();

    // A run no host can take, and one a host is assigned, on the workspace
    // just checkpointed.
    let mut clients = Clients::admin(&server).await;
    let queued = clients.create_run(&[("zone", "nowhere")]).await;
    let mut host = FakeHost::register(&server, &server.admin_token, "h", &[], 1).await;
    let active = clients.create(run_on(&ws.id)).await;
    host.beat_until_assigned(&active.id).await;
    // A heartbeat that fails: no such host id.
    let refused = HostServiceClient::new(server.channel(&server.admin_token).await)
        .heartbeat(pb::HeartbeatRequest {
            host_id: "not a host id".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);

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
    let samples = parse_prometheus(&response.text().await.unwrap());

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

    assert_eq!(
        value(
            &samples,
            "cairn_restore_manifest_duration_seconds_count",
            &[]
        ),
        1.0
    );

    // The two packs the commit brought are live, none condemned.
    let stored = |name: &str, state: &str| {
        value(&samples, name, &[("tenant", &ws.tenant), ("state", state)])
    };
    assert_eq!(stored("cairn_stored_bytes", "live"), committed_bytes);
    assert_eq!(stored("cairn_stored_packs", "live"), 2.0);
    assert_eq!(stored("cairn_stored_bytes", "condemned"), 0.0);

    // One cycle ran, deleting nothing: every pack is referenced.
    assert_eq!(
        value(&samples, "cairn_gc_cycles_total", &[("outcome", "ok")]),
        1.0
    );
    assert_eq!(value(&samples, "cairn_gc_freed_bytes_total", &[]), 0.0);
    assert_eq!(
        value(&samples, "cairn_gc_checkpoints_deleted_total", &[]),
        0.0
    );
    let last_gc = value(&samples, "cairn_gc_last_success_timestamp_seconds", &[]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        last_gc > now - 600.0 && last_gc <= now,
        "{last_gc} vs {now}"
    );

    // The scheduler assigned one run for the first time.
    assert_eq!(
        value(
            &samples,
            "cairn_run_first_assignment_wait_seconds_count",
            &[]
        ),
        1.0
    );
    assert!(value(&samples, "cairn_scheduler_pass_duration_seconds_count", &[]) >= 1.0);

    // The host's heartbeats were answered (one at least, the one that
    // brought its assignment), and the one with a bad id failed.
    assert!(value(&samples, "cairn_heartbeat_duration_seconds_count", &[]) >= 1.0);
    assert_eq!(
        value(
            &samples,
            "cairn_heartbeats_failed_total",
            &[("reason", "invalid_argument")]
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
        .filter(|s| s.name == "cairn_run_checkpoint_age_seconds")
        .collect();
    assert_eq!(ages.len(), 1, "{ages:?}");
    assert_eq!(ages[0].labels["run"], active.id);
    assert_eq!(ages[0].labels["workspace"], ws.id);
    assert!(ages[0].value >= 0.0);
    assert_ne!(ages[0].labels["run"], queued.id);

    // The example alerts name only series the coordinator serves (hosts'
    // are checked by the host metrics test).
    let alerts = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/alerts.yml"),
    )
    .unwrap();
    let mut named = alerts
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("cairn_") && !word.starts_with("cairn_host_"))
        .peekable();
    assert!(named.peek().is_some(), "docs/alerts.yml names cairn series");
    for series in named {
        assert!(
            samples.iter().any(|s| s.name == series),
            "docs/alerts.yml names {series}, which the coordinator does not serve"
        );
    }
    server.stop().await;
}
