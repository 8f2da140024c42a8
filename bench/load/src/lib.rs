//! `cairn-load`: a load harness for the coordinator. It starts real
//! `cairn-coordinator serve` processes on loopback ([`ClusterOptions`]:
//! one, or several replicas on one database) and plays their clients over
//! real gRPC, then returns a report; it prints nothing.
//!
//! - [`fleet`]: simulated hosts register, heartbeat at the interval the
//!   coordinator gives (their starts spread over one interval) and report
//!   every sandbox they were assigned as running, while runs are created
//!   with bounded concurrency; measures how fast runs reach hosts and what
//!   heartbeats cost ([`FleetReport`]).
//! - [`commits`]: workspaces each get one real first checkpoint (a small
//!   random pack uploaded through its signed URL), then concurrent workers
//!   commit checkpoints that reference that pack again; measures commit
//!   throughput and latency ([`CommitsReport`]).
//!
//! Simulated clients share a small pool of channels (HTTP/2 connections)
//! per replica, round-robin. Counts are bounded (the `MAX_*` constants)
//! and every phase stops at the duration limit, reporting what it had.

mod cluster;
mod commits;
mod fleet;
pub mod stats;

use std::time::Duration;

pub use cluster::{ClusterOptions, ReplicaReport, SchemaReport};
pub use commits::{CommitsOptions, CommitsReport, commits};
pub use fleet::{FleetOptions, FleetReport, fleet};

/// Most simulated hosts.
pub const MAX_HOSTS: u64 = 5_000;
/// Most slots per simulated host.
pub const MAX_SLOTS: u64 = 1_000;
/// Most runs one fleet phase creates.
pub const MAX_RUNS: u64 = 50_000;
/// Most workspaces of a commits phase.
pub const MAX_WORKSPACES: u64 = 10_000;
/// Most commits of a commits phase.
pub const MAX_COMMITS: u64 = 1_000_000;
/// Most calls in flight (commit workers, run creations).
pub const MAX_CONCURRENCY: u64 = 1_024;
/// Most coordinator processes.
pub const MAX_REPLICAS: u64 = 8;
/// Most channels to one replica.
pub const MAX_CHANNELS: u64 = 64;
/// Longest duration limit.
pub const MAX_DURATION: Duration = Duration::from_secs(3_600);

/// Why a load run could not be made (what the coordinators answered
/// during a run is in its report, not here).
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    #[error("the coordinator did not start: {why}; the end of its log:\n{log_tail}")]
    Startup { why: String, log_tail: String },
    #[error("{what}: {status}")]
    Rpc {
        what: String,
        #[source]
        status: tonic::Status,
    },
    #[error("{0}")]
    Setup(String),
}

impl LoadError {
    fn rpc(what: impl Into<String>, status: tonic::Status) -> Self {
        Self::Rpc {
            what: what.into(),
            status,
        }
    }
}

/// Checks that `value` of `flag` lies in `min..=max`.
fn bounded(flag: &str, value: u64, min: u64, max: u64) -> Result<(), LoadError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(LoadError::Invalid(format!(
            "{flag} is {value}; it must lie between {min} and {max}"
        )))
    }
}

fn bounded_duration(flag: &str, value: Duration) -> Result<(), LoadError> {
    if value.is_zero() || value > MAX_DURATION {
        return Err(LoadError::Invalid(format!(
            "{flag} is {value:?}; it must be above zero and at most {MAX_DURATION:?}"
        )));
    }
    Ok(())
}

/// Raises this process's soft limit on open files to its hard limit (the
/// harness holds a few connections per replica, but the coordinators it
/// starts inherit the limit) and returns the limit in force.
pub fn raise_nofile_limit() -> std::io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit that lowers no hard limit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        limit = raised;
    }
    // The field is 32 bits wide on some targets.
    #[allow(clippy::unnecessary_cast)]
    Ok(limit.rlim_cur as u64)
}

/// A channel with the bearer token `token`, for any service's client.
type AuthChannel = tonic::service::interceptor::InterceptedService<
    tonic::transport::Channel,
    cairn_proto::auth::BearerInterceptor,
>;

fn auth_channel(channel: tonic::transport::Channel, token: &str) -> Result<AuthChannel, LoadError> {
    let interceptor = cairn_proto::auth::BearerInterceptor::new(Some(token))
        .map_err(|e| LoadError::Setup(format!("a token cannot be sent: {e}")))?;
    Ok(tonic::service::interceptor::InterceptedService::new(
        channel,
        interceptor,
    ))
}

/// Whether a call refused with `status` is worth trying again during set-up.
fn retryable(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::ResourceExhausted | tonic::Code::Aborted
    )
}

/// Calls `call` until it succeeds, is refused for good, or has been tried
/// five times (set-up calls only: measured calls are never retried).
async fn with_retries<T, F, Fut>(what: &str, mut call: F) -> Result<T, LoadError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let mut backoff = Duration::from_millis(100);
    let mut tries = 1;
    loop {
        match call().await {
            Ok(value) => return Ok(value),
            Err(status) if tries < 5 && retryable(&status) => {
                tokio::time::sleep(backoff).await;
                backoff *= 2;
                tries += 1;
            }
            Err(status) => return Err(LoadError::rpc(what, status)),
        }
    }
}

fn proto_duration(d: Option<prost_types::Duration>) -> Option<Duration> {
    d.and_then(|d| Duration::try_from(d).ok())
}
