//! `cairnctl`: parse the command line, set up logging, run (see [`cairnctl`]).

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = cairnctl::Cli::parse();
    // The demo logs to a file in its own directory; the terminal shows its timeline.
    if !matches!(cli.command, cairnctl::Command::Demo(_)) {
        // Warnings only: stdout is the answer, stderr stays quiet.
        cairn_utils::logging::init(cli.log_format, "warn");
    }
    cairnctl::run_to_exit(cli)
}
