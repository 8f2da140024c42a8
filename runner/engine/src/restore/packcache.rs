//! The host's pack cache: pack bytes kept on local disk for every restore of
//! one host (all the sandboxes `cairn-host` starts share one), so that a
//! second restore of a workspace — or of a fork of the same checkpoint,
//! whose packs are the same objects — reads from disk what the first one
//! downloaded.
//!
//! ## What is kept
//!
//! Pieces: byte ranges of packs exactly as the store holds them, one file
//! each, `p1-<pack id>-<start>-<end>` (decimal offsets, end exclusive),
//! directly in the cache directory:
//!
//! - a META pack whole (`0-<size>`): restores always read META packs whole;
//! - a DATA pack's sealed index with the trailer behind it
//!   (`<index offset>-<size>`);
//! - every coalesced range of DATA blobs a restore fetched.
//!
//! Ranges rather than whole DATA packs, because a restore already reads
//! through gaps of up to 256 KiB ([`super::fetch::MAX_GAP`]): a restore into
//! an empty directory leaves its packs nearly whole in the cache anyway,
//! while a restore onto a baked older copy, which needs a few blobs of a
//! 16 MiB pack, neither downloads nor stores the rest. A later restore takes
//! every blob lying entirely inside a piece from the cache and fetches only
//! the others, which become pieces in turn. Pack ids are SHA-256 digests of
//! immutable objects, so a piece never goes stale.
//!
//! ## Nothing read from the cache is trusted
//!
//! The directory is shared by sandboxes that may belong to different tenants
//! and may be hostile. What comes out of it passes the same checks as bytes
//! from the store: a META pack's SHA-256 must be its id, a DATA index must
//! authenticate (AES-256-GCM under the lineage's key, bound to the pack kind)
//! and agree with the manifest's trailer position, and every blob must
//! authenticate and hash (keyed) to its id before a byte of it is written.
//! A piece that fails a check is deleted with a warning and its bytes are
//! fetched from the store; the restore goes on. Pieces are ciphertext as the
//! store holds it, sealed with each lineage's own key, so reading another
//! workspace's pieces reveals nothing the store would not. Files are opened with `O_NOFOLLOW|O_NONBLOCK` and must be
//! regular files of the length their name says (a planted symlink or fifo is
//! refused), and a read never goes past the range a restore asked for, which
//! the manifest bounds.
//!
//! ## Concurrency and eviction
//!
//! Pieces are written to a temporary file and renamed into place, so no
//! reader ever sees a partial piece; two restores writing the same piece
//! just replace one copy with an identical one. A piece that disappears
//! between listing and reading (evicted by another restore) is a miss.
//!
//! The bound is kept by evicting the least recently used pieces: a read sets
//! a piece's mtime to now (the access time is unreliable under
//! `relatime`/`noatime`), and eviction deletes the oldest mtimes first down
//! to 90% of the bound. The bytes the directory holds are a ledger kept in
//! `.lock` and changed only under an exclusive `flock` on it: a restore
//! reserves a piece's bytes in the ledger before it writes the piece
//! (evicting first when they would not fit), gives them back if the write
//! fails, and every walk of the directory (at open, at each eviction) sets
//! the ledger to what is really there. A piece being written is counted by
//! the walks too: its temporary file, created under the lock with the
//! reservation, is named `.tmp-<length>-…`. So restores of many sandboxes at once
//! keep the bound together, as one would alone; a ledger that does not parse
//! is rebuilt from a walk. A lock held by someone else for more than a second
//! makes this process keep its own count and stop asking for the lock (a
//! hostile holder can stop eviction, never a restore, and costs it one
//! second). Temporary files older than an hour (left by a killed restore)
//! are removed by the walk.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use cairn_proto::ids::PackId;

/// The default bound of a pack cache: 10 GiB.
pub const DEFAULT_PACK_CACHE_SIZE: u64 = 10 << 30;

