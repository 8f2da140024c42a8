//! Bearer tokens: recorded by hash, listed and revoked by their public id,
//! and the facts [`crate::tokens::admit`] decides on.
//!
//! A token row never goes away: revoking sets `revoked_at`, and expiry is a
//! time compared at each use, so a list shows what was handed out and what
//! became of it. Run tokens (one per attempt, written by the scheduler) have
//! no id and are not listed: they die with their attempt.

use std::time::{Instant, SystemTime};

use cairn_proto::ids::{HostId, RunId, TenantId, TokenId, WorkspaceId};
use cairn_proto::refusal::NotCurrent;
use cairn_proto::runs::{AttemptState, RunState};
use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row};

use super::{DbError, MetadataStore, from_millis, millis, parse_column, query_error, unsigned};
use crate::tokens::{AttemptFacts, RunBinding, Scope, TokenRecord, attempt_standing};

/// A token as an operator sees it (never its text, which is not kept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenInfo {
    pub id: TokenId,
    pub scope: Scope,
    pub description: String,
    pub created_at: SystemTime,
    pub expires_at: Option<SystemTime>,
    pub revoked_at: Option<SystemTime>,
    /// The host a host token is bound to (None on a host token: enrollment).
    pub host: Option<HostId>,
}

/// A token to record.
#[derive(Debug, Clone)]
pub struct NewTokenRow<'a> {
    pub hash: &'a [u8; 32],
    pub tenant: &'a TenantId,
    pub scope: Scope,
    pub description: &'a str,
    pub expires_at: Option<SystemTime>,
    /// For a host token: the host it is bound to.
    pub host: Option<&'a HostId>,
}

const INFO_COLUMNS: &str = "id, scope, description, created_at, expires_at, revoked_at, host_id";

fn info_from_row(row: &AnyRow) -> Result<TokenInfo, DbError> {
    let read = |source| DbError::Query {
        op: "read token",
        source,
    };
    let id: Option<String> = row.try_get("id").map_err(read)?;
    let id = id.ok_or_else(|| DbError::Corrupt("a listed token has no id".into()))?;
    let scope: String = row.try_get("scope").map_err(read)?;
    let expires_at: Option<i64> = row.try_get("expires_at").map_err(read)?;
    let revoked_at: Option<i64> = row.try_get("revoked_at").map_err(read)?;
    let host: Option<String> = row.try_get("host_id").map_err(read)?;
    Ok(TokenInfo {
        id: parse_column(&id, "token id")?,
        scope: parse_column(&scope, "token scope")?,
        description: row.try_get("description").map_err(read)?,
        created_at: from_millis(row.try_get("created_at").map_err(read)?),
        expires_at: expires_at.map(from_millis),
        revoked_at: revoked_at.map(from_millis),
        host: host
            .map(|h| parse_column(&h, "token host id"))
            .transpose()?,
    })
}

/// Records a new token with a fresh id; returns it as listed.
pub(super) async fn insert_token(
    conn: &mut AnyConnection,
    new: &NewTokenRow<'_>,
) -> Result<TokenInfo, DbError> {
    let id = TokenId::generate();
    let now = millis(SystemTime::now());
    sqlx::query(
        "INSERT INTO tokens (token_hash, tenant, scope, workspace_id, description, created_at,
             expires_at, id, host_id)
         VALUES ($1, $2, $3, NULL, $4, $5, $6, $7, $8)",
    )
    .bind(new.hash.as_slice())
    .bind(new.tenant.as_str())
    .bind(new.scope.as_str())
    .bind(new.description)
    .bind(now)
    .bind(new.expires_at.map(millis))
    .bind(id.as_str())
    .bind(new.host.map(HostId::as_str))
    .execute(&mut *conn)
    .await
    .map_err(query_error("insert token"))?;
    Ok(TokenInfo {
        id,
        scope: new.scope,
        description: new.description.to_owned(),
        created_at: from_millis(now),
        expires_at: new.expires_at.map(|t| from_millis(millis(t))),
        revoked_at: None,
        host: new.host.cloned(),
    })
}

