//! The git command line, as the prepare step and handoff notes run it:
//! never a prompt, never a hook (a workspace's hooks are the agent's, not
//! the runner's), messages in English, and a bound on how long it may take.
//!
//! libgit2 (see [`crate::git`]) reads repositories; fetching needs the
//! transports and credential helpers a team configured for `git`, and a
//! fast-forward must update the working tree exactly as `git merge` does,
//! so those go through the CLI.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

/// What a git command printed and how it exited.
#[derive(Debug, Clone)]
pub struct GitOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl From<std::process::Output> for GitOutput {
    fn from(output: std::process::Output) -> Self {
        Self {
            status: output.status,
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }
}

impl GitOutput {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Git's own account of a failure: its first `fatal:` or `error:` line
    /// (without the word), else its first line, else the exit status.
    pub fn message(&self) -> String {
        let lines = || self.stderr.lines().map(str::trim).filter(|l| !l.is_empty());
        lines()
            .find_map(|l| {
                l.strip_prefix("fatal: ")
                    .or_else(|| l.strip_prefix("error: "))
            })
            .or_else(|| lines().next())
            .map(str::to_owned)
            .unwrap_or_else(|| {
                format!("git {}", cairn_utils::process::describe_status(self.status))
            })
    }

    /// Stdout, trimmed.
    pub fn text(&self) -> &str {
        self.stdout.trim()
    }
}

/// Why git could not be run to its end.
#[derive(Debug, thiserror::Error)]
pub enum GitCliError {
    #[error("cannot run git in {}: {source}", .dir.display())]
    Spawn { dir: PathBuf, source: io::Error },
    #[error("git {command} took longer than {} s", .limit.as_secs())]
    Timeout { command: String, limit: Duration },
}

/// `git` in `dir` as the runner runs it: no hook, no prompt, messages in
/// English, the repository found from `dir` alone; its arguments follow.
pub fn command(dir: &Path) -> std::process::Command {
    let mut command = std::process::Command::new("git");
    command
        .args(["-c", "core.hooksPath=/dev/null", "-c", "safe.directory=*"])
        .current_dir(dir)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("LC_ALL", "C")
        .env_remove("GIT_DIR")
        .env_remove("GIT_WORK_TREE")
        .env_remove("GIT_INDEX_FILE")
        // Pathspec magic (`:(glob)…`) must mean what it says.
        .env_remove("GIT_LITERAL_PATHSPECS")
        .env_remove("GIT_GLOB_PATHSPECS")
        .env_remove("GIT_NOGLOB_PATHSPECS")
        .env_remove("GIT_ICASE_PATHSPECS")
        .stdin(Stdio::null());
    command
}

/// Runs `git ARGS` in `dir`, giving up (and killing it) after `limit`.
pub async fn git(dir: &Path, args: &[&str], limit: Duration) -> Result<GitOutput, GitCliError> {
    let mut command = tokio::process::Command::from(command(dir));
    command
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = command.spawn().map_err(|source| GitCliError::Spawn {
        dir: dir.to_path_buf(),
        source,
    })?;
    match tokio::time::timeout(limit, child.wait_with_output()).await {
        Ok(Ok(output)) => Ok(GitOutput::from(output)),
        Ok(Err(source)) => Err(GitCliError::Spawn {
            dir: dir.to_path_buf(),
            source,
        }),
        Err(_) => Err(GitCliError::Timeout {
            command: args.first().copied().unwrap_or_default().to_owned(),
            limit,
        }),
    }
}

/// The first seven characters of a commit id (or the id, if shorter).
pub fn short(id: &str) -> &str {
    id.get(..7).unwrap_or(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn git_errors_are_told_in_gits_words() {
        let dir = tempfile::tempdir().unwrap();
        let out = git(dir.path(), &["rev-parse", "HEAD"], Duration::from_secs(30))
            .await
            .unwrap();
        assert!(!out.success());
        assert!(
            out.message().starts_with("not a git repository"),
            "{}",
            out.message()
        );
        assert_eq!(short("0123456789abcdef"), "0123456");
        assert_eq!(short("abc"), "abc");
    }
}
