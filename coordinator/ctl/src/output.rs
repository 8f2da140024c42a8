//! How cairnctl shows things: aligned tables and key/value blocks for
//! people, stable JSON objects for scripts (an entity's own id is always
//! under `"id"`; durations are `*_ms` numbers; times RFC 3339), and human
//! units.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use cairn_proto::domain::{CheckpointReason, WorkspaceState};
use cairn_proto::pb;
use cairn_proto::runs::{AttemptState, CheckpointLimits, HostState, RunState, from_proto_duration};
use cairn_proto::size::human_bytes;
use cairn_utils::text::{human_age, plural};
use serde_json::{Value, json};

/// Columns padded to their widest cell; the last column is not padded.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len() - 1;
        let mut out = String::new();
        for (i, cell) in cells.into_iter().enumerate() {
            out.push_str(cell);
            if i < last {
                out.push_str(&" ".repeat(widths[i] - cell.chars().count() + 2));
            }
        }
        out.trim_end().to_owned()
    };
    let mut out = line(headers.to_vec());
    for row in rows {
        out.push('\n');
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// `key  value` lines with the keys aligned.
pub fn key_values(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    pairs
        .iter()
        .map(|(k, v)| format!("{k:width$}  {v}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A timestamp of a message, if set.
macro_rules! time_of {
    ($ts:expr) => {
        $ts.as_ref().map(cairn_proto::domain::from_timestamp)
    };
}
pub(crate) use time_of;

/// RFC 3339, for JSON.
pub fn rfc3339(t: Option<SystemTime>) -> Value {
    match t {
        Some(t) => Value::String(humantime::format_rfc3339_seconds(t).to_string()),
        None => Value::Null,
    }
}

/// "5m ago", for tables.
pub fn age(t: Option<SystemTime>) -> String {
    t.map(human_age).unwrap_or_else(|| "-".into())
}

/// Exact time and age, for key/value blocks.
pub fn when(t: Option<SystemTime>) -> String {
    match t {
        Some(t) => format!(
            "{} ({})",
            humantime::format_rfc3339_seconds(t),
            human_age(t)
        ),
        None => "-".into(),
    }
}

pub fn bytes(n: u64) -> String {
    human_bytes(n)
}

pub fn reason(value: i32) -> &'static str {
    CheckpointReason::try_from(value)
        .map(|r| r.as_str())
        .unwrap_or("unspecified")
}

pub fn state(value: i32) -> &'static str {
    WorkspaceState::try_from(value)
        .map(|s| s.as_str())
        .unwrap_or("unspecified")
}

/// `path:branch@head` per repository, e.g. `app:main@1a2b3c4`.
pub fn repos(repos: &[pb::GitRepoState]) -> String {
    if repos.is_empty() {
        return "-".into();
    }
    repos
        .iter()
        .map(|r| {
            let path = if r.path.is_empty() { "." } else { &r.path };
            let head = &r.head[..r.head.len().min(7)];
            if r.detached || r.branch.is_empty() {
                format!("{path}:@{head}")
            } else {
                format!("{path}:{}@{head}", r.branch)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn workspace_json(w: &pb::Workspace) -> Value {
    json!({
        "id": w.id,
        "name": w.name,
        "tenant": w.tenant,
        "state": state(w.state),
        "generation": w.generation,
        "checkpoint_count": w.checkpoint_count,
        "created_at": rfc3339(time_of!(w.created_at)),
        "updated_at": rfc3339(time_of!(w.updated_at)),
        "latest_checkpoint": w.latest_checkpoint.as_ref().map(checkpoint_json),
        "finished_at": rfc3339(time_of!(w.finished_at)),
        "expires_at": rfc3339(time_of!(w.expires_at)),
        "retention": w.retention.as_ref().map(|r| json!({
            "keep_last": r.keep_last,
            "finished_expiry_secs": r.finished_expiry.as_ref().map(|d| d.seconds),
            "own_keep_last": r.own_keep_last,
            "own_finished_expiry": r.own_finished_expiry,
        })),
        "storage": w.storage.as_ref().map(|s| json!({
            "referenced_bytes": s.referenced_bytes,
            "referenced_packs": s.referenced_packs,
            "unique_bytes": s.unique_bytes,
            "shared_bytes": s.shared_bytes,
        })),
    })
}

/// One reason retention keeps a checkpoint, in words.
pub fn keep_reason(reason: &pb::KeepReason) -> String {
    use pb::keep_reason::Reason;
    match &reason.reason {
        Some(Reason::Newest(_)) => "newest".into(),
        Some(Reason::Recent(r)) => format!("last {} (#{})", r.of, r.rank),
        Some(Reason::Pinned(p)) => match time_of!(p.until) {
            Some(until) => format!(
                "pin {} until {}",
                p.reason,
                humantime::format_rfc3339_seconds(until)
            ),
            None => format!("pin {}", p.reason),
        },
        Some(Reason::RunStart(r)) => format!("run {} started from it", r.run_id),
        None => "unknown".into(),
    }
}

/// Why retention keeps a checkpoint, in words (`-` when unknown).
pub fn kept_by(retention: Option<&pb::CheckpointRetention>) -> String {
    match retention {
        None => "-".into(),
        Some(r) if r.kept_by.is_empty() => "nothing: goes at the next gc".into(),
        Some(r) => r
            .kept_by
            .iter()
            .map(keep_reason)
            .collect::<Vec<_>>()
            .join("; "),
    }
}

/// Until when retention keeps a checkpoint, in words.
pub fn kept_until(retention: Option<&pb::CheckpointRetention>) -> String {
    match retention {
        None => "-".into(),
        Some(r) if r.kept_by.is_empty() => "next gc".into(),
        Some(r) => match time_of!(r.kept_until) {
            Some(until) => humantime::format_rfc3339_seconds(until).to_string(),
            None => "while newest/recent".into(),
        },
    }
}

fn keep_reason_json(reason: &pb::KeepReason) -> Value {
    use pb::keep_reason::Reason;
    match &reason.reason {
        Some(Reason::Newest(_)) => json!({"kind": "newest"}),
        Some(Reason::Recent(r)) => json!({"kind": "recent", "rank": r.rank, "of": r.of}),
        Some(Reason::Pinned(p)) => {
            json!({"kind": "pinned", "reason": p.reason, "until": rfc3339(time_of!(p.until))})
        }
        Some(Reason::RunStart(r)) => {
            json!({"kind": "run_start", "run_id": r.run_id, "until": rfc3339(time_of!(r.until))})
        }
        None => json!({"kind": "unknown"}),
    }
}

pub fn checkpoint_json(c: &pb::Checkpoint) -> Value {
    let stats = c.stats.unwrap_or_default();
    json!({
        "id": c.id,
        "workspace_id": c.workspace_id,
        "sequence": c.sequence,
        "parent_checkpoint_id": c.parent_checkpoint_id,
        "reason": reason(c.reason),
        "generation": c.generation,
        "created_at": rfc3339(time_of!(c.created_at)),
        "format_version": c.format_version,
        "key_id": c.key_id,
        "pack_count": c.pack_count,
        "stored_bytes": c.stored_bytes,
        "stats": {
            "files": stats.files,
            "directories": stats.directories,
            "symlinks": stats.symlinks,
            "total_bytes": stats.total_bytes,
            "files_read": stats.files_read,
            "bytes_read": stats.bytes_read,
            "new_blobs": stats.new_blobs,
            "new_bytes": stats.new_bytes,
            "uploaded_bytes": stats.uploaded_bytes,
            "packs_uploaded": stats.packs_uploaded,
            "duration_ms": stats.duration_ms,
        },
        "repos": c.repos.iter().map(|r| json!({
            "path": r.path,
            "branch": r.branch,
            "head": r.head,
            "upstream": r.upstream,
            "ahead": r.ahead,
            "behind": r.behind,
            "staged": r.staged,
            "unstaged": r.unstaged,
            "untracked": r.untracked,
            "stashes": r.stashes,
            "detached": r.detached,
        })).collect::<Vec<_>>(),
        "warnings": c.warnings,
        "harness": c.harness.as_ref().map(|h| json!({
            "harness": h.harness,
            "session_id": h.session_id,
            "station": h.station,
        })),
        "retention": c.retention.as_ref().map(|r| json!({
            "kept_by": r.kept_by.iter().map(keep_reason_json).collect::<Vec<_>>(),
            "kept_until": rfc3339(time_of!(r.kept_until)),
        })),
    })
}

/// `ck-… (#3, manual, 5m ago)`.
pub fn checkpoint_brief(c: &pb::Checkpoint) -> String {
    format!(
        "{} (#{}, {}, {})",
        c.id,
        c.sequence,
        reason(c.reason),
        age(time_of!(c.created_at))
    )
}

/// RFC 3339 with milliseconds, for events (several happen within a second).
pub fn rfc3339_millis(t: Option<SystemTime>) -> Value {
    match t {
        Some(t) => Value::String(humantime::format_rfc3339_millis(t).to_string()),
        None => Value::Null,
    }
}

pub fn run_state(value: i32) -> &'static str {
    RunState::try_from(value)
        .map(|s| s.as_str())
        .unwrap_or("unspecified")
}

pub fn host_state(value: i32) -> &'static str {
    HostState::try_from(value)
        .map(|s| s.as_str())
        .unwrap_or("unspecified")
}

pub fn attempt_state(value: i32) -> &'static str {
    AttemptState::try_from(value)
        .map(|s| s.as_str())
        .unwrap_or("unspecified")
}

/// A protobuf duration, if set and valid.
pub fn duration(d: Option<&prost_types::Duration>) -> Option<Duration> {
    d.and_then(|d| from_proto_duration(d, "duration").ok())
}

/// "5m", "1h 30m", or "-".
pub fn human_duration(d: Option<Duration>) -> String {
    match d {
        Some(d) => humantime::format_duration(Duration::from_secs(d.as_secs())).to_string(),
        None => "-".into(),
    }
}

fn millis(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| json!(d.as_millis() as u64))
}

/// A protobuf map in key order (protobuf maps have none).
pub fn sorted(map: &HashMap<String, String>) -> BTreeMap<&str, &str> {
    map.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// `k=v,k2=v2` in key order, or `-`.
pub fn pairs(map: &HashMap<String, String>) -> String {
    if map.is_empty() {
        return "-".into();
    }
    sorted(map)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Empty text as `-`.
pub fn or_dash(text: &str) -> String {
    if text.trim().is_empty() {
        "-".into()
    } else {
        text.to_owned()
    }
}

/// The first line of a text, cut to `max` characters, marked when cut.
pub fn first_line(text: &str, max: usize) -> String {
    let line = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    let more_lines = text.trim().lines().count() > 1;
    let mut out: String = line.chars().take(max).collect();
    if line.chars().count() > max || more_lines {
        out.push('…');
    }
    out
}

/// The attempt now holding a sandbox, or the newest one.
pub fn current_attempt(run: &pb::Run) -> Option<&pb::Attempt> {
    run.attempts.last()
}

/// The work a live attempt's workspace holds that no checkpoint has (what
/// losing its sandbox would lose), as its runner last counted it: "-"
/// when unknown or the attempt ended.
pub fn at_risk(attempt: Option<&pb::Attempt>) -> String {
    let Some(unsaved) = attempt
        .filter(|a| a.state != pb::AttemptState::Ended as i32)
        .and_then(|a| a.unsaved.as_ref())
    else {
        return "-".into();
    };
    if unsaved.files == 0 {
        return "nothing".into();
    }
    format!(
        "{}{}, {}",
        if unsaved.complete { "" } else { "at least " },
        plural(unsaved.files, "file", "files"),
        human_bytes(unsaved.bytes)
    )
}

pub fn attempt_json(a: &pb::Attempt) -> Value {
    json!({
        "number": a.number,
        "generation": a.generation,
        "host_id": a.host_id,
        "sandbox_id": a.sandbox_id,
        "state": attempt_state(a.state),
        "started_at": rfc3339(time_of!(a.started_at)),
        "ended_at": rfc3339(time_of!(a.ended_at)),
        "end_reason": a.end_reason,
        "prepare": a.prepare,
        "restored_checkpoint_id": a.restored_checkpoint_id,
        "unsaved": a.unsaved.as_ref().map(|u| json!({
            "files": u.files,
            "bytes": u.bytes,
            "complete": u.complete,
            "reported_at": rfc3339(time_of!(u.reported_at)),
        })),
    })
}

pub fn run_json(r: &pb::Run) -> Value {
    let limits = CheckpointLimits::from(r.checkpoint_limits.unwrap_or_default());
    let harness = r.harness.clone().unwrap_or_default();
    json!({
        "id": r.id,
        "workspace_id": r.workspace_id,
        "station": r.station,
        "state": run_state(r.state),
        "state_reason": r.state_reason,
        "harness": {"name": harness.name, "config": sorted(&harness.config)},
        "prompt": r.prompt,
        "labels": sorted(&r.labels),
        "hold_ms": millis(duration(r.hold.as_ref())),
        "max_attempts": r.max_attempts,
        "attempts": r.attempts.iter().map(attempt_json).collect::<Vec<_>>(),
        "question": r.question,
        "summary": r.summary,
        "harness_session_id": r.harness_session_id,
        "last_checkpoint_id": r.last_checkpoint_id,
        "workspace_checkpointed_at": rfc3339(time_of!(r.workspace_checkpointed_at)),
        "repos": r.repos.iter().map(|repo| json!({
            "name": repo.name,
            "url": repo.url,
            "branch": repo.branch,
        })).collect::<Vec<_>>(),
        "image": r.image,
        "laid_paths": r.laid_paths,
        "checkpoint_interval_ms": millis(duration(r.checkpoint_interval.as_ref())),
        "checkpoint_limits": {
            "max_file_bytes": limits.max_file_bytes,
            "max_total_bytes": limits.max_total_bytes,
        },
        "created_at": rfc3339(time_of!(r.created_at)),
        "updated_at": rfc3339(time_of!(r.updated_at)),
        "hold_until": rfc3339(time_of!(r.hold_until)),
    })
}

pub fn event_json(e: &pb::RunEvent) -> Value {
    json!({
        "sequence": e.sequence,
        "run_id": e.run_id,
        "at": rfc3339_millis(time_of!(e.at)),
        "state": run_state(e.state),
        "reason": e.reason,
        "host_id": e.host_id,
        "attempt": e.attempt,
        "generation": e.generation,
        "checkpoint_id": e.checkpoint_id,
        "detail": e.detail,
    })
}

/// `#2 g5` (attempt 2 at generation 5), or `-` for run-level events.
pub fn attempt_generation(attempt: u32, generation: u64) -> String {
    if attempt == 0 {
        "-".into()
    } else {
        format!("#{attempt} g{generation}")
    }
}

/// One event as one line, columns at fixed widths so lines printed as they
/// arrive (`runs events --follow`) line up: time, state, reason, host,
/// attempt/generation, checkpoint, detail.
pub fn event_line(e: &pb::RunEvent) -> String {
    let at = match time_of!(e.at) {
        Some(t) => humantime::format_rfc3339_millis(t).to_string(),
        None => "-".into(),
    };
    let line = format!(
        "{at:<24}  {:<9}  {:<17}  {:<22}  {:<8}  {:<28}  {}",
        run_state(e.state),
        e.reason,
        or_dash(&e.host_id),
        attempt_generation(e.attempt, e.generation),
        or_dash(&e.checkpoint_id),
        e.detail,
    );
    line.trim_end().to_owned()
}

/// The header over [`event_line`]s.
pub fn event_header() -> String {
    format!(
        "{:<24}  {:<9}  {:<17}  {:<22}  {:<8}  {:<28}  DETAIL",
        "TIME", "STATE", "REASON", "HOST", "ATTEMPT", "CHECKPOINT"
    )
}

pub fn host_json(h: &pb::Host) -> Value {
    json!({
        "id": h.id,
        "name": h.name,
        "state": host_state(h.state),
        "labels": sorted(&h.labels),
        "slots": h.slots,
        "used_slots": h.used_slots,
        "driver": h.driver,
        "registered_at": rfc3339(time_of!(h.registered_at)),
        "last_heartbeat_at": rfc3339(time_of!(h.last_heartbeat_at)),
        "run_ids": h.run_ids,
        "kept_workspaces": h.kept_workspaces,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_columns_by_their_widest_cell() {
        let rows = vec![
            vec!["ws-1".to_owned(), "a".to_owned(), "x".to_owned()],
            vec!["ws-22".to_owned(), "longer".to_owned(), "y".to_owned()],
        ];
        let out = table(&["ID", "NAME", "STATE"], &rows);
        assert_eq!(
            out,
            "ID     NAME    STATE\nws-1   a       x\nws-22  longer  y"
        );
    }

    #[test]
    fn repositories_read_as_path_branch_and_short_head() {
        let repo = pb::GitRepoState {
            path: "app".into(),
            branch: "main".into(),
            head: "1a2b3c4d5e6f".into(),
            ..Default::default()
        };
        let detached = pb::GitRepoState {
            head: "abcdef0123".into(),
            detached: true,
            ..Default::default()
        };
        assert_eq!(repos(&[repo, detached]), "app:main@1a2b3c4, .:@abcdef0");
        assert_eq!(repos(&[]), "-");
    }

    #[test]
    fn a_workspace_in_json_keeps_its_latest_checkpoint_apart() {
        let w = pb::Workspace {
            id: "ws-x".into(),
            name: "demo".into(),
            state: pb::WorkspaceState::Active as i32,
            latest_checkpoint: Some(pb::Checkpoint {
                id: "ck-y".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let value = workspace_json(&w);
        assert_eq!(value["id"], "ws-x");
        assert_eq!(value["state"], "active");
        assert_eq!(value["latest_checkpoint"]["id"], "ck-y");
        assert_eq!(value["created_at"], Value::Null);
    }
}