/// Where attempt `number` of `run` stands (None: the run is unknown).
async fn attempt_facts(
    conn: &mut AnyConnection,
    run: &RunId,
    number: u32,
) -> Result<Option<AttemptFacts>, DbError> {
    let row: Option<(String, i64, Option<String>)> = sqlx::query_as(
        "SELECT r.state, r.attempt_count, a.state FROM runs r
         LEFT JOIN attempts a ON a.run_id = r.id AND a.number = $2
         WHERE r.id = $1",
    )
    .bind(run.as_str())
    .bind(i64::from(number))
    .fetch_optional(&mut *conn)
    .await
    .map_err(query_error("attempt of a run token"))?;
    let Some((run_state, newest, attempt_state)) = row else {
        return Ok(None);
    };
    let run_state: RunState = parse_column(&run_state, "run state")?;
    let attempt_state = attempt_state
        .map(|s| parse_column::<AttemptState>(&s, "attempt state"))
        .transpose()?;
    Ok(Some(AttemptFacts {
        newest_attempt: unsigned(newest, "attempt count")?,
        ended: attempt_state.is_none_or(|s| s == AttemptState::Ended),
        run_cancelled: run_state == RunState::Cancelled,
    }))
}

impl MetadataStore {
    /// Gives every admin, client and host token recorded before tokens had
    /// ids one, so it can be listed and revoked.
    pub(super) async fn assign_token_ids(&self) -> Result<(), DbError> {
        let hashes: Vec<Vec<u8>> =
            sqlx::query_scalar("SELECT token_hash FROM tokens WHERE id IS NULL AND scope <> $1")
                .bind(Scope::Run.as_str())
                .fetch_all(&self.pool)
                .await
                .map_err(query_error("tokens without id"))?;
        for hash in hashes {
            sqlx::query("UPDATE tokens SET id = $1 WHERE token_hash = $2 AND id IS NULL")
                .bind(TokenId::generate().as_str())
                .bind(hash)
                .execute(&self.pool)
                .await
                .map_err(query_error("give a token an id"))?;
        }
        Ok(())
    }

    /// Records a token by its hash unless it is already known (the admin
    /// token at every start).
    pub async fn ensure_token(
        &self,
        hash: &[u8; 32],
        tenant: &TenantId,
        scope: Scope,
        workspace: Option<&WorkspaceId>,
        description: &str,
    ) -> Result<(), DbError> {
        let id = (scope != Scope::Run).then(TokenId::generate);
        sqlx::query(
            "INSERT INTO tokens (token_hash, tenant, scope, workspace_id, description, created_at, id)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             ON CONFLICT (token_hash) DO NOTHING",
        )
        .bind(hash.as_slice())
        .bind(tenant.as_str())
        .bind(scope.as_str())
        .bind(workspace.map(|w| w.as_str()))
        .bind(description)
        .bind(millis(SystemTime::now()))
        .bind(id.as_ref().map(TokenId::as_str))
        .execute(&self.pool)
        .await
        .map_err(query_error("insert token"))?;
        Ok(())
    }

    /// Records a new admin-created token (client, host enrollment).
    pub async fn create_token(&self, new: &NewTokenRow<'_>) -> Result<TokenInfo, DbError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(query_error("create token"))?;
        insert_token(&mut conn, new).await
    }

    /// [`Self::token`] for authenticating a call: an admin, client or host
    /// token this replica read in the last [`super::TOKEN_CACHE_TTL`] is not
    /// read again unless it was revoked since (see [`super::token_cache`]).
    pub async fn authenticating_token(
        &self,
        hash: &[u8; 32],
    ) -> Result<Option<TokenRecord>, DbError> {
        let epoch = match self.token_cache.lookup(hash, Instant::now()) {
            Ok(kept) => return Ok(Some(kept)),
            Err(epoch) => epoch,
        };
        let record = self.token(hash).await?;
        if let Some(record) = &record {
            self.token_cache.keep(*hash, record, epoch, Instant::now());
        }
        Ok(record)
    }

