//! The host agent's drivers with real processes: the local driver's mount
//! namespaces, destroy (SIGTERM, grace, SIGKILL, session sweep, directory
//! removal), and the exec driver with unshare, bubblewrap and detached
//! templates.

mod host_support;

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cairn_engine::host_reports::ReportReader;
use cairn_host::driver::{Driver, SandboxSpec};
use cairn_host::metrics::HostMetrics;
use cairn_host::sandbox::{Cleanup, RunnerOutput, Update, supervise};
use cairn_host::{ExecDriver, ExecTemplates, LocalDriver, NamespaceMode};
use cairn_proto::runs::SandboxState;
use host_support::*;
use tokio::sync::{mpsc, oneshot};

/// A sandbox under the real supervisor, as the agent runs it.
struct Running {
    id: String,
    dir: std::path::PathBuf,
    destroy: Option<oneshot::Sender<String>>,
    updates: mpsc::UnboundedReceiver<Update>,
}

impl Running {
    fn start<D: Driver>(driver: &D, spec: &SandboxSpec, grace: Duration) -> Self {
        let sandbox = driver
            .start(spec)
            .unwrap_or_else(|e| panic!("start {}: {e}", spec.sandbox_id));
        let (destroy_tx, destroy_rx) = oneshot::channel();
        let (updates_tx, updates) = mpsc::unbounded_channel();
        tokio::spawn(supervise(
            spec.sandbox_id.clone(),
            sandbox,
            grace,
            destroy_rx,
            Cleanup {
                paths: spec.paths.clone(),
                keep: None,
            },
            RunnerOutput {
                log_file: spec.log_file.clone(),
                reports: ReportReader::new(),
                metrics: Arc::new(HostMetrics::new()),
            },
            updates_tx,
        ));
        Self {
            id: spec.sandbox_id.clone(),
            dir: spec.paths.dir.clone(),
            destroy: Some(destroy_tx),
            updates,
        }
    }

    /// Waits for the sandbox's end; returns (state, exit code, detail).
    async fn ended(&mut self) -> (SandboxState, i32, String) {
        loop {
            let update = tokio::time::timeout(PATIENCE, self.updates.recv())
                .await
                .unwrap_or_else(|_| panic!("{} did not end", self.id))
                .expect("the supervisor reports before it stops");
            if let Update::Ended {
                state,
                exit_code,
                detail,
                ..
            } = update
            {
                assert!(
                    !self.dir.exists(),
                    "{} still exists after the end was reported",
                    self.dir.display()
                );
                return (state, exit_code, detail);
            }
        }
    }

    async fn destroy(&mut self, reason: &str) -> (SandboxState, i32, String) {
        self.destroy
            .take()
            .unwrap()
            .send(reason.to_owned())
            .unwrap();
        self.ended().await
    }
}

/// Both sandboxes write /workspace/x; each lands in its own directory only.
/// `destroyed_exit` is the status destroy reports (the session leader's).
async fn check_isolation<D: Driver>(driver: &D, scratch: &Scratch, destroyed_exit: i32) {
    let specs = [
        scratch.spec("sbx-iso-a1", "trap", &[]),
        scratch.spec("sbx-iso-b1", "trap", &[]),
    ];
    let mut running: Vec<Running> = specs
        .iter()
        .map(|s| Running::start(driver, s, Duration::from_secs(30)))
        .collect();
    for spec in &specs {
        wait_for_file(&scratch.report_file(&spec.sandbox_id, "ready")).await;
    }
    for spec in &specs {
        let id = &spec.sandbox_id;
        assert_eq!(
            fs::read_to_string(spec.paths.workspace.join("x")).unwrap(),
            format!("{id}\n")
        );
        // Each saw only its own files at /workspace, started there, with its own environment.
        assert_eq!(scratch.read_report(id, "seen"), "escape\nx\n");
        assert_eq!(scratch.read_report(id, "pwd"), "/workspace\n");
        let env = scratch.read_report(id, "env");
        assert!(
            env.contains(&format!("CAIRN_RUN_TOKEN=token-of-{id}\n")),
            "{env}"
        );
        assert!(
            env.contains(&format!("HOME={}\n", spec.paths.home.display())),
            "{env}"
        );
        assert!(
            env.contains(&format!("CAIRN_CACHE_DIR={}\n", spec.paths.cache.display())),
            "{env}"
        );
        // The host's pack cache, shared by all sandboxes, as a host path.
        let pack_cache = scratch.pack_cache();
        assert!(
            env.contains(&format!("CAIRN_PACK_CACHE={}\n", pack_cache.dir.display())),
            "{env}"
        );
        assert!(
            env.contains(&format!("CAIRN_PACK_CACHE_SIZE={}\n", pack_cache.max_bytes)),
            "{env}"
        );
    }
    assert!(
        !Path::new("/workspace/x").exists(),
        "a sandbox wrote into the host's /workspace"
    );

    for sandbox in &mut running {
        let (state, exit_code, detail) = sandbox.destroy("cancelled").await;
        assert_eq!(
            (state, exit_code),
            (SandboxState::Destroyed, destroyed_exit),
            "{detail}"
        );
        assert!(
            detail.contains("destroyed (cancelled)") && detail.contains("after SIGTERM"),
            "{detail}"
        );
    }
    for spec in &specs {
        assert_eq!(scratch.read_report(&spec.sandbox_id, "term"), "TERM\n");
    }
    // The symlink out of the sandbox was removed, not followed.
    assert!(scratch.report_file("sbx-iso-a1", "env").exists());
}

