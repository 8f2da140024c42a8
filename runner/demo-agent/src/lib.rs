//! `cairn-demo-agent`: a stand-in for Claude Code that needs no model.
//!
//! It honours the Claude Code contract of ../shared/reference/harnesses.md
//! the way the real CLI does, so the runner's `claude` adapter, the tests
//! and `cairnctl demo` run offline:
//! - `-p --output-format stream-json --verbose --session-id <uuid> <prompt>`
//!   opens a conversation; `--resume <id> <message>` continues one;
//!   `--resume <id> --fork-session` continues a copy of it under a new id
//!   (`--session-id` names it, else a new uuid): the copy is a new
//!   transcript in the same project directory, the init event reports its
//!   id, and the original transcript is left as it was;
//! - the transcript is `$CLAUDE_CONFIG_DIR/projects/<slug of realpath(cwd)>/
//!   <uuid>.jsonl` (default config dir `~/.claude`), so a conversation is
//!   only found from the directory it started in;
//! - stream-json: first `{"type":"system","subtype":"init","session_id":…}`,
//!   then assistant messages, then `{"type":"result",…,"result":<summary>}`;
//! - the same refusals with the same words: `Error: Session ID X is already
//!   in use.` when `--session-id` names an existing transcript, and
//!   `No conversation found with session ID: X` (exit 1) when `--resume`
//!   names none under this directory.
//!
//! What it does is scripted by directives in the message (see [`script`]);
//! `recall` reads the conversation's own transcript, so a conversation
//! resumed on another host, after a restore, remembers its first turn.

pub mod script;
pub mod transcript;

use std::io::Read as _;
use std::process::ExitCode;
use std::time::Instant;

use serde_json::{Value, json};

use self::script::Done;
use self::transcript::Transcript;
use cairn_runner::harness::is_uuid;

/// Options that take a value and do not change what the demo agent does.
const IGNORED_WITH_VALUE: &[&str] = &[
    "--model",
    "--permission-mode",
    "--max-turns",
    "--append-system-prompt",
    "--system-prompt",
    "--allowedTools",
    "--allowed-tools",
    "--disallowedTools",
    "--disallowed-tools",
    "--add-dir",
    "--mcp-config",
    "--settings",
];
/// Flags that do not change what the demo agent does.
const IGNORED_FLAGS: &[&str] = &[
    "--dangerously-skip-permissions",
    "--include-partial-messages",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Text,
    Json,
    StreamJson,
}

#[derive(Debug, Default)]
struct Args {
    print: bool,
    verbose: bool,
    format: Option<String>,
    session_id: Option<String>,
    resume: Option<String>,
    fork_session: bool,
    prompt: Option<String>,
}

/// A refusal: the text for stderr and the exit status.
struct Refusal(String);

fn parse(argv: &[String]) -> Result<Args, Refusal> {
    let mut args = Args::default();
    let mut positional = Vec::new();
    let mut i = 0;
    while i < argv.len() {
        let arg = argv[i].as_str();
        i += 1;
        if arg == "--" {
            positional.extend(argv[i..].iter().cloned());
            break;
        }
        if !arg.starts_with('-') || arg == "-" {
            positional.push(arg.to_owned());
            continue;
        }
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(value.to_owned())),
            _ => (arg, None),
        };
        let mut value = |name: &str| -> Result<String, Refusal> {
            if let Some(value) = inline.clone() {
                return Ok(value);
            }
            match argv.get(i) {
                Some(value) => {
                    i += 1;
                    Ok(value.clone())
                }
                None => Err(Refusal(format!(
                    "error: option '{name} <value>' argument missing"
                ))),
            }
        };
        match name {
            "-p" | "--print" => args.print = true,
            "--verbose" => args.verbose = true,
            "--output-format" => args.format = Some(value(name)?),
            "--session-id" => args.session_id = Some(value(name)?),
            "-r" | "--resume" => args.resume = Some(value(name)?),
            "--fork-session" => args.fork_session = true,
            name if IGNORED_WITH_VALUE.contains(&name) => {
                value(name)?;
            }
            name if IGNORED_FLAGS.contains(&name) => {}
            _ => return Err(Refusal(format!("error: unknown option '{arg}'"))),
        }
    }
    match positional.len() {
        0 => {}
        1 => args.prompt = positional.pop(),
        n => {
            return Err(Refusal(format!(
                "error: too many arguments. Expected 1 argument but got {n}."
            )));
        }
    }
    Ok(args)
}

