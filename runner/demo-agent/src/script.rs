//! The demo agent's directives: one per line of a message.
//!
//! ```text
//! commit <path> <text>      write text to path, git add + commit
//! edit <path> <text>        append text to path (left uncommitted)
//! untracked <path> <text>   write a file git does not track
//! ask <question>            end the turn asking a person (outcome file)
//! recall <word>             say what the FIRST user message of this
//!                           conversation said about <word>
//! sleep <secs>              work for a while
//! run <command>             run a shell command in the working directory,
//!                           as Claude Code's Bash tool does (its output and
//!                           exit status go into the summary; a failing
//!                           command does not end the turn)
//! fail <message>            end the turn with an error (exit 1)
//! ```
//!
//! Lines that are not directives are just remembered (they are in the
//! transcript). Paths are relative to the working directory and stay in it.

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use git2::{Repository, RepositoryOpenFlags, Signature};

/// One directive.
#[derive(Debug, Clone, PartialEq)]
pub enum Directive {
    Commit { path: String, text: String },
    Edit { path: String, text: String },
    Untracked { path: String, text: String },
    Ask { question: String },
    Recall { word: String },
    Sleep { secs: f64 },
    Run { command: String },
    Fail { message: String },
}

/// The directives of a message, in order; other lines are skipped.
pub fn parse(message: &str) -> Vec<Directive> {
    message.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Directive> {
    let line = line.trim();
    let (word, rest) = line
        .split_once(char::is_whitespace)
        .map_or((line, ""), |(w, r)| (w, r.trim()));
    let path_and_text = || {
        let (path, text) = rest
            .split_once(char::is_whitespace)
            .map_or((rest, ""), |(p, t)| (p, t.trim()));
        (!path.is_empty()).then(|| (path.to_owned(), text.to_owned()))
    };
    match word {
        "commit" => path_and_text().map(|(path, text)| Directive::Commit { path, text }),
        "edit" => path_and_text().map(|(path, text)| Directive::Edit { path, text }),
        "untracked" => path_and_text().map(|(path, text)| Directive::Untracked { path, text }),
        "ask" if !rest.is_empty() => Some(Directive::Ask {
            question: rest.to_owned(),
        }),
        "recall" if !rest.is_empty() => Some(Directive::Recall {
            word: rest.to_owned(),
        }),
        "sleep" => rest
            .parse()
            .ok()
            .filter(|s: &f64| s.is_finite() && *s >= 0.0)
            .map(|secs| Directive::Sleep { secs }),
        "run" if !rest.is_empty() => Some(Directive::Run {
            command: rest.to_owned(),
        }),
        "fail" => Some(Directive::Fail {
            message: if rest.is_empty() {
                "failed on purpose".into()
            } else {
                rest.to_owned()
            },
        }),
        _ => None,
    }
}

/// What a directive did, or why it could not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Done {
    /// A line for the summary.
    Said(String),
    Asked(String),
    Failed(String),
}

/// Carries out one directive in `cwd`; `first_message` is the first user
/// message of the conversation (for `recall`).
pub fn perform(
    directive: &Directive,
    cwd: &Path,
    first_message: &str,
    outcome_file: &Path,
) -> Done {
    let result = match directive {
        Directive::Commit { path, text } => {
            commit(cwd, path, text).map(|()| format!("committed {path}"))
        }
        Directive::Edit { path, text } => {
            append(cwd, path, text).map(|()| format!("edited {path}"))
        }
        Directive::Untracked { path, text } => {
            write(cwd, path, text).map(|()| format!("wrote {path}, which git does not track"))
        }
        Directive::Ask { question } => {
            let outcome = cairn_runner::run::outcome::Outcome::NeedsInput {
                question: question.clone(),
            };
            return match cairn_runner::run::outcome::write(outcome_file, &outcome) {
                Ok(_) => Done::Asked(question.clone()),
                Err(e) => Done::Failed(e.to_string()),
            };
        }
        Directive::Recall { word } => Ok(recall(first_message, word)),
        Directive::Sleep { secs } => {
            std::thread::sleep(Duration::from_secs_f64(*secs));
            Ok(format!("worked for {secs} s"))
        }
        Directive::Run { command } => run_shell(cwd, command),
        Directive::Fail { message } => return Done::Failed(message.clone()),
    };
    match result {
        Ok(said) => Done::Said(said),
        Err(e) => Done::Failed(e),
    }
}

