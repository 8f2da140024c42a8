//! The content stage ([`store_contents`]): turning the scanned files into
//! chunk lists, and new chunks into batches that it stores.
//!
//! The reading runs on a blocking thread while the async side stores what it
//! sends. For
//! each file, in path order:
//! - a fingerprint the cache knows, whose chunks are all known to be
//!   committed, reuses the cached chunk list without reading the file;
//! - otherwise the file is read and cut ([`crate::chunker`]); small files are
//!   read in parallel groups, large ones streamed one at a time with their
//!   chunks hashed in parallel windows.
//!
//! A chunk the cache knows, or that this checkpoint already produced, is
//! dropped at once; the others are gathered into [`Batch`]es of about
//! [`BATCH_BYTES`] that are handed over through a channel of one slot, so the
//! plaintext in memory stays bounded whatever the size of the workspace.
//!
//! A file that changes while it is read (its size, times or inode differ
//! before and after) is read once more; if it changes again, what was read
//! is kept, a warning says so, and its fingerprint is not cached.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use cairn_proto::domain::PackKind;
use cairn_proto::ids::{BlobId, PackId};
use rayon::prelude::*;

use crate::cache::{CachedFile, Fingerprint, FingerprintCache};
use crate::chunker;
use crate::format::{ChunkRef, TenantKeys};
use crate::gitobj::{self, GitStored};
use crate::restore::fsops::open_for_read;

use super::CheckpointError;
use super::dir::{DirFiles, FileContent};
use super::memo::Memo;
use super::treebases::{Base, TreeBases};
use super::upload::Store;
use crate::gitobj::TreeCache;
use crate::scan::{Meta, NodeKind, Scan, ScannedDir, display_rel, join_rel, join_rel_into};

/// Plaintext gathered before the store is asked which blobs it lacks.
pub const BATCH_BYTES: usize = 16 << 20;
/// Small files are read in parallel groups of about this many bytes.
const GROUP_BYTES: u64 = 8 << 20;
const GROUP_FILES: usize = 2048;
/// Files larger than this are streamed one at a time.
const LARGE_FILE: u64 = 8 << 20;
/// Chunks of a streamed file are hashed in parallel windows of this size.
const WINDOW_BYTES: usize = 4 << 20;

/// A chunk with its id, and its plaintext.
type Hashed = (ChunkRef, Vec<u8>);

/// New plaintext blobs: neither known from the cache nor sent before.
#[derive(Debug, Default)]
pub struct Batch {
    pub blobs: Vec<(BlobId, Vec<u8>)>,
}

/// Everything the reader found out.
#[derive(Debug)]
pub struct Content {
    /// Per scanned directory.
    pub files: Vec<DirFiles>,
    /// Per scanned directory: whether its files are the memo's (only
    /// newly cacheable fingerprints may differ), so its tree can be too.
    pub from_memo: Vec<bool>,
    /// Per scanned directory listed again: the files taken from what the
    /// last checkpoint found for its earlier listing.
    pub from_earlier: Vec<Option<TakenEarlier>>,
    pub warnings: Vec<String>,
    pub files_read: u64,
    pub bytes_read: u64,
}

/// Files of a directory listed again that are what the last checkpoint
/// found for them: their chunks are in the packs it placed that listing
/// in, so they are placed without a lookup each.
#[derive(Debug)]
pub struct TakenEarlier {
    /// Every pack of the earlier listing (a superset of what they need).
    pub packs: Arc<[PackId]>,
    /// Per node of the new listing: whether it was taken.
    pub nodes: Vec<bool>,
}

/// The receiving side went away (the checkpoint failed elsewhere).
#[derive(Debug, Clone, Copy)]
pub struct Cancelled;

/// What the content stage reads with.
pub(crate) struct Reading {
    /// The walk, as the limits left it.
    pub scan: Arc<Scan>,
    pub cache: Arc<FingerprintCache>,
    pub memo: Option<Arc<Memo>>,
    pub keys: Arc<TenantKeys>,
    /// The git trees the repositories' readings read.
    pub git_trees: Arc<TreeCache>,
    pub started: Instant,
}

/// The content stage: reads what must be read on a blocking thread (see
/// [`read_all`]), while this task has `store` store the new chunks it sends
/// in DATA packs, whose uploads start as they fill.
pub(crate) async fn store_contents(
    store: &mut Store<'_>,
    reading: Reading,
) -> Result<Content, CheckpointError> {
    let Reading {
        scan,
        cache,
        memo,
        keys,
        git_trees,
        started,
    } = reading;
    let (batches, mut incoming) = tokio::sync::mpsc::channel(1);
    let reader = tokio::task::spawn_blocking(move || {
        std::thread::scope(|s| {
            let finding = s.spawn(|| {
                let bases = TreeBases::find(&scan, &cache, memo.as_deref(), &git_trees);
                let elapsed_ms = started.elapsed().as_millis() as u64;
                tracing::debug!(elapsed_ms, "git tree bases found");
                bases
            });
            // Without bases (the thread panicked) loose trees are
            // stored as the files they are.
            let bases = || finding.join().unwrap_or_default();
            read_all(&scan, &cache, bases, &keys, memo.as_deref(), batches)
        })
    });
    let mut stored = Ok(());
    while let Some(batch) = incoming.recv().await {
        if let Err(e) = store.store(PackKind::Data, batch.blobs).await {
            stored = Err(e);
            break;
        }
    }
    // Closing the channel stops the reader if storing failed.
    drop(incoming);
    let read = reader
        .await
        .map_err(|e| CheckpointError::Task(format!("the file reader failed: {e}")));
    stored?;
    let content =
        read?.map_err(|Cancelled| CheckpointError::Task("the file reader stopped early".into()))?;
    store.finish_pack(PackKind::Data).await?;
    tracing::debug!(
        files_read = content.files_read,
        bytes_read = content.bytes_read,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "contents stored"
    );
    Ok(content)
}

