//! The restore manifest: where it comes from and what it says, checked.
//!
//! The coordinator answers `GetRestoreManifest` with newest-first candidate
//! checkpoints, the packs they reference (size, kind, index range and a
//! signed GET URL) and the tenant keys their key ids name. Nothing in it is
//! trusted further than its shape: pack contents are verified against their
//! ids, and blobs against their keyed ids, when they arrive.

use std::collections::HashMap;
use std::sync::Arc;

use cairn_proto::domain::PackKind;
use cairn_proto::ids::{BlobId, CheckpointId, PackId, WorkspaceId};
use cairn_proto::pb;
use futures::future::BoxFuture;

use crate::client::CoordinatorClient;
use crate::format::TenantKeys;

/// Something that hands out restore manifests: the coordinator, or a test.
pub trait ManifestSource: Send + Sync {
    fn restore_manifest(
        &self,
        request: pb::GetRestoreManifestRequest,
    ) -> BoxFuture<'_, Result<pb::RestoreManifest, tonic::Status>>;
}

impl ManifestSource for CoordinatorClient {
    fn restore_manifest(
        &self,
        request: pb::GetRestoreManifestRequest,
    ) -> BoxFuture<'_, Result<pb::RestoreManifest, tonic::Status>> {
        let mut client = self.checkpoints.clone();
        Box::pin(async move { Ok(client.get_restore_manifest(request).await?.into_inner()) })
    }
}

/// A pack as the manifest describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackInfo {
    pub id: PackId,
    pub kind: PackKind,
    pub size: u64,
    pub index_offset: u64,
    pub index_length: u32,
}

/// One candidate checkpoint, as received.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The checkpoint id as sent (shown in messages even when malformed).
    pub id: String,
    pub checkpoint: pb::Checkpoint,
    pub packs: Vec<String>,
}

/// What a candidate needs to be restored, resolved against the manifest.
#[derive(Debug, Clone)]
pub struct ResolvedCandidate {
    pub id: CheckpointId,
    pub root_tree: BlobId,
    pub keys: Arc<TenantKeys>,
    pub packs: Vec<PackInfo>,
    /// When the checkpoint's runner began reading the workspace, if it said.
    pub scan_started: Option<std::time::SystemTime>,
}

/// A restore manifest, checked for shape.
#[derive(Debug)]
pub struct Manifest {
    pub workspace_id: WorkspaceId,
    pub candidates: Vec<Candidate>,
    pub packs: HashMap<PackId, PackInfo>,
    pub urls: HashMap<PackId, String>,
    keys: HashMap<String, Result<Arc<TenantKeys>, String>>,
}

/// The manifest as a whole is unusable.
#[derive(Debug, thiserror::Error)]
#[error("the coordinator's restore manifest is invalid: {0}")]
pub struct ManifestError(pub String);

impl Manifest {
    pub fn parse(manifest: pb::RestoreManifest) -> Result<Self, ManifestError> {
        let workspace_id = manifest
            .workspace_id
            .parse()
            .map_err(|e| ManifestError(format!("workspace id: {e}")))?;
        let keys = manifest
            .keys
            .into_iter()
            .map(|k| {
                let derived = TenantKeys::derive(k.key_id.clone(), &k.secret)
                    .map(Arc::new)
                    .map_err(|e| e.to_string());
                (k.key_id, derived)
            })
            .collect();
        let mut packs = HashMap::new();
        let mut urls = HashMap::new();
        for location in manifest.packs {
            let id: PackId = location
                .pack_id
                .parse()
                .map_err(|e| ManifestError(format!("pack location: {e}")))?;
            let kind = PackKind::try_from(location.kind)
                .map_err(|e| ManifestError(format!("pack {id}: {e}")))?;
            urls.insert(id.clone(), location.url);
            packs.insert(
                id.clone(),
                PackInfo {
                    id,
                    kind,
                    size: location.size,
                    index_offset: location.index_offset,
                    index_length: location.index_length,
                },
            );
        }
        let candidates = manifest
            .candidates
            .into_iter()
            .map(|c| {
                let checkpoint = c.checkpoint.unwrap_or_default();
                Candidate {
                    id: checkpoint.id.clone(),
                    checkpoint,
                    packs: c.packs,
                }
            })
            .collect();
        Ok(Self {
            workspace_id,
            candidates,
            packs,
            urls,
            keys,
        })
    }

