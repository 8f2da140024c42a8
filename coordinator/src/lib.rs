//! cairn's control plane.
//!
//! The coordinator is thin: it never reads or writes checkpoint bytes. It
//! keeps metadata (workspaces, checkpoints, which packs hold which blobs),
//! hands out short-lived signed URLs through which runners move the bytes
//! themselves, and commits checkpoints atomically after checking that every
//! pack they reference is in the store. It also runs the runs: hosts
//! register and heartbeat, the scheduler assigns queued runs to them, and
//! runners report each attempt's life.
//!
//! ```text
//!   cairnctl, clients ── Run/Admin/Workspace ──────┐
//!   cairn-host ───────── HostService ──────────────┼──► coordinator ──► SQLite (DIR/cairn.db)
//!   runner ───────────── Runner/Checkpoint ────────┘     │ scheduler: lost hosts, holds, placement
//!     │                                                  │ signs URLs, stats objects
//!     └──── PUT / GET signed URLs ─────────────────────► blob server ──► DIR/blobs/…
//! ```
//!
//! Code map:
//! - [`serve`] / [`Coordinator`]: start-up (data dir, database, keys, admin
//!   token) and the two servers, until shutdown.
//! - [`datadir`]: what lives in the data directory; first-start set-up.
//! - [`db`]: [`db::MetadataStore`], the metadata in SQLite, one method per
//!   operation; the commit transaction.
//! - [`grpc`]: the `cairn.v1` services (workspaces, checkpoints, runs, hosts,
//!   runners, admin), health and reflection; [`grpc::ServiceError`] → status
//!   codes in one place.
//! - [`runlife`]: the run's life as a pure transition table and the
//!   retry/release policy; [`db`] persists what it decides.
//! - [`scheduler`]: the background task that marks lost hosts, expires
//!   holds and assigns queued runs.
//! - [`leader`]: the leader lease; only the replica holding it schedules and
//!   collects garbage when several coordinators share a database.
//! - [`auth`] and [`tokens`]: the bearer-token layer over every gRPC service,
//!   token format and hashing, scopes.
//! - [`store`]: the [`store::ObjectStore`] trait, [`store::LocalStore`],
//!   [`store::S3Store`] (`--store s3://…`) and the fault-injecting
//!   [`store::FaultyStore`].
//! - [`signing`]: HMAC-SHA256 signed URLs of the embedded blob store.
//! - [`blob_http`]: the embedded blob server (axum) behind those URLs.
//! - [`conn_limits`]: connection caps and deadlines of both listeners.
//! - [`metrics`]: Prometheus metrics on `--metrics-listen`: counters kept
//!   as calls are answered, database figures read at each scrape.
//! - [`tls`]: TLS on both listeners; mutual TLS for hosts.
//!
//! Invariants:
//! - A checkpoint that did not commit does not exist: its record, its pack and
//!   blob records and the workspace's sequence move together in one
//!   transaction, after every referenced pack was found in the store.
//! - A commit carrying a generation other than the workspace's is refused.
//!   Each attempt of a run bumps its workspace's generation, and a run token
//!   commits only at its own attempt's generation, so a superseded runner
//!   cannot overwrite newer work.
//! - Every run state change is a run event, written in the same transaction.
//! - Tokens and signed URLs are never logged; tokens are stored hashed. Run
//!   tokens are derived from the run-token key in the database (seeded from
//!   the first replica's `DIR/run-token.key`), so any replica can re-send them.

pub mod auth;
pub mod blob_http;
pub mod clock;
pub mod conn_limits;
pub mod datadir;
pub mod db;
pub mod gc;
pub mod grpc;
pub mod leader;
pub mod metrics;
pub mod retention;
pub mod runlife;
pub mod scheduler;
pub mod signing;
pub mod store;
pub mod tls;
pub mod tokens;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cairn_proto::ids::TenantId;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::blob_http::BlobServer;
use crate::clock::Clock;
use crate::conn_limits::{ConnectionCaps, Timeouts};
use crate::datadir::{DataDir, DataDirError};
use crate::db::{DatabaseLocation, DbError, MetadataStore};
use crate::gc::{Collector, GcConfig};
use crate::grpc::{GrpcError, HostTiming, ServerLimits, ServiceLimits, Shared};
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::scheduler::{MAX_PASS_INTERVAL, SchedulerConfig, SchedulerHandle};
use crate::signing::UrlSigner;
use crate::store::{LocalStore, ObjectStore, RemoteStore, StoreConfigError, StoreLayer};
use crate::tls::{ServerTls, TlsFiles};
use crate::tokens::{RUN_TOKEN_KEY_NAME, RunTokenKey, Scope};
use cairn_proto::tls::TlsError;

