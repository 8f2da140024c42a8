//! Bearer tokens: their shape, how they are stored, and what each scope may do.
//!
//! A token is `cairn_<scope>_<32 bytes, base64url>`: random for admin, client
//! and host tokens; for run tokens an HMAC of the run id and attempt number
//! under the coordinator's run-token key ([`RunTokenKey`]), so every
//! heartbeat answer can repeat an attempt's token without storing it. The
//! coordinator keeps only its SHA-256, so a copy of the database does not hand
//! out access. Each token resolves to a [`Principal`]: a tenant, a scope and,
//! for run tokens, the one workspace, run and attempt it is bound to.

use std::fmt;
use std::str::FromStr;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use cairn_proto::ids::{RunId, TenantId, WorkspaceId};
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
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// Length of the run-token key file.
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
        }
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
