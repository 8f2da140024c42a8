//! What the contract tests share: finding the installed CLIs, the provider
//! stub, a workspace with the adapter under test, one turn run the way the
//! runner runs it, and a restore through cairn.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_e2e::{Client, Coordinator, block_on, git, tempdir};
use cairn_proto::pb;
use cairn_runner::harness::{Harness, TurnExit, TurnRequest, from_spec, spawn_turn};
use serde_json::Value;
use tempfile::TempDir;

/// How long one turn of a real CLI may take against the local stub.
const TURN_TIMEOUT: Duration = Duration::from_secs(180);

/// The directory of the installed CLIs (with `bin/`), or a panic saying how
/// to install them.
pub fn clis_dir() -> PathBuf {
    let dir = match std::env::var_os("CAIRN_REAL_CLIS").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .unwrap_or_else(|| PathBuf::from("/nonexistent"));
            cache.join("cairn/clis/current")
        }
    };
    if !dir.join("bin").is_dir() {
        panic!(
            "the contract tests run the real agent CLIs, and none are installed at {}: run \
             `scripts/install-clis` (needs npm and Python; it prints the directory to put in \
             CAIRN_REAL_CLIS), or `scripts/test`, which does",
            dir.display()
        );
    }
    dir
}

/// The real CLIs this tier runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RealCli {
    Claude,
    Codex,
    Gemini,
    Opencode,
    Pi,
    Aider,
    OpenHands,
}

impl RealCli {
    pub fn name(self) -> &'static str {
        match self {
            Self::Claude => "claude",
            Self::Codex => "codex",
            Self::Gemini => "gemini",
            Self::Opencode => "opencode",
            Self::Pi => "pi",
            Self::Aider => "aider",
            Self::OpenHands => "openhands",
        }
    }

    /// The adapter's settings besides `binary` and `credentials_dir`.
    pub fn settings(self) -> Vec<(&'static str, &'static str)> {
        match self {
            Self::Claude | Self::Codex => vec![],
            // A named model: "auto" first asks a router model for a choice.
            Self::Gemini => vec![("model", "gemini-2.5-flash")],
            Self::Opencode => vec![("model", "stub/stub-model")],
            Self::Pi => vec![("model", "stub-model"), ("args", "--provider stub")],
            Self::Aider => vec![
                ("model", "openai/stub-model"),
                (
                    "args",
                    "--no-check-update --analytics-disable --no-show-model-warnings \
                     --no-auto-commits",
                ),
            ],
            // No settings file: the model and provider come from LLM_*.
            Self::OpenHands => vec![("args", "--override-with-envs")],
        }
    }

    /// Files the user's credentials directory holds.
    fn credentials(self) -> Vec<(&'static str, &'static str)> {
        match self {
            // Gemini reads its key from `$GEMINI_CLI_HOME/.gemini/.env`.
            Self::Gemini => vec![(".env", "GEMINI_API_KEY=sk-contract\n")],
            Self::Aider => vec![(".env", "OPENAI_API_KEY=sk-contract\n")],
            _ => vec![],
        }
    }

    /// Variables every turn gets (the sandbox's environment would).
    pub fn env(self, stub: &Stub, home: Option<&Path>) -> Vec<(String, String)> {
        let url = stub.url();
        let mut env: Vec<(String, String)> = home
            .map(|home| ("HOME".to_owned(), home.display().to_string()))
            .into_iter()
            .collect();
        let add = |env: &mut Vec<(String, String)>, k: &str, v: String| env.push((k.into(), v));
        match self {
            Self::Claude => {
                add(&mut env, "ANTHROPIC_BASE_URL", url);
                add(&mut env, "ANTHROPIC_API_KEY", "sk-contract".into());
                add(&mut env, "CLAUDE_CODE_MAX_RETRIES", "0".into());
                add(&mut env, "DISABLE_AUTOUPDATER", "1".into());
                add(
                    &mut env,
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
                    "1".into(),
                );
            }
            Self::Codex => add(&mut env, "OPENAI_API_KEY", "sk-contract".into()),
            Self::Gemini => add(&mut env, "GOOGLE_GEMINI_BASE_URL", url),
            Self::Opencode => add(&mut env, "OPENCODE_DISABLE_AUTOUPDATE", "1".into()),
            Self::Pi => {}
            Self::Aider => {
                add(&mut env, "OPENAI_API_BASE", format!("{url}/v1"));
                add(&mut env, "LITELLM_LOCAL_MODEL_COST_MAP", "True".into());
            }
            Self::OpenHands => {
                add(&mut env, "LLM_MODEL", "openai/stub-model".into());
                add(&mut env, "LLM_BASE_URL", format!("{url}/v1"));
                add(&mut env, "LLM_API_KEY", "sk-contract".into());
                add(&mut env, "LITELLM_LOCAL_MODEL_COST_MAP", "True".into());
            }
        }
        env
    }

    /// Provider configuration the CLI reads from its state directory
    /// (written after the adapter prepared it).
    pub fn configure(self, state: &Path, stub: &Stub) {
        let url = stub.url();
        let write = |path: PathBuf, text: String| {
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        };
        match self {
            Self::Codex => write(
                state.join("config.toml"),
                format!(
                    "model = \"gpt-5\"\nmodel_provider = \"stub\"\n\n[model_providers.stub]\n\
                     name = \"stub\"\nbase_url = \"{url}/v1\"\nenv_key = \"OPENAI_API_KEY\"\n\
                     wire_api = \"responses\"\n"
                ),
            ),
            Self::Opencode => write(
                state.join("config/opencode/opencode.json"),
                serde_json::json!({
                    "$schema": "https://opencode.ai/config.json",
                    "provider": {"stub": {
                        "npm": "@ai-sdk/openai-compatible",
                        "name": "stub",
                        "options": {"baseURL": format!("{url}/v1"), "apiKey": "sk-contract"},
                        "models": {"stub-model": {"name": "stub-model"}}
                    }}
                })
                .to_string(),
            ),
            Self::Pi => write(
                state.join("models.json"),
                serde_json::json!({"providers": {"stub": {
                    "baseUrl": format!("{url}/v1"),
                    "api": "openai-completions",
                    "apiKey": "sk-contract",
                    "models": [{
                        "id": "stub-model", "name": "stub", "reasoning": false, "input": ["text"],
                        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                        "contextWindow": 128000, "maxTokens": 4096
                    }]
                }}})
                .to_string(),
            ),
            Self::Claude | Self::Gemini | Self::Aider | Self::OpenHands => {}
        }
    }

    /// The help texts that must list the adapter's flags.
    fn help_commands(self) -> Vec<Vec<&'static str>> {
        match self {
            Self::Codex => vec![
                vec!["exec", "--help"],
                vec!["exec", "resume", "--help"],
                vec!["exec", "fork", "--help"],
            ],
            Self::Opencode => vec![vec!["run", "--help"]],
            _ => vec![vec!["--help"]],
        }
    }
}

