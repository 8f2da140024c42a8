//! The outcome file: how the agent tells the runner how its turn ended.
//!
//! `/workspace/.cairn/outcome.json` (the harness gets its path in
//! `CAIRN_OUTCOME_FILE`) holds one JSON object:
//!
//! ```json
//! {"status": "needs_input", "question": "Which colour should the button be?"}
//! {"status": "done", "summary": "Added the button."}          // summary optional
//! {"status": "failed", "error": "The build needs a licence key."}
//! ```
//!
//! Beside the status the agent may leave its handoff note (see
//! [`super::handoff`]): `"handoff": {"changed": …, "checked": …,
//! "uncertain": …, "next": …}`, each a text or a list of texts.
//!
//! The agent writes it itself or runs `cairn-runner ask "question"`. The
//! runner clears it before every turn (and a new run clears one an earlier
//! agent left before the harness starts), reads it when the turn ends, and
//! deletes it after reading. A turn without the file ends by the harness's
//! exit status: success is `done`, anything else `failed`.

use std::fs;
use std::io::{self, Read as _};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::handoff::AgentHandoff;
use crate::harness::{OUTCOME_ENV, OUTCOME_FILE};

/// Larger files are refused unread (a question is a few lines).
const MAX_BYTES: u64 = 1 << 20;

/// How the agent says its turn ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Outcome {
    /// The agent needs a person to answer `question`.
    NeedsInput { question: String },
    /// The work is done.
    Done {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        summary: Option<String>,
    },
    /// The work cannot be done.
    Failed { error: String },
}

impl Outcome {
    fn validate(self) -> Result<Self, String> {
        match &self {
            Self::NeedsInput { question } if question.trim().is_empty() => {
                Err("the question is empty".into())
            }
            Self::Failed { error } if error.trim().is_empty() => Err("the error is empty".into()),
            _ => Ok(self),
        }
    }

    pub fn status(&self) -> &'static str {
        match self {
            Self::NeedsInput { .. } => "needs_input",
            Self::Done { .. } => "done",
            Self::Failed { .. } => "failed",
        }
    }
}

/// Why the outcome file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum OutcomeError {
    #[error("cannot read the outcome file {}: {source}", .path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot write the outcome file {}: {source}", .path.display())]
    Write { path: PathBuf, source: io::Error },
    #[error("the outcome file {} is invalid: {reason}", .path.display())]
    Invalid { path: PathBuf, reason: String },
}

/// The outcome file of the workspace at `root`.
pub fn path_in(root: &Path) -> PathBuf {
    root.join(OUTCOME_FILE)
}

/// The outcome file named by `CAIRN_OUTCOME_FILE`, else the one of `/workspace`.
pub fn path_from_env() -> PathBuf {
    match std::env::var_os(OUTCOME_ENV) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => path_in(Path::new("/workspace")),
    }
}

/// Reads the outcome file and deletes it (`None` when there is none), with
/// the agent's handoff note if it wrote one (a handoff that cannot be read
/// is logged and left out: the runner composes the note then).
pub fn take_with_handoff(
    path: &Path,
) -> Result<Option<(Outcome, Option<AgentHandoff>)>, OutcomeError> {
    let Some(text) = take_text(path)? else {
        return Ok(None);
    };
    let outcome = parse(path, &text)?;
    let handoff = match AgentHandoff::from_outcome_json(&text) {
        Ok(handoff) => handoff,
        Err(e) => {
            tracing::warn!(error = %e, "the handoff in the outcome file cannot be used; the runner composes the note");
            None
        }
    };
    Ok(Some((outcome, handoff)))
}

/// The outcome file's text, the file deleted; `None` when there is none.
fn take_text(path: &Path) -> Result<Option<String>, OutcomeError> {
    let read_error = |source| OutcomeError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = match fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(read_error(e)),
    };
    let mut text = String::new();
    let read = file.take(MAX_BYTES + 1).read_to_string(&mut text);
    // Deleted whatever it holds: a bad file must not be read again next turn.
    let removed = fs::remove_file(path);
    read.map_err(read_error)?;
    removed.map_err(read_error)?;
    if text.len() as u64 > MAX_BYTES {
        return Err(OutcomeError::Invalid {
            path: path.to_path_buf(),
            reason: format!("it is larger than {MAX_BYTES} bytes"),
        });
    }
    Ok(Some(text))
}

