//! A store wrapper that fails on demand, for tests of the failure paths.
//!
//! A test keeps an `Arc<Faults>` and arms it while the server runs: fail the
//! next N calls of an operation with a retryable error, or pretend objects
//! are missing. Everything not armed passes through to the wrapped store.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use super::{
    ObjectKey, ObjectMeta, ObjectStore, ObjectStoreError, PresignedUrl, StoreFuture, StoreOp,
};
use crate::tokens::RunBinding;

#[derive(Debug, Default)]
struct FaultState {
    failures: HashMap<StoreOp, u32>,
    hidden: HashSet<ObjectKey>,
    calls: HashMap<StoreOp, u64>,
}

/// The faults armed for a [`FaultyStore`], shared with the test that arms them.
#[derive(Debug, Default)]
pub struct Faults {
    state: Mutex<FaultState>,
}

impl Faults {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FaultState> {
        // A panic elsewhere while holding the lock leaves plain counters behind.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The next `times` calls of `op` fail with a retryable error.
    pub fn fail_next(&self, op: StoreOp, times: u32) {
        *self.state().failures.entry(op).or_default() += times;
    }

    /// `key` looks missing: stat answers `None` and list leaves it out.
    pub fn hide(&self, key: &ObjectKey) {
        self.state().hidden.insert(key.clone());
    }

    /// Undoes [`Faults::hide`].
    pub fn reveal(&self, key: &ObjectKey) {
        self.state().hidden.remove(key);
    }

    /// Disarms every fault.
    pub fn clear(&self) {
        let mut state = self.state();
        state.failures.clear();
        state.hidden.clear();
    }

    /// How many times `op` was called (failed calls included).
    pub fn calls(&self, op: StoreOp) -> u64 {
        self.state().calls.get(&op).copied().unwrap_or(0)
    }

    /// Counts a call and says whether it must fail.
    fn enter(&self, op: StoreOp, key: &str) -> Result<(), ObjectStoreError> {
        let mut state = self.state();
        *state.calls.entry(op).or_default() += 1;
        match state.failures.get_mut(&op) {
            Some(left) if *left > 0 => {
                *left -= 1;
                Err(ObjectStoreError::Unavailable {
                    op,
                    key: key.to_owned(),
                    reason: "injected fault".into(),
                })
            }
            _ => Ok(()),
        }
    }

    fn is_hidden(&self, key: &ObjectKey) -> bool {
        self.state().hidden.contains(key)
    }
}

/// Wraps a store and applies the armed [`Faults`].
#[derive(Debug)]
pub struct FaultyStore<S> {
    inner: S,
    faults: Arc<Faults>,
}

impl<S: ObjectStore> FaultyStore<S> {
    pub fn new(inner: S, faults: Arc<Faults>) -> Self {
        Self { inner, faults }
    }

    pub fn faults(&self) -> &Arc<Faults> {
        &self.faults
    }
}

impl<S: ObjectStore> ObjectStore for FaultyStore<S> {
    fn stat<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, Option<u64>> {
        Box::pin(async move {
            self.faults.enter(StoreOp::Stat, key.as_str())?;
            if self.faults.is_hidden(key) {
                return Ok(None);
            }
            self.inner.stat(key).await
        })
    }

    fn delete<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.faults.enter(StoreOp::Delete, key.as_str())?;
            self.inner.delete(key).await
        })
    }

    fn list<'a>(&'a self, prefix: &'a str) -> StoreFuture<'a, Vec<ObjectMeta>> {
        Box::pin(async move {
            self.faults.enter(StoreOp::List, prefix)?;
            let mut objects = self.inner.list(prefix).await?;
            objects.retain(|o| !self.faults.is_hidden(&o.key));
            Ok(objects)
        })
    }

    fn presign_put<'a>(
        &'a self,
        key: &'a ObjectKey,
        size: u64,
        sha256: [u8; 32],
        ttl: Duration,
        holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl> {
        Box::pin(async move {
            self.faults.enter(StoreOp::PresignPut, key.as_str())?;
            self.inner.presign_put(key, size, sha256, ttl, holder).await
        })
    }

    fn presign_get<'a>(
        &'a self,
        key: &'a ObjectKey,
        ttl: Duration,
        holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl> {
        Box::pin(async move {
            self.faults.enter(StoreOp::PresignGet, key.as_str())?;
            self.inner.presign_get(key, ttl, holder).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signing::UrlSigner;
    use crate::store::LocalStore;

    #[tokio::test]
    async fn armed_failures_are_used_up_then_calls_pass_through() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("packs")).unwrap();
        std::fs::write(dir.path().join("packs/a"), b"abc").unwrap();
        let faults = Faults::new();
        let store = FaultyStore::new(
            LocalStore::new(dir.path(), UrlSigner::new(&[0; 32]), "http://x"),
            faults.clone(),
        );
        let key = ObjectKey::new("packs/a").unwrap();
        faults.fail_next(StoreOp::Stat, 2);
        for _ in 0..2 {
            let err = store.stat(&key).await.unwrap_err();
            assert!(err.is_retryable(), "{err}");
        }
        assert_eq!(store.stat(&key).await.unwrap(), Some(3));
        assert_eq!(faults.calls(StoreOp::Stat), 3);
        // Other operations were never armed.
        assert_eq!(store.list("packs/").await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn hidden_objects_look_missing_until_revealed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("packs")).unwrap();
        std::fs::write(dir.path().join("packs/a"), b"abc").unwrap();
        let faults = Faults::new();
        let store = FaultyStore::new(
            LocalStore::new(dir.path(), UrlSigner::new(&[0; 32]), "http://x"),
            faults.clone(),
        );
        let key = ObjectKey::new("packs/a").unwrap();
        faults.hide(&key);
        assert_eq!(store.stat(&key).await.unwrap(), None);
        assert!(store.list("").await.unwrap().is_empty());
        faults.reveal(&key);
        assert_eq!(store.stat(&key).await.unwrap(), Some(3));
    }
}