/// `tests/stubs/provider_api.py`, answering every provider API with a
/// streamed reply; killed on drop.
pub struct Stub {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Stub {
    /// Answers with `answer`; with `hold`, the first model call waits until
    /// that file exists.
    pub fn start(dir: &Path, answer: &str, hold: Option<&Path>) -> Self {
        let port_file = dir.join("stub.port");
        let log = dir.join("stub-requests");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("stubs/provider_api.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg("--port-file")
            .arg(&port_file)
            .arg("--log-dir")
            .arg(&log)
            .args(["--mode", "reply", "--text", answer])
            .args(hold.iter().flat_map(|h| [Path::new("--hold-first"), h]))
            .stdin(Stdio::null())
            .spawn()
            .expect("python3 runs the provider stub");
        let deadline = Instant::now() + Duration::from_secs(20);
        let port = loop {
            if let Ok(text) = fs::read_to_string(&port_file)
                && let Ok(port) = text.trim().parse()
            {
                break port;
            }
            if let Some(status) = child.try_wait().unwrap() {
                panic!("the provider stub exited ({status}) before it listened");
            }
            assert!(Instant::now() < deadline, "the provider stub did not start");
            std::thread::sleep(Duration::from_millis(20));
        };
        Self { child, port, log }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every request so far, in order.
    pub fn requests(&self) -> Vec<Value> {
        let mut names: Vec<PathBuf> = fs::read_dir(&self.log)
            .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_default();
        names.sort();
        names
            .iter()
            .filter_map(|p| serde_json::from_slice(&fs::read(p).ok()?).ok())
            .collect()
    }
}

impl Drop for Stub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One turn's end.
pub struct Turn {
    pub exit: TurnExit,
}

impl Turn {
    pub fn describe(&self) -> String {
        format!(
            "{:?}; observed {:?}; last stdout {:?}; stderr tail:\n{}",
            self.exit.status,
            self.exit.observed,
            self.exit.last_stdout,
            self.exit.stderr_tail.join("\n")
        )
    }

    #[track_caller]
    pub fn assert_succeeded(&self, what: &str) {
        assert!(
            self.exit.status.success() && self.exit.observed.error.is_none(),
            "{what} failed: {}",
            self.describe()
        );
    }

    #[track_caller]
    pub fn session(&self, what: &str) -> String {
        self.exit
            .observed
            .session_id
            .clone()
            .unwrap_or_else(|| panic!("{what} reported no session id: {}", self.describe()))
    }

    /// The turn's answer as the runner would record it.
    pub fn summary(&self) -> String {
        self.exit
            .observed
            .summary
            .clone()
            .or_else(|| self.exit.last_stdout.clone())
            .unwrap_or_default()
            .trim()
            .to_owned()
    }
}

/// A workspace with one CLI's adapter, its provider stub, and a coordinator
/// to checkpoint and restore it through.
pub struct Contract {
    pub cli: RealCli,
    pub harness: Arc<dyn Harness>,
    binary: PathBuf,
    _tmp: TempDir,
    root: PathBuf,
    cwd: PathBuf,
    home: PathBuf,
    stub: Stub,
    answer: String,
    coordinator: Coordinator,
    client: Client,
    workspace: String,
}

impl Contract {
    pub fn new(cli: RealCli) -> Self {
        let clis = clis_dir();
        let binary = clis.join("bin").join(cli.name());
        assert!(binary.exists(), "{} is not installed", binary.display());
        let tmp = tempdir(&format!("contract-{}", cli.name()));
        let root = tmp.path().join("workspace");
        let cwd = root.join("app");
        fs::create_dir_all(&cwd).unwrap();
        git(&cwd, &["init", "-q"]);
        fs::write(cwd.join("README.md"), "# app\n").unwrap();
        git(&cwd, &["add", "README.md"]);
        git(&cwd, &["commit", "-q", "-m", "first"]);
        let home = tmp.path().join("home");
        let credentials = tmp.path().join("credentials");
        fs::create_dir_all(&home).unwrap();
        fs::create_dir_all(&credentials).unwrap();
        for (file, content) in cli.credentials() {
            fs::write(credentials.join(file), content).unwrap();
        }
        let answer = format!("STUB-ANSWER-{}", cli.name().to_uppercase());
        let stub = Stub::start(tmp.path(), &answer, None);

        let mut config: BTreeMap<String, String> = cli
            .settings()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        config.insert("binary".into(), binary.display().to_string());
        config.insert("credentials_dir".into(), credentials.display().to_string());
        let spec = pb::HarnessSpec {
            name: cli.name().into(),
            config: config.into_iter().collect(),
        };
        let harness = from_spec(&spec, &root).expect("the adapter accepts its settings");
        harness
            .prepare()
            .expect("the adapter prepares the workspace");
        cli.configure(&root.join(".cairn/state").join(cli.name()), &stub);

        let coordinator = Coordinator::start();
        let workspace = coordinator.create_workspace(&format!("contract-{}", cli.name()));
        let client = coordinator.client();
        Self {
            cli,
            harness,
            binary,
            _tmp: tmp,
            root,
            cwd,
            home,
            stub,
            answer,
            coordinator,
            client,
            workspace,
        }
    }

    pub fn answer(&self) -> String {
        self.answer.clone()
    }

    /// Every `--flag` the adapter passes, for a start, a resume and (if it
    /// forks) a fork, is listed by the CLI's own help.
    pub fn flags_exist(&self) {
        let mut help = String::new();
        for args in self.cli.help_commands() {
            let out = Command::new(&self.binary)
                .args(&args)
                .env("HOME", &self.home)
                .stdin(Stdio::null())
                .output()
                .expect("the CLI runs");
            help.push_str(&String::from_utf8_lossy(&out.stdout));
            help.push_str(&String::from_utf8_lossy(&out.stderr));
        }
        let mut requests = vec![
            TurnRequest::Start {
                message: "m".into(),
            },
            TurnRequest::Resume {
                session_id: "0f0e0d0c-0b0a-4908-8706-050403020100".into(),
                message: "m".into(),
                fork: false,
            },
        ];
        if self.harness.can_fork() {
            requests.push(TurnRequest::Resume {
                session_id: "0f0e0d0c-0b0a-4908-8706-050403020100".into(),
                message: "m".into(),
                fork: true,
            });
        }
        if !self.harness.can_resume() {
            requests.truncate(1);
        }
        for request in requests {
            let command = self.harness.command(&request, &self.cwd).unwrap();
            for arg in &command.args {
                let Some(flag) = arg.strip_prefix("--").map(|f| f.split('=').next().unwrap())
                else {
                    continue;
                };
                let flag = format!("--{flag}");
                let listed = help.match_indices(&flag).any(|(at, _)| {
                    let after = help[at + flag.len()..].chars().next();
                    !after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
                });
                assert!(
                    listed,
                    "{} {} passes {flag}, which `{} {}` does not list:\n{help}",
                    self.cli.name(),
                    request_kind(&request),
                    self.cli.name(),
                    self.cli.help_commands()[0].join(" ")
                );
            }
        }
    }

    /// Runs one turn as the runner does (the adapter's command line, the
    /// adapter reading the output), in the workspace's app directory.
    pub fn turn(&self, request: TurnRequest) -> Turn {
        let mut command = self.harness.command(&request, &self.cwd).unwrap();
        command
            .env
            .extend(self.cli.env(&self.stub, Some(&self.home)));
        let harness = self.harness.clone();
        let exit = block_on(async move {
            let (mut running, _events) = spawn_turn(harness, command).expect("the CLI starts");
            match tokio::time::timeout(TURN_TIMEOUT, running.finished()).await {
                Ok(exit) => Ok(exit),
                Err(_) => Err(running.stop(Duration::from_secs(5)).await),
            }
        });
        match exit {
            Ok(exit) => Turn { exit },
            Err(exit) => panic!(
                "{} {} did not end within {TURN_TIMEOUT:?}: {}",
                self.cli.name(),
                request_kind(&request),
                Turn { exit }.describe()
            ),
        }
    }

    /// The conversation is where the adapter pointed the CLI.
    pub fn assert_state_holds(&self, session: &str) {
        let state = self.root.join(".cairn/state").join(self.cli.name());
        let files = files_under(&state);
        let found = match self.cli {
            RealCli::Claude => {
                let real = fs::canonicalize(&self.cwd).unwrap();
                let slug: String = real
                    .to_string_lossy()
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                    .collect();
                files.iter().any(|f| {
                    f == &state
                        .join("projects")
                        .join(&slug)
                        .join(format!("{session}.jsonl"))
                })
            }
            RealCli::Codex => files.iter().any(|f| {
                f.starts_with(state.join("sessions"))
                    && f.to_string_lossy().ends_with(&format!("-{session}.jsonl"))
            }),
            RealCli::Gemini => files.iter().any(|f| {
                f.to_string_lossy().contains("/.gemini/tmp/")
                    && f.to_string_lossy()
                        .ends_with(&format!("-{}.jsonl", &session[..8]))
            }),
            RealCli::Opencode => files
                .iter()
                .any(|f| f == &state.join("data/opencode/opencode.db")),
            RealCli::Pi => files.iter().any(|f| {
                f.starts_with(state.join("sessions"))
                    && fs::read_to_string(f).is_ok_and(|t| {
                        t.lines()
                            .next()
                            .and_then(|l| serde_json::from_str::<Value>(l).ok())
                            .is_some_and(|h| h["id"] == session)
                    })
            }),
            RealCli::Aider => fs::read_to_string(state.join(".aider.chat.history.md"))
                .is_ok_and(|t| t.contains("HERON-4471")),
            RealCli::OpenHands => files
                .iter()
                .any(|f| f.starts_with(state.join("conversations").join(session).join("events"))),
        };
        assert!(
            found,
            "{}'s conversation {session:?} is not where the adapter expects it under {}: {files:#?}",
            self.cli.name(),
            state.display()
        );
    }

    /// Checkpoints the workspace through cairn, wipes it, restores it at the
    /// same path (as a sandbox on another host would), and prepares the
    /// adapter again (fresh credentials).
    pub fn restore_elsewhere(&self) {
        self.client.checkpoint(&self.root, &self.workspace);
        fs::remove_dir_all(&self.root).unwrap();
        self.client.restore(&self.root, &self.workspace);
        self.harness
            .prepare()
            .expect("the adapter prepares the restored workspace");
        let _ = &self.coordinator;
    }

    /// The provider's last request (a model call) carried `word`.
    /// (See also [`last_model_call`].)
    #[track_caller]
    pub fn assert_last_request_mentions(&self, word: &str, what: &str) {
        let requests = self.stub.requests();
        let last = requests
            .iter()
            .rev()
            .find(|r| r["method"] == "POST")
            .unwrap_or_else(|| panic!("{what}: the provider got no request"));
        let body = last["body"].to_string();
        assert!(
            body.contains(word),
            "{what}: the provider was not sent the first turn's words ({word}): {}",
            &body[..body.len().min(3000)]
        );
    }
}

fn request_kind(request: &TurnRequest) -> &'static str {
    match request {
        TurnRequest::Start { .. } => "start",
        TurnRequest::Resume { fork: false, .. } => "resume",
        TurnRequest::Resume { fork: true, .. } => "fork",
    }
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            match entry.file_type() {
                Ok(t) if t.is_dir() => stack.push(path),
                Ok(_) => out.push(path),
                Err(_) => {}
            }
        }
    }
    out.sort();
    out
}

/// The body of the provider's last model call (POST), as JSON text.
pub fn last_model_call(stub: &Stub) -> Option<String> {
    stub.requests()
        .iter()
        .rev()
        .find(|r| r["method"] == "POST")
        .map(|r| r["body"].to_string())
}
