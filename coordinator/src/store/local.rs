//! The embedded object store: files under `DIR/blobs`, one per object key.
//!
//! The bytes come and go through the embedded blob server
//! ([`crate::blob_http`]); this side only looks at the files and signs URLs
//! pointing at that server.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use super::{
    ObjectKey, ObjectMeta, ObjectStore, ObjectStoreError, PresignedUrl, StoreFuture, StoreOp,
};
use crate::signing::{Grant, UrlSigner, expiry_after};
use crate::tokens::RunBinding;

/// Objects as files under a root directory, readable and writable through
/// URLs signed for the embedded blob server at `base_url`.
#[derive(Debug, Clone)]
pub struct LocalStore {
    root: PathBuf,
    signer: UrlSigner,
    base_url: String,
}

impl LocalStore {
    /// `base_url` is where the blob server answers, e.g. `http://127.0.0.1:7401`.
    pub fn new(root: impl Into<PathBuf>, signer: UrlSigner, base_url: &str) -> Self {
        Self {
            root: root.into(),
            signer,
            base_url: base_url.trim_end_matches('/').to_owned(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file holding `key`.
    pub fn path_of(&self, key: &ObjectKey) -> PathBuf {
        object_path(&self.root, key)
    }

    fn presign(
        &self,
        key: &ObjectKey,
        grant: Grant,
        ttl: Duration,
        holder: Option<&RunBinding>,
    ) -> PresignedUrl {
        let expires = expiry_after(ttl);
        let query = self.signer.sign_query(key, &grant, expires, holder);
        PresignedUrl {
            url: format!("{}/o/{key}?{query}", self.base_url),
            method: match grant {
                Grant::Get => "GET",
                Grant::Put { .. } => "PUT",
            },
            expires_at: UNIX_EPOCH + Duration::from_secs(expires),
            headers: Vec::new(),
        }
    }
}

/// Name of the directory (under the blob root) that holds uploads in flight.
/// Object keys cannot start a segment with '.', so it is never addressable.
pub const TEMP_DIR: &str = ".tmp";

/// The file of `key` under the store's `root`.
pub(crate) fn object_path(root: &Path, key: &ObjectKey) -> PathBuf {
    // Keys are validated: relative, no dot segments, so this stays under root.
    root.join(key.as_str())
}

fn io_error(op: StoreOp, key: &str) -> impl FnOnce(std::io::Error) -> ObjectStoreError + '_ {
    move |source| ObjectStoreError::Io {
        op,
        key: key.to_owned(),
        source,
    }
}

/// Removes every upload temp file under the store's `root`
/// (`blobs/.tmp`), returning how many. Only for start-up, before the blob
/// server accepts uploads: any file there was left by a process that died.
pub fn sweep_uploads(root: &Path) -> std::io::Result<u64> {
    let dir = root.join(TEMP_DIR);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry?;
        // Only files are made there; anything else is not the store's.
        if !entry.file_type()?.is_file() {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

/// Walks `dir` (a directory under `root`) and collects the objects in it.
fn collect(
    root: &Path,
    dir: &Path,
    prefix: &str,
    out: &mut Vec<ObjectMeta>,
) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        if name.to_str().is_none_or(|n| n.starts_with('.')) {
            continue;
        }
        let path = entry.path();
        let file_type = entry.file_type()?;
        if file_type.is_dir() {
            collect(root, &path, prefix, out)?;
        } else if file_type.is_file() {
            let relative = path.strip_prefix(root).expect("walked below the root");
            let Some(key) = relative.to_str() else {
                continue;
            };
            if !key.starts_with(prefix) {
                continue;
            }
            // Files that are not valid keys were not put there by the store.
            if let Ok(key) = ObjectKey::new(key) {
                let meta = entry.metadata()?;
                out.push(ObjectMeta {
                    key,
                    size: meta.len(),
                    modified: meta.modified()?,
                });
            }
        }
    }
    Ok(())
}

impl ObjectStore for LocalStore {
    fn stat<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, Option<u64>> {
        Box::pin(async move {
            match tokio::fs::metadata(self.path_of(key)).await {
                Ok(meta) if meta.is_file() => Ok(Some(meta.len())),
                Ok(_) => Ok(None),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
                Err(e) => Err(io_error(StoreOp::Stat, key.as_str())(e)),
            }
        })
    }

    fn delete<'a>(&'a self, key: &'a ObjectKey) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            match tokio::fs::remove_file(self.path_of(key)).await {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
                Err(e) => Err(io_error(StoreOp::Delete, key.as_str())(e)),
            }
        })
    }

    fn list<'a>(&'a self, prefix: &'a str) -> StoreFuture<'a, Vec<ObjectMeta>> {
        Box::pin(async move {
            // Start the walk at the deepest directory the prefix names.
            let dir = match prefix.rfind('/') {
                Some(end) => {
                    let dir = &prefix[..end];
                    ObjectKey::new(dir)?;
                    self.root.join(dir)
                }
                None => self.root.clone(),
            };
            let root = self.root.clone();
            let owned_prefix = prefix.to_owned();
            let listed = tokio::task::spawn_blocking(move || {
                let mut out = Vec::new();
                collect(&root, &dir, &owned_prefix, &mut out).map(|()| out)
            })
            .await
            .map_err(|e| ObjectStoreError::Unavailable {
                op: StoreOp::List,
                key: prefix.to_owned(),
                reason: format!("listing task failed: {e}"),
            })?;
            let mut objects = listed.map_err(io_error(StoreOp::List, prefix))?;
            objects.sort_by(|a, b| a.key.cmp(&b.key));
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
        Box::pin(async move { Ok(self.presign(key, Grant::Put { size, sha256 }, ttl, holder)) })
    }

    fn presign_get<'a>(
        &'a self,
        key: &'a ObjectKey,
        ttl: Duration,
        holder: Option<&'a RunBinding>,
    ) -> StoreFuture<'a, PresignedUrl> {
        Box::pin(async move { Ok(self.presign(key, Grant::Get, ttl, holder)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(dir: &Path) -> LocalStore {
        LocalStore::new(dir, UrlSigner::new(&[3; 32]), "http://127.0.0.1:9/")
    }

    fn put_file(root: &Path, key: &str, bytes: &[u8]) {
        let path = root.join(key);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn the_sweep_removes_upload_temp_files_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(sweep_uploads(dir.path()).unwrap(), 0, "no temp dir yet");
        put_file(dir.path(), ".tmp/1.part", b"half an upload");
        put_file(dir.path(), ".tmp/2.part", b"");
        put_file(dir.path(), "packs/ab/cd", b"an object");
        assert_eq!(sweep_uploads(dir.path()).unwrap(), 2);
        assert_eq!(
            std::fs::read_dir(dir.path().join(".tmp")).unwrap().count(),
            0
        );
        assert_eq!(
            std::fs::read(dir.path().join("packs/ab/cd")).unwrap(),
            b"an object"
        );
    }

    #[tokio::test]
    async fn stat_reports_sizes_and_missing_objects() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        put_file(dir.path(), "packs/t/ab/abc", b"hello");
        assert_eq!(
            store
                .stat(&ObjectKey::new("packs/t/ab/abc").unwrap())
                .await
                .unwrap(),
            Some(5)
        );
        assert_eq!(
            store
                .stat(&ObjectKey::new("packs/t/ab/abd").unwrap())
                .await
                .unwrap(),
            None
        );
        // A directory is not an object.
        assert_eq!(
            store
                .stat(&ObjectKey::new("packs/t/ab").unwrap())
                .await
                .unwrap(),
            None
        );
    }

    #[tokio::test]
    async fn list_walks_below_the_prefix_and_skips_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        put_file(dir.path(), "packs/t/ab/ab1", b"1");
        put_file(dir.path(), "packs/t/cd/cd2", b"22");
        put_file(dir.path(), "packs/u/ab/ab3", b"333");
        put_file(dir.path(), ".tmp/upload-1", b"partial");
        let all = store.list("").await.unwrap();
        let keys: Vec<_> = all.iter().map(|o| o.key.as_str()).collect();
        assert_eq!(keys, ["packs/t/ab/ab1", "packs/t/cd/cd2", "packs/u/ab/ab3"]);
        let tenant_t = store.list("packs/t/").await.unwrap();
        assert_eq!(tenant_t.len(), 2);
        assert_eq!(tenant_t[1].size, 2);
        let partial_segment = store.list("packs/t/c").await.unwrap();
        assert_eq!(partial_segment.len(), 1);
        assert!(store.list("packs/none/").await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn delete_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        put_file(dir.path(), "packs/t/ab/ab1", b"1");
        let key = ObjectKey::new("packs/t/ab/ab1").unwrap();
        store.delete(&key).await.unwrap();
        store.delete(&key).await.unwrap();
        assert_eq!(store.stat(&key).await.unwrap(), None);
    }

    #[tokio::test]
    async fn presigned_urls_point_at_the_blob_server() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let key = ObjectKey::new("packs/t/ab/ab1").unwrap();
        let get = store
            .presign_get(&key, Duration::from_secs(60), None)
            .await
            .unwrap();
        assert!(
            get.url
                .starts_with("http://127.0.0.1:9/o/packs/t/ab/ab1?exp="),
            "{}",
            get.url
        );
        assert_eq!(get.method, "GET");
        assert!(get.expires_at > std::time::SystemTime::now());
        let put = store
            .presign_put(&key, 10, [1; 32], Duration::from_secs(60), None)
            .await
            .unwrap();
        assert_eq!(put.method, "PUT");
        assert!(put.url.contains("&size=10&sha256="), "{}", put.url);
    }
}
