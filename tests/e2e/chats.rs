//! Chat messages to a workspace (issue 4, "Chats"): a message is heard only
//! once a harness heard it. A run whose runner fails before starting the
//! harness gives its messages back; the next run at the station takes them
//! and its agent (the demo agent) hears them.

use cairn_e2e::fleet::{Fleet, HostOptions, codeword, describe_run, on_workspace, state_of};
use cairn_proto::pb;
use cairn_proto::runs::RunState;

fn messages(fleet: &Fleet, workspace: &str) -> Vec<pb::Message> {
    let mut client = fleet.block_on(fleet.coordinator.admin()).workspaces;
    fleet
        .block_on(client.list_messages(pb::ListMessagesRequest {
            workspace: workspace.to_owned(),
        }))
        .unwrap_or_else(|s| panic!("ListMessages failed: {s}"))
        .into_inner()
        .messages
}

#[test]
fn chat_message_given_back_by_a_run_that_never_started_its_harness_is_heard_by_the_next() {
    let mut fleet = Fleet::start();
    fleet.start_host("a", HostOptions::default());
    fleet.coordinator.create_workspace("chat");
    let mut client = fleet.block_on(fleet.coordinator.admin()).workspaces;

    // No run yet: the message waits on the workspace.
    let sent = fleet
        .block_on(client.send_message(pb::SendMessageRequest {
            workspace: "chat".into(),
            text: "recall codeword".into(),
            station: String::new(),
        }))
        .unwrap_or_else(|s| panic!("SendMessage failed: {s}"))
        .into_inner()
        .message
        .expect("the sent message");
    assert_eq!(sent.state(), pb::MessageState::Pending, "{sent:?}");

    // A run whose harness binary does not exist: the runner fails before
    // the harness reports a session, and the run gives the message back.
    let word = codeword("HERON");
    let mut broken = on_workspace(
        fleet.run_request("unused", &format!("The codeword is {word}.")),
        "chat",
    );
    broken.max_attempts = 1;
    broken
        .harness
        .as_mut()
        .expect("a harness")
        .config
        .insert("binary".into(), "/nonexistent/claude".into());
    let failed_run = fleet.create_run(broken);
    let listed = messages(&fleet, "chat");
    assert_eq!(listed[0].state(), pb::MessageState::Delivered, "{listed:?}");
    assert_eq!(listed[0].run_id, failed_run.id);
    let failed = fleet.wait_for_state(&failed_run.id, RunState::Failed);
    let listed = messages(&fleet, "chat");
    assert_eq!(
        (
            listed[0].state(),
            listed[0].run_id.as_str(),
            listed[0].given_back
        ),
        (pb::MessageState::Pending, "", 1),
        "the failed run gave the message back: {listed:?}\n{}",
        describe_run(&failed)
    );
    assert!(
        fleet
            .events(&failed_run.id)
            .iter()
            .any(|e| e.reason == "message_given_back"),
        "{}",
        fleet.diagnose(&failed_run.id)
    );

    // The next run at the station takes it with its prompt; the demo agent
    // hears it (it recalls the codeword of its first message).
    let good = fleet.create_run(on_workspace(
        fleet.run_request("unused", &format!("The codeword is {word}.")),
        "chat",
    ));
    let done = fleet.wait_for_state(&good.id, RunState::Succeeded);
    assert_eq!(state_of(&done), Some(RunState::Succeeded));
    assert!(
        done.summary.contains(&word),
        "the agent did not hear the message: summary {:?}",
        done.summary
    );
    let listed = messages(&fleet, "chat");
    assert_eq!(
        (listed[0].state(), listed[0].run_id.as_str()),
        (pb::MessageState::Heard, good.id.as_str()),
        "{listed:?}"
    );

    // cairnctl shows the same, and sends to a station without a run.
    let sent = fleet.coordinator.client().ctl_json(&[
        "workspace",
        "send",
        "chat",
        "for the reviewer",
        "--station",
        "review",
    ]);
    assert_eq!(sent["state"], "pending", "{sent}");
    assert_eq!(sent["station"], "review", "{sent}");
    let listed = fleet
        .coordinator
        .client()
        .ctl_json(&["workspace", "messages", "chat"]);
    let rows: Vec<(&str, &str, &str)> = listed
        .as_array()
        .expect("a list of messages")
        .iter()
        .map(|m| {
            (
                m["text"].as_str().unwrap_or_default(),
                m["state"].as_str().unwrap_or_default(),
                m["run_id"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("recall codeword", "heard", good.id.as_str()),
            ("for the reviewer", "pending", ""),
        ]
    );
}