const PIECE_PREFIX: &str = "p1-";
const TEMP_PREFIX: &str = ".tmp-";
const LOCK_FILE: &str = ".lock";
/// A temporary file this old was left by a writer that died.
const STALE_TEMP: Duration = Duration::from_secs(3600);
/// Eviction goes down to this share of the bound, so that not every write
/// of a full cache walks the directory.
const LOW_WATER_PERCENT: u64 = 90;
/// How long eviction waits for another process's eviction to finish.
const LOCK_ATTEMPTS: u32 = 50;
const LOCK_RETRY: Duration = Duration::from_millis(20);

/// Where a pack cache lives and how large it may grow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackCacheConfig {
    pub dir: PathBuf,
    pub max_bytes: u64,
}

/// The cache directory cannot be used (the restore then goes without it).
#[derive(Debug, thiserror::Error)]
#[error("cannot use the pack cache {}: {source}", path.display())]
pub struct PackCacheError {
    pub path: PathBuf,
    pub source: io::Error,
}

/// A byte range `[start, end)` of one pack held in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Piece {
    pub start: u64,
    pub end: u64,
}

impl Piece {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }

    /// Whether `[start, end)` lies inside this piece.
    pub fn covers(&self, start: u64, end: u64) -> bool {
        self.start <= start && end <= self.end
    }
}

/// The file name of a piece.
fn piece_name(pack: &PackId, piece: Piece) -> String {
    format!("{PIECE_PREFIX}{pack}-{}-{}", piece.start, piece.end)
}

/// The pack and range a file name stands for, if it names a piece.
fn parse_piece_name(name: &str) -> Option<(PackId, Piece)> {
    let rest = name.strip_prefix(PIECE_PREFIX)?;
    let mut parts = rest.split('-');
    let pack = parts.next()?.parse::<PackId>().ok()?;
    let start = parse_decimal(parts.next()?)?;
    let end = parse_decimal(parts.next()?)?;
    (parts.next().is_none() && start < end).then_some((pack, Piece { start, end }))
}

/// Digits only, no sign or leading zero, so that each piece has one name.
fn parse_decimal(text: &str) -> Option<u64> {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    canonical.then(|| text.parse().ok()).flatten()
}

/// One piece found by a walk of the directory.
#[derive(Debug)]
struct Found {
    name: String,
    pack: PackId,
    piece: Piece,
    len: u64,
    mtime: SystemTime,
}

/// What a walk of the directory found.
#[derive(Debug, Default)]
struct Walked {
    pieces: Vec<Found>,
    /// Bytes reserved by pieces being written (their temporary files).
    reserved: u64,
}

/// A piece's reserved temporary file.
struct Reserved {
    file: File,
    path: PathBuf,
}

#[derive(Debug, Default)]
struct State {
    pieces: HashMap<PackId, Vec<Piece>>,
    /// The ledger's bytes as this process last saw them (with its own
    /// reservation); without the lock, the last walk plus what this process
    /// wrote since.
    total: u64,
    /// The lock was not to be had once: this process keeps its own count.
    lock_refused: bool,
}

impl State {
    /// Replaces what this process knows with a walk's findings.
    fn remember(&mut self, walked: Walked) {
        self.pieces.clear();
        self.total = walked.pieces.iter().map(|f| f.len).sum::<u64>() + walked.reserved;
        for f in walked.pieces {
            self.pieces.entry(f.pack).or_default().push(f.piece);
        }
    }

    fn forget(&mut self, pack: &PackId, piece: Piece) {
        if let Some(pieces) = self.pieces.get_mut(pack)
            && let Some(at) = pieces.iter().position(|p| *p == piece)
        {
            pieces.swap_remove(at);
            self.total = self.total.saturating_sub(piece.len());
        }
    }
}

/// A pack cache directory, opened for one restore.
#[derive(Debug)]
pub struct PackCache {
    dir: PathBuf,
    max_bytes: u64,
    state: Mutex<State>,
    temp_counter: AtomicU64,
}

