//! The `local` driver: each sandbox is a `cairn-runner run` process in a
//! mount namespace of its own, where the sandbox's directory is bind-mounted
//! at `/workspace`.
//!
//! Between fork and exec (only async-signal-safe syscalls there) the child:
//!
//! 1. leads a new session (`setsid`), so destroy can signal all of it;
//! 2. enters a new mount namespace — as root `unshare(CLONE_NEWNS)`; otherwise
//!    `unshare(CLONE_NEWUSER | CLONE_NEWNS)` with its own uid and gid mapped
//!    to themselves (`setgroups` denied first, as the kernel requires);
//! 3. makes every mount private (`MS_REC | MS_PRIVATE` on `/`), so nothing it
//!    mounts propagates back to the host;
//! 4. bind-mounts `DIR/sandboxes/<id>/workspace` at `/workspace` and changes
//!    into it;
//! 5. arms `PR_SET_PDEATHSIG(SIGTERM)` (after the namespace change, which
//!    could reset it) and checks the agent is still its parent.
//!
//! Every sandbox sees the same `/workspace`, so harness state keyed by the
//! working directory (Claude Code's project slug) is identical on every host.
//! The rest of the file system is the host's; the sandbox is about the
//! workspace path and process lifetime, not a security boundary against the
//! agent (use the exec driver with a container runtime for that).
//!
//! The host's `/workspace` is only a mount point. As root the driver creates
//! it (empty) when missing; without root it must already exist, since an
//! unprivileged process cannot create it.
//!
//! At startup the driver probes which way works by forking a child that goes
//! through the same steps with a scratch directory and checks a marker file
//! is visible at `/workspace`. If neither way works it refuses to start and
//! says what to do.
//!
//! The runner's environment is cleared except [`PASSTHROUGH`] variables, then
//! gets the sandbox's variables (the host token never reaches it).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use super::driver::{Driver, DriverError, SandboxSpec, open_log};
use super::layout::{SandboxRecord, remove_tree};
use super::process::{ProcessSandbox, SessionLeader, arm_parent_death_signal, new_session};

/// Where every sandbox sees its workspace.
pub const MOUNT_POINT: &str = "/workspace";

/// Host variables the runner inherits; `--env` may override them.
pub const PASSTHROUGH: &[&str] = &[
    "PATH",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "RUST_LOG",
    "RUST_BACKTRACE",
    "CAIRN_LOG_FORMAT",
];

/// Name of the file the probe looks for through the bind mount.
const PROBE_MARKER: &str = "cairn-namespace-probe";

/// How the driver gets a private mount namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NamespaceMode {
    /// `unshare(CLONE_NEWNS)`: needs CAP_SYS_ADMIN (root).
    Root,
    /// `unshare(CLONE_NEWUSER | CLONE_NEWNS)`: an unprivileged user namespace.
    UserNamespace,
}

impl NamespaceMode {
    fn describe(self) -> &'static str {
        match self {
            Self::Root => "as root (mount namespace)",
            Self::UserNamespace => "with an unprivileged user namespace",
        }
    }
}

/// Why the local driver cannot run.
#[derive(Debug, thiserror::Error)]
pub enum LocalDriverError {
    #[error("runner binary {}: {reason} (point --runner-bin at cairn-runner)", path.display())]
    Runner { path: PathBuf, reason: String },
    #[error(
        "the local driver cannot give sandboxes a private /workspace: {attempts}. Run cairn-host as \
         root, enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 and \
         user.max_user_namespaces > 0, and no AppArmor/seccomp rule forbidding them), or use \
         --driver exec"
    )]
    NoNamespaces { attempts: String },
    #[error("cannot prepare the namespace probe in {}: {source}", path.display())]
    Probe { path: PathBuf, source: io::Error },
}

/// The `local` driver.
#[derive(Debug, Clone)]
pub struct LocalDriver {
    runner_bin: PathBuf,
    mode: NamespaceMode,
}

