//! How cairnctl shows things: aligned tables and key/value blocks for
//! people, stable JSON objects for scripts (an entity's own id is always
//! under `"id"`), and human units.

use std::time::SystemTime;

use cairn_proto::domain::{CheckpointReason, WorkspaceState};
use cairn_proto::pb;
use cairn_runner::restore::{human_age, human_bytes};
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
    })
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
