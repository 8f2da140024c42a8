//! `cairn-host`: see `cairn_runner::host`.

fn main() -> std::process::ExitCode {
    cairn_runner::host::cli::main()
}
