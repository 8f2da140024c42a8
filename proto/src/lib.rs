//! cairn's wire contract.
//!
//! - [`pb`]: the code generated from `proto/cairn/v1/*.proto` (package
//!   `cairn.v1`), clients and servers for every service. Nothing in it is
//!   written by hand.
//! - [`ids`] and [`domain`]: hand-written types that the rest of the system
//!   works with. Every id is a newtype; messages received over the wire are
//!   validated into domain types with `TryFrom`, so a malformed request is
//!   refused at the edge with a [`ValidationError`] naming the field.
//! - [`size`]: byte sizes read from flags and written in messages.
//! - [`stations`]: the files a run lays for its station and the handoff
//!   note it leaves, validated on receipt.
//! - [`auth`]: how a bearer token travels in gRPC metadata.
//! - [`refusal`]: why the coordinator refused a call, typed, in the status
//!   details; callers decide on it, never on the message.
//! - [`tls`]: PEM certificates, keys and CA bundles for TLS, from a file or
//!   inline.

/// An enum of words: `ALL`, `as_str`, `Display`, and `FromStr` refusing any
/// other word with a [`ValidationError`] of field `$field`. The caller gives
/// the derives.
macro_rules! word_enum {
    ($(#[$meta:meta])* $name:ident, $field:literal, { $($variant:ident => $word:literal),+ $(,)? }) => {
        $(#[$meta])*
        pub enum $name {
            $($variant),+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$(Self::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $word),+
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::ValidationError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::ALL.iter().copied().find(|v| v.as_str() == s).ok_or_else(|| {
                    let words: Vec<&str> = Self::ALL.iter().map(|v| v.as_str()).collect();
                    $crate::ValidationError::new(
                        $field,
                        format!("{s:?} is not one of {}", words.join(", ")),
                    )
                })
            }
        }
    };
}

pub mod auth;
pub mod domain;
pub mod ids;
pub mod refusal;
pub mod runs;
pub mod size;
pub mod stations;
pub mod tls;

pub use domain::ValidationError;

/// Generated protobuf and gRPC code for `cairn.v1`.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("cairn.v1");

    /// The standard rich-error envelope, `google.rpc.Status`.
    pub mod google_rpc {
        tonic::include_proto!("google.rpc");
    }
}

/// Encoded `FileDescriptorSet` of `cairn.v1`, served by gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("cairn_descriptor");
