//! What the harness is told: the opening turn of an attempt, the message
//! after a person's answer, and the handoff briefing when a conversation
//! cannot be continued.

use cairn_proto::pb;

use crate::harness::TurnRequest;

/// The label every handoff briefing starts with.
pub const LOSSY_HANDOFF: &str = "lossy handoff: the earlier conversation could not be resumed";

/// Sent when an attempt continues a conversation that nobody answered (its
/// sandbox was lost while the agent worked).
pub const CARRY_ON: &str = "The sandbox this conversation ran in was lost; the workspace was restored from its \
     last checkpoint, so files may be a little older than you remember. Carry on with the task.";

/// The first turn of an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opening {
    pub request: TurnRequest,
    /// The ids of the inputs its message carries.
    pub input_ids: Vec<u64>,
    /// The inputs' texts other than the run's prompt (people's messages).
    pub messages: Vec<String>,
}

/// The first turn of an attempt. A forked workspace's conversation is the
/// source's: it is forked where the harness can fork, and never continued
/// (the source and each fork would write to one conversation).
pub fn opening_turn(spec: &pb::AttemptSpec, can_resume: bool, can_fork: bool) -> Opening {
    let input_ids: Vec<u64> = spec.inputs.iter().map(|i| i.id).collect();
    let messages = messages_of(spec);
    let session = spec.resume_session_id.trim();
    let question = Some(spec.question.trim()).filter(|q| !q.is_empty());
    let fork = spec.fork_session && !session.is_empty();
    let handoff = |why: &str| TurnRequest::Start {
        message: briefing(&spec.prompt, question, &messages, why),
    };
    let request = if fork && !(can_resume && can_fork) {
        handoff(&format!(
            "the workspace was forked and this harness cannot fork conversation {session}"
        ))
    } else if !session.is_empty() && can_resume {
        // A new run on a station continues the station's conversation, and
        // its task has not been said in it yet.
        let task =
            Some(spec.prompt.clone()).filter(|p| !spec.prompt_delivered && !p.trim().is_empty());
        let said: Vec<String> = task.into_iter().chain(messages.iter().cloned()).collect();
        let message = if said.is_empty() {
            CARRY_ON.to_owned()
        } else {
            said.join("\n\n")
        };
        TurnRequest::Resume {
            session_id: session.to_owned(),
            message,
            fork,
        }
    } else if !session.is_empty() {
        handoff(&format!(
            "this harness cannot continue conversation {session}"
        ))
    } else if question.is_some() {
        handoff("the harness never reported a conversation id")
    } else if messages.is_empty() {
        TurnRequest::Start {
            message: spec.prompt.clone(),
        }
    } else {
        TurnRequest::Start {
            message: format!("{}\n\n{}", spec.prompt, messages.join("\n\n")),
        }
    };
    Opening {
        request,
        input_ids,
        messages,
    }
}

/// The texts of the inputs, without the run's own prompt (which the
/// coordinator may hand over as the first input).
fn messages_of(spec: &pb::AttemptSpec) -> Vec<String> {
    spec.inputs
        .iter()
        .filter(|i| !(i.kind == "prompt" && i.text.trim() == spec.prompt.trim()))
        .map(|i| i.text.clone())
        .collect()
}