impl LocalDriver {
    /// Checks the runner binary and probes for a way to make mount
    /// namespaces (root first when running as root, then a user namespace).
    /// `scratch` is a directory the probe may use (the data directory).
    pub fn new(runner_bin: &Path, scratch: &Path) -> Result<Self, LocalDriverError> {
        // SAFETY: geteuid takes no arguments.
        let modes: &[NamespaceMode] = if unsafe { libc::geteuid() } == 0 {
            &[NamespaceMode::Root, NamespaceMode::UserNamespace]
        } else {
            &[NamespaceMode::UserNamespace]
        };
        let mut failures = Vec::new();
        for &mode in modes {
            match Self::with_mode(runner_bin, scratch, mode) {
                Ok(driver) => return Ok(driver),
                Err(LocalDriverError::NoNamespaces { attempts }) => failures.push(attempts),
                Err(e) => return Err(e),
            }
        }
        if modes.len() == 1 {
            failures.push("not running as root".to_owned());
        }
        Err(LocalDriverError::NoNamespaces {
            attempts: failures.join("; "),
        })
    }

    /// Like [`LocalDriver::new`] with one way of making namespaces only.
    pub fn with_mode(
        runner_bin: &Path,
        scratch: &Path,
        mode: NamespaceMode,
    ) -> Result<Self, LocalDriverError> {
        check_runner(runner_bin)?;
        probe(mode, scratch)?;
        tracing::info!(runner = %runner_bin.display(), "local driver: sandboxes get /workspace {}", mode.describe());
        Ok(Self {
            runner_bin: runner_bin.to_owned(),
            mode,
        })
    }

    pub fn mode(&self) -> NamespaceMode {
        self.mode
    }
}

fn check_runner(path: &Path) -> Result<(), LocalDriverError> {
    let reason = match std::fs::metadata(path) {
        Err(e) => e.to_string(),
        Ok(meta) if !meta.is_file() => "is not a file".to_owned(),
        Ok(meta) if meta.permissions().mode() & 0o111 == 0 => "is not executable".to_owned(),
        Ok(_) => return Ok(()),
    };
    Err(LocalDriverError::Runner {
        path: path.to_owned(),
        reason,
    })
}

/// A step of entering the sandbox's namespace, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Step {
    Unshare = 1,
    DenySetgroups,
    MapUid,
    MapGid,
    MakePrivate,
    BindWorkspace,
    EnterWorkspace,
    SeeMarker,
}

impl Step {
    fn from_u8(v: u8) -> Option<Self> {
        [
            Self::Unshare,
            Self::DenySetgroups,
            Self::MapUid,
            Self::MapGid,
            Self::MakePrivate,
            Self::BindWorkspace,
            Self::EnterWorkspace,
            Self::SeeMarker,
        ]
        .into_iter()
        .find(|s| *s as u8 == v)
    }

