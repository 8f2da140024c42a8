//! The host agent against a coordinator double: an in-test HostService that
//! honours the proto's contract (level-triggered assignments, destroy
//! orders and forget, LOST), with real sandboxes (the local driver and a
//! stand-in runner) and the real `cairn-host` binary.

mod host_support;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cairn_host::{self as host, DriverConfig, HostConfig};
use cairn_proto::pb;
use cairn_proto::pb::host_service_server::{HostService, HostServiceServer};
use cairn_proto::runs::{SandboxState, to_proto_duration};
use host_support::*;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

const HOST_TOKEN: &str = "cairn_host_test-token";

#[derive(Default)]
struct FakeState {
    registrations: Vec<pb::RegisterHostRequest>,
    heartbeats: Vec<pb::HeartbeatRequest>,
    assignments: Vec<pb::Assignment>,
    destroy: Vec<pb::DestroyOrder>,
    forget: Vec<String>,
    /// Sandboxes some heartbeat reported (their assignment is then recorded as taken).
    seen: HashSet<String>,
    /// Sandboxes some heartbeat reported gone (their destroy orders are then carried out).
    ended: HashSet<String>,
    /// Answer the next heartbeat with LOST.
    lost_next: bool,
    /// The heartbeat interval registrations are given (None: 100 ms).
    interval: Option<Duration>,
    /// Serve WatchOrders (else it is refused as unimplemented, as by a
    /// coordinator that predates it).
    pushes_orders: bool,
    /// WatchOrders streams opened.
    order_watches: usize,
}

/// A coordinator's HostService, scripted by the test.
#[derive(Clone, Default)]
struct Fake {
    state: Arc<Mutex<FakeState>>,
    /// Rung when the test gives the host orders (WatchOrders sends a notice).
    bell: Arc<tokio::sync::Notify>,
    /// Ends every WatchOrders stream, as a coordinator that shuts down does.
    hung_up: tokio_util::sync::CancellationToken,
}

fn gone(report: &pb::SandboxReport) -> bool {
    SandboxState::try_from(report.state).is_ok_and(SandboxState::is_gone)
}