    /// Everything known about the token with this hash, for
    /// [`crate::tokens::admit`] to decide on (None: an unknown token).
    pub async fn token(&self, hash: &[u8; 32]) -> Result<Option<TokenRecord>, DbError> {
        let mut conn = self.pool.acquire().await.map_err(query_error("token"))?;
        let row = sqlx::query(
            "SELECT id, tenant, scope, workspace_id, run_id, attempt, host_id, expires_at, revoked_at
             FROM tokens WHERE token_hash = $1",
        )
        .bind(hash.as_slice())
        .fetch_optional(&mut *conn)
        .await
        .map_err(query_error("token"))?;
        let Some(row) = row else { return Ok(None) };
        let get = |source| DbError::Query {
            op: "token",
            source,
        };
        let id: Option<String> = row.try_get("id").map_err(get)?;
        let tenant: String = row.try_get("tenant").map_err(get)?;
        let scope: String = row.try_get("scope").map_err(get)?;
        let workspace: Option<String> = row.try_get("workspace_id").map_err(get)?;
        let run: Option<String> = row.try_get("run_id").map_err(get)?;
        let attempt: Option<i64> = row.try_get("attempt").map_err(get)?;
        let host: Option<String> = row.try_get("host_id").map_err(get)?;
        let expires_at: Option<i64> = row.try_get("expires_at").map_err(get)?;
        let revoked_at: Option<i64> = row.try_get("revoked_at").map_err(get)?;
        let run = match (run, attempt) {
            (Some(run), Some(attempt)) => Some(RunBinding {
                run: parse_column(&run, "run id")?,
                attempt: unsigned(attempt, "attempt")?,
            }),
            _ => None,
        };
        let facts = match &run {
            Some(binding) => attempt_facts(&mut conn, &binding.run, binding.attempt).await?,
            None => None,
        };
        Ok(Some(TokenRecord {
            id: id.map(|id| parse_column(&id, "token id")).transpose()?,
            tenant: parse_column(&tenant, "tenant")?,
            scope: parse_column(&scope, "token scope")?,
            workspace: workspace
                .map(|w| parse_column(&w, "workspace id"))
                .transpose()?,
            run,
            host: host.map(|h| parse_column(&h, "host id")).transpose()?,
            expires_at: expires_at.map(from_millis),
            revoked_at: revoked_at.map(from_millis),
            attempt: facts,
        }))
    }

    /// Whether attempt `number` of `run` is still current (see
    /// [`attempt_standing`]); the blob server asks before honouring a URL
    /// signed for an attempt.
    pub async fn attempt_current(&self, run: &RunId, number: u32) -> Result<(), NotCurrent> {
        let facts = async {
            let mut conn = self.pool.acquire().await.map_err(query_error("attempt"))?;
            attempt_facts(&mut conn, run, number).await
        };
        match facts.await {
            Ok(Some(facts)) => attempt_standing(number, facts),
            Ok(None) => Err(NotCurrent::Ended),
            Err(e) => {
                // Fail closed: a URL is refused while the answer is unknown.
                tracing::error!(error = %e, %run, attempt = number, "cannot check an attempt");
                Err(NotCurrent::Ended)
            }
        }
    }

    /// The admin, client and host tokens of `tenant`, oldest first.
    pub async fn list_tokens(&self, tenant: &TenantId) -> Result<Vec<TokenInfo>, DbError> {
        let rows = sqlx::query(&format!(
            "SELECT {INFO_COLUMNS} FROM tokens WHERE tenant = $1 AND scope <> $2 AND id IS NOT NULL
             ORDER BY id"
        ))
        .bind(tenant.as_str())
        .bind(Scope::Run.as_str())
        .fetch_all(&self.pool)
        .await
        .map_err(query_error("list tokens"))?;
        rows.iter().map(info_from_row).collect()
    }

    /// Revokes a token of `tenant` (the first revocation's time stays);
    /// returns it as listed now.
    pub async fn revoke_token(
        &self,
        tenant: &TenantId,
        id: &TokenId,
    ) -> Result<TokenInfo, DbError> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "UPDATE tokens SET revoked_at = COALESCE(revoked_at, $1) WHERE tenant = $2 AND id = $3",
        )
        .bind(millis(SystemTime::now()))
        .bind(tenant.as_str())
        .bind(id.as_str())
        .execute(tx.conn())
        .await
        .map_err(query_error("revoke token"))?;
        let row = sqlx::query(&format!(
            "SELECT {INFO_COLUMNS} FROM tokens WHERE tenant = $1 AND id = $2"
        ))
        .bind(tenant.as_str())
        .bind(id.as_str())
        .fetch_optional(tx.conn())
        .await
        .map_err(query_error("revoked token"))?
        .ok_or_else(|| DbError::NotFound(format!("token {id} does not exist")))?;
        let info = info_from_row(&row)?;
        if let Some(channel) = &self.run_channel {
            // Other replicas forget it when this commits.
            channel
                .announce(tx.conn(), &format!("{}{id}", super::REVOKED_TOKEN_PREFIX))
                .await
                .map_err(query_error("announce a revocation"))?;
        }
        self.commit(tx).await?;
        self.token_cache.forget(id);
        Ok(info)
    }
}

