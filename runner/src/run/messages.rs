//! What the harness is told: the opening turn of an attempt, the message
//! after a person's answer, and the briefings of new conversations — a
//! handover at a new station, a lossy handoff when a conversation cannot be
//! continued — built from the task and the workspace's handoff notes.

use cairn_proto::domain::from_timestamp;
use cairn_proto::pb;
use cairn_proto::stations::{NOT_STATED, NoteField};

use crate::harness::TurnRequest;

/// The label every briefing after a lost conversation starts with.
pub const LOSSY_HANDOFF: &str = "lossy handoff: the earlier conversation could not be resumed";

/// How the first conversation at a new station starts ("Handover from
/// station implement: …"); nothing was lost, so it is not a lossy handoff.
pub const HANDOVER: &str = "Handover from station";

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
/// (the source and each fork would write to one conversation). Without a
/// conversation to continue, a new one opens with a briefing built from the
/// task and the workspace's handoff notes: a handover at a station that
/// never had a conversation, a lossy handoff where one was lost.
pub fn opening_turn(spec: &pb::AttemptSpec, can_resume: bool, can_fork: bool) -> Opening {
    let input_ids: Vec<u64> = spec.inputs.iter().map(|i| i.id).collect();
    let messages = messages_of(spec);
    let session = spec.resume_session_id.trim();
    let question = Some(spec.question.trim()).filter(|q| !q.is_empty());
    let fork = spec.fork_session && !session.is_empty();
    let briefing = Briefing::of(spec, question, &messages);
    let lossy = |why: &str| TurnRequest::Start {
        message: briefing.lossy(why),
    };
    let station = spec.station.as_str();
    let request = if fork && !(can_resume && can_fork) {
        lossy(&format!(
            "the workspace was forked and this harness cannot fork conversation {session}"
        ))
    } else if !session.is_empty() && can_resume {
        // A new run on a station continues the station's conversation, and
        // its task has not been said in it yet; nor what other stations
        // handed over since this station last worked.
        let new_run = !spec.prompt_delivered;
        let task = Some(spec.prompt.clone()).filter(|p| new_run && !p.trim().is_empty());
        let since = Some(notes_since(&spec.notes, station))
            .filter(|notes| new_run && !notes.is_empty())
            .map(|notes| {
                format!(
                    "Since this conversation last ran, other stations handed over (oldest first):\n\n{}",
                    render_notes(notes)
                )
            });
        let said: Vec<String> = task
            .into_iter()
            .chain(since)
            .chain(messages.iter().cloned())
            .collect();
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
        lossy(&format!(
            "this harness cannot continue conversation {session}"
        ))
    } else if !spec.station_session_harness.trim().is_empty() {
        lossy(&format!(
            "station {station}'s conversation belongs to harness {}, and this run uses {}",
            spec.station_session_harness.trim(),
            spec.harness.as_ref().map_or("another", |h| h.name.as_str())
        ))
    } else if question.is_some() {
        lossy("the harness never reported a conversation id")
    } else if spec.notes.iter().any(|n| n.station == station) {
        lossy(&format!(
            "no conversation of station {station} was recorded to resume"
        ))
    } else if !spec.notes.is_empty() {
        TurnRequest::Start {
            message: briefing.handover(),
        }
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

/// The notes written after `station`'s newest one (none when the station
/// wrote none: then nothing tells what its conversation already knows).
fn notes_since<'a>(notes: &'a [pb::HandoffNote], station: &str) -> &'a [pb::HandoffNote] {
    match notes.iter().rposition(|n| n.station == station) {
        Some(last) => &notes[last + 1..],
        None => &[],
    }
}

/// The first message of a new conversation that did not continue one.
#[derive(Debug, Clone, Copy)]
pub struct Briefing<'a> {
    pub station: &'a str,
    pub task: &'a str,
    /// The workspace's handoff notes, oldest first.
    pub notes: &'a [pb::HandoffNote],
    /// The question the agent was waiting on, if any.
    pub question: Option<&'a str>,
    /// The people's messages: answers to the question, chat messages.
    pub answers: &'a [String],
}

impl<'a> Briefing<'a> {
    pub fn of(spec: &'a pb::AttemptSpec, question: Option<&'a str>, answers: &'a [String]) -> Self {
        Self {
            station: &spec.station,
            task: &spec.prompt,
            notes: &spec.notes,
            question,
            answers,
        }
    }