#[tokio::test]
async fn local_sandboxes_each_see_their_own_workspace() {
    let scratch = Scratch::new();
    let driver = local_driver(&scratch);
    check_isolation(&driver, &scratch, 0).await;

    // The runner's environment holds only the sandbox's variables and a few
    // harmless ones from the host: what the host agent itself was given
    // (here, cargo's variables; in production its token) does not leak in.
    let env = scratch.read_report("sbx-iso-a1", "env");
    assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
    assert!(!env.contains("CARGO_MANIFEST_DIR="), "{env}");
}

#[tokio::test]
async fn local_sandboxes_work_through_a_user_namespace() {
    let scratch = Scratch::new();
    let made = LocalDriver::with_mode(
        &scratch.standin,
        scratch.layout.root(),
        NamespaceMode::UserNamespace,
    );
    let driver = match (made, user_namespaces_work(&[])) {
        (Ok(driver), true) => driver,
        (Err(e), false) => {
            // The kernel forbids them: the driver must refuse, saying why.
            assert!(e.to_string().contains("namespace"), "{e}");
            return;
        }
        (Ok(_), false) => panic!("the driver accepted user namespaces `unshare -U` cannot make"),
        (Err(e), true) => panic!("user namespaces work here, but the driver refused: {e}"),
    };
    check_isolation(&driver, &scratch, 0).await;
    // The uid is mapped to itself, so files in the workspace belong to the host user.
    // SAFETY: getuid takes no arguments.
    let uid = unsafe { libc::getuid() };
    assert_eq!(scratch.read_report("sbx-iso-a1", "uid"), format!("{uid}\n"));
}

#[tokio::test]
async fn destroy_sends_sigterm_first_and_sigkill_after_the_grace() {
    let scratch = Scratch::new();
    let driver = local_driver(&scratch);

    let spec = scratch.spec("sbx-stubborn-a1", "ignore", &[]);
    let mut stubborn = Running::start(&driver, &spec, Duration::from_millis(300));
    wait_for_file(&scratch.report_file("sbx-stubborn-a1", "ready")).await;
    let (state, exit_code, detail) = stubborn.destroy("hold_expired").await;
    assert_eq!(
        (state, exit_code),
        (SandboxState::Destroyed, -libc::SIGKILL),
        "{detail}"
    );
    assert!(
        detail.contains("killed with SIGKILL after the 300ms grace period"),
        "{detail}"
    );

    let spec = scratch.spec("sbx-polite-a1", "trap", &[]);
    let mut polite = Running::start(&driver, &spec, Duration::from_secs(60));
    wait_for_file(&scratch.report_file("sbx-polite-a1", "ready")).await;
    let (state, exit_code, detail) = polite.destroy("suspended").await;
    assert_eq!((state, exit_code), (SandboxState::Destroyed, 0), "{detail}");
    assert_eq!(scratch.read_report("sbx-polite-a1", "term"), "TERM\n");
}

#[tokio::test]
async fn processes_left_in_the_sandbox_session_are_killed() {
    let scratch = Scratch::new();
    let driver = local_driver(&scratch);
    let spec = scratch.spec("sbx-orphan-a1", "orphan", &[]);
    let mut sandbox = Running::start(&driver, &spec, Duration::from_millis(500));
    wait_for_file(&scratch.report_file("sbx-orphan-a1", "ready")).await;
    let orphan: i32 = scratch
        .read_report("sbx-orphan-a1", "orphan")
        .trim()
        .parse()
        .unwrap();
    assert!(alive(orphan));
    let (state, exit_code, detail) = sandbox.destroy("draining").await;
    assert_eq!((state, exit_code), (SandboxState::Destroyed, 0), "{detail}");
    // The runner exited on SIGTERM, but its leftover (in a process group the
    // SIGTERM did not reach) is gone before the end is reported.
    assert!(
        detail.contains("processes it left were killed with SIGKILL"),
        "{detail}"
    );
    assert!(!alive(orphan), "process {orphan} outlived its sandbox");
}

