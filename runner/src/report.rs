//! Checkpoint and restore reports in words, as `cairn-runner` prints them,
//! a resident runner answers on its control socket, and a run reports them.

use std::path::Path;

use cairn_engine::checkpoint::CheckpointReport;
use cairn_engine::restore::RestoreReport;
use cairn_proto::size::human_bytes;
use cairn_utils::text::{human_age, plural};

/// One line: what the checkpoint holds and what it cost.
pub fn checkpoint_summary(report: &CheckpointReport) -> String {
    let s = &report.stats;
    format!(
        "checkpoint {} of {} (#{}, {}): {}, {}; read {} ({}); uploaded {}, {}, in {} ms",
        report.checkpoint_id,
        report.workspace_id,
        report.sequence,
        report.reason,
        plural(s.files, "file", "files"),
        human_bytes(s.total_bytes),
        plural(s.files_read, "file", "files"),
        human_bytes(s.bytes_read),
        plural(u64::from(s.packs_uploaded), "pack", "packs"),
        human_bytes(s.uploaded_bytes),
        s.duration_ms,
    )
}

/// A few lines: the checkpoint restored into `root` and every one skipped.
pub fn restore_summary(report: &RestoreReport, root: &Path) -> String {
    let mut out = format!(
        "restored checkpoint {} (#{}, {}{}) of workspace {} into {}\n  {} files ({}), {} directories, {} symlinks; \
         wrote {}, reused {} files, removed {} stale entries; downloaded {}{} in {} ms",
        report.checkpoint_id,
        report.checkpoint.sequence,
        cairn_proto::domain::CheckpointReason::try_from(report.checkpoint.reason)
            .map(|r| r.as_str())
            .unwrap_or("unknown reason"),
        report
            .checkpoint
            .created_at
            .as_ref()
            .map(|t| format!(", {}", human_age(cairn_proto::domain::from_timestamp(t))))
            .unwrap_or_default(),
        report.workspace_id,
        root.display(),
        report.files,
        human_bytes(report.total_bytes),
        report.directories,
        report.symlinks,
        human_bytes(report.bytes_written),
        report.files_reused,
        report.entries_removed,
        human_bytes(report.bytes_downloaded),
        if report.bytes_from_cache > 0 {
            format!(
                " (and {} from the host's pack cache)",
                human_bytes(report.bytes_from_cache)
            )
        } else {
            String::new()
        },
        report.duration_ms,
    );
    for skipped in &report.fell_back_from {
        out.push_str(&format!(
            "\n  fell back from checkpoint {}: {}",
            skipped.checkpoint_id, skipped.reason
        ));
    }
    out
}

/// A warning when the checkpoint `report` restored was taken more than
/// `threshold` before `now`: whatever was done in the workspace after it
/// is not in the restored tree. `None` when it is newer, or its time is
/// unknown.
pub fn staleness_warning(
    report: &RestoreReport,
    threshold: std::time::Duration,
    now: std::time::SystemTime,
) -> Option<String> {
    let taken = report.checkpoint_created_at()?;
    let age = now.duration_since(taken).ok()?;
    if threshold.is_zero() || age <= threshold {
        return None;
    }
    let round = std::time::Duration::from_secs(age.as_secs());
    Some(format!(
        "warning: the restored checkpoint {} was taken {} ago, more than {}: \
         anything done in the workspace after it is not in this tree",
        report.checkpoint_id,
        humantime::format_duration(round),
        humantime::format_duration(threshold),
    ))
}

#[cfg(test)]
mod tests {
    use cairn_engine::checkpoint::Stats;
    use cairn_proto::domain::CheckpointReason;
    use cairn_proto::ids::{BlobId, CheckpointId, WorkspaceId};

    use super::*;

