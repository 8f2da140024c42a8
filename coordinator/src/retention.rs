//! Which checkpoints a workspace keeps, and when a finished workspace
//! expires, apart from the database.
//!
//! [`decide`] takes a workspace's checkpoints, the pins on them and the runs
//! that started from them, and says of each checkpoint why it is kept
//! ([`KeepReason`]) and until when — or that nothing keeps it and it goes.
//! [`expired`] says whether a finished workspace is past its retention.
//! `db` gathers the facts and deletes what these decide; nothing here reads
//! or writes anything.
//!
//! The rules, in the order `cairnctl checkpoints` shows them:
//!
//! - The newest checkpoint is always kept, whatever the policy says: it is
//!   the workspace's only copy of its latest state.
//! - The last `keep_last` checkpoints (by sequence, the newest counted) are
//!   kept (server default 5, per workspace overridable, never below 1).
//! - A checkpoint a pin names is kept while the pin holds (until its time,
//!   or until it is unpinned when it has none).
//! - A checkpoint a run started from (restored) is kept for
//!   `run_start_hold` (30 days) after that attempt started.
//!
//! Only checkpoints of the workspace's own rows are judged: a fork holds
//! copies of its source's checkpoint under its own ids, so deleting the
//! source (or its checkpoints) never touches what a fork restores.

use std::time::{Duration, SystemTime};

use cairn_proto::domain::WorkspaceState;
use cairn_proto::ids::{CheckpointId, RunId};

/// Server defaults, overridable per workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// How many of the newest checkpoints are kept (at least 1).
    pub keep_last: u32,
    /// How long the checkpoint a run started from stays after it started.
    pub run_start_hold: Duration,
    /// How long a finished workspace stays before it is deleted.
    pub finished_expiry: Duration,
}

impl Policy {
    pub const DEFAULT_KEEP_LAST: u32 = 5;
    pub const DEFAULT_RUN_START_HOLD: Duration = Duration::from_secs(30 * 24 * 3600);
    pub const DEFAULT_FINISHED_EXPIRY: Duration = Duration::from_secs(7 * 24 * 3600);

    /// This policy with a workspace's overrides (`None`: the default's).
    pub fn with_overrides(self, overrides: &Overrides) -> Self {
        Self {
            keep_last: overrides.keep_last.unwrap_or(self.keep_last).max(1),
            run_start_hold: self.run_start_hold,
            finished_expiry: overrides.finished_expiry.unwrap_or(self.finished_expiry),
        }
    }
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            keep_last: Self::DEFAULT_KEEP_LAST,
            run_start_hold: Self::DEFAULT_RUN_START_HOLD,
            finished_expiry: Self::DEFAULT_FINISHED_EXPIRY,
        }
    }
}

/// A workspace's own retention settings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    pub keep_last: Option<u32>,
    pub finished_expiry: Option<Duration>,
}

/// What retention needs to know of one checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointFacts {
    pub id: CheckpointId,
    pub sequence: u64,
}

/// A pin: keeps `checkpoint` until `until` (`None`: until unpinned).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin {
    pub checkpoint: CheckpointId,
    pub reason: String,
    pub until: Option<SystemTime>,
}

/// An attempt of `run` that started (restored) from `checkpoint` at `started_at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunStart {
    pub checkpoint: CheckpointId,
    pub run: RunId,
    pub started_at: SystemTime,
}

/// Why a checkpoint is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeepReason {
    /// The newest checkpoint of the workspace.
    Newest,
    /// Among the last `of` checkpoints (`rank` 1 is the newest).
    Recent { rank: u32, of: u32 },
    /// A pin holds it.
    Pinned {
        reason: String,
        until: Option<SystemTime>,
    },
    /// A run started from it.
    RunStart { run: RunId, until: SystemTime },
}

impl KeepReason {
    /// Until when this reason holds (`None`: no time ends it).
    fn until(&self) -> Option<SystemTime> {
        match self {
            Self::Newest | Self::Recent { .. } => None,
            Self::Pinned { until, .. } => *until,
            Self::RunStart { until, .. } => Some(*until),
        }
    }
}

/// What retention makes of one checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub checkpoint: CheckpointId,
    pub sequence: u64,
    /// Empty: nothing keeps it; it is deleted.
    pub kept_by: Vec<KeepReason>,
    /// When the last reason lapses, if every reason ends at a time; `None`
    /// while a reason without an end (newest, recent, an open pin) holds.
    /// A recent checkpoint goes once `keep_last` newer ones exist.
    pub kept_until: Option<SystemTime>,
}

impl Verdict {
    pub fn is_kept(&self) -> bool {
        !self.kept_by.is_empty()
    }
}

