//! Writing a checked plan into the restore root.
//!
//! ```text
//! survey   (read only)  each planned directory that is a real directory on
//!                       disk listed once, parents first: names the plan
//!                       lacks are stale; planned files there are stat'ed
//!                       relative to the open directory, and those that
//!                       hold the planned content (fingerprint cache, the
//!                       recorded size and mtime, or the blob ids recomputed
//!                       from disk) are reused
//! prepare  (top-down)   stale entries removed; directories created, or
//!                       replaced when something else sits there; files to
//!                       rewrite unlinked; multi-chunk files created and
//!                       sized; metadata of reused files fixed
//! download (parallel)   coalesced ranged GETs per pack; each response opened
//!                       (AEAD + keyed digest) and written at its offsets off
//!                       the async threads; a file is finished (owner, mode,
//!                       mtime) by whichever write completes it
//! finish                symlinks (replacing what is there), directory
//!                       metadata bottom-up
//! ```
//!
//! A file already in the root is reused only when something vouches for
//! it: the fingerprint cache (inode and ctime included), or the checkpoint
//! itself, by the recorded size and mtime when that mtime lies two seconds
//! or more before the checkpoint's scan began
//! (`CheckpointStats.scan_started_at`, by the runner's clock). Any write
//! after the scan moved the mtime, so only a tool that sets mtimes back gets
//! past that check (`--verify-existing` reads those files too). Everything
//! else is read and its chunk ids recomputed.
//!
//! Nothing is written through a symlink or a hard link: directories are
//! verified or created parent first, files are created fresh with
//! `O_EXCL|O_NOFOLLOW` after the old entry is unlinked, and only files with a
//! single link are reused. Everything happens below the root, whose own mode
//! and mtime are left alone.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use cairn_proto::ids::{BlobId, PackId};
use rayon::prelude::*;

use crate::cache::{Fingerprint, FingerprintCache};
use crate::format::{self, ChunkRef, FormatError, TenantKeys};
use crate::gitobj::{self, GitStored};
use crate::scan::join_rel;

use super::fsops::{self, DiskKind, DiskStat, EntryMeta};
use super::plan::{Plan, PlanKind};

/// A problem on the local filesystem (not the checkpoint's fault).
#[derive(Debug, thiserror::Error)]
#[error("{action} {}: {source}", path.display())]
pub struct LocalError {
    pub action: &'static str,
    pub path: PathBuf,
    pub source: io::Error,
}

fn local<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LocalError + 'a {
    move |source| LocalError {
        action,
        path: path.to_owned(),
        source,
    }
}

/// What a restore writes into, shared with the blocking workers.
#[derive(Debug)]
pub(crate) struct Target {
    pub root: PathBuf,
    pub plan: Arc<Plan>,
    pub keys: Arc<TenantKeys>,
    /// Restore uid/gid (only when running as root).
    pub set_owner: bool,
    /// Relative paths never removed as extras (the runner's own cache dir).
    pub protected: Vec<Vec<u8>>,
    /// A file on disk with the size and mtime the checkpoint recorded is
    /// kept unread when that mtime lies before this second (see
    /// [`survey`]); `None`: every file is read.
    pub mtimes_settled_before: Option<i64>,
}

impl Target {
    fn path(&self, rel: &[u8]) -> PathBuf {
        if rel.is_empty() {
            self.root.clone()
        } else {
            self.root.join(std::ffi::OsStr::from_bytes(rel))
        }
    }
}

/// What sits at a planned file's path before the restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Existing {
    Nothing,
    Dir,
    /// A file, symlink or special file; `bytes` it occupies if a file.
    Other {
        bytes: u64,
    },
}

#[derive(Debug, Clone)]
pub(crate) enum FileState {
    /// The content on disk is the planned content.
    Reuse {
        meta_ok: bool,
        fingerprint: Fingerprint,
    },
    Write {
        existing: Existing,
    },
}

/// The survey's findings.
#[derive(Debug)]
pub(crate) struct Survey {
    pub root_exists: bool,
    /// Per plan entry; `None` for directories and symlinks.
    pub files: Vec<Option<FileState>>,
    /// What the directories on disk hold that the plan lacks (and that is
    /// not protected): `prepare` removes it.
    pub stale: Vec<PathBuf>,
    /// Planned directories already on disk as directories.
    pub dirs_present: u64,
}

