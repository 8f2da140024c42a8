//! `cairn-runner`, the runner inside every sandbox.
//!
//! It drives one attempt of a run: restores the workspace, starts the agent
//! CLI (the harness) turn by turn, checkpoints after every turn and on
//! signals, and reports to the coordinator. The checkpoint bytes are the
//! engine's business ([`cairn_engine`]); this crate decides when.
//!
//! Code map:
//! - [`cli`]: the command line (flags → options, output for people), and
//!   nothing else; every command is a call into a module below.
//! - [`run`]: `cairn-runner run`, one attempt inside its sandbox: restore,
//!   harness turns, checkpoints, reports.
//! - [`harness`]: the agent CLIs a run drives (Claude Code, Codex, Gemini,
//!   opencode, pi, aider, OpenHands, goose, command templates).
//! - [`watch`]: `cairn-runner watch`, a resident checkpointer.
//! - [`socket`]: the control socket through which `cairn-runner checkpoint`
//!   asks a resident runner (`watch`, or `run`) for a checkpoint.
//! - [`report`]: checkpoint and restore reports in words.

pub mod cli;
pub mod harness;
pub mod report;
pub mod run;
pub mod socket;
pub mod watch;
