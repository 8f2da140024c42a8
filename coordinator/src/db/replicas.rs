//! What several coordinators on one database share: leases (who leads) and
//! keys (the run-token key).

use std::time::{Duration, SystemTime};

use super::{DbError, MetadataStore, from_millis, millis, query_error};
use crate::leader::{LeaseDecision, LeaseRecord, decide};

impl MetadataStore {
    /// Takes or renews lease `name` for `holder` for `ttl` when the rule of
    /// [`decide`] says so, in one write transaction; says who holds it
    /// otherwise.
    pub async fn try_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<LeaseDecision, DbError> {
        let mut tx = self.begin_write().await?;
        let now = SystemTime::now();
        let current: Option<(String, i64)> =
            sqlx::query_as("SELECT holder, expires_at FROM leases WHERE name = $1")
                .bind(name)
                .fetch_optional(tx.conn())
                .await
                .map_err(query_error("read lease"))?;
        let current = current.map(|(holder, expires_at)| LeaseRecord {
            holder,
            expires_at: from_millis(expires_at),
        });
        let decision = decide(current.as_ref(), holder, now);
        if matches!(decision, LeaseDecision::Take | LeaseDecision::Renew) {
            sqlx::query(
                "INSERT INTO leases (name, holder, expires_at) VALUES ($1, $2, $3)
                 ON CONFLICT (name) DO UPDATE SET holder = $2, expires_at = $3",
            )
            .bind(name)
            .bind(holder)
            .bind(millis(now + ttl))
            .execute(tx.conn())
            .await
            .map_err(query_error("take lease"))?;
        }
        self.commit(tx).await?;
        Ok(decision)
    }

    /// Ends `holder`'s lease `name` now (if it still holds it).
    pub async fn release_lease(&self, name: &str, holder: &str) -> Result<(), DbError> {
        let mut tx = self.begin_write().await?;
        sqlx::query("UPDATE leases SET expires_at = $1 WHERE name = $2 AND holder = $3")
            .bind(millis(SystemTime::now()))
            .bind(name)
            .bind(holder)
            .execute(tx.conn())
            .await
            .map_err(query_error("release lease"))?;
        self.commit(tx).await
    }

    /// The key `name` all replicas share: the stored one, or `candidate`
    /// stored now if there is none (the first replica's own key).
    pub async fn shared_key(&self, name: &str, candidate: &[u8]) -> Result<Vec<u8>, DbError> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO shared_keys (name, value, created_at) VALUES ($1, $2, $3)
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(name)
        .bind(candidate)
        .bind(millis(SystemTime::now()))
        .execute(tx.conn())
        .await
        .map_err(query_error("store shared key"))?;
        let value: Vec<u8> = sqlx::query_scalar("SELECT value FROM shared_keys WHERE name = $1")
            .bind(name)
            .fetch_one(tx.conn())
            .await
            .map_err(query_error("read shared key"))?;
        self.commit(tx).await?;
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn the_first_key_stored_is_the_one_every_replica_gets() {
        let (_dir, db, _tenant) = super::super::tests::open().await;
        assert_eq!(db.shared_key("k", &[1; 32]).await.unwrap(), vec![1; 32]);
        assert_eq!(db.shared_key("k", &[2; 32]).await.unwrap(), vec![1; 32]);
        assert_eq!(db.shared_key("other", &[3; 4]).await.unwrap(), vec![3; 4]);
    }
}
