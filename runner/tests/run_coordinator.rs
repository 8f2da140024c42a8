//! `cairn-runner run` (the real binary) against the real coordinator, with
//! this test playing the host over HostService and the demo agent as the
//! harness: a run clones its repository, works, asks, is suspended (destroy
//! order → SIGTERM → destroy checkpoint), is answered, and resumes in a new
//! sandbox at the same path from the newest checkpoint, in the same
//! conversation, remembering its first turn.
//!
//! Needs the `cairn-coordinator` binary next to this test's target dir, with
//! the run services; without it the test says so and passes vacuously (the
//! end-to-end suite in tests/ builds and runs everything).

mod attempt_support;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use attempt_support::{Reaped, coordinator_binary, demo_agent_binary, start_coordinator};
use cairn_engine::client::{AuthChannel, CoordinatorClient};
use cairn_engine::restore::{self, NoProgress, RestoreOptions};
use cairn_proto::pb;
use cairn_proto::pb::host_service_client::HostServiceClient;
use cairn_proto::pb::run_service_client::RunServiceClient;

const RUNNER: &str = env!("CARGO_BIN_EXE_cairn-runner");
const LIMIT: Duration = Duration::from_secs(90);

/// This test as a host: heartbeats, takes assignments, runs the runner.
struct Host {
    client: HostServiceClient<AuthChannel>,
    id: String,
    grpc: String,
    /// The sandbox's workspace path: the same for every attempt, as /workspace is.
    root: PathBuf,
    base: PathBuf,
    sandboxes: HashMap<String, (pb::Assignment, Reaped)>,
    ended: Vec<pb::SandboxReport>,
}

impl Host {
    async fn heartbeat(&mut self) -> pb::HeartbeatResponse {
        let mut reports: Vec<pb::SandboxReport> = self
            .sandboxes
            .values()
            .map(|(a, _)| pb::SandboxReport {
                sandbox_id: a.sandbox_id.clone(),
                run_id: a.run_id.clone(),
                attempt: a.attempt,
                state: pb::SandboxState::Running as i32,
                ..Default::default()
            })
            .collect();
        reports.extend(self.ended.iter().cloned());
        let request = pb::HeartbeatRequest {
            host_id: self.id.clone(),
            sandboxes: reports,
            stopping: false,
            kept_workspaces: Vec::new(),
        };
        let answer = self.client.heartbeat(request).await.unwrap().into_inner();
        self.ended
            .retain(|r| !answer.forget.contains(&r.sandbox_id));
        answer
    }

    /// Starts the runner for a new assignment, in an emptied sandbox.
    fn start(&mut self, assignment: pb::Assignment) {
        if self.root.exists() {
            fs::remove_dir_all(&self.root).unwrap();
        }
        fs::create_dir_all(&self.root).unwrap();
        let home = self.base.join("home").join(&assignment.sandbox_id);
        fs::create_dir_all(home.join(".claude")).unwrap();
        let child = Command::new(RUNNER)
            .args(["run", "--root"])
            .arg(&self.root)
            .env("CAIRN_COORDINATOR", &self.grpc)
            .env("CAIRN_RUN_TOKEN", &assignment.run_token)
            .env(
                "CAIRN_CACHE_DIR",
                self.base.join("cache").join(&assignment.sandbox_id),
            )
            .env("HOME", &home)
            .env("CAIRN_SANDBOX_ID", &assignment.sandbox_id)
            .spawn()
            .unwrap();
        self.sandboxes
            .insert(assignment.sandbox_id.clone(), (assignment, Reaped(child)));
    }

    /// Destroys a sandbox the way cairn-host does: SIGTERM, wait, report.
    fn destroy(&mut self, sandbox_id: &str) -> ExitStatus {
        let (assignment, child) = self
            .sandboxes
            .remove(sandbox_id)
            .expect("a sandbox of this host");
        // SAFETY: signalling a child we started.
        unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
        self.end(assignment, child, pb::SandboxState::Destroyed)
    }

    /// Reports sandboxes whose runner exited on its own.
    fn reap(&mut self) -> Vec<ExitStatus> {
        let done: Vec<String> = self
            .sandboxes
            .iter_mut()
            .filter_map(|(id, (_, child))| child.0.try_wait().unwrap().map(|_| id.clone()))
            .collect();
        done.into_iter()
            .map(|id| {
                let (assignment, child) = self.sandboxes.remove(&id).unwrap();
                self.end(assignment, child, pb::SandboxState::Exited)
            })
            .collect()
    }

