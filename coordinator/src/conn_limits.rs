//! Limits on the coordinator's network connections: how many may be open,
//! how long a peer may take to send a request, sit idle, or trickle bytes.
//!
//! ```text
//! accept ── a permit first (past the cap, connections wait in the kernel's
//!           backlog and hold no file handle) ── Metered stream
//!   Head   (accepted, or the first byte of the next request): headers within
//!          header_timeout
//!   Idle   (between requests): the next request starts within idle_timeout
//!   Active (a request is served, until its response body is handed over):
//!          at least min_rate bytes/s moved either way, after a grace period
//! ```
//!
//! Every deadline is checked where the connection waits on its peer (a read
//! or write that would block), so a connection stalled by the server's own
//! work is never cut for it. [`nofile_budget`] sizes the caps below the
//! process's file-handle limit, which [`raise_nofile_limit`] raises first.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, HttpBody as _};
use axum::extract::{ConnectInfo, Request};
use axum::middleware::Next;
use axum::response::Response;
use axum::serve::{IncomingStream, Listener};
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::either::Either;

/// How long a peer may take, and how slowly it may move bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// From accept (or the first byte of a later request) to complete headers.
    pub header_timeout: Duration,
    /// Between requests on a kept-alive connection.
    pub idle_timeout: Duration,
    /// Bytes per second a request must move (both ways together) once
    /// `rate_grace` has passed; 0 turns the check off.
    pub min_rate: u64,
    /// How long a request may move less than `min_rate` at its start
    /// (connection ramp-up, the server opening files).
    pub rate_grace: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            min_rate: 16 << 10,
            rate_grace: Duration::from_secs(10),
        }
    }
}

/// What a connection is doing, for its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for a request's headers since `since`.
    Head { since: Instant },
    /// Between requests since `since`.
    Idle { since: Instant },
    /// Serving `requests` requests, the first since `since`, when the
    /// connection had moved `moved_before` bytes.
    Active {
        since: Instant,
        moved_before: u64,
        requests: usize,
    },
}

/// Why a connection was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    HeaderTimeout,
    IdleTimeout,
    TooSlow,
}

impl Expiry {
    fn describe(self, timeouts: &Timeouts) -> String {
        match self {
            Self::HeaderTimeout => format!(
                "no complete request headers within {}",
                humantime::format_duration(timeouts.header_timeout)
            ),
            Self::IdleTimeout => format!(
                "idle for {}",
                humantime::format_duration(timeouts.idle_timeout)
            ),
            Self::TooSlow => format!(
                "moved fewer than {} bytes/s after {}",
                timeouts.min_rate,
                humantime::format_duration(timeouts.rate_grace)
            ),
        }
    }
}

/// One connection's progress: the pure part of the limits.
#[derive(Debug, Clone)]
struct ConnState {
    phase: Phase,
    /// Bytes read and written so far.
    moved: u64,
}

impl ConnState {
    fn new(now: Instant) -> Self {
        Self {
            phase: Phase::Head { since: now },
            moved: 0,
        }
    }

    fn read(&mut self, bytes: usize, now: Instant) {
        self.moved = self.moved.saturating_add(bytes as u64);
        // The first byte of the next request starts its header clock.
        if bytes > 0
            && let Phase::Idle { .. } = self.phase
        {
            self.phase = Phase::Head { since: now };
        }
    }

    fn wrote(&mut self, bytes: usize) {
        self.moved = self.moved.saturating_add(bytes as u64);
    }

    /// The headers of a request are in: it is served from now.
    fn begin(&mut self, now: Instant) {
        self.phase = match self.phase {
            Phase::Active {
                since,
                moved_before,
                requests,
            } => Phase::Active {
                since,
                moved_before,
                requests: requests + 1,
            },
            _ => Phase::Active {
                since: now,
                moved_before: self.moved,
                requests: 1,
            },
        };
    }

    /// A request's response body was handed over (or dropped).
    fn end(&mut self, now: Instant) {
        if let Phase::Active {
            since,
            moved_before,
            requests,
        } = self.phase
        {
            self.phase = if requests > 1 {
                Phase::Active {
                    since,
                    moved_before,
                    requests: requests - 1,
                }
            } else {
                Phase::Idle { since: now }
            };
        }
    }