/// Runs `command` with `sh -c` in `cwd`; says what it printed and how it
/// ended. Only a command that cannot be started is an error.
fn run_shell(cwd: &Path, command: &str) -> Result<String, String> {
    let output = std::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .current_dir(cwd)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {command:?}: {e}"))?;
    let printed = |bytes: &[u8]| String::from_utf8_lossy(bytes).trim().to_owned();
    let (stdout, stderr) = (printed(&output.stdout), printed(&output.stderr));
    let mut said = match output.status.code() {
        Some(0) => format!("ran {command:?}"),
        Some(code) => format!("ran {command:?}, which exited with status {code}"),
        None => format!("ran {command:?}, which was killed by a signal"),
    };
    for text in [stdout, stderr] {
        if !text.is_empty() {
            said.push_str(": ");
            said.push_str(&text);
        }
    }
    Ok(said)
}

/// What `message` says about `word`: the word after it, skipping filler
/// like "is" or ":" — `"The codeword is PELICAN."` → `the codeword was PELICAN`.
pub fn recall(message: &str, word: &str) -> String {
    const FILLER: &[&str] = &[
        "is", "was", "are", "were", "=", ":", "-", "to", "be", "will", "shall", "of", "it's",
    ];
    let clean = |token: &str| {
        token
            .trim_matches(|c: char| !c.is_alphanumeric())
            .to_owned()
    };
    let tokens: Vec<&str> = message.split_whitespace().collect();
    let wanted = clean(word).to_lowercase();
    for (i, token) in tokens.iter().enumerate() {
        if clean(token).to_lowercase() != wanted {
            continue;
        }
        let value = tokens[i + 1..]
            .iter()
            .map(|t| clean(t))
            .find(|t| !t.is_empty() && !FILLER.contains(&t.to_lowercase().as_str()));
        if let Some(value) = value {
            return format!("the {wanted} was {value}");
        }
    }
    format!("the first message said nothing about {wanted}")
}

fn inside(cwd: &Path, path: &str) -> Result<PathBuf, String> {
    let relative = Path::new(path);
    if relative
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
    {
        Ok(cwd.join(relative))
    } else {
        Err(format!(
            "{path:?} is not a relative path inside {}",
            cwd.display()
        ))
    }
}

fn with_parent(path: &Path) -> Result<(), String> {
    let parent = path.parent().expect("joined onto a directory");
    fs::create_dir_all(parent).map_err(|e| format!("cannot create {}: {e}", parent.display()))
}

fn write(cwd: &Path, path: &str, text: &str) -> Result<(), String> {
    let full = inside(cwd, path)?;
    with_parent(&full)?;
    fs::write(&full, format!("{text}\n"))
        .map_err(|e| format!("cannot write {}: {e}", full.display()))
}

fn append(cwd: &Path, path: &str, text: &str) -> Result<(), String> {
    let full = inside(cwd, path)?;
    with_parent(&full)?;
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&full)
        .map_err(|e| format!("cannot open {}: {e}", full.display()))?;
    file.write_all(format!("{text}\n").as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", full.display()))
}

