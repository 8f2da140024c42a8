//! Preparing a workspace that has no checkpoint (cloning the run's
//! repositories), and the record of where each conversation runs. (The
//! station's part of the prepare step — clearing leftovers, fast-forwarding,
//! laying files — is in `laid` and `fastforward`.)
//!
//! Claude Code finds a conversation by the slug of its working directory,
//! so a conversation must be resumed in the directory it started in — even
//! if, meanwhile, the agent created a repository that changes the default
//! choice. `.cairn/runner/sessions.json` (checkpointed with the workspace)
//! remembers each session's directory, relative to the root.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;

use cairn_proto::pb;
use serde::{Deserialize, Serialize};

/// The sessions record, relative to the root.
pub const SESSIONS_FILE: &str = ".cairn/runner/sessions.json";

/// Why a repository could not be cloned.
#[derive(Debug, thiserror::Error)]
pub enum CloneError {
    #[error("repository name {0:?} is not a single directory name")]
    BadName(String),
    #[error("cannot run git to clone {name}: {source}")]
    Git { name: String, source: io::Error },
    #[error("cannot clone {name} from {url}: {reason}")]
    Failed {
        name: String,
        url: String,
        reason: String,
    },
}

/// What [`clone_repo`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cloned {
    /// The repository's directory name.
    pub name: String,
    /// Cloned just now (false: something was there already and was kept).
    pub fresh: bool,
    /// What it did, in words.
    pub said: String,
}

/// Clones one repository into `<root>/<name>`.
pub async fn clone_repo(root: &Path, repo: &pb::RepoSpec) -> Result<Cloned, CloneError> {
    let name = repo.name.trim();
    let mut components = Path::new(name).components();
    if !matches!(
        (components.next(), components.next()),
        (Some(Component::Normal(_)), None)
    ) {
        return Err(CloneError::BadName(repo.name.clone()));
    }
    let dest = root.join(name);
    if fs::read_dir(&dest).is_ok_and(|mut entries| entries.next().is_some()) {
        return Ok(Cloned {
            name: name.to_owned(),
            fresh: false,
            said: format!(
                "kept {name}: {} is already there and not empty",
                dest.display()
            ),
        });
    }
    let mut git = tokio::process::Command::new("git");
    git.arg("clone");
    if !repo.branch.trim().is_empty() {
        git.args(["--branch", repo.branch.trim()]);
    }
    git.arg("--").arg(&repo.url).arg(&dest);
    let output = git
        .env("GIT_TERMINAL_PROMPT", "0")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|source| CloneError::Git {
            name: name.to_owned(),
            source,
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let reason = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .map(|l| l.trim().to_owned())
            .unwrap_or_else(|| {
                format!(
                    "git {}",
                    cairn_utils::process::describe_status(output.status)
                )
            });
        return Err(CloneError::Failed {
            name: name.to_owned(),
            url: repo.url.clone(),
            reason,
        });
    }
    let said = match repo.branch.trim() {
        "" => format!("cloned {name} from {}", repo.url),
        branch => format!("cloned {name} from {} (branch {branch})", repo.url),
    };
    Ok(Cloned {
        name: name.to_owned(),
        fresh: true,
        said,
    })
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct SessionEntry {
    harness: String,
    /// Relative to the root ("" for the root itself).
    cwd: String,
}

fn read_sessions(root: &Path) -> BTreeMap<String, SessionEntry> {
    fs::read_to_string(root.join(SESSIONS_FILE))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default()
}

/// Records that `session_id` of `harness` runs in `cwd`.
pub fn record_session(root: &Path, harness: &str, session_id: &str, cwd: &Path) -> io::Result<()> {
    let relative = cwd
        .strip_prefix(root)
        .unwrap_or(cwd)
        .to_string_lossy()
        .into_owned();
    let mut sessions = read_sessions(root);
    let entry = SessionEntry {
        harness: harness.to_owned(),
        cwd: relative,
    };
    if sessions.get(session_id) == Some(&entry) {
        return Ok(());
    }
    sessions.insert(session_id.to_owned(), entry);
    let path = root.join(SESSIONS_FILE);
    fs::create_dir_all(path.parent().expect("the file is in a directory"))?;
    let temporary = path.with_extension("json.tmp");
    fs::write(
        &temporary,
        serde_json::to_string_pretty(&sessions).expect("serialises") + "\n",
    )?;
    fs::rename(temporary, path)
}

/// The directory `session_id` ran in, if recorded and still a directory
/// inside the root.
pub fn session_cwd(root: &Path, session_id: &str) -> Option<PathBuf> {
    let entry = read_sessions(root).remove(session_id)?;
    let relative = Path::new(&entry.cwd);
    if !relative
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
    {
        return None;
    }
    let cwd = root.join(relative);
    cwd.is_dir().then_some(cwd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_remember_their_directory() {
        let root = tempfile::tempdir().unwrap();
        let root = root.path();
        fs::create_dir_all(root.join("app")).unwrap();
        record_session(root, "claude", "s-1", &root.join("app")).unwrap();
        record_session(root, "claude", "s-2", root).unwrap();
        assert_eq!(session_cwd(root, "s-1"), Some(root.join("app")));
        assert_eq!(session_cwd(root, "s-2"), Some(root.to_path_buf()));
        assert_eq!(session_cwd(root, "s-3"), None);
        fs::remove_dir(root.join("app")).unwrap();
        assert_eq!(
            session_cwd(root, "s-1"),
            None,
            "a directory that is gone is not used"
        );
        fs::write(
            root.join(SESSIONS_FILE),
            r#"{"s-4":{"harness":"claude","cwd":"../etc"}}"#,
        )
        .unwrap();
        assert_eq!(session_cwd(root, "s-4"), None, "nothing outside the root");
    }

    #[tokio::test]
    async fn repositories_are_cloned_by_name() {
        let origin = tempfile::tempdir().unwrap();
        let repo = git2::Repository::init(origin.path()).unwrap();
        fs::write(origin.path().join("README"), "hello\n").unwrap();
        let mut index = repo.index().unwrap();
        index.add_path(Path::new("README")).unwrap();
        let tree = repo.find_tree(index.write_tree().unwrap()).unwrap();
        let who = git2::Signature::now("t", "t@example.com").unwrap();
        repo.commit(Some("HEAD"), &who, &who, "first", &tree, &[])
            .unwrap();

        let root = tempfile::tempdir().unwrap();
        let url = origin.path().to_string_lossy().into_owned();
        let spec = pb::RepoSpec {
            name: "app".into(),
            url: url.clone(),
            branch: String::new(),
        };
        let done = clone_repo(root.path(), &spec).await.unwrap();
        assert_eq!(done.said, format!("cloned app from {url}"));
        assert!(done.fresh && done.name == "app");
        assert_eq!(
            fs::read_to_string(root.path().join("app/README")).unwrap(),
            "hello\n"
        );
        let again = clone_repo(root.path(), &spec).await.unwrap();
        assert!(
            again.said.starts_with("kept app") && !again.fresh,
            "{again:?}"
        );

        let bad = pb::RepoSpec {
            name: "../x".into(),
            url: url.clone(),
            branch: String::new(),
        };
        assert!(matches!(
            clone_repo(root.path(), &bad).await,
            Err(CloneError::BadName(_))
        ));
        let missing = pb::RepoSpec {
            name: "gone".into(),
            url: "/nonexistent/repo".into(),
            branch: String::new(),
        };
        let err = clone_repo(root.path(), &missing)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("cannot clone gone from /nonexistent/repo: "),
            "{err}"
        );
    }
}
