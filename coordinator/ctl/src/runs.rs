//! `cairnctl runs create|list|show|events|answer|suspend|cancel`: asking for
//! agent work on a workspace and following it across attempts and hosts
//! (`runs watch` is [`super::watch`]).

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use cairn_engine::client::{AuthChannel, CoordinatorClient, MAX_MESSAGE_BYTES};
use cairn_proto::pb;
use cairn_proto::pb::run_service_client::RunServiceClient;
use cairn_proto::runs::{CheckpointLimits, Labels, RunState, to_proto_duration};
use futures::StreamExt as _;
use serde_json::Value;

use super::output::{self, time_of};
use super::{Output, emit, print_document, print_stream_item, rpc_error};

/// `runs create`: what to run, where, and how.
#[derive(Debug, clap::Args)]
#[command(group(
    clap::ArgGroup::new("target")
        .required(true)
        .args(["workspace", "new_workspace"]),
))]
pub struct CreateArgs {
    /// Workspace id or name to run on.
    #[arg(long)]
    pub workspace: Option<String>,
    /// Run on a new workspace (named with --name).
    #[arg(long)]
    pub new_workspace: bool,
    /// Name of the new workspace (letters, digits, '-', '_', '.').
    #[arg(long, conflicts_with = "workspace")]
    pub name: Option<String>,
    /// Harness adapter: claude, codex, gemini, pi, opencode, goose, openhands,
    /// aider or command (docs/harnesses.md).
    #[arg(long)]
    pub harness: String,
    /// Harness setting, e.g. binary=/usr/local/bin/claude (repeatable).
    #[arg(long = "harness-config", value_name = "KEY=VALUE", value_parser = parse_setting)]
    pub harness_config: Vec<(String, String)>,
    /// The task for the agent.
    #[arg(long)]
    pub prompt: String,
    /// The task's stage (implement, review, …); each station keeps its own
    /// conversation (default "default").
    #[arg(long)]
    pub station: Option<String>,
    /// Placement label the host must have, k=v (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// How long a sandbox waiting for an answer is held warm (e.g. 90s, 5m).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub hold: Option<Duration>,
    /// Attempts before the run fails on infrastructure errors (default 3).
    #[arg(long, value_name = "N")]
    pub max_attempts: Option<u32>,
    /// Repository cloned into /workspace/NAME when the workspace has no
    /// checkpoint yet: name=url[@branch] (repeatable).
    #[arg(long = "repo", value_name = "NAME=URL[@BRANCH]", value_parser = parse_repo)]
    pub repos: Vec<RepoArg>,
    /// Sandbox image, for drivers that use one (exec templates).
    #[arg(long)]
    pub image: Option<String>,
    /// Periodic checkpoints while something changed (e.g. 10m).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub checkpoint_interval: Option<Duration>,
    /// Leave out of this run's checkpoints any file larger than SIZE (e.g.
    /// 512MiB), with a warning on the checkpoint. The runner keeps the
    /// stricter of this and its own --max-file-size.
    #[arg(long, value_name = "SIZE", value_parser = parse_limit)]
    pub max_file_size: Option<u64>,
    /// Keep at most SIZE of file contents per checkpoint of this run; above
    /// it the largest files are left out, each with a warning. The runner
    /// keeps the stricter of this and its own --max-total-size.
    #[arg(long, value_name = "SIZE", value_parser = parse_limit)]
    pub max_total_size: Option<u64>,
    /// Lay a file for this run's station before the harness starts: the
    /// content of the local file LOCALFILE at PATH, relative to the workspace
    /// (a skill, a harness profile file). The next run removes it again
    /// (repeatable; docs/stations.md).
    #[arg(long = "lay", value_name = "PATH=LOCALFILE", value_parser = parse_lay)]
    pub lay: Vec<LayArg>,
}

/// A `--lay PATH=LOCALFILE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayArg {
    /// Where in the workspace.
    pub path: String,
    /// The local file whose content is laid.
    pub local: std::path::PathBuf,
}

