//! cairn's execution side.
//!
//! The runner lives in every sandbox image. It owns all checkpoint bytes: it
//! cuts content-addressed checkpoints of the workspace, seals them and
//! uploads them straight to the object store through URLs the coordinator
//! signed, and restores them, verified, on any host.
//!
//! Code map:
//! - [`format`]: the versioned checkpoint format (trees, sealed blobs, packs).
//! - [`transfer`]: HTTP transfers through signed URLs, with retries.
//! - [`client`]: the gRPC connection to the coordinator.
//! - [`tls`]: the CA clients trust (`CAIRN_CA`) and hosts' client certificates.
//! - [`restore`]: restoring a checkpoint, verified, with fallback to older
//!   ones; also the pack-reading and tree-walking pieces `cairnctl` reuses.
//! - [`scan`]: the parallel walk of a workspace (metadata only, ignore rules).
//! - [`tracker`]: inotify change tracking, so a walk lists only what changed.
//! - [`chunker`]: cutting file content into chunks (whole or FastCDC).
//! - [`gitobj`]: git loose blobs stored by their content (they dedupe with
//!   the working-tree files they copy).
//! - [`git`]: per-repository git metadata recorded with each checkpoint.
//! - [`checkpoint`]: cutting, sealing, uploading and committing a checkpoint.
//! - [`watch`]: `cairn-runner watch`, a resident checkpointer (interval
//!   checkpoints when changed, and `cairn-runner checkpoint` through its socket).
//! - [`socket`]: the control socket through which `cairn-runner checkpoint`
//!   asks a resident runner (`watch`, or `run` in a sandbox) for a checkpoint.
//! - [`host`]: the host agent `cairn-host` (sandboxes, drivers, heartbeats).
//! - [`run`]: `cairn-runner run`, one attempt of a run inside its sandbox:
//!   restore, harness turns, checkpoints, reports.
//! - [`harness`]: the agent CLIs a run drives (Claude Code, command templates).
//! - [`demo_agent`]: `cairn-demo-agent`, a model-free stand-in for Claude Code.

pub mod cache;
pub mod checkpoint;
pub mod chunker;
pub mod cli;
pub mod client;
pub mod demo_agent;
pub mod failpoint;
pub mod format;
pub mod git;
pub mod gitobj;
pub mod harness;
pub mod host;
pub mod restore;
pub mod run;
pub mod scan;
pub mod socket;
pub mod tls;
pub mod tracker;
pub mod transfer;
pub mod watch;