/// Writes the file and commits it to the repository holding it (searched no
/// higher than `cwd`), or to a new repository at `cwd`.
fn commit(cwd: &Path, path: &str, text: &str) -> Result<(), String> {
    write(cwd, path, text)?;
    let full = inside(cwd, path)?;
    let git = |e: git2::Error| format!("git: {}", e.message());
    let start = full.parent().expect("joined onto a directory");
    let ceiling = cwd.parent().map(Path::to_path_buf).into_iter();
    let repo = match Repository::open_ext(start, RepositoryOpenFlags::empty(), ceiling) {
        Ok(repo) => repo,
        Err(_) => Repository::init(cwd).map_err(git)?,
    };
    let workdir = repo.workdir().ok_or("the repository is bare")?;
    let workdir = fs::canonicalize(workdir).map_err(|e| e.to_string())?;
    let full = fs::canonicalize(&full).map_err(|e| e.to_string())?;
    let relative = full
        .strip_prefix(&workdir)
        .map_err(|_| format!("{path} is outside the repository"))?;
    let mut index = repo.index().map_err(git)?;
    index.add_path(relative).map_err(git)?;
    index.write().map_err(git)?;
    let tree = repo
        .find_tree(index.write_tree().map_err(git)?)
        .map_err(git)?;
    let parent = repo.head().ok().and_then(|head| head.peel_to_commit().ok());
    let who = Signature::now("cairn demo agent", "demo-agent@cairn.invalid").map_err(git)?;
    let parents: Vec<&git2::Commit> = parent.iter().collect();
    repo.commit(
        Some("HEAD"),
        &who,
        &who,
        &format!("demo agent: {path}"),
        &tree,
        &parents,
    )
    .map_err(git)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_are_read_line_by_line() {
        let message = "The codeword is PELICAN.\n  commit notes/a.md first line\nedit notes/a.md second\n\
                       untracked scratch.txt draft\nask Which colour?\nrecall codeword\nsleep 0.5\nsleep soon\nfail\nask";
        assert_eq!(
            parse(message),
            [
                Directive::Commit {
                    path: "notes/a.md".into(),
                    text: "first line".into()
                },
                Directive::Edit {
                    path: "notes/a.md".into(),
                    text: "second".into()
                },
                Directive::Untracked {
                    path: "scratch.txt".into(),
                    text: "draft".into()
                },
                Directive::Ask {
                    question: "Which colour?".into()
                },
                Directive::Recall {
                    word: "codeword".into()
                },
                Directive::Sleep { secs: 0.5 },
                Directive::Fail {
                    message: "failed on purpose".into()
                },
            ]
        );
    }

    #[test]
    fn run_executes_a_shell_command_in_the_working_directory() {
        let dir = tempfile::tempdir().unwrap();
        let cwd = dir.path();
        let outcome = cwd.join(".cairn/outcome.json");
        let done = |line: &str| perform(&parse(line)[0], cwd, "", &outcome);
        assert_eq!(
            done("run echo made > made.txt && pwd"),
            Done::Said(format!(
                "ran \"echo made > made.txt && pwd\": {}",
                cwd.display()
            ))
        );
        assert_eq!(fs::read_to_string(cwd.join("made.txt")).unwrap(), "made\n");
        assert_eq!(
            done("run echo oops >&2; exit 3"),
            Done::Said("ran \"echo oops >&2; exit 3\", which exited with status 3: oops".into()),
            "a failing command is reported, not fatal"
        );
        assert!(parse("run").is_empty(), "run needs a command");
    }

    #[test]
    fn recall_finds_what_was_said() {
        assert_eq!(
            recall("Hi. The codeword is PELICAN. Bye.", "codeword"),
            "the codeword was PELICAN"
        );
        assert_eq!(
            recall("codeword: 'heron'", "Codeword"),
            "the codeword was heron"
        );
        assert_eq!(recall("colour = blue", "colour"), "the colour was blue");
        assert_eq!(
            recall("nothing here", "codeword"),
            "the first message said nothing about codeword"
        );
        assert_eq!(
            recall("the codeword", "codeword"),
            "the first message said nothing about codeword"
        );
    }

    #[test]
    fn commits_edits_and_untracked_files_land_in_git() {
        let dir = tempfile::tempdir().unwrap();
        let cwd = dir.path();
        let outcome = cwd.join(".cairn/outcome.json");
        for d in parse(
            "commit notes.md one\ncommit notes.md two\nedit notes.md three\nuntracked scratch.txt x",
        ) {
            assert!(
                matches!(perform(&d, cwd, "", &outcome), Done::Said(_)),
                "{d:?}"
            );
        }
        let repo = Repository::open(cwd).unwrap();
        let head = repo.head().unwrap().peel_to_commit().unwrap();
        assert_eq!(
            head.parent_count(),
            1,
            "the second commit builds on the first"
        );
        let statuses = repo.statuses(None).unwrap();
        let status = |p: &str| {
            statuses
                .iter()
                .find(|s| s.path() == Some(p))
                .map(|s| s.status())
        };
        assert_eq!(status("notes.md"), Some(git2::Status::WT_MODIFIED));
        assert_eq!(status("scratch.txt"), Some(git2::Status::WT_NEW));
        assert_eq!(
            fs::read_to_string(cwd.join("notes.md")).unwrap(),
            "two\nthree\n"
        );

        assert_eq!(
            perform(
                &Directive::Ask {
                    question: "Why?".into()
                },
                cwd,
                "",
                &outcome
            ),
            Done::Asked("Why?".into())
        );
        assert!(outcome.exists());
        let escape = Directive::Edit {
            path: "../x".into(),
            text: "no".into(),
        };
        assert!(
            matches!(perform(&escape, cwd, "", &outcome), Done::Failed(e) if e.contains("not a relative path"))
        );
    }
}
