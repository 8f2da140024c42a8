//! Chat messages to workspaces: delivered as run inputs, heard only when a
//! runner reports its harness heard them, given back by attempts and runs
//! that end before that.

use cairn_engine::client::AuthChannel;
use cairn_proto::pb;
use cairn_proto::pb::workspace_service_client::WorkspaceServiceClient;
use tonic::Code;

use crate::fleet::{FakeRunner, patient_fleet, reasons, run_on, start_patient, wait_for_input};
use crate::harness::data_dir;

async fn send(
    client: &mut WorkspaceServiceClient<AuthChannel>,
    workspace: &str,
    text: &str,
) -> Result<pb::Message, tonic::Status> {
    send_to_station(client, workspace, text, "").await
}

async fn send_to_station(
    client: &mut WorkspaceServiceClient<AuthChannel>,
    workspace: &str,
    text: &str,
    station: &str,
) -> Result<pb::Message, tonic::Status> {
    client
        .send_message(pb::SendMessageRequest {
            workspace: workspace.into(),
            text: text.into(),
            station: station.into(),
        })
        .await
        .map(|r| r.into_inner().message.expect("a sent message"))
}

async fn messages(
    client: &mut WorkspaceServiceClient<AuthChannel>,
    workspace: &str,
) -> Vec<pb::Message> {
    client
        .list_messages(pb::ListMessagesRequest {
            workspace: workspace.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .messages
}

fn state_of(message: &pb::Message) -> (pb::MessageState, &str) {
    (message.state(), message.run_id.as_str())
}

/// Kind and text of each input.
fn message_texts(inputs: &[pb::RunInput]) -> Vec<(&str, &str)> {
    inputs
        .iter()
        .map(|i| (i.kind.as_str(), i.text.as_str()))
        .collect()
}

#[tokio::test]
async fn chat_message_to_a_waiting_run_reaches_the_held_sandbox_and_the_next_attempt() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let mut ws = server.client().await.workspaces;
    let run = clients.create_run(&[]).await;
    let (first, mut runner) = host.launch(&server, &run.id).await;
    runner.start().await;
    runner.wait_for_person("which database?").await;

    let sent = send(&mut ws, &run.workspace_id, "use sqlite")
        .await
        .unwrap();
    assert_eq!(
        state_of(&sent),
        (pb::MessageState::Delivered, run.id.as_str())
    );
    assert_eq!(sent.station, "default");
    let events = clients.events(&run.id).await;
    let last = events.last().unwrap();
    assert_eq!(
        (last.reason.as_str(), last.detail.as_str()),
        ("message", "delivered to the held sandbox")
    );
    // The held sandbox gets it like an answer.
    let delivered = wait_for_input(&mut runner.runner).await;
    assert_eq!(
        message_texts(&delivered.inputs),
        [("message", "use sqlite")]
    );

    // The sandbox dies before the harness heard it: the next attempt gets it.
    host.sandbox_gone(&first.sandbox_id, pb::SandboxState::Failed, 1);
    host.beat().await;
    let second = host.beat_until_assigned(&run.id).await;
    assert_eq!(second.attempt, 2);
    let mut next = FakeRunner::connect(&server, &second).await;
    let spec = next.claim().await;
    assert_eq!(message_texts(&spec.inputs), [("message", "use sqlite")]);
}

#[tokio::test]
async fn chat_message_is_given_back_by_an_attempt_without_a_harness_session_and_heard_once() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let mut ws = server.client().await.workspaces;
    let run = clients.create_run(&[]).await;
    let (first, mut runner) = host.launch(&server, &run.id).await;
    runner.claim().await;

    // Delivered to the running run; its runner fails before the harness
    // reported a session.
    let sent = send(&mut ws, &run.workspace_id, "also add tests")
        .await
        .unwrap();
    assert_eq!(
        state_of(&sent),
        (pb::MessageState::Delivered, run.id.as_str())
    );
    let events = clients.events(&run.id).await;
    let last = events.last().unwrap();
    assert_eq!(
        (last.reason.as_str(), last.detail.as_str()),
        ("message", "the next turn or attempt picks it up")
    );
    host.sandbox_gone(&first.sandbox_id, pb::SandboxState::Failed, 1);
    host.beat().await;
    let events = clients.events(&run.id).await;
    let reasons = reasons(&events);
    assert!(reasons.contains(&"message"), "{reasons:?}");
    assert!(reasons.contains(&"message_given_back"), "{reasons:?}");
    let listed = messages(&mut ws, &run.workspace_id).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(
        state_of(&listed[0]),
        (pb::MessageState::Delivered, run.id.as_str())
    );

    // The next attempt gets it again; its harness hears it.
    let second = host.beat_until_assigned(&run.id).await;
    let mut next = FakeRunner::connect(&server, &second).await;
    let spec = next.start().await;
    assert_eq!(message_texts(&spec.inputs), [("message", "also add tests")]);
    next.report_session("session-two").await;
    next.outcome(pb::Outcome::Succeeded, &[spec.inputs[0].id])
        .await
        .unwrap();
    let listed = messages(&mut ws, &run.workspace_id).await;
    assert_eq!(
        state_of(&listed[0]),
        (pb::MessageState::Heard, run.id.as_str())
    );
    assert_eq!(listed[0].given_back, 0);
    host.sandbox_gone(&second.sandbox_id, pb::SandboxState::Exited, 0);
    host.beat().await;

    // Heard messages are not handed out again.
    let again = clients.create(run_on(&run.workspace_id)).await;
    let third = host.beat_until_assigned(&again.id).await;
    let spec = FakeRunner::connect(&server, &third).await.claim().await;
    assert!(spec.inputs.is_empty(), "{:?}", spec.inputs);
}

