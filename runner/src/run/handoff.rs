//! The handoff note every run ends with: what changed, what was checked,
//! what is uncertain, and the next action.
//!
//! The agent may write it itself, beside its status in the outcome file:
//!
//! ```json
//! {"status": "done", "summary": "Added the login form.",
//!  "handoff": {"changed": "app: login form and its route",
//!              "checked": ["cargo test", "the form by hand"],
//!              "uncertain": "the session timeout",
//!              "next": "review the form's error messages"}}
//! ```
//!
//! Each field is a text or a list of texts. Whatever the agent leaves out
//! the runner fills in from facts it has: "changed" from git (per checkout,
//! the commits made during the run — `git log <head at start>..HEAD` — and
//! the staged, unstaged and untracked counts), "uncertain" from the error of
//! a failed run, and "not stated" otherwise. The note names the fields the
//! runner filled in.
//!
//! A run ends right after its last checkpoint, which read every
//! repository's state (HEAD, and the counts, narrowed to what changed since
//! the reading before): the note takes those instead of asking git again,
//! which for a large repository costs a full `git status`. Git is asked
//! only for the commits of a checkout whose HEAD moved.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use cairn_proto::pb;
use cairn_proto::stations::{MAX_NOTE_FIELD_BYTES, NOT_STATED, NoteField};
use serde::Deserialize;

use super::control::clip_to;
use super::fastforward::{Checkout, find_checkouts};
use cairn_engine::git::RepoState;
use cairn_engine::git::command::git;
use cairn_utils::text::plural;

/// How long each git command of a note may take.
const GIT_LIMIT: Duration = Duration::from_secs(10);
/// Commits listed per checkout.
const COMMITS_SHOWN: usize = 10;

/// A field of the agent's handoff: a text or a list of texts.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
enum Said {
    Text(String),
    List(Vec<String>),
}

impl Said {
    /// The words, or `None` when nothing was said.
    fn words(&self) -> Option<String> {
        let text = match self {
            Self::Text(text) => text.trim().to_owned(),
            Self::List(items) => items
                .iter()
                .map(|i| i.trim())
                .filter(|i| !i.is_empty())
                .map(|i| format!("- {i}"))
                .collect::<Vec<_>>()
                .join("\n"),
        };
        (!text.is_empty()).then_some(text)
    }
}

/// What the agent wrote under `handoff` in its outcome file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct AgentHandoff {
    changed: Option<String>,
    checked: Option<String>,
    uncertain: Option<String>,
    next: Option<String>,
}

#[derive(Deserialize)]
struct RawHandoff {
    changed: Option<Said>,
    checked: Option<Said>,
    uncertain: Option<Said>,
    next: Option<Said>,
}

#[derive(Deserialize)]
struct WithHandoff {
    handoff: Option<RawHandoff>,
}

impl AgentHandoff {
    /// The `handoff` of an outcome file's JSON text: `Ok(None)` when there
    /// is none, an error naming what is wrong with it otherwise.
    pub fn from_outcome_json(text: &str) -> Result<Option<Self>, String> {
        let parsed: WithHandoff = serde_json::from_str(text).map_err(|e| {
            format!(
                "{e} (expected \"handoff\": {{\"changed\": …, \"checked\": …, \"uncertain\": …, \"next\": …}}, \
                 each a text or a list of texts)"
            )
        })?;
        Ok(parsed.handoff.map(|raw| {
            let words = |said: Option<Said>| said.as_ref().and_then(Said::words);
            Self {
                changed: words(raw.changed),
                checked: words(raw.checked),
                uncertain: words(raw.uncertain),
                next: words(raw.next),
            }
        }))
    }

    #[cfg(test)]
    pub fn new(changed: &str, checked: &str, uncertain: &str, next: &str) -> Self {
        let some = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        Self {
            changed: some(changed),
            checked: some(checked),
            uncertain: some(uncertain),
            next: some(next),
        }
    }
}

/// How the run ended, for the note.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    Succeeded { summary: String },
    Failed { error: String },
    Interrupted,
}