/// Reads what must be read and sends new blobs through `batches`. A
/// listing `memo` remembers keeps what it found then.
///
/// The loose git objects wait for `bases` (the trees a new loose tree can
/// be stored as a delta of, found meanwhile on another thread); every
/// other file is compared and read first.
pub fn read_all(
    scan: &Scan,
    cache: &FingerprintCache,
    bases: impl FnOnce() -> TreeBases,
    keys: &TenantKeys,
    memo: Option<&Memo>,
    batches: tokio::sync::mpsc::Sender<Batch>,
) -> Result<Content, Cancelled> {
    let unread: DirFiles = Arc::new(Vec::new());
    let mut content = Content {
        files: vec![unread; scan.dirs.len()],
        from_memo: vec![false; scan.dirs.len()],
        from_earlier: (0..scan.dirs.len()).map(|_| None).collect(),
        warnings: Vec::new(),
        files_read: 0,
        bytes_read: 0,
    };
    let started = std::time::Instant::now();
    let mut batcher = Batcher {
        sender: batches,
        cache,
        seen: HashSet::new(),
        pending: Batch::default(),
        pending_bytes: 0,
    };
    let (loose, other): (Vec<usize>, Vec<usize>) =
        (0..scan.dirs.len()).partition(|&d| gitobj::is_loose_object_dir(&scan.dirs[d].path));
    let compare = Comparer {
        scan,
        cache,
        keys,
        memo,
    };
    // No file outside a loose-object directory has a base.
    let to_read = compare.dirs(&mut content, other, &TreeBases::default());
    tracing::debug!(
        files = to_read.len(),
        dirs_reused = content.from_memo.iter().filter(|reused| **reused).count(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "fingerprints compared with the cache"
    );
    read_jobs(&mut content, &mut batcher, scan, keys, to_read)?;
    let to_read = compare.dirs(&mut content, loose, &bases());
    read_jobs(&mut content, &mut batcher, scan, keys, to_read)?;
    tracing::debug!(
        elapsed_ms = started.elapsed().as_millis() as u64,
        "files read"
    );
    batcher.flush()?;
    Ok(content)
}

/// What the files of a directory are compared with: the memo, then the cache.
struct Comparer<'a> {
    scan: &'a Scan,
    cache: &'a FingerprintCache,
    keys: &'a TenantKeys,
    memo: Option<&'a Memo>,
}

impl Comparer<'_> {
    /// Takes what the memo or the cache knows of the files of directories
    /// `dirs`, and returns the jobs that read the others.
    fn dirs(&self, content: &mut Content, dirs: Vec<usize>, bases: &TreeBases) -> Vec<Job> {
        let mut to_read = Vec::new();
        // One buffer for every path looked up: most files only are.
        let mut rel = Vec::new();
        for d in dirs {
            self.dir(content, &mut to_read, &mut rel, d, bases);
        }
        to_read
    }

    fn dir(
        &self,
        content: &mut Content,
        to_read: &mut Vec<Job>,
        rel: &mut Vec<u8>,
        d: usize,
        bases: &TreeBases,
    ) {
        let Self {
            scan,
            cache,
            keys,
            memo,
        } = *self;
        let dir = &scan.dirs[d];
        let remembered = memo
            .and_then(|memo| memo.get(dir))
            .filter(|outcome| !outcome.has_tree_deltas || bases_hold(dir, &outcome.files, bases));
        if let Some(outcome) = remembered {
            let files = match outcome.uncached {
                true => now_cacheable(dir, &outcome.files, scan.started),
                false => None,
            };
            content.files[d] = files.unwrap_or_else(|| outcome.files.clone());
            content.from_memo[d] = true;
            return;
        }
        content.files[d] = Arc::new(vec![None; dir.nodes.len()]);
        // Listed again since the last checkpoint: most of its files are
        // still what that one found, which costs less to tell than a
        // lookup of each in the cache.
        let earlier = memo.and_then(|memo| memo.earlier(&dir.path));
        let mut cursor = 0;
        for (n, node) in dir.nodes.iter().enumerate() {
            let NodeKind::File(fingerprint) = &node.kind else {
                continue;
            };
            // A delta is only as good as its base, found again below.
            if let Some(was) = earlier
                && let Some(same) = was.same_file(&node.name, fingerprint, &mut cursor)
                && !same.is_tree_delta()
            {
                fresh(&mut content.files[d])[n] = Some(FileContent {
                    meta: node.meta,
                    ..same.clone()
                });
                let taken = content.from_earlier[d].get_or_insert_with(|| TakenEarlier {
                    packs: was.packs.clone(),
                    nodes: vec![false; dir.nodes.len()],
                });
                taken.nodes[n] = true;
                continue;
            }
            join_rel_into(rel, &dir.path, &node.name);
            let rel = &rel[..];
            let abs = || scan.root.join(OsStr::from_bytes(rel));
            // A delta is only as good as its base, found again each time.
            let committed = |known: &&CachedFile| {
                known.chunks.iter().all(|c| cache.knows_blob(&c.id))
                    && match known.git {
                        Some(GitStored::TreeDelta { base, .. }) => {
                            bases.get(rel).is_some_and(|found| found.id == base)
                        }
                        _ => true,
                    }
            };
            // (what the cache knows, the fingerprint to remember it under)
            let reusable = match cache.lookup(rel, fingerprint).filter(committed) {
                Some(known) => Some((known, Some(*fingerprint))),
                None => cache
                    .file(rel)
                    .filter(committed)
                    .filter(|known| gitobj::is_pack_path(rel) && known.git.is_none())
                    .and_then(|known| {
                        let (unchanged, tail) = pack_unchanged(&abs(), fingerprint, known, keys);
                        content.bytes_read += tail;
                        // Known by its bytes, and remembered under its new
                        // times at once: a pack is never written in place.
                        unchanged.then_some((known, Some(*fingerprint)))
                    }),
            };
            match reusable {
                Some((known, cacheable)) => {
                    fresh(&mut content.files[d])[n] = Some(FileContent {
                        chunks: known.chunks.clone(),
                        size: fingerprint.size,
                        meta: node.meta,
                        cacheable,
                        git: known.git,
                    });
                }
                None => {
                    to_read.push(Job {
                        dir: d,
                        node: n,
                        abs: abs(),
                        tree_base: bases.get(rel).cloned(),
                        rel: rel.to_vec(),
                        size: fingerprint.size,
                    });
                }
            }
        }
    }
}

