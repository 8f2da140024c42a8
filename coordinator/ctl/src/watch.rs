//! `cairnctl runs watch [--workspace WS] [--state S] [--interval 2s]`: the
//! runs table, kept current.
//!
//! The coordinator streams events of one run only (`WatchRunEvents`), so
//! this polls `ListRuns` every `--interval`. On a terminal the table is
//! redrawn in place (ages tick along with it); when stdout is a file or a
//! pipe, each change is one line: a run that appeared, changed, or left the
//! filter. `-o json` prints each change as one JSON object per line (`-o
//! yaml`: one document each). Ctrl-C ends it with exit 0.

use std::collections::HashMap;
use std::io::IsTerminal as _;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use cairn_engine::client::CoordinatorClient;
use cairn_proto::pb;
use serde_json::json;

use super::output;
use super::runs::{self, RunFilter};
use super::{Output, emit, print_stream_item};

/// `runs watch`: which runs, and how often to look.
#[derive(Debug, clap::Args)]
pub struct WatchArgs {
    #[command(flatten)]
    pub filter: RunFilter,
    /// How often to ask the coordinator (e.g. 500ms, 2s).
    #[arg(long, default_value = "2s", value_parser = parse_interval)]
    pub interval: Duration,
}

/// At least 100 ms: a watch should not load the coordinator.
fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if interval < Duration::from_millis(100) {
        return Err(format!("{text:?} is shorter than 100ms"));
    }
    Ok(interval)
}

/// What happened to a run between two looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// First seen (every run on the first look).
    New,
    /// Anything about it changed: state, attempt, host, checkpoint, reason.
    Changed,
    /// No longer listed: deleted with its workspace, or out of the filter
    /// (`--state running` and it ended).
    Gone,
}

impl ChangeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::Changed => "changed",
            Self::Gone => "gone",
        }
    }
}

/// One run's change, with the run as last seen and its state before.
#[derive(Debug, Clone)]
pub struct Change {
    pub kind: ChangeKind,
    pub run: pb::Run,
    pub previous_state: Option<i32>,
}

/// The changes from `before` (by id) to `now`, in `now`'s order, then the
/// runs that are gone.
pub fn changes(before: &HashMap<String, pb::Run>, now: &[pb::Run]) -> Vec<Change> {
    let mut out = Vec::new();
    for run in now {
        match before.get(&run.id) {
            None => out.push(Change {
                kind: ChangeKind::New,
                run: run.clone(),
                previous_state: None,
            }),
            Some(old) if old != run => out.push(Change {
                kind: ChangeKind::Changed,
                run: run.clone(),
                previous_state: Some(old.state),
            }),
            Some(_) => {}
        }
    }
    let mut gone: Vec<&pb::Run> = before
        .values()
        .filter(|old| !now.iter().any(|r| r.id == old.id))
        .collect();
    gone.sort_by(|a, b| a.id.cmp(&b.id));
    out.extend(gone.into_iter().map(|old| Change {
        kind: ChangeKind::Gone,
        run: old.clone(),
        previous_state: Some(old.state),
    }));
    out
}

/// A change as one line, columns at fixed widths so lines printed as they
/// happen line up: time, change, run, state (and the state before), host,
/// attempt/generation, why.
pub fn change_line(change: &Change, at: SystemTime) -> String {
    let run = &change.run;
    let state = output::run_state(run.state);
    let state = match change.previous_state {
        Some(before) if before != run.state => {
            format!("{} → {state}", output::run_state(before))
        }
        _ => state.to_owned(),
    };
    let attempt = output::current_attempt(run);
    let line = format!(
        "{:<8}  {:<7}  {:<30}  {:<22}  {:<22}  {:<8}  {}",
        humantime::format_rfc3339_seconds(at)
            .to_string()
            .get(11..19)
            .unwrap_or("-"),
        change.kind.as_str(),
        run.id,
        state,
        attempt.map_or_else(|| "-".into(), |a| output::or_dash(&a.host_id)),
        attempt.map_or_else(
            || "-".into(),
            |a| output::attempt_generation(a.number, a.generation)
        ),
        output::first_line(&run.state_reason, 80),
    );
    line.trim_end().to_owned()
}

/// The header over [`change_line`]s.
pub fn change_header() -> String {
    format!(
        "{:<8}  {:<7}  {:<30}  {:<22}  {:<22}  {:<8}  WHY",
        "TIME", "CHANGE", "RUN", "STATE", "HOST", "ATTEMPT"
    )
}

/// A change for scripts: what happened, when, and the run as `runs show
/// -o json` prints it.
pub fn change_json(change: &Change, at: SystemTime) -> serde_json::Value {
    json!({
        "at": output::rfc3339_millis(Some(at)),
        "change": change.kind.as_str(),
        "previous_state": change.previous_state.map(output::run_state),
        "run": output::run_json(&change.run),
    })
}