/// How to run a coordinator.
#[derive(Clone)]
pub struct ServerConfig {
    /// Where metadata, keys, the admin token and the embedded blob store live.
    pub data_dir: PathBuf,
    /// The metadata database (default: the SQLite file in the data directory).
    pub database: Option<DatabaseLocation>,
    /// Base URL runners reach the blob server at (default: the blob
    /// listener's address, `http://IP:PORT`).
    pub blob_public_url: Option<String>,
    /// URL lifetime and request limits.
    pub limits: ServiceLimits,
    /// Where objects live: `None` for the embedded blob store under the
    /// data directory, or a provider's bucket (`--store`).
    pub store: Option<RemoteStore>,
    /// Wraps the object store the services use (tests inject a
    /// [`store::FaultyStore`] here).
    pub store_layer: Option<StoreLayer>,
    /// A host whose last heartbeat is older than this is lost (default 10s).
    pub host_lease: Duration,
    /// How often hosts are told to heartbeat (default 1s; below the lease).
    pub heartbeat_interval: Duration,
    /// Connections the blob server holds open at once (lowered to fit the
    /// file-handle limit).
    pub blob_max_connections: usize,
    /// Header, idle and minimum-rate limits of blob connections.
    pub blob_timeouts: Timeouts,
    /// Connection and stream limits of the gRPC listener (its connection
    /// cap is lowered to fit the file-handle limit too).
    pub grpc_limits: ServerLimits,
    /// Serve gRPC and blobs over TLS with these files (and require client
    /// certificates of hosts when they name a client CA).
    pub tls: Option<TlsFiles>,
    /// How often the certificate files are looked at for a renewal.
    pub tls_reload_interval: Duration,
    /// Retention defaults and garbage collection (grace, interval).
    pub gc: GcConfig,
    /// What retention and garbage collection take as now (tests move it).
    pub clock: Clock,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("data_dir", &self.data_dir)
            .field("database", &self.database)
            .field("blob_public_url", &self.blob_public_url)
            .field("limits", &self.limits)
            .field("store", &self.store)
            .field("store_layer", &self.store_layer.is_some())
            .field("host_lease", &self.host_lease)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("blob_max_connections", &self.blob_max_connections)
            .field("blob_timeouts", &self.blob_timeouts)
            .field("grpc_limits", &self.grpc_limits)
            .field("tls", &self.tls)
            .field("tls_reload_interval", &self.tls_reload_interval)
            .field("gc", &self.gc)
            .finish()
    }
}

impl ServerConfig {
    /// Defaults: URLs live an hour (see [`ServiceLimits`]); hosts heartbeat every
    /// second and are lost after 10 seconds of silence.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        let timing = HostTiming::default();
        Self {
            data_dir: data_dir.into(),
            database: None,
            blob_public_url: None,
            limits: ServiceLimits::default(),
            store: None,
            store_layer: None,
            host_lease: timing.lease,
            heartbeat_interval: timing.heartbeat_interval,
            blob_max_connections: DEFAULT_BLOB_MAX_CONNECTIONS,
            blob_timeouts: Timeouts::default(),
            grpc_limits: ServerLimits::default(),
            tls: None,
            tls_reload_interval: Duration::from_secs(30),
            gc: GcConfig::default(),
            clock: Clock::system(),
        }
    }
}

/// Connections the blob server holds open at once by default.
pub const DEFAULT_BLOB_MAX_CONNECTIONS: usize = 4096;