/// Judges every checkpoint of one workspace at `now`, newest first.
/// Expired pins and run holds keep nothing.
pub fn decide(
    policy: &Policy,
    checkpoints: &[CheckpointFacts],
    pins: &[Pin],
    run_starts: &[RunStart],
    now: SystemTime,
) -> Vec<Verdict> {
    let mut ordered: Vec<&CheckpointFacts> = checkpoints.iter().collect();
    ordered.sort_by_key(|c| std::cmp::Reverse(c.sequence));
    let keep_last = policy.keep_last.max(1);
    ordered
        .into_iter()
        .enumerate()
        .map(|(index, facts)| {
            let mut kept_by = Vec::new();
            if index == 0 {
                kept_by.push(KeepReason::Newest);
            }
            let rank = u32::try_from(index + 1).unwrap_or(u32::MAX);
            if rank <= keep_last {
                kept_by.push(KeepReason::Recent {
                    rank,
                    of: keep_last,
                });
            }
            for pin in pins.iter().filter(|p| p.checkpoint == facts.id) {
                if pin.until.is_none_or(|until| until > now) {
                    kept_by.push(KeepReason::Pinned {
                        reason: pin.reason.clone(),
                        until: pin.until,
                    });
                }
            }
            for start in run_starts.iter().filter(|s| s.checkpoint == facts.id) {
                let until = start.started_at + policy.run_start_hold;
                if until > now {
                    kept_by.push(KeepReason::RunStart {
                        run: start.run.clone(),
                        until,
                    });
                }
            }
            let kept_until = if kept_by.is_empty() {
                None
            } else {
                kept_by
                    .iter()
                    .map(KeepReason::until)
                    .collect::<Option<Vec<_>>>()
                    .and_then(|untils| untils.into_iter().max())
            };
            Verdict {
                checkpoint: facts.id.clone(),
                sequence: facts.sequence,
                kept_by,
                kept_until,
            }
        })
        .collect()
}

/// When a workspace in `state`, finished at `finished_at`, expires (`None`:
/// it does not: it is active, or deleted already).
pub fn expires_at(
    policy: &Policy,
    state: WorkspaceState,
    finished_at: Option<SystemTime>,
) -> Option<SystemTime> {
    match state {
        WorkspaceState::Finished => Some(finished_at? + policy.finished_expiry),
        _ => None,
    }
}

