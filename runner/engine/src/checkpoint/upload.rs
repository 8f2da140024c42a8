//! The upload stage ([`Store`]): asking which new blobs the store lacks,
//! sealing those, packing them into spool files and uploading the packs as
//! they fill.
//!
//! A [`Packer`] writes one kind of pack (tree objects or file chunks, never
//! mixed) to a spool file and starts a new one at [`PACK_TARGET`] bytes. An
//! [`Uploader`] sends each finished pack through a signed URL while the
//! checkpoint goes on, at most [`PARALLEL_UPLOADS`] at a time; a URL that
//! expired before its turn (403) is replaced by a fresh one. A spool file is
//! deleted once uploaded, and the [`Spool`] directory with whatever is left
//! when the checkpoint ends, committed or not.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, BufWriter};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use cairn_proto::domain::PackKind;
use cairn_proto::ids::{BlobId, PackId, WorkspaceId};
use cairn_proto::pb;
use rand::Rng;
use rayon::prelude::*;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::remote::{self, Session};
use super::{CheckpointError, Stats};
use crate::cache::FastMap;
use crate::format::{PackBuilder, TenantKeys, seal};
use crate::task::blocking;
use crate::transfer::{BlobTransfer, TransferError};

/// A pack is finished once it holds about this many bytes.
pub const PACK_TARGET: u64 = 16 << 20;
/// Packs uploaded at the same time.
pub const PARALLEL_UPLOADS: usize = 4;
/// How many fresh URLs one pack may need (each 403 asks for another).
const URL_ATTEMPTS: u32 = 3;

/// This checkpoint's spool directory, removed with everything in it on drop.
#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
}

impl Spool {
    /// Creates `<cache_dir>/spool/<pid>-<random>/`, first removing the spools
    /// of runners that died without cleaning up (killed mid-checkpoint).
    pub fn create(cache_dir: &Path) -> io::Result<Self> {
        let parent = cache_dir.join("spool");
        Self::sweep_dead(&parent);
        let unique = format!(
            "{}-{:016x}",
            std::process::id(),
            rand::rng().random::<u64>()
        );
        let dir = parent.join(unique);
        fs::create_dir_all(&dir)?;
        Ok(Self { dir })
    }

    fn sweep_dead(parent: &Path) {
        let Ok(entries) = fs::read_dir(parent) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.split_once('-'))
                .map(|(pid, _)| pid)
            else {
                continue;
            };
            if pid.parse::<u32>().is_err() || Path::new("/proc").join(pid).exists() {
                continue;
            }
            match fs::remove_dir_all(entry.path()) {
                Ok(()) => {
                    tracing::debug!(spool = %entry.path().display(), "removed the spool of a runner that died")
                }
                Err(e) => {
                    tracing::debug!(spool = %entry.path().display(), error = %e, "cannot remove a stale spool")
                }
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.dir)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove the spool directory");
        }
    }
}

/// A finished pack waiting in the spool.
#[derive(Debug)]
pub struct SpooledPack {
    pub record: pb::NewPack,
    pub id: PackId,
    pub kind: PackKind,
    pub blob_ids: Vec<BlobId>,
    pub path: PathBuf,
}

/// Writes sealed blobs of one kind into packs of about [`PACK_TARGET`] bytes.
pub struct Packer {
    kind: PackKind,
    keys: Arc<TenantKeys>,
    dir: PathBuf,
    current: Option<(PackBuilder<BufWriter<File>>, PathBuf)>,
    written: u32,
}

impl Packer {
    pub fn new(kind: PackKind, keys: Arc<TenantKeys>, spool: &Spool) -> Self {
        Self {
            kind,
            keys,
            dir: spool.dir().to_path_buf(),
            current: None,
            written: 0,
        }
    }

