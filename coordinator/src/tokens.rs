//! Bearer tokens: their shape, how they are stored, and what each scope may do.
//!
//! A token is `cairn_<scope>_<32 bytes, base64url>`: random for admin, client
//! and host tokens; for run tokens an HMAC of the run id and attempt number
//! under the coordinator's run-token key ([`RunTokenKey`]), so every
//! heartbeat answer can repeat an attempt's token without storing it. The
//! coordinator keeps only its SHA-256, so a copy of the database does not hand
//! out access. Each token resolves to a [`Principal`]: a tenant, a scope and,
//! for run tokens, the one workspace, run and attempt it is bound to; for
//! host tokens, the one host (none: an enrollment token).
//!
//! Whether a known token is honoured is decided here, as pure code over the
//! facts the database supplies ([`TokenRecord`], [`admit`]): revoked and
//! expired tokens are refused, and a run token only while its attempt is
//! current — not superseded by a newer attempt, not ended. An attempt being
//! destroyed is still current: its runner cuts a destroy checkpoint and
//! reports during the grace period, and the attempt ends only when its host
//! reports the sandbox gone.

use std::fmt;
use std::str::FromStr;
use std::time::SystemTime;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use cairn_proto::ids::{HostId, RunId, TenantId, TokenId, WorkspaceId};
use cairn_proto::refusal::{NotCurrent, Refusal, TokenRefusal};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use sha2::{Digest, Sha256};

/// What a token is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Operators (cairnctl): everything.
    Admin,
    /// Services that create and drive runs: runs, workspaces and checkpoints.
    Client,
    /// Host agents: register and heartbeat.
    Host,
    /// One attempt's runner: only its own workspace and run.
    Run,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admin => "admin",
            Self::Client => "client",
            Self::Host => "host",
            Self::Run => "run",
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Scope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "admin" => Ok(Self::Admin),
            "client" => Ok(Self::Client),
            "host" => Ok(Self::Host),
            "run" => Ok(Self::Run),
            other => Err(format!("unknown token scope {other:?}")),
        }
    }
}

/// The attempt a run token belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RunBinding {
    pub run: RunId,
    pub attempt: u32,
}

/// Who is calling: resolved from the bearer token, stored in request extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub tenant: TenantId,
    pub scope: Scope,
    /// The only workspace a run token may touch.
    pub workspace: Option<WorkspaceId>,
    /// The attempt a run token was issued for.
    pub run: Option<RunBinding>,
    /// The one host a bound host token may act as (None on a host token:
    /// an enrollment token).
    pub host: Option<HostId>,
    /// The token's public id (run tokens have none).
    pub token: Option<TokenId>,
}

