//! Packs: many sealed blobs in one store object, with a sealed index.
//!
//! ```text
//! offset 0        "CAIRNPK\0" │ version u8 │ kind u8 (1 meta, 2 data) │ 6 zero bytes
//! 16              sealed blob │ sealed blob │ …
//! index_offset    nonce(12) │ AES-256-GCM(index key, index) │ tag(16)
//!                   aad = "cairn-pack-index-v1" │ kind
//!                   index = "CIDX" │ version u8 │ count varint
//!                           │ (blob id[32] │ offset varint │ sealed_len varint │ plain_len varint)*
//! size - 20       index_offset u64 LE │ index_length u32 LE │ "CAIRNEND"
//! ```
//! The pack's id is the SHA-256 of all its bytes; the store refuses an upload
//! whose bytes do not hash to the id it was signed for.

use std::io::{self, Write};

use cairn_proto::domain::PackKind;
use cairn_proto::ids::{BlobId, PackId};
use rand::RngCore;
use ring::aead;
use sha2::{Digest, Sha256};

use super::varint::{Reader, put_u64};
use super::{FORMAT_VERSION, FormatError, MAX_BLOB_LEN, SEAL_OVERHEAD, TenantKeys};

const MAGIC: &[u8; 8] = b"CAIRNPK\0";
const END_MAGIC: &[u8; 8] = b"CAIRNEND";
const INDEX_MAGIC: &[u8; 4] = b"CIDX";
const INDEX_AAD: &[u8] = b"cairn-pack-index-v1";
pub const PACK_HEADER_LEN: usize = 16;
pub const PACK_TRAILER_LEN: usize = 20;

fn kind_code(kind: PackKind) -> u8 {
    match kind {
        PackKind::Meta => 1,
        PackKind::Data => 2,
    }
}

/// Where one blob sits in a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    pub id: BlobId,
    pub offset: u64,
    pub sealed_len: u32,
    pub plain_len: u32,
}

/// The decrypted index of a pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackIndex {
    pub kind: PackKind,
    pub entries: Vec<IndexEntry>,
}

/// Writes a pack to `sink`, hashing as it goes.
pub struct PackBuilder<W: Write> {
    kind: PackKind,
    sink: W,
    hasher: Sha256,
    len: u64,
    entries: Vec<IndexEntry>,
}

impl<W: Write> std::fmt::Debug for PackBuilder<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackBuilder")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

/// A finished pack: its id, layout, and the sink it was written to.
#[derive(Debug)]
pub struct FinishedPack<W> {
    pub id: PackId,
    pub kind: PackKind,
    pub size: u64,
    pub index_offset: u64,
    pub index_length: u32,
    pub blob_ids: Vec<BlobId>,
    pub sink: W,
}

impl<W: Write> PackBuilder<W> {
    pub fn new(kind: PackKind, sink: W) -> io::Result<Self> {
        let mut builder = Self {
            kind,
            sink,
            hasher: Sha256::new(),
            len: 0,
            entries: Vec::new(),
        };
        let mut header = [0u8; PACK_HEADER_LEN];
        header[..8].copy_from_slice(MAGIC);
        header[8] = FORMAT_VERSION as u8;
        header[9] = kind_code(kind);
        builder.write(&header)?;
        Ok(builder)
    }

    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.sink.write_all(bytes)?;
        self.hasher.update(bytes);
        self.len += bytes.len() as u64;
        Ok(())
    }

    pub fn kind(&self) -> PackKind {
        self.kind
    }

    /// Appends one sealed blob.
    pub fn add(&mut self, id: BlobId, sealed: &[u8], plain_len: u32) -> io::Result<()> {
        let offset = self.len;
        self.write(sealed)?;
        self.entries.push(IndexEntry {
            id,
            offset,
            sealed_len: sealed.len() as u32,
            plain_len,
        });
        Ok(())
    }

    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn blob_count(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Writes the sealed index and trailer and returns the pack's identity.
    pub fn finish(mut self, keys: &TenantKeys) -> io::Result<FinishedPack<W>> {
        let mut index = Vec::with_capacity(8 + self.entries.len() * 44);
        index.extend_from_slice(INDEX_MAGIC);
        index.push(FORMAT_VERSION as u8);
        put_u64(&mut index, self.entries.len() as u64);
        for e in &self.entries {
            index.extend_from_slice(e.id.as_bytes());
            put_u64(&mut index, e.offset);
            put_u64(&mut index, u64::from(e.sealed_len));
            put_u64(&mut index, u64::from(e.plain_len));
        }
        let mut nonce = [0u8; 12];
        rand::rng().fill_bytes(&mut nonce);
        let tag = keys
            .index_key()
            .seal_in_place_separate_tag(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(index_aad(self.kind)),
                &mut index,
            )
            .expect("sealing an index cannot fail");
        let index_offset = self.len;
        self.write(&nonce)?;
        self.write(&index)?;
        self.write(tag.as_ref())?;
        let index_length = (self.len - index_offset) as u32;
        let mut trailer = [0u8; PACK_TRAILER_LEN];
        trailer[..8].copy_from_slice(&index_offset.to_le_bytes());
        trailer[8..12].copy_from_slice(&index_length.to_le_bytes());
        trailer[12..].copy_from_slice(END_MAGIC);
        self.write(&trailer)?;
        self.sink.flush()?;
        let digest: [u8; 32] = self.hasher.finalize().into();
        Ok(FinishedPack {
            id: PackId::from_digest(&digest),
            kind: self.kind,
            size: self.len,
            index_offset,
            index_length,
            blob_ids: self.entries.iter().map(|e| e.id).collect(),
            sink: self.sink,
        })
    }
}