impl PackCache {
    /// Creates the directory if needed (mode 0700), lists what it holds,
    /// and evicts if it is over its bound (the bound may have shrunk).
    pub fn open(config: &PackCacheConfig) -> Result<Self, PackCacheError> {
        let error = |source| PackCacheError {
            path: config.dir.clone(),
            source,
        };
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&config.dir)
            .map_err(error)?;
        let cache = Self {
            dir: config.dir.clone(),
            max_bytes: config.max_bytes,
            state: Mutex::new(State::default()),
            temp_counter: AtomicU64::new(0),
        };
        let mut state = cache.state.lock().expect("pack cache state");
        match cache.lock() {
            Some(lock) => {
                // The bound may have shrunk since the last restore.
                let (over, target) = (cache.max_bytes, cache.low_water());
                cache
                    .resync(&mut state, &lock, over, target)
                    .map_err(error)?;
            }
            None => {
                state.lock_refused = true;
                state.remember(cache.walk().map_err(error)?);
            }
        }
        drop(state);
        Ok(cache)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn low_water(&self) -> u64 {
        self.max_bytes / 100 * LOW_WATER_PERCENT
    }

    /// Bytes the cache holds as far as this process knows.
    pub fn total_bytes(&self) -> u64 {
        self.state.lock().expect("pack cache state").total
    }

    /// The pieces of `pack` known to be in the cache.
    pub fn pieces(&self, pack: &PackId) -> Vec<Piece> {
        let state = self.state.lock().expect("pack cache state");
        state.pieces.get(pack).cloned().unwrap_or_default()
    }

    /// A piece of `pack` that holds all of `[start, end)`.
    pub fn find(&self, pack: &PackId, start: u64, end: u64) -> Option<Piece> {
        let state = self.state.lock().expect("pack cache state");
        state
            .pieces
            .get(pack)?
            .iter()
            .copied()
            .filter(|p| p.covers(start, end))
            .min_by_key(Piece::len)
    }

    /// Reads `[start, end)` of `pack` from `piece` (which must cover it) and
    /// marks the piece used. `None` when the piece is gone, is not a regular
    /// file of its length, or cannot be read (the last two delete it). The
    /// bytes are unchecked: the caller verifies them like bytes from the store.
    pub fn read(&self, pack: &PackId, piece: Piece, start: u64, end: u64) -> Option<Vec<u8>> {
        let mut bytes = Vec::new();
        self.read_into(pack, piece, start, end, &mut bytes)
            .then_some(bytes)
    }

