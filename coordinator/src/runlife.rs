//! The life of a run as a transition table, apart from the database.
//!
//! [`next`] says what an [`Event`] does to a run in a [`RunState`]: the run
//! enters a state ([`Change::Enter`], its own again for a new question) or
//! stays where it is ([`Change::Stay`]), and the database then carries out
//! the [`Effect`]s, in order. Every other pair is an [`IllegalTransition`].
//! [`next_step`] is the policy that decides what the end of an attempt
//! (without an outcome) makes of its run. `db` asks these two and persists
//! their answers; nothing here reads or writes anything.
//!
//! A run is created queued ([`INITIAL`]). Assigned, starting, running and
//! waiting are the *live* states: a run in one holds exactly one attempt that
//! has not ended. Queued, suspended and the terminal states hold none. In
//! short:
//!
//! ```text
//! queued ─assigned─► assigned ─claimed─► starting ─harness running─► running ─question asked─► waiting
//!   ▲                                                                                │ hold expired / suspend
//!   │◄──── attempt ended, retried: host lost, runner exited, drained (attempts left) ─┤ (sandbox gone: released)
//!   │                                                                                ▼
//!   └───────────────────────────────── input arrived ◄──────────────────────────── suspended
//! any but terminal ─cancel requested─► cancelled; finished ─► succeeded | failed;
//! failures reaching max_attempts ─► failed
//! ```
//!
//! The table, event by event:
//!
//! - **assigned** (the scheduler placed the run): queued → assigned.
//! - **workspace inactive** (found when placing it): queued → failed.
//! - **claimed** (the runner started): assigned → starting.
//! - **harness running**: assigned, starting or waiting → running, and the
//!   question is cleared; running stays (a later turn).
//! - **question asked** (the agent waits for a person, its sandbox held):
//!   any live state → waiting (from waiting: a new question and hold).
//! - **finished** (the runner reported succeeded or failed): any live state
//!   → succeeded or failed.
//! - **input arrived** (an answer or a message): waiting (its sandbox held)
//!   stays: the held runner gets it, or the next attempt does; suspended →
//!   queued.
//! - **suspend requested**: queued → suspended; a live state stays and
//!   orders its sandbox destroyed (`suspended`).
//! - **hold expired**: waiting stays and orders its sandbox destroyed
//!   (`hold_expired`).
//! - **host draining** / **host stopping**: a live state stays and orders its
//!   sandbox destroyed (`draining` / `host_stopping`).
//! - **cancel requested**: any state but a terminal one → cancelled; a live
//!   one also orders its sandbox destroyed (`cancelled`).
//! - **attempt ended, released** ([`NextStep::Release`]): a live state →
//!   queued when an input no harness heard is pending, else suspended.
//! - **attempt ended, retried** ([`NextStep::Requeue`]): assigned, starting
//!   or running → queued. A failure is counted, and once the failed attempts
//!   reach `max_attempts` the run goes to failed instead. A waiting run is
//!   never retried (the policy releases it).
//! - Succeeded, failed and cancelled runs take no event at all.
//!
//! Two effects follow from where the run goes: leaving waiting clears the
//! hold, and entering a terminal state gives the messages no harness heard
//! back to the workspace.
//!
//! The policy, for an attempt that ended without an outcome (its sandbox is
//! gone or its host lost): a terminal run does nothing more. A sandbox
//! destroyed because the run was suspended or its hold expired releases the
//! run, as does any end of a waiting run's attempt. Any other destroy order
//! (draining, a stopping host) requeues it without counting a failure, as
//! does a runner that reported `interrupted` before it stopped. Anything
//! else (the runner exited, the sandbox failed, the host was lost) requeues
//! it and counts a failure.
//!
//! What the table does not see is decided before it is asked: requests that
//! find the run where they would take it (cancel a cancelled run, suspend a
//! suspended one), a runner's claim, running and waiting reports once its
//! sandbox is being destroyed or its run ended (recorded, but they no longer
//! move the run; an outcome still does), and an outcome reported for a run
//! that already ended (recorded only).

use std::time::{Duration, SystemTime};

use cairn_proto::runs::{Outcome, RunState};