/// Whether a finished workspace is past its retention at `now`.
pub fn expired(
    policy: &Policy,
    state: WorkspaceState,
    finished_at: Option<SystemTime>,
    now: SystemTime,
) -> bool {
    expires_at(policy, state, finished_at).is_some_and(|at| at <= now)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn ids(n: usize) -> Vec<CheckpointId> {
        (0..n).map(|_| CheckpointId::generate()).collect()
    }

    fn facts(ids: &[CheckpointId]) -> Vec<CheckpointFacts> {
        ids.iter()
            .enumerate()
            .map(|(i, id)| CheckpointFacts {
                id: id.clone(),
                sequence: i as u64 + 1,
            })
            .collect()
    }

    fn policy(keep_last: u32) -> Policy {
        Policy {
            keep_last,
            ..Policy::default()
        }
    }

    fn kept(verdicts: &[Verdict]) -> Vec<u64> {
        verdicts
            .iter()
            .filter(|v| v.is_kept())
            .map(|v| v.sequence)
            .collect()
    }

    #[test]
    fn the_last_n_are_kept_and_the_rest_go() {
        let ids = ids(20);
        let now = SystemTime::now();
        let verdicts = decide(&policy(3), &facts(&ids), &[], &[], now);
        assert_eq!(verdicts.len(), 20);
        assert_eq!(kept(&verdicts), [20, 19, 18]);
        assert_eq!(
            verdicts[0].kept_by,
            [KeepReason::Newest, KeepReason::Recent { rank: 1, of: 3 }]
        );
        assert_eq!(verdicts[2].kept_by, [KeepReason::Recent { rank: 3, of: 3 }]);
        assert!(verdicts[3].kept_by.is_empty());
        assert_eq!(verdicts[0].kept_until, None, "no time ends 'newest'");
    }

    #[test]
    fn the_newest_is_kept_whatever_the_policy_says() {
        let ids = ids(4);
        let zero = Policy {
            keep_last: 0,
            ..Policy::default()
        };
        let verdicts = decide(&zero, &facts(&ids), &[], &[], SystemTime::now());
        assert_eq!(kept(&verdicts), [4]);
        assert_eq!(verdicts[0].checkpoint, ids[3]);
        // Also when the checkpoints come in any order.
        let mut shuffled = facts(&ids);
        shuffled.reverse();
        shuffled.swap(0, 2);
        assert_eq!(
            kept(&decide(&zero, &shuffled, &[], &[], SystemTime::now())),
            [4]
        );
        assert!(decide(&zero, &[], &[], &[], SystemTime::now()).is_empty());
    }

    #[test]
    fn a_pin_keeps_an_old_checkpoint_until_its_time_or_until_unpinned() {
        let ids = ids(10);
        let now = SystemTime::now();
        let pins = [
            Pin {
                checkpoint: ids[1].clone(),
                reason: "replay".into(),
                until: Some(now + DAY),
            },
            Pin {
                checkpoint: ids[2].clone(),
                reason: "audit".into(),
                until: None,
            },
            Pin {
                checkpoint: ids[3].clone(),
                reason: "lapsed".into(),
                until: Some(now - DAY),
            },
        ];
        let verdicts = decide(&policy(2), &facts(&ids), &pins, &[], now);
        assert_eq!(kept(&verdicts), [10, 9, 3, 2]);
        let of = |seq: u64| verdicts.iter().find(|v| v.sequence == seq).unwrap();
        assert_eq!(of(2).kept_until, Some(now + DAY));
        assert_eq!(
            of(3).kept_by,
            [KeepReason::Pinned {
                reason: "audit".into(),
                until: None
            }]
        );
        assert_eq!(of(3).kept_until, None);
        assert!(!of(4).is_kept(), "a lapsed pin keeps nothing");
        // A day later the replay pin has lapsed too.
        let later = decide(&policy(2), &facts(&ids), &pins, &[], now + DAY);
        assert_eq!(kept(&later), [10, 9, 3]);
    }

    #[test]
    fn the_checkpoint_a_run_started_from_stays_for_the_hold_after_it_started() {
        let ids = ids(8);
        let started = SystemTime::now();
        let run = RunId::generate();
        let starts = [RunStart {
            checkpoint: ids[0].clone(),
            run: run.clone(),
            started_at: started,
        }];
        let p = policy(2);
        let verdicts = decide(&p, &facts(&ids), &[], &starts, started + 29 * DAY);
        assert_eq!(kept(&verdicts), [8, 7, 1]);
        let first = verdicts.iter().find(|v| v.sequence == 1).unwrap();
        assert_eq!(
            first.kept_by,
            [KeepReason::RunStart {
                run,
                until: started + 30 * DAY
            }]
        );
        assert_eq!(first.kept_until, Some(started + 30 * DAY));
        let after = decide(&p, &facts(&ids), &[], &starts, started + 30 * DAY);
        assert_eq!(kept(&after), [8, 7]);
    }

    #[test]
    fn kept_until_is_the_latest_end_and_none_while_an_open_reason_holds() {
        let ids = ids(5);
        let now = SystemTime::now();
        let pins = [
            Pin {
                checkpoint: ids[0].clone(),
                reason: "a".into(),
                until: Some(now + DAY),
            },
            Pin {
                checkpoint: ids[0].clone(),
                reason: "b".into(),
                until: Some(now + 3 * DAY),
            },
        ];
        let starts = [RunStart {
            checkpoint: ids[0].clone(),
            run: RunId::generate(),
            started_at: now - 29 * DAY,
        }];
        let verdicts = decide(&policy(1), &facts(&ids), &pins, &starts, now);
        let first = verdicts.iter().find(|v| v.sequence == 1).unwrap();
        assert_eq!(first.kept_by.len(), 3);
        assert_eq!(first.kept_until, Some(now + 3 * DAY));
    }

    #[test]
    fn overrides_replace_the_defaults_but_never_keep_fewer_than_one() {
        let base = Policy::default();
        let own = base.with_overrides(&Overrides {
            keep_last: Some(0),
            finished_expiry: Some(DAY),
        });
        assert_eq!(own.keep_last, 1);
        assert_eq!(own.finished_expiry, DAY);
        assert_eq!(own.run_start_hold, base.run_start_hold);
        assert_eq!(base.with_overrides(&Overrides::default()), base);
    }

    #[test]
    fn a_finished_workspace_expires_after_its_retention_and_only_then() {
        let p = Policy::default();
        let finished = SystemTime::now();
        let at = finished + Policy::DEFAULT_FINISHED_EXPIRY;
        assert_eq!(
            expires_at(&p, WorkspaceState::Finished, Some(finished)),
            Some(at)
        );
        assert!(!expired(
            &p,
            WorkspaceState::Finished,
            Some(finished),
            at - Duration::from_secs(1)
        ));
        assert!(expired(&p, WorkspaceState::Finished, Some(finished), at));
        assert!(!expired(&p, WorkspaceState::Active, None, at + DAY));
        assert!(!expired(&p, WorkspaceState::Deleted, Some(finished), at));
        // A finished workspace without a recorded time (never so written)
        // is not guessed at.
        assert!(!expired(&p, WorkspaceState::Finished, None, at));
    }
}