/// The binary's `main`.
pub fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    match run(&argv) {
        Ok(code) => code,
        Err(Refusal(text)) => {
            eprintln!("{text}");
            ExitCode::FAILURE
        }
    }
}

fn run(argv: &[String]) -> Result<ExitCode, Refusal> {
    let args = parse(argv)?;
    if !args.print {
        return Err(Refusal(
            "cairn-demo-agent only runs non-interactively, as `claude -p` does: pass -p (--print)"
                .into(),
        ));
    }
    let format = match args.format.as_deref() {
        None | Some("text") => Format::Text,
        Some("json") => Format::Json,
        Some("stream-json") => Format::StreamJson,
        Some(other) => {
            return Err(Refusal(format!(
                "error: option '--output-format <format>' argument '{other}' is invalid. Allowed choices are text, json, stream-json."
            )));
        }
    };
    if format == Format::StreamJson && !args.verbose {
        return Err(Refusal(
            "Error: When using --print, --output-format=stream-json requires --verbose".into(),
        ));
    }
    if args.fork_session && args.resume.is_none() {
        return Err(Refusal(
            "Error: --fork-session can only be used with --continue or --resume.".into(),
        ));
    }
    if args.session_id.is_some() && args.resume.is_some() && !args.fork_session {
        return Err(Refusal(
            "Error: --session-id can only be used with --continue or --resume if --fork-session is also specified."
                .into(),
        ));
    }
    if let Some(id) = &args.session_id
        && !is_uuid(id)
    {
        return Err(Refusal(
            "Error: Invalid session ID. Must be a valid UUID.".into(),
        ));
    }
    let prompt = match args.prompt {
        Some(prompt) => prompt,
        None => {
            let mut input = String::new();
            let _ = std::io::stdin().read_to_string(&mut input);
            input
        }
    };
    if prompt.trim().is_empty() {
        return Err(Refusal(
            "Error: Input must be provided either through stdin or as a prompt argument when using --print".into(),
        ));
    }
    let cwd = std::env::current_dir()
        .and_then(std::fs::canonicalize)
        .map_err(|e| Refusal(format!("Error: cannot read the working directory: {e}")))?;
    let config_dir = transcript::config_dir();
    let mut transcript = match (&args.session_id, &args.resume) {
        (new_id, Some(id)) if args.fork_session => {
            let source = Transcript::at(&config_dir, &cwd, id);
            if !is_uuid(id) || !source.exists() {
                return Err(Refusal(format!(
                    "No conversation found with session ID: {id}"
                )));
            }
            let new_id = new_id
                .clone()
                .unwrap_or_else(cairn_runner::harness::new_session_id);
            let fork = Transcript::at(&config_dir, &cwd, &new_id);
            if fork.exists() {
                return Err(Refusal(format!(
                    "Error: Session ID {new_id} is already in use."
                )));
            }
            source.fork_to(&new_id).map_err(|e| {
                Refusal(format!(
                    "Error: cannot fork the transcript {}: {e}",
                    source.path.display()
                ))
            })?
        }
        (Some(id), _) => {
            let t = Transcript::at(&config_dir, &cwd, id);
            if t.exists() {
                return Err(Refusal(format!(
                    "Error: Session ID {id} is already in use."
                )));
            }
            t
        }
        (None, Some(id)) => {
            let t = Transcript::at(&config_dir, &cwd, id);
            if !is_uuid(id) || !t.exists() {
                return Err(Refusal(format!(
                    "No conversation found with session ID: {id}"
                )));
            }
            t
        }
        (None, None) => Transcript::at(&config_dir, &cwd, &cairn_runner::harness::new_session_id()),
    };
    let transcript_file = transcript.path.display().to_string();
    let write_error = |e: std::io::Error| {
        Refusal(format!(
            "Error: cannot write the transcript {transcript_file}: {e}"
        ))
    };
    transcript.append_user(&prompt).map_err(write_error)?;
    let session_id = transcript.session_id.clone();
    let out = Output {
        format,
        session_id: session_id.clone(),
        started: Instant::now(),
    };
    out.event(json!({
        "type": "system",
        "subtype": "init",
        "cwd": cwd.to_string_lossy(),
        "session_id": session_id,
        "tools": [],
        "mcp_servers": [],
        "model": "cairn-demo-agent",
        "permissionMode": "default",
        "apiKeySource": "none",
    }));

    let first_message = transcript
        .first_user_message()
        .ok()
        .flatten()
        .unwrap_or_default();
    let outcome_file = cairn_runner::run::outcome::path_from_env();
    let mut said = Vec::new();
    for directive in script::parse(&prompt) {
        match script::perform(&directive, &cwd, &first_message, &outcome_file) {
            Done::Said(text) => {
                out.assistant(&text);
                said.push(text);
            }
            Done::Asked(question) => {
                let text = format!("asked: {question}");
                out.assistant(&text);
                said.push(text);
            }
            Done::Failed(error) => {
                let _ = transcript.append_assistant(&format!("failed: {error}"));
                out.result(&error, true);
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    let summary = if said.is_empty() {
        "nothing to do: the message had no directives".to_owned()
    } else {
        said.join("; ")
    };
    transcript.append_assistant(&summary).map_err(write_error)?;
    out.result(&summary, false);
    Ok(ExitCode::SUCCESS)
}

/// What goes to stdout, per output format.
struct Output {
    format: Format,
    session_id: String,
    started: Instant,
}

impl Output {
    fn event(&self, event: Value) {
        if self.format == Format::StreamJson {
            println!("{event}");
        }
    }

    fn assistant(&self, text: &str) {
        self.event(json!({
            "type": "assistant",
            "message": transcript::assistant_message(text),
            "parent_tool_use_id": null,
            "session_id": self.session_id,
        }));
    }

    fn result(&self, text: &str, is_error: bool) {
        let result = json!({
            "type": "result",
            "subtype": if is_error { "error_during_execution" } else { "success" },
            "is_error": is_error,
            "duration_ms": self.started.elapsed().as_millis() as u64,
            "duration_api_ms": 0,
            "num_turns": 1,
            "result": text,
            "session_id": self.session_id,
            "total_cost_usd": 0,
            "usage": { "input_tokens": 0, "output_tokens": 0 },
        });
        match self.format {
            Format::StreamJson | Format::Json => println!("{result}"),
            Format::Text => println!("{text}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn flags_parse_like_claude_code() {
        let args = parse(&argv(&[
            "-p",
            "--output-format",
            "stream-json",
            "--verbose",
            "--resume",
            "abc",
            "--model",
            "x",
            "hello",
        ]))
        .map_err(|Refusal(t)| t)
        .unwrap();
        assert!(args.print && args.verbose);
        assert_eq!(args.format.as_deref(), Some("stream-json"));
        assert_eq!(args.resume.as_deref(), Some("abc"));
        assert_eq!(args.prompt.as_deref(), Some("hello"));
        let dashed = parse(&argv(&["-p", "--output-format=json", "--", "-v please"]))
            .map_err(|Refusal(t)| t)
            .unwrap();
        assert_eq!(
            (dashed.format.as_deref(), dashed.prompt.as_deref()),
            (Some("json"), Some("-v please"))
        );
        let Err(Refusal(unknown)) = parse(&argv(&["-p", "--bogus", "x"])) else {
            panic!("refused")
        };
        assert_eq!(unknown, "error: unknown option '--bogus'");
        let Err(Refusal(extra)) = parse(&argv(&["-p", "a", "b"])) else {
            panic!("refused")
        };
        assert_eq!(
            extra,
            "error: too many arguments. Expected 1 argument but got 2."
        );
        let Err(Refusal(missing)) = parse(&argv(&["-p", "--resume"])) else {
            panic!("refused")
        };
        assert_eq!(missing, "error: option '--resume <value>' argument missing");
    }

    #[test]
    fn fork_session_needs_resume_and_may_name_the_new_session() {
        let args = parse(&argv(&["-p", "--resume", "a", "--fork-session", "go"]))
            .map_err(|Refusal(t)| t)
            .unwrap();
        assert!(args.fork_session);
        let Err(Refusal(alone)) = run(&argv(&["-p", "--fork-session", "go"])) else {
            panic!("refused")
        };
        assert!(alone.contains("--fork-session can only be used"), "{alone}");
    }
}
