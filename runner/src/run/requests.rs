//! Checkpoints the agent asks for: `cairn-runner run` serves the control
//! socket ([`crate::socket`]) while its harness works, so an agent that runs
//! `cairn-runner checkpoint` in the sandbox gets a checkpoint cut by this
//! runner — with its change tracker and in-memory fingerprint cache, the
//! attempt's generation and the conversation's session — rather than a
//! walk of its own (it holds no token anyway: the run token is hidden from
//! the harness).
//!
//! The socket's connections only carry requests; the attempt answers them
//! between its own steps (its checkpoints never overlap), so a request
//! that arrives while the harness is not running waits for the next turn,
//! and one still waiting when the attempt ends is answered with an error.

use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};

use crate::socket::{self, Request, Response};

/// A request and where its answer goes.
pub type Asked = (Request, oneshot::Sender<Response>);

/// Requests waiting at most; a further one waits in its connection.
const QUEUED: usize = 8;

/// The listening control socket of an attempt; dropping it stops
/// listening and removes the socket file.
#[derive(Debug)]
pub struct Listening {
    path: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Listening {
    /// Listens at `path`; the requests arrive on the receiver.
    pub fn start(path: &Path) -> anyhow::Result<(Self, mpsc::Receiver<Asked>)> {
        let listener = socket::bind(path)?;
        let (sender, receiver) = mpsc::channel(QUEUED);
        let task = tokio::spawn(accept(listener, sender));
        let listening = Self {
            path: path.to_path_buf(),
            task,
        };
        Ok((listening, receiver))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.task.abort();
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(error = %e, socket = %self.path.display(), "cannot remove the control socket");
        }
    }
}

async fn accept(listener: UnixListener, sender: mpsc::Sender<Asked>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors, say: give the attempt time to free some.
                tracing::warn!(error = %e, "cannot accept a control connection");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let sender = sender.clone();
        tokio::spawn(async move {
            let answered = socket::serve_connection(stream, |request| async move {
                let request = match request {
                    Ok(request) => request,
                    Err(e) => return Response::failed(e),
                };
                let (reply, answer) = oneshot::channel();
                if sender.send((request, reply)).await.is_err() {
                    return Response::failed("the run is ending; it cuts no more checkpoints");
                }
                answer.await.unwrap_or_else(|_| {
                    Response::failed("the run ended before it could cut the checkpoint")
                })
            });
            if let Err(e) = answered.await {
                tracing::debug!(error = %e, "a control connection ended early");
            }
        });
    }
}