/// Reads `jobs` (small files in parallel) and records what they hold.
fn read_jobs(
    content: &mut Content,
    batcher: &mut Batcher<'_>,
    scan: &Scan,
    keys: &TenantKeys,
    jobs: Vec<Job>,
) -> Result<(), Cancelled> {
    let (small, large): (Vec<Job>, Vec<Job>) = jobs.into_iter().partition(|j| j.size <= LARGE_FILE);
    let mut deferred = Vec::new();
    for group in groups(small) {
        let results: Vec<(Job, Option<ReadResult>)> = group
            .into_par_iter()
            .map(|job| {
                let result = read_with_retry(&job, keys, &mut Collect, Some(LARGE_FILE));
                (job, result)
            })
            .collect();
        for (job, result) in results {
            match result {
                Some(result) => record(content, batcher, scan, job, result)?,
                None => deferred.push(job),
            }
        }
    }
    for job in large.into_iter().chain(deferred) {
        let result = read_with_retry(&job, keys, &mut Stream { batcher }, None)
            .expect("without a size limit every read has a result");
        record(content, batcher, scan, job, result)?;
    }
    Ok(())
}

/// The files of a directory this checkpoint works out itself.
fn fresh(files: &mut DirFiles) -> &mut Vec<Option<FileContent>> {
    Arc::get_mut(files).expect("a directory read by this checkpoint is not shared yet")
}

/// The memo's `files` of `dir` with the fingerprints that became cacheable
/// since they were read (None: none did). Remembering them is safe although
/// they were read within the racy window: the tracker has seen no write to
/// them since their listing, so what was read is what they hold, and any
/// later write moves their times past the fingerprint.
fn now_cacheable(
    dir: &ScannedDir,
    files: &DirFiles,
    scan_started: std::time::SystemTime,
) -> Option<DirFiles> {
    let mut upgraded: Option<Vec<Option<FileContent>>> = None;
    for (n, (node, file)) in dir.nodes.iter().zip(files.iter()).enumerate() {
        if let (NodeKind::File(fingerprint), Some(file)) = (&node.kind, file)
            && file.cacheable.is_none()
            && fingerprint.is_stable(scan_started)
        {
            let upgraded = upgraded.get_or_insert_with(|| files.to_vec());
            if let Some(file) = &mut upgraded[n] {
                file.cacheable = Some(*fingerprint);
            }
        }
    }
    upgraded.map(Arc::new)
}

/// Whether every loose tree in `files` that is stored as a delta still has
/// the base found for this checkpoint.
fn bases_hold(dir: &ScannedDir, files: &[Option<FileContent>], bases: &TreeBases) -> bool {
    dir.nodes.iter().zip(files).all(|(node, file)| match file {
        Some(FileContent {
            git: Some(GitStored::TreeDelta { base, .. }),
            ..
        }) => bases
            .get(&join_rel(&dir.path, &node.name))
            .is_some_and(|found| found.id == *base),
        _ => true,
    })
}

struct Job {
    dir: usize,
    node: usize,
    abs: PathBuf,
    rel: Vec<u8>,
    size: u64,
    /// For a loose git tree: the packed tree to store it against.
    tree_base: Option<Base>,
}

/// Whether the git pack at `abs` still holds what `known` recorded: same
/// device, inode, size and mode, and its last chunks (which hold the pack's
/// trailing checksum, see [`gitobj::is_pack_path`]) hash to the same ids.
/// Also returns how many bytes it read.
fn pack_unchanged(
    abs: &std::path::Path,
    now: &Fingerprint,
    known: &CachedFile,
    keys: &TenantKeys,
) -> (bool, u64) {
    use std::os::unix::fs::FileExt as _;
    let recorded: u64 = known.chunks.iter().map(|c| u64::from(c.len)).sum();
    if !known.fingerprint.same_file(now) || recorded != now.size {
        return (false, 0);
    }
    let mut tail = Vec::new();
    let mut offset = now.size;
    for chunk in known.chunks.iter().rev() {
        let Some(start) = offset.checked_sub(u64::from(chunk.len)) else {
            return (false, 0);
        };
        offset = start;
        tail.push((start, chunk));
        if now.size - offset >= gitobj::PACK_CHECKSUM_LEN {
            break;
        }
    }
    if now.size - offset < gitobj::PACK_CHECKSUM_LEN.min(now.size) {
        return (false, 0);
    }
    let Ok(file) = open_for_read(abs) else {
        return (false, 0);
    };
    if file.metadata().map(|m| Fingerprint::of(&m)).ok().as_ref() != Some(now) {
        return (false, 0);
    }
    let mut read = 0;
    for (start, chunk) in tail {
        let mut data = vec![0; chunk.len as usize];
        if file.read_exact_at(&mut data, start).is_err() {
            return (false, read);
        }
        read += data.len() as u64;
        if keys.blob_id(&data) != chunk.id {
            return (false, read);
        }
    }
    (true, read)
}

