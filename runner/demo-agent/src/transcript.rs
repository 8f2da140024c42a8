//! Where Claude Code keeps a conversation, and the transcript lines the demo
//! agent writes there.
//!
//! `$CLAUDE_CONFIG_DIR/projects/<slug>/<session uuid>.jsonl`, one JSON
//! object per line; the slug is the realpath of the working directory with
//! every character that is not an ASCII letter or digit replaced by `-`
//! (`/workspace/app` → `-workspace-app`), cut at 200 characters and
//! suffixed with a hash when longer.

use std::fs::{self, OpenOptions};
use std::io::{self, BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde_json::{Value, json};

const MAX_SLUG: usize = 200;

/// The project directory name Claude Code derives from an absolute path.
pub fn slug(path: &Path) -> String {
    let text = path.to_string_lossy();
    let replaced: String = text
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    if replaced.chars().count() <= MAX_SLUG {
        return replaced;
    }
    let cut: String = replaced.chars().take(MAX_SLUG).collect();
    format!("{cut}-{}", short_hash(&text))
}

/// A 32-bit string hash in base 36 (the shape of Claude Code's suffix).
fn short_hash(text: &str) -> String {
    let mut hash: i32 = 0;
    for unit in text.encode_utf16() {
        hash = hash
            .wrapping_shl(5)
            .wrapping_sub(hash)
            .wrapping_add(i32::from(unit));
    }
    let mut n = hash.unsigned_abs();
    let digits = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(digits[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).expect("ascii digits")
}

/// The config dir: `CLAUDE_CONFIG_DIR`, else `$HOME/.claude`.
pub fn config_dir() -> PathBuf {
    match std::env::var_os("CLAUDE_CONFIG_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/"));
            home.join(".claude")
        }
    }
}

/// One conversation's transcript file.
#[derive(Debug, Clone)]
pub struct Transcript {
    pub path: PathBuf,
    pub session_id: String,
    cwd: PathBuf,
    /// The uuid of the last line written, which the next line points back to.
    last_uuid: Option<String>,
}

impl Transcript {
    /// The transcript of `session_id` for the working directory `cwd` (a realpath).
    pub fn at(config_dir: &Path, cwd: &Path, session_id: &str) -> Self {
        let path = config_dir
            .join("projects")
            .join(slug(cwd))
            .join(format!("{session_id}.jsonl"));
        Self {
            path,
            session_id: session_id.to_owned(),
            cwd: cwd.to_path_buf(),
            last_uuid: None,
        }
    }

    pub fn exists(&self) -> bool {
        self.path.is_file()
    }

    /// Every line of the transcript that parses.
    pub fn lines(&self) -> io::Result<Vec<Value>> {
        let file = fs::File::open(&self.path)?;
        let mut lines = Vec::new();
        for line in BufReader::new(file).lines() {
            if let Ok(value) = serde_json::from_str::<Value>(&line?) {
                lines.push(value);
            }
        }
        Ok(lines)
    }

    /// The text of the first user message of the conversation.
    pub fn first_user_message(&self) -> io::Result<Option<String>> {
        Ok(self
            .lines()?
            .iter()
            .find(|line| line["type"] == "user")
            .map(|line| message_text(&line["message"])))
    }

    fn append(&mut self, kind: &str, message: Value) -> io::Result<()> {
        if self.last_uuid.is_none() {
            self.last_uuid = self.lines().ok().and_then(|lines| {
                lines
                    .iter()
                    .rev()
                    .find_map(|l| l["uuid"].as_str().map(str::to_owned))
            });
        }
        let uuid = cairn_runner::harness::new_session_id();
        let line = json!({
            "parentUuid": self.last_uuid,
            "isSidechain": false,
            "userType": "external",
            "cwd": self.cwd.to_string_lossy(),
            "sessionId": self.session_id,
            "version": env!("CARGO_PKG_VERSION"),
            "type": kind,
            "message": message,
            "uuid": uuid,
            "timestamp": cairn_proto::domain::to_timestamp(SystemTime::now()).to_string(),
        });
        fs::create_dir_all(self.path.parent().expect("a transcript is in a directory"))?;
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        file.write_all(format!("{line}\n").as_bytes())?;
        self.last_uuid = Some(uuid);
        Ok(())
    }

