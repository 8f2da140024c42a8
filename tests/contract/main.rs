//! Contract tests: cairn's harness adapters against the REAL agent CLIs, at
//! the versions `scripts/install-clis` pins, offline. Each CLI is pointed at
//! `tests/stubs/provider_api.py`, a local stand-in for its provider's API
//! that answers with a valid streamed reply, so real turns complete.
//!
//! For each adapter, with the command lines the adapter itself builds and
//! the output read by the adapter itself (`cairn_runner::harness`):
//! - every flag it passes exists (the CLI's own `--help` lists it);
//! - a first turn completes, reports its session id and its answer, and
//!   leaves its conversation under the state directory the adapter points
//!   the CLI at;
//! - after a real cairn checkpoint, the workspace wiped and restored by
//!   `cairn-runner restore` at the same path, the conversation resumes: the
//!   same id, and the provider is sent the first turn's words again;
//! - an unknown id gives what the adapter recognises as a lost
//!   conversation;
//! - a fork (where the adapter forks) reports a new id that remembers the
//!   source.
//!
//! Aider has no ids: its first turn, and a turn after the restore that
//! resends the restored chat history, are checked. OpenHands never says an
//! id is unknown (it opens an empty conversation under it): what is checked
//! is exactly that, and that the adapter's look before a resume tells a
//! real conversation from an unknown id. goose (on no registry reachable
//! here) is not covered by this tier.
//!
//! The CLIs come from `CAIRN_REAL_CLIS` (the directory `scripts/install-clis`
//! prints), else from its default cache; a test fails, saying how to
//! install them, when they are missing. `scripts/test` installs them.

mod hosts;
mod support;

use cairn_runner::harness::TurnRequest;
use support::{Contract, RealCli};

const CODEWORD: &str = "The codeword is HERON-4471.";

/// The checks every adapter that resumes by id goes through.
fn resuming_contract(cli: RealCli) {
    let contract = Contract::new(cli);
    contract.flags_exist();

    let first = contract.turn(TurnRequest::Start {
        message: CODEWORD.into(),
    });
    first.assert_succeeded("the first turn");
    let session = first.session("the first turn");
    assert_eq!(
        first.summary(),
        contract.answer(),
        "the first turn's answer, as the adapter reads it"
    );
    contract.assert_state_holds(&session);

    contract.restore_elsewhere();
    let resumed = contract.turn(TurnRequest::Resume {
        session_id: session.clone(),
        message: "What was the codeword?".into(),
        fork: false,
    });
    resumed.assert_succeeded("the resumed turn");
    assert_eq!(resumed.session("the resumed turn"), session);
    contract.assert_last_request_mentions("HERON-4471", "the resumed turn");

    // An id of the form the CLI gives (OpenHands: hex, the others: UUIDs).
    let unknown = if cli == RealCli::OpenHands {
        "0f0e0d0c0b0a49088706050403020100"
    } else {
        "0f0e0d0c-0b0a-4908-8706-050403020100"
    };
    match contract.harness.has_conversation(unknown) {
        // The adapter looks before it resumes: the CLI would not say.
        Some(known) => {
            assert!(!known, "an unknown id is no conversation");
            assert_eq!(contract.harness.has_conversation(&session), Some(true));
        }
        None => {
            let lost = contract.turn(TurnRequest::Resume {
                session_id: unknown.into(),
                message: "Anyone there?".into(),
                fork: false,
            });
            assert!(
                lost.exit.observed.session_lost,
                "the adapter must read the CLI's answer to an unknown id as a lost conversation: {}",
                lost.describe()
            );
        }
    }

    if contract.harness.can_fork() {
        let forked = contract.turn(TurnRequest::Resume {
            session_id: session.clone(),
            message: "Fork: what was the codeword?".into(),
            fork: true,
        });
        forked.assert_succeeded("the fork");
        assert_ne!(
            forked.session("the fork"),
            session,
            "a fork reports a new id"
        );
        contract.assert_last_request_mentions("HERON-4471", "the fork");
    }
}

#[test]
fn claude() {
    resuming_contract(RealCli::Claude);
}

#[test]
fn codex() {
    resuming_contract(RealCli::Codex);
}

#[test]
fn gemini() {
    resuming_contract(RealCli::Gemini);
}

#[test]
fn opencode() {
    resuming_contract(RealCli::Opencode);
}

#[test]
fn pi() {
    resuming_contract(RealCli::Pi);
}

#[test]
fn openhands() {
    resuming_contract(RealCli::OpenHands);
    // Why the adapter looks first: resumed under an unknown id, the real
    // CLI opens an empty conversation and says nothing.
    let contract = Contract::new(RealCli::OpenHands);
    let silent = contract.turn(TurnRequest::Resume {
        session_id: "0f0e0d0c0b0a49088706050403020100".into(),
        message: "Anyone there?".into(),
        fork: false,
    });
    assert!(
        silent.exit.status.success() && !silent.exit.observed.session_lost,
        "OpenHands now says something about an unknown id; the adapter could read it: {}",
        silent.describe()
    );
}

#[test]
fn aider() {
    let contract = Contract::new(RealCli::Aider);
    contract.flags_exist();
    let first = contract.turn(TurnRequest::Start {
        message: CODEWORD.into(),
    });
    first.assert_succeeded("the first turn");
    assert_eq!(first.summary(), contract.answer());
    contract.assert_state_holds("");

    // No ids: the next conversation starts anew, and --restore-chat-history
    // resends what the restored history holds.
    contract.restore_elsewhere();
    let next = contract.turn(TurnRequest::Start {
        message: "What was the codeword?".into(),
    });
    next.assert_succeeded("the turn after the restore");
    contract.assert_last_request_mentions("HERON-4471", "the turn after the restore");
}
