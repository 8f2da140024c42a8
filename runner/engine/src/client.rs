//! Connecting to the coordinator over gRPC (TLS for `https://`, see
//! [`crate::tls`]) with a bearer token, to one address or to several
//! replicas with failover ([`CoordinatorChannel`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use cairn_proto::auth::BearerInterceptor;
use cairn_proto::pb::checkpoint_service_client::CheckpointServiceClient;
use cairn_proto::pb::workspace_service_client::WorkspaceServiceClient;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::tls::{ClientTls, describe_chain};
use cairn_proto::tls::TlsError;

/// Largest message either side accepts (commits of big workspaces carry many blob ids).
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// The endpoint of `address`, with TLS when it is `https://`.
pub fn endpoint(address: &str, tls: &ClientTls) -> Result<Endpoint, ConnectError> {
    let endpoint = Endpoint::from_shared(address.to_owned())
        .map_err(|_| ConnectError::BadAddress(address.to_owned()))?;
    tls.configure(endpoint, address)
        .map_err(|cause| ConnectError::BadTlsSettings {
            address: address.to_owned(),
            cause,
        })
}

/// A channel that adds the bearer token to every call.
pub type AuthChannel = InterceptedService<CoordinatorChannel, BearerInterceptor>;

/// The coordinator addresses of `addresses`: one URL, or several replicas'
/// separated by commas (`http://a:7400,http://b:7400`).
pub fn split_addresses(addresses: &str) -> Result<Vec<String>, ConnectError> {
    let list: Vec<String> = addresses
        .split(',')
        .map(|a| a.trim().trim_end_matches('/').to_owned())
        .filter(|a| !a.is_empty())
        .collect();
    if list.is_empty() {
        return Err(ConnectError::BadAddress(addresses.to_owned()));
    }
    Ok(list)
}

/// Channels to one coordinator or to several replicas of one. A call goes
/// to the current replica; a call that cannot reach it (a transport error:
/// refused, reset, timed out) fails as it would with one address, and moves
/// the calls after it to the next replica. Every cairn call is safe to send
/// again, so callers retry as they do anyway.
#[derive(Clone)]
pub struct CoordinatorChannel {
    replicas: Arc<Replicas>,
}

struct Replicas {
    channels: Vec<(String, Channel)>,
    current: AtomicUsize,
}

impl std::fmt::Debug for CoordinatorChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addresses: Vec<&str> = self
            .replicas
            .channels
            .iter()
            .map(|(a, _)| a.as_str())
            .collect();
        f.debug_struct("CoordinatorChannel")
            .field("addresses", &addresses)
            .field("current", &self.current_address())
            .finish()
    }
}

impl CoordinatorChannel {
    /// Channels to every address in `addresses` (see [`split_addresses`])
    /// that connect on first use; the first is current.
    pub fn lazy(addresses: &str, tls: &ClientTls) -> Result<Self, ConnectError> {
        let channels = split_addresses(addresses)?
            .into_iter()
            .map(|address| {
                let channel = configured(&address, tls)?.connect_lazy();
                Ok((address, channel))
            })
            .collect::<Result<Vec<_>, ConnectError>>()?;
        Ok(Self::from_channels(channels, 0))
    }

    /// Connects to the first address that answers, in order, and makes it
    /// current; the others connect on first use. Fails with the last
    /// address's error when none answers.
    pub async fn connect(addresses: &str, tls: &ClientTls) -> Result<Self, ConnectError> {
        let list = split_addresses(addresses)?;
        let mut channels = Vec::with_capacity(list.len());
        let mut current = None;
        let mut last_error = None;
        for address in list {
            let endpoint = configured(&address, tls)?;
            if current.is_none() {
                match endpoint.connect().await {
                    Ok(channel) => {
                        current = Some(channels.len());
                        channels.push((address, channel));
                        continue;
                    }
                    Err(cause) => {
                        last_error = Some(ConnectError::Unreachable {
                            address: address.clone(),
                            cause,
                        });
                    }
                }
            }
            channels.push((address, endpoint.connect_lazy()));
        }
        match current {
            Some(current) => Ok(Self::from_channels(channels, current)),
            None => Err(last_error.expect("an address was tried")),
        }
    }

    fn from_channels(channels: Vec<(String, Channel)>, current: usize) -> Self {
        Self {
            replicas: Arc::new(Replicas {
                channels,
                current: AtomicUsize::new(current),
            }),
        }
    }

    /// The address calls go to now.
    pub fn current_address(&self) -> &str {
        let replicas = &self.replicas;
        &replicas.channels[replicas.current.load(Ordering::Relaxed)].0
    }
}

/// The endpoint of `address` with the settings every coordinator channel uses.
fn configured(address: &str, tls: &ClientTls) -> Result<Endpoint, ConnectError> {
    Ok(endpoint(address, tls)?
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30)))
}

