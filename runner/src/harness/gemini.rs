//! The Gemini CLI adapter (`gemini`), per ../shared/reference/harnesses.md.
//!
//! - State: `GEMINI_CLI_HOME=<root>/.cairn/state/gemini` (Gemini CLI uses it
//!   in place of the home directory), so chats
//!   (`.gemini/tmp/<slug>/chats/session-<ts>-<id8>.jsonl`, with the slug
//!   registry `.gemini/projects.json`) live in the workspace and travel with
//!   its checkpoints.
//! - First turn: `-p <message> --output-format stream-json --session-id
//!   <new uuid>` (the runner chooses the id); every later turn, and every
//!   turn after a restore: `-p <message> --output-format stream-json
//!   --resume <id>` (never both flags). `model` and `args` follow. A message
//!   starting with `-` is passed as `--prompt=<message>`.
//! - The session id comes from `{"type":"init","session_id":…}`; the turn's
//!   summary is the assistant's text, streamed as `{"type":"message",
//!   "role":"assistant","content":…,"delta":true}` pieces after the last
//!   tool call (a final result's `response`, which older versions send,
//!   wins); a result with
//!   `"status":"error"` marks a failed turn (`error.message` says why; the
//!   CLI exits 145). Either `Error resuming session: Invalid session
//!   identifier "<id>"` (the project has other chats) or `Error resuming
//!   session: No previous sessions found for this project.` (it has none,
//!   e.g. after a first turn that failed, whose chat gemini deletes at its
//!   next start), both exit 42, means the conversation is gone.
//! - Trust: Gemini CLI refuses every call in a directory nobody trusted
//!   interactively (exit 55); the runner sets
//!   `GEMINI_CLI_TRUST_WORKSPACE=true` for every turn — the sandbox's
//!   workspace is the directory the agent is there to work in.
//! - Credentials (`oauth_creds.json`, `google_accounts.json`,
//!   `mcp-oauth-tokens.json`, `a2a-oauth-tokens.json`,
//!   `gemini-credentials.json`, and `.env`, which may hold
//!   `GEMINI_API_KEY`, under `$GEMINI_CLI_HOME/.gemini/`) are never
//!   checkpointed; they are copied in fresh from `credentials_dir` (default
//!   `$HOME/.gemini`) before the first turn.
//! - Auth selection: the OAuth files alone are refused (exit 41, `Please set
//!   an Auth method in your …/settings.json`), and so is `GEMINI_API_KEY`
//!   alone (`Invalid auth method selected.`), so before the first turn the
//!   runner writes `security.auth.selectedType` into the state's
//!   `settings.json` when it holds none: the one of `credentials_dir`'s
//!   `settings.json`, else `oauth-personal` when `oauth_creds.json` was
//!   copied in, else `gemini-api-key` when `GEMINI_API_KEY` is set (in the
//!   environment or the copied `.env`). Nothing else of the user's settings
//!   is copied.
//! - No fork: a forked workspace's first turn gets the handoff briefing.
//!
//! Settings: `binary` (default `gemini`), `model`, `args`, `cwd`,
//! `credentials_dir`.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use serde_json::Value;

use super::{
    Cli, CliSpec, CliTurns, HarnessError, Invocation, Observed, TurnRequest, message_option,
    new_session_id, non_empty,
};

const CLI: CliSpec = CliSpec {
    name: "gemini",
    settings: cairn_proto::runs::GEMINI_SETTINGS,
    state_dir: ".cairn/state/gemini",
    state_env: Some("GEMINI_CLI_HOME"),
    // Where Gemini CLI keeps its files under `GEMINI_CLI_HOME`.
    credentials_subdir: Some(".gemini"),
    credential_files: &[
        "oauth_creds.json",
        "google_accounts.json",
        "mcp-oauth-tokens.json",
        "a2a-oauth-tokens.json",
        "gemini-credentials.json",
        ".env",
    ],
    more_excludes: &[],
    home_credentials: ".gemini",
    // What `gemini --resume` prints (exit 42) when no chat has the id: the
    // project has other chats, or none.
    session_lost: &[
        "Error resuming session: Invalid session identifier",
        "Error resuming session: No previous sessions found for this project.",
    ],
    can_fork: false,
};

