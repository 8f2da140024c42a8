//! `cairn-host`: see [`cairn_host::cli`].

fn main() -> std::process::ExitCode {
    cairn_host::cli::main()
}