/// Why the coordinator could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("data directory: {0}")]
    DataDir(#[from] DataDirError),
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("blob public URL {0:?} is not an http:// or https:// URL")]
    BadPublicUrl(String),
    #[error("signed URLs must live at least a second")]
    UrlTtlTooShort,
    #[error(
        "the garbage collection grace ({grace}) must be longer than signed URLs live ({url_ttl}): a pack could go while a URL to it is still used"
    )]
    GraceTooShort { grace: String, url_ttl: String },
    #[error(
        "the heartbeat interval ({interval}) must be positive and shorter than the host lease ({lease})"
    )]
    BadHostTiming { interval: String, lease: String },
    #[error("could not read the address of a listener: {0}")]
    Listener(std::io::Error),
    #[error("blob server failed: {0}")]
    BlobServer(std::io::Error),
    #[error("metrics server failed: {0}")]
    MetricsServer(std::io::Error),
    #[error(transparent)]
    Grpc(#[from] GrpcError),
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
    #[error("object store: {0}")]
    Store(#[from] StoreConfigError),
}

/// A coordinator whose data directory, database and keys are ready.
pub struct Coordinator {
    config: ServerConfig,
    data_dir: DataDir,
    db: Arc<MetadataStore>,
    signer: UrlSigner,
    run_tokens: RunTokenKey,
    admin_token_created: bool,
    tls: Option<ServerTls>,
    /// Where [`metrics`] are served, if anywhere.
    metrics_listener: Option<TcpListener>,
    /// Held while this coordinator lives: no second one serves from the
    /// same data directory.
    _data_dir_lock: std::fs::File,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("data_dir", &self.data_dir)
            .finish_non_exhaustive()
    }
}

