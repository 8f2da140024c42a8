//! `cairn-demo-agent`: see [`cairn_demo_agent`].

fn main() -> std::process::ExitCode {
    cairn_demo_agent::main()
}