    fn spool_error(path: &Path) -> impl FnOnce(io::Error) -> CheckpointError + '_ {
        move |source| CheckpointError::Spool {
            path: path.to_path_buf(),
            source,
        }
    }

    /// Adds one sealed blob; returns the pack it completed, if any.
    pub fn add(
        &mut self,
        id: BlobId,
        sealed: &[u8],
        plain_len: u32,
    ) -> Result<Option<SpooledPack>, CheckpointError> {
        let full = self.current.as_ref().is_some_and(|(builder, _)| {
            !builder.is_empty() && builder.len() + sealed.len() as u64 > PACK_TARGET
        });
        let finished = if full { self.finish()? } else { None };
        if self.current.is_none() {
            self.written += 1;
            let path = self
                .dir
                .join(format!("{}-{}.pack", self.kind, self.written));
            let file = File::create(&path).map_err(Self::spool_error(&path))?;
            let builder = PackBuilder::new(self.kind, BufWriter::with_capacity(1 << 20, file))
                .map_err(Self::spool_error(&path))?;
            self.current = Some((builder, path));
        }
        let (builder, path) = self.current.as_mut().expect("a pack was just started");
        builder
            .add(id, sealed, plain_len)
            .map_err(Self::spool_error(path))?;
        Ok(finished)
    }

    /// Finishes the pack being written, if it holds anything.
    pub fn finish(&mut self) -> Result<Option<SpooledPack>, CheckpointError> {
        let Some((builder, path)) = self.current.take() else {
            return Ok(None);
        };
        let done = builder
            .finish(&self.keys)
            .map_err(Self::spool_error(&path))?;
        done.sink.into_inner().map_err(|e| CheckpointError::Spool {
            path: path.clone(),
            source: e.into_error(),
        })?;
        let record = pb::NewPack {
            pack_id: done.id.to_string(),
            kind: pb::PackKind::from(done.kind) as i32,
            size: done.size,
            index_offset: done.index_offset,
            index_length: done.index_length,
            blob_ids: done
                .blob_ids
                .iter()
                .map(|id| id.as_bytes().to_vec())
                .collect(),
        };
        Ok(Some(SpooledPack {
            record,
            id: done.id,
            kind: done.kind,
            blob_ids: done.blob_ids,
            path,
        }))
    }
}

/// The upload stage: stores new blobs, asking which the store lacks,
/// sealing and packing those, and uploading every pack as it fills (at
/// most [`PARALLEL_UPLOADS`] at a time) while the content and trees stages
/// go on; [`Store::finish`] waits for the last uploads.
pub(crate) struct Store<'a> {
    session: &'a Session,
    /// Packs known to be gone: blobs the store places there are sent again.
    lost: &'a HashSet<PackId>,
    uploader: Uploader,
    /// One packer per kind; lent to a blocking task while it seals a batch.
    data: Option<Packer>,
    meta: Option<Packer>,
    /// Blobs of this checkpoint found in the store or written to a new pack.
    located: FastMap<BlobId, PackId>,
    stats: Stats,
}

impl<'a> Store<'a> {
    pub fn new(session: &'a Session, spool: &Spool, lost: &'a HashSet<PackId>) -> Self {
        Self {
            session,
            lost,
            uploader: Uploader::new(session),
            data: Some(Packer::new(PackKind::Data, session.keys.clone(), spool)),
            meta: Some(Packer::new(PackKind::Meta, session.keys.clone(), spool)),
            located: FastMap::default(),
            stats: Stats::default(),
        }
    }

    fn packer(&mut self, kind: PackKind) -> &mut Option<Packer> {
        match kind {
            PackKind::Data => &mut self.data,
            PackKind::Meta => &mut self.meta,
        }
    }

