//! `cairnctl checkpoints [list] WS`: a workspace's checkpoints, newest
//! first, with why retention keeps each; `checkpoints pin|unpin CID`.

use std::process::ExitCode;
use std::time::SystemTime;

use cairn_engine::client::CoordinatorClient;
use cairn_proto::pb;

use super::output::{self, time_of};
use super::{Output, all_checkpoints, emit, print_document, rpc_error};

pub async fn list(
    coordinator: &CoordinatorClient,
    workspace: &str,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let checkpoints = all_checkpoints(coordinator, workspace).await?;
    match out {
        Output::Json | Output::Yaml => print_document(
            out,
            &serde_json::Value::Array(checkpoints.iter().map(output::checkpoint_json).collect()),
        )?,
        Output::Table | Output::Wide => {
            let rows: Vec<Vec<String>> = checkpoints
                .iter()
                .map(|c| {
                    let stats = c.stats.unwrap_or_default();
                    let mut row = vec![
                        c.id.clone(),
                        c.sequence.to_string(),
                        output::reason(c.reason).to_owned(),
                        output::age(time_of!(c.created_at)),
                        stats.files.to_string(),
                        output::bytes(stats.total_bytes),
                        output::bytes(stats.uploaded_bytes),
                        c.pack_count.to_string(),
                        output::repos(&c.repos),
                        output::kept_by(c.retention.as_ref()),
                        output::kept_until(c.retention.as_ref()),
                    ];
                    if out.is_wide() {
                        row.extend([
                            c.generation.to_string(),
                            output::or_dash(&c.parent_checkpoint_id),
                            output::bytes(c.stored_bytes),
                            c.key_id.clone(),
                            c.warnings.len().to_string(),
                        ]);
                    }
                    row
                })
                .collect();
            let mut headers = vec![
                "ID", "#", "REASON", "CREATED", "FILES", "SIZE", "UPLOADED", "PACKS", "REPOS",
                "KEPT BY", "UNTIL",
            ];
            if out.is_wide() {
                headers.extend(["GEN", "PARENT", "STORED", "KEY", "WARNINGS"]);
            }
            emit(&output::table(&headers, &rows))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Pins `checkpoint` for `reason` until `until` (`None`: until unpinned).
pub async fn pin(
    coordinator: &CoordinatorClient,
    checkpoint: &str,
    reason: &str,
    until: Option<SystemTime>,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = coordinator.checkpoints.clone();
    let pinned = client
        .pin_checkpoint(pb::PinCheckpointRequest {
            checkpoint_id: checkpoint.to_owned(),
            reason: reason.to_owned(),
            until: until.map(cairn_proto::domain::to_timestamp),
        })
        .await
        .map_err(rpc_error("pinning the checkpoint"))?
        .into_inner();
    answer(&pinned, "pinned", out)
}

/// Removes the pin `reason` from `checkpoint`.
pub async fn unpin(
    coordinator: &CoordinatorClient,
    checkpoint: &str,
    reason: &str,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = coordinator.checkpoints.clone();
    let unpinned = client
        .unpin_checkpoint(pb::UnpinCheckpointRequest {
            checkpoint_id: checkpoint.to_owned(),
            reason: reason.to_owned(),
        })
        .await
        .map_err(rpc_error("unpinning the checkpoint"))?
        .into_inner();
    answer(&unpinned, "unpinned", out)
}

fn answer(c: &pb::Checkpoint, done: &str, out: Output) -> anyhow::Result<ExitCode> {
    match out {
        Output::Json | Output::Yaml => print_document(out, &output::checkpoint_json(c))?,
        Output::Table | Output::Wide => emit(&format!(
            "{done} {}; kept by: {} (until {})",
            output::checkpoint_brief(c),
            output::kept_by(c.retention.as_ref()),
            output::kept_until(c.retention.as_ref())
        ))?,
    }
    Ok(ExitCode::SUCCESS)
}
