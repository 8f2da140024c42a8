//! `cairn-demo-agent`: see `cairn_runner::demo_agent`.

fn main() -> std::process::ExitCode {
    cairn_runner::demo_agent::main()
}