    fn describe(self, mode: NamespaceMode) -> &'static str {
        match (self, mode) {
            (Self::Unshare, NamespaceMode::Root) => "unshare(CLONE_NEWNS) failed",
            (Self::Unshare, NamespaceMode::UserNamespace) => {
                "unshare(CLONE_NEWUSER|CLONE_NEWNS) failed"
            }
            (Self::DenySetgroups, _) => "writing /proc/self/setgroups failed",
            (Self::MapUid, _) => "writing /proc/self/uid_map failed",
            (Self::MapGid, _) => "writing /proc/self/gid_map failed",
            (Self::MakePrivate, _) => "making mounts private failed",
            (Self::BindWorkspace, _) => "bind-mounting onto /workspace failed",
            (Self::EnterWorkspace, _) => "changing into /workspace failed",
            (Self::SeeMarker, _) => "the bind mount was not visible at /workspace",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct SetupError {
    step: Step,
    errno: i32,
}

/// The syscall arguments of entering a sandbox, prepared before the fork so
/// the child allocates nothing.
struct NamespacePlan {
    mode: NamespaceMode,
    source: CString,
    target: CString,
    uid_map: Vec<u8>,
    gid_map: Vec<u8>,
}

impl NamespacePlan {
    fn new(mode: NamespaceMode, workspace: &Path) -> io::Result<Self> {
        let source = CString::new(workspace.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
        // SAFETY: getuid/getgid take no arguments.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        Ok(Self {
            mode,
            source,
            target: CString::new(MOUNT_POINT).expect("no NUL in a constant"),
            uid_map: format!("{uid} {uid} 1\n").into_bytes(),
            gid_map: format!("{gid} {gid} 1\n").into_bytes(),
        })
    }

    /// Enters a new mount namespace with the workspace at /workspace.
    ///
    /// # Safety
    /// Call only in a freshly forked, single-threaded child before exec: it
    /// changes the calling process's namespaces and uses raw syscalls only.
    unsafe fn enter(&self) -> Result<(), SetupError> {
        let fail = |step| SetupError {
            step,
            errno: io::Error::last_os_error().raw_os_error().unwrap_or(0),
        };
        // SAFETY: every pointer below comes from a CString or slice that lives
        // in `self` for the duration of the call.
        unsafe {
            match self.mode {
                NamespaceMode::Root => {
                    if libc::unshare(libc::CLONE_NEWNS) < 0 {
                        return Err(fail(Step::Unshare));
                    }
                }
                NamespaceMode::UserNamespace => {
                    if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) < 0 {
                        return Err(fail(Step::Unshare));
                    }
                    write_proc_file(c"/proc/self/setgroups", b"deny")
                        .map_err(|_| fail(Step::DenySetgroups))?;
                    write_proc_file(c"/proc/self/uid_map", &self.uid_map)
                        .map_err(|_| fail(Step::MapUid))?;
                    write_proc_file(c"/proc/self/gid_map", &self.gid_map)
                        .map_err(|_| fail(Step::MapGid))?;
                }
            }
            let none = c"none".as_ptr();
            let no_data = std::ptr::null();
            if libc::mount(
                none,
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                no_data,
            ) < 0
            {
                return Err(fail(Step::MakePrivate));
            }
            let bind = libc::MS_BIND | libc::MS_REC;
            if libc::mount(
                self.source.as_ptr(),
                self.target.as_ptr(),
                std::ptr::null(),
                bind,
                no_data,
            ) < 0
            {
                return Err(fail(Step::BindWorkspace));
            }
            if libc::chdir(self.target.as_ptr()) < 0 {
                return Err(fail(Step::EnterWorkspace));
            }
        }
        Ok(())
    }
}

/// open + write + close, all async-signal-safe.
///
/// # Safety
/// Only raw syscalls; `path` and `bytes` must be valid for the call.
unsafe fn write_proc_file(path: &std::ffi::CStr, bytes: &[u8]) -> Result<(), ()> {
    // SAFETY: valid NUL-terminated path and a live buffer of the given length.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(());
        }
        let written = libc::write(fd, bytes.as_ptr().cast(), bytes.len());
        libc::close(fd);
        if written != bytes.len() as isize {
            Err(())
        } else {
            Ok(())
        }
    }
}

/// Forks a child that enters a sandbox namespace with a scratch workspace and
/// checks a marker file shows at /workspace.
fn probe(mode: NamespaceMode, scratch: &Path) -> Result<(), LocalDriverError> {
    let probe_dir = scratch.join(format!("namespace-probe-{}", std::process::id()));
    let prepare = || -> io::Result<()> {
        remove_tree(&probe_dir).map_err(io::Error::other)?;
        std::fs::create_dir_all(&probe_dir)?;
        std::fs::write(probe_dir.join(PROBE_MARKER), b"")
    };
    prepare().map_err(|source| LocalDriverError::Probe {
        path: probe_dir.clone(),
        source,
    })?;
    let result = prepare_mount_point(mode).and_then(|()| fork_probe(mode, &probe_dir));
    if let Err(e) = remove_tree(&probe_dir) {
        tracing::warn!(error = %e, "cannot remove the namespace probe directory");
    }
    result.map_err(|reason| LocalDriverError::NoNamespaces {
        attempts: format!("{}: {reason}", mode.describe()),
    })
}

/// Makes sure /workspace exists (creating it needs root).
fn prepare_mount_point(mode: NamespaceMode) -> Result<(), String> {
    match std::fs::symlink_metadata(MOUNT_POINT) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => Err(format!("{MOUNT_POINT} exists but is not a directory")),
        Err(e) if e.kind() == io::ErrorKind::NotFound && mode == NamespaceMode::Root => {
            std::fs::create_dir(MOUNT_POINT)
                .or_else(|e| {
                    if e.kind() == io::ErrorKind::AlreadyExists {
                        Ok(())
                    } else {
                        Err(e)
                    }
                })
                .map_err(|e| format!("cannot create the mount point {MOUNT_POINT}: {e}"))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(format!(
            "{MOUNT_POINT} does not exist and only root can create it (create it once, empty: it \
             is only a mount point)"
        )),
        Err(e) => Err(format!("cannot inspect {MOUNT_POINT}: {e}")),
    }
}