impl tonic::codegen::Service<http::Request<tonic::body::Body>> for CoordinatorChannel {
    type Response = http::Response<tonic::body::Body>;
    type Error = tonic::transport::Error;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Readiness is the chosen channel's, awaited in the call: which one
        // is chosen may change until then.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let replicas = self.replicas.clone();
        let index = replicas.current.load(Ordering::Relaxed);
        let mut channel = replicas.channels[index].1.clone();
        Box::pin(async move {
            let result = async {
                futures::future::poll_fn(|cx| channel.poll_ready(cx)).await?;
                channel.call(request).await
            }
            .await;
            if let Err(e) = &result
                && replicas.channels.len() > 1
            {
                let next = (index + 1) % replicas.channels.len();
                // Only the first of several failed calls moves on.
                if replicas
                    .current
                    .compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    tracing::warn!(
                        from = %replicas.channels[index].0,
                        to = %replicas.channels[next].0,
                        error = %describe_chain(e),
                        "coordinator replica unreachable; the next calls go to another"
                    );
                }
            }
            result
        })
    }
}

/// Connection attempts [`Coordinator::connect_retrying`] makes.
const CONNECT_TRIES: u32 = 6;

/// Why the coordinator could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("coordinator address {0:?} is not a URL (expected e.g. http://127.0.0.1:7400)")]
    BadAddress(String),
    // The cause is described whole in the message (tonic's own message is
    // only "transport error"), so it is not also a `source`.
    #[error(
        "could not connect to the coordinator at {address}: {}",
        describe_chain(cause)
    )]
    Unreachable {
        address: String,
        cause: tonic::transport::Error,
    },
    #[error(
        "TLS settings for the coordinator at {address}: {}",
        describe_chain(cause)
    )]
    BadTlsSettings {
        address: String,
        cause: tonic::transport::Error,
    },
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    BadToken(#[from] cairn_proto::ValidationError),
}

/// Clients for the coordinator's services, sharing one connection.
#[derive(Clone)]
pub struct CoordinatorClient {
    pub address: String,
    pub checkpoints: CheckpointServiceClient<AuthChannel>,
    pub workspaces: WorkspaceServiceClient<AuthChannel>,
    channel: CoordinatorChannel,
    interceptor: BearerInterceptor,
}

impl std::fmt::Debug for CoordinatorClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorClient")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl CoordinatorClient {
    /// Connects to `address` (e.g. `http://127.0.0.1:7400`, or several
    /// replicas' separated by commas) with `token`, trusting the CA in
    /// `CAIRN_CA` for an `https://` address.
    pub async fn connect(address: &str, token: Option<&str>) -> Result<Self, ConnectError> {
        Self::connect_with(address, token, &ClientTls::from_env()?).await
    }

    /// Like [`Coordinator::connect`], with TLS settings of the caller's.
    pub async fn connect_with(
        address: &str,
        token: Option<&str>,
        tls: &ClientTls,
    ) -> Result<Self, ConnectError> {
        let address = split_addresses(address)?.join(",");
        let channel = CoordinatorChannel::connect(&address, tls).await?;
        let interceptor = BearerInterceptor::new(token)?;
        Ok(Self::from_channel(address, channel, interceptor))
    }

    /// Like [`Coordinator::connect`], trying again with backoff (about 6 s
    /// in all) while the coordinator refuses connections: a coordinator
    /// that is restarting is back within that. Other errors are final.
    pub async fn connect_retrying(
        address: &str,
        token: Option<&str>,
    ) -> Result<Self, ConnectError> {
        let mut backoff = Duration::from_millis(200);
        let mut tries = 1;
        loop {
            match Self::connect(address, token).await {
                Err(ConnectError::Unreachable { address, cause }) if tries < CONNECT_TRIES => {
                    tracing::info!(%address, error = %describe_chain(&cause), ?backoff, "coordinator unreachable; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    tries += 1;
                }
                other => return other,
            }
        }
    }

    fn from_channel(
        address: String,
        channel: CoordinatorChannel,
        interceptor: BearerInterceptor,
    ) -> Self {
        let intercepted = InterceptedService::new(channel.clone(), interceptor.clone());
        Self {
            address,
            checkpoints: CheckpointServiceClient::new(intercepted.clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            workspaces: WorkspaceServiceClient::new(intercepted)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            channel,
            interceptor,
        }
    }

    /// Every checkpoint of `workspace`, newest first (all pages).
    pub async fn all_checkpoints(
        &self,
        workspace: &str,
    ) -> Result<Vec<cairn_proto::pb::Checkpoint>, tonic::Status> {
        let mut client = self.checkpoints.clone();
        let mut checkpoints = Vec::new();
        let mut page_token = String::new();
        loop {
            let page = client
                .list_checkpoints(cairn_proto::pb::ListCheckpointsRequest {
                    workspace: workspace.to_owned(),
                    page_size: 500,
                    page_token: page_token.clone(),
                })
                .await?
                .into_inner();
            checkpoints.extend(page.checkpoints);
            if page.next_page_token.is_empty() || page.next_page_token == page_token {
                return Ok(checkpoints);
            }
            page_token = page.next_page_token;
        }
    }

    /// The shared channel with the token attached, for clients of other services.
    pub fn auth_channel(&self) -> AuthChannel {
        InterceptedService::new(self.channel.clone(), self.interceptor.clone())
    }
}
