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
//! - [`pi`] — pi, per the same reference; the runner chooses the session
//!   file (and so the id) of a new conversation.
//! - [`opencode`] — opencode, per the same reference (SQLite in WAL mode;
//!   forks with `--fork`).
//! - [`goose`] — goose, per the same reference (SQLite; its stream-json
//!   events and its "session not found" text are unverified).
//! - [`openhands`] — OpenHands CLI, per the same reference (the id is
//!   printed at exit; its "not found" text is unverified).
//! - [`aider`] — Aider: no conversation ids, so it never resumes; every
//!   conversation after the first starts with a lossy-handoff briefing, and
//!   Aider restores its own chat history file.
//!
//!   These share `Cli`: a state directory in the workspace, fresh
//!   credentials, the same settings. Each describes itself in a `CliSpec`
//!   and adds only its turns' invocations and what it reads in its output
//!   (`CliTurns`).
//! - [`command`] — any CLI, described by `start` / `resume` templates and a
//!   `session_regex`.

pub mod aider;
pub mod claude;
pub mod codex;
pub mod command;
pub mod gemini;
pub mod goose;
pub mod opencode;
pub mod openhands;
pub mod pattern;
pub mod pi;
pub mod process;
pub mod template;

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cairn_proto::pb;
use serde_json::Value;

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
    /// The harness waits for something nobody in a sandbox will do (a
    /// browser login): the runner stops it at once and fails the turn
    /// with this reason.
    pub stuck: Option<String>,
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
    /// Whether conversation `session_id` can be resumed, for a harness
    /// whose resume of an unknown id does not say so (it silently starts an
    /// empty conversation): `Some(false)` makes the runner treat it as lost
    /// before the turn starts. `None`: the harness says so itself.
    fn has_conversation(&self, _session_id: &str) -> Option<bool> {
        None
    }
}

/// The adapters this runner has, as the coordinator knows them too.
fn adapter_names() -> String {
    let names: Vec<&str> = cairn_proto::runs::HARNESS_ADAPTERS
        .iter()
        .map(|(name, _)| *name)
        .collect();
    names.join(", ")
}

/// Why a harness cannot be set up or started.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("unknown harness {0:?} (this runner has: {known})", known = adapter_names())]
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
        "pi" => Ok(Arc::new(pi::Pi::new(&config, root)?)),
        "opencode" => Ok(Arc::new(opencode::Opencode::new(&config, root)?)),
        "goose" => Ok(Arc::new(goose::Goose::new(&config, root)?)),
        "openhands" => Ok(Arc::new(openhands::OpenHands::new(&config, root)?)),
        "aider" => Ok(Arc::new(aider::Aider::new(&config, root)?)),
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

/// What sets an agent CLI that keeps its state in the workspace (all but
/// `command`) apart from the others; [`Cli`] and [`CliTurns`] do the rest.
#[derive(Debug)]
struct CliSpec {
    /// The adapter's name, as in `HarnessSpec.name`, and the default `binary`.
    name: &'static str,
    /// The settings the adapter knows.
    settings: &'static [&'static str],
    /// The CLI's state directory, relative to the root, so that its
    /// conversations live in the workspace and travel with its checkpoints.
    state_dir: &'static str,
    /// The environment variable that points the CLI at its state directory
    /// (none: the CLI is pointed there by flags, as Aider is).
    state_env: Option<&'static str>,
    /// Where the credential files are, inside the state directory.
    credentials_subdir: Option<&'static str>,
    /// The files there that hold credentials (paths relative to it): never
    /// checkpointed, copied in fresh from `credentials_dir` before the
    /// first turn.
    credential_files: &'static [&'static str],
    /// More patterns, relative to the state directory, that no checkpoint
    /// may contain (copies the CLI makes of its credentials).
    more_excludes: &'static [&'static str],
    /// The default `credentials_dir`, relative to `$HOME`.
    home_credentials: &'static str,
    /// What the CLI prints when the conversation to resume is gone (any of
    /// these, looked for in every output line unless the adapter reads its
    /// output in its own way, see [`CliTurns::observe_line`]).
    session_lost: &'static [&'static str],
    /// Whether the CLI can fork a conversation.
    can_fork: bool,
}

