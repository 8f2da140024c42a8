//! The tokens this replica authenticated recently, so that a host's
//! heartbeat or a client's call does not read its token's row each time.
//!
//! Only admin, client and host tokens are kept: a run token's standing
//! follows its attempt, which must be read at each use. A kept token is
//! used for at most [`TOKEN_CACHE_TTL`], and only while the cache is
//! *trusted*: revocations reach it at once. On SQLite one coordinator holds
//! the database, so every revocation is this process's own and forgets the
//! token here. On PostgreSQL a revocation on another replica arrives as a
//! notification; the cache is trusted only while this replica listens, and
//! forgets everything when it stops. Expiry needs nothing: it is compared
//! at each use ([`crate::tokens::admit`]).
//!
//! A read that races a revocation must not put the revoked token back: a
//! lookup notes the cache's epoch before it reads the database and keeps
//! what it read only if nothing was forgotten since.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use cairn_proto::ids::TokenId;

use crate::tokens::{Scope, TokenRecord};

/// How long a kept token is used before its row is read again: bounds how
/// stale anything but a revocation can be.
pub const TOKEN_CACHE_TTL: Duration = Duration::from_secs(5);

/// Most tokens kept; a full cache drops what is stale, then everything.
const MAX_KEPT: usize = 20_000;

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct TokenCache {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    trusted: bool,
    /// Counts forgettings: a lookup keeps what it read only if it is the
    /// same as when the lookup started.
    epoch: u64,
    kept: HashMap<[u8; 32], (TokenRecord, Instant)>,
}

/// A lookup's ticket to keep what it reads (see [`TokenCache::lookup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Epoch(u64);