/// The variable that tells Gemini CLI its cwd is trusted.
const TRUST_ENV: &str = "GEMINI_CLI_TRUST_WORKSPACE";
/// Gemini CLI's settings file, in its `.gemini` directory.
const SETTINGS: &str = "settings.json";
/// The auth method of a Google login (the OAuth files).
const OAUTH_PERSONAL: &str = "oauth-personal";
/// The auth method of an API key, and its variable.
const API_KEY_AUTH: &str = "gemini-api-key";
const API_KEY_ENV: &str = "GEMINI_API_KEY";

/// `security.auth.selectedType` of the settings file at `path`, if any.
fn auth_type(path: &Path) -> Option<String> {
    let settings: Value = serde_json::from_slice(&fs::read(path).ok()?).ok()?;
    non_empty(&settings["security"]["auth"]["selectedType"]).map(str::to_owned)
}

/// Sets `value` at the nested object path `keys`, making objects on the way
/// (a non-object on the way is replaced).
fn set_path(value: &mut Value, keys: &[&str], leaf: String) {
    let Some((last, parents)) = keys.split_last() else {
        return;
    };
    let mut node = value;
    for key in parents {
        if !node[*key].is_object() {
            node[*key] = Value::Object(Default::default());
        }
        node = &mut node[*key];
    }
    node[*last] = Value::String(leaf);
}

/// Gemini CLI, configured for one run.
#[derive(Debug, Clone)]
pub struct Gemini(Cli);

impl Gemini {
    pub fn new(config: &BTreeMap<String, String>, root: &Path) -> Result<Self, HarnessError> {
        Cli::new(&CLI, config, root).map(Self)
    }
}

impl CliTurns for Gemini {
    fn cli(&self) -> &Cli {
        &self.0
    }

    fn invocation(&self, turn: &TurnRequest, _cwd: &Path) -> Invocation {
        let mut args = message_option("-p", "--prompt=", turn.message());
        args.extend(["--output-format".into(), "stream-json".into()]);
        match turn {
            TurnRequest::Start { .. } => args.extend(["--session-id".into(), new_session_id()]),
            TurnRequest::Resume { session_id, .. } => {
                args.extend(["--resume".into(), session_id.clone()]);
            }
        }
        args.extend(self.0.options());
        Invocation {
            args,
            env: vec![(TRUST_ENV.to_owned(), "true".to_owned())],
            session_at_start: None,
        }
    }

