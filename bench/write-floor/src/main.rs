//! `cairn-write-floor`: writes a copy of a tree from memory and reports how
//! long the writing took, for `bench/run.py`'s write-floor row.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

/// Read every entry of FROM into memory, then create the same tree at TO
/// (directories, files with their modes and mtimes, symlinks) with
/// --threads writers, and print the write's wall time as JSON. Only the
/// writing is timed: no download, decompression or checks, so the figure is
/// what any restore of that tree pays this filesystem at least.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The tree to copy.
    #[arg(long)]
    from: PathBuf,
    /// Where to create the copy; must not exist.
    #[arg(long)]
    to: PathBuf,
    /// Writer threads (default: the available cores).
    #[arg(long)]
    threads: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let tree = cairn_write_floor::Tree::load(&args.from)
        .with_context(|| format!("reading {}", args.from.display()))?;
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get)
    });
    let written = tree
        .write(&args.to, threads)
        .with_context(|| format!("writing {}", args.to.display()))?;
    println!(
        "{}",
        serde_json::json!({
            "seconds": written.as_secs_f64(),
            "files": tree.files(),
            "bytes": tree.bytes(),
            "threads": threads,
        })
    );
    Ok(())
}
