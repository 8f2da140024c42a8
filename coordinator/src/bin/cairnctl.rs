//! `cairnctl`: parse the command line, set up logging, run (see `ctl`).

#[path = "../ctl/mod.rs"]
mod ctl;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = ctl::Cli::parse();
    ctl::init_logging(cli.log_format);
    ctl::run_to_exit(cli)
}
