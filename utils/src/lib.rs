//! What cairn's programs share that is not about checkpoints.
//!
//! - [`text`]: words for people (`3 files`, `5m ago`, an error chain on one line).
//! - [`failpoint`]: named places where tests make a process fail or wait.
//! - [`process`]: process groups and `/proc/<pid>/stat`, for the host agent
//!   that supervises sandboxes and the runner that supervises a harness.
//! - [`logging`] (feature `cli`): the `--log-format` flag and the tracing
//!   setup every binary starts with; [`program`] (feature `cli`): the
//!   runtime and error printing every binary's `main` goes through.
//! - [`testing`] (feature `testing`): finding another package's binary
//!   from a test; a real S3-compatible server (`s3s-fs`) for tests of
//!   remote object stores.
//!
//! Nothing here knows of workspaces, runs or the coordinator.

pub mod failpoint;
#[cfg(feature = "cli")]
pub mod logging;
pub mod process;
#[cfg(feature = "cli")]
pub mod program;
#[cfg(feature = "testing")]
pub mod testing;
pub mod text;
