//! Tenant key derivation: one secret gives the blob-id key and the seal key.

use cairn_proto::ids::BlobId;
use ring::{aead, hkdf, hmac};

use super::FormatError;

const HKDF_SALT: &[u8] = b"cairn-format-v1";

/// The keys a runner needs to cut and read checkpoints of one tenant.
pub struct TenantKeys {
    key_id: String,
    id_key: hmac::Key,
    seal_key: hmac::Key,
}

impl std::fmt::Debug for TenantKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantKeys")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

impl TenantKeys {
    /// Derives the keys from a tenant's 32-byte secret.
    pub fn derive(key_id: impl Into<String>, secret: &[u8]) -> Result<Self, FormatError> {
        if secret.len() != 32 {
            return Err(FormatError::BadKeyLength(secret.len()));
        }
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, HKDF_SALT).extract(secret);
        let expand = |info: &'static [u8]| -> hmac::Key {
            let infos = [info];
            prk.expand(&infos, hmac::HMAC_SHA256)
                .expect("HKDF output of one hash length is always valid")
                .into()
        };
        Ok(Self {
            key_id: key_id.into(),
            id_key: expand(b"blob-id"),
            seal_key: expand(b"seal"),
        })
    }

    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The keyed id of a plaintext.
    pub fn blob_id(&self, plaintext: &[u8]) -> BlobId {
        let tag = hmac::sign(&self.id_key, plaintext);
        BlobId(tag.as_ref().try_into().expect("HMAC-SHA256 is 32 bytes"))
    }

    /// Constant-time check that `plaintext` has id `id`.
    pub fn verify_blob_id(&self, id: &BlobId, plaintext: &[u8]) -> bool {
        hmac::verify(&self.id_key, plaintext, id.as_bytes()).is_ok()
    }

    /// The AEAD key of one blob. Keys are per blob so that a nonce is never
    /// reused under a key for different contents, even across builds whose
    /// compressors produce different bytes.
    pub(crate) fn blob_key(&self, id: &BlobId) -> aead::LessSafeKey {
        self.aead_key(&[b"blob".as_slice(), id.as_bytes()].concat())
    }

    /// The AEAD key of pack indexes.
    pub(crate) fn index_key(&self) -> aead::LessSafeKey {
        self.aead_key(b"pack-index")
    }

    fn aead_key(&self, context: &[u8]) -> aead::LessSafeKey {
        let tag = hmac::sign(&self.seal_key, context);
        let unbound = aead::UnboundKey::new(&aead::AES_256_GCM, tag.as_ref())
            .expect("32 bytes is an AES-256 key");
        aead::LessSafeKey::new(unbound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_depend_on_the_tenant_secret() {
        let a = TenantKeys::derive("a", &[1; 32]).unwrap();
        let b = TenantKeys::derive("b", &[2; 32]).unwrap();
        assert_eq!(a.blob_id(b"hello"), a.blob_id(b"hello"));
        assert_ne!(a.blob_id(b"hello"), b.blob_id(b"hello"));
        assert!(a.verify_blob_id(&a.blob_id(b"x"), b"x"));
        assert!(!a.verify_blob_id(&a.blob_id(b"x"), b"y"));
        assert!(matches!(
            TenantKeys::derive("c", &[0; 16]),
            Err(FormatError::BadKeyLength(16))
        ));
    }
}