/// A new conversation's first message when the old one is gone: the task,
/// the open question and the answers, labelled as a lossy handoff.
pub fn briefing(task: &str, question: Option<&str>, answers: &[String], why: &str) -> String {
    let mut out = format!(
        "{LOSSY_HANDOFF} ({why}). This is a new conversation; the workspace holds the work done so far.\n\n\
         The task:\n{}\n",
        task.trim()
    );
    if let Some(question) = question {
        out.push_str(&format!("\nThe question you asked:\n{}\n", question.trim()));
    }
    match answers {
        [] => out.push_str("\nCarry on with the task from where the work stands.\n"),
        [answer] => out.push_str(&format!("\nThe answer:\n{}\n", answer.trim())),
        answers => {
            out.push_str("\nThe answers, oldest first:\n");
            for answer in answers {
                out.push_str(&format!("- {}\n", answer.trim()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(id: u64, kind: &str, text: &str) -> pb::RunInput {
        pb::RunInput {
            id,
            kind: kind.into(),
            text: text.into(),
            created_at: None,
        }
    }

    /// Continuing conversation `s-1` with `message`.
    fn resume_s1(message: &str, fork: bool) -> TurnRequest {
        TurnRequest::Resume {
            session_id: "s-1".into(),
            message: message.into(),
            fork,
        }
    }

    fn spec(inputs: Vec<pb::RunInput>, session: &str, question: &str) -> pb::AttemptSpec {
        pb::AttemptSpec {
            prompt: "Build the thing.".into(),
            inputs,
            resume_session_id: session.into(),
            question: question.into(),
            prompt_delivered: !session.is_empty(),
            ..Default::default()
        }
    }

    #[test]
    fn a_first_attempt_starts_with_the_prompt() {
        let opening = opening_turn(
            &spec(vec![input(1, "prompt", "Build the thing.")], "", ""),
            true,
            true,
        );
        assert_eq!(
            opening.request,
            TurnRequest::Start {
                message: "Build the thing.".into()
            }
        );
        assert_eq!(opening.input_ids, [1]);
        assert!(
            opening.messages.is_empty(),
            "the prompt is not a person's message"
        );
    }

    #[test]
    fn a_suspended_run_resumes_with_the_answers() {
        let s = spec(
            vec![
                input(4, "answer", "Blue."),
                input(5, "answer", "And round."),
            ],
            "s-1",
            "Which colour?",
        );
        let opening = opening_turn(&s, true, true);
        assert_eq!(opening.request, resume_s1("Blue.\n\nAnd round.", false));
        assert_eq!(opening.input_ids, [4, 5]);
        assert_eq!(opening.messages, ["Blue.", "And round."]);
        let lost = opening_turn(&spec(vec![], "s-1", ""), true, true).request;
        assert_eq!(lost, resume_s1(CARRY_ON, false));
    }

    #[test]
    fn a_new_run_on_a_station_tells_the_resumed_conversation_its_task() {
        let s = pb::AttemptSpec {
            prompt_delivered: false,
            ..spec(vec![], "s-1", "")
        };
        assert_eq!(
            opening_turn(&s, true, true).request,
            resume_s1("Build the thing.", false)
        );
    }

    #[test]
    fn a_forked_workspace_forks_the_conversation_or_starts_with_a_briefing() {
        let s = pb::AttemptSpec {
            prompt_delivered: false,
            fork_session: true,
            ..spec(vec![], "s-1", "")
        };
        assert_eq!(
            opening_turn(&s, true, true).request,
            resume_s1("Build the thing.", true)
        );
        for (can_resume, can_fork) in [(true, false), (false, false)] {
            let TurnRequest::Start { message } = opening_turn(&s, can_resume, can_fork).request
            else {
                panic!("a harness that cannot fork starts a new conversation")
            };
            assert!(message.starts_with(LOSSY_HANDOFF), "{message}");
            assert!(
                message.contains("cannot fork conversation s-1")
                    && message.contains("Build the thing."),
                "{message}"
            );
        }
        let no_session = pb::AttemptSpec {
            fork_session: true,
            ..spec(vec![], "", "")
        };
        assert_eq!(
            opening_turn(&no_session, true, true).request,
            TurnRequest::Start {
                message: "Build the thing.".into()
            },
            "nothing to fork: a plain start"
        );
    }

    #[test]
    fn a_conversation_that_cannot_continue_gets_a_briefing() {
        let s = spec(vec![input(4, "answer", "Blue.")], "s-1", "Which colour?");
        let TurnRequest::Start { message } = opening_turn(&s, false, false).request else {
            panic!("a new conversation")
        };
        assert_eq!(
            message,
            "lossy handoff: the earlier conversation could not be resumed (this harness cannot continue \
             conversation s-1). This is a new conversation; the workspace holds the work done so far.\n\n\
             The task:\nBuild the thing.\n\nThe question you asked:\nWhich colour?\n\nThe answer:\nBlue.\n"
        );
        let turn = opening_turn(
            &spec(vec![input(4, "answer", "Blue.")], "", "Which colour?"),
            true,
            true,
        )
        .request;
        assert!(
            turn.message().starts_with(LOSSY_HANDOFF) && turn.message().contains("never reported")
        );
    }

    #[test]
    fn several_answers_are_listed() {
        let text = briefing("Task.", None, &["one".into(), "two".into()], "gone");
        assert!(
            text.ends_with("The answers, oldest first:\n- one\n- two\n"),
            "{text}"
        );
        assert!(!text.contains("The question"));
    }
}
