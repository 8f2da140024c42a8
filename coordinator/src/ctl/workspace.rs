//! `cairnctl workspace create|list|show|fork|send|messages`.

use std::process::ExitCode;

use cairn_proto::pb;
use cairn_runner::client::Coordinator;

use super::output::{self, time_of};
use super::{Output, emit, print_json, rpc_error};

pub async fn create(
    coordinator: &Coordinator,
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
        Output::Json => print_json(&output::workspace_json(&workspace))?,
        Output::Table => {
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
    coordinator: &Coordinator,
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
        Output::Json => print_json(&serde_json::json!({
            "checkpoint_id": forked.checkpoint_id,
            "workspaces": forked
                .workspaces
                .iter()
                .map(output::workspace_json)
                .collect::<Vec<_>>(),
        }))?,
        Output::Table => {
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

pub async fn list(coordinator: &Coordinator, out: Output) -> anyhow::Result<ExitCode> {
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
        Output::Json => print_json(&serde_json::Value::Array(
            workspaces.iter().map(output::workspace_json).collect(),
        ))?,
        Output::Table => {
            let rows: Vec<Vec<String>> = workspaces
                .iter()
                .map(|w| {
                    vec![
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
                    ]
                })
                .collect();
            emit(&output::table(
                &[
                    "ID",
                    "NAME",
                    "STATE",
                    "GEN",
                    "CHECKPOINTS",
                    "LATEST",
                    "CREATED",
                ],
                &rows,
            ))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn show(
    coordinator: &Coordinator,
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
        Output::Json => print_json(&output::workspace_json(&w))?,
        Output::Table => {
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
            ]))?;
        }
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
    coordinator: &Coordinator,
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
        Output::Json => print_json(&message_json(&message))?,
        Output::Table => {
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
    coordinator: &Coordinator,
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
        Output::Json => print_json(&serde_json::Value::Array(
            messages.iter().map(message_json).collect(),
        ))?,
        Output::Table => {
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
                        output::first_line(&m.text, 60),
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
