//! The `exec` driver: sandboxes made by commands the operator supplies as
//! templates, so a team plugs in docker, podman, kubectl, bubblewrap, …
//!
//! Flags (templates are split like shell words; see [`super::template`] for
//! the rules and the placeholder safety guarantees):
//!
//! - `--exec-create TEMPLATE` (required) starts a sandbox.
//! - `--exec-destroy TEMPLATE` (optional) ends one.
//! - `--exec-wait TEMPLATE` (required with `--exec-destroy`, else refused)
//!   blocks until a detached sandbox has ended.
//!
//! Placeholders: `{sandbox_id}` `{sandbox_dir}` `{workspace_dir}`
//! `{home_dir}` `{cache_dir}` (the sandbox's directories on this host),
//! `{pack_cache}` (the host's pack cache directory, shared by all its
//! sandboxes, `--pack-cache`; refused at startup when the cache is off),
//! `{image}` (the run's image, else `--default-image`; a template that uses it
//! fails the sandbox with a clear message when neither is set), `{runner}`
//! (`--runner-bin`), `{run_id}` `{attempt}`, `{grace_secs}` (`--grace` in whole
//! seconds, rounded up), `{env_args}` (see below). `{{`/`}}` are literal braces.
//! An unknown placeholder is refused at startup.
//!
//! ## Two modes
//!
//! **Foreground** (no `--exec-destroy`): the create command *is* the sandbox.
//! It is supervised exactly like the local driver's runner — its own session
//! and process group, `PR_SET_PDEATHSIG(SIGTERM)`; its exit is the sandbox's
//! exit; destroy is SIGTERM to its process group, `--grace`, SIGKILL to the
//! group and whatever is left in its session.
//!
//! **Detached** (`--exec-destroy` and `--exec-wait`): the create command must
//! return once the sandbox is up (exit 0; anything else fails the sandbox
//! with the end of its output). The wait command then runs for as long as the
//! sandbox does; when it returns, the sandbox has ended, and its exit status
//! is the integer on the last line the wait command printed (`docker wait`
//! and `podman wait` print exactly that), else the wait command's own status.
//! Destroy runs the destroy command (it gets `--grace` plus a minute, then is
//! killed) and waits up to 30 s more for the wait command to report the end.
//! After a sandbox ended on its own the destroy command is run too, to
//! release what is left (a stopped container, say); its failure then is only
//! logged. A host agent that restarts stops detached sandboxes its previous
//! process left with the destroy command.
//!
//! ## Environment
//!
//! Commands inherit the host agent's environment without `CAIRN_TOKEN` (the
//! host's own token), plus the sandbox's variables: `CAIRN_COORDINATOR`
//! (`--sandbox-coordinator`, else `--coordinator`), `CAIRN_RUN_TOKEN`,
//! `CAIRN_SANDBOX_ID`, `CAIRN_CACHE_DIR` (= `{cache_dir}`), `HOME`
//! (= `{home_dir}`), `CAIRN_PACK_CACHE` (= `{pack_cache}`) and
//! `CAIRN_PACK_CACHE_SIZE` (when the pack cache is on) and every `--env`. So a runner started directly (bwrap,
//! unshare) has what it needs. `HOME` pointing at the sandbox also applies to
//! the docker/kubectl CLIs the template calls: set `DOCKER_CONFIG` /
//! `KUBECONFIG` in the host agent's environment if they need their own config.
//!
//! `{env_args}` (a word of its own) becomes `-e NAME` for `CAIRN_COORDINATOR`,
//! `CAIRN_RUN_TOKEN`, `CAIRN_SANDBOX_ID`, `CAIRN_PACK_CACHE_SIZE` and every
//! `--env` — the variables
//! that mean the same inside a container. Only names are on the command
//! line; docker and podman read the values from their own environment, so the
//! run token does not show in `ps`. Host paths (`HOME`, `CAIRN_CACHE_DIR`,
//! `CAIRN_PACK_CACHE`) are left out: the template mounts them where it likes
//! and sets them itself.
//! The destroy and wait commands get the same environment without
//! `CAIRN_RUN_TOKEN`.
//!
//! ## Examples
//!
//! (Wrapped for reading: each template is one line, since a newline inside
//! `sh -c "…"` would separate shell commands.)
//!
//! Docker, detached (the runner image ships `cairn-runner`; point
//! `--sandbox-coordinator` at an address the container can reach, e.g.
//! `http://host.docker.internal:7400`; `--init` lets the runner get SIGTERM
//! as it expects):
//!
//! ```text
//! --exec-create  'docker run -d --init --name cairn-{sandbox_id}
//!                 -v {workspace_dir}:/workspace -v {cache_dir}:/cache
//!                 -v {pack_cache}:/pack-cache -e CAIRN_PACK_CACHE=/pack-cache
//!                 -e CAIRN_CACHE_DIR=/cache {env_args} {image} cairn-runner run'
//! --exec-wait    'docker wait cairn-{sandbox_id}'
//! --exec-destroy 'sh -c "docker stop --time {grace_secs} cairn-{sandbox_id}; docker rm -f cairn-{sandbox_id}"'
//! ```
//!
//! Podman (`podman wait` also prints the exit code), as the image tier runs
//! it (tests/e2e/image.rs, README "### Sandboxes"): the same with `podman`
//! plus this machine's settings, which a normal machine leaves out: `--runtime
//! runc --cgroup-manager cgroupfs` (crun refuses the VM's hybrid cgroups; no
//! systemd) and `--network host` (the coordinator on 127.0.0.1), with
//! `CONTAINERS_CONF`/`CONTAINERS_STORAGE_CONF` in the host agent's
//! environment (vfs storage, `default_ulimits = []`; written by
//! scripts/runner-image):
//!
//! ```text
//! --exec-create  'podman --runtime runc --cgroup-manager cgroupfs run -d --init --network host
//!                 --name cairn-{sandbox_id} -v {workspace_dir}:/workspace -v {cache_dir}:/cache
//!                 -e CAIRN_CACHE_DIR=/cache -v {pack_cache}:/pack-cache
//!                 -e CAIRN_PACK_CACHE=/pack-cache {env_args} {image} cairn-runner run'
//! --exec-wait    'podman wait cairn-{sandbox_id}'
//! --exec-destroy 'sh -c "podman stop --time {grace_secs} cairn-{sandbox_id}; podman rm -f cairn-{sandbox_id}"'
//! ```
//!
//! Kubernetes (not run by the tests; the workspace lives in the pod; the
//! runner restores it there; the run token is short-lived and scoped to this
//! attempt's workspace, but it does appear in the pod spec):
//!
//! ```text
//! --exec-create  'sh -c "kubectl run cairn-{sandbox_id} --image={image} --restart=Never
//!                 --env=CAIRN_COORDINATOR=$CAIRN_COORDINATOR --env=CAIRN_RUN_TOKEN=$CAIRN_RUN_TOKEN
//!                 --env=CAIRN_SANDBOX_ID=$CAIRN_SANDBOX_ID -- cairn-runner run"'
//! --exec-wait    'sh -c "until kubectl get pod cairn-{sandbox_id}
//!                 -o jsonpath={{.status.containerStatuses[0].state.terminated.exitCode}} | grep -q .;
//!                 do sleep 2; done; kubectl get pod cairn-{sandbox_id}
//!                 -o jsonpath={{.status.containerStatuses[0].state.terminated.exitCode}}"'
//! --exec-destroy 'kubectl delete pod cairn-{sandbox_id} --grace-period={grace_secs} --ignore-not-found'
//! ```
//!
//! Bubblewrap, foreground (the runner from the host; `/workspace` must exist).
//! Leave out `--die-with-parent`: bwrap dies of the destroy SIGTERM at once,
//! and that option would SIGKILL the runner before it checkpointed; without it
//! the host waits (up to the grace) for the runner, still in the session. The
//! status reported for a destroyed bwrap sandbox is bwrap's (-15).
//!
//! ```text
//! --exec-create 'bwrap --dev-bind / / --bind {workspace_dir} /workspace --chdir /workspace
//!                {runner} run'
//! ```
//!
//! unshare, foreground (as root; util-linux makes the mounts private):
//!
//! ```text
//! --exec-create 'unshare -m sh -c "mount --bind {workspace_dir} /workspace && exec {runner} run"'
//! ```

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::sync::oneshot;