    fn prepare_more(&self) -> Result<(), HarnessError> {
        let dot_gemini = self.0.state_dir.join(".gemini");
        let from_user = self
            .0
            .credentials_dir
            .as_ref()
            .and_then(|dir| auth_type(&dir.join(SETTINGS)));
        let oauth = dot_gemini.join("oauth_creds.json").is_file();
        let key = std::env::var_os(API_KEY_ENV).is_some_and(|k| !k.is_empty())
            || fs::read_to_string(dot_gemini.join(".env")).is_ok_and(|env| {
                env.lines().any(|line| {
                    let line = line.trim().trim_start_matches("export ");
                    line.strip_prefix(API_KEY_ENV)
                        .and_then(|rest| rest.strip_prefix('='))
                        .is_some_and(|value| !value.trim().is_empty())
                })
            });
        let fallback = if oauth {
            Some(OAUTH_PERSONAL)
        } else if key {
            Some(API_KEY_AUTH)
        } else {
            None
        };
        let Some(selected) = from_user.or_else(|| fallback.map(str::to_owned)) else {
            return Ok(());
        };
        let path = dot_gemini.join(SETTINGS);
        let error = |source| HarnessError::Prepare {
            path: path.clone(),
            source,
        };
        let mut settings = match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice::<Value>(&bytes)
                .ok()
                .filter(Value::is_object)
                .ok_or_else(|| {
                    error(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "not a JSON object",
                    ))
                })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Object(Default::default()),
            Err(e) => return Err(error(e)),
        };
        if non_empty(&settings["security"]["auth"]["selectedType"]).is_some() {
            return Ok(());
        }
        set_path(
            &mut settings,
            &["security", "auth", "selectedType"],
            selected.clone(),
        );
        let text = serde_json::to_vec_pretty(&settings).expect("a JSON value serialises");
        fs::write(&path, text).map_err(error)?;
        tracing::debug!(auth = %selected, "gemini's auth method written to its settings");
        Ok(())
    }

    fn observe_event(&self, event: &Value, observed: &mut Observed) {
        match event["type"].as_str() {
            Some("init") => {
                if let Some(id) = non_empty(&event["session_id"]) {
                    observed.session_id.get_or_insert_with(|| id.to_owned());
                }
            }
            Some("result") if event["status"] == "error" => {
                let message =
                    non_empty(&event["error"]["message"]).unwrap_or("gemini reported an error");
                observed.error = Some(message.to_owned());
            }
            // Gemini CLI streams the answer in pieces; a tool call starts
            // the answer over.
            Some("message") if event["role"] == "assistant" => {
                if let Some(text) = event["content"].as_str() {
                    let summary = observed.summary.get_or_insert_with(String::new);
                    if event["delta"] != true {
                        summary.clear();
                    }
                    summary.push_str(text);
                }
            }
            Some("tool_use" | "tool_result") => observed.summary = None,
            Some("result") => {
                // Older versions put the whole answer here.
                if let Some(text) = non_empty(&event["response"]) {
                    observed.summary = Some(text.to_owned());
                }
                if let Some(summary) = &mut observed.summary {
                    let trimmed = summary.trim_end().len();
                    summary.truncate(trimmed);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::super::testing::*;
    use super::*;

    fn gemini(config: &[(&str, &str)], root: &Path) -> Gemini {
        Gemini::new(&settings(config), root).unwrap()
    }

    #[test]
    fn turns_use_the_exact_flags() {
        let g = gemini(
            &[("model", "gemini-2.5-pro"), ("args", "--yolo")],
            Path::new("/workspace"),
        );
        let start = start_turn(&g, "fix it", "/workspace/app");
        assert_eq!(start.program, "gemini");
        assert_eq!(
            &start.args[..5],
            [
                "-p",
                "fix it",
                "--output-format",
                "stream-json",
                "--session-id"
            ]
        );
        assert!(is_uuid(&start.args[5]), "{:?}", start.args);
        assert_eq!(&start.args[6..], ["--model", "gemini-2.5-pro", "--yolo"]);
        assert!(!start.args.contains(&"--resume".to_owned()));
        assert_eq!(
            start.env,
            [
                (
                    "GEMINI_CLI_HOME".to_owned(),
                    "/workspace/.cairn/state/gemini".to_owned()
                ),
                ("GEMINI_CLI_TRUST_WORKSPACE".to_owned(), "true".to_owned())
            ]
        );

        let plain = gemini(&[], Path::new("/workspace"));
        let resume = resume_turn(&plain, "s-1", "-v please", false).unwrap();
        assert_eq!(
            resume.args,
            [
                "--prompt=-v please",
                "--output-format",
                "stream-json",
                "--resume",
                "s-1"
            ]
        );
        assert!(!plain.can_fork());
    }

    #[test]
    fn the_stream_gives_session_summary_and_errors() {
        let g = gemini(&[], Path::new("/workspace"));
        let seen = observe_lines(
            &g,
            Stream::Stdout,
            &[
                r#"{"type":"init","timestamp":"t","session_id":"abc","model":"m"}"#,
                r#"{"type":"message","role":"assistant","content":"did","delta":true}"#,
                r#"{"type":"result","status":"success","response":"did it","stats":{}}"#,
            ],
        );
        assert_eq!(seen.summary.as_deref(), Some("did it"));
        // 0.61: the answer only in pieces, a tool call between.
        let streamed = observe_lines(
            &g,
            Stream::Stdout,
            &[
                r#"{"type":"message","role":"user","content":"fix it"}"#,
                r#"{"type":"message","role":"assistant","content":"Looking","delta":true}"#,
                r#"{"type":"tool_use","tool_name":"read_file","tool_id":"t1","parameters":{}}"#,
                r#"{"type":"tool_result","tool_id":"t1","status":"success"}"#,
                r#"{"type":"message","role":"assistant","content":"Fixed ","delta":true}"#,
                r#"{"type":"message","role":"assistant","content":"it.\n","delta":true}"#,
                r#"{"type":"result","status":"success","stats":{"total_tokens":15}}"#,
            ],
        );
        assert_eq!(streamed.summary.as_deref(), Some("Fixed it."));
        assert_eq!(
            seen,
            Observed {
                session_id: Some("abc".into()),
                summary: Some("did it".into()),
                ..Observed::default()
            }
        );
        let failed = observe_lines(
            &g,
            Stream::Stdout,
            &[r#"{"type":"result","status":"error","error":{"type":"x","message":"quota"}}"#],
        );
        assert_eq!(failed.error.as_deref(), Some("quota"));
        let lost = observe_lines(
            &g,
            Stream::Stderr,
            &[r#"Error resuming session: Invalid session identifier "1234". Use --list-sessions"#],
        );
        assert!(lost.session_lost);
        let none_left = observe_lines(
            &g,
            Stream::Stderr,
            &["Error resuming session: No previous sessions found for this project."],
        );
        assert!(none_left.session_lost);
    }

    #[test]
    fn an_oauth_login_gets_its_auth_method_selected() {
        let (root, _g) = prepared(Gemini::new, &[("oauth_creds.json", "{\"token\":1}")]);
        let settings = root
            .path()
            .join(".cairn/state/gemini/.gemini/settings.json");
        assert_eq!(auth_type(&settings).as_deref(), Some("oauth-personal"));

        // The user's own choice wins, and an existing settings file keeps
        // what it holds.
        let (root, g) = prepared(
            Gemini::new,
            &[(
                "settings.json",
                r#"{"security":{"auth":{"selectedType":"vertex-ai"}},"mcpServers":{"x":{}}}"#,
            )],
        );
        let state_settings = root
            .path()
            .join(".cairn/state/gemini/.gemini/settings.json");
        assert_eq!(auth_type(&state_settings).as_deref(), Some("vertex-ai"));
        let written: Value = serde_json::from_slice(&fs::read(&state_settings).unwrap()).unwrap();
        assert!(
            written.get("mcpServers").is_none(),
            "only the auth method is copied"
        );
        fs::write(
            &state_settings,
            r#"{"ui":{"theme":"x"},"security":{"auth":{"selectedType":"gemini-api-key"}}}"#,
        )
        .unwrap();
        g.prepare().unwrap();
        let kept: Value = serde_json::from_slice(&fs::read(&state_settings).unwrap()).unwrap();
        assert_eq!(kept["security"]["auth"]["selectedType"], "gemini-api-key");
        assert_eq!(kept["ui"]["theme"], "x");

        // No login at all: nothing is written.
        let (root, _g) = prepared(Gemini::new, &[]);
        assert!(
            !root
                .path()
                .join(".cairn/state/gemini/.gemini/settings.json")
                .exists()
        );
    }

    #[test]
    fn credentials_are_excluded_and_copied_in_fresh() {
        let (root, g) = prepared(Gemini::new, &[("oauth_creds.json", "{\"token\":1}")]);
        let dot_gemini = root.path().join(".cairn/state/gemini/.gemini");
        let copied = dot_gemini.join("oauth_creds.json");
        assert_eq!(fs::read_to_string(&copied).unwrap(), "{\"token\":1}");
        assert!(!dot_gemini.join("google_accounts.json").exists());
        assert_excluded(
            &g,
            root.path(),
            &[
                (".cairn/state/gemini/.gemini/oauth_creds.json", true),
                (".cairn/state/gemini/.gemini/gemini-credentials.json", true),
                (".cairn/state/gemini/.gemini/.env", true),
                (".cairn/state/gemini/.gemini/settings.json", false),
                (".cairn/state/gemini/.gemini/projects.json", false),
                (
                    ".cairn/state/gemini/.gemini/tmp/app/chats/session-x.jsonl",
                    false,
                ),
                ("app/oauth_creds.json", false),
            ],
        );
    }
}