/// Looks at the root without changing anything.
///
/// Every directory of the plan that is a real directory on disk (as are all
/// its ancestors) is listed once, parents before children and the
/// directories of one depth in parallel: a name the plan lacks is stale, a
/// planned file found there is looked at with a `stat` relative to the open
/// directory, and a planned file the listing lacks needs no look at all.
///
/// A file already at a planned path stays when it holds the planned content.
/// Two things vouch for that without reading it: `cache`, the runner's
/// fingerprint cache (the file is as the runner last saw it), and the
/// checkpoint itself when the file has the recorded size and mtime and that
/// mtime lies safely before the checkpoint's scan (an older copy baked into
/// an image with `cp -a`, `rsync -a` or a restore keeps both). That is rsync's
/// quick check with the racy window closed: any write after the scan moved
/// the mtime, so only a tool that sets mtimes back can fool it, and
/// `--verify-existing` turns it off. Every other file is read and its chunk
/// ids recomputed.
pub(crate) fn survey(
    target: &Target,
    cache: Option<&FingerprintCache>,
) -> Result<Survey, LocalError> {
    let plan = &target.plan;
    let mut survey = Survey {
        root_exists: false,
        files: plan
            .entries
            .iter()
            .map(|entry| {
                matches!(entry.kind, PlanKind::File { .. }).then_some(FileState::Write {
                    existing: Existing::Nothing,
                })
            })
            .collect(),
        stale: Vec::new(),
        dirs_present: 0,
    };
    // The root itself may be a symlink the operator chose; only below it is
    // nothing followed.
    match fs::metadata(&target.root) {
        Ok(meta) if meta.is_dir() => survey.root_exists = true,
        Ok(_) => {
            return Err(LocalError {
                action: "restoring into",
                path: target.root.clone(),
                source: io::Error::new(io::ErrorKind::NotADirectory, "the root is not a directory"),
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(survey),
        Err(e) => return Err(local("inspecting", &target.root)(e)),
    }
    // A directory is listed when the listing of its parent showed it as a
    // directory; below anything else, nothing on disk counts.
    let mut level = vec![None];
    while !level.is_empty() {
        let listed = on_io_pool(|| {
            level
                .par_iter()
                .map(|&dir| survey_dir(target, cache, dir))
                .collect::<Result<Vec<_>, LocalError>>()
        })?;
        level = Vec::new();
        for found in listed {
            for (i, state) in found.files {
                survey.files[i] = Some(state);
            }
            survey.dirs_present += found.dirs.len() as u64;
            level.extend(found.dirs.into_iter().map(Some));
            survey.stale.extend(found.stale);
        }
    }
    Ok(survey)
}

/// What the listing of one directory found.
#[derive(Default)]
struct DirFindings {
    /// Planned files that are there, with their state.
    files: Vec<(usize, FileState)>,
    /// Planned directories that are real directories there.
    dirs: Vec<usize>,
    stale: Vec<PathBuf>,
}

/// Lists directory `dir` of the plan (`None`: the root) and looks at what
/// it holds.
fn survey_dir(
    target: &Target,
    cache: Option<&FingerprintCache>,
    dir: Option<usize>,
) -> Result<DirFindings, LocalError> {
    let plan = &target.plan;
    let rel = plan.dir_path(dir);
    let path = target.path(rel);
    let opened = match dir {
        None => fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(&path),
        Some(_) => fsops::open_dir(&path),
    };
    let handle = match opened {
        Ok(handle) => handle,
        // Gone or replaced since its parent was listed: `prepare` makes it
        // anew, and it holds nothing yet.
        Err(e) if is_gone(&e) => return Ok(DirFindings::default()),
        Err(e) => return Err(local("listing", &path)(e)),
    };
    let mut listing = rustix::fs::Dir::new(std::os::fd::OwnedFd::from(handle))
        .map_err(|e| local("listing", &path)(e.into()))?;
    let mut found = DirFindings::default();
    while let Some(item) = listing.read() {
        let item = item.map_err(|e| local("listing", &path)(e.into()))?;
        let name = item.file_name();
        if matches!(name.to_bytes(), b"." | b"..") {
            continue;
        }
        let Some(i) = plan.child(dir, name.to_bytes()) else {
            let stale_rel = join_rel(rel, name.to_bytes());
            if !target.protected.contains(&stale_rel) {
                found.stale.push(target.path(&stale_rel));
            }
            continue;
        };
        let file_type = item.file_type();
        let fd = listing
            .fd()
            .map_err(|e| local("listing", &path)(e.into()))?;
        match &plan.entries[i].kind {
            PlanKind::Dir { .. } => {
                let is_dir = match file_type {
                    rustix::fs::FileType::Directory => true,
                    rustix::fs::FileType::Unknown => {
                        fsops::stat_in(fd, name).is_ok_and(|stat| stat.kind == DiskKind::Dir)
                    }
                    _ => false,
                };
                if is_dir {
                    found.dirs.push(i);
                }
            }
            PlanKind::File { .. } => {
                let state = if file_type == rustix::fs::FileType::Directory {
                    FileState::Write {
                        existing: Existing::Dir,
                    }
                } else {
                    match fsops::stat_in(fd, name) {
                        Ok(stat) => file_state(target, cache, i, &stat),
                        Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                        Err(e) => {
                            return Err(local("inspecting", &target.path(&plan.entries[i].path))(
                                e,
                            ));
                        }
                    }
                };
                found.files.push((i, state));
            }
            // `finish` looks at the few symlinks itself.
            PlanKind::Symlink { .. } => {}
        }
    }
    Ok(found)
}

/// Whether opening a directory failed because it is no longer one.
fn is_gone(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound
        || matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP))
}

/// What to do with plan file `i`, given what sits at its path.
fn file_state(
    target: &Target,
    cache: Option<&FingerprintCache>,
    i: usize,
    stat: &DiskStat,
) -> FileState {
    let entry = &target.plan.entries[i];
    let PlanKind::File { size, chunks, git } = &entry.kind else {
        unreachable!("only files are surveyed");
    };
    if stat.kind == DiskKind::Dir {
        return FileState::Write {
            existing: Existing::Dir,
        };
    }
    let want = OnDisk {
        size: *size,
        chunks,
        git: *git,
        meta: &entry.meta,
    };
    if let Some(fingerprint) = reusable(target, cache, &entry.path, stat, &want) {
        return FileState::Reuse {
            meta_ok: entry.meta.matches(stat, target.set_owner),
            fingerprint,
        };
    }
    let bytes = if stat.kind == DiskKind::File && stat.nlink == 1 {
        stat.fingerprint.size
    } else {
        0
    };
    FileState::Write {
        existing: Existing::Other { bytes },
    }
}

/// Threads for filesystem work on many entries at once: the survey, and
/// listing and finishing directories. More than the cores: an older copy
/// baked into an image is often not in the page cache, and then the work
/// waits on the disk rather than on the CPU.
const IO_THREADS: usize = 8;

/// Runs `f` (rayon work) on the restore's I/O pool, or on rayon's global
/// pool if that pool cannot be made.
fn on_io_pool<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    let pool = POOL.get_or_init(|| {
        let threads = IO_THREADS.max(rayon::current_num_threads());
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cairn-restore-io-{i}"))
            .build()
            .ok()
    });
    match pool {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

/// What a file of the plan must be on disk.
struct OnDisk<'a> {
    size: u64,
    chunks: &'a [ChunkRef],
    git: Option<GitStored>,
    meta: &'a EntryMeta,
}

/// The fingerprint of the file at `path` if it already holds what `want` says.
fn reusable(
    target: &Target,
    cache: Option<&FingerprintCache>,
    rel: &[u8],
    stat: &DiskStat,
    want: &OnDisk<'_>,
) -> Option<Fingerprint> {
    // A file with other links may be shared with something outside the
    // root; it is replaced rather than kept and re-permissioned.
    let fingerprint = stat.fingerprint;
    if stat.kind != DiskKind::File || fingerprint.size != want.size || stat.nlink != 1 {
        return None;
    }
    if let Some(cache) = cache
        && cache
            .lookup(rel, &fingerprint)
            .is_some_and(|known| *known.chunks == want.chunks[..] && known.git == want.git)
    {
        return Some(fingerprint);
    }
    if target
        .mtimes_settled_before
        .is_some_and(|settled| want.meta.mtime_sec < settled)
        && want.meta.mtime_matches(stat)
    {
        return Some(fingerprint);
    }
    let mut file = fsops::open_for_read(&target.path(rel)).ok()?;
    let matches = match want.git {
        Some(git) => {
            let mut stored = Vec::with_capacity(want.size as usize);
            file.read_to_end(&mut stored).ok()?;
            match git {
                // What the restore would write: the tree the file is named
                // after (its SHA-1), at the same level.
                GitStored::TreeDelta { level, .. } => {
                    gitobj::unpack_tree(&stored).is_some_and(|(found, tree)| {
                        found == level
                            && gitobj::loose_object_id(rel)
                                .is_some_and(|id| gitobj::tree_id(&tree) == Some(id))
                    })
                }
                GitStored::Blob { level } => {
                    gitobj::unpack(&stored).is_some_and(|(found, content)| {
                        let content_len: u64 = want.chunks.iter().map(|c| u64::from(c.len)).sum();
                        found == level
                            && content.len() as u64 == content_len
                            && holds_chunks(&target.keys, want.chunks, &content[..])
                    })
                }
            }
        }
        // The size check above makes the chunks cover the whole file.
        None => holds_chunks(&target.keys, want.chunks, &mut file),
    };
    // The file must not have changed while it was read.
    let after = Fingerprint::of(&file.metadata().ok()?);
    (matches && after == fingerprint).then_some(fingerprint)
}

/// Whether `source` starts with exactly the chunks `chunks`, in order.
fn holds_chunks(keys: &TenantKeys, chunks: &[ChunkRef], mut source: impl Read) -> bool {
    thread_local! {
        /// One buffer per survey thread for the tens of thousands of files
        /// it checks, instead of an allocation (and zeroing) per file.
        static CHUNK: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    CHUNK.with_borrow_mut(|buf| {
        let fits = chunks.iter().all(|chunk| {
            buf.resize(chunk.len as usize, 0);
            source.read_exact(buf).is_ok() && keys.verify_blob_id(&chunk.id, buf)
        });
        format::shrink_scratch(buf);
        fits
    })
}

/// A file the download writes.
#[derive(Debug)]
pub(crate) struct FileJob {
    pub plan_index: usize,
    pub path: PathBuf,
    meta: EntryMeta,
    /// Chunk writes still to come; the one that brings it to zero finishes the file.
    remaining: AtomicU32,
    /// A single-chunk file: created by its one write instead of in advance.
    create_on_write: bool,
    /// A git loose object stored by what it holds ([`crate::gitobj`]): a
    /// blob's content is deflated once all chunks are written; a tree delta
    /// waits for [`rebuild_git_trees`], when the packs it needs are written.
    git: Option<GitStored>,
    /// The bytes the chunks hold.
    content_len: u64,
    pub fingerprint: OnceLock<Fingerprint>,
}

/// What `prepare` leaves for the download and the report.
#[derive(Debug, Default)]
pub(crate) struct Prepared {
    pub jobs: Vec<FileJob>,
    /// Files kept as they were, with their fingerprint.
    pub reused: Vec<(usize, Fingerprint)>,
    /// Empty files, created and finished by `prepare`.
    pub created_empty: Vec<(usize, Fingerprint)>,
    /// Stale entries removed.
    pub removed: u64,
}

/// The directories `prepare` made: they hold only what the restore puts
/// there, so a directory inside one is made without a look first.
#[derive(Debug, Default)]
struct CreatedDirs {
    root: bool,
    /// Per plan entry.
    entries: Vec<bool>,
}

impl CreatedDirs {
    /// `dir`: a plan entry, or `None` for the root.
    fn contains(&self, dir: Option<usize>) -> bool {
        dir.map_or(self.root, |i| self.entries.get(i).copied().unwrap_or(false))
    }
}

/// Creates the directory skeleton and readies every file for the download.
pub(crate) fn prepare(target: &Target, survey: Survey) -> Result<Prepared, LocalError> {
    let plan = &target.plan;
    let mut created_dirs = CreatedDirs {
        root: !survey.root_exists,
        entries: vec![false; plan.entries.len()],
    };
    if created_dirs.root {
        fs::create_dir_all(&target.root).map_err(local("creating the root", &target.root))?;
    }
    // Stale entries first: they may hold the space the new files need.
    let removed = survey.stale.len() as u64;
    on_io_pool(|| {
        survey
            .stale
            .par_iter()
            .try_for_each(|path| fsops::remove_entry(path).map_err(local("removing", path)))
    })?;
    // Parents before children; the directories of one depth in parallel (a
    // restore into an empty root makes thousands, in different parents).
    for level in directories_by_depth(plan) {
        let made = on_io_pool(|| {
            level
                .par_iter()
                .map(|&i| {
                    let entry = &plan.entries[i];
                    ensure_dir(
                        &target.path(&entry.path),
                        created_dirs.contains(entry.parent),
                    )
                })
                .collect::<Result<Vec<bool>, LocalError>>()
        })?;
        for (i, made) in level.into_iter().zip(made) {
            created_dirs.entries[i] = made;
        }
    }
    let mut prepared = Prepared {
        removed,
        reused: Vec::with_capacity(plan.files as usize),
        ..Prepared::default()
    };
    for (i, (entry, state)) in plan.entries.iter().zip(survey.files).enumerate() {
        let (PlanKind::File { size, chunks, git }, Some(state)) = (&entry.kind, state) else {
            continue;
        };
        let existing = match state {
            // Most files of a restore onto an older copy: not even a path.
            FileState::Reuse {
                meta_ok: true,
                fingerprint,
            } => {
                prepared.reused.push((i, fingerprint));
                continue;
            }
            FileState::Reuse { meta_ok: false, .. } => {
                let path = target.path(&entry.path);
                match fix_meta(&path, &entry.meta, target.set_owner) {
                    Ok(fingerprint) => {
                        prepared.reused.push((i, fingerprint));
                        continue;
                    }
                    Err(e) => {
                        tracing::debug!(path = %path.display(), error = %e, "cannot fix the metadata of a matching file; rewriting it");
                        Existing::Other { bytes: 0 }
                    }
                }
            }
            FileState::Write { existing } => existing,
        };
        let path = target.path(&entry.path);
        if existing != Existing::Nothing {
            fsops::remove_entry(&path).map_err(local("removing", &path))?;
        }
        if *size == 0 {
            let file = fsops::create_new(&path, &entry.meta).map_err(local("creating", &path))?;
            let fingerprint = finish_file(&file, &path, &entry.meta, target.set_owner)?;
            prepared.created_empty.push((i, fingerprint));
            continue;
        }
        let create_on_write = chunks.len() == 1;
        let content_len: u64 = chunks.iter().map(|c| u64::from(c.len)).sum();
        if !create_on_write {
            let file = fsops::create_new(&path, &entry.meta).map_err(local("creating", &path))?;
            file.set_len(content_len).map_err(local("sizing", &path))?;
        }
        prepared.jobs.push(FileJob {
            plan_index: i,
            path,
            meta: entry.meta,
            remaining: AtomicU32::new(chunks.len() as u32),
            create_on_write,
            git: *git,
            content_len,
            fingerprint: OnceLock::new(),
        });
    }
    Ok(prepared)
}

/// Makes `path` a real directory the restore can write into; `true` if it
/// had to create it. When its parent is one this restore made
/// (`parent_made`), which holds only what the restore put there, one
/// `mkdir` does without a look first (a restore into an empty root makes
/// thousands); what is found there anyway is inspected like any other path.
fn ensure_dir(path: &Path, parent_made: bool) -> Result<bool, LocalError> {
    let mkdir = || fs::DirBuilder::new().mode(0o700).create(path);
    if parent_made {
        match mkdir() {
            Ok(()) => return Ok(true),
            // Something else wrote into the root meanwhile.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(local("creating directory", path)(e)),
        }
    }
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_dir() => {
            if meta.mode() & 0o700 != 0o700 {
                // Final modes are set at the end; until then the owner writes.
                fs::set_permissions(
                    path,
                    fs::Permissions::from_mode((meta.mode() | 0o700) & 0o7777),
                )
                .map_err(local("making writable", path))?;
            }
            return Ok(false);
        }
        Ok(_) => fsops::remove_entry(path).map_err(local("removing", path))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(local("inspecting", path)(e)),
    }
    mkdir().map_err(local("creating directory", path))?;
    Ok(true)
}

fn fix_meta(path: &Path, meta: &EntryMeta, set_owner: bool) -> io::Result<Fingerprint> {
    let file = fsops::open_for_read(path)?;
    if !file.metadata()?.file_type().is_file() {
        return Err(io::Error::other("no longer a regular file"));
    }
    fsops::apply_meta(&file, meta, set_owner)?;
    Ok(Fingerprint::of(&file.metadata()?))
}

/// Gives a file this restore created ([`fsops::create_new`]) its mtime, and
/// its owner and mode where creation did not already (a umask, set-id bits,
/// another owner): most files need two calls here, not four.
fn finish_file(
    file: &fs::File,
    path: &Path,
    meta: &EntryMeta,
    set_owner: bool,
) -> Result<Fingerprint, LocalError> {
    file.set_modified(meta.mtime())
        .map_err(local("setting the mtime of", path))?;
    let after = DiskStat::from(&file.metadata().map_err(local("inspecting", path))?);
    if meta.matches(&after, set_owner) {
        return Ok(after.fingerprint);
    }
    fsops::apply_meta(file, meta, set_owner).map_err(local("setting metadata of", path))?;
    let after = file.metadata().map_err(local("inspecting", path))?;
    Ok(Fingerprint::of(&after))
}

/// A blob the download needs and where its plaintext goes.
#[derive(Debug, Clone)]
pub(crate) struct NeededBlob {
    pub id: BlobId,
    pub plain_len: u32,
    /// (file job, offset in the file)
    pub targets: Vec<(usize, u64)>,
}

/// Why writing one downloaded range failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SpanError {
    #[error("pack {pack}: {source}")]
    Blob { pack: PackId, source: FormatError },
    #[error(transparent)]
    Local(#[from] LocalError),
}

/// The download side shared by all blocking writers.
#[derive(Debug)]
pub(crate) struct Writers {
    pub jobs: Vec<FileJob>,
    pub keys: Arc<TenantKeys>,
    pub set_owner: bool,
    /// Set on the first failure so that writers still queued stop early.
    pub cancelled: AtomicBool,
}

/// What one range's writes achieved.
#[derive(Debug, Default)]
pub(crate) struct SpanDone {
    pub bytes: u64,
    pub files: u64,
    /// Blobs that did not verify and were not written ([`BadBlob::Collect`]).
    pub bad: Vec<(u64, u64, NeededBlob)>,
}

/// What a blob that does not verify means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BadBlob {
    /// The checkpoint is broken (bytes from the store): fail.
    Fail,
    /// The bytes came from the pack cache: note the blob for the store.
    Collect,
}

