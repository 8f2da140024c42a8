//! Bearer tokens: their shape, how they are stored, and what each scope may do.
//!
//! A token is `cairn_<scope>_<32 random bytes, base64url>`. The coordinator
//! keeps only its SHA-256, so a copy of the database does not hand out
//! access. Each token resolves to a [`Principal`]: a tenant, a scope and, for
//! run tokens, the one workspace it may touch.

use std::fmt;
use std::str::FromStr;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use cairn_proto::ids::{TenantId, WorkspaceId};
use ring::rand::{SecureRandom, SystemRandom};
use sha2::{Digest, Sha256};

/// What a token is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Operators (cairnctl): everything.
    Admin,
    /// Services that create and drive runs: workspaces and checkpoints.
    Client,
    /// Host agents.
    Host,
    /// One attempt's runner: only its own workspace.
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

/// Who is calling: resolved from the bearer token, stored in request extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub tenant: TenantId,
    pub scope: Scope,
    /// The only workspace a run token may touch.
    pub workspace: Option<WorkspaceId>,
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
}

impl Principal {
    /// Whether this principal may do `action`; the error says why not.
    pub fn authorize(&self, action: Action<'_>) -> Result<(), String> {
        match (self.scope, action) {
            (Scope::Admin | Scope::Client, _) => Ok(()),
            (Scope::Host, _) => {
                Err("a host token may not use the workspace or checkpoint services".into())
            }
            (Scope::Run, Action::CreateWorkspace | Action::ListWorkspaces) => {
                Err("a run token may only use its own workspace".into())
            }
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
    fn admin_and_client_may_do_everything_here_and_hosts_nothing() {
        let ws = WorkspaceId::generate();
        for scope in [Scope::Admin, Scope::Client] {
            let p = principal(scope, None);
            assert!(p.authorize(Action::CreateWorkspace).is_ok());
            assert!(p.authorize(Action::WriteCheckpoints(&ws)).is_ok());
        }
        assert!(
            principal(Scope::Host, None)
                .authorize(Action::ReadWorkspace(&ws))
                .is_err()
        );
    }

    #[test]
    fn scopes_round_trip_through_text() {
        for scope in [Scope::Admin, Scope::Client, Scope::Host, Scope::Run] {
            assert_eq!(scope.as_str().parse::<Scope>().unwrap(), scope);
        }
        assert!("root".parse::<Scope>().is_err());
    }
}
