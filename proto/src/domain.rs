//! Hand-written domain types and their validation from wire messages.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::ids::{BlobId, CheckpointId, CommitRequestId, Generation, PackId, WorkspaceId};
use crate::pb;

/// A field of a received message (or a command-line value) that is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct ValidationError {
    pub field: &'static str,
    pub reason: String,
}

impl ValidationError {
    pub fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }
}

impl From<ValidationError> for tonic::Status {
    fn from(err: ValidationError) -> Self {
        tonic::Status::invalid_argument(err.to_string())
    }
}

/// Why a checkpoint was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointReason {
    Turn,
    Pause,
    End,
    Destroy,
    Interval,
    Manual,
}

impl CheckpointReason {
    pub const ALL: [CheckpointReason; 6] = [
        Self::Turn,
        Self::Pause,
        Self::End,
        Self::Destroy,
        Self::Interval,
        Self::Manual,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Turn => "turn",
            Self::Pause => "pause",
            Self::End => "end",
            Self::Destroy => "destroy",
            Self::Interval => "interval",
            Self::Manual => "manual",
        }
    }
}

impl fmt::Display for CheckpointReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CheckpointReason {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| {
                ValidationError::new(
                    "reason",
                    format!("{s:?} is not one of turn, pause, end, destroy, interval, manual"),
                )
            })
    }
}

impl From<CheckpointReason> for pb::CheckpointReason {
    fn from(r: CheckpointReason) -> Self {
        match r {
            CheckpointReason::Turn => Self::Turn,
            CheckpointReason::Pause => Self::Pause,
            CheckpointReason::End => Self::End,
            CheckpointReason::Destroy => Self::Destroy,
            CheckpointReason::Interval => Self::Interval,
            CheckpointReason::Manual => Self::Manual,
        }
    }
}

impl TryFrom<i32> for CheckpointReason {
    type Error = ValidationError;
    fn try_from(value: i32) -> Result<Self, Self::Error> {
        match pb::CheckpointReason::try_from(value) {
            Ok(pb::CheckpointReason::Turn) => Ok(Self::Turn),
            Ok(pb::CheckpointReason::Pause) => Ok(Self::Pause),
            Ok(pb::CheckpointReason::End) => Ok(Self::End),
            Ok(pb::CheckpointReason::Destroy) => Ok(Self::Destroy),
            Ok(pb::CheckpointReason::Interval) => Ok(Self::Interval),
            Ok(pb::CheckpointReason::Manual) => Ok(Self::Manual),
            Ok(pb::CheckpointReason::Unspecified) => {
                Err(ValidationError::new("reason", "is unspecified"))
            }
            Err(_) => Err(ValidationError::new(
                "reason",
                format!("unknown value {value}"),
            )),
        }
    }
}

/// Lifecycle of a workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkspaceState {
    Active,
    Finished,
    Deleted,
}

impl WorkspaceState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Finished => "finished",
            Self::Deleted => "deleted",
        }
    }
}

impl fmt::Display for WorkspaceState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for WorkspaceState {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "active" => Ok(Self::Active),
            "finished" => Ok(Self::Finished),
            "deleted" => Ok(Self::Deleted),
            _ => Err(ValidationError::new(
                "state",
                format!("unknown workspace state {s:?}"),
            )),
        }
    }
}

impl From<WorkspaceState> for pb::WorkspaceState {
    fn from(s: WorkspaceState) -> Self {
        match s {
            WorkspaceState::Active => Self::Active,
            WorkspaceState::Finished => Self::Finished,
            WorkspaceState::Deleted => Self::Deleted,
        }
    }
}

impl TryFrom<i32> for WorkspaceState {
    type Error = ValidationError;
    fn try_from(value: i32) -> Result<Self, Self::Error> {
        match pb::WorkspaceState::try_from(value) {
            Ok(pb::WorkspaceState::Active) => Ok(Self::Active),
            Ok(pb::WorkspaceState::Finished) => Ok(Self::Finished),
            Ok(pb::WorkspaceState::Deleted) => Ok(Self::Deleted),
            _ => Err(ValidationError::new(
                "state",
                format!("unknown value {value}"),
            )),
        }
    }
}

/// What a pack holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PackKind {
    /// Tree objects.
    Meta,
    /// File content chunks.
    Data,
}

impl PackKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Meta => "meta",
            Self::Data => "data",
        }
    }
}

impl fmt::Display for PackKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PackKind {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "meta" => Ok(Self::Meta),
            "data" => Ok(Self::Data),
            _ => Err(ValidationError::new(
                "kind",
                format!("unknown pack kind {s:?}"),
            )),
        }
    }
}

impl From<PackKind> for pb::PackKind {
    fn from(k: PackKind) -> Self {
        match k {
            PackKind::Meta => Self::Meta,
            PackKind::Data => Self::Data,
        }
    }
}

