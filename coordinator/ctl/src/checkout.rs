//! `cairnctl checkout WS DEST [--checkpoint CID]`: the runner's restore
//! engine writing into any directory, with a progress bar on stderr.
//!
//! The bar is hidden when stderr is not a terminal or the output is JSON or
//! YAML ([`super::progress`]), so scripts see only the report. The runner's
//! fingerprint cache is left alone: it belongs to the workspace's sandbox,
//! not to this directory. A host's pack cache (`--pack-cache DIR`) is used
//! and filled like a runner does, every byte from it verified.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use cairn_engine::client::CoordinatorClient;
use cairn_engine::restore::{self, PackCacheConfig, PlannedWork, RestoreOptions, RestoreProgress};
use cairn_proto::ids::CheckpointId;
use indicatif::ProgressBar;

use super::{Output, emit, print_document, progress};

/// Feeds restore progress into an indicatif bar (bytes written).
struct Bar(ProgressBar);

impl RestoreProgress for Bar {
    fn trying(&self, checkpoint: &CheckpointId) {
        self.0.set_message(format!("checkpoint {checkpoint}"));
    }

    fn skipped(&self, checkpoint: &str, reason: &str) {
        self.0.println(format!(
            "checkpoint {checkpoint} cannot be restored ({reason}); trying an older one"
        ));
    }

    fn planned(&self, work: &PlannedWork) {
        self.0.set_length(work.bytes_to_write);
        self.0.set_position(0);
    }

    fn written(&self, bytes: u64, _files: u64) {
        self.0.inc(bytes);
    }
}

/// Bytes written of the bytes the plan writes.
pub(crate) const TEMPLATE: &str =
    "{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}";

/// What `cairnctl checkout` restores, where, and how.
#[derive(Debug)]
pub struct Checkout<'a> {
    pub workspace: &'a str,
    pub dest: PathBuf,
    /// Exactly this checkpoint (no fallback to older ones).
    pub checkpoint: Option<&'a str>,
    pub pack_cache: Option<PackCacheConfig>,
    pub verify_existing: bool,
    /// A checkpoint older than this is restored with a warning (0: never).
    pub warn_older_than: std::time::Duration,
}

pub async fn run(
    coordinator: &CoordinatorClient,
    checkout: Checkout<'_>,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let Checkout {
        workspace,
        dest,
        checkpoint,
        pack_cache,
        verify_existing,
        warn_older_than,
    } = checkout;
    let checkpoint = checkpoint
        .map(str::parse::<CheckpointId>)
        .transpose()
        .context("--checkpoint")?;
    let opts = RestoreOptions {
        checkpoint,
        pack_cache,
        verify_existing,
        ..RestoreOptions::new(&dest, workspace)
    };
    let bar = Bar(progress::bar(out, TEMPLATE));
    let result = restore::restore(coordinator, &opts, &bar).await;
    bar.0.finish_and_clear();
    let report = result?;
    if let Some(warning) = cairn_runner::report::staleness_warning(
        &report,
        warn_older_than,
        std::time::SystemTime::now(),
    ) {
        eprintln!("{warning}");
    }
    match out {
        Output::Json | Output::Yaml => print_document(out, &report.to_json())?,
        Output::Table | Output::Wide => {
            emit(&cairn_runner::report::restore_summary(&report, &dest))?
        }
    }
    Ok(ExitCode::SUCCESS)
}