fn index_aad(kind: PackKind) -> Vec<u8> {
    let mut aad = INDEX_AAD.to_vec();
    aad.push(kind_code(kind));
    aad
}

fn malformed(pack: &PackId, reason: impl Into<String>) -> FormatError {
    FormatError::MalformedPack {
        pack: pack.to_string(),
        reason: reason.into(),
    }
}

/// Checks a pack's first bytes and returns its kind.
pub fn parse_pack_header(pack: &PackId, header: &[u8]) -> Result<PackKind, FormatError> {
    if header.len() < PACK_HEADER_LEN || &header[..8] != MAGIC {
        return Err(malformed(pack, "bad header magic"));
    }
    let version = u32::from(header[8]);
    if version > FORMAT_VERSION {
        return Err(FormatError::UnsupportedVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    match header[9] {
        1 => Ok(PackKind::Meta),
        2 => Ok(PackKind::Data),
        other => Err(malformed(pack, format!("unknown pack kind {other}"))),
    }
}

/// Reads the trailer (the last [`PACK_TRAILER_LEN`] bytes) of a pack of `size` bytes.
pub fn parse_trailer(pack: &PackId, size: u64, tail: &[u8]) -> Result<(u64, u32), FormatError> {
    if tail.len() != PACK_TRAILER_LEN || &tail[12..] != END_MAGIC {
        return Err(malformed(pack, "bad trailer"));
    }
    let offset = u64::from_le_bytes(tail[..8].try_into().expect("8 bytes"));
    let length = u32::from_le_bytes(tail[8..12].try_into().expect("4 bytes"));
    let end = offset.checked_add(u64::from(length));
    if offset < PACK_HEADER_LEN as u64 || end != Some(size - PACK_TRAILER_LEN as u64) {
        return Err(malformed(pack, "index range does not fit the pack"));
    }
    Ok((offset, length))
}

impl PackIndex {
    /// Decrypts and checks a pack's sealed index. `index_offset` bounds every
    /// entry: blobs lie between the header and the index.
    pub fn open(
        keys: &TenantKeys,
        pack: &PackId,
        kind: PackKind,
        index_offset: u64,
        sealed: &[u8],
    ) -> Result<PackIndex, FormatError> {
        if sealed.len() < 12 + 16 {
            return Err(malformed(pack, "index is truncated"));
        }
        let nonce: [u8; 12] = sealed[..12].try_into().expect("12 bytes");
        let mut body = sealed[12..].to_vec();
        let plain = keys
            .index_key()
            .open_in_place(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(index_aad(kind)),
                &mut body,
            )
            .map_err(|_| malformed(pack, "index failed authentication"))?;
        let mut r = Reader::new(plain);
        let bad = |e: FormatError| malformed(pack, format!("index: {e}"));
        if r.take(4).map_err(bad)? != INDEX_MAGIC {
            return Err(malformed(pack, "index has bad magic"));
        }
        let version = u32::from(r.u8().map_err(bad)?);
        if version > FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let count = r.u64().map_err(bad)?;
        if count > plain.len() as u64 / 35 {
            return Err(malformed(pack, format!("index claims {count} entries")));
        }
        let mut entries = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let id = BlobId::from_slice(r.take(32).map_err(bad)?).expect("32 bytes");
            let offset = r.u64().map_err(bad)?;
            let sealed_len = r.u32().map_err(bad)?;
            let plain_len = r.u32().map_err(bad)?;
            let end = offset.checked_add(u64::from(sealed_len));
            if offset < PACK_HEADER_LEN as u64
                || end.is_none_or(|end| end > index_offset)
                || (sealed_len as usize) < SEAL_OVERHEAD
                || plain_len as usize > MAX_BLOB_LEN
            {
                return Err(malformed(
                    pack,
                    format!("index entry for {id:?} is out of bounds"),
                ));
            }
            entries.push(IndexEntry {
                id,
                offset,
                sealed_len,
                plain_len,
            });
        }
        if !r.is_empty() {
            return Err(malformed(pack, "index has trailing bytes"));
        }
        Ok(PackIndex { kind, entries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{open, seal};

    #[test]
    fn a_pack_reads_back_through_its_trailer_and_index() {
        let keys = TenantKeys::derive("k", &[9; 32]).unwrap();
        let mut builder = PackBuilder::new(PackKind::Data, Vec::new()).unwrap();
        let blobs: Vec<Vec<u8>> = (0..5)
            .map(|i| format!("blob number {i}").repeat(i + 1).into_bytes())
            .collect();
        for b in &blobs {
            let id = keys.blob_id(b);
            let mut sealed = Vec::new();
            seal(&keys, &id, b, &mut sealed);
            builder.add(id, &sealed, b.len() as u32).unwrap();
        }
        let pack = builder.finish(&keys).unwrap();
        let bytes = pack.sink;
        assert_eq!(bytes.len() as u64, pack.size);
        let digest: [u8; 32] = Sha256::digest(&bytes).into();
        assert_eq!(PackId::from_digest(&digest), pack.id);

        assert_eq!(parse_pack_header(&pack.id, &bytes).unwrap(), PackKind::Data);
        let (off, len) = parse_trailer(
            &pack.id,
            pack.size,
            &bytes[bytes.len() - PACK_TRAILER_LEN..],
        )
        .unwrap();
        assert_eq!((off, len), (pack.index_offset, pack.index_length));
        let index = PackIndex::open(
            &keys,
            &pack.id,
            PackKind::Data,
            off,
            &bytes[off as usize..(off + len as u64) as usize],
        )
        .unwrap();
        assert_eq!(index.entries.len(), blobs.len());
        for (e, b) in index.entries.iter().zip(&blobs) {
            let sealed = &bytes[e.offset as usize..(e.offset + u64::from(e.sealed_len)) as usize];
            assert_eq!(
                &open(&keys, &e.id, sealed, e.plain_len as usize).unwrap(),
                b
            );
        }
    }

    #[test]
    fn a_tampered_index_is_refused() {
        let keys = TenantKeys::derive("k", &[9; 32]).unwrap();
        let mut builder = PackBuilder::new(PackKind::Meta, Vec::new()).unwrap();
        builder.add(BlobId([1; 32]), &[0u8; 40], 3).unwrap();
        let pack = builder.finish(&keys).unwrap();
        let mut bytes = pack.sink;
        let at = pack.index_offset as usize + 20;
        bytes[at] ^= 0x80;
        let sealed = &bytes[pack.index_offset as usize..][..pack.index_length as usize];
        assert!(
            PackIndex::open(&keys, &pack.id, PackKind::Meta, pack.index_offset, sealed).is_err()
        );
        // Read as the wrong kind, the same index does not authenticate either.
        let good = PackBuilder::new(PackKind::Meta, Vec::new())
            .unwrap()
            .finish(&keys)
            .unwrap();
        let sealed = &good.sink[good.index_offset as usize..][..good.index_length as usize];
        assert!(
            PackIndex::open(&keys, &good.id, PackKind::Data, good.index_offset, sealed).is_err()
        );
    }
}
