//! Hearing of orders as soon as they exist: the agent keeps the
//! coordinator's `WatchOrders` stream open and heartbeats at once on each
//! notice, so an assignment or a destroy order does not wait for the next
//! heartbeat. The heartbeat stays the fallback: while the stream is down
//! (the coordinator restarts, a replica fails over, an older coordinator
//! that has no such call) orders arrive at the heartbeat interval, as they
//! always did.

use std::sync::Arc;
use std::time::Duration;

use cairn_proto::pb;
use cairn_proto::pb::host_service_client::HostServiceClient;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tonic::Code;

use cairn_engine::client::AuthChannel;

/// First wait before the stream is opened again after it failed.
const REOPEN_START: Duration = Duration::from_millis(200);
/// Longest wait between two tries.
const REOPEN_MAX: Duration = Duration::from_secs(5);

/// The stream of one registration (host id and client), while it runs.
#[derive(Debug)]
pub(crate) struct OrderWatch {
    host_id: String,
    /// Which client it speaks with: a new one (the bound token) opens a new stream.
    client_generation: u64,
    task: JoinHandle<()>,
}

impl OrderWatch {
    /// Opens `host_id`'s stream through `client` and keeps it open, again
    /// after failures, notifying `rung` on each notice.
    pub(crate) fn start(
        client: HostServiceClient<AuthChannel>,
        host_id: String,
        client_generation: u64,
        rung: Arc<Notify>,
    ) -> Self {
        let task = tokio::spawn(watch(client, host_id.clone(), rung));
        Self {
            host_id,
            client_generation,
            task,
        }
    }

    /// Whether this is the stream of `host_id` through client `generation`
    /// (one that gave up stays given up for them).
    pub(crate) fn is_for(&self, host_id: &str, client_generation: u64) -> bool {
        self.host_id == host_id && self.client_generation == client_generation
    }
}

impl Drop for OrderWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Why a stream ended.
enum Ended {
    /// Open it again after a pause.
    Retry(tonic::Status),
    /// Opening it again would not help (no such call, not this host's).
    GiveUp(tonic::Status),
}

async fn watch(mut client: HostServiceClient<AuthChannel>, host_id: String, rung: Arc<Notify>) {
    let mut pause = REOPEN_START;
    loop {
        match listen(&mut client, &host_id, &rung, &mut pause).await {
            Ended::GiveUp(status) => {
                tracing::info!(%status, "the coordinator does not tell this host of orders as they come; they arrive with heartbeats");
                return;
            }
            Ended::Retry(status) => {
                tracing::debug!(%status, ?pause, "the orders stream ended; opening it again");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(REOPEN_MAX);
    }
}

/// Opens the stream and passes its notices on until it ends; a stream that
/// delivered a notice sets `pause` back to its start.
async fn listen(
    client: &mut HostServiceClient<AuthChannel>,
    host_id: &str,
    rung: &Notify,
    pause: &mut Duration,
) -> Ended {
    let request = pb::WatchOrdersRequest {
        host_id: host_id.to_owned(),
    };
    let mut notices = match client.watch_orders(request).await {
        Ok(response) => response.into_inner(),
        Err(status) => return ended(status),
    };
    loop {
        match notices.message().await {
            Ok(Some(_notice)) => {
                *pause = REOPEN_START;
                rung.notify_one();
            }
            Ok(None) => return Ended::Retry(tonic::Status::unavailable("the stream ended")),
            Err(status) => return ended(status),
        }
    }
}

fn ended(status: tonic::Status) -> Ended {
    match status.code() {
        // An older coordinator; or a token or host the coordinator refuses,
        // which the heartbeat reports (and acts on) itself.
        Code::Unimplemented | Code::PermissionDenied | Code::Unauthenticated => {
            Ended::GiveUp(status)
        }
        _ => Ended::Retry(status),
    }
}
