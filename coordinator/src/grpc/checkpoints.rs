//! `cairn.v1.CheckpointService`: the checkpoint protocol.
//!
//! Begin (keys, generation, parent) → FindMissingBlobs → PrepareUploads
//! (signed PUT URLs; the runner uploads) → CommitCheckpoint (every pack
//! checked in the store, then one transaction) → ListCheckpoints /
//! GetCheckpoint / GetRestoreManifest (newest-first candidates with signed GET
//! URLs). The coordinator sees ids, sizes and pack names, never bytes.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::SystemTime;

use cairn_proto::domain::{
    CommitCheckpoint, CompactPacks, PackKind, WorkspaceRef, WorkspaceState, to_timestamp,
};
use cairn_proto::ids::{BlobId, CheckpointId, Generation, PackId};
use cairn_proto::pb;
use cairn_proto::pb::checkpoint_service_server::CheckpointService;
use cairn_proto::refusal::Refusal;
use futures::{StreamExt, TryStreamExt};
use prost::Message;
use tonic::{Request, Response, Status};

use super::{
    ServiceError, ServiceLimits, Shared, checkpoint_to_pb, decode_page_token, encode_page_token,
    ensure_active, page_size, verdict_to_pb,
};
use crate::auth::principal;
use crate::db::{Checkpoint, DbError, NewCheckpoint, Workspace};
use crate::retention::{self, Verdict};
use crate::store::ObjectKey;
use crate::tokens::{Action, Principal};

const PAGE_KIND: &str = "checkpoints";

/// Where a commit stops after checking its packs in the store, before its
/// transaction.
pub const FAILPOINT_COMMIT_BEFORE_TRANSACTION: &str = "commit-before-transaction";

/// Where a compaction stops after its checks, before its transaction.
pub const FAILPOINT_COMPACT_BEFORE_TRANSACTION: &str = "compact-before-transaction";

/// Longest pin reason.
const MAX_PIN_REASON: usize = 64;

/// A pin reason: 1-64 of a-z, 0-9, '-', '_'.
fn pin_reason(reason: &str) -> Result<&str, ServiceError> {
    let ok = !reason.is_empty()
        && reason.len() <= MAX_PIN_REASON
        && reason
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if ok {
        Ok(reason)
    } else {
        Err(ServiceError::InvalidArgument(format!(
            "pin reason {reason:?} is not 1-64 of a-z, 0-9, '-', '_'"
        )))
    }
}

/// Restore candidates when the request names no number.
const DEFAULT_CANDIDATES: u32 = 5;
/// Most restore candidates one manifest carries.
const MAX_CANDIDATES: u32 = 50;

/// Implements CheckpointService over the shared state.
#[derive(Debug, Clone)]
pub struct CheckpointApi {
    shared: Shared,
}

impl CheckpointApi {
    pub fn new(shared: Shared) -> Self {
        Self { shared }
    }

    /// The generation of the attempt a run token speaks for (`None` for
    /// other tokens).
    async fn attempt_generation(
        &self,
        principal: &Principal,
    ) -> Result<Option<Generation>, ServiceError> {
        let Some(binding) = &principal.run else {
            return Ok(None);
        };
        let attempt = self
            .shared
            .db
            .attempt(&binding.run, binding.attempt)
            .await?
            .ok_or_else(|| {
                ServiceError::Denied(format!(
                    "run token of attempt {} of run {}, which does not exist",
                    binding.attempt, binding.run
                ))
            })?;
        Ok(Some(attempt.generation))
    }