impl TokenCache {
    /// A cache that is trusted from the start (SQLite) or only once
    /// [`Self::trust`] says revocations are heard (PostgreSQL).
    pub(crate) fn new(trusted: bool) -> Self {
        Self {
            state: Mutex::new(State {
                trusted,
                epoch: 0,
                kept: HashMap::new(),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The token with this hash if it is kept and fresh at `now`, else the
    /// epoch to [`Self::keep`] what the database says.
    pub(crate) fn lookup(&self, hash: &[u8; 32], now: Instant) -> Result<TokenRecord, Epoch> {
        let state = self.state();
        match state.kept.get(hash) {
            Some((record, at)) if state.trusted && now.duration_since(*at) < TOKEN_CACHE_TTL => {
                Ok(record.clone())
            }
            _ => Err(Epoch(state.epoch)),
        }
    }

    /// Keeps `record`, read at `now` by a lookup that started at `epoch`,
    /// unless it is a run token or something was forgotten meanwhile.
    pub(crate) fn keep(&self, hash: [u8; 32], record: &TokenRecord, epoch: Epoch, now: Instant) {
        if record.scope == Scope::Run {
            return;
        }
        let mut state = self.state();
        if !state.trusted || state.epoch != epoch.0 {
            return;
        }
        if state.kept.len() >= MAX_KEPT {
            state
                .kept
                .retain(|_, (_, at)| now.duration_since(*at) < TOKEN_CACHE_TTL);
            if state.kept.len() >= MAX_KEPT {
                state.kept.clear();
            }
        }
        state.kept.insert(hash, (record.clone(), now));
    }

    /// Forgets the token `id` (it was revoked).
    pub(crate) fn forget(&self, id: &TokenId) {
        let mut state = self.state();
        state.epoch += 1;
        state
            .kept
            .retain(|_, (record, _)| record.id.as_ref() != Some(id));
    }

    /// Forgets every token (a revocation came that names none clearly).
    pub(crate) fn forget_all(&self) {
        self.state().forget_all();
    }

    /// Whether revocations reach this cache; forgets everything either way.
    pub(crate) fn trust(&self, trusted: bool) {
        let mut state = self.state();
        state.forget_all();
        state.trusted = trusted;
    }

    /// Whether revocations reach this cache (on PostgreSQL: this replica
    /// listens for announcements).
    #[cfg(test)]
    pub(crate) fn trusted(&self) -> bool {
        self.state().trusted
    }
}

impl State {
    fn forget_all(&mut self) {
        self.epoch += 1;
        self.kept.clear();
    }
}

#[cfg(test)]
mod tests {
    use cairn_proto::ids::TenantId;

    use super::*;

    fn record(scope: Scope, id: Option<&str>) -> TokenRecord {
        TokenRecord {
            id: id.map(|id| id.parse().unwrap()),
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

    #[test]
    fn a_kept_token_is_used_until_it_is_stale() {
        let cache = TokenCache::new(true);
        let start = Instant::now();
        let id = TokenId::generate();
        let client = record(Scope::Client, Some(id.as_str()));
        let epoch = cache.lookup(&[1; 32], start).unwrap_err();
        cache.keep([1; 32], &client, epoch, start);
        assert_eq!(
            cache.lookup(&[1; 32], start + TOKEN_CACHE_TTL / 2),
            Ok(client)
        );
        assert!(cache.lookup(&[1; 32], start + TOKEN_CACHE_TTL).is_err());
        assert!(cache.lookup(&[2; 32], start).is_err(), "another token");
    }

    #[test]
    fn run_tokens_are_never_kept() {
        let cache = TokenCache::new(true);
        let now = Instant::now();
        let epoch = cache.lookup(&[1; 32], now).unwrap_err();
        cache.keep([1; 32], &record(Scope::Run, None), epoch, now);
        assert!(cache.lookup(&[1; 32], now).is_err());
    }

    #[test]
    fn a_revoked_token_is_forgotten_and_a_racing_read_does_not_bring_it_back() {
        let cache = TokenCache::new(true);
        let now = Instant::now();
        let (revoked, other) = (TokenId::generate(), TokenId::generate());
        let host = record(Scope::Host, Some(revoked.as_str()));
        let client = record(Scope::Client, Some(other.as_str()));
        let epoch = cache.lookup(&[1; 32], now).unwrap_err();
        cache.keep([1; 32], &host, epoch, now);
        cache.keep([2; 32], &client, epoch, now);

        // A lookup starts, the token is revoked, the lookup's (stale) read
        // arrives.
        let racing = cache.lookup(&[3; 32], now).unwrap_err();
        cache.forget(&revoked);
        assert!(cache.lookup(&[1; 32], now).is_err(), "forgotten");
        assert_eq!(
            cache.lookup(&[2; 32], now),
            Ok(client.clone()),
            "others stay"
        );
        cache.keep([1; 32], &host, racing, now);
        assert!(cache.lookup(&[1; 32], now).is_err(), "not brought back");

        // A revocation naming no token clearly forgets them all.
        let before = cache.lookup(&[3; 32], now).unwrap_err();
        cache.forget_all();
        assert!(cache.lookup(&[2; 32], now).is_err(), "all forgotten");
        cache.keep([2; 32], &client, before, now);
        assert!(cache.lookup(&[2; 32], now).is_err(), "not brought back");
    }

    #[test]
    fn an_untrusted_cache_keeps_nothing_and_distrust_forgets_everything() {
        let cache = TokenCache::new(false);
        let now = Instant::now();
        let client = record(Scope::Client, None);
        let epoch = cache.lookup(&[1; 32], now).unwrap_err();
        cache.keep([1; 32], &client, epoch, now);
        assert!(cache.lookup(&[1; 32], now).is_err());

        cache.trust(true);
        let epoch = cache.lookup(&[1; 32], now).unwrap_err();
        cache.keep([1; 32], &client, epoch, now);
        assert!(cache.lookup(&[1; 32], now).is_ok());
        cache.trust(false);
        assert!(cache.lookup(&[1; 32], now).is_err());
    }

    #[test]
    fn a_full_cache_makes_room() {
        let cache = TokenCache::new(true);
        let start = Instant::now();
        let client = record(Scope::Client, None);
        let epoch = cache.lookup(&[0; 32], start).unwrap_err();
        for n in 0..MAX_KEPT {
            let mut hash = [0; 32];
            hash[..8].copy_from_slice(&(n as u64).to_le_bytes());
            cache.keep(hash, &client, epoch, start);
        }
        let later = start + TOKEN_CACHE_TTL;
        cache.keep([255; 32], &client, epoch, later);
        assert!(cache.lookup(&[255; 32], later).is_ok());
        assert_eq!(cache.state().kept.len(), 1, "the stale ones went");
    }
}