/// `text`, cut at a character boundary to fit a note field.
fn fit(text: String) -> String {
    clip_to(text, MAX_NOTE_FIELD_BYTES)
}

/// The note: the agent's words where it gave them, else `facts_changed`
/// (what git says changed) and what the ending tells.
pub fn compose(
    agent: Option<&AgentHandoff>,
    ending: &Ending,
    facts_changed: &str,
) -> pb::HandoffText {
    let agent = agent.cloned().unwrap_or_default();
    let mut composed = Vec::new();
    let mut take = |field: NoteField, given: Option<String>, otherwise: String| {
        given.unwrap_or_else(|| {
            composed.push(field.as_str().to_owned());
            otherwise
        })
    };
    let changed = take(NoteField::Changed, agent.changed, facts_changed.to_owned());
    let checked = take(NoteField::Checked, agent.checked, NOT_STATED.to_owned());
    let uncertain = take(
        NoteField::Uncertain,
        agent.uncertain,
        match ending {
            Ending::Failed { error } => format!("the run failed: {error}"),
            Ending::Interrupted => {
                "the run was interrupted before the agent finished its turn".to_owned()
            }
            Ending::Succeeded { .. } => NOT_STATED.to_owned(),
        },
    );
    let next = take(NoteField::Next, agent.next, NOT_STATED.to_owned());
    let summary = match ending {
        Ending::Succeeded { summary } if summary.trim().is_empty() => "succeeded".to_owned(),
        Ending::Succeeded { summary } => summary.trim().to_owned(),
        Ending::Failed { error } => format!("failed: {}", error.trim()),
        Ending::Interrupted => "interrupted (stopped on a destroy order)".to_owned(),
    };
    pb::HandoffText {
        summary: fit(summary),
        changed: fit(changed),
        checked: fit(checked),
        uncertain: fit(uncertain),
        next: fit(next),
        composed,
    }
}

/// Each checkout's HEAD, by name (`None`: no commit yet).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Heads(BTreeMap<String, Option<String>>);

/// The HEAD of every checkout (of [`find_checkouts`]).
pub async fn heads(checkouts: &[Checkout]) -> Heads {
    let mut heads = BTreeMap::new();
    for checkout in checkouts {
        let head = git(
            &checkout.dir,
            &["rev-parse", "--verify", "-q", "HEAD"],
            GIT_LIMIT,
        )
        .await
        .ok()
        .filter(|out| out.success())
        .map(|out| out.text().to_owned());
        heads.insert(checkout.name.clone(), head);
    }
    Heads(heads)
}

/// What git says changed since `start`, one line per checkout. `read`: the
/// repositories' states as the workspace's last checkpoint read them, if
/// nothing changed since (by their path relative to the root, "" for the
/// root); a checkout they do not cover is read from git.
pub async fn changes(root: &Path, start: &Heads, read: Option<&[RepoState]>) -> String {
    let checkouts = find_checkouts(root);
    if checkouts.is_empty() {
        return "no git checkouts in the workspace".to_owned();
    }
    let mut lines = Vec::new();
    for checkout in checkouts {
        let since = start.0.get(&checkout.name);
        let path = if checkout.name == "." {
            ""
        } else {
            checkout.name.as_str()
        };
        let known = read.and_then(|states| states.iter().find(|s| s.path == path));
        let mut line = format!("{}: ", checkout.name);
        if since.is_none() {
            line.push_str("a repository new to this run, ");
        }
        let head_unmoved = match (since, known) {
            (Some(Some(start)), Some(state)) => *start == state.head,
            (Some(None), Some(state)) => state.head.is_empty(),
            _ => false,
        };
        if head_unmoved {
            line.push_str("no new commits");
        } else {
            line.push_str(&commits_since(&checkout.dir, since).await);
        }
        match known {
            Some(state) => line.push_str(&uncommitted(state)),
            None => {
                let state = tokio::task::spawn_blocking(move || {
                    cairn_engine::git::inspect(&checkout.dir, &checkout.name)
                })
                .await;
                match state {
                    Ok(Ok(state)) => line.push_str(&uncommitted(&state)),
                    Ok(Err(e)) => line.push_str(&format!("; {e}")),
                    Err(e) => line.push_str(&format!("; git state unavailable: {e}")),
                }
            }
        }
        lines.push(line);
    }
    lines.join("\n")
}