use super::driver::{
    Destroyed, Driver, DriverError, ExitCode, Sandbox, SandboxEvent, SandboxSpec, log_tail,
    open_log,
};
use super::layout::SandboxRecord;
use super::process::{ProcessSandbox, SessionLeader, child_prelude};
use super::template::{Placeholder, Template, TemplateError, Values, is_shell_safe};
use cairn_utils::process::signal_group;
use cairn_utils::process::{describe_exit, exit_code};

/// The variable that carries the attempt's run token.
pub const RUN_TOKEN_VAR: &str = "CAIRN_RUN_TOKEN";

/// Extra time the destroy command gets beyond the grace period.
const DESTROY_SLACK: Duration = Duration::from_secs(60);

/// How long destroy waits for the wait command after the destroy command.
const WAIT_AFTER_DESTROY: Duration = Duration::from_secs(30);

/// How many log lines a failure detail quotes.
const TAIL_LINES: usize = 5;

/// The exec driver's templates, as given on the command line.
#[derive(Debug, Clone, Default)]
pub struct ExecTemplates {
    pub create: String,
    pub destroy: Option<String>,
    pub wait: Option<String>,
}

/// Why the exec driver's configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ExecDriverError {
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(
        "--exec-destroy needs --exec-wait: with a destroy command the create command returns at \
         once, and only a wait command (e.g. 'docker wait cairn-{{sandbox_id}}') tells the host \
         when the sandbox ended"
    )]
    DestroyWithoutWait,
    #[error(
        "--exec-wait needs --exec-destroy: without a destroy command the create command is the \
         sandbox and its exit is the sandbox's end"
    )]
    WaitWithoutDestroy,
    #[error(
        "{what} {value:?} cannot be used in command templates: only letters, digits and {punct} \
         are allowed (placeholders are spliced into commands unquoted)",
        punct = super::template::SAFE_PUNCTUATION
    )]
    UnsafePath { what: &'static str, value: String },
    #[error(
        "a template uses {{pack_cache}}, but the host's pack cache is off (--pack-cache-size 0)"
    )]
    NoPackCache,
}

