//! Cutting a checkpoint (being written).

use crate::cli::CheckpointArgs;

pub async fn cli_main(_args: CheckpointArgs) -> anyhow::Result<()> {
    anyhow::bail!("checkpoint is being written")
}