    /// Checks that every referenced pack is in the store with the size the
    /// metadata (or, for new packs, the commit) gives it. Returns the total
    /// size. Recorded packs the store lacks are marked lost, so their blobs
    /// are reported missing (and uploaded again) from now on; the error
    /// names every pack that is missing or the wrong size.
    async fn check_packs_in_store(
        &self,
        principal: &Principal,
        expected: &[(PackId, u64)],
    ) -> Result<u64, ServiceError> {
        let lookups: Vec<(PackId, ObjectKey)> = expected
            .iter()
            .map(|(id, _)| (id.clone(), ObjectKey::for_pack(&principal.tenant, id)))
            .collect();
        let found: HashMap<PackId, Option<u64>> = futures::stream::iter(lookups)
            .map(|(id, key)| {
                let store = self.shared.store.clone();
                async move { store.stat(&key).await.map(|size| (id, size)) }
            })
            .buffer_unordered(self.shared.limits.stat_concurrency)
            .try_collect()
            .await?;
        let mut total = 0u64;
        let mut missing = Vec::new();
        let mut unusable = Vec::new();
        let mut problems = Vec::new();
        for (id, size) in expected {
            match found.get(id).copied().flatten() {
                None => {
                    problems.push(format!(
                        "pack {id} is not in the store (never uploaded, or lost)"
                    ));
                    missing.push(id.clone());
                    unusable.push(id.clone());
                }
                Some(actual) if actual != *size => {
                    problems.push(format!(
                        "pack {id} has {actual} bytes in the store, expected {size}"
                    ));
                    unusable.push(id.clone());
                }
                Some(_) => total = total.saturating_add(*size),
            }
        }
        if problems.is_empty() {
            return Ok(total);
        }
        if !missing.is_empty() {
            let marked = self
                .shared
                .db
                .mark_packs_lost(&principal.tenant, &missing)
                .await?;
            if marked > 0 {
                tracing::warn!(
                    tenant = %principal.tenant,
                    packs = %missing.iter().map(PackId::as_str).collect::<Vec<_>>().join(","),
                    marked,
                    "recorded packs are missing from the store; marked lost"
                );
            }
        }
        Err(ServiceError::Refused {
            refusal: Refusal::PacksMissing { packs: unusable },
            message: problems.join("; "),
        })
    }

    async fn commit(
        &self,
        principal: &Principal,
        commit: CommitCheckpoint,
    ) -> Result<Checkpoint, ServiceError> {
        check_commit_limits(&self.shared.limits, &commit)?;
        let db = &self.shared.db;
        let tenant = &principal.tenant;
        let preflight = db
            .commit_preflight(
                tenant,
                &commit.workspace,
                &commit.key_id,
                commit.parent.as_ref(),
                commit.request_id.as_ref(),
            )
            .await?
            .ok_or_else(|| {
                ServiceError::NotFound(format!("workspace {} does not exist", commit.workspace))
            })?;
        principal
            .authorize(Action::WriteCheckpoints(&preflight.workspace_id))
            .map_err(ServiceError::Denied)?;
        // A retry of a commit that went through (its answer was cut off)
        // gets that checkpoint, even if the workspace moved on since.
        if let Some(earlier) = &preflight.earlier
            && let Some(made) = db.checkpoint(tenant, earlier).await?
        {
            tracing::info!(checkpoint = %made.id, request = ?commit.request_id, "commit retried; answered with its checkpoint");
            return Ok(made);
        }
        if preflight.state != WorkspaceState::Active {
            return Err(DbError::WorkspaceNotActive {
                id: preflight.workspace_id,
                state: preflight.state,
            }
            .into());
        }
        if let Some(own) = self.attempt_generation(principal).await?
            && commit.generation != own
        {
            return Err(attempt_stale(principal, commit.generation, own));
        }
        if commit.generation != preflight.generation {
            return Err(DbError::GenerationMismatch {
                given: commit.generation,
                current: preflight.generation,
            }
            .into());
        }
        let workspace = preflight.workspace_id;
        if !preflight.key_known {
            return Err(ServiceError::InvalidArgument(format!(
                "key_id {:?} is not a key of workspace {workspace}",
                commit.key_id
            )));
        }
        if let Some(parent) = &commit.parent
            && !preflight.parent_known
        {
            return Err(ServiceError::FailedPrecondition(format!(
                "parent checkpoint {parent} is not a checkpoint of workspace {workspace}"
            )));
        }

        let mut new_sizes: HashMap<&PackId, u64> = HashMap::new();
        for pack in &commit.new_packs {
            if new_sizes.insert(&pack.pack_id, pack.size).is_some() {
                return Err(ServiceError::InvalidArgument(format!(
                    "pack {} is listed twice in new_packs",
                    pack.pack_id
                )));
            }
        }
        let mut seen = HashSet::new();
        let referenced: Vec<PackId> = commit
            .referenced_packs
            .iter()
            .filter(|id| seen.insert(*id))
            .cloned()
            .collect();
        let old: Vec<PackId> = referenced
            .iter()
            .filter(|id| !new_sizes.contains_key(id))
            .cloned()
            .collect();
        let packs = db
            .commit_packs(tenant, &workspace, &old, &commit.root_tree)
            .await?;
        let mut expected = Vec::with_capacity(referenced.len());
        for id in &referenced {
            let size = match new_sizes.get(id) {
                Some(size) => *size,
                None => match packs.known.get(id) {
                    Some(pack) => pack.size,
                    None => {
                        return Err(ServiceError::Refused {
                            refusal: Refusal::PacksMissing {
                                packs: vec![id.clone()],
                            },
                            message: format!(
                                "pack {id} is not a pack of workspace {}; send it as a new pack",
                                workspace
                            ),
                        });
                    }
                },
            };
            expected.push((id.clone(), size));
        }

        let root_in_new = commit
            .new_packs
            .iter()
            .any(|p| p.blob_ids.contains(&commit.root_tree));
        if !root_in_new && !packs.root_held {
            return Err(ServiceError::FailedPrecondition(format!(
                "root tree {} is in none of the referenced packs",
                commit.root_tree
            )));
        }

        let stored_bytes = self.check_packs_in_store(principal, &expected).await?;
        // Tests hold a commit here, between its store checks and its
        // transaction, to race it with a garbage collection sweep.
        cairn_utils::failpoint::hit_async(FAILPOINT_COMMIT_BEFORE_TRANSACTION)
            .await
            .map_err(|e| ServiceError::FailedPrecondition(e.to_string()))?;
        let new_pack_count = commit.new_packs.len();
        let checkpoint = db
            .commit_checkpoint(
                tenant,
                NewCheckpoint {
                    workspace_id: workspace.clone(),
                    generation: commit.generation,
                    parent: commit.parent,
                    reason: commit.reason,
                    format_version: commit.format_version,
                    root_tree: commit.root_tree,
                    key_id: commit.key_id,
                    stats: commit.stats,
                    repos: commit.repos,
                    warnings: commit.warnings,
                    harness: commit.harness,
                    new_packs: commit.new_packs,
                    referenced_packs: referenced,
                    stored_bytes,
                    request_id: commit.request_id,
                },
            )
            .await?;
        tracing::info!(
            checkpoint = %checkpoint.id,
            workspace = %workspace,
            sequence = checkpoint.sequence,
            reason = %checkpoint.reason,
            packs = checkpoint.pack_count,
            new_packs = new_pack_count,
            "checkpoint committed"
        );
        Ok(checkpoint)
    }

