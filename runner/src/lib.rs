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

pub mod cache;
pub mod checkpoint;
pub mod cli;
pub mod client;
pub mod failpoint;
pub mod format;
pub mod restore;
pub mod transfer;
