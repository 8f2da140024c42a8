//! What the demo proves, checked against the finished run and its events:
//! the first host was lost, the run resumed on the other host from a
//! checkpoint of the first attempt, the conversation went on under the same
//! session id, and the agent remembered the codeword of its first turn.

use cairn_proto::pb;
use serde_json::{Value, json};

use super::super::output;

/// One check and what was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    pub detail: String,
}

impl Check {
    fn new(name: impl Into<String>, passed: bool, detail: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            passed,
            detail: detail.into(),
        }
    }

    pub fn to_json(&self) -> Value {
        json!({"name": self.name, "passed": self.passed, "detail": self.detail})
    }
}

/// What the checks compare the run with.
#[derive(Debug, Clone)]
pub struct Expected<'a> {
    /// The host of the first attempt (the one the demo kills), and its role.
    pub lost_host: (&'a str, &'a str),
    /// The host the run should resume on, and its role.
    pub other_host: (&'a str, &'a str),
    /// The session id the first attempt reported.
    pub session_id: &'a str,
    pub codeword: &'a str,
}

/// Runs every check on the finished `run` and all its `events`.
pub fn check(run: &pb::Run, events: &[pb::RunEvent], expected: &Expected<'_>) -> Vec<Check> {
    let (lost_id, lost_role) = expected.lost_host;
    let (other_id, other_role) = expected.other_host;
    let first = run.attempts.first();
    let last = run.attempts.last().filter(|a| a.number > 1);
    let mut checks = Vec::new();

    checks.push(Check::new(
        "the run succeeded",
        run.state == pb::RunState::Succeeded as i32,
        format!(
            "state {}{}",
            output::run_state(run.state),
            if run.state_reason.is_empty() {
                String::new()
            } else {
                format!(" ({})", run.state_reason)
            }
        ),
    ));

    checks.push(match first {
        Some(a) => Check::new(
            format!("host {lost_role} was lost and its attempt ended"),
            a.host_id == lost_id && a.end_reason == "host_lost",
            format!(
                "attempt {} on {} ended: {}",
                a.number,
                host_text(&a.host_id, expected),
                output::or_dash(&a.end_reason)
            ),
        ),
        None => Check::new(
            format!("host {lost_role} was lost and its attempt ended"),
            false,
            "the run has no attempts",
        ),
    });

    checks.push(match last {
        Some(a) => Check::new(
            format!("the resumed attempt ran on host {other_role}"),
            a.host_id == other_id,
            format!(
                "attempt {} ran on {}",
                a.number,
                host_text(&a.host_id, expected)
            ),
        ),
        None => Check::new(
            format!("the resumed attempt ran on host {other_role}"),
            false,
            format!(
                "the run had {} attempt(s); it never resumed",
                run.attempts.len()
            ),
        ),
    });

    let first_checkpoints: Vec<&str> = events
        .iter()
        .filter(|e| e.attempt == 1 && !e.checkpoint_id.is_empty())
        .map(|e| e.checkpoint_id.as_str())
        .collect();
    checks.push(match last {
        Some(a) if a.restored_checkpoint_id.is_empty() => Check::new(
            "it restored a checkpoint of the first attempt",
            false,
            format!(
                "attempt {} restored nothing: {}",
                a.number,
                output::or_dash(&a.prepare)
            ),
        ),
        Some(a) => Check::new(
            "it restored a checkpoint of the first attempt",
            first_checkpoints.contains(&a.restored_checkpoint_id.as_str()),
            format!(
                "attempt {} restored {} ({})",
                a.number,
                a.restored_checkpoint_id,
                if first_checkpoints.contains(&a.restored_checkpoint_id.as_str()) {
                    "cut by attempt 1".to_owned()
                } else {
                    format!("attempt 1 cut {}", first_checkpoints.join(", "))
                }
            ),
        ),
        None => Check::new(
            "it restored a checkpoint of the first attempt",
            false,
            "there was no resumed attempt",
        ),
    });

    let session = expected.session_id;
    let resumed = last.and_then(|a| {
        events.iter().find(|e| {
            e.attempt == a.number
                && e.detail.contains("resumed")
                && !session.is_empty()
                && e.detail.contains(session)
        })
    });
    let session_passed =
        !session.is_empty() && run.harness_session_id == session && resumed.is_some();
    let session_detail = match (session.is_empty(), resumed) {
        (true, _) => "the first attempt reported no session id".to_owned(),
        (false, Some(e)) if run.harness_session_id == session => {
            format!("session {session}: {}", e.detail)
        }
        (false, Some(_)) => format!(
            "the first attempt's session was {session}, the run's is now {}",
            output::or_dash(&run.harness_session_id)
        ),
        (false, None) => format!(
            "no event of the resumed attempt says it resumed conversation {session}; the run's session is {}",
            output::or_dash(&run.harness_session_id)
        ),
    };
    checks.push(Check::new(
        "the conversation resumed with the same session id",
        session_passed,
        session_detail,
    ));

    checks.push(Check::new(
        format!("the agent remembered the codeword {}", expected.codeword),
        run.summary.contains(expected.codeword),
        format!("summary: {}", output::or_dash(&run.summary)),
    ));
    checks
}