/// Something a principal asks to do.
#[derive(Debug, Clone, Copy)]
pub enum Action<'a> {
    CreateWorkspace,
    ListWorkspaces,
    ReadWorkspace(&'a WorkspaceId),
    /// Begin, find, upload and commit checkpoints.
    WriteCheckpoints(&'a WorkspaceId),
    /// List checkpoints and get restore manifests.
    ReadCheckpoints(&'a WorkspaceId),
    /// Finish or delete a workspace, set its retention, pin and unpin its
    /// checkpoints: never a sandbox's (run token) to do.
    ManageWorkspace(&'a WorkspaceId),
    CreateRun,
    ListRuns,
    /// Get a run and watch its events.
    ReadRun(&'a RunId),
    /// Answer, suspend or cancel a run.
    DriveRun(&'a RunId),
    /// Register as a host and heartbeat.
    ActAsHost,
    /// Hosts (list, cordon, drain) and tokens.
    Administer,
}

impl Principal {
    /// Whether this principal may do `action`; the error says why not.
    pub fn authorize(&self, action: Action<'_>) -> Result<(), String> {
        match (self.scope, action) {
            (Scope::Admin, _) => Ok(()),
            (Scope::Client, Action::ActAsHost) => {
                Err("a client token may not act as a host (use a host token)".into())
            }
            (Scope::Client, Action::Administer) => {
                Err("hosts and tokens need an admin token".into())
            }
            (Scope::Client, _) => Ok(()),
            (Scope::Host, Action::ActAsHost) => Ok(()),
            (Scope::Host, _) => Err(
                "a host token may only register and heartbeat (runs, workspaces and checkpoints need a client token)"
                    .into(),
            ),
            (Scope::Run, Action::ReadRun(id)) => match &self.run {
                Some(own) if &own.run == id => Ok(()),
                Some(own) => Err(format!(
                    "a run token of run {} may not read run {id}",
                    own.run
                )),
                None => Err("this run token is bound to no run".into()),
            },
            (
                Scope::Run,
                Action::ReadWorkspace(id)
                | Action::WriteCheckpoints(id)
                | Action::ReadCheckpoints(id),
            ) => match &self.workspace {
                Some(own) if own == id => Ok(()),
                Some(own) => Err(format!(
                    "a run token of workspace {own} may not touch workspace {id}"
                )),
                None => Err("this run token is bound to no workspace".into()),
            },
            (Scope::Run, _) => Err("a run token may only use its own workspace and run".into()),
        }
    }

    /// The attempt a runner call speaks for: only run tokens have one.
    pub fn attempt(&self) -> Result<&RunBinding, String> {
        match (&self.scope, &self.run) {
            (Scope::Run, Some(binding)) => Ok(binding),
            (Scope::Run, None) => Err("this run token is bound to no attempt".into()),
            (scope, _) => Err(format!(
                "the runner service takes an attempt's run token, not a {scope} token"
            )),
        }
    }
}

/// How a caller may register a host, decided by [`Principal::registration`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisterAs {
    /// The host id to register (None: a new one).
    pub host_id: Option<HostId>,
    /// Only a host the coordinator does not know yet may be registered
    /// (an enrollment token).
    pub new_only: bool,
    /// The answer carries a new token bound to the registered host.
    pub issue_bound_token: bool,
}

/// Why a principal may not do what it asked: a scope it does not have, or a
/// typed refusal the caller can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    #[error("{0}")]
    Scope(String),
    #[error("{message}")]
    Refused { refusal: Refusal, message: String },
}

impl Denied {
    fn refused(refusal: Refusal) -> Self {
        let message = refusal.to_string();
        Self::Refused { refusal, message }
    }

    /// PERMISSION_DENIED, with the typed refusal in its details where there is one.
    pub fn into_status(self) -> tonic::Status {
        match self {
            Self::Scope(message) => tonic::Status::permission_denied(message),
            Self::Refused { refusal, message } => refusal.into_status(message),
        }
    }
}

impl Principal {
    /// Whether this principal may act as host `asked` (heartbeat as it,
    /// receive its assignments and their run tokens): admin tokens as any
    /// host, a bound host token only as its own.
    pub fn act_as_host(&self, asked: &HostId) -> Result<(), Denied> {
        self.authorize(Action::ActAsHost).map_err(Denied::Scope)?;
        match (self.scope, &self.host) {
            (Scope::Admin, _) => Ok(()),
            (_, Some(bound)) if bound == asked => Ok(()),
            (_, Some(bound)) => Err(Denied::refused(Refusal::WrongHost {
                bound: bound.clone(),
                asked: asked.clone(),
            })),
            (_, None) => Err(Denied::Scope(format!(
                "an enrollment token (a host token bound to no host) may only register a new host, \
                 not act as host {asked}; use the token RegisterHost answered with"
            ))),
        }
    }

    /// How this principal may register a host that asks for `asked` (None:
    /// a new id). Admin tokens register or re-register any host; an
    /// enrollment token only a host the coordinator does not know; a bound
    /// token only its own host, and it keeps the token it has.
    pub fn registration(&self, asked: Option<&HostId>) -> Result<RegisterAs, Denied> {
        self.authorize(Action::ActAsHost).map_err(Denied::Scope)?;
        match (self.scope, &self.host) {
            (Scope::Admin, _) => Ok(RegisterAs {
                host_id: asked.cloned(),
                new_only: false,
                issue_bound_token: true,
            }),
            (_, Some(bound)) => match asked {
                Some(asked) if asked != bound => Err(Denied::refused(Refusal::WrongHost {
                    bound: bound.clone(),
                    asked: asked.clone(),
                })),
                _ => Ok(RegisterAs {
                    host_id: Some(bound.clone()),
                    new_only: false,
                    issue_bound_token: false,
                }),
            },
            (_, None) => Ok(RegisterAs {
                host_id: asked.cloned(),
                new_only: true,
                issue_bound_token: true,
            }),
        }
    }
}

/// Where a run token's attempt stands, as the database knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptFacts {
    /// The run's newest attempt number.
    pub newest_attempt: u32,
    /// The token's attempt ended (or the database has no such attempt).
    pub ended: bool,
    /// The run was cancelled.
    pub run_cancelled: bool,
}

/// Whether attempt `attempt` is still current. A newer attempt fences it
/// for good; an ended one is done (said as cancelled when its run was). An
/// attempt ordered destroyed, cancelled or not, stays current until its
/// sandbox is gone: the runner's orderly end (destroy checkpoint, outcome,
/// handoff note) happens in that window.
pub fn attempt_standing(attempt: u32, facts: AttemptFacts) -> Result<(), NotCurrent> {
    if facts.newest_attempt > attempt {
        Err(NotCurrent::Superseded)
    } else if facts.ended && facts.run_cancelled {
        Err(NotCurrent::Cancelled)
    } else if facts.ended {
        Err(NotCurrent::Ended)
    } else {
        Ok(())
    }
}

/// What the database knows about a token (found by its hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRecord {
    pub id: Option<TokenId>,
    pub tenant: TenantId,
    pub scope: Scope,
    pub workspace: Option<WorkspaceId>,
    pub run: Option<RunBinding>,
    pub host: Option<HostId>,
    pub expires_at: Option<SystemTime>,
    pub revoked_at: Option<SystemTime>,
    /// For a run token: its run's state (None: the run is unknown).
    pub attempt: Option<AttemptFacts>,
}

/// Whether a known token is honoured at `now`, and as whom.
pub fn admit(record: TokenRecord, now: SystemTime) -> Result<Principal, Refusal> {
    if record.revoked_at.is_some() {
        return Err(Refusal::Token(TokenRefusal::Revoked));
    }
    if record.expires_at.is_some_and(|at| at <= now) {
        return Err(Refusal::Token(TokenRefusal::Expired));
    }
    if record.scope == Scope::Run
        && let Some(binding) = &record.run
    {
        // A run the database does not know has no current attempt.
        let facts = record.attempt.unwrap_or(AttemptFacts {
            newest_attempt: 0,
            ended: true,
            run_cancelled: false,
        });
        attempt_standing(binding.attempt, facts).map_err(|why| Refusal::AttemptNotCurrent {
            run: binding.run.clone(),
            attempt: binding.attempt,
            why,
        })?;
    }
    Ok(Principal {
        tenant: record.tenant,
        scope: record.scope,
        workspace: record.workspace,
        run: record.run,
        host: record.host,
        token: record.id,
    })
}

/// A freshly generated token: the text to hand out once, and the hash to keep.
pub struct NewToken {
    pub text: String,
    pub hash: [u8; 32],
}

impl fmt::Debug for NewToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewToken").finish_non_exhaustive()
    }
}

