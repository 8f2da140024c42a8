//! Harness adapters: how the runner drives one agent CLI through turns.
//!
//! A harness is the agent program (Claude Code, or anything a `command`
//! template describes). The runner knows it only through [`Harness`]:
//! - which command line starts a new conversation and which continues one
//!   by id ([`Harness::command`] for a [`TurnRequest`]);
//! - what its output says, line by line ([`Harness::observe`]): the
//!   conversation's session id, the turn's summary, an error, or that the
//!   session to resume is gone;
//! - what it needs before the first turn ([`Harness::prepare`]: its state
//!   directory inside the workspace, fresh credentials) and which files must
//!   never be checkpointed ([`Harness::excludes`], e.g. credentials).
//!
//! [`process`] runs one turn as a child process in its own process group,
//! with stdout parsed line by line and stderr passed through.
//!
//! Adapters:
//! - [`claude`] — Claude Code, exactly per ../shared/reference/harnesses.md.
//! - [`codex`] — Codex CLI, per the same reference.
//! - [`gemini`] — Gemini CLI, per the same reference.
//! - [`command`] — any CLI, described by `start` / `resume` templates and a
//!   `session_regex`.

pub mod claude;
pub mod codex;
pub mod command;
pub mod gemini;
pub mod pattern;
pub mod process;
pub mod template;

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cairn_proto::pb;

pub use process::{RunningTurn, TurnEvent, TurnExit, spawn_turn};

/// Where the agent tells the runner how its turn ended, relative to the root.
pub const OUTCOME_FILE: &str = ".cairn/outcome.json";
/// The environment variable naming the outcome file for the harness (and
/// for `cairn-runner ask` and the demo agent).
pub const OUTCOME_ENV: &str = "CAIRN_OUTCOME_FILE";

/// What one turn is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnRequest {
    /// Open a new conversation with this message.
    Start { message: String },
    /// Continue conversation `session_id` with this message; with `fork`,
    /// continue a copy of it under a new id and leave the original as it is
    /// (a forked workspace's first turn: the source and every fork must not
    /// write to one conversation).
    Resume {
        session_id: String,
        message: String,
        fork: bool,
    },
}

impl TurnRequest {
    pub fn message(&self) -> &str {
        match self {
            Self::Start { message } | Self::Resume { message, .. } => message,
        }
    }
}

/// A process to start for one turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HarnessCommand {
    pub program: String,
    pub args: Vec<String>,
    /// Set on top of the runner's environment (minus its tokens).
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    /// A session id that holds as soon as the process runs (the harness was
    /// told to use it and reports nothing itself).
    pub session_at_start: Option<String>,
}

/// Which output stream a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// What the harness's output said during one turn.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// The conversation's id, as the harness reported it.
    pub session_id: Option<String>,
    /// What the turn did, in the harness's words.
    pub summary: Option<String>,
    /// The harness reported that the turn failed, and why.
    pub error: Option<String>,
    /// The conversation to resume does not exist (any more).
    pub session_lost: bool,
}

/// An adapter for one agent CLI, configured for one run.
pub trait Harness: Send + Sync + fmt::Debug {
    /// The adapter's name, as in `HarnessSpec.name`.
    fn name(&self) -> &str;
    /// Whether a conversation can be continued by its id.
    fn can_resume(&self) -> bool;
    /// Whether a conversation can be forked: continued as a copy under a new
    /// id, the original left unchanged.
    fn can_fork(&self) -> bool {
        false
    }
    /// Gitignore-style patterns, relative to the root, that no checkpoint
    /// may contain (credentials).
    fn excludes(&self) -> Vec<String>;
    /// Readies the sandbox before the first turn.
    fn prepare(&self) -> Result<(), HarnessError>;
    /// The working directory the configuration asks for (absolute), if any.
    fn configured_cwd(&self) -> Option<PathBuf>;
    /// The command line of one turn, run in `cwd`.
    fn command(&self, turn: &TurnRequest, cwd: &Path) -> Result<HarnessCommand, HarnessError>;
    /// Reads one line of output into `observed`.
    fn observe(&self, stream: Stream, line: &str, observed: &mut Observed);
}