fn host_text(id: &str, expected: &Expected<'_>) -> String {
    if id == expected.lost_host.0 {
        format!("host {} ({id})", expected.lost_host.1)
    } else if id == expected.other_host.0 {
        format!("host {} ({id})", expected.other_host.1)
    } else {
        output::or_dash(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SESSION: &str = "0b7f3c1e-0000-4000-8000-000000000001";

    fn expected() -> Expected<'static> {
        Expected {
            lost_host: ("host-a", "A"),
            other_host: ("host-b", "B"),
            session_id: SESSION,
            codeword: "KESTREL",
        }
    }

    fn event(attempt: u32, reason: &str, checkpoint: &str, detail: &str) -> pb::RunEvent {
        pb::RunEvent {
            attempt,
            reason: reason.into(),
            checkpoint_id: checkpoint.into(),
            detail: detail.into(),
            ..Default::default()
        }
    }

    fn resumed_run() -> (pb::Run, Vec<pb::RunEvent>) {
        let run = pb::Run {
            state: pb::RunState::Succeeded as i32,
            harness_session_id: SESSION.into(),
            summary: "the codeword was KESTREL".into(),
            attempts: vec![
                pb::Attempt {
                    number: 1,
                    host_id: "host-a".into(),
                    end_reason: "host_lost".into(),
                    ..Default::default()
                },
                pb::Attempt {
                    number: 2,
                    host_id: "host-b".into(),
                    restored_checkpoint_id: "ck-2".into(),
                    prepare: "restored ck-2".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let events = vec![
            event(1, "checkpoint", "ck-1", ""),
            event(1, "checkpoint", "ck-2", ""),
            event(2, "restored", "ck-2", "restored ck-2"),
            event(
                2,
                "harness_started",
                "",
                &format!("claude resumed conversation {SESSION} in /workspace"),
            ),
        ];
        (run, events)
    }

    #[test]
    fn a_run_that_resumed_elsewhere_passes_every_check() {
        let (run, events) = resumed_run();
        let checks = check(&run, &events, &expected());
        assert_eq!(checks.len(), 6);
        assert!(checks.iter().all(|c| c.passed), "{checks:#?}");
    }

    #[test]
    fn each_broken_promise_fails_its_own_check() {
        let failed = |run: &pb::Run, events: &[pb::RunEvent]| -> Vec<String> {
            check(run, events, &expected())
                .into_iter()
                .filter(|c| !c.passed)
                .map(|c| c.name)
                .collect()
        };

        let (mut run, events) = resumed_run();
        run.attempts[1].host_id = "host-a".into();
        assert_eq!(failed(&run, &events), ["the resumed attempt ran on host B"]);

        let (mut run, events) = resumed_run();
        run.attempts[1].restored_checkpoint_id.clear();
        assert_eq!(
            failed(&run, &events),
            ["it restored a checkpoint of the first attempt"]
        );

        // A new conversation (a lossy handoff) still knows the codeword from
        // the briefing, but it is not the same session.
        let (run, mut events) = resumed_run();
        events[3].detail = "claude started a new conversation in /workspace".into();
        assert_eq!(
            failed(&run, &events),
            ["the conversation resumed with the same session id"]
        );

        let (mut run, events) = resumed_run();
        run.summary = "the first message said nothing about codeword".into();
        assert_eq!(
            failed(&run, &events),
            ["the agent remembered the codeword KESTREL"]
        );

        let (mut run, events) = resumed_run();
        run.attempts.truncate(1);
        run.state = pb::RunState::Suspended as i32;
        let failures = failed(&run, &events);
        assert!(
            failures.contains(&"the run succeeded".to_owned()),
            "{failures:?}"
        );
        assert!(
            failures.contains(&"the resumed attempt ran on host B".to_owned()),
            "{failures:?}"
        );
    }
}
