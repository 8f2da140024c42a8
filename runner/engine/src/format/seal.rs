//! Sealing one blob: optional zstd, then AES-256-GCM under a per-blob key.
//!
//! ```text
//! flags(1) │ nonce(12) │ ciphertext │ tag(16)      aad = blob id(32) │ flags
//! flags: bit 0 = zstd-compressed; other bits must be zero
//! ```

use cairn_proto::ids::BlobId;
use rand::RngCore;
use ring::aead;

use super::{FormatError, MAX_BLOB_LEN, TenantKeys};

const FLAG_ZSTD: u8 = 0b1;
const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;
/// Bytes a sealed blob adds to its (possibly compressed) plaintext.
pub const SEAL_OVERHEAD: usize = 1 + NONCE_LEN + TAG_LEN;

const ZSTD_LEVEL: i32 = 3;
/// Probe this much of a large blob first; skip compression if it does not shrink.
const PROBE_LEN: usize = 64 << 10;

fn worth_compressing(plaintext: &[u8]) -> bool {
    if plaintext.len() < 64 {
        return false;
    }
    if plaintext.len() <= 2 * PROBE_LEN {
        return true;
    }
    match zstd::bulk::compress(&plaintext[..PROBE_LEN], 1) {
        Ok(probe) => probe.len() < PROBE_LEN * 15 / 16,
        Err(_) => false,
    }
}

/// Seals `plaintext` (whose id is `id`) and appends the sealed bytes to `out`.
pub fn seal(keys: &TenantKeys, id: &BlobId, plaintext: &[u8], out: &mut Vec<u8>) {
    let compressed = if worth_compressing(plaintext) {
        zstd::bulk::compress(plaintext, ZSTD_LEVEL)
            .ok()
            .filter(|c| c.len() + 16 < plaintext.len())
    } else {
        None
    };
    let (flags, body): (u8, &[u8]) = match &compressed {
        Some(c) => (FLAG_ZSTD, c),
        None => (0, plaintext),
    };
    let mut nonce = [0u8; NONCE_LEN];
    rand::rng().fill_bytes(&mut nonce);

    let start = out.len();
    out.reserve(SEAL_OVERHEAD + body.len());
    out.push(flags);
    out.extend_from_slice(&nonce);
    let body_start = out.len();
    out.extend_from_slice(body);
    let tag = keys
        .blob_key(id)
        .seal_in_place_separate_tag(
            aead::Nonce::assume_unique_for_key(nonce),
            aead::Aad::from(aad(id, flags)),
            &mut out[body_start..],
        )
        .expect("AES-GCM sealing cannot fail for blobs under 64 GiB");
    out.extend_from_slice(tag.as_ref());
    debug_assert_eq!(out.len() - start, SEAL_OVERHEAD + body.len());
}

fn aad(id: &BlobId, flags: u8) -> [u8; 33] {
    let mut aad = [0u8; 33];
    aad[..32].copy_from_slice(id.as_bytes());
    aad[32] = flags;
    aad
}

/// Opens a sealed blob, checking its tag and that its plaintext has id `id`.
/// `plain_len` is the plaintext length the caller expects (from the tree or
/// the pack index); anything else is refused before it is allocated.
pub fn open(
    keys: &TenantKeys,
    id: &BlobId,
    sealed: &[u8],
    plain_len: usize,
) -> Result<Vec<u8>, FormatError> {
    Opener::with(|opener| opener.open(keys, id, sealed, plain_len).map(<[u8]>::to_vec))
}

/// Opens blobs one after another with one zstd context and two buffers, so
/// that a restore writing tens of thousands of blobs neither sets up a
/// decompressor nor allocates (and faults in) fresh memory per blob.
pub struct Opener {
    decompressor: zstd::bulk::Decompressor<'static>,
    /// The sealed body, opened in place.
    body: Vec<u8>,
    /// Decompressed plaintext.
    plain: Vec<u8>,
}

impl std::fmt::Debug for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opener")
            .field("body_capacity", &self.body.capacity())
            .finish_non_exhaustive()
    }
}

thread_local! {
    static OPENER: std::cell::RefCell<Option<Opener>> = const { std::cell::RefCell::new(None) };
}

/// Buffers grown past this are given back after use, so that one large blob
/// does not pin its size on every thread that ever opened one.
const KEPT_CAPACITY: usize = 4 << 20;

/// Gives back a per-thread buffer that one large blob grew past
/// [`KEPT_CAPACITY`]; smaller ones are kept for the next use.
pub fn shrink_scratch(buffer: &mut Vec<u8>) {
    if buffer.capacity() > KEPT_CAPACITY {
        *buffer = Vec::new();
    }
}

