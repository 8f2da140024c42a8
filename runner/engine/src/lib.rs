//! cairn's checkpoint engine: everything about a workspace's bytes, and
//! nothing about runs, harnesses or command lines.
//!
//! The programs call it: `cairn-runner` cuts and restores checkpoints inside
//! a sandbox, `cairn-host` restores trees it keeps and shares a pack cache,
//! `cairnctl` checks out and verifies checkpoints. The engine owns all
//! checkpoint bytes: it cuts content-addressed checkpoints of a workspace,
//! seals them, uploads them straight to the object store through URLs the
//! coordinator signed, and restores them, verified.
//!
//! The public API, in the order a checkpoint flows:
//! - [`checkpoint`]: [`checkpoint::checkpoint`] and
//!   [`checkpoint::checkpoint_if_changed`] cut one ([`checkpoint::CheckpointOptions`]
//!   says what and where; a [`checkpoint::Resident`] remembers what a
//!   long-lived runner learned between checkpoints).
//! - [`restore`]: [`restore::restore`] restores the newest restorable
//!   checkpoint (or a chosen one), with fallback to older ones; the pack
//!   reading and tree walking that `cairnctl verify` reuses.
//! - [`compact`]: rewriting data packs that are mostly dead, where the
//!   key is ([`compact::compact`]).
//! - [`client`]: the gRPC connection to the coordinator
//!   ([`client::CoordinatorClient`]).
//! - [`host_reports`]: what a runner tells its host about its restores and
//!   checkpoints (for the host's metrics), and how the host reads it.
//!
//! Underneath, each module depending only on those above it in this list:
//! - [`format`]: the versioned checkpoint format (trees, sealed blobs, packs).
//! - [`chunker`]: cutting file content into chunks (whole or FastCDC).
//! - [`gitobj`]: git loose blobs stored by their content.
//! - [`cache`]: the fingerprint cache (which file content is already stored).
//! - [`libgit2`]: process-wide libgit2 settings.
//! - [`scan`]: the parallel walk of a workspace (metadata only, ignore rules).
//! - [`tracker`]: inotify change tracking, so a walk lists only what changed.
//! - [`git`]: per-repository git metadata recorded with each checkpoint, and
//!   the git command line as cairn runs it.
//! - [`transfer`]: HTTP transfers through signed URLs, with retries.
//! - [`tls`]: the CA clients trust (`CAIRN_CA`) and hosts' client certificates.
//! - [`task`]: running blocking work off the async runtime.

pub mod cache;
pub mod checkpoint;
pub mod chunker;
pub mod client;
pub mod compact;
pub mod format;
pub mod git;
pub mod gitobj;
pub mod host_reports;
pub mod libgit2;
pub mod restore;
pub mod scan;
pub mod task;
pub mod tls;
pub mod tracker;
pub mod transfer;