impl Coordinator {
    /// Prepares the data directory: creates it (0700), the database (and
    /// applies migrations), the URL-signing key, the default tenant and its
    /// key, and the admin token on first start; reuses them afterwards.
    pub async fn open(config: ServerConfig) -> Result<Self, ServeError> {
        if config.limits.url_ttl.as_secs() < 1 {
            return Err(ServeError::UrlTtlTooShort);
        }
        if config.gc.grace <= config.limits.url_ttl {
            return Err(ServeError::GraceTooShort {
                grace: humantime::format_duration(config.gc.grace).to_string(),
                url_ttl: humantime::format_duration(config.limits.url_ttl).to_string(),
            });
        }
        if let Some(remote) = &config.store {
            remote.check_url_ttl(config.limits.url_ttl)?;
        }
        if let Some(url) = &config.blob_public_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err(ServeError::BadPublicUrl(url.clone()));
        }
        if config.heartbeat_interval.is_zero() || config.heartbeat_interval >= config.host_lease {
            return Err(ServeError::BadHostTiming {
                interval: humantime::format_duration(config.heartbeat_interval).to_string(),
                lease: humantime::format_duration(config.host_lease).to_string(),
            });
        }
        // Before anything is created: a bad certificate is a mistake in the
        // command line, not a reason to set up a data directory.
        let tls = config.tls.as_ref().map(ServerTls::load).transpose()?;
        let data_dir = DataDir::new(&config.data_dir);
        data_dir.create()?;
        let data_dir_lock = data_dir.lock()?;
        let signer = UrlSigner::new(&data_dir.load_or_create_signing_key()?);
        let location = config
            .database
            .clone()
            .unwrap_or_else(|| DatabaseLocation::sqlite(data_dir.database()));
        let db = MetadataStore::open(&location).await?;
        // Every replica derives the same run tokens: the first one's key,
        // kept in the database, wins over the data directory's own.
        let own_key = data_dir.load_or_create_run_token_key()?;
        let shared_key = db.shared_key(RUN_TOKEN_KEY_NAME, &own_key).await?;
        let run_tokens = RunTokenKey::new(&shared_key.as_slice().try_into().map_err(|_| {
            DbError::Corrupt(format!(
                "the stored run-token key is {} bytes, not {}",
                shared_key.len(),
                tokens::RUN_TOKEN_KEY_LEN
            ))
        })?);
        if shared_key != own_key {
            tracing::info!(path = %data_dir.run_token_key().display(), "another coordinator on this database made the run-token key; using it, not this data directory's");
        }
        let tenant = TenantId::default_tenant();
        if db.ensure_tenant(&tenant).await? {
            tracing::info!(%tenant, "created tenant and its first key");
        }
        // The file is written before its hash is recorded, so a crash in
        // between leaves a token that the next start records.
        let (admin_token, admin_token_created) = data_dir.load_or_create_admin_token()?;
        db.ensure_token(
            &tokens::hash(&admin_token),
            &tenant,
            Scope::Admin,
            None,
            "admin token (admin.token)",
        )
        .await?;
        if admin_token_created {
            tracing::info!(path = %data_dir.admin_token().display(), "admin token written");
        }
        // Uploads in flight when an earlier process died stay in the temp
        // dir otherwise; none of them can be in flight now: this process
        // holds the data directory's lock and serves nothing yet. Swept
        // here, before the caller announces its endpoints, so that a
        // coordinator that says it is up has swept.
        match store::local::sweep_uploads(&data_dir.blobs()) {
            Ok(0) => {}
            Ok(removed) => tracing::info!(removed, "removed upload temp files an earlier run left"),
            Err(e) => tracing::warn!(error = %e, "could not sweep the upload temp files"),
        }
        Ok(Self {
            config,
            data_dir,
            db: Arc::new(db),
            signer,
            run_tokens,
            admin_token_created,
            tls,
            metrics_listener: None,
            _data_dir_lock: data_dir_lock,
        })
    }

    /// Serves the Prometheus metrics ([`metrics`]) at `/metrics` on
    /// `listener` too, while the coordinator runs.
    pub fn with_metrics_listener(mut self, listener: TcpListener) -> Self {
        self.metrics_listener = Some(listener);
        self
    }

    pub fn data_dir(&self) -> &DataDir {
        &self.data_dir
    }

    /// Whether the listeners serve TLS (their URLs are `https://`).
    pub fn uses_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Whether [`Coordinator::open`] created the admin token (first start).
    pub fn admin_token_created(&self) -> bool {
        self.admin_token_created
    }

    /// Runs the gRPC server on `grpc_listener`, the blob server on
    /// `blob_listener` and the scheduler until `shutdown` completes (or
    /// either server fails), then lets open requests finish and closes the
    /// database.
    pub async fn run(
        mut self,
        grpc_listener: TcpListener,
        blob_listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let metrics = Arc::new(Metrics::new());
        let metrics_listener = self.metrics_listener.take();
        let grpc_addr = grpc_listener.local_addr().map_err(ServeError::Listener)?;
        let blob_addr = blob_listener.local_addr().map_err(ServeError::Listener)?;
        let blob_url = match &self.config.blob_public_url {
            Some(url) => url.trim_end_matches('/').to_owned(),
            None => local_url(blob_addr, self.uses_tls()),
        };
        let base: Arc<dyn ObjectStore> = match &self.config.store {
            None => Arc::new(LocalStore::new(
                self.data_dir.blobs(),
                self.signer.clone(),
                &blob_url,
            )),
            Some(remote) => {
                tracing::info!(store = %remote, "objects live in a remote store");
                remote.open()?
            }
        };
        let store = match &self.config.store_layer {
            Some(layer) => layer(base),
            None => base,
        };
        let stop = CancellationToken::new();
        let scheduler = SchedulerHandle::new();
        let shared = Shared {
            db: self.db.clone(),
            store: store.clone(),
            limits: self.config.limits.clone(),
            host_timing: HostTiming {
                heartbeat_interval: self.config.heartbeat_interval,
                lease: self.config.host_lease,
            },
            run_tokens: self.run_tokens.clone(),
            scheduler: scheduler.clone(),
            shutdown: stop.clone(),
            collector: Collector::new(
                self.db.clone(),
                store.clone(),
                self.config.gc.clone(),
                self.config.clock.clone(),
                metrics.clone(),
            ),
            metrics: metrics.clone(),
        };
        let caps = connection_caps(&self.config);
        let blob_router =
            BlobServer::new(self.data_dir.blobs(), self.signer.clone(), self.db.clone())
                .map_err(ServeError::BlobServer)?
                .router();

        tracing::info!(grpc = %local_url(grpc_addr, self.uses_tls()), blob = %blob_url, data_dir = %self.data_dir.root().display(), "coordinator serving");
        let shared_collector = shared.collector.clone();
        let leadership = Arc::new(Leadership::new());
        let scheduling = scheduler::run(
            self.db.clone(),
            self.run_tokens.clone(),
            SchedulerConfig {
                lease: self.config.host_lease,
                pass_interval: MAX_PASS_INTERVAL.min(self.config.heartbeat_interval),
            },
            scheduler,
            leadership.clone(),
            metrics.clone(),
            stop.clone(),
        );
        let relaying = self.db.relay_run_changes(stop.clone().cancelled_owned());
        let grpc = async {
            let limits = ServerLimits {
                max_connections: caps.grpc,
                ..self.config.grpc_limits
            };
            let result = grpc::serve(
                shared,
                grpc_listener,
                limits,
                self.tls.clone(),
                stop.clone().cancelled_owned(),
            )
            .await;
            stop.cancel();
            result
        };
        let blob = async {
            let result = blob_http::serve(
                blob_listener,
                blob_router,
                caps.blob,
                self.config.blob_timeouts,
                self.tls.as_ref().map(|tls| tls.blob_acceptor().clone()),
                stop.clone().cancelled_owned(),
            )
            .await;
            stop.cancel();
            result
        };
        let reload = async {
            let Some(certificate) = self.tls.as_ref().map(|tls| tls.certificate().clone()) else {
                return;
            };
            let mut every = tokio::time::interval(
                self.config
                    .tls_reload_interval
                    .max(Duration::from_millis(100)),
            );
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = every.tick() => {}
                    () = stop.cancelled() => return,
                }
                match certificate.reload_if_changed() {
                    Ok(true) => {
                        tracing::info!("TLS certificate files changed: serving the new certificate")
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::error!(error = %e, "TLS certificate files changed but cannot be used; still serving the old certificate")
                    }
                }
            }
        };
        let signal = async {
            tokio::select! {
                () = shutdown => tracing::info!("shutting down"),
                () = stop.cancelled() => {}
            }
            stop.cancel();
        };
        let collecting = shared_collector.run(leadership.clone(), stop.clone().cancelled_owned());
        let leases = async {
            let mut every =
                tokio::time::interval(db::heartbeat_flush_interval(self.config.host_lease));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = every.tick() => {}
                    () = stop.cancelled() => return,
                }
                if let Err(e) = self.db.flush_heartbeats().await {
                    tracing::warn!(error = %e, "could not record host leases; trying again");
                }
            }
        };
        let metrics_serving = async {
            let Some(listener) = metrics_listener else {
                return Ok(());
            };
            let result = crate::metrics::serve(
                listener,
                metrics,
                self.db.clone(),
                stop.clone().cancelled_owned(),
            )
            .await;
            stop.cancel();
            result
        };
        let (grpc_result, blob_result, metrics_result, (), (), (), (), (), ()) = tokio::join!(
            grpc,
            blob,
            metrics_serving,
            signal,
            scheduling,
            reload,
            collecting,
            leases,
            relaying
        );
        // Reports and leases of heartbeats answered before the servers stopped.
        self.db.write_deferred_reports().await;
        if let Err(e) = self.db.flush_heartbeats().await {
            tracing::warn!(error = %e, "could not record the last host leases");
        }
        // Another replica need not wait for the lease to run out.
        if let Err(e) = leadership.resign(&self.db).await {
            tracing::warn!(error = %e, "could not give up the leader lease; it runs out by itself");
        }
        self.db.close().await;
        grpc_result?;
        blob_result.map_err(ServeError::BlobServer)?;
        metrics_result.map_err(ServeError::MetricsServer)?;
        Ok(())
    }
}

