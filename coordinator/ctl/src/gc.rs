//! `cairnctl gc [--dry-run]` and `cairnctl storage` (admin token), and
//! `cairnctl compact WS`.

use std::process::ExitCode;

use cairn_engine::client::CoordinatorClient;
use cairn_proto::pb;
use cairn_proto::runs::from_proto_duration;

use super::output;
use super::{Output, emit, print_document, progress, rpc_error};

/// The coordinator reports nothing until a cycle ends: a spinner and the
/// time it has taken, so a long cycle does not look like a hang.
pub(crate) const TEMPLATE: &str = "{spinner} {msg} {elapsed}";

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
    let spinner = progress::bar(out, TEMPLATE);
    spinner.set_message(if dry_run {
        "collecting garbage (dry run)"
    } else {
        "collecting garbage"
    });
    let answer = client
        .collect_garbage(pb::CollectGarbageRequest { dry_run })
        .await;
    spinner.finish_and_clear();
    let r = answer
        .map_err(rpc_error("collecting garbage"))?
        .into_inner();
    match out {
        Output::Json | Output::Yaml => print_document(
            out,
            &serde_json::json!({
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
            }),
        )?,
        Output::Table | Output::Wide => {
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
        Output::Json | Output::Yaml => print_document(
            out,
            &serde_json::json!({
                "tenant": s.tenant,
                "packs": s.packs,
                "stored_bytes": s.stored_bytes,
                "condemned_packs": s.condemned_packs,
                "condemned_bytes": s.condemned_bytes,
                "workspaces": s.workspaces,
                "checkpoints": s.checkpoints,
            }),
        )?,
        Output::Table | Output::Wide => emit(&output::key_values(&[
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

/// Rewrites the workspace's mostly dead data packs (see
/// [`cairn_engine::compact`]): this machine holds the key for it.
pub async fn compact(
    coordinator: &CoordinatorClient,
    opts: cairn_engine::compact::CompactOptions,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let transfer = cairn_engine::transfer::BlobTransfer::default();
    let report = cairn_engine::compact::compact(coordinator, &transfer, &opts).await?;
    match out {
        Output::Json | Output::Yaml => print_document(out, &serde_json::to_value(&report)?)?,
        Output::Table | Output::Wide => {
            let live_share = if report.data_bytes == 0 {
                1.0
            } else {
                report.live_bytes as f64 / report.data_bytes as f64
            };
            emit(&format!(
                "{} checkpoints reference {} data packs ({}), {:.0}% of it live",
                report.checkpoints,
                report.data_packs,
                output::bytes(report.data_bytes),
                live_share * 100.0
            ))?;
            emit(&if report.dry_run {
                format!(
                    "would rewrite {} packs ({}) below {:.0}% live",
                    report.packs_rewritten,
                    output::bytes(report.bytes_rewritten),
                    opts.threshold * 100.0
                )
            } else if report.packs_rewritten == 0 {
                format!(
                    "no pack is below {:.0}% live: nothing to do",
                    opts.threshold * 100.0
                )
            } else {
                format!(
                    "rewrote {} packs ({}) into {} ({}); {} checkpoints moved to them. `cairnctl gc` frees the old packs after its grace period",
                    report.packs_rewritten,
                    output::bytes(report.bytes_rewritten),
                    report.new_packs,
                    output::bytes(report.bytes_written),
                    report.checkpoints_updated
                )
            })?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