/// `no new commits`, or `2 new commits (abc1234 add c; def5678 add b)`: the
/// commits of the checkout at `dir` since `since` (its HEAD at the start;
/// `None`: a repository new to this run).
async fn commits_since(dir: &Path, since: Option<&Option<String>>) -> String {
    let range = match since {
        Some(Some(head)) => format!("{head}..HEAD"),
        _ => "HEAD".to_owned(),
    };
    let limit = format!("-{}", COMMITS_SHOWN + 1);
    let log = git(
        dir,
        &[
            "log",
            "--no-decorate",
            "--format=%h %s",
            &limit,
            &range,
            "--",
        ],
        GIT_LIMIT,
    )
    .await;
    let commits: Option<Vec<String>> = match &log {
        Ok(out) if out.success() => Some(out.stdout.lines().map(str::to_owned).collect()),
        _ => None,
    };
    let mut total = commits.as_ref().map_or(0, Vec::len) as u32;
    // Unless the log listed every commit there is, count them.
    if commits.as_ref().is_none_or(|c| c.len() > COMMITS_SHOWN)
        && let Ok(count) = git(dir, &["rev-list", "--count", &range, "--"], GIT_LIMIT).await
        && count.success()
    {
        total = count.text().parse().unwrap_or(total);
    }
    let commits = commits.unwrap_or_default();
    if total == 0 {
        return "no new commits".to_owned();
    }
    let mut shown: Vec<String> = commits.into_iter().take(COMMITS_SHOWN).collect();
    if total as usize > shown.len() {
        shown.push(format!("and {} more", total as usize - shown.len()));
    }
    format!(
        "{} ({})",
        plural(u64::from(total), "new commit", "new commits"),
        shown.join("; ")
    )
}