/// Why a host is told to destroy a sandbox (`DestroyOrder.reason`).
pub mod destroy_reason {
    pub const HOLD_EXPIRED: &str = "hold_expired";
    pub const CANCELLED: &str = "cancelled";
    pub const SUSPENDED: &str = "suspended";
    pub const DRAINING: &str = "draining";
    /// The host agent is shutting down.
    pub const HOST_STOPPING: &str = "host_stopping";
    /// The attempt was ended while the host was away (lost, or restarted).
    pub const SUPERSEDED: &str = "superseded";
    /// The coordinator knows no such sandbox on this host.
    pub const UNKNOWN: &str = "unknown";
}

/// The state of a new run.
pub const INITIAL: RunState = RunState::Queued;

/// Something that happens to a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The scheduler assigned the run to a host (a new attempt).
    Assigned,
    /// The scheduler found the run's workspace no longer active.
    WorkspaceInactive,
    /// The runner of the attempt claimed it.
    Claimed,
    /// The runner reports its harness running: its first turn, the turn
    /// after an answer, or a later one.
    HarnessRunning,
    /// The agent asked a person; the runner holds the sandbox.
    QuestionAsked,
    /// The runner reported how the work ended: succeeded or failed.
    Finished { succeeded: bool },
    /// A person sent an answer or a message. `sandbox_held`: the run has a
    /// live attempt (as a waiting run always does and a suspended one never).
    InputArrived { sandbox_held: bool },
    /// Someone asked to suspend the run.
    SuspendRequested,
    /// A waiting run's hold ran out.
    HoldExpired,
    /// The operator drains the host of the run's attempt.
    HostDraining,
    /// The host agent of the run's attempt is shutting down.
    HostStopping,
    /// Someone cancelled the run.
    CancelRequested,
    /// The run's attempt ended without an outcome, and [`next_step`] said
    /// what follows.
    AttemptEnded(AttemptEnd),
}

/// What follows an attempt's end, with what the move depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptEnd {
    /// [`NextStep::Release`]: the run waits for a person, unless an input
    /// (an answer, a message) no harness heard is pending already.
    Released { input_pending: bool },
    /// [`NextStep::Requeue`]: the run is retried; `failure` counts against
    /// `max_attempts`. `failed_attempts` is the count before this attempt.
    Retried {
        failure: bool,
        failed_attempts: u32,
        max_attempts: u32,
    },
}

/// Whether the run changes state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// The run enters this state (the database writes it and its reason).
    Enter(RunState),
    /// The run stays in its state.
    Stay,
}

/// What the database does after it wrote the change and recorded the event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Clear the hold: the run left waiting. Written with the state.
    ClearHold,
    /// Clear the agent's question: the harness runs again.
    ClearQuestion,
    /// Count the ended attempt as failed (`failed_attempts` + 1).
    CountFailedAttempt,
    /// Give the messages no harness heard back to the workspace.
    GiveBackMessages,
    /// Order the sandbox of the run's live attempt destroyed for this
    /// reason (a [`destroy_reason`]); an earlier order's reason stays.
    OrderDestroy(&'static str),
}

/// A legal answer of [`next`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub from: RunState,
    pub change: Change,
    pub effects: Vec<Effect>,
}

impl Transition {
    /// The run's state afterwards.
    pub fn to(&self) -> RunState {
        match self.change {
            Change::Enter(state) => state,
            Change::Stay => self.from,
        }
    }

    /// Whether the run enters a state (rather than staying in its own).
    pub fn enters(&self) -> bool {
        matches!(self.change, Change::Enter(_))
    }
}

/// An event a run in state `from` cannot take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a {from} run cannot take event {event:?}")]
pub struct IllegalTransition {
    pub from: RunState,
    pub event: Event,
}

/// The states in which a run holds a live attempt.
pub fn is_live(state: RunState) -> bool {
    matches!(
        state,
        RunState::Assigned | RunState::Starting | RunState::Running | RunState::Waiting
    )
}