    /// When the connection is cut if its peer moves nothing more, and why.
    fn deadline(&self, t: &Timeouts) -> Option<(Instant, Expiry)> {
        match self.phase {
            Phase::Head { since } => Some((since + t.header_timeout, Expiry::HeaderTimeout)),
            Phase::Idle { since } => Some((since + t.idle_timeout, Expiry::IdleTimeout)),
            Phase::Active {
                since,
                moved_before,
                ..
            } => {
                if t.min_rate == 0 {
                    return None;
                }
                // Every min_rate bytes moved buy another second.
                let moved = self.moved - moved_before;
                let earned = Duration::from_secs(moved / t.min_rate)
                    + Duration::from_nanos((moved % t.min_rate) * 1_000_000_000 / t.min_rate);
                let deadline = since
                    .checked_add(t.rate_grace)
                    .and_then(|d| d.checked_add(earned))?;
                Some((deadline, Expiry::TooSlow))
            }
        }
    }
}

/// A connection's state, shared by its stream and its requests.
#[derive(Debug)]
pub struct Meter {
    state: Mutex<ConnState>,
    timeouts: Timeouts,
}

impl Meter {
    fn new(timeouts: Timeouts) -> Self {
        Self {
            state: Mutex::new(ConnState::new(Instant::now())),
            timeouts,
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut ConnState) -> T) -> T {
        // A panic elsewhere cannot leave the counters half-updated.
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut state)
    }

    /// Marks a request as served until the returned guard drops.
    pub fn begin(self: &Arc<Self>) -> ActiveRequest {
        self.with(|s| s.begin(Instant::now()));
        ActiveRequest {
            meter: Some(self.clone()),
        }
    }
}

/// A request being served; dropping it ends it.
#[derive(Debug)]
pub struct ActiveRequest {
    meter: Option<Arc<Meter>>,
}

impl ActiveRequest {
    fn end(&mut self) {
        if let Some(meter) = self.meter.take() {
            meter.with(|s| s.end(Instant::now()));
        }
    }
}

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        self.end();
    }
}

/// A TCP connection under [`Timeouts`], holding its slot under the cap.
#[derive(Debug)]
pub struct Metered {
    stream: TcpStream,
    meter: Arc<Meter>,
    timer: Pin<Box<Sleep>>,
    _permit: OwnedSemaphorePermit,
}

impl Metered {
    fn new(stream: TcpStream, permit: OwnedSemaphorePermit, timeouts: Timeouts) -> Self {
        Self {
            stream,
            meter: Arc::new(Meter::new(timeouts)),
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            _permit: permit,
        }
    }

    pub fn meter(&self) -> &Arc<Meter> {
        &self.meter
    }

    /// Called when the peer holds the connection up: is it past its deadline?
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let timeouts = self.meter.timeouts;
        let Some((deadline, expiry)) = self.meter.with(|s| s.deadline(&timeouts)) else {
            return Ok(());
        };
        if self.timer.deadline() != deadline {
            self.timer.as_mut().reset(deadline);
        }
        match self.timer.as_mut().poll(cx) {
            Poll::Pending => Ok(()),
            Poll::Ready(()) => {
                let reason = expiry.describe(&timeouts);
                tracing::debug!(peer = ?self.stream.peer_addr().ok(), %reason, "connection cut");
                Err(io::Error::new(io::ErrorKind::TimedOut, reason))
            }
        }
    }
}

impl AsyncRead for Metered {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let read = buf.filled().len() - before;
                this.meter.with(|s| s.read(read, Instant::now()));
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.check(cx) {
                Ok(()) => Poll::Pending,
                Err(e) => Poll::Ready(Err(e)),
            },
        }
    }
}