    pub async fn store(
        &mut self,
        kind: PackKind,
        blobs: Vec<(BlobId, Vec<u8>)>,
    ) -> Result<(), CheckpointError> {
        if blobs.is_empty() {
            return Ok(());
        }
        let ids: Vec<BlobId> = blobs.iter().map(|(id, _)| *id).collect();
        let present = self.session.find_missing(&ids).await?;
        let mut missing = Vec::new();
        for ((id, data), pack) in blobs.into_iter().zip(present) {
            match pack {
                Some(pack) if !self.lost.contains(&pack) => {
                    self.located.insert(id, pack);
                }
                _ => missing.push((id, data)),
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        self.stats.new_blobs += missing.len() as u64;
        self.stats.new_bytes += missing
            .iter()
            .map(|(_, data)| data.len() as u64)
            .sum::<u64>();
        let keys = self.session.keys.clone();
        let mut packer = self
            .packer(kind)
            .take()
            .expect("a failed batch ends the checkpoint, so the packer is back");
        let (packer, finished) = blocking(move || -> Result<_, CheckpointError> {
            let sealed: Vec<(BlobId, Vec<u8>, u32)> = missing
                .into_par_iter()
                .map(|(id, data)| {
                    // seal() reserves exactly what the sealed blob needs.
                    let mut out = Vec::new();
                    seal(&keys, &id, &data, &mut out);
                    (id, out, data.len() as u32)
                })
                .collect();
            let mut finished = Vec::new();
            for (id, bytes, plain_len) in sealed {
                finished.extend(packer.add(id, &bytes, plain_len)?);
            }
            Ok((packer, finished))
        })
        .await?;
        *self.packer(kind) = Some(packer);
        for pack in finished {
            self.upload(pack).await?;
        }
        Ok(())
    }

    /// Finishes and uploads the last pack of `kind`, if it holds anything.
    pub async fn finish_pack(&mut self, kind: PackKind) -> Result<(), CheckpointError> {
        let Some(mut packer) = self.packer(kind).take() else {
            return Ok(());
        };
        if let Some(pack) = packer.finish()? {
            self.upload(pack).await?;
        }
        Ok(())
    }

    async fn upload(&mut self, pack: SpooledPack) -> Result<(), CheckpointError> {
        for id in &pack.blob_ids {
            self.located.insert(*id, pack.id.clone());
        }
        self.stats.uploaded_bytes += pack.record.size;
        self.stats.packs_uploaded += 1;
        self.uploader.upload(pack).await
    }
    /// Waits for every upload: the end of the upload stage.
    pub async fn finish(self, started: Instant) -> Result<Uploaded, CheckpointError> {
        let Self {
            uploader,
            located,
            mut stats,
            ..
        } = self;
        let (new_packs, upload_wait) = uploader.finish().await?;
        stats.upload_wait_ms = upload_wait.as_millis() as u64;
        tracing::debug!(
            packs = new_packs.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "trees stored, uploads finished"
        );
        Ok(Uploaded {
            new_packs,
            located,
            stats,
        })
    }
}

/// What the upload stage stored.
pub(crate) struct Uploaded {
    /// The packs uploaded.
    pub new_packs: Vec<pb::NewPack>,
    /// Blobs of this checkpoint found in the store or written to a new pack.
    pub located: FastMap<BlobId, PackId>,
    /// New blobs, their bytes, and the packs uploaded, and how long the
    /// checkpoint waited for them.
    pub stats: Stats,
}

/// Uploads finished packs in the background, a few at a time.
pub struct Uploader {
    client: pb::checkpoint_service_client::CheckpointServiceClient<crate::client::AuthChannel>,
    workspace: WorkspaceId,
    transfer: BlobTransfer,
    slots: Arc<Semaphore>,
    tasks: JoinSet<Result<pb::NewPack, CheckpointError>>,
    uploaded: Vec<pb::NewPack>,
    /// How long the checkpoint waited on uploads (busy slots, the last ones).
    waited: std::time::Duration,
}

impl Uploader {
    pub fn new(session: &Session) -> Self {
        Self {
            client: session.client.clone(),
            workspace: session.workspace_id.clone(),
            transfer: BlobTransfer::default(),
            slots: Arc::new(Semaphore::new(PARALLEL_UPLOADS)),
            tasks: JoinSet::new(),
            uploaded: Vec::new(),
            waited: std::time::Duration::ZERO,
        }
    }

    fn collect(
        &mut self,
        joined: Result<Result<pb::NewPack, CheckpointError>, tokio::task::JoinError>,
    ) -> Result<(), CheckpointError> {
        let pack =
            joined.map_err(|e| CheckpointError::Task(format!("an upload task failed: {e}")))??;
        self.uploaded.push(pack);
        Ok(())
    }

    /// Starts uploading `pack`; waits while all upload slots are busy.
    pub async fn upload(&mut self, pack: SpooledPack) -> Result<(), CheckpointError> {
        while let Some(joined) = self.tasks.try_join_next() {
            self.collect(joined)?;
        }
        let waiting = std::time::Instant::now();
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        self.waited += waiting.elapsed();
        let client = self.client.clone();
        let workspace = self.workspace.clone();
        let transfer = self.transfer.clone();
        self.tasks.spawn(async move {
            let result = upload_one(&client, &workspace, &transfer, &pack).await;
            drop(slot);
            result.map(|()| pack.record)
        });
        Ok(())
    }

    /// Waits for every upload; returns the packs uploaded and how long
    /// the checkpoint waited on uploads in all.
    pub async fn finish(
        mut self,
    ) -> Result<(Vec<pb::NewPack>, std::time::Duration), CheckpointError> {
        let waiting = std::time::Instant::now();
        while let Some(joined) = self.tasks.join_next().await {
            self.collect(joined)?;
        }
        Ok((self.uploaded, self.waited + waiting.elapsed()))
    }
}

async fn upload_one(
    client: &pb::checkpoint_service_client::CheckpointServiceClient<crate::client::AuthChannel>,
    workspace: &WorkspaceId,
    transfer: &BlobTransfer,
    pack: &SpooledPack,
) -> Result<(), CheckpointError> {
    let upload = pb::PackUpload {
        pack_id: pack.id.to_string(),
        size: pack.record.size,
        kind: pb::PackKind::from(pack.kind) as i32,
    };
    let mut attempt = 1;
    loop {
        let url = remote::prepare_upload(client, workspace, upload.clone()).await?;
        match transfer.put_file(&url.url, &url.headers, &pack.path).await {
            Ok(()) => break,
            Err(TransferError::Forbidden { .. }) if attempt < URL_ATTEMPTS => {
                tracing::info!(pack = %pack.id, "the store refused the upload URL; asking for a fresh one");
                attempt += 1;
            }
            Err(source) => {
                return Err(CheckpointError::Upload {
                    pack: pack.id.clone(),
                    source,
                });
            }
        }
    }
    if let Err(e) = fs::remove_file(&pack.path) {
        tracing::debug!(path = %pack.path.display(), error = %e, "cannot remove an uploaded spool file");
    }
    tracing::debug!(pack = %pack.id, kind = %pack.kind, size = pack.record.size, "pack uploaded");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::format::{
        PACK_TRAILER_LEN, PackIndex, open, parse_pack_header, parse_trailer, seal,
    };

    #[test]
    fn packs_rotate_at_the_target_size_and_read_back() {
        let cache = tempfile::tempdir().unwrap();
        let spool = Spool::create(cache.path()).unwrap();
        let keys = Arc::new(TenantKeys::derive("k", &[1; 32]).unwrap());
        let mut packer = Packer::new(PackKind::Data, keys.clone(), &spool);
        let mut finished = Vec::new();
        let mut blobs = HashMap::new();
        // Incompressible 1 MiB blobs: a 16 MiB pack holds 15 of them.
        for i in 0..40u32 {
            let mut data = vec![0u8; 1 << 20];
            rand::rng().fill(&mut data[..]);
            data[..4].copy_from_slice(&i.to_le_bytes());
            let id = keys.blob_id(&data);
            let mut sealed = Vec::new();
            seal(&keys, &id, &data, &mut sealed);
            finished.extend(packer.add(id, &sealed, data.len() as u32).unwrap());
            blobs.insert(id, data);
        }
        finished.extend(packer.finish().unwrap());
        assert_eq!(finished.len(), 3);
        let mut seen = 0;
        for pack in &finished {
            let bytes = fs::read(&pack.path).unwrap();
            assert_eq!(bytes.len() as u64, pack.record.size);
            assert!(
                pack.record.size <= PACK_TARGET,
                "{} bytes",
                pack.record.size
            );
            assert_eq!(parse_pack_header(&pack.id, &bytes).unwrap(), PackKind::Data);
            let (offset, len) = parse_trailer(
                &pack.id,
                pack.record.size,
                &bytes[bytes.len() - PACK_TRAILER_LEN..],
            )
            .unwrap();
            let index = PackIndex::open(
                &keys,
                &pack.id,
                PackKind::Data,
                offset,
                &bytes[offset as usize..][..len as usize],
            )
            .unwrap();
            assert_eq!(
                index.entries.iter().map(|e| e.id).collect::<Vec<_>>(),
                pack.blob_ids
            );
            for entry in &index.entries {
                let sealed = &bytes[entry.offset as usize..][..entry.sealed_len as usize];
                assert_eq!(
                    open(&keys, &entry.id, sealed, entry.plain_len as usize).unwrap(),
                    blobs[&entry.id]
                );
                seen += 1;
            }
        }
        assert_eq!(seen, 40);
    }

    #[test]
    fn a_spool_is_removed_when_dropped_and_dead_runners_spools_are_swept() {
        let cache = tempfile::tempdir().unwrap();
        // No process has pid 4294967295; a live pid's spool is left alone.
        let dead = cache.path().join("spool").join("4294967295-00");
        let alive = cache
            .path()
            .join("spool")
            .join(format!("{}-00", std::process::id()));
        fs::create_dir_all(&dead).unwrap();
        fs::create_dir_all(&alive).unwrap();
        fs::write(dead.join("data-1.pack"), b"left over").unwrap();
        let spool = Spool::create(cache.path()).unwrap();
        assert!(!dead.exists());
        assert!(alive.exists());
        fs::write(spool.dir().join("data-1.pack"), b"x").unwrap();
        let dir = spool.dir().to_path_buf();
        drop(spool);
        assert!(!dir.exists());
    }
}
