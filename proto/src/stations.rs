//! Stations: the files a run lays for its station, and the handoff note
//! every run leaves for the next (docs/stations.md).
//!
//! Both arrive over the wire (a client's `CreateRunRequest.lay`, a runner's
//! `ReportOutcomeRequest.handoff`) and are validated here, once, into the
//! types the coordinator stores. The runner checks the same path rules again
//! against the filesystem before it writes or removes anything.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::ValidationError;
use crate::pb;

/// Most files one run may lay.
pub const MAX_LAID_FILES: usize = 64;
/// Largest laid file, in bytes.
pub const MAX_LAID_FILE_BYTES: usize = 1 << 20;
/// Most bytes one run may lay in all.
pub const MAX_LAID_BYTES: usize = 4 << 20;
/// Longest laid path, in bytes.
pub const MAX_LAY_PATH_BYTES: usize = 1024;

/// Largest field of a handoff note, in bytes.
pub const MAX_NOTE_FIELD_BYTES: usize = 16 << 10;

/// What a note says for a field nobody gave.
pub const NOT_STATED: &str = "not stated";

/// Station of a run that names none.
pub const DEFAULT_STATION: &str = "default";

/// Checks that `path` may be laid (or named in `.cairn/laid.json`): relative,
/// `/`-separated normal components, not in a `.git` directory, and not in
/// `.cairn` except under `.cairn/state/` (the harness state directories).
pub fn validate_lay_path(path: &str) -> Result<(), ValidationError> {
    let refuse = |why: &str| Err(ValidationError::new("lay", format!("path {path:?} {why}")));
    if path.is_empty() {
        return refuse("is empty");
    }
    if path.len() > MAX_LAY_PATH_BYTES {
        return refuse(&format!("is longer than {MAX_LAY_PATH_BYTES} bytes"));
    }
    if path.contains('\0') {
        return refuse("holds a NUL byte");
    }
    if path.starts_with('/') {
        return refuse("is absolute; paths are relative to the workspace");
    }
    let components: Vec<&str> = path.split('/').collect();
    for component in &components {
        match *component {
            "" => return refuse("has an empty component (\"//\" or a trailing \"/\")"),
            "." => return refuse("has a \".\" component"),
            ".." => return refuse("leaves the workspace (\"..\")"),
            c if c.eq_ignore_ascii_case(".git") => {
                return refuse("is inside a .git directory");
            }
            _ => {}
        }
    }
    if components[0] == ".cairn" && !(components.len() > 2 && components[1] == "state") {
        return refuse(
            "is in .cairn, which belongs to the runner (only .cairn/state/… may be laid)",
        );
    }
    Ok(())
}

/// The files a run lays, validated: safe paths, none inside another, within
/// the limits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaidFiles(BTreeMap<String, Vec<u8>>);

impl LaidFiles {
    /// Validates path → content pairs.
    pub fn new(
        files: impl IntoIterator<Item = (String, Vec<u8>)>,
    ) -> Result<Self, ValidationError> {
        let files: BTreeMap<String, Vec<u8>> = files.into_iter().collect();
        if files.len() > MAX_LAID_FILES {
            return Err(ValidationError::new(
                "lay",
                format!("{} files; a run lays at most {MAX_LAID_FILES}", files.len()),
            ));
        }
        let mut total = 0usize;
        for (path, content) in &files {
            validate_lay_path(path)?;
            if content.len() > MAX_LAID_FILE_BYTES {
                return Err(ValidationError::new(
                    "lay",
                    format!(
                        "{path} has {} bytes; the limit is {MAX_LAID_FILE_BYTES}",
                        content.len()
                    ),
                ));
            }
            total += content.len();
        }
        if total > MAX_LAID_BYTES {
            return Err(ValidationError::new(
                "lay",
                format!("the files hold {total} bytes; the limit is {MAX_LAID_BYTES}"),
            ));
        }
        let paths: BTreeSet<&str> = files.keys().map(String::as_str).collect();
        for path in &paths {
            let mut parent = *path;
            while let Some((up, _)) = parent.rsplit_once('/') {
                if paths.contains(up) {
                    return Err(ValidationError::new(
                        "lay",
                        format!("{up} is laid as a file, so {path} cannot be laid inside it"),
                    ));
                }
                parent = up;
            }
        }
        Ok(Self(files))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The paths, in order.
    pub fn paths(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Vec<u8>)> {
        self.0.iter()
    }
}

impl TryFrom<HashMap<String, Vec<u8>>> for LaidFiles {
    type Error = ValidationError;

    /// Validates `CreateRunRequest.lay` (or `AttemptSpec.lay`).
    fn try_from(files: HashMap<String, Vec<u8>>) -> Result<Self, ValidationError> {
        Self::new(files)
    }
}

word_enum!(
    /// The fields of a handoff note the agent may leave out (and the runner
    /// then fills in).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
    NoteField, "handoff.composed", {
        Changed => "changed",
        Checked => "checked",
        Uncertain => "uncertain",
        Next => "next",
    }
);

/// What a handoff note says, validated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandoffText {
    pub summary: String,
    pub changed: String,
    pub checked: String,
    pub uncertain: String,
    pub next: String,
    /// The fields the runner filled in, in order, each once.
    pub composed: Vec<NoteField>,
}