impl AsyncWrite for Metered {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.stream).poll_write(cx, buf) {
            Poll::Ready(Ok(written)) => {
                this.meter.with(|s| s.wrote(written));
                Poll::Ready(Ok(written))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.check(cx) {
                Ok(()) => Poll::Pending,
                Err(e) => Poll::Ready(Err(e)),
            },
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.stream).poll_write_vectored(cx, bufs) {
            Poll::Ready(Ok(written)) => {
                this.meter.with(|s| s.wrote(written));
                Poll::Ready(Ok(written))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.check(cx) {
                Ok(()) => Poll::Pending,
                Err(e) => Poll::Ready(Err(e)),
            },
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// A blob connection: metered TCP, or TLS over metered TCP (so the
/// handshake is held to the header deadline like a request's headers).
pub type BlobIo = Either<Metered, TlsStream<Metered>>;

/// A TLS handshake in progress on an accepted connection.
type Handshake = Pin<Box<dyn Future<Output = Option<(BlobIo, SocketAddr)>> + Send>>;

/// A TCP listener that holds at most `max_connections` open and meters
/// each; with TLS, it hands a connection over once its handshake is done.
pub struct CappedListener {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    timeouts: Timeouts,
    tls: Option<TlsAcceptor>,
    /// Handshakes run here, side by side, while the next connection is
    /// accepted: one peer stalling its handshake delays no other.
    handshakes: FuturesUnordered<Handshake>,
}

impl std::fmt::Debug for CappedListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CappedListener")
            .field("inner", &self.inner)
            .field("timeouts", &self.timeouts)
            .field("tls", &self.tls.is_some())
            .field("handshakes", &self.handshakes.len())
            .finish_non_exhaustive()
    }
}

impl CappedListener {
    pub fn new(
        inner: TcpListener,
        max_connections: usize,
        timeouts: Timeouts,
        tls: Option<TlsAcceptor>,
    ) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max_connections.max(1))),
            timeouts,
            tls,
            handshakes: FuturesUnordered::new(),
        }
    }
}