    async fn restore_manifest(
        &self,
        principal: &Principal,
        req: pb::GetRestoreManifestRequest,
    ) -> Result<pb::RestoreManifest, ServiceError> {
        let workspace = self
            .shared
            .authorized_workspace(principal, &req.workspace, |id| Action::ReadCheckpoints(id))
            .await?;
        let db = &self.shared.db;
        let tenant = &principal.tenant;
        let candidates = if req.checkpoint_id.is_empty() {
            let wanted = match req.max_candidates {
                0 => DEFAULT_CANDIDATES,
                n => n.min(MAX_CANDIDATES),
            };
            db.list_checkpoints(&workspace.id, None, wanted).await?
        } else {
            let id: CheckpointId = req.checkpoint_id.parse()?;
            let checkpoint = db
                .checkpoint(tenant, &id)
                .await?
                .filter(|c| c.workspace_id == workspace.id);
            match checkpoint {
                Some(c) => vec![c],
                None => {
                    return Err(ServiceError::NotFound(format!(
                        "checkpoint {id} of workspace {} does not exist",
                        workspace.id
                    )));
                }
            }
        };

        let ids: Vec<CheckpointId> = candidates.iter().map(|c| c.id.clone()).collect();
        let mut packs_of = db.checkpoint_packs(&ids).await?;
        let all_packs: Vec<PackId> = packs_of
            .values()
            .flatten()
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let records = db
            .workspace_packs(tenant, &workspace.id, &all_packs)
            .await?;
        let key_ids: Vec<String> = candidates
            .iter()
            .map(|c| c.key_id.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let keys = db.keys(tenant, &workspace.id, &key_ids).await?;

        let ttl = self.shared.limits.url_ttl;
        let mut lookups = Vec::with_capacity(all_packs.len());
        for id in &all_packs {
            let record = records.get(id).cloned().ok_or_else(|| {
                DbError::Corrupt(format!(
                    "a checkpoint references pack {id}, which is not a recorded pack of its workspace"
                ))
            })?;
            lookups.push((ObjectKey::for_pack(tenant, id), record));
        }
        let signed: Vec<(SystemTime, pb::PackLocation)> = futures::stream::iter(lookups)
            .map(|(key, record)| {
                let store = self.shared.store.clone();
                // A run token's URLs die with its attempt.
                let holder = principal.run.clone();
                async move {
                    let url = store.presign_get(&key, ttl, holder.as_ref()).await?;
                    let location = pb::PackLocation {
                        pack_id: record.id.to_string(),
                        kind: pb::PackKind::from(record.kind) as i32,
                        size: record.size,
                        index_offset: record.index_offset,
                        index_length: record.index_length,
                        url: url.url,
                    };
                    Ok::<_, ServiceError>((url.expires_at, location))
                }
            })
            .buffer_unordered(self.shared.limits.stat_concurrency)
            .try_collect()
            .await?;
        // The manifest is good until its first URL expires.
        let urls_expire_at = signed
            .iter()
            .map(|(expires_at, _)| *expires_at)
            .min()
            .unwrap_or_else(|| SystemTime::now() + ttl);
        let mut locations: Vec<pb::PackLocation> =
            signed.into_iter().map(|(_, location)| location).collect();
        locations.sort_by(|a, b| a.pack_id.cmp(&b.pack_id));

        Ok(pb::RestoreManifest {
            workspace_id: workspace.id.to_string(),
            tenant: tenant.to_string(),
            keys: keys
                .into_iter()
                .map(|k| pb::TenantKey {
                    key_id: k.key_id,
                    secret: k.secret,
                })
                .collect(),
            candidates: candidates
                .iter()
                .map(|c| pb::RestoreCandidate {
                    checkpoint: Some(checkpoint_to_pb(c)),
                    packs: packs_of
                        .remove(&c.id)
                        .unwrap_or_default()
                        .iter()
                        .map(ToString::to_string)
                        .collect(),
                })
                .collect(),
            packs: locations,
            urls_expire_at: Some(to_timestamp(urls_expire_at)),
        })
    }
}

/// Why a run token's checkpoint at `given` is refused: its attempt owns `own`.
/// Refuses a commit over any of the per-commit limits before it costs
/// anything: no lookup, no store call, no write lock.
fn check_commit_limits(
    limits: &ServiceLimits,
    commit: &CommitCheckpoint,
) -> Result<(), ServiceError> {
    let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    if commit.new_packs.len() > limits.max_packs_per_call {
        return Err(ServiceError::over_limit(
            "commit.new_packs",
            count(limits.max_packs_per_call),
            count(commit.new_packs.len()),
            format!("{} new packs in one commit", commit.new_packs.len()),
        ));
    }
    if commit.referenced_packs.len() > limits.max_commit_referenced_packs {
        return Err(ServiceError::over_limit(
            "commit.referenced_packs",
            count(limits.max_commit_referenced_packs),
            count(commit.referenced_packs.len()),
            format!(
                "{} referenced packs in one commit",
                commit.referenced_packs.len()
            ),
        ));
    }
    let blobs: u64 = commit
        .new_packs
        .iter()
        .map(|pack| count(pack.blob_ids.len()))
        .sum();
    if blobs > limits.max_commit_blobs {
        return Err(ServiceError::over_limit(
            "commit.blob_ids",
            limits.max_commit_blobs,
            blobs,
            format!("{blobs} blob ids declared in one commit's new packs"),
        ));
    }
    for pack in &commit.new_packs {
        if pack.size > limits.max_pack_size {
            return Err(ServiceError::over_limit(
                "pack.bytes",
                limits.max_pack_size,
                pack.size,
                format!("pack {} is {} bytes", pack.pack_id, pack.size),
            ));
        }
    }
    let details: usize = commit.repos.iter().map(Message::encoded_len).sum::<usize>()
        + commit.warnings.iter().map(String::len).sum::<usize>()
        + commit.harness.as_ref().map_or(0, Message::encoded_len);
    if details > limits.max_commit_details_bytes {
        return Err(ServiceError::over_limit(
            "commit.details_bytes",
            count(limits.max_commit_details_bytes),
            count(details),
            format!("the commit's git states, warnings and harness session take {details} bytes"),
        ));
    }
    Ok(())
}

/// A run token's call at another generation than its attempt's: refused as
/// stale, the attempt's generation being the current one for it.
fn attempt_stale(principal: &Principal, given: Generation, own: Generation) -> ServiceError {
    let message = match &principal.run {
        Some(binding) => format!(
            "attempt {} of run {} checkpoints at generation {own}, not {given}",
            binding.attempt, binding.run
        ),
        None => format!("generation {given} is not the attempt's {own}"),
    };
    ServiceError::Refused {
        refusal: Refusal::StaleGeneration {
            given,
            current: own,
        },
        message,
    }
}

/// `c` with what retention makes of it (`verdicts`, by checkpoint).
fn with_retention(c: &Checkpoint, verdicts: &HashMap<CheckpointId, Verdict>) -> pb::Checkpoint {
    let mut answer = checkpoint_to_pb(c);
    answer.retention = verdicts.get(&c.id).map(verdict_to_pb);
    answer
}

impl CheckpointApi {
    /// Checks a compaction and records it: the caller may manage the
    /// workspace, the old packs are its own, each new pack holds only blobs
    /// recorded for the packs it replaces (nothing else can be slipped into
    /// a checkpoint this way) and is in the store at its size.
    async fn compact(
        &self,
        principal: &Principal,
        compaction: CompactPacks,
    ) -> Result<crate::db::Compacted, ServiceError> {
        let workspace = self
            .shared
            .workspace_by_ref(principal, &compaction.workspace)
            .await?;
        principal
            .authorize(Action::ManageWorkspace(&workspace.id))
            .map_err(ServiceError::Denied)?;
        if workspace.state == cairn_proto::domain::WorkspaceState::Deleted {
            return Err(DbError::WorkspaceNotActive {
                id: workspace.id.clone(),
                state: workspace.state,
            }
            .into());
        }
        let limits = &self.shared.limits;
        if compaction.new_packs.len() > limits.max_packs_per_call {
            return Err(ServiceError::over_limit(
                "compact.new_packs",
                limits.max_packs_per_call as u64,
                compaction.new_packs.len() as u64,
                format!("{} new packs in one compaction", compaction.new_packs.len()),
            ));
        }
        let tenant = &principal.tenant;
        let olds: Vec<PackId> = compaction
            .replacements
            .iter()
            .map(|(old, _)| old.clone())
            .collect();
        let known = self
            .shared
            .db
            .workspace_packs(tenant, &workspace.id, &olds)
            .await?;
        if let Some(unknown) = olds.iter().find(|id| !known.contains_key(id)) {
            return Err(ServiceError::Refused {
                refusal: Refusal::PacksMissing {
                    packs: vec![unknown.clone()],
                },
                message: format!("pack {unknown} is not a pack of workspace {}", workspace.id),
            });
        }
        let recorded = self.shared.db.blobs_of_packs(tenant, &olds).await?;
        for new in &compaction.new_packs {
            let sources: Vec<&PackId> = compaction
                .replacements
                .iter()
                .filter(|(_, news)| news.contains(&new.pack_id))
                .map(|(old, _)| old)
                .collect();
            let kinds_match = sources
                .iter()
                .all(|old| known.get(*old).is_some_and(|p| p.kind == new.kind));
            if !kinds_match {
                return Err(ServiceError::InvalidArgument(format!(
                    "new pack {} is not of the kind of the packs it replaces",
                    new.pack_id
                )));
            }
            if let Some(stray) = new.blob_ids.iter().find(|blob| {
                !sources
                    .iter()
                    .any(|old| recorded.contains(&((*old).clone(), **blob)))
            }) {
                return Err(ServiceError::InvalidArgument(format!(
                    "new pack {} holds blob {stray}, which none of the packs it replaces holds",
                    new.pack_id
                )));
            }
        }
        let expected: Vec<(PackId, u64)> = compaction
            .new_packs
            .iter()
            .map(|p| (p.pack_id.clone(), p.size))
            .collect();
        self.check_packs_in_store(principal, &expected).await?;
        cairn_utils::failpoint::hit_async(FAILPOINT_COMPACT_BEFORE_TRANSACTION)
            .await
            .map_err(|e| ServiceError::FailedPrecondition(e.to_string()))?;
        let now = self.shared.collector.clock().now();
        let compacted = self
            .shared
            .db
            .compact_packs(
                tenant,
                &workspace.id,
                &compaction.new_packs,
                &compaction.replacements,
                &compaction.checkpoints,
                now,
            )
            .await?;
        tracing::info!(
            workspace = %workspace.id,
            new_packs = compaction.new_packs.len(),
            packs_replaced = compacted.packs_replaced,
            checkpoints_updated = compacted.checkpoints_updated,
            "packs compacted"
        );
        Ok(compacted)
    }