    /// A new conversation because the earlier one was lost (`why`),
    /// labelled as a lossy handoff.
    pub fn lossy(&self, why: &str) -> String {
        let mut out = format!(
            "{LOSSY_HANDOFF} ({why}). This is a new conversation; the workspace holds the work done so far.\n\n\
             The task:\n{}\n",
            self.task.trim()
        );
        self.push_notes(&mut out);
        if let Some(question) = self.question {
            out.push_str(&format!("\nThe question you asked:\n{}\n", question.trim()));
        }
        match self.answers {
            [] => out.push_str("\nCarry on with the task from where the work stands.\n"),
            [answer] => out.push_str(&format!("\nThe answer:\n{}\n", answer.trim())),
            answers => push_list(&mut out, "The answers, oldest first:", answers),
        }
        out
    }

    /// The first conversation at a station, taking over from the station
    /// that wrote the newest note. Nothing was lost: every station keeps its
    /// own conversation, and this one learns the history from the notes.
    pub fn handover(&self) -> String {
        let from = self.notes.last().map_or("", |n| n.station.as_str());
        let mut out = format!(
            "{HANDOVER} {from}: this is the first conversation at station {}. Each station keeps its own \
             conversation; the workspace holds the work as the earlier stations left it (commits, \
             uncommitted changes, other files), and their handoff notes below say what they did.\n\n\
             The task:\n{}\n",
            self.station,
            self.task.trim()
        );
        self.push_notes(&mut out);
        if !self.answers.is_empty() {
            push_list(
                &mut out,
                "Messages for this station, oldest first:",
                self.answers,
            );
        }
        out
    }

    fn push_notes(&self, out: &mut String) {
        if !self.notes.is_empty() {
            out.push_str("\nHandoff notes of earlier runs, oldest first:\n\n");
            out.push_str(&render_notes(self.notes));
        }
    }
}

/// `heading` after a blank line, then each item (trimmed) as `- item`.
fn push_list(out: &mut String, heading: &str, items: &[String]) {
    out.push_str(&format!("\n{heading}\n"));
    for item in items {
        out.push_str(&format!("- {}\n", item.trim()));
    }
}

/// Notes as a briefing shows them.
pub fn render_notes(notes: &[pb::HandoffNote]) -> String {
    notes.iter().map(render_note).collect::<Vec<_>>().join("\n")
}

