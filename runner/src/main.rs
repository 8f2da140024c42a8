//! `cairn-runner`: see [`cairn_runner::cli`].

fn main() -> std::process::ExitCode {
    cairn_runner::cli::main()
}
