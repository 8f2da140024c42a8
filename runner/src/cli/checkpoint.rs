//! `cairn-runner checkpoint`: asks the resident runner of the workspace
//! through its control socket when one answers, else cuts the checkpoint
//! here.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context as _;
use cairn_engine::checkpoint::{
    CheckpointError, checkpoint, checkpoint_if_changed, newest_checkpoint,
};
use cairn_engine::scan;
use cairn_proto::domain::CheckpointReason;
use cairn_utils::text::one_line;

use super::{CheckpointArgs, OutputFormat};
use crate::report::checkpoint_summary;
use crate::socket::{self, Request, Unchanged};

pub(super) async fn main(args: CheckpointArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let reason: CheckpointReason = args.reason.parse()?;
    if let Some((socket, named)) = socket_for(&args) {
        if ask_resident(&socket, &args).await? {
            return Ok(());
        }
        anyhow::ensure!(!named, "no resident runner answers at {}", socket.display());
        tracing::debug!(socket = %socket.display(), "a stale control socket; checkpointing here");
    }
    let output = args.output;
    let if_changed = args.if_changed;
    let opts = args.target.checkpoint_options(reason);
    let failed = |e: CheckpointError| anyhow::anyhow!(one_line(&e));
    let baseline = if if_changed {
        let newest = newest_checkpoint(&opts).await.map_err(failed)?;
        newest.map(|newest| newest.baseline)
    } else {
        None
    };
    let report = match &baseline {
        Some(baseline) => checkpoint_if_changed(opts, baseline).await,
        None => checkpoint(opts).await.map(Some),
    }
    .map_err(failed)?;
    let Some(report) = report else {
        let unchanged = Unchanged {
            unchanged_since: baseline.expect("only a baseline settles").checkpoint_id,
            duration_ms: started.elapsed().as_millis() as u64,
        };
        return print_unchanged(&unchanged, output);
    };
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string(&report)?),
        OutputFormat::Text => {
            println!("{}", checkpoint_summary(&report));
            for warning in &report.warnings {
                eprintln!("warning: {warning}");
            }
        }
    }
    Ok(())
}

/// The socket to ask, if any: the one named by `--socket`, else the default
/// one when a file is there. The flag says whether it was named.
fn socket_for(args: &CheckpointArgs) -> Option<(PathBuf, bool)> {
    if let Some(socket) = &args.socket {
        return Some((socket.clone(), true));
    }
    let root = scan::resolve_root(&args.target.root).ok()?;
    let socket = socket::default_socket(&args.target.cache_dir(), &root);
    socket.exists().then_some((socket, false))
}

/// Asks the runner at `socket` for the checkpoint and prints its answer as
/// a checkpoint cut here would be. `Ok(false)`: nobody answered there.
async fn ask_resident(socket: &Path, args: &CheckpointArgs) -> anyhow::Result<bool> {
    let request = Request {
        workspace: args.target.workspace.clone(),
        reason: args.reason.clone(),
        if_changed: args.if_changed,
    };
    let Some(response) = socket::ask(socket, &request).await? else {
        return Ok(false);
    };
    if let Some(error) = response.error {
        anyhow::bail!("{error}");
    }
    if let Some(unchanged) = response.unchanged {
        print_unchanged(&unchanged, args.output)?;
        return Ok(true);
    }
    let report = response
        .report
        .with_context(|| format!("the runner at {} sent no report", socket.display()))?;
    match args.output {
        OutputFormat::Json => println!("{report}"),
        OutputFormat::Text => {
            println!("{}", response.summary.unwrap_or_default());
            for warning in report["warnings"].as_array().into_iter().flatten() {
                eprintln!("warning: {}", warning.as_str().unwrap_or_default());
            }
        }
    }
    Ok(true)
}

/// Prints the answer of an `--if-changed` checkpoint that found nothing new.
fn print_unchanged(unchanged: &Unchanged, output: OutputFormat) -> anyhow::Result<()> {
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string(unchanged)?),
        OutputFormat::Text => println!("{}", unchanged.summary()),
    }
    Ok(())
}
