//! Typed refusals: why the coordinator said no, for callers to decide on.
//!
//! A refusal travels as the one detail of the standard `google.rpc.Status`
//! in the `grpc-status-details-bin` trailer (an `Any` holding a
//! `cairn.v1.Refusal`). The status message is for people and may be
//! reworded at any time; runners, hosts and cairnctl decide on
//! [`Refusal::of`] only. A detail that does not decode, or names an id that
//! is not valid, is treated as no refusal at all: a caller then falls back
//! to the status code alone, never to the message.

use std::fmt;

use prost::Message;
use tonic::{Code, Status};

use crate::domain::WorkspaceState;
use crate::ids::{Generation, HostId, PackId, RunId, WorkspaceId};
use crate::pb;

/// The `type_url` of the `Any` that carries a [`pb::Refusal`].
pub const TYPE_URL: &str = "type.googleapis.com/cairn.v1.Refusal";

/// Why a bearer token was refused although it was once valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenRefusal {
    Expired,
    Revoked,
}

impl TokenRefusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Expired => "expired",
            Self::Revoked => "revoked",
        }
    }
}

/// Why a run token's attempt is no longer current.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotCurrent {
    /// The attempt ended (its sandbox was destroyed or the run finished).
    Ended,
    /// A newer attempt of the run exists, with a newer generation.
    Superseded,
    /// The run was cancelled.
    Cancelled,
}

impl NotCurrent {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ended => "ended",
            Self::Superseded => "superseded",
            Self::Cancelled => "cancelled",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [Self::Ended, Self::Superseded, Self::Cancelled]
            .into_iter()
            .find(|v| v.as_str() == s)
    }
}

/// A refusal the caller can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The call's generation is older than the workspace's: another attempt
    /// took over, and this writer is fenced.
    StaleGeneration {
        given: Generation,
        current: Generation,
    },
    /// Packs a commit referenced are missing from the store (or are not at
    /// the size the coordinator knows): the caller uploads them again.
    PacksMissing { packs: Vec<PackId> },
    /// The workspace is finished or deleted.
    WorkspaceNotActive {
        workspace: WorkspaceId,
        state: WorkspaceState,
    },
    /// A request exceeds one of the coordinator's limits.
    LimitExceeded {
        limit: String,
        max: u64,
        actual: u64,
    },
    /// A run token of an attempt that is no longer current.
    AttemptNotCurrent {
        run: RunId,
        attempt: u32,
        why: NotCurrent,
    },
    /// The bearer token expired or was revoked.
    Token(TokenRefusal),
    /// A host token used for another host than its own.
    WrongHost { bound: HostId, asked: HostId },
    /// A host call over a connection without a client certificate, on a
    /// coordinator that requires hosts to present one.
    ClientCertificateRequired,
    /// The workspace has runs that have not ended (finishing or deleting
    /// it waits for them).
    WorkspaceHasRuns {
        workspace: WorkspaceId,
        runs: Vec<RunId>,
    },
}