#[tokio::test]
async fn chat_message_of_a_run_that_failed_unheard_goes_with_the_next_run() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let mut ws = server.client().await.workspaces;
    let run = clients.create_with_max_attempts(1).await;
    let (first, mut runner) = host.launch(&server, &run.id).await;
    runner.claim().await;
    send(&mut ws, &run.workspace_id, "hello").await.unwrap();
    // The runner fails before starting the harness and reports so.
    runner.outcome(pb::Outcome::Failed, &[]).await.unwrap();
    host.sandbox_gone(&first.sandbox_id, pb::SandboxState::Exited, 1);
    host.beat().await;
    assert_eq!(
        clients.get(&run.id).await.state,
        pb::RunState::Failed as i32
    );
    let listed = messages(&mut ws, &run.workspace_id).await;
    assert_eq!(state_of(&listed[0]), (pb::MessageState::Pending, ""));
    assert_eq!(listed[0].given_back, 1);
    assert!(reasons(&clients.events(&run.id).await).contains(&"message_given_back"));

    let again = clients.create(run_on(&run.workspace_id)).await;
    let listed = messages(&mut ws, &run.workspace_id).await;
    assert_eq!(
        state_of(&listed[0]),
        (pb::MessageState::Delivered, again.id.as_str())
    );
    let second = host.beat_until_assigned(&again.id).await;
    let spec = FakeRunner::connect(&server, &second).await.claim().await;
    assert_eq!(message_texts(&spec.inputs), [("message", "hello")]);
}

#[tokio::test]
async fn chat_message_without_an_unfinished_run_waits_for_the_next_run() {
    let (server, mut clients, mut host) = patient_fleet("h", 1).await;
    let mut ws = server.client().await.workspaces;
    let workspace = ws
        .create_workspace(pb::CreateWorkspaceRequest {
            name: "chat".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = send(&mut ws, "chat", "first").await.unwrap();
    assert_eq!(state_of(&first), (pb::MessageState::Pending, ""));
    let other = send_to_station(&mut ws, "chat", "for review", "review")
        .await
        .unwrap();
    assert_eq!(other.station, "review");
    send(&mut ws, &workspace.id, "second").await.unwrap();

    let run = clients.create(run_on("chat")).await;
    let listed = messages(&mut ws, "chat").await;
    let states: Vec<_> = listed
        .iter()
        .map(|m| (m.text.as_str(), state_of(m)))
        .collect();
    assert_eq!(
        states,
        [
            ("first", (pb::MessageState::Delivered, run.id.as_str())),
            ("for review", (pb::MessageState::Pending, "")),
            ("second", (pb::MessageState::Delivered, run.id.as_str())),
        ]
    );
    let assignment = host.beat_until_assigned(&run.id).await;
    let spec = FakeRunner::connect(&server, &assignment)
        .await
        .claim()
        .await;
    assert_eq!(spec.prompt, "remember the codeword PELICAN");
    assert_eq!(
        message_texts(&spec.inputs),
        [("message", "first"), ("message", "second")]
    );
}

#[tokio::test]
async fn chat_message_errors_are_precise() {
    let dir = data_dir();
    let server = start_patient(dir.path()).await;
    let mut ws = server.client().await.workspaces;
    ws.create_workspace(pb::CreateWorkspaceRequest {
        name: "chat".into(),
    })
    .await
    .unwrap();
    let unknown = send(&mut ws, "nope", "hi").await.unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound, "{}", unknown.message());
    let empty = send(&mut ws, "chat", "  ").await.unwrap_err();
    assert_eq!(empty.code(), Code::InvalidArgument, "{}", empty.message());
    let big = send(&mut ws, "chat", &"x".repeat(64 * 1024 + 1))
        .await
        .unwrap_err();
    assert_eq!(big.code(), Code::InvalidArgument, "{}", big.message());
    let station = send_to_station(&mut ws, "chat", "hi", "../x")
        .await
        .unwrap_err();
    assert_eq!(station.code(), Code::InvalidArgument);
    let listed = ws
        .list_messages(pb::ListMessagesRequest {
            workspace: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(listed.code(), Code::NotFound);
    assert!(messages(&mut ws, "chat").await.is_empty());
}
