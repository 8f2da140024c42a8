//! The runner's fingerprint cache: what it already knows about a workspace.
//!
//! Two maps, persisted per workspace in one file under the cache directory:
//! - files: relative path → (fingerprint, chunk refs). A file whose
//!   fingerprint (device, inode, size, mtime, ctime, mode) is unchanged is not
//!   read again; its chunks are taken from here.
//! - blobs: blob id → pack. Blobs known to be committed need not be asked
//!   about, and say which pack a checkpoint must reference.
//!
//! A file changed within two seconds of a walk's start is not remembered
//! ([`Fingerprint::is_stable`]): a write in place within one timestamp tick
//! would leave its fingerprint as it was. Git loose objects and packs are
//! named by what they hold and never written in place, so they are
//! remembered as soon as they are read. A loose object whose times git moved
//! ("freshened") is still known by its inode and size ([`FingerprintCache::lookup`]).
//!
//! The cache is only an accelerator. A missing, corrupt or foreign cache file
//! (another tenant key, another format) loads as empty and the next
//! checkpoint reads everything. A stale blob entry is caught at commit: the
//! coordinator refuses a checkpoint whose packs are gone, and the runner
//! forgets its blob map and tries again.
//!
//! ```text
//! "CFPC" │ version u8 │ key id bytes
//! │ pack count varint │ pack digest[32]*
//! │ blob count varint │ (blob id[32] │ pack ordinal varint)*
//! │ file count varint │ (path bytes │ dev │ ino │ size │ mtime_s │ mtime_ns │ ctime_s
//! │                      │ ctime_ns │ mode │ git u8 │ [base id[20]] │ chunk count │ (blob id[32] │ len)*)*
//! git: 0 for a plain file; 1 + the zlib level for a git loose blob whose
//! chunks hold its content; 11 + the zlib level, then the base tree's id, for
//! a git loose tree whose chunks hold a delta (see crate::gitobj)
//! ```

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cairn_proto::ids::{BlobId, PackId, WorkspaceId};

use crate::format::ChunkRef;
use crate::gitobj::GitStored;

/// The maps of a checkpoint's hot path (tens of thousands of lookups per
/// checkpoint): keys are paths and keyed digests, not chosen by a peer that
/// could aim collisions at a fast hasher.
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
pub type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

const MAGIC: &[u8; 4] = b"CFPC";
const VERSION: u8 = 4;

/// A fast checksum of the cache's bytes (it is written without fsync, so a
/// crash can leave blocks of another file's data or zeros in it). Not a
/// defence against tampering: whoever can write the cache can read the
/// workspace it describes.
fn checksum(bytes: &[u8]) -> u64 {
    let mut words = bytes.chunks_exact(8);
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15 ^ bytes.len() as u64;
    for word in &mut words {
        let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        h = (h ^ w).wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    }
    h ^ (h >> 33)
}

/// What identifies a file's current content without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_sec: i64,
    pub mtime_nsec: i64,
    pub ctime_sec: i64,
    pub ctime_nsec: i64,
    pub mode: u32,
}

impl Fingerprint {
    pub fn of(meta: &fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_sec: meta.mtime(),
            mtime_nsec: meta.mtime_nsec(),
            ctime_sec: meta.ctime(),
            ctime_nsec: meta.ctime_nsec(),
            mode: meta.mode(),
        }
    }

    /// Whether both are of the same file, with the same size and mode,
    /// whatever its times.
    pub fn same_file(&self, other: &Self) -> bool {
        (self.dev, self.ino, self.size, self.mode) == (other.dev, other.ino, other.size, other.mode)
    }

    /// Whether the file was last touched safely before `scan_start`. A file
    /// changed within the timestamp granularity of the scan could change
    /// again without its fingerprint changing, so it is not cached ("racy").
    pub fn is_stable(&self, scan_start: SystemTime) -> bool {
        let guard = settled_before(scan_start);
        self.mtime_sec < guard && self.ctime_sec < guard
    }
}