#[derive(Debug)]
struct Templates {
    create: Template,
    /// Set in detached mode, with the wait template.
    detached: Option<(Template, Template)>,
    runner: String,
    /// The host's pack cache directory (empty when it is off).
    pack_cache: String,
    grace: Duration,
}

/// The `exec` driver.
#[derive(Debug, Clone)]
pub struct ExecDriver {
    templates: Arc<Templates>,
}

impl ExecDriver {
    /// Parses and checks the templates. `data_dir` is where sandbox
    /// directories live; `runner` is what `{runner}` stands for; `pack_cache`
    /// is the host's pack cache directory, if it has one (`{pack_cache}`).
    pub fn new(
        templates: &ExecTemplates,
        runner: &str,
        data_dir: &Path,
        pack_cache: Option<&Path>,
        grace: Duration,
    ) -> Result<Self, ExecDriverError> {
        let create = Template::parse("--exec-create", &templates.create)?;
        let destroy = templates
            .destroy
            .as_deref()
            .map(|t| Template::parse("--exec-destroy", t))
            .transpose()?;
        let wait = templates
            .wait
            .as_deref()
            .map(|t| Template::parse("--exec-wait", t))
            .transpose()?;
        let detached = match (destroy, wait) {
            (Some(destroy), Some(wait)) => Some((destroy, wait)),
            (Some(_), None) => return Err(ExecDriverError::DestroyWithoutWait),
            (None, Some(_)) => return Err(ExecDriverError::WaitWithoutDestroy),
            (None, None) => None,
        };
        let all: Vec<&Template> = std::iter::once(&create)
            .chain(detached.iter().flat_map(|(d, w)| [d, w]))
            .collect();
        let uses = |p: Placeholder| all.iter().any(|t| t.uses(p));
        let dir_placeholders = [
            Placeholder::SandboxDir,
            Placeholder::WorkspaceDir,
            Placeholder::HomeDir,
            Placeholder::CacheDir,
        ];
        let data_dir = data_dir.display().to_string();
        if dir_placeholders.into_iter().any(uses) && !is_shell_safe(&data_dir) {
            return Err(ExecDriverError::UnsafePath {
                what: "--data-dir",
                value: data_dir,
            });
        }
        if uses(Placeholder::Runner) && !is_shell_safe(runner) {
            return Err(ExecDriverError::UnsafePath {
                what: "--runner-bin",
                value: runner.to_owned(),
            });
        }
        let pack_cache = pack_cache.map(|p| p.display().to_string());
        if uses(Placeholder::PackCache) {
            match &pack_cache {
                None => return Err(ExecDriverError::NoPackCache),
                Some(dir) if !is_shell_safe(dir) => {
                    return Err(ExecDriverError::UnsafePath {
                        what: "--pack-cache",
                        value: dir.clone(),
                    });
                }
                Some(_) => {}
            }
        }
        Ok(Self {
            templates: Arc::new(Templates {
                create,
                detached,
                runner: runner.to_owned(),
                pack_cache: pack_cache.unwrap_or_default(),
                grace,
            }),
        })
    }

