//! Which replica leads: the one holding the leader lease in the database.
//!
//! Several coordinators may serve one database. Each serves every RPC, but
//! only the leader runs the scheduler's passes and the garbage collector's
//! cycles, so two replicas never place the same queue at once. The lease is
//! a row (`leader_leases`) naming its holder and when it runs out; the
//! holder renews it well before then, and another replica takes it over once
//! it has run out, so a dead leader is replaced within [`LEASE_TTL`].
//!
//! A leader acts only while its lease has at least [`ACT_MARGIN`] left, so a
//! leader whose renewals stall stops acting before anyone can take over.
//! Placement is safe even if two replicas ever act at once: an assignment is
//! made only if the run's attempt count is still the one the pass read.
//!
//! [`decide`] is the pure rule; [`Leadership`] keeps one replica's view and
//! touches the database only to take or renew the lease (every
//! [`RENEW_AFTER`]) or, as a follower, to read it once it could have run out.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use crate::db::{DbError, MetadataStore};

/// How long a taken or renewed lease lasts.
pub const LEASE_TTL: Duration = Duration::from_secs(6);
/// The holder renews once this much of its lease has passed.
pub const RENEW_AFTER: Duration = Duration::from_secs(2);
/// A holder stops acting when less than this is left of its lease.
pub const ACT_MARGIN: Duration = Duration::from_secs(2);

/// The lease of the scheduler and the collector.
pub const LEADER_LEASE: &str = "leader";

/// A lease as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    pub holder: String,
    pub expires_at: SystemTime,
}

/// What a replica does about a lease it has read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseDecision {
    /// Nobody holds it, or its holder's time ran out: take it.
    Take,
    /// This replica holds it: extend it.
    Renew,
    /// Another replica holds it until then.
    Follow { holder: String, until: SystemTime },
}

/// The rule for `current` (none if never taken) seen by replica `me` at `now`.
pub fn decide(current: Option<&LeaseRecord>, me: &str, now: SystemTime) -> LeaseDecision {
    match current {
        None => LeaseDecision::Take,
        Some(lease) if lease.holder == me => LeaseDecision::Renew,
        Some(lease) if lease.expires_at <= now => LeaseDecision::Take,
        Some(lease) => LeaseDecision::Follow {
            holder: lease.holder.clone(),
            until: lease.expires_at,
        },
    }
}

/// What this replica knows of the lease.
#[derive(Debug, Clone)]
enum Known {
    /// Nothing yet, or a failed attempt: ask the database.
    Unknown,
    /// Held by this replica: taken or renewed at `renewed`, until `until`.
    Held {
        renewed: SystemTime,
        until: SystemTime,
    },
    /// Held by another until `until`: nothing to do before then.
    Following { until: SystemTime },
}

/// One replica's side of the leader lease.
#[derive(Debug)]
pub struct Leadership {
    me: String,
    known: Mutex<Known>,
}

impl Leadership {
    /// This replica, under a name unique to the process.
    pub fn new() -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "coordinator".into());
        Self::named(format!(
            "{host}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ))
    }

    pub fn named(me: impl Into<String>) -> Self {
        Self {
            me: me.into(),
            known: Mutex::new(Known::Unknown),
        }
    }

    /// This replica's name in the lease.
    pub fn name(&self) -> &str {
        &self.me
    }

    /// Whether this replica may act as the leader now: renews or takes the
    /// lease when due, reads it as a follower once it could have run out.
    pub async fn lead(&self, db: &MetadataStore) -> Result<bool, DbError> {
        let now = SystemTime::now();
        let known = self.known.lock().expect("leadership lock").clone();
        match known {
            Known::Held { renewed, until }
                if now < renewed + RENEW_AFTER && now + ACT_MARGIN < until =>
            {
                return Ok(true);
            }
            Known::Following { until } if now < until => return Ok(false),
            _ => {}
        }
        let result = db.try_lease(LEADER_LEASE, &self.me, LEASE_TTL).await;
        let mut known = self.known.lock().expect("leadership lock");
        match result {
            Ok(LeaseDecision::Take | LeaseDecision::Renew) => {
                let was = matches!(*known, Known::Held { .. });
                *known = Known::Held {
                    renewed: now,
                    until: now + LEASE_TTL,
                };
                if !was {
                    tracing::info!(replica = %self.me, "this coordinator leads: it schedules and collects garbage");
                }
                Ok(true)
            }
            Ok(LeaseDecision::Follow { holder, until }) => {
                if !matches!(*known, Known::Following { .. }) {
                    tracing::info!(replica = %self.me, leader = %holder, "another coordinator leads");
                }
                *known = Known::Following { until };
                Ok(false)
            }
            Err(e) => {
                // Still the leader while the lease it holds lasts.
                let holding =
                    matches!(*known, Known::Held { until, .. } if now + ACT_MARGIN < until);
                if !holding {
                    *known = Known::Unknown;
                }
                Err(e)
            }
        }
    }

    /// Gives the lease up (at shutdown), so another replica need not wait
    /// for it to run out.
    pub async fn resign(&self, db: &MetadataStore) -> Result<(), DbError> {
        let held = matches!(
            *self.known.lock().expect("leadership lock"),
            Known::Held { .. }
        );
        if held {
            db.release_lease(LEADER_LEASE, &self.me).await?;
            *self.known.lock().expect("leadership lock") = Known::Unknown;
        }
        Ok(())
    }
}

impl Default for Leadership {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, expires_at: SystemTime) -> LeaseRecord {
        LeaseRecord {
            holder: holder.into(),
            expires_at,
        }
    }

    #[test]
    fn a_free_or_run_out_lease_is_taken_and_a_held_one_followed() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        assert_eq!(decide(None, "a", now), LeaseDecision::Take);
        let later = now + Duration::from_secs(3);
        assert_eq!(
            decide(Some(&lease("b", later)), "a", now),
            LeaseDecision::Follow {
                holder: "b".into(),
                until: later
            }
        );
        assert_eq!(
            decide(Some(&lease("b", now)), "a", now),
            LeaseDecision::Take
        );
        assert_eq!(
            decide(Some(&lease("a", now - Duration::from_secs(9))), "a", now),
            LeaseDecision::Renew,
            "its own lease, even run out, is renewed"
        );
    }

    #[test]
    fn a_holder_stops_acting_before_anyone_may_take_over() {
        // The holder renews at least every RENEW_AFTER and stops acting
        // ACT_MARGIN before the lease runs out.
        assert!(RENEW_AFTER + ACT_MARGIN < LEASE_TTL);
        assert!(ACT_MARGIN > Duration::ZERO);
    }

    #[tokio::test]
    async fn one_of_two_replicas_leads_and_the_other_takes_over_when_it_resigns() {
        let (_dir, db, _tenant) = crate::db::tests::open().await;
        let a = Leadership::named("a");
        let b = Leadership::named("b");
        assert!(a.lead(&db).await.unwrap());
        assert!(!b.lead(&db).await.unwrap());
        assert!(a.lead(&db).await.unwrap(), "the leader keeps leading");
        a.resign(&db).await.unwrap();
        // b follows until the lease it read runs out; a fresh view of b's sees it free.
        let b = Leadership::named("b");
        assert!(b.lead(&db).await.unwrap());
        assert!(!Leadership::named("a").lead(&db).await.unwrap());
    }
}
