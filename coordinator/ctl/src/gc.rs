//! `cairnctl gc [--dry-run]` and `cairnctl storage` (admin token).

use std::process::ExitCode;

use cairn_engine::client::CoordinatorClient;
use cairn_proto::pb;
use cairn_proto::runs::from_proto_duration;

use super::output;
use super::{Output, emit, print_json, rpc_error};

fn duration(d: Option<&prost_types::Duration>) -> String {
    d.and_then(|d| from_proto_duration(d, "duration").ok())
        .map(|d| humantime::format_duration(d).to_string())
        .unwrap_or_else(|| "-".into())
}

/// Runs a garbage collection cycle over the tenant now (or says what one
/// would do).
pub async fn collect(
    coordinator: &CoordinatorClient,
    dry_run: bool,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = super::hosts::client(coordinator);
    let r = client
        .collect_garbage(pb::CollectGarbageRequest { dry_run })
        .await
        .map_err(rpc_error("collecting garbage"))?
        .into_inner();
    match out {
        Output::Json => print_json(&serde_json::json!({
            "dry_run": r.dry_run,
            "checkpoints_deleted": r.checkpoints_deleted,
            "workspaces_expired": r.workspaces_expired,
            "packs_condemned": r.packs_condemned,
            "bytes_condemned": r.bytes_condemned,
            "packs_swept": r.packs_swept,
            "bytes_swept": r.bytes_swept,
            "orphans_swept": r.orphans_swept,
            "orphan_bytes_swept": r.orphan_bytes_swept,
            "packs_awaiting_grace": r.packs_awaiting_grace,
            "bytes_awaiting_grace": r.bytes_awaiting_grace,
            "grace_secs": r.grace.as_ref().map(|d| d.seconds),
            "took_ms": r.took.as_ref().and_then(|d| from_proto_duration(d, "took").ok()).map(|d| d.as_millis() as u64),
        }))?,
        Output::Table => {
            let (prefix, free, delete, condemn, wait) = if r.dry_run {
                (
                    "gc (dry run)",
                    "would free",
                    "would delete",
                    "would condemn",
                    "already wait",
                )
            } else {
                ("gc", "freed", "deleted", "condemned", "wait")
            };
            emit(&format!(
                "{prefix}: {free} {} now ({} packs, {} of them uploads never committed); {delete} {} checkpoints and {} expired workspaces",
                output::bytes(r.bytes_swept + r.orphan_bytes_swept),
                r.packs_swept + r.orphans_swept,
                r.orphans_swept,
                r.checkpoints_deleted,
                r.workspaces_expired,
            ))?;
            emit(&format!(
                "{condemn} {} packs ({}) no checkpoint references; {} packs ({}) {wait} out the grace period of {} before they are freed; took {}",
                r.packs_condemned,
                output::bytes(r.bytes_condemned),
                r.packs_awaiting_grace,
                output::bytes(r.bytes_awaiting_grace),
                duration(r.grace.as_ref()),
                r.took
                    .as_ref()
                    .and_then(|d| from_proto_duration(d, "took").ok())
                    .map(|d| format!("{} ms", d.as_millis()))
                    .unwrap_or_else(|| "-".into()),
            ))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What the tenant stores.
pub async fn storage(coordinator: &CoordinatorClient, out: Output) -> anyhow::Result<ExitCode> {
    let mut client = super::hosts::client(coordinator);
    let s = client
        .get_storage(pb::GetStorageRequest {})
        .await
        .map_err(rpc_error("reading the storage"))?
        .into_inner();
    match out {
        Output::Json => print_json(&serde_json::json!({
            "tenant": s.tenant,
            "packs": s.packs,
            "stored_bytes": s.stored_bytes,
            "condemned_packs": s.condemned_packs,
            "condemned_bytes": s.condemned_bytes,
            "workspaces": s.workspaces,
            "checkpoints": s.checkpoints,
        }))?,
        Output::Table => emit(&output::key_values(&[
            ("tenant", s.tenant.clone()),
            (
                "stored",
                format!("{} in {} packs", output::bytes(s.stored_bytes), s.packs),
            ),
            (
                "condemned",
                format!(
                    "{} in {} packs (referenced by no checkpoint; freed after the gc grace)",
                    output::bytes(s.condemned_bytes),
                    s.condemned_packs
                ),
            ),
            ("workspaces", s.workspaces.to_string()),
            ("checkpoints", s.checkpoints.to_string()),
        ]))?,
    }
    Ok(ExitCode::SUCCESS)
}