    /// [`Self::read`] into `bytes` (replacing what it held), so that a restore
    /// reading hundreds of pieces reuses one buffer per thread; `false` where
    /// `read` gives `None`.
    pub fn read_into(
        &self,
        pack: &PackId,
        piece: Piece,
        start: u64,
        end: u64,
        bytes: &mut Vec<u8>,
    ) -> bool {
        debug_assert!(piece.covers(start, end));
        let path = self.dir.join(piece_name(pack, piece));
        let file = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Evicted by another restore since the listing: a miss.
                self.state
                    .lock()
                    .expect("pack cache state")
                    .forget(pack, piece);
                return false;
            }
            Err(e) => {
                self.discard(pack, piece, &format!("it cannot be opened: {e}"));
                return false;
            }
        };
        let meta = match file.metadata() {
            Ok(meta) => meta,
            Err(e) => {
                self.discard(pack, piece, &format!("it cannot be inspected: {e}"));
                return false;
            }
        };
        if !meta.file_type().is_file() || meta.len() != piece.len() {
            self.discard(
                pack,
                piece,
                &format!(
                    "it is not a regular file of {} bytes (a {} of {} bytes)",
                    piece.len(),
                    if meta.file_type().is_file() {
                        "file"
                    } else {
                        "special file"
                    },
                    meta.len()
                ),
            );
            return false;
        }
        bytes.clear();
        bytes.resize((end - start) as usize, 0);
        if let Err(e) = file.read_exact_at(bytes, start - piece.start) {
            self.discard(pack, piece, &format!("it cannot be read: {e}"));
            return false;
        }
        // Least recently used goes first: a read makes the piece young. A
        // file with other links is not ours alone; its times stay.
        if meta.nlink() == 1 {
            let _ = file.set_modified(SystemTime::now());
        }
        true
    }

    /// Reads `[start, end)` of `pack` from whichever piece holds it.
    pub fn get(&self, pack: &PackId, start: u64, end: u64) -> Option<(Piece, Vec<u8>)> {
        let piece = self.find(pack, start, end)?;
        self.read(pack, piece, start, end)
            .map(|bytes| (piece, bytes))
    }

    /// Deletes a piece whose bytes failed a check; the caller fetches them
    /// from the store instead.
    pub fn discard(&self, pack: &PackId, piece: Piece, reason: &str) {
        tracing::warn!(
            %pack,
            start = piece.start,
            end = piece.end,
            %reason,
            "dropping a damaged piece of the host's pack cache; fetching it from the store"
        );
        let path = self.dir.join(piece_name(pack, piece));
        if let Err(e) = fs::remove_file(&path)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), error = %e, "cannot delete the damaged piece");
        }
        self.state
            .lock()
            .expect("pack cache state")
            .forget(pack, piece);
    }

    /// Stores `bytes` as the piece of `pack` starting at `start`, unless a
    /// piece already holds that range. Evicts first if the bound requires.
    /// Failures only cost a future download, so they are logged, not returned.
    pub fn insert(&self, pack: &PackId, start: u64, bytes: &[u8]) {
        let len = bytes.len() as u64;
        let piece = Piece {
            start,
            end: start + len,
        };
        if len == 0 || len > self.low_water() {
            return;
        }
        let temp = {
            let mut state = self.state.lock().expect("pack cache state");
            let held = state
                .pieces
                .get(pack)
                .is_some_and(|pieces| pieces.iter().any(|p| p.covers(piece.start, piece.end)));
            if held {
                return;
            }
            self.reserve(&mut state, len)
        };
        let temp = match temp {
            Ok(temp) => temp,
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), %pack, error = %e, "cannot write to the host's pack cache");
                return;
            }
        };
        match self.write_piece(pack, piece, bytes, temp) {
            Ok(()) => {
                let mut state = self.state.lock().expect("pack cache state");
                let pieces = state.pieces.entry(pack.clone()).or_default();
                if !pieces.contains(&piece) {
                    pieces.push(piece);
                }
            }
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), %pack, error = %e, "cannot write to the host's pack cache");
                self.release(len);
            }
        }
    }

    /// Counts `len` more bytes in the ledger, evicting first when they
    /// would take it past the bound, and creates the temporary file the
    /// piece is written to. Its name carries `len`, so that a walk by any
    /// process counts the reservation until the piece is renamed into place.
    fn reserve(&self, state: &mut State, len: u64) -> io::Result<Reserved> {
        let Some(lock) = (!state.lock_refused).then(|| self.lock()).flatten() else {
            if !state.lock_refused {
                tracing::debug!(dir = %self.dir.display(), "another process holds the pack cache lock; keeping a count of this restore's own");
                state.lock_refused = true;
            }
            let temp = self.create_temp(len)?;
            state.total += len;
            return Ok(temp);
        };
        match read_ledger(&lock) {
            Some(held) => state.total = held,
            None => {
                if let Err(e) = self.resync(state, &lock, u64::MAX, u64::MAX) {
                    tracing::warn!(dir = %self.dir.display(), error = %e, "cannot list the pack cache to count what it holds");
                }
            }
        }
        if state.total + len > self.max_bytes {
            let target = self.low_water().saturating_sub(len);
            if let Err(e) = self.resync(state, &lock, target, target) {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot list the pack cache to evict from it");
            }
        }
        let temp = self.create_temp(len)?;
        state.total += len;
        write_ledger(&lock, state.total);
        Ok(temp)
    }

    fn create_temp(&self, len: u64) -> io::Result<Reserved> {
        let path = self.dir.join(format!(
            "{TEMP_PREFIX}{len}-{}-{}-{:016x}",
            std::process::id(),
            self.temp_counter.fetch_add(1, Ordering::Relaxed),
            rand::random::<u64>()
        ));
        // Readable by every sandbox of the host, whatever its uid: the
        // bytes are the store's ciphertext.
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)?;
        Ok(Reserved { file, path })
    }

    /// Takes back a reservation whose piece was not written.
    fn release(&self, len: u64) {
        let mut state = self.state.lock().expect("pack cache state");
        state.total = state.total.saturating_sub(len);
        if state.lock_refused {
            return;
        }
        if let Some(lock) = self.lock()
            && let Some(held) = read_ledger(&lock)
        {
            write_ledger(&lock, held.saturating_sub(len));
        }
    }

    fn write_piece(
        &self,
        pack: &PackId,
        piece: Piece,
        bytes: &[u8],
        temp: Reserved,
    ) -> io::Result<()> {
        let Reserved { mut file, path } = temp;
        let written = (|| {
            file.write_all(bytes)?;
            // No fsync: after a crash a piece may be short or garbled, and
            // then it fails its checks like any damaged piece.
            drop(file);
            // rename replaces whatever holds the name, never following it.
            fs::rename(&path, self.dir.join(piece_name(pack, piece)))
        })();
        if written.is_err() {
            let _ = fs::remove_file(&path);
        }
        written
    }

    /// Lists the pieces on disk and counts the bytes reserved by pieces
    /// being written; removes stale temporary files.
    fn walk(&self) -> io::Result<Walked> {
        let now = SystemTime::now();
        let mut walked = Walked::default();
        for entry in fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            // DirEntry::metadata does not follow symlinks.
            let Ok(meta) = entry.metadata() else { continue };
            let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            if let Some((pack, piece)) = parse_piece_name(name) {
                if meta.file_type().is_file() {
                    walked.pieces.push(Found {
                        name: name.to_owned(),
                        pack,
                        piece,
                        len: meta.len(),
                        mtime,
                    });
                }
            } else if let Some(rest) = name.strip_prefix(TEMP_PREFIX) {
                if now.duration_since(mtime).unwrap_or_default() > STALE_TEMP {
                    let _ = fs::remove_file(entry.path());
                } else if let Some(len) = rest.split('-').next().and_then(parse_decimal) {
                    walked.reserved = walked.reserved.saturating_add(len);
                }
            }
        }
        Ok(walked)
    }

    /// Under the lock: walks the directory and, when it holds more than
    /// `over` bytes, deletes least recently used pieces until at most
    /// `target` remain; then sets the ledger and what this process knows to
    /// what is there.
    fn resync(&self, state: &mut State, lock: &File, over: u64, target: u64) -> io::Result<()> {
        let Walked {
            pieces: mut found,
            reserved,
        } = self.walk()?;
        // Pieces being written cannot be evicted, but they count.
        let mut total = found.iter().map(|f| f.len).sum::<u64>() + reserved;
        let mut evicted = 0u64;
        if total > over {
            found.sort_by(|a, b| a.mtime.cmp(&b.mtime).then_with(|| a.name.cmp(&b.name)));
            let mut kept = Vec::with_capacity(found.len());
            for f in found {
                if total > target {
                    match fs::remove_file(self.dir.join(&f.name)) {
                        Ok(()) => {
                            total -= f.len;
                            evicted += 1;
                            continue;
                        }
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {
                            total -= f.len;
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!(piece = %f.name, error = %e, "cannot evict a piece of the pack cache");
                        }
                    }
                }
                kept.push(f);
            }
            found = kept;
        }
        if evicted > 0 {
            tracing::debug!(
                evicted,
                remaining = total,
                bound = self.max_bytes,
                "pack cache evicted"
            );
        }
        state.remember(Walked {
            pieces: found,
            reserved,
        });
        write_ledger(lock, total);
        Ok(())
    }

    /// The exclusive lock on the ledger, if it can be had within about a second.
    fn lock(&self) -> Option<File> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(self.dir.join(LOCK_FILE))
            .ok()?;
        for _ in 0..LOCK_ATTEMPTS {
            // SAFETY: flock on a descriptor this function owns.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Some(file);
            }
            std::thread::sleep(LOCK_RETRY);
        }
        None
    }
}