/// Generates a token of `scope`.
pub fn generate(scope: Scope) -> NewToken {
    let mut random = [0u8; 32];
    SystemRandom::new()
        .fill(&mut random)
        .expect("the system random generator works");
    let text = format!(
        "cairn_{}_{}",
        scope.as_str(),
        URL_SAFE_NO_PAD.encode(random)
    );
    let hash = hash(&text);
    NewToken { text, hash }
}

/// The secret run tokens are derived from (`DIR/run-token.key`).
#[derive(Clone)]
pub struct RunTokenKey {
    key: hmac::Key,
}

impl fmt::Debug for RunTokenKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunTokenKey").finish_non_exhaustive()
    }
}

/// The run-token key's name among the keys replicas share
/// ([`crate::db::MetadataStore::shared_key`]).
pub const RUN_TOKEN_KEY_NAME: &str = "run-token";

/// Length of the run-token key.
pub const RUN_TOKEN_KEY_LEN: usize = 32;

impl RunTokenKey {
    pub fn new(secret: &[u8; RUN_TOKEN_KEY_LEN]) -> Self {
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
        }
    }

    /// The token of attempt `attempt` of `run`: the same text every time.
    pub fn token(&self, run: &RunId, attempt: u32) -> NewToken {
        let message = format!("cairn run token v1\n{run}\n{attempt}");
        let tag = hmac::sign(&self.key, message.as_bytes());
        let text = format!(
            "cairn_{}_{}",
            Scope::Run.as_str(),
            URL_SAFE_NO_PAD.encode(tag.as_ref())
        );
        let hash = hash(&text);
        NewToken { text, hash }
    }
}