    #[test]
    fn the_summary_reads_like_the_contract() {
        let (checkpoint_id, workspace_id) = (CheckpointId::generate(), WorkspaceId::generate());
        let report = CheckpointReport {
            checkpoint_id: checkpoint_id.clone(),
            workspace_id: workspace_id.clone(),
            sequence: 3,
            reason: CheckpointReason::Manual,
            stats: Stats {
                files: 50123,
                total_bytes: 327_579_238,
                files_read: 10,
                bytes_read: 41 * 1024,
                packs_uploaded: 1,
                uploaded_bytes: 143 * 1024,
                duration_ms: 85,
                ..Stats::default()
            },
            warnings: vec![],
            repos: vec![],
            root_tree: BlobId([7; 32]),
        };
        assert_eq!(
            checkpoint_summary(&report),
            format!(
                "checkpoint {checkpoint_id} of {workspace_id} (#3, manual): 50123 files, 312.4 MiB; \
                 read 10 files (41.0 KiB); uploaded 1 pack, 143.0 KiB, in 85 ms"
            )
        );
        let json: serde_json::Value = serde_json::to_value(&report).unwrap();
        assert_eq!(json["checkpoint_id"], checkpoint_id.as_str());
        assert_eq!(json["workspace_id"], workspace_id.as_str());
        assert_eq!(json["reason"], "manual");
        assert_eq!(json["stats"]["files_read"], 10);
        assert!(json["repos"].is_array() && json["warnings"].is_array());
        assert!(
            json.get("root_tree").is_none(),
            "the JSON output keeps its contract"
        );
    }

    #[test]
    fn a_restore_of_an_old_checkpoint_warns_past_the_threshold_only() {
        let now = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        let report = |age_secs: u64| RestoreReport {
            checkpoint_id: CheckpointId::generate(),
            workspace_id: WorkspaceId::generate(),
            checkpoint: cairn_proto::pb::Checkpoint {
                created_at: Some(cairn_proto::domain::to_timestamp(
                    now - std::time::Duration::from_secs(age_secs),
                )),
                ..Default::default()
            },
            fell_back_from: vec![],
            files: 0,
            directories: 0,
            symlinks: 0,
            total_bytes: 0,
            bytes_written: 0,
            bytes_downloaded: 0,
            bytes_from_cache: 0,
            files_reused: 0,
            entries_removed: 0,
            duration_ms: 0,
        };
        let hour = std::time::Duration::from_secs(3600);
        assert_eq!(staleness_warning(&report(3599), hour, now), None);
        let old = report(3 * 3600 + 120);
        assert_eq!(
            staleness_warning(&old, hour, now).unwrap(),
            format!(
                "warning: the restored checkpoint {} was taken 3h 2m ago, more than 1h: \
                 anything done in the workspace after it is not in this tree",
                old.checkpoint_id
            )
        );
        // 0 turns the warning off; a checkpoint without a time cannot warn.
        assert_eq!(
            staleness_warning(&old, std::time::Duration::ZERO, now),
            None
        );
        let mut timeless = report(0);
        timeless.checkpoint.created_at = None;
        assert_eq!(staleness_warning(&timeless, hour, now), None);
    }

    #[test]
    fn a_restore_summary_names_the_checkpoint_the_fallbacks_and_the_pack_cache() {
        let (checkpoint_id, workspace_id) = (CheckpointId::generate(), WorkspaceId::generate());
        let report = RestoreReport {
            checkpoint_id: checkpoint_id.clone(),
            workspace_id: workspace_id.clone(),
            checkpoint: cairn_proto::pb::Checkpoint {
                sequence: 2,
                reason: cairn_proto::pb::CheckpointReason::Turn as i32,
                ..Default::default()
            },
            fell_back_from: vec![cairn_engine::restore::SkippedCheckpoint {
                checkpoint_id: "newer".into(),
                reason: "authentication failed".into(),
            }],
            files: 3,
            directories: 1,
            symlinks: 0,
            total_bytes: 4096,
            bytes_written: 4096,
            bytes_downloaded: 2048,
            bytes_from_cache: 2048,
            files_reused: 0,
            entries_removed: 0,
            duration_ms: 12,
        };
        let text = restore_summary(&report, Path::new("/workspace"));
        let head = format!(
            "restored checkpoint {checkpoint_id} (#2, turn) of workspace {workspace_id} into /workspace"
        );
        assert!(text.starts_with(&head), "{text}");
        assert!(
            text.contains("(and 2.0 KiB from the host's pack cache)"),
            "{text}"
        );
        assert!(
            text.ends_with("\n  fell back from checkpoint newer: authentication failed"),
            "{text}"
        );
    }
}