/// `PATH=LOCALFILE`, the workspace path checked like the coordinator checks it.
pub fn parse_lay(text: &str) -> Result<LayArg, String> {
    let (path, local) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not PATH=LOCALFILE"))?;
    let path = path.trim();
    cairn_proto::stations::validate_lay_path(path).map_err(|e| e.reason)?;
    if local.is_empty() {
        return Err(format!("{text:?} names no local file (PATH=LOCALFILE)"));
    }
    Ok(LayArg {
        path: path.to_owned(),
        local: local.into(),
    })
}

/// A `--repo name=url[@branch]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoArg {
    pub name: String,
    pub url: String,
    pub branch: String,
}

/// `KEY=VALUE` of a harness setting (the value may hold `=` and commas).
pub fn parse_setting(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.trim().is_empty() => {
            Ok((key.trim().to_owned(), value.to_owned()))
        }
        _ => Err(format!("{text:?} is not KEY=VALUE")),
    }
}

/// `k=v` of a placement label, checked like the coordinator checks labels.
pub fn parse_label(text: &str) -> Result<(String, String), String> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not k=v"))?;
    let labels = Labels::from_map([(key.trim().to_owned(), value.trim().to_owned())])
        .map_err(|e| e.reason)?;
    Ok(labels.0.into_iter().next().expect("one label was given"))
}

/// `name=url[@branch]`. A URL may itself hold `@` (`git@host:org/app.git`,
/// `https://user@host/app.git`), so the text after the last `@` is a branch
/// only if what comes before it is still a whole repository address and the
/// branch could be a git ref name.
pub fn parse_repo(text: &str) -> Result<RepoArg, String> {
    let (name, rest) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not name=url[@branch]"))?;
    let name = name.trim();
    if name.is_empty() {
        return Err(format!("{text:?} names no repository (name=url[@branch])"));
    }
    let rest = rest.trim();
    let (url, branch) = match rest.rsplit_once('@') {
        Some((url, branch)) if is_repo_address(url) && is_ref_name(branch) => (url, branch),
        _ => (rest, ""),
    };
    if url.is_empty() {
        return Err(format!("{text:?} has no url (name=url[@branch])"));
    }
    Ok(RepoArg {
        name: name.to_owned(),
        url: url.to_owned(),
        branch: branch.to_owned(),
    })
}

fn is_repo_address(url: &str) -> bool {
    if let Some((_, after_scheme)) = url.split_once("://") {
        return after_scheme.trim_start_matches('/').contains('/') || url.starts_with("file://");
    }
    url.starts_with('/') || url.starts_with('.') || url.contains(':')
}

fn is_ref_name(branch: &str) -> bool {
    !branch.is_empty()
        && !branch.starts_with(['-', '/'])
        && !branch.contains("..")
        && !branch
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, ':' | '~' | '^' | '?' | '*' | '[' | '\\'))
}

impl CreateArgs {
    /// The request; repeated label keys with different values are refused.
    pub fn into_request(self) -> anyhow::Result<pb::CreateRunRequest> {
        let mut labels = HashMap::new();
        for (key, value) in self.labels {
            if let Some(earlier) = labels.insert(key.clone(), value.clone())
                && earlier != value
            {
                anyhow::bail!("--label {key} is given twice ({earlier} and {value})");
            }
        }
        let mut config = HashMap::new();
        for (key, value) in self.harness_config {
            if config.insert(key.clone(), value).is_some() {
                anyhow::bail!("--harness-config {key} is given twice");
            }
        }
        let mut lay = HashMap::new();
        for arg in self.lay {
            let content = std::fs::read(&arg.local).with_context(|| {
                format!("--lay {}: cannot read {}", arg.path, arg.local.display())
            })?;
            if lay.insert(arg.path.clone(), content).is_some() {
                anyhow::bail!("--lay {} is given twice", arg.path);
            }
        }
        let target = match (self.workspace, self.new_workspace) {
            (Some(workspace), _) => pb::create_run_request::Target::Workspace(workspace),
            (None, _) => pb::create_run_request::Target::NewWorkspace(pb::NewWorkspace {
                name: self.name.unwrap_or_default(),
            }),
        };
        Ok(pb::CreateRunRequest {
            target: Some(target),
            station: self.station.unwrap_or_default(),
            harness: Some(pb::HarnessSpec {
                name: self.harness,
                config,
            }),
            prompt: self.prompt,
            labels,
            hold: self.hold.map(to_proto_duration),
            max_attempts: self.max_attempts.unwrap_or(0),
            repos: self
                .repos
                .into_iter()
                .map(|r| pb::RepoSpec {
                    name: r.name,
                    url: r.url,
                    branch: r.branch,
                })
                .collect(),
            image: self.image.unwrap_or_default(),
            checkpoint_interval: self.checkpoint_interval.map(to_proto_duration),
            checkpoint_limits: Some(
                CheckpointLimits {
                    max_file_bytes: self.max_file_size,
                    max_total_bytes: self.max_total_size,
                }
                .into(),
            ),
            lay,
        })
    }
}

