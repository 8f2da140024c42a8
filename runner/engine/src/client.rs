//! Connecting to the coordinator over gRPC (TLS for `https://`, see
//! [`crate::tls`]) with a bearer token.

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
pub type AuthChannel = InterceptedService<Channel, BearerInterceptor>;

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
    channel: Channel,
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
    /// Connects to `address` (e.g. `http://127.0.0.1:7400`) with `token`,
    /// trusting the CA in `CAIRN_CA` for an `https://` address.
    pub async fn connect(address: &str, token: Option<&str>) -> Result<Self, ConnectError> {
        Self::connect_with(address, token, &ClientTls::from_env()?).await
    }

    /// Like [`Coordinator::connect`], with TLS settings of the caller's.
    pub async fn connect_with(
        address: &str,
        token: Option<&str>,
        tls: &ClientTls,
    ) -> Result<Self, ConnectError> {
        let address = address.trim().trim_end_matches('/').to_owned();
        let endpoint = endpoint(&address, tls)?
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30));
        let channel = endpoint
            .connect()
            .await
            .map_err(|cause| ConnectError::Unreachable {
                address: address.clone(),
                cause,
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