    /// Whether sandboxes are detached (a destroy command exists).
    pub fn is_detached(&self) -> bool {
        self.templates.detached.is_some()
    }
}

impl Templates {
    fn values(&self, spec: &SandboxSpec) -> Values {
        let path = |p: &Path| p.display().to_string();
        Values {
            sandbox_id: spec.sandbox_id.clone(),
            sandbox_dir: path(&spec.paths.dir),
            workspace_dir: path(&spec.paths.workspace),
            home_dir: path(&spec.paths.home),
            cache_dir: path(&spec.paths.cache),
            pack_cache: self.pack_cache.clone(),
            image: spec.image.clone(),
            runner: self.runner.clone(),
            run_id: spec.run_id.clone(),
            attempt: spec.attempt,
            grace_secs: self.grace.as_secs() + u64::from(self.grace.subsec_nanos() > 0),
            env_names: spec
                .env
                .iter()
                .filter(|v| v.portable)
                .map(|v| v.name.clone())
                .collect(),
        }
    }

    /// A command for `template`, in a session of its own, output to the log.
    fn command(
        &self,
        template: &Template,
        spec: &SandboxSpec,
        with_token: bool,
    ) -> Result<(tokio::process::Command, String), DriverError> {
        let argv = template.render(&self.values(spec))?;
        let (stdout, stderr) = open_log(&spec.log_file)?;
        let mut command = tokio::process::Command::new(&argv[0]);
        command
            .args(&argv[1..])
            .env_remove("CAIRN_TOKEN")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        for var in spec
            .env
            .iter()
            .filter(|v| with_token || v.name != RUN_TOKEN_VAR)
        {
            command.env(&var.name, &var.value);
        }
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: child_prelude makes only async-signal-safe syscalls.
        unsafe {
            command.pre_exec(move || child_prelude(parent));
        }
        Ok((command, argv[0].clone()))
    }

    fn spawn(
        &self,
        template: &Template,
        spec: &SandboxSpec,
        with_token: bool,
    ) -> Result<SessionLeader, DriverError> {
        let (mut command, program) = self.command(template, spec, with_token)?;
        let spawn_error = |source| DriverError::Spawn {
            program: program.clone(),
            source,
        };
        let child = command.spawn().map_err(spawn_error)?;
        SessionLeader::from_child(child).map_err(spawn_error)
    }

