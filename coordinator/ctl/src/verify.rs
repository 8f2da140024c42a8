//! `cairnctl verify WS [--read-data]`: is every checkpoint of a workspace
//! still restorable from what the store holds?
//!
//! Per checkpoint, through the signed URLs of its restore manifest:
//! - always: every referenced pack is in the store, whole (a ranged GET of
//!   its trailer, checked against the recorded index range);
//! - `--read-data`: every pack downloaded, its SHA-256 equal to its id, its
//!   header, trailer and sealed index valid, every blob decrypted and checked
//!   against its keyed id; then the trees walked from the root (with the
//!   restore's own safety checks) and every chunk they name found in a pack.
//!
//! Packs shared by several checkpoints are checked once. Progress (the
//! checkpoints done, the packs checked) is drawn on stderr for people
//! ([`super::progress`]).

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;
use std::sync::Arc;

use bytes::Bytes;
use cairn_engine::client::CoordinatorClient;
use cairn_engine::format::{self, PackIndex, TenantKeys};
use cairn_engine::restore::fetch::{self, PackFetcher};
use cairn_engine::restore::{
    Manifest, ManifestSource, MetaBlobs, PackInfo, TreeBounds, build_plan,
};
use cairn_engine::transfer::BlobTransfer;
use cairn_proto::domain::PackKind;
use cairn_proto::ids::{BlobId, PackId};
use cairn_proto::pb;
use futures::StreamExt;
use indicatif::ProgressBar;
use serde_json::json;

use super::{Output, all_checkpoints, emit, print_document, progress, rpc_error};

/// Checkpoints verified of the workspace's, and the packs checked so far.
pub(crate) const TEMPLATE: &str =
    "{spinner} verifying {msg} [{bar:30}] {pos}/{len} checkpoints {elapsed}";

/// Packs checked at once (each may be held whole in memory while checked).
const PARALLEL_PACKS: usize = 4;
/// Blob failures listed per pack before the rest are only counted.
const LISTED_FAILURES: usize = 3;

/// What checking one pack found.
#[derive(Debug, Default)]
struct PackCheck {
    problems: Vec<String>,
    /// Blob ids the pack holds (with `--read-data`).
    blobs: Vec<BlobId>,
    /// A META pack's bytes and index, for walking the trees.
    meta: Option<(Bytes, PackIndex)>,
}

impl PackCheck {
    fn problem(problem: String) -> Self {
        Self {
            problems: vec![problem],
            ..Self::default()
        }
    }
}

/// What verifying one checkpoint found.
#[derive(Debug)]
struct CheckpointResult {
    checkpoint_id: String,
    sequence: u64,
    packs: usize,
    blobs_verified: u64,
    problems: Vec<String>,
}