/// A RunService client on the coordinator's connection.
pub fn client(coordinator: &CoordinatorClient) -> RunServiceClient<AuthChannel> {
    RunServiceClient::new(coordinator.auth_channel())
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

pub async fn create(
    coordinator: &CoordinatorClient,
    args: CreateArgs,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let request = args.into_request()?;
    let run = client(coordinator)
        .create_run(request)
        .await
        .map_err(rpc_error("creating the run"))?
        .into_inner();
    match out {
        Output::Json | Output::Yaml => print_document(out, &output::run_json(&run))?,
        Output::Table | Output::Wide => emit(&format!(
            "created run {} on workspace {}: {}",
            run.id,
            run.workspace_id,
            state_with_reason(&run)
        ))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `queued (no ready host has labels gpu=a100)`.
pub fn state_with_reason(run: &pb::Run) -> String {
    let state = output::run_state(run.state);
    if run.state_reason.trim().is_empty() {
        state.to_owned()
    } else {
        format!("{state} ({})", run.state_reason)
    }
}

/// Which runs `runs list` and `runs watch` show.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RunFilter {
    /// Only runs on this workspace (id or name).
    #[arg(long)]
    pub workspace: Option<String>,
    /// Only runs in this state (queued, assigned, starting, running,
    /// waiting, suspended, succeeded, failed, cancelled).
    #[arg(long, value_parser = super::parse_run_state)]
    pub state: Option<RunState>,
}

/// Every run `filter` lets through, newest first, across pages.
pub async fn fetch(
    client: &mut RunServiceClient<AuthChannel>,
    filter: &RunFilter,
) -> anyhow::Result<Vec<pb::Run>> {
    let mut runs = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_runs(pb::ListRunsRequest {
                workspace: filter.workspace.clone().unwrap_or_default(),
                state: filter
                    .state
                    .map_or(pb::RunState::Unspecified, pb::RunState::from)
                    as i32,
                page_size: 500,
                page_token: page_token.clone(),
            })
            .await
            .map_err(rpc_error("listing runs"))?
            .into_inner();
        runs.extend(page.runs);
        if page.next_page_token.is_empty() || page.next_page_token == page_token {
            break;
        }
        page_token = page.next_page_token;
    }
    Ok(runs)
}

pub async fn list(
    coordinator: &CoordinatorClient,
    filter: &RunFilter,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let runs = fetch(&mut client(coordinator), filter).await?;
    match out {
        Output::Json | Output::Yaml => print_document(
            out,
            &Value::Array(runs.iter().map(output::run_json).collect()),
        )?,
        Output::Table | Output::Wide => emit(&runs_table(&runs, out.is_wide()))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// One row per run: where it is, on which host, how old its workspace's
/// newest checkpoint is and what its sandbox holds that no checkpoint has
/// (the work losing the sandbox would lose), and why.
/// `wide` adds the current attempt's generation, the run's labels, its last
/// checkpoint and when it last changed, and gives the reason uncut.
pub fn runs_table(runs: &[pb::Run], wide: bool) -> String {
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            let attempt = output::current_attempt(r);
            let mut row = vec![
                r.id.clone(),
                output::run_state(r.state).to_owned(),
                r.workspace_id.clone(),
                r.station.clone(),
                r.harness
                    .as_ref()
                    .map_or_else(|| "-".into(), |h| h.name.clone()),
                r.attempts.len().to_string(),
                attempt.map_or_else(|| "-".into(), |a| output::or_dash(&a.host_id)),
                output::age(time_of!(r.workspace_checkpointed_at)),
                output::at_risk(attempt),
                output::age(time_of!(r.created_at)),
            ];
            if wide {
                row.extend([
                    attempt.map_or_else(|| "-".into(), |a| a.generation.to_string()),
                    output::pairs(&r.labels),
                    output::or_dash(&r.last_checkpoint_id),
                    output::age(time_of!(r.updated_at)),
                    output::or_dash(&r.state_reason.replace('\n', " ")),
                ]);
            } else {
                row.push(output::first_line(&r.state_reason, 60));
            }
            row
        })
        .collect();
    let mut headers = vec![
        "ID",
        "STATE",
        "WORKSPACE",
        "STATION",
        "HARNESS",
        "ATTEMPTS",
        "HOST",
        "CHECKPOINTED",
        "AT RISK",
        "CREATED",
    ];
    if wide {
        headers.extend(["GEN", "LABELS", "LAST CHECKPOINT", "UPDATED"]);
    }
    headers.push("WHY");
    output::table(&headers, &rows)
}

/// What the live attempt's sandbox holds that no checkpoint has, and
/// when its runner counted it.
fn at_risk_details(run: &pb::Run) -> String {
    let attempt = output::current_attempt(run);
    let text = output::at_risk(attempt);
    let counted = attempt
        .and_then(|a| a.unsaved.as_ref())
        .and_then(|u| time_of!(u.reported_at));
    match counted {
        Some(at) if text != "-" => format!(
            "{text} in no checkpoint (counted {})",
            cairn_utils::text::human_age(at)
        ),
        _ => text,
    }
}

pub async fn show(
    coordinator: &CoordinatorClient,
    run: &str,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let run = client(coordinator)
        .get_run(pb::GetRunRequest {
            run_id: run.to_owned(),
        })
        .await
        .map_err(rpc_error("showing the run"))?
        .into_inner();
    match out {
        Output::Json | Output::Yaml => print_document(out, &output::run_json(&run))?,
        Output::Table | Output::Wide => emit(&run_details(&run, out.is_wide()))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `runs show`: the run's settings and state, then its attempts (`wide`:
/// with their sandboxes, restored checkpoints and end times).
pub fn run_details(run: &pb::Run, wide: bool) -> String {
    let harness = run.harness.clone().unwrap_or_default();
    let harness_text = if harness.config.is_empty() {
        harness.name.clone()
    } else {
        format!("{} ({})", harness.name, output::pairs(&harness.config))
    };
    let repos = if run.repos.is_empty() {
        "-".to_owned()
    } else {
        run.repos
            .iter()
            .map(|r| {
                if r.branch.is_empty() {
                    format!("{}={}", r.name, r.url)
                } else {
                    format!("{}={}@{}", r.name, r.url, r.branch)
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut pairs = vec![
        ("id", run.id.clone()),
        ("workspace", run.workspace_id.clone()),
        ("station", output::or_dash(&run.station)),
        ("state", output::run_state(run.state).to_owned()),
        ("why", output::or_dash(&run.state_reason)),
        ("harness", harness_text),
        ("prompt", output::first_line(&run.prompt, 80)),
        ("labels", output::pairs(&run.labels)),
        (
            "hold",
            output::human_duration(output::duration(run.hold.as_ref())),
        ),
    ];
    if run.hold_until.is_some() {
        pairs.push(("hold until", output::when(time_of!(run.hold_until))));
    }
    pairs.extend([
        ("max attempts", run.max_attempts.to_string()),
        (
            "checkpoint every",
            output::human_duration(output::duration(run.checkpoint_interval.as_ref())),
        ),
        (
            "checkpoint limits",
            limits_text(run.checkpoint_limits.unwrap_or_default().into()),
        ),
        ("repos", repos),
        (
            "lays",
            if run.laid_paths.is_empty() {
                "-".to_owned()
            } else {
                run.laid_paths.join(", ")
            },
        ),
        ("question", output::or_dash(&run.question)),
        ("summary", output::or_dash(&run.summary)),
        ("session", output::or_dash(&run.harness_session_id)),
        ("last checkpoint", output::or_dash(&run.last_checkpoint_id)),
        (
            "workspace checkpointed",
            output::when(time_of!(run.workspace_checkpointed_at)),
        ),
        ("at risk", at_risk_details(run)),
        ("created", output::when(time_of!(run.created_at))),
        ("updated", output::when(time_of!(run.updated_at))),
    ]);
    let mut text = output::key_values(&pairs);
    text.push_str("\n\nattempts\n");
    if run.attempts.is_empty() {
        text.push_str("  none yet");
    } else {
        text.push_str(&attempts_table(&run.attempts, wide));
    }
    text
}

/// A run's own checkpoint limits, for people.
fn limits_text(limits: CheckpointLimits) -> String {
    let mut parts = Vec::new();
    if let Some(bytes) = limits.max_file_bytes {
        parts.push(format!("files up to {}", output::bytes(bytes)));
    }
    if let Some(bytes) = limits.max_total_bytes {
        parts.push(format!("{} in all", output::bytes(bytes)));
    }
    if parts.is_empty() {
        "- (the runner's own)".to_owned()
    } else {
        parts.join(", ")
    }
}

/// A size limit: like the runner's sizes, and more than nothing (0 would
/// leave out every file that is not empty).
fn parse_limit(text: &str) -> Result<u64, String> {
    match cairn_proto::size::parse_size(text)? {
        0 => Err(format!(
            "{text:?}: a limit of 0 bytes would leave out every file"
        )),
        bytes => Ok(bytes),
    }
}

fn attempts_table(attempts: &[pb::Attempt], wide: bool) -> String {
    let rows: Vec<Vec<String>> = attempts
        .iter()
        .map(|a| {
            let mut row = vec![
                a.number.to_string(),
                a.generation.to_string(),
                output::or_dash(&a.host_id),
                output::attempt_state(a.state).to_owned(),
                output::age(time_of!(a.started_at)),
            ];
            if wide {
                row.extend([
                    output::age(time_of!(a.ended_at)),
                    output::or_dash(&a.sandbox_id),
                    output::or_dash(&a.restored_checkpoint_id),
                ]);
            }
            row.extend([output::or_dash(&a.end_reason), output::or_dash(&a.prepare)]);
            row
        })
        .collect();
    let mut headers = vec!["#", "GEN", "HOST", "STATE", "STARTED"];
    if wide {
        headers.extend(["ENDED", "SANDBOX", "RESTORED"]);
    }
    headers.extend(["ENDED BECAUSE", "PREPARE"]);
    output::table(&headers, &rows)
}

pub async fn events(
    coordinator: &CoordinatorClient,
    run: &str,
    follow: bool,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut stream = client(coordinator)
        .watch_run_events(pb::WatchRunEventsRequest {
            run_id: run.to_owned(),
            after_sequence: 0,
            follow,
        })
        .await
        .map_err(rpc_error("watching the run's events"))?
        .into_inner();
    let mut collected = Vec::new();
    if !out.is_document() {
        emit(&output::event_header())?;
    }
    while let Some(event) = stream.next().await {
        let event = event.map_err(rpc_error("watching the run's events"))?;
        match (out, follow) {
            (Output::Table | Output::Wide, _) => emit(&output::event_line(&event))?,
            // Following never ends in one document: one item at a time.
            (Output::Json | Output::Yaml, true) => {
                print_stream_item(&output::event_json(&event), out)?
            }
            (Output::Json | Output::Yaml, false) => collected.push(output::event_json(&event)),
        }
    }
    if out.is_document() && !follow {
        print_document(out, &Value::Array(collected))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// What answer, suspend and cancel do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Answer,
    Suspend,
    Cancel,
}

pub async fn act(
    coordinator: &CoordinatorClient,
    action: Action,
    run: &str,
    text: String,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = client(coordinator);
    let run_id = run.to_owned();
    let (run, done) = match action {
        Action::Answer => (
            client
                .answer_run(pb::AnswerRunRequest { run_id, text })
                .await
                .map_err(rpc_error("answering the run"))?,
            "answered",
        ),
        Action::Suspend => (
            client
                .suspend_run(pb::SuspendRunRequest {
                    run_id,
                    reason: text,
                })
                .await
                .map_err(rpc_error("suspending the run"))?,
            "suspending",
        ),
        Action::Cancel => (
            client
                .cancel_run(pb::CancelRunRequest {
                    run_id,
                    reason: text,
                })
                .await
                .map_err(rpc_error("cancelling the run"))?,
            "cancelled",
        ),
    };
    let run = run.into_inner();
    match out {
        Output::Json | Output::Yaml => print_document(out, &output::run_json(&run))?,
        Output::Table | Output::Wide => emit(&format!(
            "{done} run {}: now {}",
            run.id,
            state_with_reason(&run)
        ))?,
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repositories_take_a_branch_only_after_a_whole_address() {
        let repo = |text| parse_repo(text).unwrap();
        assert_eq!(
            repo("app=https://example.com/org/app.git@main"),
            RepoArg {
                name: "app".into(),
                url: "https://example.com/org/app.git".into(),
                branch: "main".into()
            }
        );
        let scp = repo("app=git@github.com:org/app.git");
        assert_eq!(
            (scp.url.as_str(), scp.branch.as_str()),
            ("git@github.com:org/app.git", "")
        );
        let scp = repo("app=git@github.com:org/app.git@feature/x");
        assert_eq!(
            (scp.url.as_str(), scp.branch.as_str()),
            ("git@github.com:org/app.git", "feature/x")
        );
        let user = repo("app=https://user@example.com/app.git");
        assert_eq!(
            (user.url.as_str(), user.branch.as_str()),
            ("https://user@example.com/app.git", "")
        );
        assert_eq!(repo("lib=/srv/git/lib@dev").branch, "dev");
        assert!(parse_repo("https://example.com/app.git").is_err());
        assert!(parse_repo("=https://example.com/app.git").is_err());
        assert!(parse_repo("app=").is_err());
    }

    #[test]
    fn labels_and_settings_say_what_is_wrong() {
        assert_eq!(
            parse_label("gpu=a100").unwrap(),
            ("gpu".into(), "a100".into())
        );
        assert!(parse_label("gpu").unwrap_err().contains("is not k=v"));
        assert!(parse_label("bad key=x").unwrap_err().contains("label key"));
        assert_eq!(
            parse_setting("args=--model=x,y").unwrap(),
            ("args".into(), "--model=x,y".into())
        );
        assert!(parse_setting("=x").is_err());
    }

    fn args(extra: &[&str]) -> anyhow::Result<pb::CreateRunRequest> {
        use clap::Parser as _;
        let base = [
            "cairnctl",
            "runs",
            "create",
            "--harness",
            "claude",
            "--prompt",
            "p",
        ];
        let cli = super::super::Cli::try_parse_from(base.iter().chain(extra))?;
        match cli.command {
            super::super::Command::Runs(super::super::RunsCommand::Create(create)) => {
                create.into_request()
            }
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn a_run_request_carries_every_flag() {
        let request = args(&[
            "--new-workspace",
            "--name",
            "demo",
            "--harness-config",
            "binary=/opt/agent",
            "--label",
            "gpu=a100",
            "--label",
            "zone=eu",
            "--hold",
            "1m 30s",
            "--max-attempts",
            "5",
            "--station",
            "review",
            "--repo",
            "app=https://example.com/app.git@main",
        ])
        .unwrap();
        assert_eq!(
            request.target,
            Some(pb::create_run_request::Target::NewWorkspace(
                pb::NewWorkspace {
                    name: "demo".into()
                }
            ))
        );
        let harness = request.harness.unwrap();
        assert_eq!(harness.name, "claude");
        assert_eq!(harness.config["binary"], "/opt/agent");
        assert_eq!(request.labels.len(), 2);
        assert_eq!(request.hold.unwrap().seconds, 90);
        assert_eq!(request.max_attempts, 5);
        assert_eq!(request.station, "review");
        assert_eq!(request.repos[0].branch, "main");

        let request = args(&["--workspace", "ws-1"]).unwrap();
        assert_eq!(
            request.target,
            Some(pb::create_run_request::Target::Workspace("ws-1".into()))
        );
        assert_eq!(request.hold, None, "the coordinator's default applies");
    }

    #[test]
    fn laid_files_are_read_from_local_files() {
        let dir = tempfile::tempdir().unwrap();
        let skill = dir.path().join("SKILL.md");
        std::fs::write(&skill, "# review\n").unwrap();
        let lay = format!(
            ".cairn/state/claude/skills/review/SKILL.md={}",
            skill.display()
        );
        let request = args(&["--workspace", "w", "--lay", &lay]).unwrap();
        assert_eq!(
            request.lay[".cairn/state/claude/skills/review/SKILL.md"],
            b"# review\n"
        );
        let missing = format!("x.md={}", dir.path().join("nope").display());
        let err = args(&["--workspace", "w", "--lay", &missing]).unwrap_err();
        assert!(
            format!("{err:#}").starts_with("--lay x.md: cannot read "),
            "{err:#}"
        );
        let err = args(&["--workspace", "w", "--lay", "../x.md=/etc/hostname"]).unwrap_err();
        assert!(err.to_string().contains("leaves the workspace"), "{err}");
        let twice = format!("a.md={}", skill.display());
        let err = args(&["--workspace", "w", "--lay", &twice, "--lay", &twice]).unwrap_err();
        assert!(
            err.to_string().contains("--lay a.md is given twice"),
            "{err}"
        );
    }

    #[test]
    fn a_run_needs_exactly_one_target_and_consistent_labels() {
        assert!(args(&[]).is_err(), "no workspace");
        assert!(args(&["--workspace", "w", "--new-workspace"]).is_err());
        assert!(args(&["--workspace", "w", "--name", "n"]).is_err());
        assert!(args(&["--workspace", "w", "--hold", "soon"]).is_err());
        let err = args(&["--workspace", "w", "--label", "a=1", "--label", "a=2"]).unwrap_err();
        assert!(
            err.to_string().contains("--label a is given twice"),
            "{err}"
        );
    }

    #[test]
    fn the_wide_runs_table_adds_generation_labels_and_the_whole_reason() {
        let reason = format!("waiting for {}", "a host ".repeat(12));
        let run = pb::Run {
            id: "run-1".into(),
            state: pb::RunState::Queued as i32,
            state_reason: reason.clone(),
            labels: HashMap::from([("zone".to_owned(), "eu".to_owned())]),
            last_checkpoint_id: "ck-9".into(),
            attempts: vec![pb::Attempt {
                number: 1,
                generation: 7,
                ..Default::default()
            }],
            ..Default::default()
        };
        let narrow = runs_table(std::slice::from_ref(&run), false);
        let wide = runs_table(std::slice::from_ref(&run), true);
        let header = wide.lines().next().unwrap();
        for column in ["GEN", "LABELS", "LAST CHECKPOINT", "UPDATED"] {
            assert!(header.contains(column), "{wide}");
            assert!(!narrow.lines().next().unwrap().contains(column), "{narrow}");
        }
        assert!(header.ends_with("WHY"), "the reason stays last: {wide}");
        let row = wide.lines().nth(1).unwrap();
        assert!(row.contains(" 7 ") && row.contains("zone=eu") && row.contains("ck-9"));
        assert!(row.ends_with(reason.trim_end()), "{wide}");
        assert!(narrow.lines().nth(1).unwrap().ends_with('…'), "{narrow}");
    }

    #[test]
    fn runs_show_explains_the_state_and_lists_attempts() {
        let run = pb::Run {
            id: "run-1".into(),
            workspace_id: "ws-1".into(),
            state: pb::RunState::Queued as i32,
            state_reason: "no ready host has labels gpu=a100".into(),
            hold: Some(to_proto_duration(Duration::from_secs(300))),
            attempts: vec![pb::Attempt {
                number: 1,
                generation: 4,
                host_id: "host-a".into(),
                state: pb::AttemptState::Ended as i32,
                end_reason: "host_lost".into(),
                prepare: "restored ck-1".into(),
                // Stale: the attempt ended.
                unsaved: Some(pb::UnsavedWork {
                    files: 9,
                    bytes: 9,
                    complete: true,
                    reported_at: None,
                }),
                ..Default::default()
            }],
            question: "Which colour?".into(),
            workspace_checkpointed_at: Some(cairn_proto::domain::to_timestamp(
                std::time::SystemTime::now() - Duration::from_secs(150),
            )),
            ..Default::default()
        };
        let text = run_details(&run, false);
        let value_of = |key: &str| {
            let line = text.lines().find(|l| l.starts_with(&format!("{key}  ")));
            line.map(|l| l[key.len()..].trim().to_owned())
        };
        assert_eq!(value_of("state").as_deref(), Some("queued"), "{text}");
        assert_eq!(
            value_of("why").as_deref(),
            Some("no ready host has labels gpu=a100"),
            "{text}"
        );
        assert_eq!(value_of("hold").as_deref(), Some("5m"), "{text}");
        assert_eq!(value_of("question").as_deref(), Some("Which colour?"));
        let checkpointed = value_of("workspace checkpointed").unwrap_or_default();
        assert!(checkpointed.ends_with("(2m ago)"), "{text}");
        assert_eq!(value_of("at risk").as_deref(), Some("-"), "{text}");
        let mut running = run.clone();
        running.attempts[0].state = pb::AttemptState::Running as i32;
        running.attempts[0].unsaved = Some(pb::UnsavedWork {
            files: 3,
            bytes: 3 << 20,
            complete: false,
            reported_at: Some(cairn_proto::domain::to_timestamp(
                std::time::SystemTime::now() - Duration::from_secs(4),
            )),
        });
        let details = run_details(&running, false);
        let at_risk = details
            .lines()
            .find_map(|l| l.strip_prefix("at risk "))
            .map(str::trim);
        assert!(
            at_risk.is_some_and(
                |v| v.starts_with("at least 3 files, 3.0 MiB in no checkpoint (counted")
            ),
            "{details}"
        );
        let table = runs_table(std::slice::from_ref(&running), false);
        let mut lines = table.lines();
        let column = lines.next().unwrap().find("AT RISK").unwrap();
        assert!(
            lines.next().unwrap()[column..].starts_with("at least 3 files, 3.0 MiB"),
            "{table}"
        );
        let table = runs_table(std::slice::from_ref(&run), false);
        let mut lines = table.lines();
        let column = lines.next().unwrap().find("CHECKPOINTED").unwrap();
        let row = lines.next().unwrap();
        assert!(row[column..].starts_with("2m ago "), "{table}");
        assert_eq!(
            value_of("checkpoint limits").as_deref(),
            Some("- (the runner's own)"),
            "{text}"
        );
        let limited = pb::Run {
            checkpoint_limits: Some(pb::CheckpointLimits {
                max_file_bytes: 1 << 20,
                max_total_bytes: 2 << 30,
            }),
            ..run.clone()
        };
        assert!(
            run_details(&limited, false)
                .lines()
                .any(|l| l.starts_with("checkpoint limits")
                    && l.ends_with("files up to 1.0 MiB, 2.0 GiB in all")),
            "{}",
            run_details(&limited, false)
        );
        let attempt_row = text.lines().last().unwrap();
        for cell in ["1", "4", "host-a", "ended", "host_lost", "restored ck-1"] {
            assert!(attempt_row.contains(cell), "{attempt_row}");
        }
        assert_eq!(
            state_with_reason(&run),
            "queued (no ready host has labels gpu=a100)"
        );
    }
}
