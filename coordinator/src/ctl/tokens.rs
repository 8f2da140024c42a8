//! `cairnctl tokens create --scope client|host` (admin token).

use std::process::ExitCode;

use cairn_proto::pb;
use cairn_runner::client::Coordinator;
use clap::ValueEnum;
use serde_json::json;

use super::{Output, emit, hosts, print_json, rpc_error};

/// Scopes an admin can hand out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scope {
    /// Workspaces, checkpoints and runs.
    Client,
    /// For `cairn-host`: register and heartbeat.
    Host,
}

impl Scope {
    fn as_str(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Host => "host",
        }
    }
}

/// Prints the new token alone on stdout (so `$(cairnctl tokens create …)`
/// works); it is shown only this once.
pub async fn create(
    coordinator: &Coordinator,
    scope: Scope,
    description: Option<String>,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let created = hosts::client(coordinator)
        .create_token(pb::CreateTokenRequest {
            scope: scope.as_str().to_owned(),
            description: description.unwrap_or_default(),
        })
        .await
        .map_err(rpc_error("creating the token"))?
        .into_inner();
    match out {
        Output::Json => print_json(&json!({"token": created.token, "scope": created.scope}))?,
        Output::Table => {
            eprintln!(
                "{} token created; it is shown only now and cannot be read back",
                created.scope
            );
            emit(&created.token)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