    /// Reaps a sandbox's runner and remembers the sandbox as ended in `state`.
    fn end(
        &mut self,
        assignment: pb::Assignment,
        mut child: Reaped,
        state: pb::SandboxState,
    ) -> ExitStatus {
        let status = child.0.wait().unwrap();
        self.ended.push(pb::SandboxReport {
            sandbox_id: assignment.sandbox_id,
            run_id: assignment.run_id,
            attempt: assignment.attempt,
            state: state as i32,
            exit_code: status.code().unwrap_or(-1),
            detail: String::new(),
        });
        status
    }

    /// Heartbeats (starting assignments, carrying out destroy orders) until
    /// `done` says the run got where the test wants it.
    async fn until(
        &mut self,
        runs: &mut RunServiceClient<AuthChannel>,
        run_id: &str,
        what: &str,
        done: impl Fn(&pb::Run) -> bool,
    ) -> pb::Run {
        let deadline = Instant::now() + LIMIT;
        loop {
            for status in self.reap() {
                assert!(
                    status.success(),
                    "a runner failed ({status}); its stderr is above"
                );
            }
            let answer = self.heartbeat().await;
            for assignment in answer.assignments {
                if !self.sandboxes.contains_key(&assignment.sandbox_id)
                    && !self
                        .ended
                        .iter()
                        .any(|r| r.sandbox_id == assignment.sandbox_id)
                {
                    self.start(assignment);
                }
            }
            for order in answer.destroy {
                if self.sandboxes.contains_key(&order.sandbox_id) {
                    let status = self.destroy(&order.sandbox_id);
                    assert!(
                        status.success(),
                        "the runner checkpoints and exits 0 on SIGTERM: {status}"
                    );
                }
            }
            let run = runs
                .get_run(pb::GetRunRequest {
                    run_id: run_id.into(),
                })
                .await
                .unwrap()
                .into_inner();
            if done(&run) {
                return run;
            }
            assert!(
                Instant::now() < deadline,
                "gave up waiting for {what}: {run:#?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn state(run: &pb::Run) -> pb::RunState {
    pb::RunState::try_from(run.state).unwrap()
}

/// A repository to clone, with one commit.
fn origin(dir: &Path) -> String {
    let repo = git2::Repository::init(dir).unwrap();
    fs::write(dir.join("README"), "the app\n").unwrap();
    let mut index = repo.index().unwrap();
    index.add_path(Path::new("README")).unwrap();
    let tree = repo.find_tree(index.write_tree().unwrap()).unwrap();
    let who = git2::Signature::now("t", "t@example.com").unwrap();
    repo.commit(Some("HEAD"), &who, &who, "first", &tree, &[])
        .unwrap();
    dir.to_string_lossy().into_owned()
}

/// A coordinator with this test registered as a host, and a run created on
/// it; None (with the reason printed) when the coordinator binary is missing
/// or has no run services.
struct World {
    _server: Reaped,
    coordinator: CoordinatorClient,
    runs: RunServiceClient<AuthChannel>,
    host: Host,
    run: pb::Run,
    url: String,
}

const PROMPT: &str = "The codeword is PELICAN.\ncommit notes.md first line\nedit notes.md second line\n\
                      untracked scratch.txt draft\nask Which colour should the button be?";

async fn world(base: &Path) -> World {
    let binary = coordinator_binary();
    let (server, grpc, token) = start_coordinator(&binary, &base.join("data"), LIMIT);
    let coordinator = CoordinatorClient::connect(&grpc, Some(&token))
        .await
        .unwrap();
    let mut hosts = HostServiceClient::new(coordinator.auth_channel());
    let registered = hosts
        .register_host(pb::RegisterHostRequest {
            name: "test-host".into(),
            slots: 1,
            driver: "local".into(),
            ..Default::default()
        })
        .await;
    let registered = registered.unwrap().into_inner();
    let mut runs = RunServiceClient::new(coordinator.auth_channel());
    let url = origin(&base.join("origin"));
    let run = runs
        .create_run(pb::CreateRunRequest {
            target: Some(pb::create_run_request::Target::NewWorkspace(
                pb::NewWorkspace {
                    name: "e2e-run".into(),
                },
            )),
            harness: Some(pb::HarnessSpec {
                name: "claude".into(),
                config: [("binary".to_owned(), demo_agent_binary().to_owned())].into(),
            }),
            prompt: PROMPT.into(),
            repos: vec![pb::RepoSpec {
                name: "app".into(),
                url: url.clone(),
                branch: String::new(),
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let host = Host {
        client: hosts,
        id: registered.host_id,
        grpc,
        root: base.join("sandbox/workspace"),
        base: base.to_path_buf(),
        sandboxes: HashMap::new(),
        ended: Vec::new(),
    };
    World {
        _server: server,
        coordinator,
        runs,
        host,
        run,
        url,
    }
}

fn terminal(run: &pb::Run) -> bool {
    matches!(
        state(run),
        pb::RunState::Succeeded | pb::RunState::Failed | pb::RunState::Cancelled
    )
}

/// Heartbeats until the run waits for an answer.
async fn until_waiting(
    host: &mut Host,
    runs: &mut RunServiceClient<AuthChannel>,
    run_id: &str,
) -> pb::Run {
    host.until(runs, run_id, "the run to wait", |r| {
        state(r) == pb::RunState::Waiting
    })
    .await
}

/// Answers the run's question (the answer makes the demo agent recall the
/// codeword) and heartbeats until the run ends, which it must do succeeding.
async fn answer_until_succeeded(
    host: &mut Host,
    runs: &mut RunServiceClient<AuthChannel>,
    run_id: &str,
) -> pb::Run {
    runs.answer_run(pb::AnswerRunRequest {
        run_id: run_id.into(),
        text: "Blue.\nrecall codeword".into(),
    })
    .await
    .unwrap();
    let done = host.until(runs, run_id, "the run to end", terminal).await;
    assert_eq!(state(&done), pb::RunState::Succeeded, "{done:#?}");
    assert_eq!(done.summary, "the codeword was PELICAN");
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_asks_is_suspended_answered_and_resumes_from_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let base = fs::canonicalize(dir.path()).unwrap();
    let World {
        _server,
        coordinator,
        mut runs,
        mut host,
        run: created,
        url,
    } = world(&base).await;

    let waiting = until_waiting(&mut host, &mut runs, &created.id).await;
    assert_eq!(waiting.question, "Which colour should the button be?");
    assert_eq!(
        waiting.attempts[0].prepare,
        format!("cloned app from {url}"),
        "{waiting:#?}"
    );
    let session = waiting.harness_session_id.clone();
    assert!(!session.is_empty(), "the conversation was reported");

    runs.suspend_run(pb::SuspendRunRequest {
        run_id: created.id.clone(),
        reason: "test".into(),
    })
    .await
    .unwrap();
    let suspended = host
        .until(&mut runs, &created.id, "the run to be suspended", |r| {
            state(r) == pb::RunState::Suspended
        })
        .await;
    assert!(host.sandboxes.is_empty(), "the sandbox was destroyed");

    let done = answer_until_succeeded(&mut host, &mut runs, &created.id).await;
    assert_eq!(done.harness_session_id, session, "the same conversation");
    assert_eq!(done.attempts.len(), 2);
    assert_eq!(
        done.attempts[1].restored_checkpoint_id, suspended.last_checkpoint_id,
        "restored the destroy checkpoint"
    );

    let checkpoints = coordinator
        .checkpoints
        .clone()
        .list_checkpoints(pb::ListCheckpointsRequest {
            workspace: done.workspace_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .checkpoints;
    let reasons: Vec<pb::CheckpointReason> = checkpoints
        .iter()
        .rev()
        .map(|c| pb::CheckpointReason::try_from(c.reason).unwrap())
        .collect();
    assert_eq!(
        reasons,
        [
            pb::CheckpointReason::Pause,
            pb::CheckpointReason::Destroy,
            pb::CheckpointReason::End
        ]
    );
    assert!(
        checkpoints
            .iter()
            .all(|c| c.harness.as_ref().is_some_and(|h| h.session_id == session))
    );

    // What the end checkpoint holds: the work, the conversation, no credentials.
    let check = base.join("check");
    let opts = RestoreOptions::new(check.clone(), done.workspace_id.clone());
    restore::restore(&coordinator, &opts, &NoProgress)
        .await
        .unwrap();
    assert_eq!(
        fs::read_to_string(check.join("app/notes.md")).unwrap(),
        "first line\nsecond line\n"
    );
    assert_eq!(
        fs::read_to_string(check.join("app/scratch.txt")).unwrap(),
        "draft\n"
    );
    let slug = host
        .root
        .join("app")
        .to_string_lossy()
        .replace(|c: char| !c.is_ascii_alphanumeric(), "-");
    assert!(
        check
            .join(format!(
                ".cairn/state/claude/projects/{slug}/{session}.jsonl"
            ))
            .is_file()
    );
    assert!(!check.join(".cairn/outcome.json").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_within_the_hold_reaches_the_same_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let base = fs::canonicalize(dir.path()).unwrap();
    let World {
        _server,
        mut runs,
        mut host,
        run: created,
        ..
    } = world(&base).await;
    until_waiting(&mut host, &mut runs, &created.id).await;
    let sandbox: Vec<String> = host.sandboxes.keys().cloned().collect();
    let done = answer_until_succeeded(&mut host, &mut runs, &created.id).await;
    assert_eq!(done.attempts.len(), 1, "the same attempt, no restore");
    assert_eq!(done.attempts[0].sandbox_id, sandbox[0]);
    assert!(done.attempts[0].restored_checkpoint_id.is_empty());
}
