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