pub async fn run(
    coordinator: &CoordinatorClient,
    workspace: &str,
    read_data: bool,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let checkpoints = all_checkpoints(coordinator, workspace).await?;
    let transfer = BlobTransfer::default();
    let mut checked: HashMap<PackId, Arc<PackCheck>> = HashMap::new();
    let mut results = Vec::with_capacity(checkpoints.len());
    let bar = progress::bar(out, TEMPLATE);
    bar.set_length(checkpoints.len() as u64);
    for checkpoint in &checkpoints {
        bar.set_message(checkpoint.id.clone());
        let result = verify_checkpoint(
            coordinator,
            workspace,
            checkpoint,
            read_data,
            &transfer,
            &mut checked,
            &bar,
        )
        .await;
        let result = match result {
            Ok(result) => result,
            Err(e) => {
                bar.finish_and_clear();
                return Err(e);
            }
        };
        if !out.is_document() {
            // Lines go above the bar, not through it.
            bar.suspend(|| emit(&describe_result(&result)))?;
        }
        bar.inc(1);
        results.push(result);
    }
    bar.finish_and_clear();
    let failed = results.iter().filter(|r| !r.problems.is_empty()).count();
    match out {
        Output::Json | Output::Yaml => print_document(
            out,
            &json!({
                "workspace": workspace,
                "read_data": read_data,
                "ok": failed == 0,
                "checkpoints": results.iter().map(|r| json!({
                    "checkpoint_id": r.checkpoint_id,
                    "sequence": r.sequence,
                    "ok": r.problems.is_empty(),
                    "packs": r.packs,
                    "blobs_verified": r.blobs_verified,
                    "problems": r.problems,
                })).collect::<Vec<_>>(),
            }),
        )?,
        Output::Table | Output::Wide if results.is_empty() => {
            emit(&format!("workspace {workspace} has no checkpoints"))?
        }
        Output::Table | Output::Wide if failed == 0 => emit(&format!(
            "all {} checkpoints of {workspace} verified",
            results.len()
        ))?,
        Output::Table | Output::Wide => {}
    }
    if failed > 0 {
        eprintln!(
            "error: {failed} of {} checkpoints of {workspace} have problems",
            results.len()
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn describe_result(result: &CheckpointResult) -> String {
    let what = if result.blobs_verified > 0 {
        format!(
            "{} packs, {} blobs verified",
            result.packs, result.blobs_verified
        )
    } else {
        format!("{} packs present", result.packs)
    };
    if result.problems.is_empty() {
        return format!("{} #{}: OK ({what})", result.checkpoint_id, result.sequence);
    }
    let mut text = format!(
        "{} #{}: {} problems ({what})",
        result.checkpoint_id,
        result.sequence,
        result.problems.len()
    );
    for problem in &result.problems {
        text.push_str(&format!("\n  - {problem}"));
    }
    text
}

async fn verify_checkpoint(
    coordinator: &CoordinatorClient,
    workspace: &str,
    checkpoint: &pb::Checkpoint,
    read_data: bool,
    transfer: &BlobTransfer,
    checked: &mut HashMap<PackId, Arc<PackCheck>>,
    bar: &ProgressBar,
) -> anyhow::Result<CheckpointResult> {
    let mut result = CheckpointResult {
        checkpoint_id: checkpoint.id.clone(),
        sequence: checkpoint.sequence,
        packs: 0,
        blobs_verified: 0,
        problems: Vec::new(),
    };
    let request = pb::GetRestoreManifestRequest {
        workspace: workspace.to_owned(),
        checkpoint_id: checkpoint.id.clone(),
        max_candidates: 1,
    };
    let manifest = coordinator
        .restore_manifest(request.clone())
        .await
        .map_err(rpc_error("getting the restore manifest"))?;
    let manifest = Manifest::parse(manifest)?;
    let Some(candidate) = manifest.candidates.iter().find(|c| c.id == checkpoint.id) else {
        result
            .problems
            .push("the coordinator has no restore manifest for it".into());
        return Ok(result);
    };
    let resolved = match manifest.resolve(candidate) {
        Ok(resolved) => resolved,
        Err(reason) => {
            result.problems.push(reason);
            return Ok(result);
        }
    };
    result.packs = resolved.packs.len();

    let fetcher = PackFetcher::new(
        transfer.clone(),
        coordinator,
        request,
        manifest.urls.clone(),
    );
    let todo: Vec<PackInfo> = resolved
        .packs
        .iter()
        .filter(|p| !checked.contains_key(&p.id))
        .cloned()
        .collect();
    let keys = &resolved.keys;
    let fetcher = &fetcher;
    let packs_before = checked.len();
    let new_checks: Vec<(PackId, PackCheck)> = futures::stream::iter(todo)
        .map(|info| async move {
            let id = info.id.clone();
            (id, check_pack(fetcher, info, keys.clone(), read_data).await)
        })
        .buffer_unordered(PARALLEL_PACKS)
        .enumerate()
        .map(|(done, check)| {
            bar.set_message(format!(
                "{} · {} packs checked",
                checkpoint.id,
                packs_before + done + 1
            ));
            check
        })
        .collect()
        .await;
    for (id, check) in new_checks {
        checked.insert(id, Arc::new(check));
    }

    let mut present: HashSet<BlobId> = HashSet::new();
    let mut meta = MetaBlobs::new();
    let mut meta_complete = true;
    for info in &resolved.packs {
        let check = &checked[&info.id];
        result.problems.extend(check.problems.iter().cloned());
        result.blobs_verified += check.blobs.len() as u64;
        present.extend(check.blobs.iter().copied());
        match &check.meta {
            Some((bytes, index)) => meta.add_pack(bytes.clone(), index),
            None if info.kind == PackKind::Meta => meta_complete = false,
            None => {}
        }
    }
    if read_data && meta_complete {
        let keys = resolved.keys.clone();
        let root = resolved.root_tree;
        let plan = tokio::task::spawn_blocking(move || {
            build_plan(&meta, &keys, root, &TreeBounds::default())
        })
        .await?;
        match plan {
            Ok(plan) => {
                let mut reported = HashSet::new();
                for chunk in plan.chunks() {
                    if !present.contains(&chunk.id) && reported.insert(chunk.id) {
                        result.problems.push(format!(
                            "blob {} is in none of the checkpoint's packs",
                            chunk.id
                        ));
                    }
                }
            }
            Err(e) => result
                .problems
                .push(format!("its trees cannot be restored: {e}")),
        }
    }
    Ok(result)
}

async fn check_pack(
    fetcher: &PackFetcher<'_>,
    info: PackInfo,
    keys: Arc<TenantKeys>,
    read_data: bool,
) -> PackCheck {
    if !read_data {
        return match fetch::check_trailer_in_store(fetcher, &info).await {
            Ok(()) => PackCheck::default(),
            Err(e) => PackCheck::problem(e.to_string()),
        };
    }
    let bytes = match fetcher.get(&info.id).await {
        Ok(bytes) => bytes,
        Err(e) => return PackCheck::problem(e.to_string()),
    };
    match tokio::task::spawn_blocking(move || inspect_pack(&info, bytes, &keys)).await {
        Ok(check) => check,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Checks every byte of a downloaded pack.
fn inspect_pack(info: &PackInfo, bytes: Bytes, keys: &TenantKeys) -> PackCheck {
    let mut check = PackCheck::default();
    if let Err(e) = fetch::check_digest(info, &bytes) {
        check.problems.push(e.to_string());
    }
    let index = match fetch::open_pack_index(info, &bytes, keys) {
        Ok(index) => index,
        Err(e) => {
            check.problems.push(e.to_string());
            return check;
        }
    };
    let mut failures = Vec::new();
    for entry in &index.entries {
        let sealed =
            &bytes[entry.offset as usize..(entry.offset + u64::from(entry.sealed_len)) as usize];
        match format::open(keys, &entry.id, sealed, entry.plain_len as usize) {
            Ok(_) => check.blobs.push(entry.id),
            Err(e) => failures.push(e.to_string()),
        }
    }
    if !failures.is_empty() {
        let listed = failures
            .iter()
            .take(LISTED_FAILURES)
            .cloned()
            .collect::<Vec<_>>()
            .join("; ");
        let more = failures.len().saturating_sub(LISTED_FAILURES);
        let more = if more > 0 {
            format!("; and {more} more")
        } else {
            String::new()
        };
        check.problems.push(format!(
            "pack {}: {} of {} blobs fail verification: {listed}{more}",
            info.id,
            failures.len(),
            index.entries.len()
        ));
    }
    if info.kind == PackKind::Meta {
        check.meta = Some((bytes, index));
    }
    check
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_engine::format::{PackBuilder, seal};
    use sha2::Digest;

    fn pack_with(keys: &TenantKeys, blobs: &[&[u8]]) -> (PackInfo, Vec<u8>) {
        let mut builder = PackBuilder::new(PackKind::Data, Vec::new()).unwrap();
        for blob in blobs {
            let id = keys.blob_id(blob);
            let mut sealed = Vec::new();
            seal(keys, &id, blob, &mut sealed);
            builder.add(id, &sealed, blob.len() as u32).unwrap();
        }
        let pack = builder.finish(keys).unwrap();
        let info = PackInfo {
            id: pack.id,
            kind: PackKind::Data,
            size: pack.size,
            index_offset: pack.index_offset,
            index_length: pack.index_length,
        };
        (info, pack.sink)
    }

    #[test]
    fn a_sound_pack_has_no_problems_and_lists_its_blobs() {
        let keys = TenantKeys::derive("k1", &[5; 32]).unwrap();
        let (info, bytes) = pack_with(&keys, &[b"one", b"two"]);
        let check = inspect_pack(&info, Bytes::from(bytes), &keys);
        assert!(check.problems.is_empty(), "{:?}", check.problems);
        assert_eq!(check.blobs.len(), 2);
        assert!(check.meta.is_none());
    }

    #[test]
    fn a_flipped_byte_is_reported_with_the_pack_and_the_damaged_blob() {
        let keys = TenantKeys::derive("k1", &[5; 32]).unwrap();
        let (info, mut bytes) = pack_with(&keys, &[b"first blob", b"second blob"]);
        bytes[20] ^= 1;
        assert_ne!(
            <[u8; 32]>::from(sha2::Sha256::digest(&bytes)),
            info.id.digest()
        );
        let check = inspect_pack(&info, Bytes::from(bytes), &keys);
        let all = check.problems.join("\n");
        assert!(all.contains("do not hash to its id"), "{all}");
        assert!(all.contains("1 of 2 blobs fail verification"), "{all}");
        assert!(all.contains(info.id.as_str()), "{all}");
        assert_eq!(
            check.blobs.len(),
            1,
            "the intact blob still counts as present"
        );
    }
}