/// How the watch shows what it sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Display {
    /// A terminal: the whole table, redrawn in place every look.
    Live,
    /// A file or pipe: one line per change.
    Lines,
    /// One JSON object (or YAML document) per change.
    Documents,
}

pub async fn run(
    coordinator: &CoordinatorClient,
    args: WatchArgs,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let display = if out.is_document() {
        Display::Documents
    } else if std::io::stdout().is_terminal() {
        Display::Live
    } else {
        Display::Lines
    };
    let mut client = runs::client(coordinator);
    let mut seen: HashMap<String, pb::Run> = HashMap::new();
    let mut ticker = tokio::time::interval(args.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut looked = false;
    if display == Display::Lines {
        emit(&change_header())?;
    }
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            _ = &mut ctrl_c => break,
            _ = ticker.tick() => {}
        }
        let now = match runs::fetch(&mut client, &args.filter).await {
            Ok(now) => now,
            // A coordinator that restarts should not end a watch someone
            // left open; the first look must work, though.
            Err(e) if looked => {
                eprintln!(
                    "warning: {}; trying again in {}",
                    cairn_utils::text::one_line(e.as_ref()),
                    humantime::format_duration(args.interval)
                );
                continue;
            }
            Err(e) => return Err(e),
        };
        looked = true;
        let at = SystemTime::now();
        match display {
            Display::Live => emit(&live_screen(&now, &args, out, at))?,
            Display::Lines => {
                for change in changes(&seen, &now) {
                    emit(&change_line(&change, at))?;
                }
            }
            Display::Documents => {
                for change in changes(&seen, &now) {
                    print_stream_item(&change_json(&change, at), out)?;
                }
            }
        }
        seen = now.into_iter().map(|r| (r.id.clone(), r)).collect();
    }
    Ok(ExitCode::SUCCESS)
}

/// The whole screen: home the cursor, each line cleared to its end, the
/// rest of the screen cleared below, so a redraw does not flicker.
fn live_screen(runs: &[pb::Run], args: &WatchArgs, out: Output, at: SystemTime) -> String {
    let mut filters = Vec::new();
    if let Some(workspace) = &args.filter.workspace {
        filters.push(format!("workspace {workspace}"));
    }
    if let Some(state) = args.filter.state {
        filters.push(format!("state {}", state.as_str()));
    }
    let title = format!(
        "runs{} · every {} · {} · Ctrl-C to stop",
        if filters.is_empty() {
            String::new()
        } else {
            format!(" ({})", filters.join(", "))
        },
        humantime::format_duration(args.interval),
        humantime::format_rfc3339_seconds(at),
    );
    let body = if runs.is_empty() {
        "no runs".to_owned()
    } else {
        runs::runs_table(runs, out.is_wide())
    };
    let mut screen = String::from("\x1b[H");
    for line in std::iter::once(title.as_str())
        .chain([""])
        .chain(body.lines())
    {
        screen.push_str(line);
        screen.push_str("\x1b[K\n");
    }
    screen.push_str("\x1b[J");
    screen
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(id: &str, state: pb::RunState) -> pb::Run {
        pb::Run {
            id: id.into(),
            state: state as i32,
            ..Default::default()
        }
    }

    #[test]
    fn a_look_reports_new_changed_and_gone_runs_once() {
        let first = vec![
            run("run-a", pb::RunState::Queued),
            run("run-b", pb::RunState::Running),
        ];
        let found = changes(&HashMap::new(), &first);
        assert_eq!(
            found
                .iter()
                .map(|c| (c.kind, c.run.id.as_str()))
                .collect::<Vec<_>>(),
            [(ChangeKind::New, "run-a"), (ChangeKind::New, "run-b")]
        );
        let seen: HashMap<_, _> = first.iter().map(|r| (r.id.clone(), r.clone())).collect();
        assert!(changes(&seen, &first).is_empty(), "nothing changed");

        let second = vec![run("run-a", pb::RunState::Cancelled)];
        let found = changes(&seen, &second);
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].kind, ChangeKind::Changed);
        assert_eq!(found[0].previous_state, Some(pb::RunState::Queued as i32));
        assert_eq!(
            (found[1].kind, found[1].run.id.as_str()),
            (ChangeKind::Gone, "run-b")
        );

        let line = change_line(&found[0], SystemTime::UNIX_EPOCH);
        assert!(line.starts_with("00:00:00  changed  run-a"), "{line}");
        assert!(line.contains("queued → cancelled"), "{line}");
        let value = change_json(&found[0], SystemTime::UNIX_EPOCH);
        assert_eq!(value["change"], "changed");
        assert_eq!(value["previous_state"], "queued");
        assert_eq!(value["run"]["state"], "cancelled");
    }

    #[test]
    fn watching_more_often_than_every_100ms_is_refused() {
        assert_eq!(parse_interval("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_interval("10ms").is_err());
        assert!(parse_interval("soon").is_err());
    }
}