/// The next TCP connection, once a slot under the cap is free.
async fn accept_capped(
    listener: &TcpListener,
    permits: &Arc<Semaphore>,
    timeouts: Timeouts,
) -> (Metered, SocketAddr) {
    // The permit comes before accept: past the cap a connection waits in
    // the kernel's backlog, holding no file handle of this process.
    let permit = permits
        .clone()
        .acquire_owned()
        .await
        .expect("the semaphore is never closed");
    loop {
        match listener.accept().await {
            Ok((stream, addr)) => {
                // Responses are written in pieces (head, then body); with
                // Nagle's algorithm the second waits for the client's
                // delayed ACK (40 ms).
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(error = %e, "cannot set TCP_NODELAY on a connection");
                }
                return (Metered::new(stream, permit, timeouts), addr);
            }
            Err(e) => {
                // Out of file handles (or a connection reset before
                // accept): wait a moment instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

impl Listener for CappedListener {
    type Io = BlobIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // Both branches are cancel-safe: a permit or a connection not
            // taken now is taken on the next call.
            tokio::select! {
                Some(done) = self.handshakes.next(), if !self.handshakes.is_empty() => {
                    if let Some(connection) = done {
                        return connection;
                    }
                }
                (stream, addr) = accept_capped(&self.inner, &self.permits, self.timeouts) => {
                    let Some(acceptor) = self.tls.clone() else {
                        return (Either::Left(stream), addr);
                    };
                    self.handshakes.push(Box::pin(async move {
                        match acceptor.accept(stream).await {
                            Ok(stream) => Some((Either::Right(stream), addr)),
                            Err(e) => {
                                tracing::debug!(peer = %addr, error = %e, "blob connection's TLS handshake failed");
                                None
                            }
                        }
                    }));
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// The connection's [`Meter`], as connect info for the request middleware.
#[derive(Debug, Clone)]
pub struct ConnMeter(pub Arc<Meter>);

impl axum::extract::connect_info::Connected<IncomingStream<'_, CappedListener>> for ConnMeter {
    fn connect_info(stream: IncomingStream<'_, CappedListener>) -> Self {
        let metered = match stream.io() {
            Either::Left(plain) => plain,
            Either::Right(tls) => tls.get_ref().0,
        };
        Self(metered.meter().clone())
    }
}

/// Middleware: a request is active from its headers until its response body
/// was handed over, and held to the minimum rate meanwhile.
pub async fn track_requests(
    ConnectInfo(meter): ConnectInfo<ConnMeter>,
    request: Request,
    next: Next,
) -> Response {
    let active = meter.0.begin();
    let response = next.run(request).await;
    let (mut parts, body) = response.into_parts();
    // The stream below has no exact size of its own: the length goes into
    // the head, so the response is not sent chunked.
    if let Some(len) = body.size_hint().exact()
        && !parts.headers.contains_key(http::header::CONTENT_LENGTH)
    {
        parts
            .headers
            .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(len));
    }
    // The guard lives in the stream: dropped when hyper is done with the
    // body (all of it handed over, or the connection gone).
    let stream = body.into_data_stream().map(move |frame| {
        let _active = &active;
        frame
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// File handles kept for everything but connections: the database, the
/// store's files, logs.
pub const RESERVED_FILES: u64 = 256;

/// How many connections each server holds open at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionCaps {
    pub blob: usize,
    pub grpc: usize,
}

/// The caps that fit under `nofile` file handles: `wanted` when it fits,
/// otherwise both scaled down alike. A blob connection may hold two handles
/// (its socket and the object it streams), a gRPC connection one.
pub fn nofile_budget(nofile: u64, wanted: ConnectionCaps) -> ConnectionCaps {
    let budget = nofile.saturating_sub(RESERVED_FILES).max(2);
    let need = 2 * wanted.blob as u64 + wanted.grpc as u64;
    if need <= budget {
        return wanted;
    }
    let scale = |cap: usize| ((cap as u64 * budget / need) as usize).max(1);
    ConnectionCaps {
        blob: scale(wanted.blob),
        grpc: scale(wanted.grpc),
    }
}

/// Raises this process's soft limit on open files to its hard limit (the
/// default soft limit, often 1024, is what a connection flood exhausts
/// first) and returns the soft limit in force afterwards.
pub fn raise_nofile_limit() -> io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit that lowers no hard limit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(io::Error::last_os_error());
        }
        limit = raised;
    }
    // The field is 32 bits wide on some targets.
    #[allow(clippy::unnecessary_cast)]
    Ok(limit.rlim_cur as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Timeouts = Timeouts {
        header_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(60),
        min_rate: 1000,
        rate_grace: Duration::from_secs(5),
    };

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_new_connection_has_the_header_timeout() {
        let now = Instant::now();
        let state = ConnState::new(now);
        assert_eq!(
            state.deadline(&T),
            Some((now + secs(10), Expiry::HeaderTimeout))
        );
    }

    #[test]
    fn trickled_headers_do_not_move_the_header_deadline() {
        let now = Instant::now();
        let mut state = ConnState::new(now);
        state.read(1, now + secs(3));
        state.read(1, now + secs(6));
        assert_eq!(
            state.deadline(&T),
            Some((now + secs(10), Expiry::HeaderTimeout))
        );
    }

    #[test]
    fn between_requests_the_idle_timeout_holds_until_the_next_byte() {
        let now = Instant::now();
        let mut state = ConnState::new(now);
        state.read(200, now);
        state.begin(now);
        state.wrote(100);
        state.end(now + secs(1));
        assert_eq!(
            state.deadline(&T),
            Some((now + secs(61), Expiry::IdleTimeout))
        );
        state.read(1, now + secs(30));
        assert_eq!(
            state.deadline(&T),
            Some((now + secs(40), Expiry::HeaderTimeout))
        );
    }

    #[test]
    fn a_request_earns_time_by_the_bytes_it_moves() {
        let now = Instant::now();
        let mut state = ConnState::new(now);
        state.read(500, now);
        state.begin(now);
        // Only the grace period before any byte of the request.
        assert_eq!(state.deadline(&T), Some((now + secs(5), Expiry::TooSlow)));
        state.read(3000, now + secs(2));
        state.wrote(1500);
        assert_eq!(
            state.deadline(&T),
            Some((now + Duration::from_millis(9500), Expiry::TooSlow))
        );
    }

    #[test]
    fn overlapping_requests_stay_active_until_the_last_ends() {
        let now = Instant::now();
        let mut state = ConnState::new(now);
        state.begin(now);
        state.begin(now + secs(1));
        state.end(now + secs(2));
        assert!(matches!(state.phase, Phase::Active { requests: 1, .. }));
        state.end(now + secs(3));
        assert_eq!(
            state.phase,
            Phase::Idle {
                since: now + secs(3)
            }
        );
    }

    #[test]
    fn no_minimum_rate_means_no_request_deadline() {
        let now = Instant::now();
        let mut state = ConnState::new(now);
        state.begin(now);
        let t = Timeouts { min_rate: 0, ..T };
        assert_eq!(state.deadline(&t), None);
    }

    #[test]
    fn caps_that_fit_are_kept_and_others_scaled_below_the_limit() {
        let wanted = ConnectionCaps {
            blob: 4096,
            grpc: 1024,
        };
        assert_eq!(nofile_budget(1 << 20, wanted), wanted);
        let fitted = nofile_budget(1024, wanted);
        assert!(2 * fitted.blob as u64 + fitted.grpc as u64 + RESERVED_FILES <= 1024);
        assert!(fitted.blob.abs_diff(4 * fitted.grpc) <= 4, "{fitted:?}");
        let tiny = nofile_budget(10, wanted);
        assert!(tiny.blob >= 1 && tiny.grpc >= 1);
    }
}