/// What `event` does to a run in state `from` (see the module's table).
pub fn next(from: RunState, event: Event) -> Result<Transition, IllegalTransition> {
    use RunState as S;
    let illegal = IllegalTransition { from, event };
    if from.is_terminal() {
        return Err(illegal);
    }
    let live = is_live(from);
    let (change, order) = match event {
        Event::Assigned if from == S::Queued => (Change::Enter(S::Assigned), None),
        Event::WorkspaceInactive if from == S::Queued => (Change::Enter(S::Failed), None),
        Event::Claimed if from == S::Assigned => (Change::Enter(S::Starting), None),
        Event::HarnessRunning if from == S::Running => (Change::Stay, None),
        Event::HarnessRunning if live => (Change::Enter(S::Running), None),
        Event::QuestionAsked if live => (Change::Enter(S::Waiting), None),
        Event::Finished { succeeded } if live => {
            let to = if succeeded { S::Succeeded } else { S::Failed };
            (Change::Enter(to), None)
        }
        Event::InputArrived { sandbox_held: true } if from == S::Waiting => (Change::Stay, None),
        Event::InputArrived {
            sandbox_held: false,
        } if from == S::Suspended => (Change::Enter(S::Queued), None),
        Event::SuspendRequested if from == S::Queued => (Change::Enter(S::Suspended), None),
        Event::SuspendRequested if live => (Change::Stay, Some(destroy_reason::SUSPENDED)),
        Event::HoldExpired if from == S::Waiting => {
            (Change::Stay, Some(destroy_reason::HOLD_EXPIRED))
        }
        Event::HostDraining if live => (Change::Stay, Some(destroy_reason::DRAINING)),
        Event::HostStopping if live => (Change::Stay, Some(destroy_reason::HOST_STOPPING)),
        Event::CancelRequested => (
            Change::Enter(S::Cancelled),
            live.then_some(destroy_reason::CANCELLED),
        ),
        Event::AttemptEnded(AttemptEnd::Released { input_pending }) if live => {
            let to = if input_pending {
                S::Queued
            } else {
                S::Suspended
            };
            (Change::Enter(to), None)
        }
        Event::AttemptEnded(AttemptEnd::Retried {
            failure,
            failed_attempts,
            max_attempts,
        }) if live && from != S::Waiting => {
            let gave_up = failure && failed_attempts.saturating_add(1) >= max_attempts;
            let to = if gave_up { S::Failed } else { S::Queued };
            (Change::Enter(to), None)
        }
        _ => return Err(illegal),
    };
    let mut effects = Vec::new();
    if let Change::Enter(to) = change {
        if from == S::Waiting && to != S::Waiting {
            effects.push(Effect::ClearHold);
        }
        if event == Event::HarnessRunning {
            effects.push(Effect::ClearQuestion);
        }
        if let Event::AttemptEnded(AttemptEnd::Retried { failure: true, .. }) = event {
            effects.push(Effect::CountFailedAttempt);
        }
        if to.is_terminal() {
            effects.push(Effect::GiveBackMessages);
        }
    }
    if let Some(reason) = order {
        effects.push(Effect::OrderDestroy(reason));
    }
    Ok(Transition {
        from,
        change,
        effects,
    })
}

/// What a run does after its attempt ended without an outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextStep {
    /// Released to wait for a person ([`AttemptEnd::Released`]).
    Release,
    /// Queued again; `failure` counts it against max_attempts
    /// ([`AttemptEnd::Retried`]).
    Requeue { failure: bool },
    /// The run is terminal already; only the attempt ends.
    Nothing,
}

/// The policy for an attempt that ended without an outcome, in a run in
/// `state`: `destroy_order` is the reason of the order that destroyed its
/// sandbox (a [`destroy_reason`]), if there was one; `interrupted`, whether
/// its runner reported the outcome interrupted before it stopped.
pub fn next_step(state: RunState, destroy_order: Option<&str>, interrupted: bool) -> NextStep {
    if state.is_terminal() {
        return NextStep::Nothing;
    }
    let waiting = state == RunState::Waiting;
    match destroy_order {
        Some(destroy_reason::SUSPENDED | destroy_reason::HOLD_EXPIRED) => NextStep::Release,
        Some(_) if waiting => NextStep::Release,
        // Drained or superseded: the operator's doing, not a failure.
        Some(_) => NextStep::Requeue { failure: false },
        // The runner stops on its own when the hold runs out.
        None if waiting => NextStep::Release,
        // A runner that checkpointed and reported before stopping lost nothing.
        None if interrupted => NextStep::Requeue { failure: false },
        None => NextStep::Requeue { failure: true },
    }
}