    /// Starts the wait command; its verdict arrives on the returned channel.
    fn spawn_wait(&self, wait: &Template, spec: &SandboxSpec) -> Result<WaitCommand, DriverError> {
        let (mut command, program) = self.command(wait, spec, false)?;
        command.stdout(Stdio::piped());
        let mut child = command
            .spawn()
            .map_err(|source| DriverError::Spawn { program, source })?;
        let pid = child.id().map(|p| p as i32);
        let mut stdout = child.stdout.take().expect("stdout is piped");
        let (tx, rx) = oneshot::channel();
        tokio::spawn(async move {
            let mut printed = Vec::new();
            let _ = stdout.read_to_end(&mut printed).await;
            let status = child.wait().await.ok().map(exit_code);
            let text = String::from_utf8_lossy(&printed);
            let reported = text
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .and_then(|l| l.trim().parse::<i32>().ok());
            let _ = tx.send(reported.or(status));
        });
        Ok(WaitCommand { pid, verdict: rx })
    }

    /// Runs the destroy command to its end (bounded); returns what happened.
    async fn run_destroy(&self, destroy: &Template, spec: &SandboxSpec) -> Result<(), String> {
        let mut leader = self
            .spawn(destroy, spec, false)
            .map_err(|e| e.to_string())?;
        match tokio::time::timeout(self.grace + DESTROY_SLACK, leader.wait()).await {
            Ok(Some(0)) => Ok(()),
            Ok(code) => Err(format!("the destroy command {}", describe_exit(code))),
            Err(_) => {
                leader.terminate(Duration::from_secs(5)).await;
                Err(format!(
                    "the destroy command did not finish within {:?}",
                    self.grace + DESTROY_SLACK
                ))
            }
        }
    }
}

impl Driver for ExecDriver {
    type Sandbox = ExecSandbox;

    fn kind(&self) -> &'static str {
        "exec"
    }

    fn start(&self, spec: &SandboxSpec) -> Result<ExecSandbox, DriverError> {
        let leader = self.templates.spawn(&self.templates.create, spec, true)?;
        Ok(match self.templates.detached {
            None => ExecSandbox::Foreground(ProcessSandbox::new(leader)),
            Some(_) => ExecSandbox::Detached(Detached {
                templates: self.templates.clone(),
                spec: spec.clone(),
                phase: Phase::Creating(leader),
            }),
        })
    }

    fn adopt(&self, spec: &SandboxSpec, record: &SandboxRecord) -> Option<ExecSandbox> {
        if !record.detached {
            return ProcessSandbox::adopt(record).map(ExecSandbox::Foreground);
        }
        let (_, wait) = self.templates.detached.as_ref()?;
        let waiter = match self.templates.spawn_wait(wait, spec) {
            Ok(waiter) => waiter,
            Err(e) => {
                tracing::warn!(sandbox = %spec.sandbox_id, error = %e, "cannot start the wait command");
                return None;
            }
        };
        Some(ExecSandbox::Detached(Detached {
            templates: self.templates.clone(),
            spec: spec.clone(),
            phase: Phase::Up(waiter),
        }))
    }
}

/// A sandbox of the exec driver.
#[derive(Debug)]
pub enum ExecSandbox {
    Foreground(ProcessSandbox),
    Detached(Detached),
}

/// A sandbox whose create command returned; a wait command watches it.
#[derive(Debug)]
pub struct Detached {
    templates: Arc<Templates>,
    spec: SandboxSpec,
    phase: Phase,
}

#[derive(Debug)]
enum Phase {
    Creating(SessionLeader),
    Up(WaitCommand),
    Ended,
}

#[derive(Debug)]
struct WaitCommand {
    pid: Option<i32>,
    verdict: oneshot::Receiver<ExitCode>,
}