/// `; uncommitted: 1 staged change, 2 untracked files`, or `; nothing uncommitted`.
fn uncommitted(state: &RepoState) -> String {
    let uncommitted: Vec<String> = [
        (state.staged, "staged change", "staged changes"),
        (state.unstaged, "unstaged change", "unstaged changes"),
        (state.untracked, "untracked file", "untracked files"),
    ]
    .into_iter()
    .filter(|(n, _, _)| *n > 0)
    .map(|(n, one, many)| plural(u64::from(n), one, many))
    .collect();
    if uncommitted.is_empty() {
        "; nothing uncommitted".to_owned()
    } else {
        format!("; uncommitted: {}", uncommitted.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use cairn_engine::git::testing::git as sh_git;

    fn commit(dir: &Path, file: &str, subject: &str) {
        cairn_engine::git::testing::commit(dir, file, subject, subject);
    }

    #[test]
    fn the_agents_handoff_is_read_from_the_outcome_file() {
        let text = r#"{"status":"done","summary":"ok","handoff":{
            "changed":"the login form","checked":["cargo test"," ","the form by hand"],
            "uncertain":"  ","next":"review it"}}"#;
        let handoff = AgentHandoff::from_outcome_json(text).unwrap().unwrap();
        assert_eq!(
            handoff,
            AgentHandoff::new(
                "the login form",
                "- cargo test\n- the form by hand",
                "",
                "review it"
            )
        );
        assert_eq!(
            AgentHandoff::from_outcome_json(r#"{"status":"done"}"#).unwrap(),
            None
        );
        let err = AgentHandoff::from_outcome_json(r#"{"status":"done","handoff":{"next":7}}"#)
            .unwrap_err();
        assert!(err.contains("each a text or a list of texts"), "{err}");
    }

    #[test]
    fn what_the_agent_leaves_out_is_composed_from_facts() {
        let agent = AgentHandoff::new("", "cargo test", "", "open the pull request");
        let note = compose(
            Some(&agent),
            &Ending::Succeeded {
                summary: " Added the form. ".into(),
            },
            "app: 1 new commit (abc1234 add form); nothing uncommitted",
        );
        assert_eq!(
            note,
            pb::HandoffText {
                summary: "Added the form.".into(),
                changed: "app: 1 new commit (abc1234 add form); nothing uncommitted".into(),
                checked: "cargo test".into(),
                uncertain: "not stated".into(),
                next: "open the pull request".into(),
                composed: vec!["changed".into(), "uncertain".into()],
            }
        );

        let failed = compose(
            None,
            &Ending::Failed {
                error: "the build needs a key".into(),
            },
            "no git checkouts in the workspace",
        );
        assert_eq!(failed.summary, "failed: the build needs a key");
        assert_eq!(failed.uncertain, "the run failed: the build needs a key");
        assert_eq!(failed.next, "not stated");
        assert_eq!(failed.composed, ["changed", "checked", "uncertain", "next"]);

        let interrupted = compose(None, &Ending::Interrupted, "x");
        assert!(interrupted.summary.starts_with("interrupted"));
        let long = compose(
            None,
            &Ending::Interrupted,
            &"é".repeat(MAX_NOTE_FIELD_BYTES),
        );
        assert!(long.changed.len() <= MAX_NOTE_FIELD_BYTES && long.changed.ends_with("(cut)"));
    }

    #[tokio::test]
    async fn changes_are_the_commits_since_the_start_and_the_uncommitted_counts() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let app = root.join("app");
        fs::create_dir(&app).unwrap();
        sh_git(&app, &["init", "-q"]);
        commit(&app, "a.txt", "before the run");
        let start = heads(&find_checkouts(root)).await;
        commit(&app, "b.txt", "add b");
        commit(&app, "c.txt", "add c");
        fs::write(app.join("a.txt"), "edited").unwrap();
        fs::write(app.join("new.txt"), "new").unwrap();
        fs::write(app.join("other.txt"), "new").unwrap();
        // A repository the agent made during the run.
        let lib = root.join("lib");
        fs::create_dir(&lib).unwrap();
        sh_git(&lib, &["init", "-q"]);
        commit(&lib, "l.txt", "start lib");

        let text = changes(root, &start, None).await;
        let b = sh_git(&app, &["rev-parse", "--short=7", "HEAD~1"]);
        let c = sh_git(&app, &["rev-parse", "--short=7", "HEAD"]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            format!(
                "app: 2 new commits ({c} add c; {b} add b); uncommitted: 1 unstaged change, 2 untracked files"
            )
        );
        assert!(
            lines[1].starts_with("lib: a repository new to this run, 1 new commit (")
                && lines[1].ends_with("start lib); nothing uncommitted"),
            "{text}"
        );

        // More commits than a note lists: the rest are counted.
        for i in 0..12 {
            commit(&lib, "l.txt", &format!("lib {i}"));
        }
        let text = changes(root, &start, None).await;
        let lib_line = text.lines().nth(1).unwrap();
        assert!(
            lib_line.starts_with("lib: a repository new to this run, 13 new commits (")
                && lib_line.contains("lib 11; ")
                && lib_line.ends_with(" lib 2; and 3 more); nothing uncommitted"),
            "{text}"
        );

        // The last checkpoint's readings stand in for git's: the same note.
        let read = vec![
            cairn_engine::git::inspect(&app, "app").unwrap(),
            cairn_engine::git::inspect(&lib, "lib").unwrap(),
        ];
        assert_eq!(changes(root, &start, Some(&read)).await, text);
        // They are what the note says, not a second reading: a HEAD they
        // give as unmoved has no new commits, whatever git's log holds.
        let mut unmoved = read[0].clone();
        unmoved.head = start.0["app"].clone().unwrap();
        unmoved.untracked = 7;
        let text = changes(root, &start, Some(&[unmoved])).await;
        assert_eq!(
            text.lines().next().unwrap(),
            "app: no new commits; uncommitted: 1 unstaged change, 7 untracked files"
        );

        let empty = tempfile::tempdir().unwrap();
        assert_eq!(
            changes(empty.path(), &Heads::default(), None).await,
            "no git checkouts in the workspace"
        );
    }
}
