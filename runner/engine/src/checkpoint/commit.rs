//! The last stage of a checkpoint: where each of its blobs is ([`place`]),
//! then CommitCheckpoint ([`commit`]), and what the cache and the memo
//! learn from it ([`Recall::commit`]).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use cairn_proto::ids::{BlobId, CommitRequestId, PackId};
use cairn_proto::pb;

use super::content::Content;
use super::learn::Learned;
use super::memo::{self, Memo};
use super::recall::Recall;
use super::remote::{self, Session};
use super::trees::Trees;
use super::{CheckpointError, CheckpointOptions, CheckpointReport, Stats};
use crate::cache::{FastMap, FastSet, FingerprintCache};
use crate::format::FORMAT_VERSION;
use crate::git::RepoState;
use crate::scan::Scan;
use cairn_utils::failpoint;

/// At most this many warnings are recorded on a checkpoint; the rest are counted.
const MAX_WARNINGS: usize = 100;

/// Where a checkpoint's blobs are.
pub(crate) struct Placed {
    /// Per directory: the packs holding its file chunks, tree and pages.
    pub per_dir: Vec<Arc<[PackId]>>,
    /// All of them, for the commit.
    pub referenced: BTreeSet<PackId>,
}

/// Finds the pack of every blob the checkpoint reaches: found or written by
/// this checkpoint, else known to the cache. A directory whose files were
/// taken from `memo`, and whose tree is the one remembered, keeps the packs
/// remembered with it.
pub(crate) fn place(
    scan: &Scan,
    content: &Content,
    trees: &Trees,
    located: &FastMap<BlobId, PackId>,
    cache: &FingerprintCache,
    memo: Option<&Memo>,
) -> Result<Placed, CheckpointError> {
    let mut per_dir = Vec::with_capacity(scan.dirs.len());
    let mut referenced = FastSet::default();
    let dirs = scan.dirs.iter().zip(&content.files).zip(&content.from_memo);
    for (d, (((dir, files), &from_memo), tree)) in dirs.zip(&trees.dirs).enumerate() {
        let remembered = memo
            .and_then(|memo| memo.get(dir))
            .filter(|outcome| from_memo && outcome.tree == *tree);
        let packs = match remembered {
            Some(outcome) => outcome.packs.clone(),
            None => {
                let taken = content.from_earlier[d].as_ref();
                let read = files.iter().enumerate().filter_map(|(n, file)| {
                    let taken = taken.is_some_and(|taken| taken.nodes[n]);
                    file.as_ref().filter(|_| !taken)
                });
                let locate = |id: &BlobId| located.get(id).or_else(|| cache.blob_pack(id));
                let earlier = taken.map_or_else(Vec::new, |taken| taken.packs.to_vec());
                memo::packs_of(earlier, read, tree, locate)
                    .map_err(CheckpointError::UnlocatedBlob)?
                    .into()
            }
        };
        // Neighbouring directories mostly sit in the same packs: one
        // comparison with the last list instead of a lookup per pack.
        let same_as_last = per_dir
            .last()
            .is_some_and(|last: &Arc<[PackId]>| last[..] == packs[..]);
        if !same_as_last {
            for pack in packs.iter() {
                if !referenced.contains(pack) {
                    referenced.insert(pack.clone());
                }
            }
        }
        per_dir.push(packs);
    }
    Ok(Placed {
        per_dir,
        referenced: referenced.into_iter().collect(),
    })
}

/// What the commit records, besides what the checkpoint learned.
pub(crate) struct Committing<'a> {
    pub session: &'a Session,
    pub opts: &'a CheckpointOptions,
    pub trees: &'a Trees,
    /// What the upload stage counted, and the packs it uploaded.
    pub stats: Stats,
    pub new_packs: Vec<pb::NewPack>,
    /// Every pack the checkpoint reaches ([`Placed::referenced`]).
    pub referenced: &'a BTreeSet<PackId>,
    pub repos: Vec<RepoState>,
    /// Warnings of the limits and of the git readings (the walk's and the
    /// content's are in `learned`).
    pub limit_warnings: Vec<String>,
    pub git_warnings: Vec<String>,
    pub started: Instant,
}

/// The commit stage: commits the checkpoint, and hands what it learned to
/// `recall`.
pub(crate) async fn commit(
    recall: &impl Recall,
    committing: Committing<'_>,
    learned: Learned,
) -> Result<CheckpointReport, CheckpointError> {
    let Committing {
        session,
        opts,
        trees,
        mut stats,
        new_packs,
        referenced,
        repos,
        limit_warnings,
        git_warnings,
        started,
    } = committing;
    let ms = || started.elapsed().as_millis() as u64;
    failpoint::hit("checkpoint-before-commit")?;

    stats.files = trees.counts.files;
    stats.directories = trees.counts.directories;
    stats.symlinks = trees.counts.symlinks;
    stats.total_bytes = trees.counts.total_bytes;
    stats.files_read = learned.content.files_read;
    stats.bytes_read = learned.content.bytes_read;
    stats.duration_ms = started.elapsed().as_millis() as u64;
    stats.scan_started = Some(learned.scan.started);
    let warnings = capped_warnings(
        learned
            .scan
            .warnings
            .iter()
            .chain(&limit_warnings)
            .chain(&learned.content.warnings)
            .chain(&git_warnings)
            .cloned()
            .collect(),
    );
    let request = pb::CommitCheckpointRequest {
        workspace: session.workspace_id.to_string(),
        generation: session.generation.0,
        parent_checkpoint_id: session
            .parent
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default(),
        reason: pb::CheckpointReason::from(opts.reason) as i32,
        format_version: FORMAT_VERSION,
        root_tree: trees.root.as_bytes().to_vec(),
        new_packs,
        referenced_packs: referenced.iter().map(|p| p.to_string()).collect(),
        stats: Some(pb::CheckpointStats::from(&stats)),
        repos: repos.iter().cloned().map(pb::GitRepoState::from).collect(),
        warnings: warnings.clone(),
        harness: opts.harness.clone(),
        key_id: session.keys.key_id().to_owned(),
        // One name for this commit, however often it is sent: a retry
        // after a cut-off call gets the checkpoint the first one made.
        request_id: CommitRequestId::generate().to_string(),
    };
    let committing = async {
        tracing::debug!(elapsed_ms = ms(), "committing");
        remote::commit(&session.client, request).await
    };
    let committed = recall.commit(committing, learned).await?;
    tracing::debug!(checkpoint = %committed.id, sequence = committed.sequence, elapsed_ms = ms(), "checkpoint committed");
    Ok(CheckpointReport {
        checkpoint_id: committed.id,
        workspace_id: session.workspace_id.clone(),
        sequence: committed.sequence,
        reason: opts.reason,
        stats,
        warnings,
        repos,
        root_tree: trees.root,
    })
}

fn capped_warnings(mut warnings: Vec<String>) -> Vec<String> {
    if warnings.len() > MAX_WARNINGS {
        let more = warnings.len() - (MAX_WARNINGS - 1);
        warnings.truncate(MAX_WARNINGS - 1);
        warnings.push(format!("… and {more} more warnings"));
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_many_warnings_are_summed_up() {
        let warnings = capped_warnings((0..250).map(|i| format!("w{i}")).collect());
        assert_eq!(warnings.len(), MAX_WARNINGS);
        assert_eq!(warnings.last().unwrap(), "… and 151 more warnings");
    }
}