#[tokio::test]
async fn a_runner_that_exits_by_itself_is_reported_with_its_status() {
    let scratch = Scratch::new();
    let driver = local_driver(&scratch);

    let spec = scratch.spec("sbx-exit-a1", "exit", &[("STANDIN_EXIT", "3")]);
    let (state, exit_code, detail) = Running::start(&driver, &spec, Duration::from_secs(30))
        .ended()
        .await;
    assert_eq!((state, exit_code), (SandboxState::Exited, 3), "{detail}");
    assert!(
        detail.contains("runner exited with status 3: stand-in failing on purpose"),
        "{detail}"
    );

    let spec = scratch.spec("sbx-signal-a1", "signal", &[]);
    let (state, exit_code, detail) = Running::start(&driver, &spec, Duration::from_secs(30))
        .ended()
        .await;
    assert_eq!(
        (state, exit_code),
        (SandboxState::Exited, -libc::SIGUSR1),
        "{detail}"
    );
    assert!(
        detail.contains("runner was killed by signal 10"),
        "{detail}"
    );
}

fn exec_driver(scratch: &Scratch, templates: ExecTemplates) -> ExecDriver {
    ExecDriver::new(
        &templates,
        &scratch.standin.display().to_string(),
        scratch.layout.root(),
        None,
        Duration::from_secs(30),
    )
    .unwrap()
}

#[tokio::test]
async fn exec_driver_with_an_unshare_template() {
    let scratch = Scratch::new();
    assert!(
        is_root(),
        "this test needs root: `unshare -m` with a bind mount (CI runs as root)"
    );
    let create = "unshare -m sh -c 'mount --bind {workspace_dir} /workspace && cd /workspace && exec {runner} run'";
    let driver = exec_driver(
        &scratch,
        ExecTemplates {
            create: create.into(),
            ..Default::default()
        },
    );
    std::fs::create_dir_all("/workspace").unwrap();
    check_isolation(&driver, &scratch, 0).await;
}

#[tokio::test]
async fn exec_driver_with_a_bubblewrap_template() {
    let scratch = Scratch::new();
    assert!(
        Path::new("/usr/bin/bwrap").exists(),
        "this test needs bubblewrap (apt-get install bubblewrap; .ci/run installs it)"
    );
    if !Path::new("/workspace").is_dir() {
        assert!(
            is_root(),
            "this test needs root or an existing /workspace mount point"
        );
        std::fs::create_dir_all("/workspace").unwrap();
    }
    let create =
        "bwrap --dev-bind / / --bind {workspace_dir} /workspace --chdir /workspace {runner} run";
    let driver = exec_driver(
        &scratch,
        ExecTemplates {
            create: create.into(),
            ..Default::default()
        },
    );
    // bwrap itself dies of SIGTERM (-15) while the runner inside still handles
    // it: destroy waits for the runner, which records the SIGTERM.
    check_isolation(&driver, &scratch, -libc::SIGTERM).await;

    // A stubborn runner inside bwrap is killed after the grace like any other.
    let driver = ExecDriver::new(
        &ExecTemplates {
            create: create.into(),
            ..Default::default()
        },
        &scratch.standin.display().to_string(),
        scratch.layout.root(),
        None,
        Duration::from_millis(300),
    )
    .unwrap();
    let spec = scratch.spec("sbx-bwrap-stubborn-a1", "ignore", &[]);
    let mut sandbox = Running::start(&driver, &spec, Duration::from_millis(300));
    wait_for_file(&scratch.report_file("sbx-bwrap-stubborn-a1", "ready")).await;
    let (state, exit_code, detail) = sandbox.destroy("cancelled").await;
    assert_eq!(
        (state, exit_code),
        (SandboxState::Destroyed, -libc::SIGTERM),
        "{detail}"
    );
    assert!(
        detail.contains("killed with SIGKILL after the 300ms grace period"),
        "{detail}"
    );
    assert!(
        !scratch
            .report_file("sbx-bwrap-stubborn-a1", "term")
            .exists()
    );
}