/// The expiry of a token created now for `ttl` (refused when it does not
/// fit a stored time).
pub fn expiry_after(ttl: std::time::Duration) -> Result<SystemTime, DbError> {
    SystemTime::now()
        .checked_add(ttl)
        .filter(|t| millis(*t) < i64::MAX)
        .ok_or_else(|| DbError::Invalid(format!("an expiry {ttl:?} from now is too far away")))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::db::tests::open;
    use crate::tokens::{self, admit};

    #[tokio::test]
    async fn tokens_resolve_by_hash_and_the_admin_token_is_recorded_once() {
        let (_dir, db, tenant) = open().await;
        let token = tokens::generate(Scope::Admin);
        db.ensure_token(&token.hash, &tenant, Scope::Admin, None, "test")
            .await
            .unwrap();
        db.ensure_token(&token.hash, &tenant, Scope::Admin, None, "test")
            .await
            .unwrap();
        let record = db.token(&token.hash).await.unwrap().unwrap();
        let principal = admit(record, SystemTime::now()).unwrap();
        assert_eq!(principal.scope, Scope::Admin);
        assert_eq!(principal.tenant, tenant);
        assert!(principal.token.is_some(), "an admin token has an id");
        assert_eq!(db.list_tokens(&tenant).await.unwrap().len(), 1);
        assert!(
            db.token(&tokens::hash("cairn_admin_unknown"))
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn created_tokens_list_with_their_expiry_and_revocation() {
        let (_dir, db, tenant) = open().await;
        let token = tokens::generate(Scope::Client);
        let expires = expiry_after(Duration::from_secs(3600)).unwrap();
        let created = db
            .create_token(&NewTokenRow {
                hash: &token.hash,
                tenant: &tenant,
                scope: Scope::Client,
                description: "ci",
                expires_at: Some(expires),
                host: None,
            })
            .await
            .unwrap();
        let listed = db.list_tokens(&tenant).await.unwrap();
        assert_eq!(listed, vec![created.clone()]);
        assert_eq!(created.expires_at, Some(from_millis(millis(expires))));

        let revoked = db.revoke_token(&tenant, &created.id).await.unwrap();
        let first = revoked.revoked_at.expect("revoked");
        let again = db.revoke_token(&tenant, &created.id).await.unwrap();
        assert_eq!(
            again.revoked_at,
            Some(first),
            "the first revocation's time stays"
        );
        let record = db.token(&token.hash).await.unwrap().unwrap();
        assert_eq!(
            admit(record, SystemTime::now()),
            Err(cairn_proto::refusal::Refusal::Token(
                cairn_proto::refusal::TokenRefusal::Revoked
            ))
        );
        let missing = db.revoke_token(&tenant, &TokenId::generate()).await;
        assert!(matches!(missing, Err(DbError::NotFound(_))), "{missing:?}");
    }

    #[tokio::test]
    async fn tokens_of_older_schemas_get_an_id_at_open() {
        let (dir, db, tenant) = open().await;
        let token = tokens::generate(Scope::Host);
        db.ensure_token(&token.hash, &tenant, Scope::Host, None, "old")
            .await
            .unwrap();
        sqlx::query("UPDATE tokens SET id = NULL")
            .execute(&db.pool)
            .await
            .unwrap();
        assert!(db.list_tokens(&tenant).await.unwrap().is_empty());
        db.close().await;
        let db = MetadataStore::open(&crate::db::tests::test_location(dir.path()))
            .await
            .unwrap();
        let listed = db.list_tokens(&tenant).await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].description, "old");
    }
}