/// The ledger's bytes, if `.lock` holds a number.
fn read_ledger(lock: &File) -> Option<u64> {
    let mut text = [0u8; 24];
    let read = lock.read_at(&mut text, 0).ok()?;
    std::str::from_utf8(&text[..read]).ok()?.trim().parse().ok()
}

/// Writes the ledger (a failure only means the next reader rebuilds it).
fn write_ledger(lock: &File, bytes: u64) {
    let text = format!("{bytes}\n");
    let _ = lock
        .set_len(0)
        .and_then(|()| lock.write_all_at(text.as_bytes(), 0));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pack(n: u8) -> PackId {
        PackId::from_digest(&[n; 32])
    }

    fn open(dir: &Path, max_bytes: u64) -> PackCache {
        PackCache::open(&PackCacheConfig {
            dir: dir.to_owned(),
            max_bytes,
        })
        .unwrap()
    }

    fn age(cache: &PackCache, pack: &PackId, piece: Piece, secs_ago: u64) {
        let file = File::options()
            .write(true)
            .open(cache.dir().join(piece_name(pack, piece)))
            .unwrap();
        file.set_modified(SystemTime::now() - Duration::from_secs(secs_ago))
            .unwrap();
    }

    fn on_disk(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(PIECE_PREFIX))
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_piece_is_a_hit_for_any_range_inside_it_and_a_miss_elsewhere() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = open(tmp.path(), 1 << 20);
        let bytes: Vec<u8> = (0..100u8).collect();
        cache.insert(&pack(1), 1000, &bytes);
        let (piece, got) = cache.get(&pack(1), 1010, 1020).unwrap();
        assert_eq!(
            piece,
            Piece {
                start: 1000,
                end: 1100
            }
        );
        assert_eq!(got, &bytes[10..20]);
        assert!(cache.get(&pack(1), 990, 1010).is_none(), "starts before");
        assert!(cache.get(&pack(1), 1090, 1101).is_none(), "ends after");
        assert!(cache.get(&pack(2), 1010, 1020).is_none(), "other pack");

        // Another process sees it too, and a covered range is not stored twice.
        let again = open(tmp.path(), 1 << 20);
        assert_eq!(again.get(&pack(1), 1000, 1100).unwrap().1, bytes);
        again.insert(&pack(1), 1020, &bytes[20..40]);
        assert_eq!(on_disk(tmp.path()).len(), 1);
        assert_eq!(again.total_bytes(), 100);
    }

    #[test]
    fn eviction_keeps_the_bound_and_removes_the_least_recently_used_first() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = open(tmp.path(), 1000);
        let piece = |start| Piece {
            start,
            end: start + 300,
        };
        for (i, start) in [0u64, 1000, 2000].into_iter().enumerate() {
            cache.insert(&pack(1), start, &[i as u8; 300]);
        }
        // Oldest written: 2000, then 0, then 1000; reading 2000 makes it young.
        age(&cache, &pack(1), piece(2000), 300);
        age(&cache, &pack(1), piece(0), 200);
        age(&cache, &pack(1), piece(1000), 100);
        let reader = open(tmp.path(), 1000);
        assert!(reader.get(&pack(1), 2000, 2300).is_some());

        // 900 + 300 > 1000: evict down to 90% (900) less the new 300, oldest first.
        let writer = open(tmp.path(), 1000);
        writer.insert(&pack(2), 0, &[9; 300]);
        let mut expected = vec![
            piece_name(&pack(1), piece(1000)),
            piece_name(&pack(1), piece(2000)),
            piece_name(&pack(2), piece(0)),
        ];
        expected.sort();
        assert_eq!(
            on_disk(tmp.path()),
            expected,
            "the least recently used piece went"
        );
        assert!(writer.total_bytes() <= 1000);
        assert!(writer.get(&pack(1), 0, 10).is_none());

        // A smaller bound on the next open evicts at once.
        let small = open(tmp.path(), 400);
        assert!(small.total_bytes() <= 400, "{}", small.total_bytes());
        assert_eq!(on_disk(tmp.path()).len(), 1);
        // A piece larger than the cache could keep is not stored.
        small.insert(&pack(3), 0, &[1; 500]);
        assert!(small.get(&pack(3), 0, 500).is_none());
    }

    #[test]
    fn restores_at_once_keep_the_bound_together() {
        let tmp = tempfile::tempdir().unwrap();
        let disk = || -> u64 {
            fs::read_dir(tmp.path())
                .unwrap()
                .map(|e| e.unwrap())
                .filter(|e| e.file_name().to_str().unwrap().starts_with(PIECE_PREFIX))
                .map(|e| e.metadata().unwrap().len())
                .sum()
        };
        // Two restores open the empty cache, then take turns writing: each
        // alone would think it holds half of what is on disk.
        let (a, b) = (open(tmp.path(), 1000), open(tmp.path(), 1000));
        for i in 0..10u64 {
            let (cache, writer) = if i % 2 == 0 { (&a, 1) } else { (&b, 2) };
            cache.insert(&pack(writer), i * 1000, &[i as u8; 150]);
            assert!(
                disk() <= 1000,
                "after write {i} the cache holds {} bytes",
                disk()
            );
        }
        assert!(disk() >= 750, "eviction went only as far as it had to");
        // The ledger is what is there, for the next restore to trust.
        let lock = File::open(tmp.path().join(LOCK_FILE)).unwrap();
        assert_eq!(read_ledger(&lock), Some(disk()));

        // A write that fails gives its reservation back: here a directory
        // planted at the piece's name makes the rename fail.
        let full = disk();
        let planted = Piece { start: 0, end: 100 };
        fs::create_dir_all(tmp.path().join(piece_name(&pack(3), planted)).join("x")).unwrap();
        a.insert(&pack(3), 0, &[7; 100]);
        assert_eq!(read_ledger(&lock), Some(full));
        fs::remove_dir_all(tmp.path().join(piece_name(&pack(3), planted))).unwrap();

        // A ledger that does not parse is rebuilt from the directory.
        fs::write(tmp.path().join(LOCK_FILE), b"not a number").unwrap();
        a.insert(&pack(4), 0, &[1; 10]);
        assert_eq!(read_ledger(&lock), Some(disk()));
    }

    #[test]
    fn pieces_being_written_count_against_the_bound() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = open(tmp.path(), 1000);
        cache.insert(&pack(1), 0, &[1; 300]);
        cache.insert(&pack(1), 1000, &[1; 300]);
        // Another restore is writing a 500-byte piece; the ledger is lost.
        fs::write(tmp.path().join(format!("{TEMP_PREFIX}500-1-2-3")), b"half").unwrap();
        fs::write(tmp.path().join(LOCK_FILE), b"").unwrap();
        // 600 held + 500 being written + 100 > 1000: down to 900 - 100.
        cache.insert(&pack(2), 0, &[2; 100]);
        assert_eq!(
            on_disk(tmp.path()).len(),
            2,
            "one old piece went to make room for the one being written"
        );
        let lock = File::open(tmp.path().join(LOCK_FILE)).unwrap();
        assert_eq!(read_ledger(&lock), Some(300 + 500 + 100));
    }

    #[test]
    fn a_held_lock_stops_eviction_but_never_a_restore() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = open(tmp.path(), 1000);
        let holder = File::options()
            .read(true)
            .write(true)
            .open(tmp.path().join(LOCK_FILE))
            .unwrap();
        // SAFETY: flock on a descriptor the test owns.
        assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);
        for i in 0..8u64 {
            cache.insert(&pack(1), i * 1000, &[1; 200]);
        }
        assert_eq!(on_disk(tmp.path()).len(), 8, "every piece was written");
        assert_eq!(cache.total_bytes(), 1600, "its own count, past the bound");
        drop(holder);
        // The next restore evicts at open.
        assert!(open(tmp.path(), 1000).total_bytes() <= 900);
    }

    #[test]
    fn a_damaged_or_planted_piece_is_refused_and_deleted() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = open(tmp.path(), 1 << 20);
        cache.insert(&pack(1), 0, &[7; 100]);
        let name = piece_name(&pack(1), Piece { start: 0, end: 100 });
        // Truncated by someone: not the length its name says.
        fs::write(tmp.path().join(&name), [7; 50]).unwrap();
        assert!(cache.get(&pack(1), 0, 10).is_none());
        assert!(!tmp.path().join(&name).exists(), "deleted");

        // A symlink to a secret is never read through.
        let secret = tmp.path().join("secret");
        fs::write(&secret, [1; 100]).unwrap();
        std::os::unix::fs::symlink(&secret, tmp.path().join(&name)).unwrap();
        let planted = open(tmp.path(), 1 << 20);
        assert!(planted.get(&pack(1), 0, 100).is_none());
        assert_eq!(
            fs::read(&secret).unwrap(),
            [1; 100],
            "the target is untouched"
        );

        // discard() is what a failed check calls.
        planted.insert(&pack(2), 0, &[3; 10]);
        planted.discard(&pack(2), Piece { start: 0, end: 10 }, "test");
        assert!(planted.get(&pack(2), 0, 10).is_none());
        assert_eq!(planted.total_bytes(), 0);
    }

    #[test]
    fn writers_at_once_never_show_a_partial_piece() {
        let tmp = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..(256 << 10)).map(|i| (i % 251) as u8).collect();
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    let cache = open(tmp.path(), 1 << 30);
                    for round in 0..20 {
                        cache.insert(&pack(round % 3), 0, &bytes);
                        let reader = open(tmp.path(), 1 << 30);
                        if let Some((_, got)) = reader.get(&pack(round % 3), 0, bytes.len() as u64)
                        {
                            assert!(got == bytes, "a reader saw a partial piece");
                        }
                    }
                });
            }
        });
        let names: Vec<String> = fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n != LOCK_FILE)
            .collect();
        assert!(
            names.iter().all(|n| n.starts_with(PIECE_PREFIX)),
            "{names:?}"
        );
        assert_eq!(names.len(), 3);
    }

    #[test]
    fn piece_names_round_trip_and_odd_names_are_not_pieces() {
        let piece = Piece {
            start: 16,
            end: 4096,
        };
        assert_eq!(
            parse_piece_name(&piece_name(&pack(5), piece)),
            Some((pack(5), piece))
        );
        let hex = pack(5).to_string();
        for bad in [
            format!("p1-{hex}-10-10"),
            format!("p1-{hex}-20-10"),
            format!("p1-{hex}-010-20"),
            format!("p1-{hex}-+1-20"),
            format!("p1-{hex}-1-20-3"),
            format!("p2-{hex}-1-20"),
            "p1-xyz-1-2".to_owned(),
        ] {
            assert_eq!(parse_piece_name(&bad), None, "{bad}");
        }
    }
}