    /// Resolves a candidate's ids, key and packs; the error is the reason it
    /// cannot be restored.
    pub fn resolve(&self, candidate: &Candidate) -> Result<ResolvedCandidate, String> {
        let id: CheckpointId = candidate.id.parse().map_err(|e| format!("{e}"))?;
        let checkpoint = &candidate.checkpoint;
        let supported = crate::format::FORMAT_VERSION;
        if checkpoint.format_version > supported {
            return Err(format!(
                "it is in checkpoint format {} and this runner reads up to {supported}",
                checkpoint.format_version
            ));
        }
        let root_tree = BlobId::from_slice(&checkpoint.root_tree)
            .map_err(|e| format!("its root tree id is invalid: {}", e.reason))?;
        let keys = match self.keys.get(&checkpoint.key_id) {
            Some(Ok(keys)) => keys.clone(),
            Some(Err(e)) => {
                return Err(format!("its key {:?} is unusable: {e}", checkpoint.key_id));
            }
            None => {
                return Err(format!(
                    "the manifest lacks its key {:?}",
                    checkpoint.key_id
                ));
            }
        };
        let mut packs = Vec::with_capacity(candidate.packs.len());
        for pack in &candidate.packs {
            let id: PackId = pack.parse().map_err(|e| format!("{e}"))?;
            let info = self
                .packs
                .get(&id)
                .ok_or_else(|| format!("the manifest has no location for its pack {id}"))?;
            packs.push(info.clone());
        }
        if !packs.iter().any(|p| p.kind == PackKind::Meta) {
            return Err("it references no META pack, so its trees cannot be read".into());
        }
        Ok(ResolvedCandidate {
            id,
            root_tree,
            keys,
            packs,
            scan_started: checkpoint
                .stats
                .as_ref()
                .and_then(|s| s.scan_started_at.as_ref())
                .map(cairn_proto::domain::from_timestamp),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn location(id: &PackId, kind: PackKind) -> pb::PackLocation {
        pb::PackLocation {
            pack_id: id.to_string(),
            kind: pb::PackKind::from(kind) as i32,
            size: 100,
            index_offset: 16,
            index_length: 64,
            url: format!("http://store/{id}"),
        }
    }

    #[test]
    fn candidates_resolve_or_say_why_not() {
        let meta = PackId::from_digest(&[1; 32]);
        let ck = CheckpointId::generate();
        let manifest = pb::RestoreManifest {
            workspace_id: WorkspaceId::generate().to_string(),
            keys: vec![pb::TenantKey {
                key_id: "k1".into(),
                secret: vec![3; 32],
            }],
            candidates: vec![
                pb::RestoreCandidate {
                    checkpoint: Some(pb::Checkpoint {
                        id: ck.to_string(),
                        root_tree: vec![5; 32],
                        key_id: "k1".into(),
                        format_version: 1,
                        ..Default::default()
                    }),
                    packs: vec![meta.to_string()],
                },
                pb::RestoreCandidate {
                    checkpoint: Some(pb::Checkpoint {
                        id: CheckpointId::generate().to_string(),
                        root_tree: vec![5; 32],
                        key_id: "k9".into(),
                        format_version: 1,
                        ..Default::default()
                    }),
                    packs: vec![meta.to_string()],
                },
            ],
            packs: vec![location(&meta, PackKind::Meta)],
            ..Default::default()
        };
        let manifest = Manifest::parse(manifest).unwrap();
        let good = manifest.resolve(&manifest.candidates[0]).unwrap();
        assert_eq!(good.id, ck);
        assert_eq!(good.root_tree, BlobId([5; 32]));
        assert_eq!(good.packs[0].index_length, 64);
        let bad = manifest.resolve(&manifest.candidates[1]).unwrap_err();
        assert!(bad.contains("k9"), "{bad}");
    }
}
