//! The checkpoint format, version [`FORMAT_VERSION`].
//!
//! The format is versioned apart from the binaries: a runner reads every
//! format version up to its own and refuses newer ones by name. The full
//! description, with byte layouts, is in `docs/format.md`; this is the map.
//!
//! ```text
//!  checkpoint record (coordinator)      object store (tenant scope)
//!  ───────────────────────────────      ──────────────────────────────────────────
//!  root_tree: BlobId ─────────────┐     packs/<sha256 of pack bytes>
//!  referenced_packs: [PackId…]    │     ┌─────────────────────────────────────┐
//!  key_id, generation, reason     │     │ header  "CAIRNPK\0" ver kind  (16B) │
//!                                 │     │ sealed blob │ sealed blob │ …       │
//!                                 │     │ sealed index (blob id → range)      │
//!                                 │     │ trailer index_off index_len "CAIRNEND"
//!                                 │     └─────────────────────────────────────┘
//!                                 ▼
//!   tree (one per directory, in a META pack)
//!   ┌──────────────────────────────────────────────────────────────┐
//!   │ "CTRE" v1 │ entries sorted by name, unique:                  │
//!   │   name │ kind │ mode │ mtime │ uid │ gid │ body              │
//!   │     file:    size, [(chunk BlobId, len)…] ──► DATA pack blobs│
//!   │     dir:     subtree BlobId ──► another tree                 │
//!   │     symlink: target bytes                                    │
//!   └──────────────────────────────────────────────────────────────┘
//!
//!   blob id  = HMAC-SHA256(id_key, plaintext)           (keyed: the store
//!                                                         cannot confirm content)
//!   sealed   = flags │ nonce(12) │ AES-256-GCM(k_blob, zstd?(plaintext)) │ tag(16)
//!   k_blob   = HMAC-SHA256(seal_key, "blob" │ blob id)   aad = blob id │ flags
//!   id_key, seal_key = HKDF-SHA256(tenant secret, salt "cairn-format-v1")
//! ```
//!
//! Invariants:
//! - Identical plaintext has one blob id per key lineage (a workspace and
//!   its forks), so it is stored once across their checkpoints.
//! - Every byte read back is authenticated twice: the AEAD tag (bound to the
//!   blob id) and the recomputed keyed id of the plaintext.
//! - Nothing in the store is readable or confirmable without the lineage key;
//!   the coordinator records ids, sizes and pack names, never plaintext.

mod keys;
mod pack;
mod seal;
mod tree;
mod varint;

/// The format's varint encoding, for other versioned files of the runner.
pub(crate) mod varint_pub {
    pub(crate) use super::varint::{Reader, put_bytes, put_i64, put_u64};
}

pub use keys::TenantKeys;
pub use pack::{
    FinishedPack, IndexEntry, PACK_HEADER_LEN, PACK_TRAILER_LEN, PackBuilder, PackIndex,
    parse_pack_header, parse_trailer,
};
pub use seal::{Opener, SEAL_OVERHEAD, open, seal, shrink_scratch};
pub use tree::{
    ChunkRef, EncodedTree, Entry, EntryKind, PAGED_ABOVE, Tree, TreeObject, decode_part,
};

/// Version of the checkpoint format written by this build.
pub const FORMAT_VERSION: u32 = 5;

/// Largest plaintext a single blob may hold (a chunk or a tree object).
pub const MAX_BLOB_LEN: usize = 64 << 20;

/// Largest chunk of file content the format allows (the chunker stays far below).
pub const MAX_CHUNK_LEN: u32 = 8 << 20;

/// Why bytes could not be read as the checkpoint format.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("tenant key must be 32 bytes, got {0}")]
    BadKeyLength(usize),
    #[error("blob {id:?} failed authentication (corrupt, truncated or sealed with another key)")]
    Unauthentic { id: cairn_proto::ids::BlobId },
    #[error("blob {id:?} decrypted but its content does not match its id")]
    DigestMismatch { id: cairn_proto::ids::BlobId },
    #[error("blob {id:?} is malformed: {reason}")]
    MalformedBlob {
        id: cairn_proto::ids::BlobId,
        reason: String,
    },
    #[error("tree object is malformed: {0}")]
    MalformedTree(String),
    #[error("pack {pack} is malformed: {reason}")]
    MalformedPack { pack: String, reason: String },
    #[error("format version {found} is newer than this runner understands ({supported})")]
    UnsupportedVersion { found: u32, supported: u32 },
}