    /// Copies the conversation to a new transcript `session_id` next to it
    /// (the same project directory), every line carrying the new id, and
    /// returns the copy; this transcript is not changed.
    pub fn fork_to(&self, session_id: &str) -> io::Result<Transcript> {
        let mut fork = Transcript::at(Path::new(""), &self.cwd, session_id);
        fork.path = self.path.with_file_name(format!("{session_id}.jsonl"));
        let mut text = String::new();
        for mut line in self.lines()? {
            if line.get("sessionId").is_some() {
                line["sessionId"] = Value::String(session_id.to_owned());
            }
            text.push_str(&format!("{line}\n"));
        }
        let mut file = OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&fork.path)?;
        file.write_all(text.as_bytes())?;
        Ok(fork)
    }

    pub fn append_user(&mut self, text: &str) -> io::Result<()> {
        self.append("user", json!({ "role": "user", "content": text }))
    }

    pub fn append_assistant(&mut self, text: &str) -> io::Result<()> {
        self.append("assistant", assistant_message(text))
    }
}

/// An assistant message as the Messages API shapes it.
pub fn assistant_message(text: &str) -> Value {
    json!({
        "id": format!("msg_{}", cairn_runner::harness::new_session_id().replace('-', "")),
        "type": "message",
        "role": "assistant",
        "model": "cairn-demo-agent",
        "content": [{ "type": "text", "text": text }],
        "stop_reason": "end_turn",
        "usage": { "input_tokens": 0, "output_tokens": 0 },
    })
}

/// The text of a message whose content is a string or a list of blocks.
fn message_text(message: &Value) -> String {
    match &message["content"] {
        Value::String(text) => text.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter_map(|b| b["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_follow_claude_code() {
        assert_eq!(slug(Path::new("/workspace/app")), "-workspace-app");
        assert_eq!(slug(Path::new("/workspace")), "-workspace");
        assert_eq!(
            slug(Path::new("/home/me/my project.v2")),
            "-home-me-my-project-v2"
        );
        let long = PathBuf::from(format!("/{}", "a".repeat(300)));
        let s = slug(&long);
        assert!(s.starts_with(&format!("-{}", "a".repeat(199))), "{s}");
        assert_eq!(s.chars().nth(200), Some('-'));
        assert_ne!(
            slug(&long),
            slug(&PathBuf::from(format!("/{}", "a".repeat(301)))),
            "the hash tells them apart"
        );
    }

    #[test]
    fn a_transcript_chains_its_lines_and_finds_the_first_user_message() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = Transcript::at(dir.path(), Path::new("/workspace/app"), "s-1");
        assert_eq!(t.path, dir.path().join("projects/-workspace-app/s-1.jsonl"));
        assert!(!t.exists());
        t.append_user("The codeword is PELICAN.").unwrap();
        t.append_assistant("noted").unwrap();
        let mut again = Transcript::at(dir.path(), Path::new("/workspace/app"), "s-1");
        again.append_user("what was it?").unwrap();
        let lines = again.lines().unwrap();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0]["parentUuid"], Value::Null);
        assert_eq!(lines[1]["parentUuid"], lines[0]["uuid"]);
        assert_eq!(
            lines[2]["parentUuid"], lines[1]["uuid"],
            "a new writer continues the chain"
        );
        assert_eq!(lines[1]["message"]["content"][0]["text"], "noted");
        assert_eq!(lines[2]["sessionId"], "s-1");
        assert_eq!(
            again.first_user_message().unwrap().as_deref(),
            Some("The codeword is PELICAN.")
        );
    }

    #[test]
    fn a_fork_copies_the_conversation_and_leaves_the_original() {
        let dir = tempfile::tempdir().unwrap();
        let mut source = Transcript::at(dir.path(), Path::new("/workspace/app"), "s-1");
        source.append_user("The codeword is PELICAN.").unwrap();
        source.append_assistant("noted").unwrap();
        let before = fs::read_to_string(&source.path).unwrap();

        let mut fork = source.fork_to("s-2").unwrap();
        assert_eq!(
            fork.path,
            dir.path().join("projects/-workspace-app/s-2.jsonl")
        );
        assert_eq!(fork.session_id, "s-2");
        fork.append_user("what was it?").unwrap();
        let lines = fork.lines().unwrap();
        assert_eq!(lines.len(), 3);
        assert!(lines.iter().all(|l| l["sessionId"] == "s-2"), "{lines:?}");
        assert_eq!(
            lines[2]["parentUuid"], lines[1]["uuid"],
            "the chain goes on"
        );
        assert_eq!(
            fork.first_user_message().unwrap().as_deref(),
            Some("The codeword is PELICAN.")
        );
        assert_eq!(fs::read_to_string(&source.path).unwrap(), before);
        assert!(source.fork_to("s-2").is_err(), "a fork never overwrites");
    }
}
