//! `cairnctl hosts list|cordon|uncordon|drain` (admin token): the machines
//! that run sandboxes, and taking them out of rotation.

use std::process::ExitCode;

use cairn_engine::client::{AuthChannel, CoordinatorClient};
use cairn_proto::pb;
use cairn_proto::pb::admin_service_client::AdminServiceClient;
use serde_json::Value;

use super::output::{self, time_of};
use super::{Output, emit, print_document, rpc_error};

/// An AdminService client on the coordinator's connection.
pub fn client(coordinator: &CoordinatorClient) -> AdminServiceClient<AuthChannel> {
    AdminServiceClient::new(coordinator.auth_channel())
}

/// What cordon, uncordon and drain do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Cordon,
    Uncordon,
    Drain,
}

pub async fn list(coordinator: &CoordinatorClient, out: Output) -> anyhow::Result<ExitCode> {
    let hosts = client(coordinator)
        .list_hosts(pb::ListHostsRequest {})
        .await
        .map_err(rpc_error("listing hosts"))?
        .into_inner()
        .hosts;
    match out {
        Output::Json | Output::Yaml => print_document(
            out,
            &Value::Array(hosts.iter().map(output::host_json).collect()),
        )?,
        Output::Table | Output::Wide => emit(&hosts_table(&hosts, out.is_wide()))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// One row per host: state, capacity, labels, liveness, runs, kept trees
/// (`wide`: which workspaces' trees, and when the host registered).
pub fn hosts_table(hosts: &[pb::Host], wide: bool) -> String {
    let rows: Vec<Vec<String>> = hosts
        .iter()
        .map(|h| {
            vec![
                h.id.clone(),
                output::or_dash(&h.name),
                output::host_state(h.state).to_owned(),
                output::or_dash(&h.driver),
                format!("{}/{}", h.used_slots, h.slots),
                output::pairs(&h.labels),
                output::age(time_of!(h.last_heartbeat_at)),
                if h.run_ids.is_empty() {
                    "-".into()
                } else {
                    h.run_ids.join(",")
                },
                if wide {
                    output::or_dash(&h.kept_workspaces.join(","))
                } else {
                    h.kept_workspaces.len().to_string()
                },
            ]
            .into_iter()
            .chain(wide.then(|| output::age(time_of!(h.registered_at))))
            .collect()
        })
        .collect();
    let mut headers = vec![
        "ID",
        "NAME",
        "STATE",
        "DRIVER",
        "SLOTS",
        "LABELS",
        "HEARTBEAT",
        "RUNS",
        if wide { "KEPT WORKSPACES" } else { "KEPT" },
    ];
    if wide {
        headers.push("REGISTERED");
    }
    output::table(&headers, &rows)
}

pub async fn act(
    coordinator: &CoordinatorClient,
    action: Action,
    host: &str,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = client(coordinator);
    let request = pb::HostRequest {
        host: host.to_owned(),
    };
    let host = match action {
        Action::Cordon => client
            .cordon_host(request)
            .await
            .map_err(rpc_error("cordoning the host"))?,
        Action::Uncordon => client
            .uncordon_host(request)
            .await
            .map_err(rpc_error("uncordoning the host"))?,
        Action::Drain => client
            .drain_host(request)
            .await
            .map_err(rpc_error("draining the host"))?,
    }
    .into_inner();
    match out {
        Output::Json | Output::Yaml => print_document(out, &output::host_json(&host))?,
        Output::Table | Output::Wide => emit(&action_summary(action, &host))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `host host-1 (gpu-box): draining, 2 sandboxes being suspended`.
pub fn action_summary(action: Action, host: &pb::Host) -> String {
    let named = if host.name.is_empty() {
        String::new()
    } else {
        format!(" ({})", host.name)
    };
    let state = output::host_state(host.state);
    let tail = match action {
        Action::Cordon => ": no new runs will be placed there".to_owned(),
        Action::Uncordon => ": takes new runs again".to_owned(),
        Action::Drain if host.used_slots == 0 => ": no sandboxes to suspend".to_owned(),
        Action::Drain => format!(
            ": {} sandbox{} being released (running runs resume elsewhere, waiting ones are suspended)",
            host.used_slots,
            if host.used_slots == 1 { "" } else { "es" }
        ),
    };
    format!("host {}{named} is {state}{tail}", host.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(state: pb::HostState, used_slots: u32) -> pb::Host {
        pb::Host {
            id: "host-1".into(),
            name: "box".into(),
            state: state as i32,
            slots: 2,
            used_slots,
            labels: [
                ("zone".to_owned(), "eu".to_owned()),
                ("gpu".to_owned(), "a100".to_owned()),
            ]
            .into_iter()
            .collect(),
            run_ids: vec!["run-1".into()],
            kept_workspaces: vec!["ws-a".into(), "ws-b".into()],
            ..Default::default()
        }
    }

    #[test]
    fn the_host_table_shows_capacity_and_sorted_labels() {
        let text = hosts_table(&[host(pb::HostState::Ready, 1)], false);
        let row = text.lines().nth(1).unwrap();
        for cell in ["host-1", "box", "ready", "1/2", "gpu=a100,zone=eu", "run-1"] {
            assert!(row.contains(cell), "{row}");
        }
        assert!(text.lines().next().unwrap().ends_with("KEPT"), "{text}");
        assert!(row.ends_with(" 2"), "two kept trees: {row}");
        assert_eq!(
            output::host_json(&host(pb::HostState::Lost, 0))["state"],
            "lost"
        );
    }

    #[test]
    fn draining_says_what_happens_to_the_sandboxes() {
        let text = action_summary(Action::Drain, &host(pb::HostState::Draining, 2));
        assert_eq!(
            text,
            "host host-1 (box) is draining: 2 sandboxes being released (running runs resume \
             elsewhere, waiting ones are suspended)"
        );
        let text = action_summary(Action::Cordon, &host(pb::HostState::Cordoned, 0));
        assert_eq!(
            text,
            "host host-1 (box) is cordoned: no new runs will be placed there"
        );
    }
}