impl TryFrom<i32> for PackKind {
    type Error = ValidationError;
    fn try_from(value: i32) -> Result<Self, Self::Error> {
        match pb::PackKind::try_from(value) {
            Ok(pb::PackKind::Meta) => Ok(Self::Meta),
            Ok(pb::PackKind::Data) => Ok(Self::Data),
            _ => Err(ValidationError::new(
                "kind",
                format!("unknown pack kind {value}"),
            )),
        }
    }
}

/// Converts a wall-clock time to a protobuf timestamp.
pub fn to_timestamp(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// Converts a protobuf timestamp back (negative times clamp to the epoch).
pub fn from_timestamp(ts: &prost_types::Timestamp) -> SystemTime {
    if ts.seconds < 0 {
        return UNIX_EPOCH;
    }
    UNIX_EPOCH + Duration::new(ts.seconds as u64, ts.nanos.clamp(0, 999_999_999) as u32)
}

/// Parses a workspace reference that may be an id or a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkspaceRef {
    Id(WorkspaceId),
    Name(String),
}

impl FromStr for WorkspaceRef {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.is_empty() {
            return Err(ValidationError::new("workspace", "is empty"));
        }
        if WorkspaceId::looks_like(s) {
            return Ok(Self::Id(s.parse()?));
        }
        validate_name(s)?;
        Ok(Self::Name(s.to_owned()))
    }
}

impl fmt::Display for WorkspaceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Id(id) => write!(f, "{id}"),
            Self::Name(name) => write!(f, "{name}"),
        }
    }
}

/// Workspace names: 1-100 of letters, digits, '-', '_', '.', not starting with '.'.
pub fn validate_name(name: &str) -> Result<(), ValidationError> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ValidationError::new(
            "name",
            format!("{name:?} is not a valid name (1-100 of letters, digits, '-', '_', '.')"),
        ))
    }
}

/// A pack uploaded for a checkpoint, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPack {
    pub pack_id: PackId,
    pub kind: PackKind,
    pub size: u64,
    pub index_offset: u64,
    pub index_length: u32,
    pub blob_ids: Vec<BlobId>,
}

impl TryFrom<pb::NewPack> for NewPack {
    type Error = ValidationError;
    fn try_from(p: pb::NewPack) -> Result<Self, Self::Error> {
        let pack_id: PackId = p.pack_id.parse()?;
        let kind = PackKind::try_from(p.kind)?;
        let index_end = p.index_offset.checked_add(u64::from(p.index_length));
        if p.index_length == 0 || index_end.is_none_or(|end| end > p.size) {
            return Err(ValidationError::new(
                "new_packs.index",
                format!(
                    "index range of pack {pack_id} lies outside its {} bytes",
                    p.size
                ),
            ));
        }
        let blob_ids = p
            .blob_ids
            .iter()
            .map(|b| BlobId::from_slice(b))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            pack_id,
            kind,
            size: p.size,
            index_offset: p.index_offset,
            index_length: p.index_length,
            blob_ids,
        })
    }
}

/// A compaction (CompactPacksRequest), validated: every new pack a
/// replacement names is among the new packs, no pack is replaced twice,
/// and no pack both replaced and new.
#[derive(Debug, Clone)]
pub struct CompactPacks {
    pub workspace: WorkspaceRef,
    pub new_packs: Vec<NewPack>,
    /// Old pack → the new packs that hold its live blobs.
    pub replacements: Vec<(PackId, Vec<PackId>)>,
    pub checkpoints: Vec<CheckpointId>,
}

impl TryFrom<pb::CompactPacksRequest> for CompactPacks {
    type Error = ValidationError;
    fn try_from(r: pb::CompactPacksRequest) -> Result<Self, Self::Error> {
        let workspace: WorkspaceRef = r.workspace.parse()?;
        let new_packs = r
            .new_packs
            .into_iter()
            .map(NewPack::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        let new_ids: std::collections::HashSet<&PackId> =
            new_packs.iter().map(|p| &p.pack_id).collect();
        if new_ids.len() != new_packs.len() {
            return Err(ValidationError::new("new_packs", "a pack is listed twice"));
        }
        let mut replaced = std::collections::HashSet::new();
        let mut replacements = Vec::with_capacity(r.replacements.len());
        for replacement in r.replacements {
            let old: PackId = replacement.old_pack_id.parse()?;
            if new_ids.contains(&old) || !replaced.insert(old.clone()) {
                return Err(ValidationError::new(
                    "replacements",
                    format!("pack {old} is replaced twice, or is also new"),
                ));
            }
            let news = replacement
                .new_pack_ids
                .iter()
                .map(|id| id.parse::<PackId>())
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(unknown) = news.iter().find(|id| !new_ids.contains(id)) {
                return Err(ValidationError::new(
                    "replacements",
                    format!("pack {unknown} is not among the new packs"),
                ));
            }
            replacements.push((old, news));
        }
        if replacements.is_empty() {
            return Err(ValidationError::new("replacements", "is empty"));
        }
        let checkpoints = r
            .checkpoint_ids
            .iter()
            .map(|id| id.parse())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            workspace,
            new_packs,
            replacements,
            checkpoints,
        })
    }
}

