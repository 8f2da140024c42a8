//! `cairn-runner restore`.

use anyhow::Context as _;
use cairn_engine::client::CoordinatorClient;
use cairn_engine::restore::{NoProgress, RestoreOptions, restore};
use cairn_proto::ids::CheckpointId;

use super::{OutputFormat, RestoreArgs, default_cache_dir};
use crate::report::{restore_summary, staleness_warning};

pub(super) async fn main(args: RestoreArgs) -> anyhow::Result<()> {
    let checkpoint = args
        .checkpoint
        .as_deref()
        .map(str::parse::<CheckpointId>)
        .transpose()
        .context("--checkpoint")?;
    let coordinator = CoordinatorClient::connect(
        &args.coordinator.coordinator,
        args.coordinator.token.as_deref(),
    )
    .await?;
    let opts = RestoreOptions {
        checkpoint,
        cache_dir: Some(args.cache_dir.unwrap_or_else(default_cache_dir)),
        pack_cache: args.pack_cache.config(),
        verify_existing: args.existing.verify_existing,
        ..RestoreOptions::new(args.root, args.workspace)
    };
    let report = restore(&coordinator, &opts, &NoProgress).await?;
    if let Some(warning) =
        staleness_warning(&report, args.warn_older_than, std::time::SystemTime::now())
    {
        eprintln!("{warning}");
    }
    match args.output {
        OutputFormat::Text => println!("{}", restore_summary(&report, &opts.root)),
        OutputFormat::Json => println!("{}", report.to_json()),
    }
    Ok(())
}
