//! Shared pieces of the host agent's integration tests: a stand-in for
//! `cairn-runner run` (a shell script that records what it saw), and waiting
//! helpers.
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cairn_host::driver::{EnvVar, SandboxSpec};
use cairn_host::layout::Layout;
use cairn_host::sandbox::sandbox_env;

/// How long any wait in these tests may take before the test fails.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// The stand-in runner. It records its environment, cwd, uid and what it sees
/// at the workspace, writes `x` there and a symlink pointing out of the
/// sandbox, then behaves per STANDIN_MODE (or the file `<report>/<sandbox id>.mode`):
/// - trap:   on SIGTERM records it and exits 0 (a runner that checkpoints);
/// - ignore: ignores SIGTERM (must be SIGKILLed after the grace);
/// - orphan: like trap, but first leaves a process in another process group;
/// - exit:   exits with STANDIN_EXIT (default 3) at once;
/// - signal: kills itself with SIGUSR1.
pub const STANDIN: &str = r#"#!/bin/sh
set -u
report="$STANDIN_REPORT/$CAIRN_SANDBOX_ID"
ws="${STANDIN_WORKSPACE:-/workspace}"
[ "$1" = run ] || { echo "stand-in: expected 'run', got '$*'" >&2; exit 64; }
env > "$report.env"
pwd > "$report.pwd"
id -u > "$report.uid"
echo "$CAIRN_SANDBOX_ID" > "$ws/x"
ln -s "$STANDIN_REPORT" "$ws/escape"
ls -A "$ws" > "$report.seen"
mode="${STANDIN_MODE:-trap}"
[ -f "$report.mode" ] && mode="$(cat "$report.mode")"
case "$mode" in
  trap)   trap 'echo TERM > "$report.term"; exit 0' TERM ;;
  ignore) trap '' TERM ;;
  orphan) trap 'echo TERM > "$report.term"; exit 0' TERM
          /usr/bin/python3 -c 'import os, sys, time
os.setpgid(0, 0)
with open(sys.argv[1] + ".tmp", "w") as f: f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(1000)' "$report.orphan" &
          while [ ! -e "$report.orphan" ]; do sleep 0.02; done ;;
  exit)   echo "stand-in failing on purpose" >&2; exit "${STANDIN_EXIT:-3}" ;;
  signal) kill -USR1 $$ ;;
esac
touch "$report.ready"
while :; do sleep 0.05; done
"#;

/// A scratch area: a data directory, a report directory the stand-in writes
/// to, and the stand-in script.
pub struct Scratch {
    pub tmp: tempfile::TempDir,
    pub layout: Layout,
    pub report: PathBuf,
    pub standin: PathBuf,
}

impl Scratch {
    pub fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        // Readable by other users too: some tests run the agent as nobody.
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let layout = Layout::open(&tmp.path().join("data")).unwrap();
        let report = tmp.path().join("report");
        fs::create_dir(&report).unwrap();
        fs::set_permissions(&report, fs::Permissions::from_mode(0o777)).unwrap();
        let standin = tmp.path().join("standin-runner");
        fs::write(&standin, STANDIN).unwrap();
        fs::set_permissions(&standin, fs::Permissions::from_mode(0o755)).unwrap();
        Self {
            tmp,
            layout,
            report,
            standin,
        }
    }

    /// The host's pack cache the specs name.
    pub fn pack_cache(&self) -> cairn_engine::restore::PackCacheConfig {
        cairn_engine::restore::PackCacheConfig {
            dir: self.layout.root().join("pack-cache"),
            max_bytes: 1 << 30,
        }
    }

    /// A spec for sandbox `id` with fresh directories and the stand-in's settings.
    pub fn spec(&self, id: &str, mode: &str, extra: &[(&str, &str)]) -> SandboxSpec {
        let paths = self.layout.create_sandbox_dirs(id).unwrap();
        let mut extras: Vec<(String, String)> = vec![
            ("STANDIN_REPORT".into(), self.report.display().to_string()),
            ("STANDIN_MODE".into(), mode.into()),
        ];
        extras.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let env: Vec<EnvVar> = sandbox_env(
            "http://127.0.0.1:9",
            &format!("token-of-{id}"),
            id,
            &paths,
            Some(&self.pack_cache()),
            None,
            &extras,
        );
        SandboxSpec {
            sandbox_id: id.into(),
            run_id: format!("run-{id}"),
            attempt: 1,
            image: String::new(),
            paths,
            env,
            log_file: self.layout.log_file(id),
        }
    }

    pub fn report_file(&self, id: &str, what: &str) -> PathBuf {
        self.report.join(format!("{id}.{what}"))
    }

    pub fn read_report(&self, id: &str, what: &str) -> String {
        let path = self.report_file(id, what);
        fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }
}

/// Waits until `path` exists.
pub async fn wait_for_file(path: &Path) {
    wait_until(&format!("{} to appear", path.display()), || path.exists()).await;
}

/// Polls `done` until it holds.
pub async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "gave up waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether a process with this pid is still running (not gone, not a zombie).
pub fn alive(pid: i32) -> bool {
    cairn_utils::process::read_stat(pid).is_some_and(|s| s.state != 'Z')
}

/// A local driver; the tests that use one need root or unprivileged user
/// namespaces, and fail saying so where neither is available.
pub fn local_driver(scratch: &Scratch) -> cairn_host::LocalDriver {
    cairn_host::LocalDriver::new(&scratch.standin, scratch.layout.root()).unwrap_or_else(|e| {
        panic!("the local driver cannot run here (needs root or user namespaces): {e}")
    })
}

/// Whether this kernel lets the given command line (a user and mount
/// namespace, perhaps as another user) be made: probed with util-linux
/// `unshare`, independently of cairn's code, so a test can tell "cairn
/// refused as it should" from "cairn is broken".
pub fn user_namespaces_work(prefix: &[&str]) -> bool {
    let (program, args) = match prefix.split_first() {
        Some((program, args)) => (*program, args.to_vec()),
        None => ("unshare", Vec::new()),
    };
    let mut command = std::process::Command::new(program);
    command.args(&args);
    if !prefix.is_empty() {
        command.arg("unshare");
    }
    command
        .args(["--user", "--map-root-user", "--mount", "true"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether the test runs as root (some tests need to change users or mount).
pub fn is_root() -> bool {
    // SAFETY: geteuid takes no arguments.
    unsafe { libc::geteuid() == 0 }
}