/// A checkpoint commit, validated.
#[derive(Debug, Clone)]
pub struct CommitCheckpoint {
    pub workspace: WorkspaceRef,
    pub generation: Generation,
    pub parent: Option<CheckpointId>,
    pub reason: CheckpointReason,
    pub format_version: u32,
    pub root_tree: BlobId,
    pub new_packs: Vec<NewPack>,
    pub referenced_packs: Vec<PackId>,
    pub stats: pb::CheckpointStats,
    pub repos: Vec<pb::GitRepoState>,
    pub warnings: Vec<String>,
    pub harness: Option<pb::HarnessSession>,
    pub key_id: String,
    /// Set by runners that retry: the same id commits once.
    pub request_id: Option<CommitRequestId>,
}

impl TryFrom<pb::CommitCheckpointRequest> for CommitCheckpoint {
    type Error = ValidationError;
    fn try_from(r: pb::CommitCheckpointRequest) -> Result<Self, Self::Error> {
        let workspace: WorkspaceRef = r.workspace.parse()?;
        let parent = if r.parent_checkpoint_id.is_empty() {
            None
        } else {
            Some(r.parent_checkpoint_id.parse()?)
        };
        let reason = CheckpointReason::try_from(r.reason)?;
        if r.format_version == 0 {
            return Err(ValidationError::new("format_version", "is missing"));
        }
        let root_tree = BlobId::from_slice(&r.root_tree)
            .map_err(|e| ValidationError::new("root_tree", e.reason))?;
        let new_packs = r
            .new_packs
            .into_iter()
            .map(NewPack::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        let referenced_packs = r
            .referenced_packs
            .iter()
            .map(|p| p.parse::<PackId>())
            .collect::<Result<Vec<_>, _>>()?;
        if referenced_packs.is_empty() {
            return Err(ValidationError::new(
                "referenced_packs",
                "is empty; every checkpoint references at least the pack of its root tree",
            ));
        }
        // A set: a hostile commit may list many packs both ways.
        let referenced: std::collections::HashSet<&PackId> = referenced_packs.iter().collect();
        for new in &new_packs {
            if !referenced.contains(&new.pack_id) {
                return Err(ValidationError::new(
                    "new_packs",
                    format!("pack {} is uploaded but not referenced", new.pack_id),
                ));
            }
        }
        if r.key_id.is_empty() {
            return Err(ValidationError::new("key_id", "is missing"));
        }
        Ok(Self {
            workspace,
            generation: Generation(r.generation),
            parent,
            reason,
            format_version: r.format_version,
            root_tree,
            new_packs,
            referenced_packs,
            stats: r.stats.unwrap_or_default(),
            repos: r.repos,
            warnings: r.warnings,
            harness: r.harness,
            key_id: r.key_id,
            request_id: match r.request_id.as_str() {
                "" => None,
                id => Some(id.parse()?),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_round_trip_through_text_and_wire() {
        for r in CheckpointReason::ALL {
            assert_eq!(r.as_str().parse::<CheckpointReason>().unwrap(), r);
            let wire: pb::CheckpointReason = r.into();
            assert_eq!(CheckpointReason::try_from(wire as i32).unwrap(), r);
        }
        assert!("sometimes".parse::<CheckpointReason>().is_err());
        assert!(CheckpointReason::try_from(0).is_err());
    }

    #[test]
    fn workspace_refs_tell_ids_from_names() {
        let id = WorkspaceId::generate();
        assert_eq!(
            id.as_str().parse::<WorkspaceRef>().unwrap(),
            WorkspaceRef::Id(id)
        );
        assert_eq!(
            "my-task".parse::<WorkspaceRef>().unwrap(),
            WorkspaceRef::Name("my-task".into())
        );
        assert!("../etc".parse::<WorkspaceRef>().is_err());
        assert!("".parse::<WorkspaceRef>().is_err());
    }

    #[test]
    fn a_commit_with_a_short_root_tree_names_the_field() {
        let req = pb::CommitCheckpointRequest {
            workspace: "w".into(),
            reason: pb::CheckpointReason::Manual as i32,
            format_version: 1,
            root_tree: vec![1, 2, 3],
            referenced_packs: vec!["a".repeat(64)],
            key_id: "k1".into(),
            ..Default::default()
        };
        let err = CommitCheckpoint::try_from(req).unwrap_err();
        assert_eq!(err.field, "root_tree");
    }
}