/// Raises the file-handle limit and fits both servers' connection caps
/// under it, so a connection flood runs into a cap, not into EMFILE (which
/// would stop gRPC, health included, along with the blob server).
fn connection_caps(config: &ServerConfig) -> ConnectionCaps {
    let wanted = ConnectionCaps {
        blob: config.blob_max_connections,
        grpc: config.grpc_limits.max_connections,
    };
    let nofile = match conn_limits::raise_nofile_limit() {
        Ok(nofile) => nofile,
        Err(e) => {
            // The usual default soft limit.
            tracing::warn!(error = %e, "cannot read or raise the open-file limit; assuming 1024");
            1024
        }
    };
    let caps = conn_limits::nofile_budget(nofile, wanted);
    if caps != wanted {
        tracing::warn!(
            nofile,
            blob = caps.blob,
            grpc = caps.grpc,
            "connection caps lowered to fit the open-file limit"
        );
    } else {
        tracing::debug!(
            nofile,
            blob = caps.blob,
            grpc = caps.grpc,
            "connection caps"
        );
    }
    caps
}

/// `http://ADDR` (`https://` with `tls`), with an unspecified bind address
/// (0.0.0.0, ::) replaced by loopback so the URL is usable from this machine.
pub fn local_url(addr: SocketAddr, tls: bool) -> String {
    let mut addr = addr;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{addr}")
}

/// Prepares the data directory and serves gRPC on `grpc_listener` and the
/// blob store on `blob_listener` until `shutdown` completes.
pub async fn serve(
    config: ServerConfig,
    grpc_listener: TcpListener,
    blob_listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    Coordinator::open(config)
        .await?
        .run(grpc_listener, blob_listener, shutdown)
        .await
}