/// Opens every blob of one downloaded range and writes it to its files.
/// `items` are `(offset in pack, sealed length, blob)`.
pub(crate) fn write_span(
    writers: &Writers,
    pack: &PackId,
    start: u64,
    bytes: &[u8],
    items: &[(u64, u64, NeededBlob)],
    on_bad: BadBlob,
) -> Result<SpanDone, SpanError> {
    format::Opener::with(|opener| {
        let mut done = SpanDone::default();
        let mut open_files: HashMap<usize, fs::File> = HashMap::new();
        for (offset, sealed_len, blob) in items {
            if writers.cancelled.load(Ordering::Relaxed) {
                break;
            }
            let at = (offset - start) as usize;
            let sealed = &bytes[at..at + *sealed_len as usize];
            let plain = match opener.open(&writers.keys, &blob.id, sealed, blob.plain_len as usize)
            {
                Ok(plain) => plain,
                Err(_) if on_bad == BadBlob::Collect => {
                    // Nothing of it was written; the store's copy will be.
                    done.bad.push((*offset, *sealed_len, blob.clone()));
                    continue;
                }
                Err(source) => {
                    return Err(SpanError::Blob {
                        pack: pack.clone(),
                        source,
                    });
                }
            };
            for &(job_index, file_offset) in &blob.targets {
                let job = &writers.jobs[job_index];
                if job.create_on_write {
                    let mut file = fsops::create_new(&job.path, &job.meta)
                        .map_err(local("creating", &job.path))?;
                    match job.git {
                        Some(GitStored::Blob { level }) => file.write_all(
                            &gitobj::pack(level, plain)
                                .map_err(local("compressing the git object", &job.path))?,
                        ),
                        Some(GitStored::TreeDelta { .. }) | None => file.write_all(plain),
                    }
                    .map_err(local("writing", &job.path))?;
                    if !job.waits_for_base() {
                        let fingerprint =
                            finish_file(&file, &job.path, &job.meta, writers.set_owner)?;
                        let _ = job.fingerprint.set(fingerprint);
                        done.files += 1;
                    }
                } else {
                    let file = match open_files.entry(job_index) {
                        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                        std::collections::hash_map::Entry::Vacant(e) => e.insert(
                            fsops::open_for_write(&job.path)
                                .map_err(local("opening", &job.path))?,
                        ),
                    };
                    file.write_all_at(plain, file_offset)
                        .map_err(local("writing", &job.path))?;
                    if job.remaining.fetch_sub(1, Ordering::AcqRel) == 1 && !job.waits_for_base() {
                        if let Some(GitStored::Blob { level }) = job.git {
                            deflate_in_place(file, &job.path, level, job.content_len)?;
                        }
                        let fingerprint =
                            finish_file(file, &job.path, &job.meta, writers.set_owner)?;
                        let _ = job.fingerprint.set(fingerprint);
                        done.files += 1;
                    }
                }
                done.bytes += plain.len() as u64;
            }
        }
        Ok(done)
    })
}