/// An agent CLI of a [`CliSpec`], configured for one run by the settings
/// `binary`, `model`, `args` (extra arguments, split like a shell would),
/// `cwd` and `credentials_dir`.
#[derive(Debug, Clone)]
struct Cli {
    spec: &'static CliSpec,
    binary: String,
    model: Option<String>,
    extra_args: Vec<String>,
    cwd: Option<PathBuf>,
    /// The state directory (absolute).
    state_dir: PathBuf,
    credentials_dir: Option<PathBuf>,
}

impl Cli {
    fn new(
        spec: &'static CliSpec,
        config: &BTreeMap<String, String>,
        root: &Path,
    ) -> Result<Self, HarnessError> {
        check_settings(spec.name, config, spec.settings)?;
        let setting = |key: &str| {
            config
                .get(key)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        Ok(Self {
            spec,
            binary: setting("binary").unwrap_or_else(|| spec.name.to_owned()),
            model: setting("model"),
            extra_args: split_args(spec.name, setting("args"))?,
            cwd: cwd_setting(spec.name, config, root)?,
            state_dir: root.join(spec.state_dir),
            credentials_dir: setting("credentials_dir")
                .map(PathBuf::from)
                .or_else(|| home_subdir(spec.home_credentials)),
        })
    }

    /// The variable pointing the CLI at its state directory, if it has one.
    fn state_env(&self) -> Option<(String, String)> {
        let dir = || self.state_dir.to_string_lossy().into_owned();
        self.spec.state_env.map(|name| (name.to_owned(), dir()))
    }

    /// `--model <model>` when the setting names one, then the `args` setting.
    fn options(&self) -> impl Iterator<Item = String> {
        let model = self
            .model
            .iter()
            .flat_map(|m| ["--model".to_owned(), m.clone()]);
        model.chain(self.extra_args.iter().cloned())
    }

    /// Whether `text` holds what the CLI says when the conversation to
    /// resume is gone.
    fn says_lost(&self, text: &str) -> bool {
        self.spec
            .session_lost
            .iter()
            .any(|lost| text.contains(lost))
    }

    fn excludes(&self) -> Vec<String> {
        let spec = self.spec;
        let credentials = match spec.credentials_subdir {
            Some(subdir) => format!("/{}/{subdir}", spec.state_dir),
            None => format!("/{}", spec.state_dir),
        };
        let files = spec
            .credential_files
            .iter()
            .map(|f| format!("{credentials}/{f}"));
        let more = spec
            .more_excludes
            .iter()
            .map(|p| format!("/{}/{p}", spec.state_dir));
        files.chain(more).collect()
    }

    /// Creates the state directory (private) and copies each credential
    /// file present in `credentials_dir` into it (mode 0600). Credentials
    /// are never logged, only which files were copied.
    fn prepare(&self) -> Result<(), HarnessError> {
        use std::os::unix::fs::PermissionsExt as _;
        let prepare_error = |path: &Path| {
            let path = path.to_path_buf();
            move |source| HarnessError::Prepare { path, source }
        };
        let private_dir = |dir: &Path| {
            fs::create_dir_all(dir).map_err(prepare_error(dir))?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(prepare_error(dir))
        };
        let target_dir = match self.spec.credentials_subdir {
            Some(subdir) => self.state_dir.join(subdir),
            None => self.state_dir.clone(),
        };
        private_dir(&self.state_dir)?;
        private_dir(&target_dir)?;
        let Some(source_dir) = &self.credentials_dir else {
            return Ok(());
        };
        for file in self.spec.credential_files {
            let from = source_dir.join(file);
            if !from.is_file() {
                continue;
            }
            let to = target_dir.join(file);
            if let Some(parent) = to.parent().filter(|p| !p.exists()) {
                private_dir(parent)?;
            }
            fs::copy(&from, &to).map_err(prepare_error(&to))?;
            fs::set_permissions(&to, fs::Permissions::from_mode(0o600))
                .map_err(prepare_error(&to))?;
            tracing::debug!(harness = self.spec.name, file, from = %source_dir.display(), "credentials copied in");
        }
        Ok(())
    }
}

/// How one turn of a [`CliTurns`] adapter is started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Invocation {
    args: Vec<String>,
    /// Set besides the state directory's variable.
    env: Vec<(String, String)>,
    /// The conversation's id, when it is known before the CLI says anything.
    session_at_start: Option<String>,
}