/// Detached mode simulated with plain processes: create starts the runner in
/// the background and returns, wait polls it and prints a status, destroy
/// signals it (and records the grace it was given).
#[tokio::test]
async fn exec_driver_detached_mode() {
    let scratch = Scratch::new();
    let templates = ExecTemplates {
        create: "sh -c 'setsid {runner} run < /dev/null >> {sandbox_dir}/out 2>&1 & echo $! > {sandbox_dir}/pid'".into(),
        wait: Some(
            "sh -c 'while kill -0 $(cat {sandbox_dir}/pid) 2>/dev/null; do sleep 0.05; done; echo gone; echo 42'"
                .into(),
        ),
        destroy: Some(
            "sh -c 'echo {grace_secs} >> $STANDIN_REPORT/{sandbox_id}.destroyed; kill -TERM $(cat {sandbox_dir}/pid) 2>/dev/null; true'"
                .into(),
        ),
    };
    let driver = exec_driver(&scratch, templates);
    assert!(driver.is_detached());

    let mut spec = scratch.spec("sbx-detached-a1", "trap", &[]);
    let workspace = spec.paths.workspace.display().to_string();
    spec.env.push(cairn_host::driver::EnvVar {
        name: "STANDIN_WORKSPACE".into(),
        value: workspace,
        portable: true,
    });
    let mut sandbox = Running::start(&driver, &spec, Duration::from_secs(30));
    wait_for_file(&scratch.report_file("sbx-detached-a1", "ready")).await;
    assert_eq!(
        fs::read_to_string(spec.paths.workspace.join("x")).unwrap(),
        "sbx-detached-a1\n"
    );
    let (state, exit_code, detail) = sandbox.destroy("cancelled").await;
    assert_eq!(
        (state, exit_code),
        (SandboxState::Destroyed, 42),
        "{detail}"
    );
    assert!(detail.contains("destroy command succeeded"), "{detail}");
    assert_eq!(scratch.read_report("sbx-detached-a1", "term"), "TERM\n");
    assert_eq!(scratch.read_report("sbx-detached-a1", "destroyed"), "30\n");

    // A create command that fails fails the sandbox, quoting its output.
    let failing = ExecTemplates {
        create: "sh -c 'echo no such image: {sandbox_id} >&2; exit 125'".into(),
        wait: Some("true".into()),
        destroy: Some("true".into()),
    };
    let driver = exec_driver(&scratch, failing);
    let spec = scratch.spec("sbx-nocreate-a1", "trap", &[]);
    let (state, _, detail) = Running::start(&driver, &spec, Duration::from_secs(30))
        .ended()
        .await;
    assert_eq!(state, SandboxState::Failed, "{detail}");
    assert!(
        detail
            .contains("the create command exited with status 125: no such image: sbx-nocreate-a1"),
        "{detail}"
    );
}

#[tokio::test]
async fn exec_templates_are_checked_at_startup_and_at_start() {
    let scratch = Scratch::new();
    let runner = scratch.standin.display().to_string();
    let new = |create: &str, destroy: Option<&str>, wait: Option<&str>| {
        let templates = ExecTemplates {
            create: create.into(),
            destroy: destroy.map(str::to_owned),
            wait: wait.map(str::to_owned),
        };
        ExecDriver::new(
            &templates,
            &runner,
            scratch.layout.root(),
            None,
            Duration::from_secs(30),
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    };
    let err = new("docker run {imag} x", None, None).unwrap_err();
    assert!(
        err.contains("--exec-create: unknown placeholder {imag} (known: {sandbox_id}"),
        "{err}"
    );
    let err = new("x", Some("docker stop {id}"), Some("docker wait x")).unwrap_err();
    assert!(
        err.contains("--exec-destroy: unknown placeholder {id}"),
        "{err}"
    );
    let err = new("x", Some("y"), None).unwrap_err();
    assert!(err.contains("--exec-destroy needs --exec-wait"), "{err}");
    let err = new("x", None, Some("y")).unwrap_err();
    assert!(err.contains("--exec-wait needs --exec-destroy"), "{err}");
    let err = new("sh -c 'echo {runner}", None, None).unwrap_err();
    assert!(
        err.contains("quote opened at character 7 is never closed"),
        "{err}"
    );

    // A run without an image, for a template that needs one.
    let templates = ExecTemplates {
        create: "docker run {image}".into(),
        ..Default::default()
    };
    let driver = ExecDriver::new(
        &templates,
        &runner,
        scratch.layout.root(),
        None,
        Duration::from_secs(30),
    )
    .unwrap();
    let err = driver
        .start(&scratch.spec("sbx-noimage-a1", "trap", &[]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "uses {image}, but the run names no image and the host has no --default-image"
        ),
        "{err}"
    );
}