impl FileJob {
    fn waits_for_base(&self) -> bool {
        matches!(self.git, Some(GitStored::TreeDelta { .. }))
    }
}

/// Why a git tree stored as a delta could not be rebuilt: the checkpoint's
/// fault (its base is not in the restored packs, or the result is not the
/// tree the file is named after).
#[derive(Debug, thiserror::Error)]
#[error("{path}: cannot rebuild the git tree: {reason}")]
pub struct GitTreeError {
    pub path: String,
    pub reason: String,
}

/// Why rebuilding git trees stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RebuildError {
    #[error(transparent)]
    Tree(#[from] GitTreeError),
    #[error(transparent)]
    Local(#[from] LocalError),
}

/// Rebuilds every loose git tree stored as a delta, now that the packs
/// holding their bases are written: base from the restored repository,
/// delta applied, id checked against the file's name, deflated, finished.
/// Returns how many files it finished.
///
/// Trees are rebuilt in parallel (inflating the base and deflating the tree
/// is CPU work, and nothing else is left to overlap it with); each thread
/// opens its own object database per repository.
pub(crate) fn rebuild_git_trees(writers: &Writers) -> Result<u64, RebuildError> {
    let waiting: Vec<(&FileJob, u8, [u8; 20])> = writers
        .jobs
        .iter()
        .filter_map(|job| match job.git {
            Some(GitStored::TreeDelta { level, base }) => Some((job, level, base)),
            _ => None,
        })
        .collect();
    waiting
        .par_iter()
        .try_for_each_init(HashMap::new, |odbs, &(job, level, base)| {
            rebuild_git_tree(writers, odbs, job, level, base)
        })?;
    Ok(waiting.len() as u64)
}

/// Rebuilds one tree (see [`rebuild_git_trees`]) from the tree `base` of
/// its repository, deflating it at `level`.
fn rebuild_git_tree(
    writers: &Writers,
    odbs: &mut HashMap<PathBuf, git2::Odb<'static>>,
    job: &FileJob,
    level: u8,
    base: [u8; 20],
) -> Result<(), RebuildError> {
    let fail = |reason: String| GitTreeError {
        path: job.path.display().to_string(),
        reason,
    };
    let objects = job
        .path
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| fail("not inside an objects directory".into()))?;
    let odb = match odbs.entry(objects.to_path_buf()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            // Objects are read from this repository's own packs only.
            if objects.join("info/alternates").exists() {
                return Err(fail("the repository borrows objects (info/alternates)".into()).into());
            }
            let odb = git2::Odb::new().map_err(|e| fail(e.to_string()))?;
            odb.add_disk_alternate(&objects.to_string_lossy())
                .map_err(|e| fail(e.to_string()))?;
            e.insert(odb)
        }
    };
    let base_id = git2::Oid::from_bytes(&base).map_err(|e| fail(e.to_string()))?;
    let base_tree = odb.read(base_id).map_err(|e| {
        fail(format!(
            "its base tree {base_id} is not in the restored repository: {e}"
        ))
    })?;
    let file = fsops::open_for_write(&job.path).map_err(local("opening", &job.path))?;
    let mut delta = vec![0; job.content_len as usize];
    file.read_exact_at(&mut delta, 0)
        .map_err(local("reading back", &job.path))?;
    let tree = gitobj::apply_delta(base_tree.data(), &delta, gitobj::MAX_CONTENT as usize)
        .map_err(|e| fail(e.to_string()))?;
    let rel = job.path.as_os_str().as_bytes();
    if gitobj::tree_id(&tree) != gitobj::loose_object_id(rel) {
        return Err(
            fail("the rebuilt tree does not have the id the file is named after".into()).into(),
        );
    }
    let stored = gitobj::pack_object("tree", level, &tree)
        .map_err(local("compressing the git object", &job.path))?;
    file.write_all_at(&stored, 0)
        .map_err(local("writing", &job.path))?;
    file.set_len(stored.len() as u64)
        .map_err(local("sizing", &job.path))?;
    let fingerprint = finish_file(&file, &job.path, &job.meta, writers.set_owner)?;
    let _ = job.fingerprint.set(fingerprint);
    Ok(())
}