fn fork_probe(mode: NamespaceMode, probe_dir: &Path) -> Result<(), String> {
    let plan = NamespacePlan::new(mode, probe_dir).map_err(|e| e.to_string())?;
    let marker =
        CString::new(format!("{MOUNT_POINT}/{PROBE_MARKER}")).expect("no NUL in a constant");
    let mut fds = [0; 2];
    // SAFETY: fds is a valid array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(format!("pipe: {}", io::Error::last_os_error()));
    }
    let [read_fd, write_fd] = fds;
    // SAFETY: the child runs only async-signal-safe syscalls on data prepared
    // above and leaves with _exit; the parent closes and waits as usual.
    unsafe {
        let pid = libc::fork();
        if pid < 0 {
            let err = io::Error::last_os_error();
            libc::close(read_fd);
            libc::close(write_fd);
            return Err(format!("fork: {err}"));
        }
        if pid == 0 {
            libc::close(read_fd);
            let outcome = plan.enter().and_then(|()| {
                if libc::access(marker.as_ptr(), libc::F_OK) == 0 {
                    Ok(())
                } else {
                    Err(SetupError {
                        step: Step::SeeMarker,
                        errno: io::Error::last_os_error().raw_os_error().unwrap_or(0),
                    })
                }
            });
            if let Err(e) = outcome {
                let mut msg = [0u8; 5];
                msg[0] = e.step as u8;
                msg[1..].copy_from_slice(&e.errno.to_ne_bytes());
                libc::write(write_fd, msg.as_ptr().cast(), msg.len());
                libc::_exit(1);
            }
            libc::_exit(0);
        }
        libc::close(write_fd);
        let mut msg = [0u8; 5];
        let n = libc::read(read_fd, msg.as_mut_ptr().cast(), msg.len());
        libc::close(read_fd);
        let mut status = 0;
        while libc::waitpid(pid, &mut status, 0) < 0
            && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
        {}
        if n == msg.len() as isize {
            let errno = i32::from_ne_bytes(msg[1..].try_into().expect("four bytes"));
            let step = Step::from_u8(msg[0])
                .map_or("setting up the namespace failed", |s| s.describe(mode));
            return Err(format!("{step}: {}", io::Error::from_raw_os_error(errno)));
        }
        if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
            return Err(format!("the probe process failed (wait status {status})"));
        }
    }
    Ok(())
}

impl Driver for LocalDriver {
    type Sandbox = ProcessSandbox;

    fn kind(&self) -> &'static str {
        "local"
    }

    fn start(&self, spec: &SandboxSpec) -> Result<ProcessSandbox, DriverError> {
        let program = self.runner_bin.display().to_string();
        let spawn_error = |source| DriverError::Spawn {
            program: program.clone(),
            source,
        };
        let plan = NamespacePlan::new(self.mode, &spec.paths.workspace).map_err(spawn_error)?;
        let (stdout, stderr) = open_log(&spec.log_file)?;

        let mut command = tokio::process::Command::new(&self.runner_bin);
        command
            .arg("run")
            .env_clear()
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        for name in PASSTHROUGH {
            if let Some(value) = std::env::var_os(name) {
                command.env(name, value);
            }
        }
        for var in &spec.env {
            command.env(&var.name, &var.value);
        }
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure makes only async-signal-safe syscalls on data
        // prepared before the fork (see NamespacePlan::enter).
        unsafe {
            command.pre_exec(move || {
                new_session()?;
                plan.enter()
                    .map_err(|e| io::Error::from_raw_os_error(e.errno))?;
                arm_parent_death_signal(parent)
            });
        }
        let child = command.spawn().map_err(spawn_error)?;
        Ok(ProcessSandbox::new(
            SessionLeader::from_child(child).map_err(spawn_error)?,
        ))
    }

    fn adopt(&self, _spec: &SandboxSpec, record: &SandboxRecord) -> Option<ProcessSandbox> {
        ProcessSandbox::adopt(record)
    }
}