impl TryFrom<pb::HandoffText> for HandoffText {
    type Error = ValidationError;

    fn try_from(text: pb::HandoffText) -> Result<Self, ValidationError> {
        for (field, value) in [
            ("handoff.summary", &text.summary),
            ("handoff.changed", &text.changed),
            ("handoff.checked", &text.checked),
            ("handoff.uncertain", &text.uncertain),
            ("handoff.next", &text.next),
        ] {
            if value.len() > MAX_NOTE_FIELD_BYTES {
                return Err(ValidationError::new(
                    field,
                    format!(
                        "has {} bytes; the limit is {MAX_NOTE_FIELD_BYTES}",
                        value.len()
                    ),
                ));
            }
        }
        let mut composed = BTreeSet::new();
        for name in &text.composed {
            let field: NoteField = name.parse()?;
            if !composed.insert(field) {
                return Err(ValidationError::new(
                    "handoff.composed",
                    format!("{name:?} is listed twice"),
                ));
            }
        }
        Ok(Self {
            summary: text.summary,
            changed: text.changed,
            checked: text.checked,
            uncertain: text.uncertain,
            next: text.next,
            composed: composed.into_iter().collect(),
        })
    }
}

impl From<HandoffText> for pb::HandoffText {
    fn from(text: HandoffText) -> Self {
        Self {
            summary: text.summary,
            changed: text.changed,
            checked: text.checked,
            uncertain: text.uncertain,
            next: text.next,
            composed: text
                .composed
                .into_iter()
                .map(|f| f.as_str().to_owned())
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lay_paths_stay_in_the_workspace_and_out_of_git_and_the_runner() {
        for ok in [
            "AGENTS.md",
            "app/.claude/skills/review/SKILL.md",
            ".cairn/state/claude/skills/review/SKILL.md",
            ".github/copilot-instructions.md",
            "a..b/c",
        ] {
            validate_lay_path(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for (bad, words) in [
            ("", "is empty"),
            ("/etc/passwd", "is absolute"),
            ("../x", "leaves the workspace"),
            ("app/../../x", "leaves the workspace"),
            ("app//x", "empty component"),
            ("app/", "empty component"),
            ("./x", "\".\" component"),
            ("app/.git/hooks/post-merge", "inside a .git directory"),
            (".GIT/config", "inside a .git directory"),
            (".cairn/outcome.json", "belongs to the runner"),
            (".cairn/laid.json", "belongs to the runner"),
            (".cairn/state", "belongs to the runner"),
            ("a\0b", "NUL"),
        ] {
            let err = validate_lay_path(bad).unwrap_err().to_string();
            assert!(err.contains(words), "{bad:?}: {err}");
        }
        assert!(validate_lay_path(&"a/".repeat(600)).is_err());
    }

    #[test]
    fn laid_files_are_checked_as_a_whole() {
        let files = |list: &[(&str, usize)]| {
            list.iter()
                .map(|(p, n)| ((*p).to_owned(), vec![b'x'; *n]))
                .collect::<Vec<_>>()
        };
        let ok = LaidFiles::new(files(&[("b.md", 1), ("a/x.md", 2)])).unwrap();
        assert_eq!(ok.paths(), ["a/x.md", "b.md"]);
        assert_eq!(ok.len(), 2);
        let err = LaidFiles::new(files(&[("a", 1), ("a/b/c", 1)])).unwrap_err();
        assert!(err.to_string().contains("a is laid as a file"), "{err}");
        let err = LaidFiles::new(files(&[("big", MAX_LAID_FILE_BYTES + 1)])).unwrap_err();
        assert!(err.to_string().contains("the limit is"), "{err}");
        let many: Vec<(String, Vec<u8>)> = (0..=MAX_LAID_FILES)
            .map(|i| (format!("f{i}"), Vec::new()))
            .collect();
        assert!(LaidFiles::new(many).is_err());
        let heavy: Vec<(String, Vec<u8>)> = (0..5)
            .map(|i| (format!("f{i}"), vec![0; MAX_LAID_FILE_BYTES]))
            .collect();
        assert!(LaidFiles::new(heavy).is_err());
        assert!(LaidFiles::new(files(&[("../x", 1)])).is_err());
    }

    #[test]
    fn handoff_texts_are_validated_on_receipt() {
        let text = pb::HandoffText {
            summary: "done".into(),
            changed: "app: 1 commit".into(),
            composed: vec!["next".into(), "changed".into()],
            ..Default::default()
        };
        let valid = HandoffText::try_from(text.clone()).unwrap();
        assert_eq!(valid.composed, [NoteField::Changed, NoteField::Next]);
        let back = pb::HandoffText::from(valid);
        assert_eq!(back.composed, ["changed", "next"]);
        let twice = pb::HandoffText {
            composed: vec!["next".into(), "next".into()],
            ..text.clone()
        };
        assert!(HandoffText::try_from(twice).is_err());
        let unknown = pb::HandoffText {
            composed: vec!["summary".into()],
            ..text.clone()
        };
        assert!(HandoffText::try_from(unknown).is_err());
        let long = pb::HandoffText {
            next: "x".repeat(MAX_NOTE_FIELD_BYTES + 1),
            ..text
        };
        let err = HandoffText::try_from(long).unwrap_err();
        assert_eq!(err.field, "handoff.next");
    }
}