/// Turns a file holding a git blob's content into its loose object.
fn deflate_in_place(
    file: &fs::File,
    path: &Path,
    level: u8,
    content_len: u64,
) -> Result<(), LocalError> {
    let mut content = vec![0; content_len as usize];
    file.read_exact_at(&mut content, 0)
        .map_err(local("reading back", path))?;
    let stored =
        gitobj::pack(level, &content).map_err(local("compressing the git object", path))?;
    file.write_all_at(&stored, 0)
        .map_err(local("writing", path))?;
    file.set_len(stored.len() as u64)
        .map_err(local("sizing", path))
}

/// Symlinks and directory metadata.
pub(crate) fn finish(target: &Target) -> Result<(), LocalError> {
    place_symlinks(target)?;
    on_io_pool(|| set_directory_metadata(target))
}

fn place_symlinks(target: &Target) -> Result<(), LocalError> {
    for entry in &target.plan.entries {
        let PlanKind::Symlink {
            target: link_target,
        } = &entry.kind
        else {
            continue;
        };
        let path = target.path(&entry.path);
        let link_target = std::ffi::OsStr::from_bytes(link_target);
        let in_place = match fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_symlink() => {
                fs::read_link(&path).is_ok_and(|current| current.as_os_str() == link_target)
            }
            _ => false,
        };
        if !in_place {
            fsops::remove_entry(&path).map_err(local("removing", &path))?;
            std::os::unix::fs::symlink(link_target, &path)
                .map_err(local("creating symlink", &path))?;
        }
        if target.set_owner {
            std::os::unix::fs::lchown(&path, Some(entry.meta.uid), Some(entry.meta.gid))
                .map_err(local("setting the owner of", &path))?;
        }
        fsops::set_symlink_mtime(&path, &entry.meta)
            .map_err(local("setting the mtime of", &path))?;
    }
    Ok(())
}

