//! Connecting to the coordinator over gRPC with a bearer token.

use std::time::Duration;

use cairn_proto::auth::BearerInterceptor;
use cairn_proto::pb::checkpoint_service_client::CheckpointServiceClient;
use cairn_proto::pb::workspace_service_client::WorkspaceServiceClient;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// Largest message either side accepts (commits of big workspaces carry many blob ids).
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// A channel that adds the bearer token to every call.
pub type AuthChannel = InterceptedService<Channel, BearerInterceptor>;

/// Connection attempts [`Coordinator::connect_retrying`] makes.
const CONNECT_TRIES: u32 = 6;

/// Why the coordinator could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("coordinator address {0:?} is not a URL (expected e.g. http://127.0.0.1:7400)")]
    BadAddress(String),
    #[error("could not connect to the coordinator at {address}: {source}")]
    Unreachable {
        address: String,
        source: tonic::transport::Error,
    },
    #[error(transparent)]
    BadToken(#[from] cairn_proto::ValidationError),
}

/// Clients for the coordinator's services, sharing one connection.
#[derive(Clone)]
pub struct Coordinator {
    pub address: String,
    pub checkpoints: CheckpointServiceClient<AuthChannel>,
    pub workspaces: WorkspaceServiceClient<AuthChannel>,
    channel: Channel,
    interceptor: BearerInterceptor,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl Coordinator {
    /// Connects to `address` (e.g. `http://127.0.0.1:7400`) with `token`.
    pub async fn connect(address: &str, token: Option<&str>) -> Result<Self, ConnectError> {
        let address = address.trim().trim_end_matches('/').to_owned();
        let endpoint = Endpoint::from_shared(address.clone())
            .map_err(|_| ConnectError::BadAddress(address.clone()))?
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30));
        let channel = endpoint
            .connect()
            .await
            .map_err(|source| ConnectError::Unreachable {
                address: address.clone(),
                source,
            })?;
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
                Err(ConnectError::Unreachable { address, source }) if tries < CONNECT_TRIES => {
                    tracing::info!(%address, error = %source, ?backoff, "coordinator unreachable; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    tries += 1;
                }
                other => return other,
            }
        }
    }

    fn from_channel(address: String, channel: Channel, interceptor: BearerInterceptor) -> Self {
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

    /// The shared channel with the token attached, for clients of other services.
    pub fn auth_channel(&self) -> AuthChannel {
        InterceptedService::new(self.channel.clone(), self.interceptor.clone())
    }
}