/// The second before which a file's timestamps must lie for a scan starting
/// at `scan_start` to have read what they stand for: two seconds of margin
/// cover coarse timestamp clocks (and filesystems that store whole seconds).
pub fn settled_before(scan_start: SystemTime) -> i64 {
    scan_start
        .checked_sub(Duration::from_secs(2))
        .unwrap_or(UNIX_EPOCH)
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// A file the cache knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedFile {
    pub fingerprint: Fingerprint,
    /// Shared: a checkpoint that finds the file unchanged takes its chunk
    /// list for the tree without copying it.
    pub chunks: std::sync::Arc<[ChunkRef]>,
    /// Set for a git loose object stored by what it holds.
    pub git: Option<GitStored>,
}

/// One file of the cache, as [`FingerprintCache::save_with_files`] writes it.
#[derive(Debug, Clone, Copy)]
pub struct FileRecord<'a> {
    pub path: &'a [u8],
    pub fingerprint: &'a Fingerprint,
    pub chunks: &'a [ChunkRef],
    pub git: Option<GitStored>,
}

/// The per-workspace fingerprint cache.
#[derive(Debug)]
pub struct FingerprintCache {
    path: PathBuf,
    key_id: String,
    files: FastMap<Vec<u8>, CachedFile>,
    packs: Vec<PackId>,
    pack_ordinals: FastMap<PackId, u32>,
    blobs: FastMap<BlobId, u32>,
}

impl FingerprintCache {
    /// Where the cache of `workspace` lives under `cache_dir`.
    pub fn path_for(cache_dir: &Path, workspace: &WorkspaceId) -> PathBuf {
        cache_dir.join(format!("{workspace}.fpcache"))
    }

    /// An empty cache that will be saved at `path`.
    pub fn empty(path: PathBuf, key_id: &str) -> Self {
        Self {
            path,
            key_id: key_id.to_owned(),
            files: FastMap::default(),
            packs: Vec::new(),
            pack_ordinals: FastMap::default(),
            blobs: FastMap::default(),
        }
    }

    /// Loads the cache of `workspace`; anything unusable gives an empty cache.
    pub fn load(cache_dir: &Path, workspace: &WorkspaceId, key_id: &str) -> Self {
        let path = Self::path_for(cache_dir, workspace);
        match fs::read(&path) {
            Ok(bytes) => match Self::decode(path.clone(), key_id, &bytes) {
                Ok(cache) => cache,
                Err(reason) => {
                    tracing::info!(path = %path.display(), %reason, "ignoring the fingerprint cache");
                    Self::empty(path, key_id)
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Self::empty(path, key_id),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the fingerprint cache");
                Self::empty(path, key_id)
            }
        }
    }

    /// Where this cache is saved.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    pub fn file_count(&self) -> usize {
        self.files.len()
    }

    pub fn file(&self, rel_path: &[u8]) -> Option<&CachedFile> {
        self.files.get(rel_path)
    }

    /// What is known of `rel_path` if its fingerprint is unchanged. For a
    /// git loose object only its times may differ: git moves them when it
    /// "freshens" an object it would write again, and never rewrites one
    /// in place, so the same inode of the same size holds the same object.
    pub fn lookup(&self, rel_path: &[u8], fingerprint: &Fingerprint) -> Option<&CachedFile> {
        let known = self.files.get(rel_path)?;
        let unchanged = known.fingerprint == *fingerprint
            || (known.fingerprint.same_file(fingerprint)
                && known.git.is_some()
                && crate::gitobj::is_loose_object_path(rel_path));
        unchanged.then_some(known)
    }