/// Gives every directory its mode, owner and mtime, deepest first: its
/// contents are final, and a mode that takes away search permission must
/// not come before the directories below it are reached by path. The
/// directories of one depth go in parallel.
fn set_directory_metadata(target: &Target) -> Result<(), LocalError> {
    let plan = &target.plan;
    for level in directories_by_depth(plan).iter().rev() {
        level.par_iter().try_for_each(|&i| {
            let entry = &plan.entries[i];
            let path = target.path(&entry.path);
            let dir = fsops::open_dir(&path).map_err(local("opening", &path))?;
            fsops::apply_meta(&dir, &entry.meta, target.set_owner)
                .map_err(local("setting metadata of", &path))
        })?;
    }
    Ok(())
}

/// The plan's directories grouped by depth, the root's children first.
fn directories_by_depth(plan: &Plan) -> Vec<Vec<usize>> {
    // Plan entries come after their parent, so one pass gives every depth.
    let mut depth = vec![0usize; plan.entries.len()];
    let mut by_depth: Vec<Vec<usize>> = Vec::new();
    for (i, entry) in plan.entries.iter().enumerate() {
        if !matches!(entry.kind, PlanKind::Dir { .. }) {
            continue;
        }
        depth[i] = entry.parent.map_or(0, |p| depth[p] + 1);
        if by_depth.len() <= depth[i] {
            by_depth.resize_with(depth[i] + 1, Vec::new);
        }
        by_depth[depth[i]].push(i);
    }
    by_depth
}