/// Splits small files into groups that are read in parallel.
fn groups(jobs: Vec<Job>) -> Vec<Vec<Job>> {
    let mut groups = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0u64;
    for job in jobs {
        bytes += job.size;
        current.push(job);
        if bytes >= GROUP_BYTES || current.len() >= GROUP_FILES {
            groups.push(std::mem::take(&mut current));
            bytes = 0;
        }
    }
    if !current.is_empty() {
        groups.push(current);
    }
    groups
}

/// Stores one file's outcome and passes its new chunks on.
fn record(
    content: &mut Content,
    batcher: &mut Batcher<'_>,
    scan: &Scan,
    job: Job,
    result: ReadResult,
) -> Result<(), Cancelled> {
    let shown = display_rel(&job.rel);
    match result {
        ReadResult::Read {
            read,
            held,
            changing,
        } => {
            content.files_read += 1;
            content.bytes_read += read.size;
            for (chunk, data) in held {
                batcher.offer(chunk.id, data)?;
            }
            // A git object or pack is named by what it holds and never
            // written in place: the racy window does not apply to it.
            let named_by_content = read.git.is_some() || gitobj::is_pack_path(&job.rel);
            let stable = !changing && (named_by_content || read.after.is_stable(scan.started));
            if changing {
                content.warnings.push(format!(
                    "{shown} kept changing while it was read; the checkpoint holds one of its states"
                ));
            }
            fresh(&mut content.files[job.dir])[job.node] = Some(FileContent {
                cacheable: stable.then_some(read.after),
                chunks: read.chunks.into(),
                size: read.size,
                meta: read.meta,
                git: read.git,
            });
        }
        ReadResult::Gone => {}
        ReadResult::Failed(e) => {
            content.warnings.push(format!(
                "cannot read {shown}: {e}; it is not in the checkpoint"
            ));
        }
        ReadResult::Cancelled => return Err(Cancelled),
    }
    Ok(())
}

/// Collects new chunks and sends them on in batches.
struct Batcher<'a> {
    sender: tokio::sync::mpsc::Sender<Batch>,
    cache: &'a FingerprintCache,
    seen: HashSet<BlobId>,
    pending: Batch,
    pending_bytes: usize,
}

impl Batcher<'_> {
    fn offer(&mut self, id: BlobId, data: Vec<u8>) -> Result<(), Cancelled> {
        if self.cache.knows_blob(&id) || !self.seen.insert(id) {
            return Ok(());
        }
        self.pending_bytes += data.len();
        self.pending.blobs.push((id, data));
        if self.pending_bytes >= BATCH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), Cancelled> {
        if self.pending.blobs.is_empty() {
            return Ok(());
        }
        self.pending_bytes = 0;
        self.sender
            .blocking_send(std::mem::take(&mut self.pending))
            .map_err(|_| Cancelled)
    }
}

/// Where the hashed chunks of a file go while it is read.
trait ChunkSink {
    /// Takes a window of hashed chunks; returns those it does not keep, which
    /// travel with the file's result (see [`ReadResult::Read`]).
    fn take(&mut self, window: Vec<Hashed>) -> Result<Vec<Hashed>, Cancelled>;
}

/// Keeps every chunk with the file (small files, read in parallel).
struct Collect;

impl ChunkSink for Collect {
    fn take(&mut self, window: Vec<Hashed>) -> Result<Vec<Hashed>, Cancelled> {
        Ok(window)
    }
}

/// Hands chunks straight to the batcher (large files, streamed).
struct Stream<'a, 'b> {
    batcher: &'a mut Batcher<'b>,
}

impl ChunkSink for Stream<'_, '_> {
    fn take(&mut self, window: Vec<Hashed>) -> Result<Vec<Hashed>, Cancelled> {
        for (chunk, data) in window {
            self.batcher.offer(chunk.id, data)?;
        }
        Ok(Vec::new())
    }
}

/// One completed read of a file.
struct ReadFile {
    chunks: Vec<ChunkRef>,
    size: u64,
    meta: Meta,
    /// The fingerprint matching what was read (taken after reading).
    after: Fingerprint,
    changed: bool,
    git: Option<GitStored>,
}

enum ReadResult {
    /// `held`: chunks the sink returned, still to be offered.
    Read {
        read: ReadFile,
        held: Vec<Hashed>,
        changing: bool,
    },
    /// Vanished or replaced by something that is not a regular file.
    Gone,
    Failed(io::Error),
    Cancelled,
}

enum ReadError {
    Gone,
    Io(io::Error),
    Cancelled,
    TooLarge,
}

/// Reads a file, once more if it changed meanwhile. None: the file is
/// larger than `size_limit` (it is read again later, streaming).
fn read_with_retry(
    job: &Job,
    keys: &TenantKeys,
    sink: &mut dyn ChunkSink,
    size_limit: Option<u64>,
) -> Option<ReadResult> {
    let mut attempt = 0;
    loop {
        match read_once(job, keys, sink, size_limit) {
            Ok((read, _)) if read.changed && attempt == 0 => {
                tracing::debug!(path = %display_rel(&job.rel), "file changed while being read; reading it again");
                attempt += 1;
            }
            Ok((read, held)) => {
                let changing = read.changed;
                return Some(ReadResult::Read {
                    read,
                    held,
                    changing,
                });
            }
            Err(ReadError::Gone) => return Some(ReadResult::Gone),
            Err(ReadError::Io(e)) => return Some(ReadResult::Failed(e)),
            Err(ReadError::Cancelled) => return Some(ReadResult::Cancelled),
            Err(ReadError::TooLarge) => return None,
        }
    }
}

