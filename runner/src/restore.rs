//! Restoring a checkpoint (being written).

use crate::cli::RestoreArgs;

pub async fn cli_main(_args: RestoreArgs) -> anyhow::Result<()> {
    anyhow::bail!("restore is being written")
}