    /// What retention makes of every checkpoint of `workspace` now.
    async fn verdicts(
        &self,
        workspace: &Workspace,
    ) -> Result<HashMap<CheckpointId, Verdict>, ServiceError> {
        let policy = self
            .shared
            .collector
            .config()
            .policy
            .with_overrides(&workspace.retention);
        let facts = self.shared.db.retention_facts(&workspace.id).await?;
        let now = self.shared.collector.clock().now();
        Ok(retention::decide(
            &policy,
            &facts.checkpoints,
            &facts.pins,
            &facts.run_starts,
            now,
        )
        .into_iter()
        .map(|v| (v.checkpoint.clone(), v))
        .collect())
    }

    /// Checkpoint `c` as an answer, with what retention makes of it.
    async fn answer(
        &self,
        principal: &Principal,
        c: &Checkpoint,
    ) -> Result<pb::Checkpoint, ServiceError> {
        let workspace = self
            .shared
            .workspace_by_ref(principal, &WorkspaceRef::Id(c.workspace_id.clone()))
            .await?;
        Ok(with_retention(c, &self.verdicts(&workspace).await?))
    }

    /// The checkpoint `id` names, of a workspace the caller may manage.
    async fn managed(&self, principal: &Principal, id: &str) -> Result<Checkpoint, ServiceError> {
        let id: CheckpointId = id.parse()?;
        let checkpoint = self
            .shared
            .db
            .checkpoint(&principal.tenant, &id)
            .await?
            .ok_or_else(|| ServiceError::NotFound(format!("checkpoint {id} does not exist")))?;
        principal
            .authorize(Action::ManageWorkspace(&checkpoint.workspace_id))
            .map_err(ServiceError::Denied)?;
        Ok(checkpoint)
    }
}

#[tonic::async_trait]
impl CheckpointService for CheckpointApi {
    async fn begin_checkpoint(
        &self,
        request: Request<pb::BeginCheckpointRequest>,
    ) -> Result<Response<pb::BeginCheckpointResponse>, Status> {
        let principal = principal(&request)?.clone();
        let req = request.into_inner();
        let workspace = self
            .shared
            .authorized_workspace(&principal, &req.workspace, |id| {
                Action::WriteCheckpoints(id)
            })
            .await?;
        ensure_active(&workspace)?;
        // A run token speaks for its attempt: "the current generation" is the
        // attempt's, so a superseded runner is refused here instead of
        // quietly committing at its successor's generation.
        let own = self.attempt_generation(&principal).await?;
        let generation = match (Generation(req.generation), own) {
            (Generation(0), Some(own)) => own,
            (Generation(0), None) => workspace.generation,
            (given, _) => given,
        };
        if let Some(own) = own
            && generation != own
        {
            return Err(attempt_stale(&principal, generation, own).into());
        }
        if generation != workspace.generation {
            return Err(ServiceError::from(DbError::GenerationMismatch {
                given: generation,
                current: workspace.generation,
            })
            .into());
        }
        let key = self
            .shared
            .db
            .current_key(&principal.tenant, &workspace.id)
            .await
            .map_err(ServiceError::from)?;
        Ok(Response::new(pb::BeginCheckpointResponse {
            workspace_id: workspace.id.to_string(),
            tenant: principal.tenant.to_string(),
            key: Some(pb::TenantKey {
                key_id: key.key_id,
                secret: key.secret,
            }),
            generation: generation.0,
            parent_checkpoint_id: workspace
                .latest_checkpoint
                .map(|c| c.id.to_string())
                .unwrap_or_default(),
            max_find_batch: self.shared.limits.max_find_batch,
        }))
    }