impl From<Vec<String>> for Invocation {
    /// Only these arguments.
    fn from(args: Vec<String>) -> Self {
        Self {
            args,
            ..Self::default()
        }
    }
}

/// An adapter built on [`Cli`]: only each turn's invocation and what it
/// reads in the output are its own. Every such adapter is a [`Harness`].
trait CliTurns: Send + Sync + fmt::Debug {
    fn cli(&self) -> &Cli;
    /// Whether a conversation can be continued by its id.
    fn resumes(&self) -> bool {
        true
    }
    /// One turn, run in `cwd` (a resume only if it can resume, a fork only
    /// if it can fork).
    fn invocation(&self, turn: &TurnRequest, cwd: &Path) -> Invocation;
    /// Reads one line of output into `observed`: by default, any line that
    /// holds the spec's `session_lost` text says the conversation is gone,
    /// and each JSON event on stdout goes to [`Self::observe_event`].
    fn observe_line(&self, stream: Stream, line: &str, observed: &mut Observed) {
        if self.cli().says_lost(line) {
            observed.session_lost = true;
        }
        if let Some(event) = json_event(stream, line) {
            self.observe_event(&event, observed);
        }
    }
    /// Reads one JSON event of stdout into `observed`.
    fn observe_event(&self, _event: &Value, _observed: &mut Observed) {}
    /// What the CLI needs before its first turn besides its state directory
    /// and credentials ([`Cli::prepare`] has made both).
    fn prepare_more(&self) -> Result<(), HarnessError> {
        Ok(())
    }
    /// See [`Harness::has_conversation`].
    fn has_conversation(&self, _session_id: &str) -> Option<bool> {
        None
    }
}

impl<T: CliTurns> Harness for T {
    fn name(&self) -> &str {
        self.cli().spec.name
    }

    fn can_resume(&self) -> bool {
        self.resumes()
    }

    fn can_fork(&self) -> bool {
        self.cli().spec.can_fork
    }

    fn excludes(&self) -> Vec<String> {
        self.cli().excludes()
    }

    fn prepare(&self) -> Result<(), HarnessError> {
        self.cli().prepare()?;
        self.prepare_more()
    }

    fn configured_cwd(&self) -> Option<PathBuf> {
        self.cli().cwd.clone()
    }

    fn command(&self, turn: &TurnRequest, cwd: &Path) -> Result<HarnessCommand, HarnessError> {
        let cli = self.cli();
        let name = cli.spec.name;
        // The runner never asks for these (can_resume / can_fork say no),
        // and doing something else instead would be wrong.
        let refused = match turn {
            TurnRequest::Resume { .. } if !self.resumes() => Some("cannot continue a conversation"),
            TurnRequest::Resume { fork: true, .. } if !cli.spec.can_fork => {
                Some("cannot fork a conversation")
            }
            _ => None,
        };
        if let Some(what) = refused {
            return Err(HarnessError::BadSetting {
                harness: name,
                key: "binary",
                reason: format!("the {name} adapter {what}"),
            });
        }
        let invocation = self.invocation(turn, cwd);
        Ok(HarnessCommand {
            program: cli.binary.clone(),
            args: invocation.args,
            env: cli.state_env().into_iter().chain(invocation.env).collect(),
            cwd: cwd.to_path_buf(),
            session_at_start: invocation.session_at_start,
        })
    }

    fn observe(&self, stream: Stream, line: &str, observed: &mut Observed) {
        self.observe_line(stream, line, observed);
    }

    fn has_conversation(&self, session_id: &str) -> Option<bool> {
        CliTurns::has_conversation(self, session_id)
    }
}

/// The JSON object a line of stdout holds, if it holds one.
fn json_event(stream: Stream, line: &str) -> Option<Value> {
    if stream != Stream::Stdout || !line.starts_with('{') {
        return None;
    }
    serde_json::from_str::<Value>(line)
        .ok()
        .filter(Value::is_object)
}

/// A message as one argument for a CLI that reads any argument starting
/// with `-` as an option (and, for some, `@` as a file to attach) and has
/// no way to say otherwise: a leading space keeps it a message.
fn message_word(message: &str) -> String {
    if message.starts_with(['-', '@']) {
        format!(" {message}")
    } else {
        message.to_owned()
    }
}

