//! The generic `command` adapter: any agent CLI, described by templates.
//!
//! Settings:
//! - `start` (required): the command line of a new conversation, e.g.
//!   `codex exec --json {message}`.
//! - `resume`: the command line that continues conversation `{session_id}`,
//!   e.g. `codex exec resume {session_id} {message} --json`. Without it
//!   every turn opens a new conversation (and a person's answer reaches the
//!   agent through a handoff briefing).
//! - `session_regex`: matched against every output line (stdout and
//!   stderr); the first match gives the session id — the group named `id`,
//!   else group 1, else the whole match — e.g. `"thread_id":"([^"]+)"`.
//!   Without it, a `start` template that uses `{session_id}` makes the
//!   runner choose the id (a new UUID) and pass it in.
//! - `session_lost`: a regex; output matching it means the conversation to
//!   resume is gone.
//! - `cwd`: where the harness runs (default: the only repository under the
//!   root, else the root).
//!
//! Placeholders: `{message}` (alias `{prompt}`), `{session_id}`, `{root}`,
//! `{cwd}`. Templates are split into words like a shell would and filled in
//! word by word (see [`super::template`]); no shell runs unless the template
//! says `sh -c …`. The turn's summary is the last non-empty line of stdout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::pattern::Pattern;
use super::template::Template;
use super::{
    Harness, HarnessCommand, HarnessError, Observed, Stream, TurnRequest, check_settings,
    cwd_setting, new_session_id,
};

const NAME: &str = "command";
const SETTINGS: &[&str] = cairn_proto::runs::COMMAND_SETTINGS;
const PLACEHOLDERS: &[&str] = &["message", "prompt", "session_id", "root", "cwd"];

/// A templated harness, configured for one run.
#[derive(Debug, Clone)]
pub struct CommandHarness {
    start: Template,
    resume: Option<Template>,
    session_regex: Option<Pattern>,
    session_lost: Option<Pattern>,
    cwd: Option<PathBuf>,
    root: PathBuf,
}

impl CommandHarness {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        check_settings(NAME, config, SETTINGS)?;
        let setting = |key: &str| config.get(key).map(|v| v.trim()).filter(|v| !v.is_empty());
        let template = |key: &'static str| {
            setting(key)
                .map(|source| {
                    Template::parse(source, PLACEHOLDERS).map_err(|source| HarnessError::Template {
                        harness: NAME,
                        key,
                        source,
                    })
                })
                .transpose()
        };
        let pattern = |key: &'static str| {
            setting(key)
                .map(|source| {
                    Pattern::new(source).map_err(|source| HarnessError::Pattern {
                        harness: NAME,
                        key,
                        source,
                    })
                })
                .transpose()
        };
        let start = template("start")?.ok_or(HarnessError::MissingSetting {
            harness: NAME,
            key: "start",
        })?;
        let resume = template("resume")?;
        if let Some(resume) = &resume
            && !resume.uses("session_id")
        {
            return Err(HarnessError::BadSetting {
                harness: NAME,
                key: "resume",
                reason: format!(
                    "{:?} does not use {{session_id}}, so it cannot name the conversation",
                    resume.source()
                ),
            });
        }
        Ok(Self {
            start,
            resume,
            session_regex: pattern("session_regex")?,
            session_lost: pattern("session_lost")?,
            cwd: cwd_setting(NAME, config, root)?,
            root: root.to_path_buf(),
        })
    }

    /// Whether the runner picks the session id itself.
    fn chooses_session_id(&self) -> bool {
        self.session_regex.is_none() && self.start.uses("session_id")
    }
}

impl Harness for CommandHarness {
    fn name(&self) -> &str {
        NAME
    }

    fn can_resume(&self) -> bool {
        self.resume.is_some() && (self.session_regex.is_some() || self.start.uses("session_id"))
    }

    fn excludes(&self) -> Vec<String> {
        Vec::new()
    }

    fn prepare(&self) -> Result<(), HarnessError> {
        Ok(())
    }

    fn configured_cwd(&self) -> Option<PathBuf> {
        self.cwd.clone()
    }

