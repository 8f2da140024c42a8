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
    /// Writer threads. The default is what a restore writes with (its
    /// parallel reads): on a 2-core machine 8 writers finish ~13% sooner
    /// than 2, as some wait on directory locks while others run.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    threads: u16,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let tree = cairn_write_floor::Tree::load(&args.from)
        .with_context(|| format!("reading {}", args.from.display()))?;
    let written = tree
        .write(&args.to, usize::from(args.threads))
        .with_context(|| format!("writing {}", args.to.display()))?;
    println!(
        "{}",
        serde_json::json!({
            "seconds": written.as_secs_f64(),
            "files": tree.files(),
            "bytes": tree.bytes(),
            "threads": args.threads,
        })
    );
    Ok(())
}