fn open_regular(job: &Job) -> Result<(File, std::fs::Metadata), ReadError> {
    // A path that became a symlink is not followed out of the workspace; a
    // path that became a fifo does not hang the read.
    let file = open_for_read(&job.abs).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::ELOOP) | Some(libc::ENOTDIR) => ReadError::Gone,
        _ => ReadError::Io(e),
    })?;
    let meta = file.metadata().map_err(ReadError::Io)?;
    if !meta.is_file() {
        return Err(ReadError::Gone);
    }
    Ok((file, meta))
}

/// Hashes chunks in parallel windows and passes them to a sink.
struct Hasher<'a> {
    keys: &'a TenantKeys,
    sink: &'a mut dyn ChunkSink,
    window: Vec<Vec<u8>>,
    window_bytes: usize,
    chunks: Vec<ChunkRef>,
    held: Vec<Hashed>,
    cancelled: bool,
}

impl Hasher<'_> {
    fn push(&mut self, data: Vec<u8>) -> io::Result<()> {
        self.window_bytes += data.len();
        self.window.push(data);
        if self.window_bytes >= WINDOW_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.window_bytes = 0;
        let keys = self.keys;
        let hashed: Vec<Hashed> = std::mem::take(&mut self.window)
            .into_par_iter()
            .map(|data| {
                (
                    ChunkRef {
                        id: keys.blob_id(&data),
                        len: data.len() as u32,
                    },
                    data,
                )
            })
            .collect();
        self.chunks.extend(hashed.iter().map(|(c, _)| *c));
        match self.sink.take(hashed) {
            Ok(returned) => {
                self.held.extend(returned);
                Ok(())
            }
            Err(Cancelled) => {
                self.cancelled = true;
                Err(io::Error::other("the checkpoint was cancelled"))
            }
        }
    }
}

/// One read of a file, with the chunks the sink handed back.
fn read_once(
    job: &Job,
    keys: &TenantKeys,
    sink: &mut dyn ChunkSink,
    size_limit: Option<u64>,
) -> Result<(ReadFile, Vec<Hashed>), ReadError> {
    let (file, before_meta) = open_regular(job)?;
    if size_limit.is_some_and(|limit| before_meta.len() > limit) {
        return Err(ReadError::TooLarge);
    }
    let before = Fingerprint::of(&before_meta);
    let mut hasher = Hasher {
        keys,
        sink,
        window: Vec::new(),
        window_bytes: 0,
        chunks: Vec::new(),
        held: Vec::new(),
        cancelled: false,
    };
    let read = if gitobj::is_candidate(&job.rel, before.size) {
        read_loose_object(&file, before.size, job.tree_base.as_ref(), &mut hasher)
    } else {
        let granularity = chunker::Granularity::for_path(&job.rel);
        chunker::for_each_chunk(granularity, &file, before.size, |data| hasher.push(data))
            .map(|size| (size, None))
    }
    .and_then(|read| hasher.flush().map(|()| read));
    if hasher.cancelled {
        return Err(ReadError::Cancelled);
    }
    let (size, git) = read.map_err(ReadError::Io)?;
    let after_meta = file.metadata().map_err(ReadError::Io)?;
    let after = Fingerprint::of(&after_meta);
    let read = ReadFile {
        chunks: hasher.chunks,
        size,
        meta: Meta::of(&after_meta),
        after,
        changed: before != after || size != after.size,
        git,
    };
    Ok((read, hasher.held))
}