/// The stored form of a token.
pub fn hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(scope: Scope, workspace: Option<WorkspaceId>) -> Principal {
        Principal {
            tenant: TenantId::default_tenant(),
            scope,
            workspace,
            run: None,
            host: None,
            token: None,
        }
    }

    fn record(scope: Scope) -> TokenRecord {
        TokenRecord {
            id: Some(TokenId::generate()),
            tenant: TenantId::default_tenant(),
            scope,
            workspace: None,
            run: None,
            host: None,
            expires_at: None,
            revoked_at: None,
            attempt: None,
        }
    }

    fn facts(newest_attempt: u32, ended: bool, run_cancelled: bool) -> AttemptFacts {
        AttemptFacts {
            newest_attempt,
            ended,
            run_cancelled,
        }
    }

    #[test]
    fn an_attempt_is_current_until_it_ends_or_a_newer_one_exists() {
        assert_eq!(attempt_standing(2, facts(2, false, false)), Ok(()));
        // Cancelled but its sandbox not gone yet: the orderly end goes on.
        assert_eq!(attempt_standing(2, facts(2, false, true)), Ok(()));
        assert_eq!(
            attempt_standing(2, facts(2, true, false)),
            Err(NotCurrent::Ended)
        );
        assert_eq!(
            attempt_standing(2, facts(2, true, true)),
            Err(NotCurrent::Cancelled)
        );
        assert_eq!(
            attempt_standing(1, facts(2, false, false)),
            Err(NotCurrent::Superseded)
        );
        assert_eq!(
            attempt_standing(1, facts(2, true, true)),
            Err(NotCurrent::Superseded),
            "a newer attempt says more than the old one's end"
        );
    }

    #[test]
    fn revoked_and_expired_tokens_are_refused_with_their_reason() {
        let now = SystemTime::now();
        let hour = std::time::Duration::from_secs(3600);
        let mut live = record(Scope::Client);
        live.expires_at = Some(now + hour);
        assert_eq!(admit(live.clone(), now).unwrap().scope, Scope::Client);

        let mut expired = live.clone();
        expired.expires_at = Some(now - hour);
        assert_eq!(
            admit(expired.clone(), now),
            Err(Refusal::Token(TokenRefusal::Expired))
        );
        let mut at_expiry = live.clone();
        at_expiry.expires_at = Some(now);
        assert!(
            admit(at_expiry, now).is_err(),
            "expires_at is the first refused instant"
        );

        let mut revoked = expired;
        revoked.revoked_at = Some(now - hour);
        assert_eq!(
            admit(revoked, now),
            Err(Refusal::Token(TokenRefusal::Revoked))
        );
    }

    #[test]
    fn a_run_token_is_admitted_only_while_its_attempt_is_current() {
        let now = SystemTime::now();
        let run = RunId::generate();
        let mut token = record(Scope::Run);
        token.id = None;
        token.run = Some(RunBinding {
            run: run.clone(),
            attempt: 1,
        });
        token.attempt = Some(facts(1, false, false));
        let principal = admit(token.clone(), now).unwrap();
        assert_eq!(principal.attempt().unwrap().attempt, 1);

        token.attempt = Some(facts(2, true, false));
        assert_eq!(
            admit(token.clone(), now),
            Err(Refusal::AttemptNotCurrent {
                run: run.clone(),
                attempt: 1,
                why: NotCurrent::Superseded
            })
        );
        token.attempt = None;
        assert_eq!(
            admit(token, now),
            Err(Refusal::AttemptNotCurrent {
                run,
                attempt: 1,
                why: NotCurrent::Ended
            }),
            "a run the database does not know has no current attempt"
        );
    }

    #[test]
    fn a_bound_host_token_acts_only_as_its_host() {
        let own = HostId::generate();
        let other = HostId::generate();
        let mut bound = principal(Scope::Host, None);
        bound.host = Some(own.clone());
        assert_eq!(bound.act_as_host(&own), Ok(()));
        let denied = bound.act_as_host(&other).unwrap_err();
        assert!(
            matches!(&denied, Denied::Refused { refusal: Refusal::WrongHost { bound, asked }, .. }
                if bound == &own && asked == &other),
            "{denied:?}"
        );
        let status = denied.into_status();
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(matches!(
            Refusal::of(&status),
            Some(Refusal::WrongHost { .. })
        ));

        let enrollment = principal(Scope::Host, None);
        assert!(matches!(
            enrollment.act_as_host(&own),
            Err(Denied::Scope(_))
        ));
        assert_eq!(principal(Scope::Admin, None).act_as_host(&other), Ok(()));
        assert!(principal(Scope::Client, None).act_as_host(&own).is_err());
    }

    #[test]
    fn registration_rights_follow_the_token() {
        let own = HostId::generate();
        let other = HostId::generate();
        let enrollment = principal(Scope::Host, None);
        assert_eq!(
            enrollment.registration(Some(&own)),
            Ok(RegisterAs {
                host_id: Some(own.clone()),
                new_only: true,
                issue_bound_token: true,
            })
        );
        assert!(enrollment.registration(None).unwrap().new_only);

        let mut bound = principal(Scope::Host, None);
        bound.host = Some(own.clone());
        assert_eq!(
            bound.registration(None),
            Ok(RegisterAs {
                host_id: Some(own.clone()),
                new_only: false,
                issue_bound_token: false,
            }),
            "a bound token re-registers its own host and keeps its token"
        );
        assert_eq!(bound.registration(Some(&own)), bound.registration(None));
        assert!(matches!(
            bound.registration(Some(&other)),
            Err(Denied::Refused {
                refusal: Refusal::WrongHost { .. },
                ..
            })
        ));

        let admin = principal(Scope::Admin, None)
            .registration(Some(&other))
            .unwrap();
        assert!(!admin.new_only && admin.issue_bound_token);
        assert!(principal(Scope::Client, None).registration(None).is_err());
    }

    #[test]
    fn tokens_name_their_scope_and_are_unique() {
        let a = generate(Scope::Admin);
        let b = generate(Scope::Admin);
        assert!(a.text.starts_with("cairn_admin_"));
        assert_eq!(a.text.len(), "cairn_admin_".len() + 43);
        assert_ne!(a.text, b.text);
        assert_eq!(hash(&a.text), a.hash);
    }

    #[test]
    fn a_run_token_reaches_only_its_own_workspace() {
        let own = WorkspaceId::generate();
        let other = WorkspaceId::generate();
        let run = principal(Scope::Run, Some(own.clone()));
        assert!(run.authorize(Action::WriteCheckpoints(&own)).is_ok());
        assert!(run.authorize(Action::ReadWorkspace(&own)).is_ok());
        let denied = run.authorize(Action::ReadCheckpoints(&other)).unwrap_err();
        assert!(denied.contains(other.as_str()), "{denied}");
        assert!(run.authorize(Action::ListWorkspaces).is_err());
        assert!(run.authorize(Action::CreateWorkspace).is_err());
        // A sandbox may not finish or delete its own workspace, nor pin.
        assert!(run.authorize(Action::ManageWorkspace(&own)).is_err());
        assert!(
            principal(Scope::Client, None)
                .authorize(Action::ManageWorkspace(&own))
                .is_ok()
        );
        assert!(
            principal(Scope::Host, None)
                .authorize(Action::ManageWorkspace(&own))
                .is_err()
        );
    }

    #[test]
    fn admin_and_client_drive_runs_and_hosts_only_host() {
        let ws = WorkspaceId::generate();
        let run = RunId::generate();
        for scope in [Scope::Admin, Scope::Client] {
            let p = principal(scope, None);
            assert!(p.authorize(Action::CreateWorkspace).is_ok());
            assert!(p.authorize(Action::WriteCheckpoints(&ws)).is_ok());
            assert!(p.authorize(Action::CreateRun).is_ok());
            assert!(p.authorize(Action::DriveRun(&run)).is_ok());
        }
        let client = principal(Scope::Client, None);
        assert!(client.authorize(Action::Administer).is_err());
        assert!(client.authorize(Action::ActAsHost).is_err());
        assert!(
            principal(Scope::Admin, None)
                .authorize(Action::Administer)
                .is_ok()
        );
        let host = principal(Scope::Host, None);
        assert!(host.authorize(Action::ActAsHost).is_ok());
        assert!(host.authorize(Action::ReadWorkspace(&ws)).is_err());
        assert!(host.authorize(Action::CreateRun).is_err());
        assert!(host.attempt().is_err());
    }

    #[test]
    fn a_run_token_reads_only_its_own_run_and_speaks_for_its_attempt() {
        let own = RunId::generate();
        let other = RunId::generate();
        let mut p = principal(Scope::Run, Some(WorkspaceId::generate()));
        p.run = Some(RunBinding {
            run: own.clone(),
            attempt: 2,
        });
        assert!(p.authorize(Action::ReadRun(&own)).is_ok());
        let denied = p.authorize(Action::ReadRun(&other)).unwrap_err();
        assert!(denied.contains(other.as_str()), "{denied}");
        assert!(p.authorize(Action::DriveRun(&own)).is_err());
        assert!(p.authorize(Action::CreateRun).is_err());
        assert_eq!(p.attempt().unwrap().attempt, 2);
    }

    #[test]
    fn run_tokens_are_derived_per_attempt() {
        let key = RunTokenKey::new(&[7; RUN_TOKEN_KEY_LEN]);
        let run = RunId::generate();
        let first = key.token(&run, 1);
        assert!(first.text.starts_with("cairn_run_"));
        assert_eq!(first.text.len(), "cairn_run_".len() + 43);
        assert_eq!(key.token(&run, 1).text, first.text);
        assert_ne!(key.token(&run, 2).text, first.text);
        let other_key = RunTokenKey::new(&[8; RUN_TOKEN_KEY_LEN]);
        assert_ne!(other_key.token(&run, 1).text, first.text);
        assert_eq!(hash(&first.text), first.hash);
    }

    #[test]
    fn scopes_round_trip_through_text() {
        for scope in [Scope::Admin, Scope::Client, Scope::Host, Scope::Run] {
            assert_eq!(scope.as_str().parse::<Scope>().unwrap(), scope);
        }
        assert!("root".parse::<Scope>().is_err());
    }
}