fn render_note(note: &pb::HandoffNote) -> String {
    let when = note
        .created_at
        .as_ref()
        .filter(|t| t.seconds >= 0)
        .map(|t| format!(", {}", humantime::format_rfc3339_seconds(from_timestamp(t))))
        .unwrap_or_default();
    let mut out = format!(
        "Run {} at station {} (attempt {}, {}{when}):\n",
        note.run_id, note.station, note.attempt, note.outcome
    );
    let none = pb::HandoffText::default();
    let text = note.text.as_ref().unwrap_or(&none);
    let changed_label = if text
        .composed
        .iter()
        .any(|c| c == NoteField::Changed.as_str())
    {
        "changed (from git)"
    } else {
        "changed"
    };
    for (label, value) in [
        ("summary", &text.summary),
        (changed_label, &text.changed),
        ("checked", &text.checked),
        ("uncertain", &text.uncertain),
        ("next", &text.next),
    ] {
        let value = value.trim();
        let value = if value.is_empty() { NOT_STATED } else { value };
        let mut lines = value.lines();
        out.push_str(&format!(
            "  {label}: {}\n",
            lines.next().unwrap_or_default()
        ));
        for line in lines {
            out.push_str(&format!("    {line}\n"));
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

    /// The message of `spec`'s opening turn.
    fn opening_message(spec: &pb::AttemptSpec, can_resume: bool, can_fork: bool) -> String {
        opening_turn(spec, can_resume, can_fork)
            .request
            .message()
            .to_owned()
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
        let message = opening_message(
            &spec(vec![input(4, "answer", "Blue.")], "", "Which colour?"),
            true,
            true,
        );
        assert!(
            message.starts_with(LOSSY_HANDOFF) && message.contains("never reported"),
            "{message}"
        );
    }

    #[test]
    fn several_answers_are_listed() {
        let answers = ["one".to_owned(), "two".to_owned()];
        let briefing = Briefing {
            station: "default",
            task: "Task.",
            notes: &[],
            question: None,
            answers: &answers,
        };
        let text = briefing.lossy("gone");
        assert!(
            text.ends_with("The answers, oldest first:\n- one\n- two\n"),
            "{text}"
        );
        assert!(!text.contains("The question"));
    }

    fn note(run: &str, station: &str, summary: &str, next: &str) -> pb::HandoffNote {
        pb::HandoffNote {
            workspace_id: "ws-1".into(),
            run_id: run.into(),
            station: station.into(),
            attempt: 1,
            harness: "claude".into(),
            outcome: "succeeded".into(),
            checkpoint_id: String::new(),
            created_at: Some(cairn_proto::domain::to_timestamp(
                std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_767_225_600),
            )),
            text: Some(pb::HandoffText {
                summary: summary.into(),
                changed: "app: 1 new commit (abc1234 add the form)\napp2: no new commits".into(),
                checked: "cargo test".into(),
                uncertain: String::new(),
                next: next.into(),
                composed: vec!["changed".into()],
            }),
        }
    }

    #[test]
    fn a_new_station_gets_a_handover_briefing_with_the_notes() {
        let s = pb::AttemptSpec {
            station: "review".into(),
            notes: vec![note("run-1", "implement", "Added the form.", "review it")],
            ..spec(vec![input(1, "prompt", "Build the thing.")], "", "")
        };
        let TurnRequest::Start { message } = opening_turn(&s, true, true).request else {
            panic!("a new conversation at a new station")
        };
        assert_eq!(
            message,
            "Handover from station implement: this is the first conversation at station review. Each \
             station keeps its own conversation; the workspace holds the work as the earlier stations \
             left it (commits, uncommitted changes, other files), and their handoff notes below say \
             what they did.\n\n\
             The task:\nBuild the thing.\n\n\
             Handoff notes of earlier runs, oldest first:\n\n\
             Run run-1 at station implement (attempt 1, succeeded, 2026-01-01T00:00:00Z):\n\
             \x20 summary: Added the form.\n\
             \x20 changed (from git): app: 1 new commit (abc1234 add the form)\n\
             \x20   app2: no new commits\n\
             \x20 checked: cargo test\n\
             \x20 uncertain: not stated\n\
             \x20 next: review it\n"
        );
        assert!(!message.contains(LOSSY_HANDOFF), "nothing was lost");

        // Chat messages for the station come after the notes.
        let with_message = pb::AttemptSpec {
            inputs: vec![input(2, "message", "Look at the tests first.")],
            ..s.clone()
        };
        let message = opening_message(&with_message, true, true);
        assert!(
            message.ends_with(
                "\nMessages for this station, oldest first:\n- Look at the tests first.\n"
            ),
            "{message}"
        );
    }

    #[test]
    fn a_lost_or_unresumable_conversation_gets_a_lossy_briefing_with_the_notes() {
        let notes = vec![
            note("run-1", "implement", "Added the form.", "review it"),
            note("run-2", "review", "Two comments.", "fix them"),
        ];
        // The station's earlier conversation was never recorded.
        let s = pb::AttemptSpec {
            station: "implement".into(),
            notes: notes.clone(),
            ..spec(vec![], "", "")
        };
        let message = opening_message(&s, true, true);
        assert!(
            message.starts_with(&format!(
                "{LOSSY_HANDOFF} (no conversation of station implement was recorded to resume)"
            )),
            "{message}"
        );
        assert!(
            message.contains("Run run-2 at station review") && message.contains("next: fix them")
        );

        // The station's conversation belongs to another harness.
        let switched = pb::AttemptSpec {
            station_session_harness: "codex".into(),
            harness: Some(pb::HarnessSpec {
                name: "claude".into(),
                ..Default::default()
            }),
            ..s.clone()
        };
        let message = opening_message(&switched, true, true);
        assert!(
            message.starts_with(&format!(
                "{LOSSY_HANDOFF} (station implement's conversation belongs to harness codex, and this \
                 run uses claude)"
            )),
            "{message}"
        );

        // A harness that cannot resume: the notes come with the briefing.
        let unresumable = pb::AttemptSpec {
            notes: notes.clone(),
            ..spec(vec![input(4, "answer", "Blue.")], "s-1", "Which colour?")
        };
        let message = opening_message(&unresumable, false, false);
        assert!(message.starts_with(LOSSY_HANDOFF), "{message}");
        let notes_at = message.find("Handoff notes of earlier runs").unwrap();
        let question_at = message.find("The question you asked").unwrap();
        assert!(notes_at < question_at, "{message}");
    }

    #[test]
    fn a_resumed_station_hears_what_other_stations_handed_over_since() {
        let s = pb::AttemptSpec {
            station: "implement".into(),
            prompt_delivered: false,
            notes: vec![
                note("run-1", "implement", "Added the form.", "review it"),
                note("run-2", "review", "Two comments.", "fix them"),
            ],
            ..spec(vec![], "s-1", "")
        };
        let TurnRequest::Resume { message, .. } = opening_turn(&s, true, true).request else {
            panic!("the station's conversation is continued")
        };
        assert!(
            message.starts_with(
                "Build the thing.\n\nSince this conversation last ran, other stations handed over \
                 (oldest first):\n\nRun run-2 at station review"
            ),
            "{message}"
        );
        assert!(!message.contains("run-1"), "{message}");
        // A later attempt of the same run says nothing new.
        let again = pb::AttemptSpec {
            prompt_delivered: true,
            ..s
        };
        assert_eq!(
            opening_turn(&again, true, true).request,
            resume_s1(CARRY_ON, false)
        );
    }
}