impl Refusal {
    /// A stable word naming this kind of refusal (metrics count by it).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::StaleGeneration { .. } => "stale_generation",
            Self::PacksMissing { .. } => "packs_missing",
            Self::WorkspaceNotActive { .. } => "workspace_not_active",
            Self::LimitExceeded { .. } => "limit_exceeded",
            Self::AttemptNotCurrent { .. } => "attempt_not_current",
            Self::Token(_) => "token",
            Self::WrongHost { .. } => "wrong_host",
            Self::ClientCertificateRequired => "client_certificate_required",
            Self::WorkspaceHasRuns { .. } => "workspace_has_runs",
        }
    }

    /// The status code this refusal is sent with.
    pub fn code(&self) -> Code {
        match self {
            Self::StaleGeneration { .. }
            | Self::PacksMissing { .. }
            | Self::WorkspaceNotActive { .. }
            | Self::WorkspaceHasRuns { .. } => Code::FailedPrecondition,
            Self::LimitExceeded { .. } => Code::InvalidArgument,
            Self::AttemptNotCurrent { .. } | Self::Token(_) | Self::WrongHost { .. } => {
                Code::PermissionDenied
            }
            Self::ClientCertificateRequired => Code::Unauthenticated,
        }
    }

    /// A status with this refusal's code, `message` for people and the
    /// refusal in its details.
    pub fn into_status(self, message: impl Into<String>) -> Status {
        let code = self.code();
        self.into_status_with_code(code, message)
    }

    /// Like [`Refusal::into_status`] with another code (a limit on a rate
    /// is RESOURCE_EXHAUSTED, say).
    pub fn into_status_with_code(self, code: Code, message: impl Into<String>) -> Status {
        let message = message.into();
        let envelope = pb::google_rpc::Status {
            code: code as i32,
            message: message.clone(),
            details: vec![prost_types::Any {
                type_url: TYPE_URL.to_owned(),
                value: pb::Refusal::from(self).encode_to_vec(),
            }],
        };
        Status::with_details(code, message, envelope.encode_to_vec().into())
    }

    /// The refusal a status carries, if it carries one that decodes.
    pub fn of(status: &Status) -> Option<Self> {
        let envelope = pb::google_rpc::Status::decode(status.details()).ok()?;
        envelope
            .details
            .iter()
            .find(|any| any.type_url == TYPE_URL)
            .and_then(|any| pb::Refusal::decode(any.value.as_slice()).ok())
            .and_then(|refusal| Self::try_from(refusal).ok())
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::StaleGeneration { given, current } => {
                write!(
                    f,
                    "generation {given} is older than the workspace's {current}"
                )
            }
            Self::PacksMissing { packs } => {
                let ids: Vec<&str> = packs.iter().map(PackId::as_str).collect();
                write!(f, "packs missing from the store: {}", ids.join(", "))
            }
            Self::WorkspaceNotActive { workspace, state } => {
                write!(f, "workspace {workspace} is {state}, not active")
            }
            Self::LimitExceeded { limit, max, actual } => {
                write!(f, "limit {limit} is {max}; the request has {actual}")
            }
            Self::AttemptNotCurrent { run, attempt, why } => {
                write!(f, "attempt {attempt} of run {run} is {}", why.as_str())
            }
            Self::Token(why) => write!(f, "the bearer token is {}", why.as_str()),
            Self::WrongHost { bound, asked } => {
                write!(
                    f,
                    "a host token of host {bound} may not act as host {asked}"
                )
            }
            Self::ClientCertificateRequired => write!(
                f,
                "hosts must present a client certificate the coordinator trusts (mutual TLS)"
            ),
            Self::WorkspaceHasRuns { workspace, runs } => {
                let ids: Vec<&str> = runs.iter().map(RunId::as_str).collect();
                write!(
                    f,
                    "workspace {workspace} has runs that have not ended: {}",
                    ids.join(", ")
                )
            }
        }
    }
}

impl From<Refusal> for pb::Refusal {
    fn from(refusal: Refusal) -> Self {
        use pb::refusal::Reason;
        let reason = match refusal {
            Refusal::StaleGeneration { given, current } => {
                Reason::StaleGeneration(pb::StaleGeneration {
                    given: given.0,
                    current: current.0,
                })
            }
            Refusal::PacksMissing { packs } => Reason::PacksMissing(pb::PacksMissing {
                pack_ids: packs.iter().map(ToString::to_string).collect(),
            }),
            Refusal::WorkspaceNotActive { workspace, state } => {
                Reason::WorkspaceNotActive(pb::WorkspaceNotActive {
                    workspace_id: workspace.to_string(),
                    state: pb::WorkspaceState::from(state) as i32,
                })
            }
            Refusal::LimitExceeded { limit, max, actual } => {
                Reason::LimitExceeded(pb::LimitExceeded { limit, max, actual })
            }
            Refusal::AttemptNotCurrent { run, attempt, why } => {
                Reason::AttemptNotCurrent(pb::AttemptNotCurrent {
                    run_id: run.to_string(),
                    attempt,
                    why: why.as_str().to_owned(),
                })
            }
            Refusal::Token(why) => Reason::TokenRefused(pb::TokenRefused {
                why: why.as_str().to_owned(),
            }),
            Refusal::WrongHost { bound, asked } => Reason::WrongHost(pb::WrongHost {
                bound_host_id: bound.to_string(),
                asked_host_id: asked.to_string(),
            }),
            Refusal::ClientCertificateRequired => {
                Reason::ClientCertificateRequired(pb::ClientCertificateRequired {})
            }
            Refusal::WorkspaceHasRuns { workspace, runs } => {
                Reason::WorkspaceHasRuns(pb::WorkspaceHasRuns {
                    workspace_id: workspace.to_string(),
                    run_ids: runs.iter().map(ToString::to_string).collect(),
                })
            }
        };
        Self {
            reason: Some(reason),
        }
    }
}

/// Why a received `Refusal` message is not one this version understands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("refusal detail: {0}")]
pub struct UnknownRefusal(String);

impl TryFrom<pb::Refusal> for Refusal {
    type Error = UnknownRefusal;

