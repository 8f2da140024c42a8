//! `cairnctl`: parse the command line, set up logging, run (see `ctl`).

#[path = "../ctl/mod.rs"]
mod ctl;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = ctl::Cli::parse();
    // The demo logs to a file in its own directory; the terminal shows its timeline.
    if !matches!(cli.command, ctl::Command::Demo(_)) {
        ctl::init_logging(cli.log_format);
    }
    ctl::run_to_exit(cli)
}