/// How much of the attempt before work a restore cannot bring back: the
/// time from the restored checkpoint (or, with none restored, from that
/// attempt's start) to its end, when it ended without its runner reporting
/// an outcome — its host was lost, its sandbox failed or its runner died,
/// so no checkpoint was cut as it stopped. `None` when the attempt before
/// reported one (its last checkpoint is what it left) or has not ended.
pub fn unsaved_window(
    previous_outcome: Option<Outcome>,
    previous_started_at: SystemTime,
    previous_ended_at: Option<SystemTime>,
    restored_taken_at: Option<SystemTime>,
) -> Option<Duration> {
    if previous_outcome.is_some() {
        return None;
    }
    let ended = previous_ended_at?;
    let from = restored_taken_at.unwrap_or(previous_started_at);
    ended.duration_since(from).ok().filter(|d| !d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    use RunState as S;

    const RELEASED: Event = Event::AttemptEnded(AttemptEnd::Released {
        input_pending: false,
    });
    const RELEASED_TO_ANSWER: Event = Event::AttemptEnded(AttemptEnd::Released {
        input_pending: true,
    });
    const DRAINED: Event = Event::AttemptEnded(AttemptEnd::Retried {
        failure: false,
        failed_attempts: 2,
        max_attempts: 3,
    });
    const CRASHED: Event = Event::AttemptEnded(AttemptEnd::Retried {
        failure: true,
        failed_attempts: 1,
        max_attempts: 3,
    });
    const CRASHED_LAST: Event = Event::AttemptEnded(AttemptEnd::Retried {
        failure: true,
        failed_attempts: 2,
        max_attempts: 3,
    });

    /// Every event, with each payload that leads somewhere else.
    const EVENTS: [Event; 19] = [
        Event::Assigned,
        Event::WorkspaceInactive,
        Event::Claimed,
        Event::HarnessRunning,
        Event::QuestionAsked,
        Event::Finished { succeeded: true },
        Event::Finished { succeeded: false },
        Event::InputArrived { sandbox_held: true },
        Event::InputArrived {
            sandbox_held: false,
        },
        Event::SuspendRequested,
        Event::HoldExpired,
        Event::HostDraining,
        Event::HostStopping,
        Event::CancelRequested,
        RELEASED,
        RELEASED_TO_ANSWER,
        DRAINED,
        CRASHED,
        CRASHED_LAST,
    ];

    const LIVE: [RunState; 4] = [S::Assigned, S::Starting, S::Running, S::Waiting];

    fn enter(to: RunState, effects: &[Effect]) -> (Change, Vec<Effect>) {
        (Change::Enter(to), effects.to_vec())
    }

    fn stay(effects: &[Effect]) -> (Change, Vec<Effect>) {
        (Change::Stay, effects.to_vec())
    }

    /// The legal answer for (`from`, `event`), written out case by case.
    fn expected(from: RunState, event: Event) -> Option<(Change, Vec<Effect>)> {
        use Effect::*;
        let live = LIVE.contains(&from);
        // Leaving waiting clears the hold.
        let leave = |rest: &[Effect]| {
            let mut effects = if from == S::Waiting {
                vec![ClearHold]
            } else {
                Vec::new()
            };
            effects.extend_from_slice(rest);
            effects
        };
        Some(match (event, from) {
            (Event::Assigned, S::Queued) => enter(S::Assigned, &[]),
            (Event::WorkspaceInactive, S::Queued) => enter(S::Failed, &[GiveBackMessages]),
            (Event::Claimed, S::Assigned) => enter(S::Starting, &[]),
            (Event::HarnessRunning, S::Assigned | S::Starting) => {
                enter(S::Running, &[ClearQuestion])
            }
            (Event::HarnessRunning, S::Waiting) => enter(S::Running, &[ClearHold, ClearQuestion]),
            (Event::HarnessRunning, S::Running) => stay(&[]),
            (Event::QuestionAsked, _) if live => enter(S::Waiting, &[]),
            (Event::Finished { succeeded: true }, _) if live => {
                (Change::Enter(S::Succeeded), leave(&[GiveBackMessages]))
            }
            (Event::Finished { succeeded: false }, _) if live => {
                (Change::Enter(S::Failed), leave(&[GiveBackMessages]))
            }
            (Event::InputArrived { sandbox_held: true }, S::Waiting) => stay(&[]),
            (
                Event::InputArrived {
                    sandbox_held: false,
                },
                S::Suspended,
            ) => enter(S::Queued, &[]),
            (Event::SuspendRequested, S::Queued) => enter(S::Suspended, &[]),
            (Event::SuspendRequested, _) if live => {
                stay(&[OrderDestroy(destroy_reason::SUSPENDED)])
            }
            (Event::HoldExpired, S::Waiting) => stay(&[OrderDestroy(destroy_reason::HOLD_EXPIRED)]),
            (Event::HostDraining, _) if live => stay(&[OrderDestroy(destroy_reason::DRAINING)]),
            (Event::HostStopping, _) if live => {
                stay(&[OrderDestroy(destroy_reason::HOST_STOPPING)])
            }
            (Event::CancelRequested, S::Queued | S::Suspended) => {
                enter(S::Cancelled, &[GiveBackMessages])
            }
            (Event::CancelRequested, _) if live => (
                Change::Enter(S::Cancelled),
                leave(&[GiveBackMessages, OrderDestroy(destroy_reason::CANCELLED)]),
            ),
            (RELEASED, _) if live => (Change::Enter(S::Suspended), leave(&[])),
            (RELEASED_TO_ANSWER, _) if live => (Change::Enter(S::Queued), leave(&[])),
            (DRAINED, S::Assigned | S::Starting | S::Running) => enter(S::Queued, &[]),
            (CRASHED, S::Assigned | S::Starting | S::Running) => {
                enter(S::Queued, &[CountFailedAttempt])
            }
            (CRASHED_LAST, S::Assigned | S::Starting | S::Running) => {
                enter(S::Failed, &[CountFailedAttempt, GiveBackMessages])
            }
            _ => return None,
        })
    }

    #[test]
    fn the_table_holds_exactly_the_legal_transitions() {
        let mut legal = 0;
        for &from in RunState::ALL {
            for event in EVENTS {
                let got = next(from, event);
                match expected(from, event) {
                    Some((change, effects)) => {
                        legal += 1;
                        let want = Transition {
                            from,
                            change,
                            effects,
                        };
                        assert_eq!(got, Ok(want), "{from} on {event:?}");
                    }
                    None => assert_eq!(
                        got,
                        Err(IllegalTransition { from, event }),
                        "{from} on {event:?} must be illegal"
                    ),
                }
            }
        }
        // Written out so that a change of the table is a change of this test.
        assert_eq!(legal, 58);
    }

    #[test]
    fn terminal_runs_take_no_event() {
        for from in [S::Succeeded, S::Failed, S::Cancelled] {
            for event in EVENTS {
                assert!(next(from, event).is_err(), "{from} on {event:?}");
            }
        }
    }

    #[test]
    fn a_run_holds_an_attempt_exactly_in_the_live_states() {
        // Entering a live state takes an attempt (assigned) or keeps one;
        // leaving them all ends it or orders it destroyed.
        for &from in RunState::ALL {
            for event in EVENTS {
                let Ok(t) = next(from, event) else { continue };
                let to = t.to();
                if is_live(to) && !is_live(from) {
                    assert_eq!(event, Event::Assigned, "{from} → {to} on {event:?}");
                }
                if is_live(from) && !is_live(to) {
                    let ends = matches!(
                        event,
                        Event::Finished { .. } | Event::AttemptEnded(_) | Event::CancelRequested
                    );
                    assert!(ends, "{from} → {to} on {event:?}");
                }
            }
        }
    }

    #[test]
    fn only_waiting_runs_hold_their_sandbox_and_leaving_waiting_clears_the_hold() {
        for &from in RunState::ALL {
            for event in EVENTS {
                let Ok(t) = next(from, event) else { continue };
                let clears = t.effects.contains(&Effect::ClearHold);
                assert_eq!(
                    clears,
                    from == S::Waiting && t.to() != S::Waiting,
                    "{from} on {event:?}"
                );
                let gives_back = t.effects.contains(&Effect::GiveBackMessages);
                assert_eq!(gives_back, t.to().is_terminal(), "{from} on {event:?}");
            }
        }
    }

    #[test]
    fn a_suspended_or_expired_hold_releases_the_run() {
        for &state in &LIVE {
            for order in [destroy_reason::SUSPENDED, destroy_reason::HOLD_EXPIRED] {
                assert_eq!(next_step(state, Some(order), false), NextStep::Release);
                assert_eq!(next_step(state, Some(order), true), NextStep::Release);
            }
        }
    }

    #[test]
    fn a_drained_run_is_requeued_without_a_failure() {
        for state in [S::Assigned, S::Starting, S::Running] {
            for order in [destroy_reason::DRAINING, destroy_reason::HOST_STOPPING] {
                assert_eq!(
                    next_step(state, Some(order), false),
                    NextStep::Requeue { failure: false }
                );
            }
        }
    }

    #[test]
    fn a_runner_that_crashed_costs_an_attempt_and_an_interrupted_one_does_not() {
        for state in [S::Assigned, S::Starting, S::Running] {
            assert_eq!(
                next_step(state, None, false),
                NextStep::Requeue { failure: true }
            );
            assert_eq!(
                next_step(state, None, true),
                NextStep::Requeue { failure: false }
            );
        }
    }

    #[test]
    fn a_waiting_run_is_released_whatever_ended_its_attempt() {
        for order in [
            None,
            Some(destroy_reason::DRAINING),
            Some(destroy_reason::HOST_STOPPING),
            Some(destroy_reason::SUPERSEDED),
        ] {
            for interrupted in [false, true] {
                assert_eq!(
                    next_step(S::Waiting, order, interrupted),
                    NextStep::Release,
                    "{order:?}"
                );
            }
        }
    }

    #[test]
    fn a_terminal_run_does_nothing_when_its_attempt_ends() {
        for state in [S::Succeeded, S::Failed, S::Cancelled] {
            for order in [None, Some(destroy_reason::CANCELLED)] {
                assert_eq!(next_step(state, order, false), NextStep::Nothing);
            }
        }
    }

    #[test]
    fn failures_up_to_max_attempts_fail_the_run() {
        let retried = |failure, failed_attempts, max_attempts| {
            let event = Event::AttemptEnded(AttemptEnd::Retried {
                failure,
                failed_attempts,
                max_attempts,
            });
            next(S::Running, event).map(|t| t.to())
        };
        assert_eq!(retried(true, 0, 3), Ok(S::Queued));
        assert_eq!(retried(true, 1, 3), Ok(S::Queued));
        assert_eq!(retried(true, 2, 3), Ok(S::Failed));
        assert_eq!(retried(true, 0, 1), Ok(S::Failed));
        // Not counted: the limit is not reached by this attempt.
        assert_eq!(retried(false, 2, 3), Ok(S::Queued));
        assert_eq!(retried(false, 5, 3), Ok(S::Queued));
        assert_eq!(retried(true, u32::MAX, u32::MAX), Ok(S::Failed));
    }

    #[test]
    fn a_released_run_with_a_pending_answer_is_queued_at_once() {
        for &state in &LIVE {
            let to = |input_pending| {
                next(
                    state,
                    Event::AttemptEnded(AttemptEnd::Released { input_pending }),
                )
                .map(|t| t.to())
            };
            assert_eq!(to(true), Ok(S::Queued));
            assert_eq!(to(false), Ok(S::Suspended));
        }
    }

    #[test]
    fn illegal_transitions_say_what_was_refused() {
        let err = next(S::Queued, Event::Claimed).unwrap_err();
        assert_eq!(err.to_string(), "a queued run cannot take event Claimed");
    }

    #[test]
    fn only_an_attempt_that_ended_without_an_outcome_loses_work_after_the_restored_checkpoint() {
        let t = |secs| SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
        // Host lost at 1000; the restore brings back the checkpoint of 400.
        assert_eq!(
            unsaved_window(None, t(100), Some(t(1000)), Some(t(400))),
            Some(Duration::from_secs(600))
        );
        // Nothing restored: everything since the attempt started.
        assert_eq!(
            unsaved_window(None, t(100), Some(t(1000)), None),
            Some(Duration::from_secs(900))
        );
        // The runner reported how it ended: it checkpointed as it stopped.
        for outcome in [Outcome::Interrupted, Outcome::Succeeded, Outcome::Failed] {
            assert_eq!(
                unsaved_window(Some(outcome), t(100), Some(t(1000)), Some(t(400))),
                None
            );
        }
        // Not ended, or a checkpoint newer than the end: nothing lost.
        assert_eq!(unsaved_window(None, t(100), None, Some(t(400))), None);
        assert_eq!(
            unsaved_window(None, t(100), Some(t(300)), Some(t(400))),
            None
        );
    }
}