impl Opener {
    /// Runs `f` with this thread's opener.
    pub fn with<T>(f: impl FnOnce(&mut Opener) -> T) -> T {
        OPENER.with(|cell| {
            let mut slot = cell.borrow_mut();
            let opener = slot.get_or_insert_with(|| Opener {
                decompressor: zstd::bulk::Decompressor::new()
                    .expect("a zstd decompression context can always be made"),
                body: Vec::new(),
                plain: Vec::new(),
            });
            let out = f(opener);
            shrink_scratch(&mut opener.body);
            shrink_scratch(&mut opener.plain);
            out
        })
    }

    /// [`open`], into this opener's buffers: the plaintext is valid until the
    /// next call.
    pub fn open(
        &mut self,
        keys: &TenantKeys,
        id: &BlobId,
        sealed: &[u8],
        plain_len: usize,
    ) -> Result<&[u8], FormatError> {
        let malformed = |reason: String| FormatError::MalformedBlob { id: *id, reason };
        if plain_len > MAX_BLOB_LEN {
            return Err(malformed(format!(
                "declared length {plain_len} exceeds {MAX_BLOB_LEN}"
            )));
        }
        if sealed.len() < SEAL_OVERHEAD {
            return Err(malformed(format!(
                "{} bytes is shorter than a seal",
                sealed.len()
            )));
        }
        let flags = sealed[0];
        if flags & !FLAG_ZSTD != 0 {
            return Err(malformed(format!("unknown flags {flags:#04x}")));
        }
        let nonce: [u8; NONCE_LEN] = sealed[1..1 + NONCE_LEN].try_into().expect("length checked");
        self.body.clear();
        self.body.extend_from_slice(&sealed[1 + NONCE_LEN..]);
        let opened_len = keys
            .blob_key(id)
            .open_in_place(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(aad(id, flags)),
                &mut self.body,
            )
            .map_err(|_| FormatError::Unauthentic { id: *id })?
            .len();
        let plaintext: &[u8] = if flags & FLAG_ZSTD != 0 {
            self.plain.clear();
            self.plain.reserve(plain_len);
            // The buffer's room is bounded by declared lengths (at most
            // MAX_BLOB_LEN): a frame that would decompress to more fails
            // instead of growing it.
            self.decompressor
                .decompress_to_buffer(&self.body[..opened_len], &mut self.plain)
                .map_err(|e| malformed(format!("zstd: {e}")))?;
            &self.plain
        } else {
            &self.body[..opened_len]
        };
        if plaintext.len() != plain_len {
            return Err(malformed(format!(
                "holds {} bytes, expected {plain_len}",
                plaintext.len()
            )));
        }
        if !keys.verify_blob_id(id, plaintext) {
            return Err(FormatError::DigestMismatch { id: *id });
        }
        Ok(plaintext)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> TenantKeys {
        TenantKeys::derive("k1", &[7; 32]).unwrap()
    }

    #[test]
    fn sealed_blobs_open_to_their_plaintext_compressible_or_not() {
        let keys = keys();
        let text = b"fn main() { println!(\"hello\"); }\n".repeat(500);
        let mut random = vec![0u8; 300_000];
        rand::rng().fill_bytes(&mut random);
        for plaintext in [&text[..], &random[..], b"", b"x"] {
            let id = keys.blob_id(plaintext);
            let mut sealed = Vec::new();
            seal(&keys, &id, plaintext, &mut sealed);
            assert_eq!(
                open(&keys, &id, &sealed, plaintext.len()).unwrap(),
                plaintext
            );
        }
        let id = keys.blob_id(&text);
        let mut sealed = Vec::new();
        seal(&keys, &id, &text, &mut sealed);
        assert!(sealed.len() < text.len() / 4, "text should compress");
    }

    #[test]
    fn a_flipped_byte_anywhere_is_detected() {
        let keys = keys();
        let plaintext = b"some file content".repeat(10);
        let id = keys.blob_id(&plaintext);
        let mut sealed = Vec::new();
        seal(&keys, &id, &plaintext, &mut sealed);
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x01;
            assert!(
                open(&keys, &id, &bad, plaintext.len()).is_err(),
                "flip at {i} went unnoticed"
            );
        }
    }

    #[test]
    fn a_blob_presented_under_another_id_is_refused() {
        let keys = keys();
        let id = keys.blob_id(b"a");
        let other = keys.blob_id(b"b");
        let mut sealed = Vec::new();
        seal(&keys, &id, b"a", &mut sealed);
        assert!(matches!(
            open(&keys, &other, &sealed, 1),
            Err(FormatError::Unauthentic { .. })
        ));
        let stranger = TenantKeys::derive("k2", &[8; 32]).unwrap();
        assert!(open(&stranger, &id, &sealed, 1).is_err());
    }

    #[test]
    fn a_wrong_declared_length_is_refused() {
        let keys = keys();
        let plaintext = vec![b'a'; 10_000];
        let id = keys.blob_id(&plaintext);
        let mut sealed = Vec::new();
        seal(&keys, &id, &plaintext, &mut sealed);
        assert!(open(&keys, &id, &sealed, 100).is_err());
        assert!(open(&keys, &id, &sealed, MAX_BLOB_LEN + 1).is_err());
    }
}