/// Relative paths of `inner` and its ancestors below `root`, if `inner` lies
/// inside `root` (compared after resolving both as far as they exist: the
/// runner's cache directory may be made only when the restore saves it).
pub(crate) fn protected_paths(root: &Path, inner: &Path) -> Vec<Vec<u8>> {
    let (Some(root), Some(inner)) = (resolve_existing(root), resolve_existing(inner)) else {
        return Vec::new();
    };
    let Ok(rel) = inner.strip_prefix(&root) else {
        return Vec::new();
    };
    let mut paths = Vec::new();
    let mut current = Vec::new();
    for component in rel.components() {
        if !current.is_empty() {
            current.push(b'/');
        }
        current.extend_from_slice(component.as_os_str().as_bytes());
        paths.push(current.clone());
    }
    paths
}

/// `path` made absolute with its longest existing ancestor resolved
/// (symlinks followed) and the rest appended as written; `None` if the rest
/// is not plain names.
fn resolve_existing(path: &Path) -> Option<PathBuf> {
    let absolute = std::path::absolute(path).ok()?;
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(resolved) = existing.canonicalize() {
            let mut out = resolved;
            for name in rest.iter().rev() {
                out.push(name);
            }
            return Some(out);
        }
        match existing.components().next_back()? {
            std::path::Component::Normal(name) => rest.push(name.to_owned()),
            _ => return None,
        }
        existing = existing.parent()?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_dir_inside_the_root_is_protected_with_its_ancestors() {
        let dir = tempfile::tempdir().unwrap();
        let inner = dir.path().join(".cache/cairn");
        let expected = [b".cache".to_vec(), b".cache/cairn".to_vec()];
        // Before the cache directory exists, and through a symlinked root.
        assert_eq!(protected_paths(dir.path(), &inner), expected);
        fs::create_dir_all(&inner).unwrap();
        assert_eq!(protected_paths(dir.path(), &inner), expected);
        let link = tempfile::tempdir().unwrap();
        let linked_root = link.path().join("root");
        std::os::unix::fs::symlink(dir.path(), &linked_root).unwrap();
        assert_eq!(protected_paths(&linked_root, &inner), expected);
        assert_eq!(
            protected_paths(dir.path(), &linked_root.join(".cache/cairn/x")),
            [
                b".cache".to_vec(),
                b".cache/cairn".to_vec(),
                b".cache/cairn/x".to_vec()
            ]
        );
        let elsewhere = tempfile::tempdir().unwrap();
        assert!(protected_paths(dir.path(), elsewhere.path()).is_empty());
        assert!(protected_paths(dir.path(), &elsewhere.path().join("new")).is_empty());
    }

    #[test]
    fn ensure_dir_replaces_a_symlink_without_touching_its_target() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        let link = dir.path().join("a");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        ensure_dir(&link, false).unwrap();
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_dir());
        assert!(outside.is_dir(), "the link's target stays");
        assert_eq!(fs::read_dir(&outside).unwrap().count(), 0);
    }

    #[test]
    fn a_directory_in_a_new_parent_is_made_and_whatever_appeared_there_is_inspected() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ensure_dir(&dir.path().join("fresh"), true).unwrap());
        assert!(dir.path().join("fresh").is_dir());

        // Something put a symlink there after the parent was made.
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        let link = dir.path().join("raced");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        assert!(ensure_dir(&link, true).unwrap());
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_dir());
        assert!(outside.is_dir(), "the link's target stays");

        fs::create_dir(dir.path().join("there")).unwrap();
        assert!(
            !ensure_dir(&dir.path().join("there"), true).unwrap(),
            "a real directory already there is kept, not counted as made"
        );
    }
}