#[tonic::async_trait]
impl HostService for Fake {
    async fn register_host(
        &self,
        request: Request<pb::RegisterHostRequest>,
    ) -> Result<Response<pb::RegisterHostResponse>, Status> {
        check_token(&request)?;
        let request = request.into_inner();
        let host_id = if request.host_id.is_empty() {
            "host-1".to_owned()
        } else {
            request.host_id.clone()
        };
        let mut st = self.state.lock().unwrap();
        st.registrations.push(request);
        let interval = st.interval.unwrap_or(Duration::from_millis(100));
        Ok(Response::new(pb::RegisterHostResponse {
            host_id,
            heartbeat_interval: Some(to_proto_duration(interval)),
            lease: Some(to_proto_duration(Duration::from_secs(3))),
            // This double binds no token: the agent keeps the one it has.
            host_token: String::new(),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        check_token(&request)?;
        let request = request.into_inner();
        let mut st = self.state.lock().unwrap();
        st.heartbeats.push(request.clone());
        if std::mem::take(&mut st.lost_next) {
            let destroy = request
                .sandboxes
                .iter()
                .filter(|s| !gone(s))
                .map(|s| pb::DestroyOrder {
                    sandbox_id: s.sandbox_id.clone(),
                    reason: "superseded".into(),
                })
                .collect();
            return Ok(Response::new(pb::HeartbeatResponse {
                state: pb::HostState::Lost as i32,
                destroy,
                ..Default::default()
            }));
        }
        let reported: HashSet<&str> = request
            .sandboxes
            .iter()
            .map(|s| s.sandbox_id.as_str())
            .collect();
        st.seen.extend(reported.iter().map(|id| id.to_string()));
        let ended: Vec<String> = request
            .sandboxes
            .iter()
            .filter(|s| gone(s))
            .map(|s| s.sandbox_id.clone())
            .collect();
        st.ended.extend(ended);
        let assignments = st
            .assignments
            .iter()
            .filter(|a| !st.seen.contains(&a.sandbox_id))
            .cloned()
            .collect();
        let destroy = st
            .destroy
            .iter()
            .filter(|o| !st.ended.contains(&o.sandbox_id))
            .cloned()
            .collect();
        let forget = st
            .forget
            .iter()
            .filter(|id| reported.contains(id.as_str()))
            .cloned()
            .collect();
        Ok(Response::new(pb::HeartbeatResponse {
            lease_expires_at: None,
            state: pb::HostState::Ready as i32,
            assignments,
            destroy,
            forget,
        }))
    }

    type WatchOrdersStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::OrdersNotice, Status>>;

    async fn watch_orders(
        &self,
        request: Request<pb::WatchOrdersRequest>,
    ) -> Result<Response<Self::WatchOrdersStream>, Status> {
        check_token(&request)?;
        {
            let mut st = self.state.lock().unwrap();
            if !st.pushes_orders {
                return Err(Status::unimplemented("WatchOrders"));
            }
            st.order_watches += 1;
        }
        let (sink, notices) = tokio::sync::mpsc::channel(1);
        let (bell, hung_up) = (self.bell.clone(), self.hung_up.clone());
        tokio::spawn(async move {
            for sequence in 1.. {
                if sink.send(Ok(pb::OrdersNotice { sequence })).await.is_err() {
                    return;
                }
                tokio::select! {
                    () = bell.notified() => {}
                    () = sink.closed() => return,
                    () = hung_up.cancelled() => {
                        let _ = sink.send(Err(Status::unavailable("shutting down"))).await;
                        return;
                    }
                }
            }
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            notices,
        )))
    }
}

fn check_token<T>(request: &Request<T>) -> Result<(), Status> {
    match request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
    {
        Some(value) if value == format!("Bearer {HOST_TOKEN}") => Ok(()),
        Some(_) => Err(Status::permission_denied("unknown token")),
        None => Err(Status::unauthenticated("no token")),
    }
}

impl Fake {
    /// A coordinator that tells the host of orders as they come (the
    /// WatchOrders stream) and gives it a heartbeat interval of an hour, so
    /// that only the stream can bring them in time.
    fn pushing_orders() -> Self {
        let fake = Self::default();
        {
            let mut st = fake.state.lock().unwrap();
            st.pushes_orders = true;
            st.interval = Some(Duration::from_secs(3600));
        }
        fake
    }

    /// Tells a watching host that it has new orders.
    fn ring(&self) {
        self.bell.notify_one();
    }

    fn order_watches(&self) -> usize {
        self.state.lock().unwrap().order_watches
    }

    fn assign(&self, sandbox_id: &str) {
        self.state.lock().unwrap().assignments.push(pb::Assignment {
            sandbox_id: sandbox_id.into(),
            run_id: format!("run-of-{sandbox_id}"),
            attempt: 1,
            generation: 5,
            workspace_id: "ws-1".into(),
            run_token: format!("run-token-of-{sandbox_id}"),
            image: String::new(),
        });
    }

    fn destroy(&self, sandbox_id: &str, reason: &str) {
        self.state.lock().unwrap().destroy.push(pb::DestroyOrder {
            sandbox_id: sandbox_id.into(),
            reason: reason.into(),
        });
    }

    fn forget(&self, sandbox_id: &str) {
        self.state.lock().unwrap().forget.push(sandbox_id.into());
    }

    /// The sandbox as the latest heartbeat reported it.
    fn reported(&self, sandbox_id: &str) -> Option<pb::SandboxReport> {
        let st = self.state.lock().unwrap();
        st.heartbeats
            .last()?
            .sandboxes
            .iter()
            .find(|s| s.sandbox_id == sandbox_id)
            .cloned()
    }

    fn heartbeat_count(&self) -> usize {
        self.state.lock().unwrap().heartbeats.len()
    }

    fn registrations(&self) -> Vec<pb::RegisterHostRequest> {
        self.state.lock().unwrap().registrations.clone()
    }

    /// Waits until the latest heartbeat reports `sandbox_id` in `state`.
    async fn wait_reported(&self, sandbox_id: &str, state: SandboxState) -> pb::SandboxReport {
        let wanted = pb::SandboxState::from(state) as i32;
        wait_until(&format!("{sandbox_id} reported {state}"), || {
            self.reported(sandbox_id).is_some_and(|r| r.state == wanted)
        })
        .await;
        self.reported(sandbox_id).unwrap()
    }

    /// Waits until `n` more heartbeats than now arrived.
    async fn wait_heartbeats(&self, n: usize) {
        let target = self.heartbeat_count() + n;
        wait_until("more heartbeats", || self.heartbeat_count() >= target).await;
    }
}

/// The fake coordinator serving on a port.
struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start(fake: Fake, addr: Option<SocketAddr>) -> Self {
        let listener = TcpListener::bind(addr.unwrap_or_else(|| "127.0.0.1:0".parse().unwrap()))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(HostServiceServer::new(fake))
                .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Self {
            addr,
            stop: Some(stop),
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        if tokio::time::timeout(Duration::from_secs(10), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

fn config(scratch: &Scratch, coordinator: &str, slots: u32) -> HostConfig {
    HostConfig {
        coordinator: coordinator.into(),
        token: HOST_TOKEN.into(),
        data_dir: scratch.layout.root().to_owned(),
        name: "test-host".into(),
        labels: "zone=test,gpu=none".parse().unwrap(),
        slots,
        driver: DriverConfig::Local,
        runner_bin: scratch.standin.clone(),
        grace: Duration::from_secs(30),
        env: vec![(
            "STANDIN_REPORT".into(),
            scratch.report.display().to_string(),
        )],
        sandbox_coordinator: Some("http://coordinator-as-sandboxes-see-it:7400".into()),
        default_image: None,
        pack_cache: None,
        kept: None,
        tls: cairn_engine::tls::ClientTls::default(),
    }
}

/// Runs the agent in a task; the sender stops it.
fn spawn_agent(
    config: HostConfig,
    driver: host::LocalDriver,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), host::HostError>>,
) {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(host::run_with_driver(config, driver, async {
        let _ = stopped.await;
    }));
    (stop, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_come_on_the_stream_without_waiting_for_a_heartbeat() {
    let scratch = Scratch::new();
    let driver = local_driver(&scratch);
    // Heartbeats an hour apart: only the WatchOrders stream brings orders
    // within the test's patience.
    let fake = Fake::pushing_orders();
    let server = Server::start(fake.clone(), None).await;
    let addr = server.addr;
    let (stop, agent) = spawn_agent(config(&scratch, &server.url(), 2), driver);
    wait_until("the orders stream", || fake.order_watches() == 1).await;

    fake.assign("sbx-push-a1");
    fake.ring();
    fake.wait_reported("sbx-push-a1", SandboxState::Running)
        .await;
    wait_for_file(&scratch.report_file("sbx-push-a1", "ready")).await;
    fake.destroy("sbx-push-a1", "cancelled");
    fake.ring();
    fake.wait_reported("sbx-push-a1", SandboxState::Destroyed)
        .await;

    // The coordinator restarts: the agent opens the stream again, and
    // orders keep coming on it.
    fake.hung_up.cancel();
    server.stop().await;
    let restarted = Fake::pushing_orders();
    let server = Server::start(restarted.clone(), Some(addr)).await;
    wait_until("the orders stream on the restarted coordinator", || {
        restarted.order_watches() >= 1
    })
    .await;
    restarted.assign("sbx-push-a2");
    restarted.ring();
    restarted
        .wait_reported("sbx-push-a2", SandboxState::Running)
        .await;

    stop.send(()).unwrap();
    agent.await.unwrap().unwrap();
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_registers_starts_destroys_forgets_and_stops() {
    let scratch = Scratch::new();
    let driver = local_driver(&scratch);
    let fake = Fake::default();
    let server = Server::start(fake.clone(), None).await;
    let (stop, agent) = spawn_agent(config(&scratch, &server.url(), 2), driver);

    wait_until("registration", || !fake.registrations().is_empty()).await;
    let registration = &fake.registrations()[0];
    assert_eq!(
        (registration.name.as_str(), registration.slots),
        ("test-host", 2)
    );
    assert_eq!(
        (registration.driver.as_str(), registration.host_id.as_str()),
        ("local", "")
    );
    assert_eq!(
        registration.labels.get("zone").map(String::as_str),
        Some("test")
    );
    let host_id_file = scratch.layout.root().join("host-id");
    wait_until("the host id on disk", || host_id_file.exists()).await;
    assert_eq!(std::fs::read_to_string(&host_id_file).unwrap(), "host-1\n");

    // An assignment becomes a running sandbox with the attempt's token.
    fake.assign("sbx-one-a1");
    let report = fake
        .wait_reported("sbx-one-a1", SandboxState::Running)
        .await;
    assert_eq!(
        (report.run_id.as_str(), report.attempt),
        ("run-of-sbx-one-a1", 1)
    );
    wait_for_file(&scratch.report_file("sbx-one-a1", "ready")).await;
    let env = scratch.read_report("sbx-one-a1", "env");
    assert!(
        env.contains("CAIRN_RUN_TOKEN=run-token-of-sbx-one-a1\n"),
        "{env}"
    );
    assert!(
        env.contains("CAIRN_COORDINATOR=http://coordinator-as-sandboxes-see-it:7400\n"),
        "{env}"
    );
    assert!(
        !env.contains(HOST_TOKEN),
        "the host token leaked into the sandbox: {env}"
    );
    let sandbox_dir = scratch.layout.sandbox_paths("sbx-one-a1").dir;
    assert_eq!(
        std::fs::read_to_string(sandbox_dir.join("workspace/x")).unwrap(),
        "sbx-one-a1\n"
    );

    // A destroy order: SIGTERM, the runner's own exit, the directory gone.
    fake.destroy("sbx-one-a1", "cancelled");
    let report = fake
        .wait_reported("sbx-one-a1", SandboxState::Destroyed)
        .await;
    assert_eq!(report.exit_code, 0, "{}", report.detail);
    assert!(
        report
            .detail
            .starts_with("destroyed (cancelled): exited with status 0 after SIGTERM"),
        "{}",
        report.detail
    );
    assert_eq!(scratch.read_report("sbx-one-a1", "term"), "TERM\n");
    assert!(!sandbox_dir.exists());

    // Forgotten sandboxes leave the reports (and the records).
    fake.forget("sbx-one-a1");
    wait_until("sbx-one-a1 forgotten", || {
        fake.state
            .lock()
            .unwrap()
            .heartbeats
            .last()
            .is_some_and(|h| h.sandboxes.is_empty())
    })
    .await;
    assert!(
        !scratch
            .layout
            .root()
            .join("records/sbx-one-a1.json")
            .exists()
    );

    // A runner that exits by itself.
    std::fs::write(scratch.report_file("sbx-two-a1", "mode"), "exit").unwrap();
    fake.assign("sbx-two-a1");
    let report = fake.wait_reported("sbx-two-a1", SandboxState::Exited).await;
    assert_eq!(report.exit_code, 3);
    assert!(
        report
            .detail
            .contains("runner exited with status 3: stand-in failing on purpose"),
        "{}",
        report.detail
    );

    // A destroy order for a sandbox the host never had is answered, not repeated forever.
    fake.destroy("sbx-unknown-a1", "cancelled");
    let report = fake
        .wait_reported("sbx-unknown-a1", SandboxState::Destroyed)
        .await;
    assert!(
        report.detail.contains("this host has no such sandbox"),
        "{}",
        report.detail
    );

    // Stopping the agent destroys what runs and reports it in a last heartbeat.
    fake.assign("sbx-three-a1");
    fake.wait_reported("sbx-three-a1", SandboxState::Running)
        .await;
    wait_for_file(&scratch.report_file("sbx-three-a1", "ready")).await;
    stop.send(()).unwrap();
    agent.await.unwrap().unwrap();
    let report = fake.reported("sbx-three-a1").unwrap();
    assert_eq!(report.state, pb::SandboxState::Destroyed as i32);
    assert!(
        report.detail.starts_with("destroyed (host_shutdown)"),
        "{}",
        report.detail
    );
    assert_eq!(scratch.read_report("sbx-three-a1", "term"), "TERM\n");
    assert!(!scratch.layout.sandbox_paths("sbx-three-a1").dir.exists());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_respects_its_slots() {
    let scratch = Scratch::new();
    let driver = local_driver(&scratch);
    let fake = Fake::default();
    let server = Server::start(fake.clone(), None).await;
    let (stop, agent) = spawn_agent(config(&scratch, &server.url(), 1), driver);

    fake.assign("sbx-first-a1");
    fake.assign("sbx-second-a1");
    fake.wait_reported("sbx-first-a1", SandboxState::Running)
        .await;
    fake.wait_heartbeats(5).await;
    assert!(
        fake.reported("sbx-second-a1").is_none(),
        "a second sandbox started on a host with one slot"
    );

    fake.destroy("sbx-first-a1", "suspended");
    fake.wait_reported("sbx-first-a1", SandboxState::Destroyed)
        .await;
    fake.wait_reported("sbx-second-a1", SandboxState::Running)
        .await;

    stop.send(()).unwrap();
    agent.await.unwrap().unwrap();
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_survives_a_coordinator_restart_and_obeys_lost() {
    let scratch = Scratch::new();
    let driver = local_driver(&scratch);
    let fake = Fake::default();
    let server = Server::start(fake.clone(), None).await;
    let addr = server.addr;
    let (stop, agent) = spawn_agent(config(&scratch, &server.url(), 2), driver);

    fake.assign("sbx-steady-a1");
    fake.wait_reported("sbx-steady-a1", SandboxState::Running)
        .await;
    wait_for_file(&scratch.report_file("sbx-steady-a1", "ready")).await;

    // The coordinator goes away for a while: the sandbox keeps running.
    server.stop().await;
    let silent_from = fake.heartbeat_count();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(fake.heartbeat_count(), silent_from);
    assert!(scratch.layout.sandbox_paths("sbx-steady-a1").dir.exists());
    assert!(!scratch.report_file("sbx-steady-a1", "term").exists());

    // It comes back on the same address: heartbeats resume, no new registration.
    let server = Server::start(fake.clone(), Some(addr)).await;
    fake.wait_heartbeats(2).await;
    assert_eq!(
        fake.reported("sbx-steady-a1").unwrap().state,
        pb::SandboxState::Running as i32
    );
    assert_eq!(fake.registrations().len(), 1);

    // LOST: everything is destroyed as superseded and the host registers again as itself.
    fake.state.lock().unwrap().lost_next = true;
    wait_until("a second registration", || fake.registrations().len() == 2).await;
    assert_eq!(fake.registrations()[1].host_id, "host-1");
    let report = fake
        .wait_reported("sbx-steady-a1", SandboxState::Destroyed)
        .await;
    assert!(
        report.detail.starts_with("destroyed (superseded)"),
        "{}",
        report.detail
    );
    assert_eq!(scratch.read_report("sbx-steady-a1", "term"), "TERM\n");

    stop.send(()).unwrap();
    agent.await.unwrap().unwrap();
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_destroys_what_its_predecessor_left_running() {
    let scratch = Scratch::new();
    let driver = local_driver(&scratch);
    let fake = Fake::default();
    let server = Server::start(fake.clone(), None).await;
    let (_stop, agent) = spawn_agent(config(&scratch, &server.url(), 2), driver.clone());

    fake.assign("sbx-left-a1");
    fake.wait_reported("sbx-left-a1", SandboxState::Running)
        .await;
    wait_for_file(&scratch.report_file("sbx-left-a1", "ready")).await;
    // The agent vanishes without a word; its runner keeps running.
    agent.abort();
    let _ = agent.await;
    assert!(!scratch.report_file("sbx-left-a1", "term").exists());

    let fresh = Fake::default();
    let server2 = Server::start(fresh.clone(), None).await;
    let (stop, agent) = spawn_agent(config(&scratch, &server2.url(), 2), driver);
    let report = fresh
        .wait_reported("sbx-left-a1", SandboxState::Destroyed)
        .await;
    assert!(
        report.detail.starts_with("destroyed (host_restarted)"),
        "{}",
        report.detail
    );
    assert_eq!(scratch.read_report("sbx-left-a1", "term"), "TERM\n");
    assert!(!scratch.layout.sandbox_paths("sbx-left-a1").dir.exists());
    assert_eq!(
        fresh.registrations()[0].host_id,
        "host-1",
        "the restarted agent registered as a new host"
    );

    stop.send(()).unwrap();
    agent.await.unwrap().unwrap();
    server.stop().await;
    server2.stop().await;
}

#[tokio::test]
async fn a_refused_token_stops_the_agent_with_the_cause() {
    let scratch = Scratch::new();
    let driver = local_driver(&scratch);
    let fake = Fake::default();
    let server = Server::start(fake.clone(), None).await;
    let mut config = config(&scratch, &server.url(), 1);
    config.token = "cairn_host_wrong".into();
    let error = host::run_with_driver(config, driver, std::future::pending())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("refused this host") && error.contains("unknown token"),
        "{error}"
    );
    server.stop().await;
}

// ---- The cairn-host binary ----

fn cairn_host() -> Command {
    Command::new(env!("CARGO_BIN_EXE_cairn-host"))
}

fn host_args(scratch: &Scratch, data_dir: &Path, coordinator: &str) -> Vec<String> {
    [
        "--coordinator",
        coordinator,
        "--data-dir",
        &data_dir.display().to_string(),
        "--runner-bin",
        &scratch.standin.display().to_string(),
        "--name",
        "binary-host",
        "--labels",
        "zone=test",
        "--slots",
        "2",
        "--grace",
        "10s",
        "--env",
        &format!("STANDIN_REPORT={}", scratch.report.display()),
    ]
    .into_iter()
    .map(str::to_owned)
    .collect()
}

fn signal(child: &std::process::Child, signal: libc::c_int) {
    // SAFETY: kill takes no pointers.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
}

async fn wait_exit(child: &mut std::process::Child) -> std::process::ExitStatus {
    let mut status = None;
    wait_until("cairn-host to exit", || {
        status = child.try_wait().unwrap();
        status.is_some()
    })
    .await;
    status.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_host_agent_takes_its_runners_down_and_a_new_one_cleans_up() {
    let scratch = Scratch::new();
    // Fails with the reason when this machine cannot make sandboxes.
    local_driver(&scratch);
    let fake = Fake::default();
    let server = Server::start(fake.clone(), None).await;
    let data_dir = scratch.layout.root().to_owned();
    let mut host = cairn_host()
        .args(host_args(&scratch, &data_dir, &server.url()))
        .env("CAIRN_TOKEN", HOST_TOKEN)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    fake.assign("sbx-orphaned-a1");
    fake.wait_reported("sbx-orphaned-a1", SandboxState::Running)
        .await;
    wait_for_file(&scratch.report_file("sbx-orphaned-a1", "ready")).await;

    // SIGKILL: no chance to destroy anything, yet the runner is told to stop.
    signal(&host, libc::SIGKILL);
    wait_exit(&mut host).await;
    wait_for_file(&scratch.report_file("sbx-orphaned-a1", "term")).await;

    // A new agent on the same data directory registers as the same host and
    // reports the leftover sandbox gone.
    let fresh = Fake::default();
    let server2 = Server::start(fresh.clone(), None).await;
    let mut host = cairn_host()
        .args(host_args(&scratch, &data_dir, &server2.url()))
        .env("CAIRN_TOKEN", HOST_TOKEN)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let report = fresh
        .wait_reported("sbx-orphaned-a1", SandboxState::Destroyed)
        .await;
    assert!(
        report.detail.contains("host_restarted"),
        "{}",
        report.detail
    );
    assert_eq!(fresh.registrations()[0].host_id, "host-1");
    assert!(!scratch.layout.sandbox_paths("sbx-orphaned-a1").dir.exists());

    // SIGTERM: a clean stop, exit 0.
    fresh.assign("sbx-last-a1");
    fresh
        .wait_reported("sbx-last-a1", SandboxState::Running)
        .await;
    wait_for_file(&scratch.report_file("sbx-last-a1", "ready")).await;
    signal(&host, libc::SIGTERM);
    assert!(wait_exit(&mut host).await.success());
    let report = fresh.reported("sbx-last-a1").unwrap();
    assert!(
        report.detail.starts_with("destroyed (host_shutdown)"),
        "{}",
        report.detail
    );
    assert_eq!(scratch.read_report("sbx-last-a1", "term"), "TERM\n");
    server.stop().await;
    server2.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unprivileged_host_agent_uses_a_user_namespace() {
    let scratch = Scratch::new();
    assert!(
        is_root() && Path::new("/usr/bin/setpriv").exists(),
        "this test needs root (to become nobody) and setpriv (util-linux)"
    );
    // /workspace is only a mount point; an unprivileged agent cannot create it.
    std::fs::create_dir_all("/workspace").unwrap();
    let data_dir: PathBuf = scratch.tmp.path().join("nobody-data");
    std::fs::create_dir(&data_dir).unwrap();
    std::os::unix::fs::chown(&data_dir, Some(65534), Some(65534)).unwrap();

    let fake = Fake::default();
    let server = Server::start(fake.clone(), None).await;
    let log = scratch.tmp.path().join("host.log");
    let mut host = Command::new("/usr/bin/setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            env!("CARGO_BIN_EXE_cairn-host"),
        ])
        .args(host_args(&scratch, &data_dir, &server.url()))
        .env("CAIRN_TOKEN", HOST_TOKEN)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let registered = tokio::time::timeout(PATIENCE, async {
        while fake.registrations().is_empty() {
            if host.try_wait().unwrap().is_some() {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    })
    .await
    .unwrap();
    let unprivileged_namespaces = user_namespaces_work(&[
        "/usr/bin/setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
    ]);
    if !registered {
        let status = host.wait().unwrap();
        let stderr = std::fs::read_to_string(&log).unwrap();
        assert!(
            !unprivileged_namespaces,
            "unprivileged user namespaces work here, but cairn-host as nobody exited: {stderr}"
        );
        // The kernel forbids them: the agent refuses to start and says why.
        assert!(!status.success());
        assert!(
            stderr.contains("cannot give sandboxes a private /workspace"),
            "{stderr}"
        );
        return;
    }
    assert!(
        unprivileged_namespaces,
        "cairn-host as nobody started though `unshare -U` as nobody fails"
    );

    fake.assign("sbx-nobody-a1");
    fake.wait_reported("sbx-nobody-a1", SandboxState::Running)
        .await;
    wait_for_file(&scratch.report_file("sbx-nobody-a1", "ready")).await;
    assert_eq!(scratch.read_report("sbx-nobody-a1", "uid"), "65534\n");
    assert_eq!(scratch.read_report("sbx-nobody-a1", "seen"), "escape\nx\n");
    let workspace = data_dir.join("sandboxes/sbx-nobody-a1/workspace/x");
    assert_eq!(
        std::fs::read_to_string(workspace).unwrap(),
        "sbx-nobody-a1\n"
    );
    assert!(!Path::new("/workspace/x").exists());

    signal(&host, libc::SIGTERM);
    assert!(wait_exit(&mut host).await.success());
    assert_eq!(scratch.read_report("sbx-nobody-a1", "term"), "TERM\n");
    server.stop().await;
}

#[test]
fn an_unknown_placeholder_is_refused_before_anything_starts() {
    let scratch = Scratch::new();
    let output = cairn_host()
        .args(host_args(
            &scratch,
            scratch.layout.root(),
            "http://127.0.0.1:9",
        ))
        .args([
            "--driver",
            "exec",
            "--exec-create",
            "docker run --name cairn-{sandbox} {image}",
        ])
        .env("CAIRN_TOKEN", HOST_TOKEN)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("error: --exec-create: unknown placeholder {sandbox} (known: {sandbox_id}"),
        "{stderr}"
    );
}