    async fn find_missing_blobs(
        &self,
        request: Request<pb::FindMissingBlobsRequest>,
    ) -> Result<Response<pb::FindMissingBlobsResponse>, Status> {
        let principal = principal(&request)?.clone();
        let req = request.into_inner();
        let workspace = self
            .shared
            .authorized_workspace(&principal, &req.workspace, |id| {
                Action::WriteCheckpoints(id)
            })
            .await?;
        let max = self.shared.limits.max_find_batch;
        if req.blob_ids.len() > max as usize {
            return Err(ServiceError::over_limit(
                "find.blob_ids",
                u64::from(max),
                req.blob_ids.len() as u64,
                format!("{} blob ids in one call", req.blob_ids.len()),
            )
            .into());
        }
        let blobs = req
            .blob_ids
            .iter()
            .enumerate()
            .map(|(i, bytes)| {
                BlobId::from_slice(bytes).map_err(|e| {
                    ServiceError::InvalidArgument(format!("invalid blob_ids[{i}]: {}", e.reason))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let found = self
            .shared
            .db
            .find_blobs(&principal.tenant, &workspace.id, &blobs)
            .await
            .map_err(ServiceError::from)?;
        let mut packs: Vec<String> = Vec::new();
        let mut pack_numbers: HashMap<&PackId, u32> = HashMap::new();
        let locations = blobs
            .iter()
            .map(|blob| match found.get(blob) {
                None => 0,
                Some(pack) => *pack_numbers.entry(pack).or_insert_with(|| {
                    packs.push(pack.to_string());
                    packs.len() as u32
                }),
            })
            .collect();
        Ok(Response::new(pb::FindMissingBlobsResponse {
            packs,
            locations,
        }))
    }

    async fn prepare_uploads(
        &self,
        request: Request<pb::PrepareUploadsRequest>,
    ) -> Result<Response<pb::PrepareUploadsResponse>, Status> {
        let principal = principal(&request)?.clone();
        let req = request.into_inner();
        let workspace = self
            .shared
            .authorized_workspace(&principal, &req.workspace, |id| {
                Action::WriteCheckpoints(id)
            })
            .await?;
        ensure_active(&workspace)?;
        let limits = &self.shared.limits;
        if req.packs.len() > limits.max_packs_per_call {
            return Err(ServiceError::over_limit(
                "uploads.packs",
                limits.max_packs_per_call as u64,
                req.packs.len() as u64,
                format!("{} packs in one call", req.packs.len()),
            )
            .into());
        }
        let mut urls = Vec::with_capacity(req.packs.len());
        for upload in &req.packs {
            let id: PackId = upload.pack_id.parse().map_err(ServiceError::from)?;
            PackKind::try_from(upload.kind).map_err(ServiceError::from)?;
            if upload.size == 0 {
                return Err(ServiceError::InvalidArgument(format!(
                    "pack {id} is 0 bytes; a pack has at least one"
                ))
                .into());
            }
            if upload.size > limits.max_pack_size {
                return Err(ServiceError::over_limit(
                    "pack.bytes",
                    limits.max_pack_size,
                    upload.size,
                    format!("pack {id} is {} bytes", upload.size),
                )
                .into());
            }
            let key = ObjectKey::for_pack(&principal.tenant, &id);
            let signed = self
                .shared
                .store
                .presign_put(
                    &key,
                    upload.size,
                    id.digest(),
                    limits.url_ttl,
                    // A run token's URLs die with its attempt.
                    principal.run.as_ref(),
                )
                .await
                .map_err(ServiceError::from)?;
            urls.push(pb::SignedUrl {
                pack_id: id.to_string(),
                url: signed.url,
                method: signed.method.to_owned(),
                expires_at: Some(to_timestamp(signed.expires_at)),
                headers: signed.headers.into_iter().collect(),
            });
        }
        Ok(Response::new(pb::PrepareUploadsResponse { urls }))
    }

    async fn commit_checkpoint(
        &self,
        request: Request<pb::CommitCheckpointRequest>,
    ) -> Result<Response<pb::Checkpoint>, Status> {
        let started = std::time::Instant::now();
        let principal = principal(&request)?.clone();
        let committed = match CommitCheckpoint::try_from(request.into_inner()) {
            Ok(commit) => {
                let new_bytes = commit.new_packs.iter().map(|pack| pack.size).sum::<u64>();
                self.commit(&principal, commit)
                    .await
                    .map(|checkpoint| (checkpoint, new_bytes))
            }
            Err(e) => Err(ServiceError::from(e)),
        }
        .map_err(Status::from);
        self.shared.metrics.checkpoint_commit(
            started.elapsed(),
            committed.as_ref().map(|(_, new_bytes)| *new_bytes),
        );
        let (checkpoint, _) = committed?;
        Ok(Response::new(checkpoint_to_pb(&checkpoint)))
    }

    async fn list_checkpoints(
        &self,
        request: Request<pb::ListCheckpointsRequest>,
    ) -> Result<Response<pb::ListCheckpointsResponse>, Status> {
        let principal = principal(&request)?.clone();
        let req = request.into_inner();
        let workspace = self
            .shared
            .authorized_workspace(&principal, &req.workspace, |id| Action::ReadCheckpoints(id))
            .await?;
        let before = match decode_page_token(&req.page_token, PAGE_KIND)? {
            Some(position) => Some(position.parse::<u64>().map_err(|_| {
                ServiceError::InvalidArgument("page_token is not a token this list returned".into())
            })?),
            None => None,
        };
        let limit = page_size(req.page_size);
        let mut checkpoints = self
            .shared
            .db
            .list_checkpoints(&workspace.id, before, limit + 1)
            .await
            .map_err(ServiceError::from)?;
        let next_page_token = if checkpoints.len() > limit as usize {
            checkpoints.truncate(limit as usize);
            let last = checkpoints.last().expect("a full page is not empty");
            encode_page_token(PAGE_KIND, &last.sequence.to_string())
        } else {
            String::new()
        };
        let verdicts = self.verdicts(&workspace).await?;
        Ok(Response::new(pb::ListCheckpointsResponse {
            checkpoints: checkpoints
                .iter()
                .map(|c| with_retention(c, &verdicts))
                .collect(),
            next_page_token,
        }))
    }

    async fn get_checkpoint(
        &self,
        request: Request<pb::GetCheckpointRequest>,
    ) -> Result<Response<pb::Checkpoint>, Status> {
        let principal = principal(&request)?.clone();
        let id: CheckpointId = request
            .get_ref()
            .checkpoint_id
            .parse()
            .map_err(ServiceError::from)?;
        let checkpoint = self
            .shared
            .db
            .checkpoint(&principal.tenant, &id)
            .await
            .map_err(ServiceError::from)?
            .ok_or_else(|| ServiceError::NotFound(format!("checkpoint {id} does not exist")))?;
        principal
            .authorize(Action::ReadCheckpoints(&checkpoint.workspace_id))
            .map_err(ServiceError::Denied)?;
        Ok(Response::new(self.answer(&principal, &checkpoint).await?))
    }

    async fn pin_checkpoint(
        &self,
        request: Request<pb::PinCheckpointRequest>,
    ) -> Result<Response<pb::Checkpoint>, Status> {
        let principal = principal(&request)?.clone();
        let req = request.into_inner();
        let checkpoint = self.managed(&principal, &req.checkpoint_id).await?;
        let reason = pin_reason(&req.reason)?;
        let until = req.until.as_ref().map(cairn_proto::domain::from_timestamp);
        let now = self.shared.collector.clock().now();
        if until.is_some_and(|until| until <= now) {
            return Err(ServiceError::InvalidArgument(
                "until is in the past: the pin would keep nothing".into(),
            )
            .into());
        }
        self.shared
            .db
            .pin_checkpoint(&principal.tenant, &checkpoint.id, reason, until, now)
            .await
            .map_err(ServiceError::from)?;
        tracing::info!(checkpoint = %checkpoint.id, reason, ?until, "checkpoint pinned");
        Ok(Response::new(self.answer(&principal, &checkpoint).await?))
    }

    async fn compact_packs(
        &self,
        request: Request<pb::CompactPacksRequest>,
    ) -> Result<Response<pb::CompactPacksResponse>, Status> {
        let principal = principal(&request)?.clone();
        let compaction =
            CompactPacks::try_from(request.into_inner()).map_err(ServiceError::from)?;
        let compacted = self.compact(&principal, compaction).await?;
        Ok(Response::new(pb::CompactPacksResponse {
            checkpoints_updated: u32::try_from(compacted.checkpoints_updated).unwrap_or(u32::MAX),
            packs_replaced: u32::try_from(compacted.packs_replaced).unwrap_or(u32::MAX),
        }))
    }

    async fn unpin_checkpoint(
        &self,
        request: Request<pb::UnpinCheckpointRequest>,
    ) -> Result<Response<pb::Checkpoint>, Status> {
        let principal = principal(&request)?.clone();
        let req = request.into_inner();
        let checkpoint = self.managed(&principal, &req.checkpoint_id).await?;
        let reason = pin_reason(&req.reason)?;
        let removed = self
            .shared
            .db
            .unpin_checkpoint(&principal.tenant, &checkpoint.id, reason)
            .await
            .map_err(ServiceError::from)?;
        if !removed {
            return Err(ServiceError::NotFound(format!(
                "checkpoint {} has no pin {reason:?}",
                checkpoint.id
            ))
            .into());
        }
        tracing::info!(checkpoint = %checkpoint.id, reason, "checkpoint unpinned");
        Ok(Response::new(self.answer(&principal, &checkpoint).await?))
    }

    async fn get_restore_manifest(
        &self,
        request: Request<pb::GetRestoreManifestRequest>,
    ) -> Result<Response<pb::RestoreManifest>, Status> {
        let started = std::time::Instant::now();
        let principal = principal(&request)?.clone();
        let manifest = self
            .restore_manifest(&principal, request.into_inner())
            .await?;
        self.shared.metrics.restore_manifest(started.elapsed());
        Ok(Response::new(manifest))
    }
}