    fn command(&self, turn: &TurnRequest, cwd: &Path) -> Result<HarnessCommand, HarnessError> {
        let (template, session_id) = match turn {
            TurnRequest::Start { .. } => (
                &self.start,
                self.start.uses("session_id").then(new_session_id),
            ),
            // A template continues a conversation, it cannot fork one; the
            // runner never asks (can_fork is false), and continuing the
            // source's conversation instead would be wrong.
            TurnRequest::Resume { fork: true, .. } => {
                return Err(HarnessError::BadSetting {
                    harness: NAME,
                    key: "resume",
                    reason: "a command harness cannot fork a conversation".into(),
                });
            }
            TurnRequest::Resume { session_id, .. } => match &self.resume {
                Some(resume) => (resume, Some(session_id.clone())),
                None => {
                    return Err(HarnessError::BadSetting {
                        harness: NAME,
                        key: "resume",
                        reason: "is not set, so a conversation cannot be continued".into(),
                    });
                }
            },
        };
        let values = BTreeMap::from([
            ("message", turn.message().to_owned()),
            ("prompt", turn.message().to_owned()),
            ("session_id", session_id.clone().unwrap_or_default()),
            ("root", self.root.to_string_lossy().into_owned()),
            ("cwd", cwd.to_string_lossy().into_owned()),
        ]);
        let mut words = template.render(&values);
        let program = words.remove(0);
        let session_at_start = match turn {
            TurnRequest::Start { .. } if self.chooses_session_id() => session_id,
            // The conversation being continued is known, whatever the output says.
            TurnRequest::Resume { .. } => session_id,
            TurnRequest::Start { .. } => None,
        };
        Ok(HarnessCommand {
            program,
            args: words,
            env: Vec::new(),
            cwd: cwd.to_path_buf(),
            session_at_start,
        })
    }

    fn observe(&self, _stream: Stream, line: &str, observed: &mut Observed) {
        if let Some(lost) = &self.session_lost
            && lost.is_match(line)
        {
            observed.session_lost = true;
        }
        if observed.session_id.is_none()
            && let Some(id) = self.session_regex.as_ref().and_then(|p| p.extract(line))
        {
            observed.session_id = Some(id.to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    fn harness(config: &[(&str, &str)]) -> Result<CommandHarness, HarnessError> {
        CommandHarness::new(&settings(config), Path::new("/workspace"))
    }

    #[test]
    fn templates_become_argument_vectors() {
        let h = harness(&[
            ("start", "agent run --json {message}"),
            ("resume", "agent resume {session_id} --json -- {message}"),
            ("session_regex", r#""thread_id":"(?P<id>[^"]+)""#),
        ])
        .unwrap();
        assert!(h.can_resume());
        let cwd = Path::new("/workspace/app");
        let start = h
            .command(
                &TurnRequest::Start {
                    message: "it's \"quoted\"".into(),
                },
                cwd,
            )
            .unwrap();
        assert_eq!(
            (start.program.as_str(), start.args.as_slice()),
            (
                "agent",
                &["run", "--json", "it's \"quoted\""].map(String::from)[..]
            )
        );
        assert_eq!(start.session_at_start, None, "the regex reports the id");
        let resume = h
            .command(
                &TurnRequest::Resume {
                    session_id: "t-1".into(),
                    message: "yes".into(),
                    fork: false,
                },
                cwd,
            )
            .unwrap();
        assert_eq!(resume.args, ["resume", "t-1", "--json", "--", "yes"]);
        assert_eq!(resume.session_at_start.as_deref(), Some("t-1"));

        let mut seen = Observed::default();
        h.observe(
            Stream::Stdout,
            r#"{"type":"thread.started","thread_id":"t-9"}"#,
            &mut seen,
        );
        h.observe(
            Stream::Stdout,
            r#"{"type":"thread.started","thread_id":"t-10"}"#,
            &mut seen,
        );
        assert_eq!(
            seen.session_id.as_deref(),
            Some("t-9"),
            "the first match holds"
        );
    }

    #[test]
    fn a_start_template_with_session_id_lets_the_runner_choose() {
        let h = harness(&[
            ("start", "agent --session {session_id} {prompt}"),
            ("resume", "agent --resume {session_id} {prompt}"),
            ("session_lost", "^no session"),
        ])
        .unwrap();
        assert!(h.can_resume());
        let start = start_turn(&h, "go", "/workspace");
        let chosen = start
            .session_at_start
            .clone()
            .expect("the runner chose the id");
        assert_eq!(start.args, ["--session", chosen.as_str(), "go"]);
        let mut seen = Observed::default();
        h.observe(Stream::Stderr, "no session abc", &mut seen);
        assert!(seen.session_lost);
    }

    #[test]
    fn without_resume_no_conversation_continues() {
        let h = harness(&[("start", "sh -c 'echo {message}'")]).unwrap();
        assert!(!h.can_resume());
        let err = resume_turn(&h, "x", "m", false).unwrap_err();
        assert!(err.to_string().contains("\"resume\""), "{err}");
        let err = harness(&[("start", "a {message}"), ("resume", "a {message}")]).unwrap_err();
        assert!(
            err.to_string().contains("does not use {session_id}"),
            "{err}"
        );
        let err = harness(&[("start", "a {mesage}")]).unwrap_err();
        assert!(
            err.to_string()
                .contains("uses {mesage}, which is not one of"),
            "{err}"
        );
        let err = harness(&[("start", "a"), ("session_regex", "(x")]).unwrap_err();
        assert!(err.to_string().contains("unclosed group"), "{err}");
    }
}
