//! cairn's wire contract.
//!
//! - [`pb`]: the code generated from `proto/cairn/v1/*.proto` (package
//!   `cairn.v1`), clients and servers for every service. Nothing in it is
//!   written by hand.
//! - [`ids`] and [`domain`]: hand-written types that the rest of the system
//!   works with. Every id is a newtype; messages received over the wire are
//!   validated into domain types with `TryFrom`, so a malformed request is
//!   refused at the edge with a [`ValidationError`] naming the field.
//! - [`stations`]: the files a run lays for its station and the handoff
//!   note it leaves, validated on receipt.
//! - [`auth`]: how a bearer token travels in gRPC metadata.

pub mod auth;
pub mod domain;
pub mod ids;
pub mod runs;
pub mod stations;

pub use domain::ValidationError;

/// Generated protobuf and gRPC code for `cairn.v1`.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("cairn.v1");
}

/// Encoded `FileDescriptorSet` of `cairn.v1`, served by gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("cairn_descriptor");
