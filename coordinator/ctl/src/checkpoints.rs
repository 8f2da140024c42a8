//! `cairnctl checkpoints WS`: a workspace's checkpoints, newest first.

use std::process::ExitCode;

use cairn_engine::client::CoordinatorClient;

use super::output::{self, time_of};
use super::{Output, all_checkpoints, emit, print_json};

pub async fn list(
    coordinator: &CoordinatorClient,
    workspace: &str,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let checkpoints = all_checkpoints(coordinator, workspace).await?;
    match out {
        Output::Json => print_json(&serde_json::Value::Array(
            checkpoints.iter().map(output::checkpoint_json).collect(),
        ))?,
        Output::Table => {
            let rows: Vec<Vec<String>> = checkpoints
                .iter()
                .map(|c| {
                    let stats = c.stats.unwrap_or_default();
                    vec![
                        c.id.clone(),
                        c.sequence.to_string(),
                        output::reason(c.reason).to_owned(),
                        output::age(time_of!(c.created_at)),
                        stats.files.to_string(),
                        output::bytes(stats.total_bytes),
                        output::bytes(stats.uploaded_bytes),
                        c.pack_count.to_string(),
                        output::repos(&c.repos),
                    ]
                })
                .collect();
            emit(&output::table(
                &[
                    "ID", "#", "REASON", "CREATED", "FILES", "SIZE", "UPLOADED", "PACKS", "REPOS",
                ],
                &rows,
            ))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