impl Detached {
    async fn next_event(&mut self) -> SandboxEvent {
        match &mut self.phase {
            Phase::Creating(create) => {
                let code = create.wait().await;
                if code != Some(0) {
                    self.phase = Phase::Ended;
                    let tail = log_tail(&self.spec.log_file, TAIL_LINES);
                    return SandboxEvent::Failed(format!(
                        "the create command {}: {tail}",
                        describe_exit(code)
                    ));
                }
                let (_, wait) = self
                    .templates
                    .detached
                    .as_ref()
                    .expect("a detached sandbox has a wait template");
                match self.templates.spawn_wait(wait, &self.spec) {
                    Ok(waiter) => {
                        self.phase = Phase::Up(waiter);
                        SandboxEvent::Up
                    }
                    Err(e) => {
                        self.phase = Phase::Ended;
                        SandboxEvent::Failed(format!(
                            "the sandbox was created but cannot be watched: {e}"
                        ))
                    }
                }
            }
            Phase::Up(waiter) => {
                let code = (&mut waiter.verdict).await.unwrap_or(None);
                self.phase = Phase::Ended;
                SandboxEvent::Ended(code)
            }
            Phase::Ended => std::future::pending().await,
        }
    }

    async fn destroy(&mut self, grace: Duration) -> Destroyed {
        let mut notes = Vec::new();
        if let Phase::Creating(create) = &mut self.phase {
            let terminated = create.terminate(grace).await;
            notes.push(format!("create command {}", terminated.describe(grace)));
        }
        let (destroy, _) = self
            .templates
            .detached
            .as_ref()
            .expect("a detached sandbox has a destroy template");
        match self.templates.run_destroy(destroy, &self.spec).await {
            Ok(()) => notes.push("destroy command succeeded".to_owned()),
            Err(e) => notes.push(e),
        }
        let mut exit_code = None;
        if let Phase::Up(waiter) = &mut self.phase {
            match tokio::time::timeout(WAIT_AFTER_DESTROY, &mut waiter.verdict).await {
                Ok(verdict) => exit_code = verdict.unwrap_or(None),
                Err(_) => {
                    if let Some(pid) = waiter.pid {
                        signal_group(pid, libc::SIGKILL);
                    }
                    notes.push(format!(
                        "the wait command did not return within {WAIT_AFTER_DESTROY:?}"
                    ));
                }
            }
        }
        self.phase = Phase::Ended;
        notes.push(format!("sandbox {}", describe_exit(exit_code)));
        Destroyed {
            exit_code,
            detail: notes.join("; "),
        }
    }

    async fn release(&mut self) {
        let (destroy, _) = self
            .templates
            .detached
            .as_ref()
            .expect("a detached sandbox has a destroy template");
        if let Err(e) = self.templates.run_destroy(destroy, &self.spec).await {
            tracing::debug!(sandbox = %self.spec.sandbox_id, "after the sandbox ended: {e}");
        }
    }
}

impl Sandbox for ExecSandbox {
    fn leader(&self) -> Option<(i32, u64)> {
        match self {
            Self::Foreground(sandbox) => sandbox.leader(),
            Self::Detached(_) => None,
        }
    }

    fn detached(&self) -> bool {
        matches!(self, Self::Detached(_))
    }

    async fn next_event(&mut self) -> SandboxEvent {
        match self {
            Self::Foreground(sandbox) => sandbox.next_event().await,
            Self::Detached(sandbox) => sandbox.next_event().await,
        }
    }

    async fn destroy(&mut self, grace: Duration) -> Destroyed {
        match self {
            Self::Foreground(sandbox) => sandbox.destroy(grace).await,
            Self::Detached(sandbox) => sandbox.destroy(grace).await,
        }
    }

    async fn release(&mut self) {
        match self {
            Self::Foreground(sandbox) => sandbox.release().await,
            Self::Detached(sandbox) => sandbox.release().await,
        }
    }
}