/// A message as the value of option `flag` (`-p <message>`), or, when it
/// starts with `-` and so would be read as an option, as one argument
/// `<joined><message>` (`--prompt=<message>`).
fn message_option(flag: &str, joined: &str, message: &str) -> Vec<String> {
    if message.starts_with('-') {
        vec![format!("{joined}{message}")]
    } else {
        vec![flag.to_owned(), message.to_owned()]
    }
}

/// The `text` of the `{"type":"text"}` items of a message's content, joined
/// by newlines; `None` when there is none.
fn text_items(content: &Value) -> Option<String> {
    let texts: Vec<&str> = content
        .as_array()?
        .iter()
        .filter(|item| item["type"] == "text")
        .filter_map(|item| item["text"].as_str())
        .collect();
    (!texts.is_empty()).then(|| texts.join("\n"))
}

/// The string `value` holds, unless it is empty (or not a string).
fn non_empty(value: &Value) -> Option<&str> {
    value.as_str().filter(|s| !s.is_empty())
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

/// What the adapters' unit tests share.
#[cfg(test)]
mod testing {
    use std::collections::BTreeMap;
    use std::fs;
    use std::path::Path;

    pub(super) use super::{Harness, Observed, Stream, is_uuid};
    use super::{HarnessCommand, HarnessError, TurnRequest};

    /// A configuration of these settings.
    pub(super) fn settings(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// The command of a turn that opens a conversation with `message`, in `cwd`.
    pub(super) fn start_turn(harness: &dyn Harness, message: &str, cwd: &str) -> HarnessCommand {
        let turn = TurnRequest::Start {
            message: message.into(),
        };
        harness.command(&turn, Path::new(cwd)).unwrap()
    }

    /// The command of a turn that continues (or forks) conversation
    /// `session_id` with `message`, in `/w`.
    pub(super) fn resume_turn(
        harness: &dyn Harness,
        session_id: &str,
        message: &str,
        fork: bool,
    ) -> Result<HarnessCommand, HarnessError> {
        let turn = TurnRequest::Resume {
            session_id: session_id.into(),
            message: message.into(),
            fork,
        };
        harness.command(&turn, Path::new("/w"))
    }

    /// What `harness` observes in these lines of `stream`.
    pub(super) fn observe_lines(harness: &dyn Harness, stream: Stream, lines: &[&str]) -> Observed {
        let mut observed = Observed::default();
        for line in lines {
            harness.observe(stream, line, &mut observed);
        }
        observed
    }

    /// The adapter `new` makes, configured with a `credentials_dir` that holds
    /// `files` (path, content) and prepared in a new root, which it returns.
    pub(super) fn prepared<H: Harness>(
        new: impl Fn(&BTreeMap<String, String>, &Path) -> Result<H, HarnessError>,
        files: &[(&str, &str)],
    ) -> (tempfile::TempDir, H) {
        let root = tempfile::tempdir().unwrap();
        let home = tempfile::tempdir().unwrap();
        for (file, content) in files {
            let path = home.path().join(file);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, content).unwrap();
        }
        let config = settings(&[("credentials_dir", &home.path().to_string_lossy())]);
        let harness = new(&config, root.path()).unwrap();
        harness.prepare().unwrap();
        (root, harness)
    }

    /// Asserts which of these paths (relative to `root`) `harness` keeps out of
    /// every checkpoint.
    pub(super) fn assert_excluded(harness: &dyn Harness, root: &Path, cases: &[(&str, bool)]) {
        let matcher = cairn_engine::scan::exclude_matcher(root, &harness.excludes())
            .unwrap()
            .unwrap();
        for (path, excluded) in cases {
            assert_eq!(
                matcher.matched(root.join(path), false).is_ignore(),
                *excluded,
                "{path}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::settings;
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
        let config = |v: &str| settings(&[("cwd", v)]);
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
        let err = from_spec(&spec("cursor", &[]), root).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown harness \"cursor\" (this runner has: claude, codex, gemini, pi, opencode, \
             goose, openhands, aider, command)"
        );
        for name in [
            "codex",
            "gemini",
            "pi",
            "opencode",
            "goose",
            "openhands",
            "aider",
        ] {
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