/// Reads a git loose object. A blob's content is chunked like a workspace
/// file (so it dedupes with the working-tree copy), a tree with a `base` is
/// stored as its delta against that base — each only when this runner
/// re-creates the stored bytes exactly; anything else as the bytes it is.
/// Returns the size on disk and how the object is stored.
fn read_loose_object(
    mut file: &File,
    size_hint: u64,
    base: Option<&Base>,
    hasher: &mut Hasher<'_>,
) -> io::Result<(u64, Option<GitStored>)> {
    use std::io::Read as _;
    let mut stored = Vec::with_capacity(size_hint as usize);
    file.read_to_end(&mut stored)?;
    let size = stored.len() as u64;
    let as_delta = |base: &Base| {
        let (level, tree) = gitobj::unpack_tree(&stored)?;
        let delta = gitobj::tree_delta(&base.content, &tree)?;
        // The restore must get these very bytes back.
        let again = gitobj::apply_delta(&base.content, &delta, tree.len()).ok()?;
        (again == tree).then_some((
            GitStored::TreeDelta {
                level,
                base: base.id,
            },
            delta,
        ))
    };
    let (git, chunked) = match base.filter(|b| !b.content.is_empty()).and_then(as_delta) {
        Some((git, delta)) => (Some(git), delta),
        None => match gitobj::unpack(&stored) {
            Some((level, content)) => (Some(GitStored::Blob { level }), content),
            None => (None, stored),
        },
    };
    let len = chunked.len() as u64;
    chunker::for_each_chunk(chunker::Granularity::Standard, &chunked[..], len, |data| {
        hasher.push(data)
    })?;
    Ok((size, git))
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::checkpoint::dir::DirTree;
    use crate::scan::{ScanOptions, scan};

    fn keys() -> TenantKeys {
        TenantKeys::derive("k", &[5; 32]).unwrap()
    }

    fn scan_of(root: &std::path::Path) -> Scan {
        let opts = ScanOptions {
            root: root.to_path_buf(),
            skip_ignored: false,
            excludes: vec![],
            exclude_paths: vec![],
        };
        scan(&opts, &|_| {}).unwrap()
    }

    /// Reads everything, gathering the batches it sends.
    fn read(scan: &Scan, cache: &FingerprintCache) -> (Content, Vec<(BlobId, Vec<u8>)>) {
        read_with(scan, cache, None)
    }

    /// Reads what neither `memo` nor `cache` knows, gathering the batches.
    fn read_with(
        scan: &Scan,
        cache: &FingerprintCache,
        memo: Option<&Memo>,
    ) -> (Content, Vec<(BlobId, Vec<u8>)>) {
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let keys = keys();
        std::thread::scope(|s| {
            let reader = s.spawn(|| read_all(scan, cache, TreeBases::default, &keys, memo, tx));
            let mut blobs = Vec::new();
            while let Some(batch) = rx.blocking_recv() {
                blobs.extend(batch.blobs);
            }
            (reader.join().unwrap().unwrap(), blobs)
        })
    }

    #[test]
    fn every_byte_is_covered_and_duplicates_are_sent_once() {
        let tmp = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..20_000_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        fs::write(tmp.path().join("big"), &big).unwrap();
        fs::write(tmp.path().join("a"), b"same").unwrap();
        fs::write(tmp.path().join("b"), b"same").unwrap();
        fs::write(tmp.path().join("empty"), b"").unwrap();
        let scan = scan_of(tmp.path());
        let cache = FingerprintCache::empty(tmp.path().join("unused"), "k");
        let (content, blobs) = read(&scan, &cache);

        let names: Vec<_> = scan.dirs[0].nodes.iter().map(|n| n.name.to_vec()).collect();
        assert_eq!(
            names,
            [
                b"a".to_vec(),
                b"b".to_vec(),
                b"big".to_vec(),
                b"empty".to_vec()
            ]
        );
        let files = &content.files[0];
        assert_eq!(
            files[0].as_ref().unwrap().chunks,
            files[1].as_ref().unwrap().chunks
        );
        assert!(files[3].as_ref().unwrap().chunks.is_empty());
        let big_file = files[2].as_ref().unwrap();
        assert_eq!(big_file.size, big.len() as u64);
        let by_id: std::collections::HashMap<_, _> = blobs.iter().map(|(id, d)| (*id, d)).collect();
        assert_eq!(by_id.len(), blobs.len(), "no blob is sent twice");
        let rebuilt: Vec<u8> = big_file
            .chunks
            .iter()
            .flat_map(|c| by_id[&c.id].iter().copied())
            .collect();
        assert!(rebuilt == big, "the chunks of a streamed file rebuild it");
        assert_eq!(content.files_read, 4);
        assert_eq!(content.bytes_read, big.len() as u64 + 8);
        assert!(content.warnings.is_empty());
    }

    #[test]
    fn cached_files_are_not_read_and_fresh_files_are_not_cached() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("old"), b"old content").unwrap();
        fs::write(tmp.path().join("new"), b"new content").unwrap();
        // Setting an old mtime would make the ctime new; instead "new" gets a
        // fresh mtime and the scan is dated well after both were written.
        let later = SystemTime::now() + Duration::from_secs(60);
        fs::File::options()
            .write(true)
            .open(tmp.path().join("new"))
            .unwrap()
            .set_modified(later)
            .unwrap();
        let cache = FingerprintCache::empty(tmp.path().join("unused"), "k");
        let mut scan = scan_of(tmp.path());
        scan.started = later;
        let (first, _) = read(&scan, &cache);
        let names: Vec<_> = scan.dirs[0].nodes.iter().map(|n| n.name.to_vec()).collect();
        assert_eq!(names, [b"new".to_vec(), b"old".to_vec()]);
        assert!(
            first.files[0][0].as_ref().unwrap().cacheable.is_none(),
            "just written: racy, not cached"
        );
        let old_entry = first.files[0][1]
            .as_ref()
            .unwrap()
            .cache_entry()
            .expect("old files are cached");

        // A cache that knows the old file and its blob: it is not read again.
        let mut cache = FingerprintCache::empty(tmp.path().join("unused"), "k");
        let pack = "ab".repeat(32).parse().unwrap();
        for chunk in old_entry.chunks.iter() {
            cache.insert_blob(chunk.id, &pack);
        }
        cache.insert_file(b"old".to_vec(), old_entry.clone());
        let (second, blobs) = read(&scan, &cache);
        assert_eq!(second.files_read, 1);
        assert_eq!(
            second.files[0][1].as_ref().unwrap().chunks,
            old_entry.chunks
        );
        assert_eq!(blobs.len(), 1, "only the new file's blob is new");

        // The same fingerprint whose blob is not known to be stored is read again.
        let mut forgetful = FingerprintCache::empty(tmp.path().join("unused"), "k");
        forgetful.insert_file(b"old".to_vec(), old_entry);
        let (third, _) = read(&scan, &forgetful);
        assert_eq!(third.files_read, 2);
    }

    /// A directory listed again since the last checkpoint takes what that
    /// one found for each file still the same, with a cache that knows
    /// nothing, and places them in that listing's packs; the changed file
    /// and a file with other times are read.
    #[test]
    fn a_directory_listed_again_takes_its_unchanged_files_from_the_memo() {
        let tmp = tempfile::tempdir().unwrap();
        for name in ["a", "b", "c"] {
            fs::write(tmp.path().join(name), name).unwrap();
        }
        let later = SystemTime::now() + Duration::from_secs(60);
        let mut first_scan = scan_of(tmp.path());
        first_scan.started = later;
        let first_scan = Arc::new(first_scan);
        let (first, _) = read(
            &first_scan,
            &FingerprintCache::empty(tmp.path().join("unused"), "k"),
        );
        assert_eq!(first.files_read, 3);
        // One directory, the root, without subdirectories.
        assert_eq!(first_scan.dirs.len(), 1);
        let trees = [DirTree::encode(
            &first_scan.dirs[0],
            &first.files[0],
            Vec::new(),
            &keys(),
            &mut |_, _| {},
        )];
        let packs: Vec<Arc<[PackId]>> = vec![Arc::from(Vec::new()); first_scan.dirs.len()];
        let workspace = cairn_proto::ids::WorkspaceId::generate();
        let memo = Memo::new(
            workspace,
            "k".into(),
            &first_scan,
            &first.files,
            &trees,
            &packs,
            None,
        );

        fs::write(tmp.path().join("b"), "changed").unwrap();
        fs::File::options()
            .write(true)
            .open(tmp.path().join("c"))
            .unwrap()
            .set_modified(later + Duration::from_secs(1))
            .unwrap();
        let mut second_scan = scan_of(tmp.path());
        second_scan.started = later;
        let nothing = FingerprintCache::empty(tmp.path().join("unused"), "k");
        let (second, _) = read_with(&second_scan, &nothing, Some(&memo));
        assert_eq!(second.files_read, 2, "b changed, c has other times");
        assert_eq!(
            second.files[0][0].as_ref().unwrap().chunks,
            first.files[0][0].as_ref().unwrap().chunks
        );
        assert_ne!(
            second.files[0][1].as_ref().unwrap().chunks,
            first.files[0][1].as_ref().unwrap().chunks
        );
        let taken = second.from_earlier[0]
            .as_ref()
            .expect("files taken from the memo");
        assert_eq!(taken.nodes, [true, false, false]);
    }

    /// A cache that knows everything `content` holds, as a committed checkpoint leaves it.
    fn cache_of(scan: &Scan, content: &Content, dir: &std::path::Path) -> FingerprintCache {
        let mut cache = FingerprintCache::empty(dir.join("unused"), "k");
        let pack = "ab".repeat(32).parse().unwrap();
        for (d, files) in content.files.iter().enumerate() {
            for (n, file) in files.iter().enumerate() {
                let Some(entry) = file.as_ref().and_then(FileContent::cache_entry) else {
                    continue;
                };
                for chunk in entry.chunks.iter() {
                    cache.insert_blob(chunk.id, &pack);
                }
                cache.insert_file(
                    join_rel(&scan.dirs[d].path, &scan.dirs[d].nodes[n].name),
                    entry,
                );
            }
        }
        cache
    }

    fn pack_of(scan: &Scan, content: &Content) -> (Vec<u8>, FileContent) {
        for (d, dir) in scan.dirs.iter().enumerate() {
            for (n, node) in dir.nodes.iter().enumerate() {
                let rel = join_rel(&dir.path, &node.name);
                if gitobj::is_pack_path(&rel) {
                    return (rel, content.files[d][n].clone().unwrap());
                }
            }
        }
        panic!("no pack in the scan");
    }

    #[test]
    fn a_git_pack_whose_times_moved_is_not_read_again_unless_its_checksum_changed() {
        use crate::git::testing::git;
        use std::os::unix::fs::{FileExt as _, PermissionsExt as _};

        let tmp = tempfile::tempdir().unwrap();
        let repo = tmp.path().join("repo");
        fs::create_dir(&repo).unwrap();
        git(&repo, &["init", "-q"]);
        // Incompressible content, so the pack spans several chunks.
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let noise: Vec<u8> = (0..(1 << 20))
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        fs::write(repo.join("noise.bin"), &noise).unwrap();
        git(&repo, &["add", "noise.bin"]);
        git(&repo, &["commit", "-qm", "noise"]);
        git(&repo, &["gc", "-q"]);
        let later = SystemTime::now() + Duration::from_secs(60);
        let mut scan = scan_of(tmp.path());
        scan.started = later;
        let (first, _) = read(
            &scan,
            &FingerprintCache::empty(tmp.path().join("unused"), "k"),
        );
        let (pack_rel, packed) = pack_of(&scan, &first);
        assert!(packed.chunks.len() > 1, "{:?}", packed.chunks);
        let cache = cache_of(&scan, &first, tmp.path());

        // Adding content that a pack already holds makes git freshen that
        // pack instead of writing the object: new times, same bytes.
        let pack_path = tmp.path().join(OsStr::from_bytes(&pack_rel));
        let before = fs::metadata(&pack_path).unwrap().modified().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        fs::write(repo.join("copy.bin"), &noise).unwrap();
        git(&repo, &["add", "copy.bin"]);
        let after = fs::metadata(&pack_path).unwrap().modified().unwrap();
        assert_ne!(before, after, "git freshened the pack");
        let mut scan = scan_of(tmp.path());
        scan.started = later;
        let (second, _) = read(&scan, &cache);
        let (_, repacked) = pack_of(&scan, &second);
        assert_eq!(repacked.chunks, packed.chunks);
        // copy.bin is new and read whole; of the pack, only its tail.
        assert!(
            second.bytes_read < noise.len() as u64 + packed.size / 2,
            "only the pack's tail was read: {} with a pack of {}",
            second.bytes_read,
            packed.size
        );

        // A pack whose checksum changed in place is read again.
        let mode = fs::metadata(&pack_path).unwrap().permissions();
        fs::set_permissions(&pack_path, fs::Permissions::from_mode(0o644)).unwrap();
        let file = fs::File::options().write(true).open(&pack_path).unwrap();
        let mut last = [0u8];
        fs::File::open(&pack_path)
            .unwrap()
            .read_exact_at(&mut last, packed.size - 1)
            .unwrap();
        file.write_all_at(&[last[0] ^ 1], packed.size - 1).unwrap();
        fs::set_permissions(&pack_path, mode).unwrap();
        let mut scan = scan_of(tmp.path());
        scan.started = later;
        let (third, _) = read(&scan, &cache);
        let (_, changed) = pack_of(&scan, &third);
        assert_ne!(changed.chunks, packed.chunks);
        assert!(third.bytes_read >= packed.size);
    }

    #[test]
    fn an_unreadable_file_is_left_out_with_a_warning() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("locked"), b"secret").unwrap();
        let scan = scan_of(tmp.path());
        let cache = FingerprintCache::empty(tmp.path().join("unused"), "k");
        let (sender, _receiver) = tokio::sync::mpsc::channel(1);
        let mut batcher = Batcher {
            sender,
            cache: &cache,
            seen: HashSet::new(),
            pending: Batch::default(),
            pending_bytes: 0,
        };
        let mut content = Content {
            files: vec![vec![None].into()],
            from_memo: vec![false],
            from_earlier: vec![None],
            warnings: vec![],
            files_read: 0,
            bytes_read: 0,
        };
        // Permission bits do not stop root, so the failed read is handed in directly.
        let job = Job {
            dir: 0,
            node: 0,
            abs: tmp.path().join("locked"),
            rel: b"locked".to_vec(),
            size: 6,
            tree_base: None,
        };
        let denied = io::Error::from(io::ErrorKind::PermissionDenied);
        record(
            &mut content,
            &mut batcher,
            &scan,
            job,
            ReadResult::Failed(denied),
        )
        .unwrap();
        assert!(content.files[0][0].is_none());
        assert_eq!(content.files_read, 0);
        assert_eq!(content.warnings.len(), 1);
        assert!(
            content.warnings[0].starts_with("cannot read locked: permission denied"),
            "{:?}",
            content.warnings
        );
    }

    /// A sink that appends to the file being read, the first `times` times it is called.
    struct Meddler {
        path: std::path::PathBuf,
        times: usize,
    }

    impl ChunkSink for Meddler {
        fn take(&mut self, window: Vec<Hashed>) -> Result<Vec<Hashed>, Cancelled> {
            if self.times > 0 {
                self.times -= 1;
                use std::io::Write;
                fs::OpenOptions::new()
                    .append(true)
                    .open(&self.path)
                    .unwrap()
                    .write_all(b"more")
                    .unwrap();
            }
            Ok(window)
        }
    }

    #[test]
    fn a_file_changed_during_its_read_is_read_again_and_if_it_keeps_changing_not_trusted() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("log");
        fs::write(&path, b"first line\n").unwrap();
        let job = Job {
            dir: 0,
            node: 0,
            abs: path.clone(),
            rel: b"log".to_vec(),
            size: 11,
            tree_base: None,
        };
        let keys = keys();

        let once = read_with_retry(
            &job,
            &keys,
            &mut Meddler {
                path: path.clone(),
                times: 1,
            },
            None,
        );
        let Some(ReadResult::Read {
            read,
            held,
            changing,
        }) = once
        else {
            panic!("the file was read")
        };
        assert!(!changing, "the second read saw a stable file");
        assert_eq!(read.size, 15);
        assert_eq!(
            held.iter().map(|(_, d)| d.clone()).collect::<Vec<_>>(),
            [b"first line\nmore".to_vec()]
        );

        let always = read_with_retry(
            &job,
            &keys,
            &mut Meddler {
                path: path.clone(),
                times: 2,
            },
            None,
        );
        let Some(ReadResult::Read { read, changing, .. }) = always else {
            panic!("the file was read")
        };
        assert!(changing);
        assert_eq!(read.size, 19, "what the last read saw is kept");

        let scan = scan_of(tmp.path());
        let cache = FingerprintCache::empty(tmp.path().join("unused"), "k");
        let (sender, _receiver) = tokio::sync::mpsc::channel(4);
        let mut batcher = Batcher {
            sender,
            cache: &cache,
            seen: HashSet::new(),
            pending: Batch::default(),
            pending_bytes: 0,
        };
        let mut content = Content {
            files: vec![vec![None].into()],
            from_memo: vec![false],
            from_earlier: vec![None],
            warnings: vec![],
            files_read: 0,
            bytes_read: 0,
        };
        let result = ReadResult::Read {
            read,
            held: Vec::new(),
            changing: true,
        };
        record(&mut content, &mut batcher, &scan, job, result).unwrap();
        let file = content.files[0][0].as_ref().unwrap();
        assert!(
            file.cacheable.is_none(),
            "a changing file's fingerprint is not cached"
        );
        assert_eq!(
            content.warnings,
            ["log kept changing while it was read; the checkpoint holds one of its states"]
        );
    }

    #[test]
    fn a_file_that_vanished_after_the_scan_is_just_gone() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("brief"), b"here for a moment").unwrap();
        let scan = scan_of(tmp.path());
        fs::remove_file(tmp.path().join("brief")).unwrap();
        let (content, blobs) = read(
            &scan,
            &FingerprintCache::empty(tmp.path().join("unused"), "k"),
        );
        assert!(content.files[0][0].is_none());
        assert!(content.warnings.is_empty());
        assert!(blobs.is_empty());
    }
}