/// Why a harness cannot be set up or started.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("unknown harness {0:?} (this runner has: claude, codex, gemini, command)")]
    Unknown(String),
    #[error("harness {harness}: unknown setting {key:?} (known: {known})")]
    UnknownSetting {
        harness: &'static str,
        key: String,
        known: String,
    },
    #[error("harness {harness}: the setting {key:?} is required")]
    MissingSetting {
        harness: &'static str,
        key: &'static str,
    },
    #[error("harness {harness}: setting {key:?}: {reason}")]
    BadSetting {
        harness: &'static str,
        key: &'static str,
        reason: String,
    },
    #[error("harness {harness}: setting {key:?}: {source}")]
    Template {
        harness: &'static str,
        key: &'static str,
        source: template::TemplateError,
    },
    #[error("harness {harness}: setting {key:?}: {source}")]
    Pattern {
        harness: &'static str,
        key: &'static str,
        source: pattern::PatternError,
    },
    #[error("preparing {}: {source}", .path.display())]
    Prepare { path: PathBuf, source: io::Error },
    #[error("cannot start {program:?}: {source}")]
    Spawn { program: String, source: io::Error },
}

/// The adapter a run's harness spec names, configured for the workspace at `root`.
pub fn from_spec(spec: &pb::HarnessSpec, root: &Path) -> Result<Arc<dyn Harness>, HarnessError> {
    let config: BTreeMap<String, String> = spec
        .config
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    match spec.name.as_str() {
        "claude" => Ok(Arc::new(claude::Claude::new(&config, root)?)),
        "codex" => Ok(Arc::new(codex::Codex::new(&config, root)?)),
        "gemini" => Ok(Arc::new(gemini::Gemini::new(&config, root)?)),
        "command" => Ok(Arc::new(command::CommandHarness::new(&config, root)?)),
        other => Err(HarnessError::Unknown(other.to_owned())),
    }
}

/// Refuses settings an adapter does not know (a typo must not be ignored).
fn check_settings(
    harness: &'static str,
    config: &BTreeMap<String, String>,
    known: &[&str],
) -> Result<(), HarnessError> {
    match config.keys().find(|k| !known.contains(&k.as_str())) {
        Some(key) => Err(HarnessError::UnknownSetting {
            harness,
            key: key.clone(),
            known: known.join(", "),
        }),
        None => Ok(()),
    }
}

/// The `cwd` setting: relative to the root, or absolute inside it.
fn cwd_setting(
    harness: &'static str,
    config: &BTreeMap<String, String>,
    root: &Path,
) -> Result<Option<PathBuf>, HarnessError> {
    let Some(value) = config
        .get("cwd")
        .map(|v| v.trim())
        .filter(|v| !v.is_empty())
    else {
        return Ok(None);
    };
    let path = Path::new(value);
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        root.join(path)
    };
    let inside = joined.strip_prefix(root).is_ok_and(|rest| {
        rest.components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
    });
    if !inside {
        return Err(HarnessError::BadSetting {
            harness,
            key: "cwd",
            reason: format!(
                "{value:?} is not a directory inside the workspace {}",
                root.display()
            ),
        });
    }
    Ok(Some(joined))
}

/// The `args` setting, split into words like a shell would.
fn split_args(harness: &'static str, args: Option<String>) -> Result<Vec<String>, HarnessError> {
    match args {
        Some(args) => template::split(&args).map_err(|source| HarnessError::Template {
            harness,
            key: "args",
            source,
        }),
        None => Ok(Vec::new()),
    }
}

/// `$HOME/<name>`, the default `credentials_dir` of an adapter.
fn home_subdir(name: &str) -> Option<PathBuf> {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(name))
}