    fn try_from(message: pb::Refusal) -> Result<Self, Self::Error> {
        use pb::refusal::Reason;
        let bad = |what: &str, e: &dyn fmt::Display| UnknownRefusal(format!("{what}: {e}"));
        Ok(match message.reason {
            None => return Err(UnknownRefusal("no reason (a newer coordinator?)".into())),
            Some(Reason::StaleGeneration(g)) => Self::StaleGeneration {
                given: Generation(g.given),
                current: Generation(g.current),
            },
            Some(Reason::PacksMissing(p)) => Self::PacksMissing {
                packs: p
                    .pack_ids
                    .iter()
                    .map(|id| id.parse().map_err(|e| bad("pack id", &e)))
                    .collect::<Result<_, _>>()?,
            },
            Some(Reason::WorkspaceNotActive(w)) => Self::WorkspaceNotActive {
                workspace: w
                    .workspace_id
                    .parse()
                    .map_err(|e| bad("workspace id", &e))?,
                state: WorkspaceState::try_from(w.state).map_err(|e| bad("state", &e))?,
            },
            Some(Reason::LimitExceeded(l)) => Self::LimitExceeded {
                limit: l.limit,
                max: l.max,
                actual: l.actual,
            },
            Some(Reason::AttemptNotCurrent(a)) => Self::AttemptNotCurrent {
                run: a.run_id.parse().map_err(|e| bad("run id", &e))?,
                attempt: a.attempt,
                why: NotCurrent::parse(&a.why)
                    .ok_or_else(|| UnknownRefusal(format!("attempt not current: {:?}", a.why)))?,
            },
            Some(Reason::TokenRefused(t)) => Self::Token(match t.why.as_str() {
                "expired" => TokenRefusal::Expired,
                "revoked" => TokenRefusal::Revoked,
                other => return Err(UnknownRefusal(format!("token refused: {other:?}"))),
            }),
            Some(Reason::WrongHost(h)) => Self::WrongHost {
                bound: h.bound_host_id.parse().map_err(|e| bad("host id", &e))?,
                asked: h.asked_host_id.parse().map_err(|e| bad("host id", &e))?,
            },
            Some(Reason::ClientCertificateRequired(_)) => Self::ClientCertificateRequired,
            Some(Reason::WorkspaceHasRuns(w)) => Self::WorkspaceHasRuns {
                workspace: w
                    .workspace_id
                    .parse()
                    .map_err(|e| bad("workspace id", &e))?,
                runs: w
                    .run_ids
                    .iter()
                    .map(|id| id.parse().map_err(|e| bad("run id", &e)))
                    .collect::<Result<_, _>>()?,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(refusal: Refusal) {
        let status = refusal.clone().into_status("said for people");
        assert_eq!(status.code(), refusal.code());
        // Through the wire form: the trailers a client receives.
        let response = status.into_http::<tonic::body::Body>();
        let received = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(received.message(), "said for people");
        assert_eq!(Refusal::of(&received), Some(refusal));
    }

    #[test]
    fn every_refusal_survives_the_trailers() {
        round_trip(Refusal::StaleGeneration {
            given: Generation(3),
            current: Generation(4),
        });
        round_trip(Refusal::PacksMissing {
            packs: vec![PackId::from_digest(&[7; 32])],
        });
        round_trip(Refusal::WorkspaceNotActive {
            workspace: WorkspaceId::generate(),
            state: WorkspaceState::Finished,
        });
        round_trip(Refusal::LimitExceeded {
            limit: "commit.blob_ids".into(),
            max: 10,
            actual: 11,
        });
        round_trip(Refusal::AttemptNotCurrent {
            run: RunId::generate(),
            attempt: 2,
            why: NotCurrent::Superseded,
        });
        round_trip(Refusal::Token(TokenRefusal::Revoked));
        round_trip(Refusal::WorkspaceHasRuns {
            workspace: WorkspaceId::generate(),
            runs: vec![RunId::generate(), RunId::generate()],
        });
        round_trip(Refusal::WrongHost {
            bound: HostId::generate(),
            asked: HostId::generate(),
        });
        round_trip(Refusal::ClientCertificateRequired);
    }

    #[test]
    fn a_status_without_details_or_with_garbage_carries_no_refusal() {
        assert_eq!(
            Refusal::of(&Status::failed_precondition("pack abc is missing")),
            None,
            "a message is never read"
        );
        let garbage = Status::with_details(Code::FailedPrecondition, "x", vec![0xff; 9].into());
        assert_eq!(Refusal::of(&garbage), None);
        let bad_id = pb::google_rpc::Status {
            code: 9,
            message: String::new(),
            details: vec![prost_types::Any {
                type_url: TYPE_URL.into(),
                value: pb::Refusal {
                    reason: Some(pb::refusal::Reason::PacksMissing(pb::PacksMissing {
                        pack_ids: vec!["../etc/passwd".into()],
                    })),
                }
                .encode_to_vec(),
            }],
        };
        let status =
            Status::with_details(Code::FailedPrecondition, "x", bad_id.encode_to_vec().into());
        assert_eq!(Refusal::of(&status), None, "an invalid pack id is refused");
    }
}
