//! In-process tests of the coordinator: a real server on ephemeral ports,
//! driven with tonic clients and HTTP like runners and cairnctl drive it.

mod blob_urls;
mod checkpoints;
mod harness;
mod restart;
mod tokens;
mod workspaces;