/// Creates the harness's state directory `state_dir` (private) and copies
/// each credential file present in `source_dir` into `target_dir` (mode
/// 0600). Credentials are never logged, only which files were copied.
fn copy_credentials(
    harness: &'static str,
    state_dir: &Path,
    target_dir: &Path,
    source_dir: Option<&Path>,
    files: &[&str],
) -> Result<(), HarnessError> {
    use std::os::unix::fs::PermissionsExt as _;
    let prepare_error = |path: &Path| {
        let path = path.to_path_buf();
        move |source| HarnessError::Prepare { path, source }
    };
    for dir in [state_dir, target_dir] {
        fs::create_dir_all(dir).map_err(prepare_error(dir))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(prepare_error(dir))?;
    }
    let Some(source_dir) = source_dir else {
        return Ok(());
    };
    for file in files {
        let from = source_dir.join(file);
        if !from.is_file() {
            continue;
        }
        let to = target_dir.join(file);
        fs::copy(&from, &to).map_err(prepare_error(&to))?;
        fs::set_permissions(&to, fs::Permissions::from_mode(0o600)).map_err(prepare_error(&to))?;
        tracing::debug!(harness, file, from = %source_dir.display(), "credentials copied in");
    }
    Ok(())
}

/// The working directory of a new conversation when the configuration names
/// none: the only repository directly under the root, else the root.
pub fn default_cwd(root: &Path) -> PathBuf {
    let Ok(entries) = fs::read_dir(root) else {
        return root.to_path_buf();
    };
    let repos: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name() != ".cairn" && e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .filter(|p| p.join(".git").exists())
        .collect();
    match <[PathBuf; 1]>::try_from(repos) {
        Ok([only]) => only,
        Err(_) => root.to_path_buf(),
    }
}

/// A new random (version 4) UUID, in the usual hyphenated form.
pub fn new_session_id() -> String {
    let mut bytes: [u8; 16] = rand::random();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex = hex::encode(bytes);
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Whether `s` is a hyphenated UUID (any version).
pub fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, len)| g.len() == len && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_are_uuids() {
        let a = new_session_id();
        assert!(is_uuid(&a), "{a}");
        assert_eq!(&a[14..15], "4");
        assert_ne!(a, new_session_id());
        assert!(!is_uuid("not-a-uuid"));
        assert!(!is_uuid("0123456789abcdef0123456789abcdef"));
    }

    #[test]
    fn the_default_cwd_is_the_only_repository() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(default_cwd(root.path()), root.path());
        fs::create_dir_all(root.path().join("app/.git")).unwrap();
        fs::create_dir_all(root.path().join("notes")).unwrap();
        fs::create_dir_all(root.path().join(".cairn/state")).unwrap();
        assert_eq!(default_cwd(root.path()), root.path().join("app"));
        fs::create_dir_all(root.path().join("lib/.git")).unwrap();
        assert_eq!(
            default_cwd(root.path()),
            root.path(),
            "two repositories: the root"
        );
    }

    #[test]
    fn a_cwd_outside_the_workspace_is_refused() {
        let root = Path::new("/workspace");
        let config = |v: &str| BTreeMap::from([("cwd".to_owned(), v.to_owned())]);
        assert_eq!(
            cwd_setting("claude", &config("app"), root).unwrap(),
            Some(root.join("app"))
        );
        assert_eq!(
            cwd_setting("claude", &config("/workspace/app"), root).unwrap(),
            Some(root.join("app"))
        );
        assert_eq!(cwd_setting("claude", &BTreeMap::new(), root).unwrap(), None);
        for bad in ["../etc", "/etc", "app/../../x"] {
            let err = cwd_setting("claude", &config(bad), root).unwrap_err();
            assert!(
                err.to_string()
                    .contains("is not a directory inside the workspace"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn unknown_harnesses_and_settings_are_refused() {
        let spec = |name: &str, config: &[(&str, &str)]| pb::HarnessSpec {
            name: name.into(),
            config: config
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let root = Path::new("/workspace");
        let err = from_spec(&spec("aider", &[]), root).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown harness \"aider\" (this runner has: claude, codex, gemini, command)"
        );
        for name in ["codex", "gemini"] {
            let err = from_spec(&spec(name, &[("binray", "x")]), root).unwrap_err();
            assert!(
                err.to_string().contains("unknown setting \"binray\""),
                "{err}"
            );
            assert_eq!(from_spec(&spec(name, &[]), root).unwrap().name(), name);
        }
        let err = from_spec(&spec("claude", &[("binray", "x")]), root).unwrap_err();
        assert!(
            err.to_string().contains("unknown setting \"binray\""),
            "{err}"
        );
        let err = from_spec(&spec("command", &[]), root).unwrap_err();
        assert_eq!(
            err.to_string(),
            "harness command: the setting \"start\" is required"
        );
    }
}
