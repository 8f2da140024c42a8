//! `cairn-host --metrics-listen` and `cairn-coordinator serve
//! --metrics-listen`: scrapes of both after two runs of one workspace on one
//! host, the second starting on the tree the first left, read by
//! Prometheus' own parser.

use std::net::{SocketAddr, TcpListener};

use cairn_e2e::fleet::{Fleet, FleetTiming, HostOptions, on_workspace};
use cairn_proto::pb;
use cairn_proto::runs::RunState;
use cairn_utils::testing::{Sample, parse_prometheus, sample_value as value};

/// A loopback address nothing listens on (the host binds it next).
fn free_address() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port")
}

fn scrape(fleet: &Fleet, address: SocketAddr) -> Vec<Sample> {
    cairn_engine::transfer::install_crypto_provider();
    let text = fleet.block_on(async {
        let response = reqwest::get(format!("http://{address}/metrics"))
            .await
            .expect("the host serves /metrics");
        assert_eq!(response.status(), 200);
        response.text().await.expect("a scrape is text")
    });
    parse_prometheus(&text)
}

#[test]
fn a_host_and_its_coordinator_count_two_runs_the_second_on_a_kept_tree() {
    let coordinator_address = free_address();
    let mut fleet = Fleet::start_with_args(
        FleetTiming::default(),
        &["--metrics-listen", &coordinator_address.to_string()],
    );
    let address = free_address();
    fleet.start_host(
        "a",
        HostOptions {
            metrics_listen: Some(address),
            ..HostOptions::default()
        },
    );

    let first = fleet
        .create_run(fleet.run_request("metered", "commit work/one.txt written by the first run"));
    let first = fleet.wait_for_state(&first.id, RunState::Succeeded);
    fleet.wait_for_sandbox_gone("a", &first.attempts[0].sandbox_id);
    let second = fleet.create_run(on_workspace(
        fleet.run_request("", "untracked work/two.txt written by the second run"),
        &first.workspace_id,
    ));
    let second = fleet.wait_for_state(&second.id, RunState::Succeeded);
    fleet.wait_for_sandbox_gone("a", &second.attempts[0].sandbox_id);

    // The agent counts an end once the directory is gone: wait for it.
    let samples = fleet.wait_for("both sandboxes counted as ended", || {
        let samples = scrape(&fleet, address);
        let exited = value(
            &samples,
            "cairn_host_sandboxes_ended_total",
            &[("state", "exited")],
        );
        (exited == 2.0).then_some(samples)
    });
    assert_eq!(
        value(&samples, "cairn_host_sandboxes_started_total", &[]),
        2.0
    );
    assert_eq!(value(&samples, "cairn_host_slots", &[]), 1.0);
    for state in ["starting", "running"] {
        assert_eq!(
            value(&samples, "cairn_host_sandboxes", &[("state", state)]),
            0.0,
            "{state}"
        );
    }
    // The first run found no tree; the second started on the first's.
    let takes = |outcome| {
        value(
            &samples,
            "cairn_host_kept_tree_takes_total",
            &[("outcome", outcome)],
        )
    };
    assert_eq!((takes("miss"), takes("hit")), (1.0, 1.0));
    assert_eq!(value(&samples, "cairn_host_kept_trees", &[]), 1.0);

    // The first run had nothing to restore; the second restored the
    // first's checkpoint. Each run checkpointed at least at its end.
    assert_eq!(
        value(&samples, "cairn_host_restore_duration_seconds_count", &[]),
        1.0
    );
    let pack_bytes = |source| {
        value(
            &samples,
            "cairn_host_restore_pack_bytes_total",
            &[("source", source)],
        )
    };
    assert!(
        pack_bytes("store") + pack_bytes("pack_cache") > 0.0,
        "the restore read the checkpoint's tree from somewhere"
    );
    assert!(
        value(
            &samples,
            "cairn_host_checkpoint_duration_seconds_count",
            &[]
        ) >= 2.0
    );
    assert!(value(&samples, "cairn_host_checkpoint_uploaded_bytes_total", &[]) > 0.0);
    assert_eq!(
        value(&samples, "cairn_host_sandbox_reports_rejected_total", &[]),
        0.0
    );
    assert!(
        value(
            &samples,
            "cairn_host_heartbeats_total",
            &[("outcome", "ok")]
        ) > 0.0
    );

    // The coordinator saw the same two runs.
    let served = scrape(&fleet, coordinator_address);
    let runs = |state| value(&served, "cairn_runs", &[("state", state)]);
    assert_eq!(runs("succeeded"), 2.0);
    for state in ["queued", "assigned", "starting", "running", "waiting"] {
        assert_eq!(runs(state), 0.0, "{state}");
    }
    assert_eq!(value(&served, "cairn_hosts", &[("state", "ready")]), 1.0);
    assert!(value(&served, "cairn_checkpoints_committed_total", &[]) >= 2.0);
    assert!(value(&served, "cairn_checkpoint_pack_bytes_committed_total", &[]) > 0.0);
    assert!(
        value(
            &served,
            "cairn_restore_manifest_duration_seconds_count",
            &[]
        ) >= 1.0
    );
    assert_eq!(
        value(
            &served,
            "cairn_run_first_assignment_wait_seconds_count",
            &[]
        ),
        2.0
    );
    let tenant = fleet.block_on(async {
        let mut admin = fleet.coordinator.admin().await;
        admin
            .workspaces
            .get_workspace(pb::GetWorkspaceRequest {
                workspace: first.workspace_id.clone(),
            })
            .await
            .expect("the workspace exists")
            .into_inner()
            .tenant
    });
    assert!(
        value(
            &served,
            "cairn_stored_bytes",
            &[("tenant", &tenant), ("state", "live")]
        ) > 0.0
    );
    assert!(
        served
            .iter()
            .all(|s| s.name != "cairn_run_checkpoint_age_seconds"),
        "no run has a sandbox any more"
    );

    // The example alerts name only host series a host serves.
    let alerts = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/alerts.yml"),
    )
    .expect("docs/alerts.yml");
    let named: Vec<&str> = alerts
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("cairn_host_"))
        .collect();
    assert!(!named.is_empty(), "docs/alerts.yml names host series");
    for series in named {
        assert!(
            samples.iter().any(|s| s.name == series),
            "docs/alerts.yml names {series}, which a host does not serve"
        );
    }
}