    /// The paths of the files the cache knows directly inside `dir`.
    pub fn files_in<'a>(&'a self, dir: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.files.keys().map(Vec::as_slice).filter(move |path| {
            path.len() > dir.len()
                && path.starts_with(dir)
                && path[dir.len()] == b'/'
                && !path[dir.len() + 1..].contains(&b'/')
        })
    }

    pub fn insert_file(&mut self, rel_path: Vec<u8>, file: CachedFile) {
        self.files.insert(rel_path, file);
    }

    pub fn remove_file(&mut self, rel_path: &[u8]) {
        self.files.remove(rel_path);
    }

    /// Replaces the whole file map (after a full scan, so deleted files go).
    pub fn replace_files(&mut self, files: FastMap<Vec<u8>, CachedFile>) {
        self.files = files;
    }

    pub fn take_files(&mut self) -> FastMap<Vec<u8>, CachedFile> {
        std::mem::take(&mut self.files)
    }

    /// The pack a committed blob lives in, if known.
    pub fn blob_pack(&self, id: &BlobId) -> Option<&PackId> {
        self.blobs
            .get(id)
            .map(|&ordinal| &self.packs[ordinal as usize])
    }

    pub fn knows_blob(&self, id: &BlobId) -> bool {
        self.blobs.contains_key(id)
    }

    pub fn insert_blob(&mut self, id: BlobId, pack: &PackId) {
        self.insert_blobs(pack, [id]);
    }

    /// Records that `pack` holds every blob of `ids`.
    pub fn insert_blobs(&mut self, pack: &PackId, ids: impl IntoIterator<Item = BlobId>) {
        let ordinal = match self.pack_ordinals.get(pack) {
            Some(&o) => o,
            None => {
                let o = self.packs.len() as u32;
                self.packs.push(pack.clone());
                self.pack_ordinals.insert(pack.clone(), o);
                o
            }
        };
        self.blobs.extend(ids.into_iter().map(|id| (id, ordinal)));
    }

    pub fn blob_count(&self) -> usize {
        self.blobs.len()
    }

    /// Drops every blob location (they may name packs that are gone).
    pub fn forget_blobs(&mut self) {
        self.blobs.clear();
        self.packs.clear();
        self.pack_ordinals.clear();
    }

    /// Writes the cache atomically (temp file, rename). Not fsynced: after
    /// a crash a torn file fails to decode and loads as empty, which costs
    /// one slow checkpoint, while an fsync here would cost every checkpoint.
    pub fn save(&self) -> std::io::Result<()> {
        let files = self.files.iter().map(|(path, file)| FileRecord {
            path,
            fingerprint: &file.fingerprint,
            chunks: &file.chunks,
            git: file.git,
        });
        self.write(self.encode(files))
    }

    /// Saves the cache with `files` in place of its file map, without
    /// building that map: a restore records tens of thousands of files it
    /// never looks up, and a map of them costs more than the file it saves.
    pub fn save_with_files<'a>(
        &self,
        files: impl ExactSizeIterator<Item = FileRecord<'a>>,
    ) -> std::io::Result<()> {
        self.write(self.encode(files))
    }

    fn write(&self, mut bytes: Vec<u8>) -> std::io::Result<()> {
        if let Some(dir) = self.path.parent() {
            fs::create_dir_all(dir)?;
        }
        let tmp = self
            .path
            .with_extension(format!("tmp{}", std::process::id()));
        let sum = checksum(&bytes);
        bytes.extend_from_slice(&sum.to_le_bytes());
        let mut file = fs::File::create(&tmp)?;
        file.write_all(&bytes)?;
        fs::rename(&tmp, &self.path)
    }

    fn encode<'a>(&self, files: impl ExactSizeIterator<Item = FileRecord<'a>>) -> Vec<u8> {
        use crate::format::varint_pub::{put_bytes, put_i64, put_u64};
        let mut out = Vec::with_capacity(64 + self.blobs.len() * 34 + files.len() * 120);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        put_bytes(&mut out, self.key_id.as_bytes());
        // Only packs still referenced by a blob are written.
        let mut live: Vec<Option<u32>> = vec![None; self.packs.len()];
        let mut live_packs = Vec::new();
        for &ordinal in self.blobs.values() {
            let slot = &mut live[ordinal as usize];
            if slot.is_none() {
                *slot = Some(live_packs.len() as u32);
                live_packs.push(&self.packs[ordinal as usize]);
            }
        }
        put_u64(&mut out, live_packs.len() as u64);
        for pack in live_packs {
            out.extend_from_slice(&pack.digest());
        }
        put_u64(&mut out, self.blobs.len() as u64);
        for (id, &ordinal) in &self.blobs {
            out.extend_from_slice(id.as_bytes());
            put_u64(
                &mut out,
                u64::from(live[ordinal as usize].expect("live pack")),
            );
        }
        put_u64(&mut out, files.len() as u64);
        for file in files {
            let fp = file.fingerprint;
            put_bytes(&mut out, file.path);
            put_u64(&mut out, fp.dev);
            put_u64(&mut out, fp.ino);
            put_u64(&mut out, fp.size);
            put_i64(&mut out, fp.mtime_sec);
            put_i64(&mut out, fp.mtime_nsec);
            put_i64(&mut out, fp.ctime_sec);
            put_i64(&mut out, fp.ctime_nsec);
            put_u64(&mut out, u64::from(fp.mode));
            match file.git {
                None => out.push(0),
                Some(GitStored::Blob { level }) => out.push(1 + level),
                Some(GitStored::TreeDelta { level, base }) => {
                    out.push(11 + level);
                    out.extend_from_slice(&base);
                }
            }
            put_u64(&mut out, file.chunks.len() as u64);
            for c in file.chunks.iter() {
                out.extend_from_slice(c.id.as_bytes());
                put_u64(&mut out, u64::from(c.len));
            }
        }
        out
    }

    fn decode(path: PathBuf, key_id: &str, bytes: &[u8]) -> Result<Self, String> {
        use crate::format::varint_pub::Reader;
        let Some((bytes, sum)) = bytes.split_last_chunk::<8>() else {
            return Err("too short".into());
        };
        if u64::from_le_bytes(*sum) != checksum(bytes) {
            return Err("damaged (checksum mismatch)".into());
        }
        let mut r = Reader::new(bytes);
        let e = |e: crate::format::FormatError| e.to_string();
        if r.take(4).map_err(e)? != MAGIC {
            return Err("not a cairn fingerprint cache".into());
        }
        if r.u8().map_err(e)? != VERSION {
            return Err("written by another cache version".into());
        }
        if r.bytes(1024).map_err(e)? != key_id.as_bytes() {
            return Err("made with another tenant key".into());
        }
        let mut cache = Self::empty(path, key_id);
        let pack_count = r.u64().map_err(e)?;
        if pack_count > bytes.len() as u64 / 32 {
            return Err("pack count is out of range".into());
        }
        for _ in 0..pack_count {
            let digest: [u8; 32] = r.take(32).map_err(e)?.try_into().expect("32 bytes");
            let pack = PackId::from_digest(&digest);
            cache
                .pack_ordinals
                .insert(pack.clone(), cache.packs.len() as u32);
            cache.packs.push(pack);
        }
        let blob_count = r.u64().map_err(e)?;
        if blob_count > bytes.len() as u64 / 33 {
            return Err("blob count is out of range".into());
        }
        cache.blobs.reserve(blob_count as usize);
        for _ in 0..blob_count {
            let id = BlobId::from_slice(r.take(32).map_err(e)?).expect("32 bytes");
            let ordinal = r.u32().map_err(e)?;
            if ordinal as usize >= cache.packs.len() {
                return Err("blob refers to an unknown pack".into());
            }
            cache.blobs.insert(id, ordinal);
        }
        let file_count = r.u64().map_err(e)?;
        if file_count > bytes.len() as u64 / 10 {
            return Err("file count is out of range".into());
        }
        cache.files.reserve(file_count as usize);
        for _ in 0..file_count {
            let path = r.bytes(1 << 16).map_err(e)?.to_vec();
            let fingerprint = Fingerprint {
                dev: r.u64().map_err(e)?,
                ino: r.u64().map_err(e)?,
                size: r.u64().map_err(e)?,
                mtime_sec: r.i64().map_err(e)?,
                mtime_nsec: r.i64().map_err(e)?,
                ctime_sec: r.i64().map_err(e)?,
                ctime_nsec: r.i64().map_err(e)?,
                mode: r.u32().map_err(e)?,
            };
            let git = match r.u8().map_err(e)? {
                0 => None,
                stored @ 1..=10 => Some(GitStored::Blob { level: stored - 1 }),
                stored @ 11..=20 => Some(GitStored::TreeDelta {
                    level: stored - 11,
                    base: r.take(20).map_err(e)?.try_into().expect("20 bytes"),
                }),
                _ => return Err("git level is out of range".into()),
            };
            let n = r.u64().map_err(e)?;
            if n > bytes.len() as u64 / 33 {
                return Err("chunk count is out of range".into());
            }
            let mut chunks = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let id = BlobId::from_slice(r.take(32).map_err(e)?).expect("32 bytes");
                let len = r.u32().map_err(e)?;
                chunks.push(ChunkRef { id, len });
            }
            cache.files.insert(
                path,
                CachedFile {
                    fingerprint,
                    chunks: chunks.into(),
                    git,
                },
            );
        }
        if !r.is_empty() {
            return Err("trailing bytes".into());
        }
        Ok(cache)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(ino: u64) -> Fingerprint {
        Fingerprint {
            dev: 1,
            ino,
            size: 10,
            mtime_sec: 5,
            mtime_nsec: 6,
            ctime_sec: 7,
            ctime_nsec: 8,
            mode: 0o100644,
        }
    }

    #[test]
    fn a_saved_cache_loads_back_and_matches_only_identical_fingerprints() {
        let dir = tempfile::tempdir().unwrap();
        let ws = WorkspaceId::generate();
        let mut cache = FingerprintCache::load(dir.path(), &ws, "k1");
        let pack: PackId = "ab".repeat(32).parse().unwrap();
        let chunk = ChunkRef {
            id: BlobId([4; 32]),
            len: 10,
        };
        cache.insert_blob(chunk.id, &pack);
        cache.insert_file(
            b"src/a.rs".to_vec(),
            CachedFile {
                fingerprint: fp(42),
                chunks: vec![chunk].into(),
                git: None,
            },
        );
        let loose = CachedFile {
            fingerprint: fp(44),
            chunks: vec![chunk].into(),
            git: Some(GitStored::Blob { level: 1 }),
        };
        let loose_tree = CachedFile {
            fingerprint: fp(45),
            chunks: vec![chunk].into(),
            git: Some(GitStored::TreeDelta {
                level: 6,
                base: [9; 20],
            }),
        };
        cache.insert_file(b".git/objects/ef/01".to_vec(), loose_tree.clone());
        cache.insert_file(b".git/objects/ab/cd".to_vec(), loose.clone());
        cache.save().unwrap();

        let loaded = FingerprintCache::load(dir.path(), &ws, "k1");
        assert_eq!(
            loaded.lookup(b"src/a.rs", &fp(42)).map(|f| &f.chunks[..]),
            Some(&[chunk][..])
        );
        assert_eq!(loaded.lookup(b".git/objects/ab/cd", &fp(44)), Some(&loose));
        assert_eq!(
            loaded.lookup(b".git/objects/ef/01", &fp(45)),
            Some(&loose_tree)
        );
        assert_eq!(
            loaded.lookup(b"src/a.rs", &fp(43)),
            None,
            "a new inode is a new file"
        );
        assert_eq!(loaded.blob_pack(&chunk.id), Some(&pack));

        let foreign = FingerprintCache::load(dir.path(), &ws, "another-key");
        assert_eq!(
            foreign.file_count(),
            0,
            "a cache made with another key is not trusted"
        );
    }

    #[test]
    fn a_corrupt_cache_file_loads_as_empty() {
        let dir = tempfile::tempdir().unwrap();
        let ws = WorkspaceId::generate();
        std::fs::write(
            FingerprintCache::path_for(dir.path(), &ws),
            b"CFPC\x02garbage",
        )
        .unwrap();
        assert_eq!(
            FingerprintCache::load(dir.path(), &ws, "k1").file_count(),
            0
        );

        // A saved cache with a few bytes changed (a torn write) is not trusted.
        let mut cache = FingerprintCache::load(dir.path(), &ws, "k1");
        for i in 0..3u8 {
            cache.insert_file(
                vec![b'f', i],
                CachedFile {
                    fingerprint: fp(u64::from(i)),
                    chunks: vec![ChunkRef {
                        id: BlobId([i; 32]),
                        len: 10,
                    }]
                    .into(),
                    git: None,
                },
            );
        }
        cache.save().unwrap();
        assert_eq!(
            FingerprintCache::load(dir.path(), &ws, "k1").file_count(),
            3
        );
        let path = FingerprintCache::path_for(dir.path(), &ws);
        let mut bytes = std::fs::read(&path).unwrap();
        let middle = bytes.len() / 2;
        for b in &mut bytes[middle..middle + 4] {
            *b ^= 0x5a;
        }
        std::fs::write(&path, bytes).unwrap();
        assert_eq!(
            FingerprintCache::load(dir.path(), &ws, "k1").file_count(),
            0
        );
    }

    #[test]
    fn files_touched_just_before_the_scan_are_not_stable() {
        let now = SystemTime::now();
        let secs = now.duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
        let mut f = fp(1);
        f.mtime_sec = secs;
        f.ctime_sec = secs;
        assert!(!f.is_stable(now));
        f.mtime_sec = secs - 60;
        f.ctime_sec = secs - 60;
        assert!(f.is_stable(now));
    }
}