fn parse(path: &Path, text: &str) -> Result<Outcome, OutcomeError> {
    let invalid = |reason: String| OutcomeError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let outcome: Outcome = serde_json::from_str(text).map_err(|e| {
        invalid(format!(
            "{e} (expected {{\"status\":\"needs_input\",\"question\":…}}, {{\"status\":\"done\"}} or {{\"status\":\"failed\",\"error\":…}})"
        ))
    })?;
    outcome.validate().map_err(invalid)
}

/// Removes a stale outcome file before a turn.
pub fn clear(path: &Path) -> Result<(), OutcomeError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(OutcomeError::Write {
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// Writes `outcome` to `path` atomically; returns the outcome it replaced.
pub fn write(path: &Path, outcome: &Outcome) -> Result<Option<Outcome>, OutcomeError> {
    let outcome = outcome
        .clone()
        .validate()
        .map_err(|reason| OutcomeError::Invalid {
            path: path.to_path_buf(),
            reason,
        })?;
    let write_error = |source| OutcomeError::Write {
        path: path.to_path_buf(),
        source,
    };
    let previous = fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok());
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(write_error)?;
    }
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(format!(".{}.tmp", std::process::id()));
    let json = serde_json::to_string(&outcome).expect("an outcome serialises");
    fs::write(&temporary, json + "\n").map_err(write_error)?;
    fs::rename(&temporary, path).map_err(write_error)?;
    Ok(previous)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The outcome alone.
    fn take(path: &Path) -> Result<Option<Outcome>, OutcomeError> {
        take_with_handoff(path).map(|taken| taken.map(|(outcome, _)| outcome))
    }

    #[test]
    fn an_outcome_is_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = path_in(dir.path());
        assert_eq!(take(&path).unwrap(), None);
        let asked = Outcome::NeedsInput {
            question: "Which colour?".into(),
        };
        assert_eq!(write(&path, &asked).unwrap(), None);
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "{\"status\":\"needs_input\",\"question\":\"Which colour?\"}\n"
        );
        assert_eq!(
            write(&path, &asked).unwrap(),
            Some(asked.clone()),
            "the earlier outcome is named"
        );
        assert_eq!(take(&path).unwrap(), Some(asked));
        assert!(!path.exists(), "deleted after reading");
        assert_eq!(take(&path).unwrap(), None);
    }

    #[test]
    fn every_status_parses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("outcome.json");
        for (text, expected) in [
            (r#"{"status":"done"}"#, Outcome::Done { summary: None }),
            (
                r#"{"status":"done","summary":"ok","extra":1}"#,
                Outcome::Done {
                    summary: Some("ok".into()),
                },
            ),
            (
                r#"{"status":"failed","error":"no key"}"#,
                Outcome::Failed {
                    error: "no key".into(),
                },
            ),
        ] {
            fs::write(&path, text).unwrap();
            assert_eq!(take(&path).unwrap(), Some(expected), "{text}");
        }
    }

    #[test]
    fn bad_files_are_refused_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("outcome.json");
        for (text, words) in [
            (r#"{"status":"maybe"}"#, "unknown variant `maybe`"),
            (r#"{"status":"needs_input"}"#, "missing field `question`"),
            (
                r#"{"status":"needs_input","question":"  "}"#,
                "the question is empty",
            ),
            ("not json", "expected {\"status\":\"needs_input\""),
        ] {
            fs::write(&path, text).unwrap();
            let err = take(&path).unwrap_err().to_string();
            assert!(
                err.contains("is invalid") && err.contains(words),
                "{text}: {err}"
            );
            assert!(!path.exists());
        }
        let err = write(
            &path,
            &Outcome::NeedsInput {
                question: "".into(),
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("the question is empty"), "{err}");
        assert!(!path.exists());
    }

    #[test]
    fn the_agents_handoff_comes_with_its_outcome() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("outcome.json");
        fs::write(
            &path,
            r#"{"status":"done","summary":"ok","handoff":{"next":"ship it"}}"#,
        )
        .unwrap();
        let (outcome, handoff) = take_with_handoff(&path).unwrap().unwrap();
        assert_eq!(
            outcome,
            Outcome::Done {
                summary: Some("ok".into())
            }
        );
        assert_eq!(handoff, Some(AgentHandoff::new("", "", "", "ship it")));
        assert!(!path.exists());
        // A handoff that cannot be read does not spoil the outcome.
        fs::write(
            &path,
            r#"{"status":"failed","error":"no key","handoff":[1]}"#,
        )
        .unwrap();
        let (outcome, handoff) = take_with_handoff(&path).unwrap().unwrap();
        assert_eq!(
            outcome,
            Outcome::Failed {
                error: "no key".into()
            }
        );
        assert_eq!(handoff, None);
    }
}
