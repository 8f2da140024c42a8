//! `cairnctl workspace create|list|show|fork|send|messages|notes`.

use std::process::ExitCode;

use cairn_engine::client::CoordinatorClient;
use cairn_proto::pb;

use super::output::{self, time_of};
use super::{Output, emit, print_document, rpc_error};

pub async fn create(
    coordinator: &CoordinatorClient,
    name: Option<String>,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = coordinator.workspaces.clone();
    let workspace = client
        .create_workspace(pb::CreateWorkspaceRequest {
            name: name.unwrap_or_default(),
        })
        .await
        .map_err(rpc_error("creating the workspace"))?
        .into_inner();
    match out {
        Output::Json | Output::Yaml => print_document(out, &output::workspace_json(&workspace))?,
        Output::Table | Output::Wide => {
            let named = if workspace.name.is_empty() {
                String::new()
            } else {
                format!(" ({})", workspace.name)
            };
            emit(&format!("created workspace {}{named}", workspace.id))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn fork(
    coordinator: &CoordinatorClient,
    request: pb::ForkWorkspaceRequest,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = coordinator.workspaces.clone();
    let forked = client
        .fork_workspace(request)
        .await
        .map_err(rpc_error("forking the workspace"))?
        .into_inner();
    match out {
        Output::Json | Output::Yaml => print_document(
            out,
            &serde_json::json!({
                "checkpoint_id": forked.checkpoint_id,
                "workspaces": forked
                    .workspaces
                    .iter()
                    .map(output::workspace_json)
                    .collect::<Vec<_>>(),
            }),
        )?,
        Output::Table | Output::Wide => {
            emit(&format!(
                "forked {} workspace{} from checkpoint {}",
                forked.workspaces.len(),
                if forked.workspaces.len() == 1 {
                    ""
                } else {
                    "s"
                },
                forked.checkpoint_id
            ))?;
            let rows: Vec<Vec<String>> = forked
                .workspaces
                .iter()
                .map(|w| {
                    vec![
                        w.id.clone(),
                        if w.name.is_empty() {
                            "-".into()
                        } else {
                            w.name.clone()
                        },
                        w.latest_checkpoint
                            .as_ref()
                            .map(|c| c.id.clone())
                            .unwrap_or_else(|| "-".into()),
                    ]
                })
                .collect();
            emit(&output::table(&["ID", "NAME", "CHECKPOINT"], &rows))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn list(coordinator: &CoordinatorClient, out: Output) -> anyhow::Result<ExitCode> {
    let mut client = coordinator.workspaces.clone();
    let mut workspaces = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_workspaces(pb::ListWorkspacesRequest {
                page_size: 500,
                page_token: page_token.clone(),
            })
            .await
            .map_err(rpc_error("listing workspaces"))?
            .into_inner();
        workspaces.extend(page.workspaces);
        if page.next_page_token.is_empty() || page.next_page_token == page_token {
            break;
        }
        page_token = page.next_page_token;
    }
    match out {
        Output::Json | Output::Yaml => print_document(
            out,
            &serde_json::Value::Array(workspaces.iter().map(output::workspace_json).collect()),
        )?,
        Output::Table | Output::Wide => {
            let rows: Vec<Vec<String>> = workspaces
                .iter()
                .map(|w| {
                    let mut row = vec![
                        w.id.clone(),
                        if w.name.is_empty() {
                            "-".into()
                        } else {
                            w.name.clone()
                        },
                        output::state(w.state).to_owned(),
                        w.generation.to_string(),
                        w.checkpoint_count.to_string(),
                        w.latest_checkpoint
                            .as_ref()
                            .map(|c| output::age(time_of!(c.created_at)))
                            .unwrap_or_else(|| "-".into()),
                        output::age(time_of!(w.created_at)),
                    ];
                    if out.is_wide() {
                        // Storage figures are not here: only `workspace
                        // show` asks the database for them.
                        row.extend([
                            output::age(time_of!(w.updated_at)),
                            w.latest_checkpoint
                                .as_ref()
                                .map_or_else(|| "-".into(), |c| c.id.clone()),
                            output::age(time_of!(w.finished_at)),
                            output::when(time_of!(w.expires_at)),
                        ]);
                    }
                    row
                })
                .collect();
            let mut headers = vec![
                "ID",
                "NAME",
                "STATE",
                "GEN",
                "CHECKPOINTS",
                "LATEST",
                "CREATED",
            ];
            if out.is_wide() {
                headers.extend(["UPDATED", "LATEST ID", "FINISHED", "EXPIRES"]);
            }
            emit(&output::table(&headers, &rows))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn show(
    coordinator: &CoordinatorClient,
    workspace: &str,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = coordinator.workspaces.clone();
    let w = client
        .get_workspace(pb::GetWorkspaceRequest {
            workspace: workspace.to_owned(),
        })
        .await
        .map_err(rpc_error("showing the workspace"))?
        .into_inner();
    match out {
        Output::Json | Output::Yaml => print_document(out, &output::workspace_json(&w))?,
        Output::Table | Output::Wide => {
            let latest = match &w.latest_checkpoint {
                Some(c) => output::checkpoint_brief(c),
                None => "-".into(),
            };
            emit(&output::key_values(&[
                ("id", w.id.clone()),
                (
                    "name",
                    if w.name.is_empty() {
                        "-".into()
                    } else {
                        w.name.clone()
                    },
                ),
                ("tenant", w.tenant.clone()),
                ("state", output::state(w.state).to_owned()),
                ("generation", w.generation.to_string()),
                ("checkpoints", w.checkpoint_count.to_string()),
                ("latest", latest),
                ("created", output::when(time_of!(w.created_at))),
                ("updated", output::when(time_of!(w.updated_at))),
                ("finished", output::when(time_of!(w.finished_at))),
                ("expires", output::when(time_of!(w.expires_at))),
                ("retention", retention_words(w.retention.as_ref())),
                ("stored", storage_words(w.storage.as_ref())),
            ]))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `keep last 5 (server default); finished workspaces go after 7days (own)`.
fn retention_words(r: Option<&pb::Retention>) -> String {
    let Some(r) = r else { return "-".into() };
    let whose = |own: bool| if own { "own" } else { "server default" };
    let expiry = r
        .finished_expiry
        .as_ref()
        .and_then(|d| cairn_proto::runs::from_proto_duration(d, "finished_expiry").ok())
        .map(|d| humantime::format_duration(d).to_string())
        .unwrap_or_else(|| "-".into());
    format!(
        "keep last {} ({}); deleted {expiry} after it is finished ({})",
        r.keep_last,
        whose(r.own_keep_last),
        whose(r.own_finished_expiry)
    )
}

/// `12.0 MiB in 8 packs: 10.0 MiB its own, 2.0 MiB shared with other workspaces`.
fn storage_words(s: Option<&pb::WorkspaceStorage>) -> String {
    let Some(s) = s else { return "-".into() };
    format!(
        "{} in {} packs: {} its own, {} shared with other workspaces (forks)",
        output::bytes(s.referenced_bytes),
        s.referenced_packs,
        output::bytes(s.unique_bytes),
        output::bytes(s.shared_bytes)
    )
}

/// What finishing or deleting did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Finish,
    Delete,
}

/// `cairnctl workspace finish|delete WS`.
pub async fn end(
    coordinator: &CoordinatorClient,
    workspace: &str,
    ending: Ending,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = coordinator.workspaces.clone();
    let result = match ending {
        Ending::Finish => client
            .finish_workspace(pb::FinishWorkspaceRequest {
                workspace: workspace.to_owned(),
            })
            .await
            .map_err(ended_error("finishing the workspace"))?,
        Ending::Delete => client
            .delete_workspace(pb::DeleteWorkspaceRequest {
                workspace: workspace.to_owned(),
            })
            .await
            .map_err(ended_error("deleting the workspace"))?,
    }
    .into_inner();
    match out {
        Output::Json | Output::Yaml => print_document(out, &output::workspace_json(&result))?,
        Output::Table | Output::Wide => emit(&match ending {
            Ending::Finish => format!(
                "finished workspace {}: no new runs; deleted {}",
                result.id,
                match time_of!(result.expires_at) {
                    Some(at) => format!("at {}", humantime::format_rfc3339_seconds(at)),
                    None => "after its retention".into(),
                }
            ),
            Ending::Delete => format!(
                "deleted workspace {}: its checkpoints are gone; garbage collection frees the packs nothing else uses after its grace period",
                result.id
            ),
        })?,
    }
    Ok(ExitCode::SUCCESS)
}

/// A refused finish or delete, naming the runs to end first when that is why.
fn ended_error(what: &'static str) -> impl FnOnce(tonic::Status) -> anyhow::Error {
    move |status| match cairn_proto::refusal::Refusal::of(&status) {
        Some(cairn_proto::refusal::Refusal::WorkspaceHasRuns { workspace, runs }) => {
            let ids: Vec<String> = runs.iter().map(ToString::to_string).collect();
            anyhow::anyhow!(
                "{what}: workspace {workspace} has runs that have not ended ({}); cancel them first (cairnctl runs cancel RUN) or wait for them",
                ids.join(", ")
            )
        }
        _ => rpc_error(what)(status),
    }
}

/// `cairnctl workspace retention WS [--keep-last N] [--finished-expiry D]`.
pub async fn set_retention(
    coordinator: &CoordinatorClient,
    request: pb::SetRetentionRequest,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = coordinator.workspaces.clone();
    let w = client
        .set_retention(request)
        .await
        .map_err(rpc_error("setting the workspace's retention"))?
        .into_inner();
    match out {
        Output::Json | Output::Yaml => print_document(out, &output::workspace_json(&w))?,
        Output::Table | Output::Wide => emit(&format!(
            "workspace {}: {}",
            w.id,
            retention_words(w.retention.as_ref())
        ))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Where a message is, in a word, and the run that has it.
fn message_state(m: &pb::Message) -> &'static str {
    match m.state() {
        pb::MessageState::Pending => "pending",
        pb::MessageState::Delivered => "delivered",
        pb::MessageState::Heard => "heard",
        pb::MessageState::Unspecified => "unknown",
    }
}

fn message_json(m: &pb::Message) -> serde_json::Value {
    serde_json::json!({
        "id": m.id,
        "workspace_id": m.workspace_id,
        "station": m.station,
        "text": m.text,
        "created_at": output::rfc3339(time_of!(m.created_at)),
        "state": message_state(m),
        "run_id": m.run_id,
        "given_back": m.given_back,
    })
}

pub async fn send(
    coordinator: &CoordinatorClient,
    request: pb::SendMessageRequest,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = coordinator.workspaces.clone();
    let message = client
        .send_message(request)
        .await
        .map_err(rpc_error("sending the message"))?
        .into_inner()
        .message
        .ok_or_else(|| anyhow::anyhow!("the coordinator answered without the message"))?;
    match out {
        Output::Json | Output::Yaml => print_document(out, &message_json(&message))?,
        Output::Table | Output::Wide => {
            let where_ = if message.run_id.is_empty() {
                format!("pending until the next run at station {}", message.station)
            } else {
                format!("delivered to run {}", message.run_id)
            };
            emit(&format!("message {} {where_}", message.id))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn messages(
    coordinator: &CoordinatorClient,
    workspace: &str,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = coordinator.workspaces.clone();
    let messages = client
        .list_messages(pb::ListMessagesRequest {
            workspace: workspace.to_owned(),
        })
        .await
        .map_err(rpc_error("listing the messages"))?
        .into_inner()
        .messages;
    match out {
        Output::Json | Output::Yaml => print_document(
            out,
            &serde_json::Value::Array(messages.iter().map(message_json).collect()),
        )?,
        Output::Table | Output::Wide => {
            let rows: Vec<Vec<String>> = messages
                .iter()
                .map(|m| {
                    vec![
                        m.id.to_string(),
                        m.station.clone(),
                        message_state(m).to_owned(),
                        output::or_dash(&m.run_id),
                        m.given_back.to_string(),
                        output::age(time_of!(m.created_at)),
                        if out.is_wide() {
                            m.text.replace('\n', " ")
                        } else {
                            output::first_line(&m.text, 60)
                        },
                    ]
                })
                .collect();
            emit(&output::table(
                &[
                    "ID",
                    "STATION",
                    "STATE",
                    "RUN",
                    "GIVEN BACK",
                    "SENT",
                    "TEXT",
                ],
                &rows,
            ))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn note_json(n: &pb::HandoffNote) -> serde_json::Value {
    let text = n.text.clone().unwrap_or_default();
    serde_json::json!({
        "workspace_id": n.workspace_id,
        "run_id": n.run_id,
        "station": n.station,
        "attempt": n.attempt,
        "harness": n.harness,
        "outcome": n.outcome,
        "checkpoint_id": n.checkpoint_id,
        "created_at": output::rfc3339(time_of!(n.created_at)),
        "summary": text.summary,
        "changed": text.changed,
        "checked": text.checked,
        "uncertain": text.uncertain,
        "next": text.next,
        "composed": text.composed,
    })
}

/// One note for people: a heading line, then each field, continuation
/// lines indented.
fn note_text(n: &pb::HandoffNote) -> String {
    let text = n.text.clone().unwrap_or_default();
    let mut out = format!(
        "run {}  station {}  attempt {}  {}  {}  ({})\n",
        n.run_id,
        n.station,
        n.attempt,
        n.outcome,
        output::when(time_of!(n.created_at)),
        n.harness
    );
    for (label, value) in [
        ("summary", &text.summary),
        ("changed", &text.changed),
        ("checked", &text.checked),
        ("uncertain", &text.uncertain),
        ("next", &text.next),
    ] {
        // `composed` names the fields the runner filled in (never the summary).
        let by_runner = text.composed.iter().any(|c| c == label);
        let mut lines = value.lines();
        out.push_str(&format!(
            "  {:<10} {}{}\n",
            format!("{label}:"),
            lines.next().unwrap_or("-"),
            if by_runner { "  [by the runner]" } else { "" }
        ));
        for line in lines {
            out.push_str(&format!("  {:<10} {line}\n", ""));
        }
    }
    out
}

pub async fn notes(
    coordinator: &CoordinatorClient,
    workspace: &str,
    out: Output,
) -> anyhow::Result<ExitCode> {
    let mut client = coordinator.workspaces.clone();
    let notes = client
        .list_handoff_notes(pb::ListHandoffNotesRequest {
            workspace: workspace.to_owned(),
        })
        .await
        .map_err(rpc_error("listing the handoff notes"))?
        .into_inner()
        .notes;
    match out {
        Output::Json | Output::Yaml => print_document(
            out,
            &serde_json::Value::Array(notes.iter().map(note_json).collect()),
        )?,
        Output::Table | Output::Wide if notes.is_empty() => emit("no handoff notes yet")?,
        Output::Table | Output::Wide => emit(
            notes
                .iter()
                .map(note_text)
                .collect::<Vec<_>>()
                .join("\n")
                .trim_end(),
        )?,
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_show_every_field_and_who_wrote_it() {
        let note = pb::HandoffNote {
            workspace_id: "ws-1".into(),
            run_id: "run-1".into(),
            station: "implement".into(),
            attempt: 2,
            harness: "claude".into(),
            outcome: "succeeded".into(),
            text: Some(pb::HandoffText {
                summary: "Added the form.".into(),
                changed: "app: 1 new commit\nlib: no new commits".into(),
                checked: "cargo test".into(),
                uncertain: "not stated".into(),
                next: "review it".into(),
                composed: vec!["changed".into(), "uncertain".into()],
            }),
            ..Default::default()
        };
        let text = note_text(&note);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with("run run-1  station implement  attempt 2  succeeded  "),
            "{text}"
        );
        assert_eq!(lines[1], "  summary:   Added the form.");
        assert_eq!(lines[2], "  changed:   app: 1 new commit  [by the runner]");
        assert_eq!(lines[3], "             lib: no new commits");
        assert_eq!(lines[4], "  checked:   cargo test");
        assert_eq!(lines[5], "  uncertain: not stated  [by the runner]");
        assert_eq!(lines[6], "  next:      review it");
        let json = note_json(&note);
        assert_eq!(json["station"], "implement");
        assert_eq!(
            json["composed"],
            serde_json::json!(["changed", "uncertain"])
        );
    }
}
