//! For tests that start another package's binary, or a real S3-compatible
//! server ([`S3sFs`]), or Azure's storage emulator ([`Azurite`]), or keep a
//! coordinator's metadata in PostgreSQL ([`test_database`]), or read a
//! `/metrics` scrape with Prometheus' own parser ([`parse_prometheus`]).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The PostgreSQL database `CAIRN_TEST_DATABASE` names (a `postgres://`
/// URL), and the schema the coordinator of `data_dir` keeps its metadata in
/// there: one per data directory, the same after a restart. `None` when the
/// variable is unset: the coordinator uses the SQLite file of its data dir.
pub fn test_database(data_dir: &Path) -> Option<(String, String)> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let url = std::env::var("CAIRN_TEST_DATABASE")
        .ok()
        .filter(|u| !u.is_empty())?;
    let mut hasher = DefaultHasher::new();
    data_dir.hash(&mut hasher);
    Some((url, format!("t_{:016x}", hasher.finish())))
}

/// The binary `name` built by `cargo build --workspace --bins` (scripts/test
/// runs it) in this test's profile directory. Cargo builds only the calling
/// package's own binaries for its tests, so a test that needs another
/// package's finds it next to the test executable's `deps` directory, and
/// fails (never skips) when it is not there.
pub fn sibling_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable has a path");
    let mut dir = exe
        .parent()
        .expect("the test executable is in a directory")
        .to_path_buf();
    // Test executables live in target/<profile>/deps; binaries one level up.
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build --workspace --bins` first (scripts/test does)",
        path.display()
    );
    path
}

/// How to get `s3s-fs`, for the message of a test that cannot find it.
pub const S3S_FS_INSTALL: &str = "cargo install s3s-fs --version 0.14.1 --features binary --locked";

/// A test server's program: the path in `var`, else the first `name` on
/// `PATH`. Fails (never skips) when there is none, saying how to install
/// it with `install`.
fn test_program(name: &str, var: &str, install: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(var) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "{var}={} is not a file; install {name} with `{install}`",
            path.display()
        );
        return path;
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "{name} is needed by the object store tests and is not on PATH (or in {var}): install it with `{install}`"
        )
    })
}

/// Starts `command` (stdout piped) and waits for the first line of its
/// output holding `marker`, returning the word after it (the address it
/// listens at). Its output is read to the end meanwhile, so a chatty
/// server never blocks on a full pipe.
fn start_and_read_address(
    mut command: Command,
    name: &str,
    install: &str,
    marker: &'static str,
) -> (Child, String) {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("{name} does not start ({e}); install it with `{install}`"));
    let stdout = child.stdout.take().expect("stdout is piped");
    let (found, address) = mpsc::channel();
    std::thread::spawn(move || {
        let mut found = Some(found);
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(at) = line.find(marker)
                && let Some(sender) = found.take()
            {
                let rest = &line[at + marker.len()..];
                let word = rest.split_whitespace().next().unwrap_or_default();
                let _ = sender.send(word.to_owned());
            }
        }
    });
    match address.recv_timeout(Duration::from_secs(60)) {
        Ok(address) if address.starts_with("http://127.0.0.1:") => (child, address),
        other => {
            let _ = child.kill();
            let status = child.wait().ok();
            panic!(
                "{name} did not say it listens on 127.0.0.1 within 60s ({other:?}; exit status: {status:?})"
            );
        }
    }
}

/// The `s3s-fs` binary: `CAIRN_S3S_FS`, else the first `s3s-fs` on `PATH`.
pub fn s3s_fs_binary() -> PathBuf {
    test_program("s3s-fs", "CAIRN_S3S_FS", S3S_FS_INSTALL)
}

/// A real S3-compatible server: `s3s-fs` on 127.0.0.1 (an ephemeral port),
/// serving a directory of the caller's, checking SigV4 signatures with one
/// access key. Killed when dropped.
#[derive(Debug)]
pub struct S3sFs {
    child: Child,
    endpoint: String,
    root: PathBuf,
}

impl S3sFs {
    pub const ACCESS_KEY: &str = "cairn-test-access-key";
    pub const SECRET_KEY: &str = "cairn-test-secret-key-do-not-use";
    pub const REGION: &str = "us-east-1";

    /// Starts `s3s-fs` on `root` (an empty directory the caller owns) with
    /// the buckets `buckets` (directories under the root, which is what a
    /// bucket is to s3s-fs).
    pub fn start(root: &Path, buckets: &[&str]) -> Self {
        for bucket in buckets {
            std::fs::create_dir_all(root.join(bucket)).expect("bucket directories can be created");
        }
        let mut command = Command::new(s3s_fs_binary());
        command
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(["--access-key", Self::ACCESS_KEY])
            .args(["--secret-key", Self::SECRET_KEY])
            .arg(root)
            // Its address is only in its log; info is where it says it.
            .env("RUST_LOG", "s3s_fs=info")
            .env("NO_COLOR", "1");
        let (child, endpoint) =
            start_and_read_address(command, "s3s-fs", S3S_FS_INSTALL, "server is running at ");
        Self {
            child,
            endpoint,
            root: root.to_owned(),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The file that holds `key` of `bucket`.
    pub fn object_path(&self, bucket: &str, key: &str) -> PathBuf {
        self.root.join(bucket).join(key)
    }

    /// The AWS variables that point a coordinator at this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".to_owned()),
            ("AWS_REGION", Self::REGION.to_owned()),
            ("AWS_ACCESS_KEY_ID", Self::ACCESS_KEY.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", Self::SECRET_KEY.to_owned()),
        ]
    }
}

impl Drop for S3sFs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How to get Azurite, for the message of a test that cannot find it.
pub const AZURITE_INSTALL: &str = "npm install -g azurite@3.37.0";

/// The `azurite-blob` program: `CAIRN_AZURITE`, else the first on `PATH`.
pub fn azurite_binary() -> PathBuf {
    test_program("azurite-blob", "CAIRN_AZURITE", AZURITE_INSTALL)
}

/// Azure's storage emulator (Azurite's blob service) on 127.0.0.1, an
/// ephemeral port, keeping its data in a directory of the caller's. It
/// checks SAS signatures with the emulator's well-known account. Killed
/// when dropped.
#[derive(Debug)]
pub struct Azurite {
    child: Child,
    endpoint: String,
}

impl Azurite {
    /// The emulator's account and key (public, from Azurite's documentation).
    pub const ACCOUNT: &str = "devstoreaccount1";
    pub const KEY: &str =
        "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

    pub fn start(root: &Path) -> Self {
        let mut command = Command::new(azurite_binary());
        command
            .args(["--blobHost", "127.0.0.1", "--blobPort", "0"])
            .arg("--location")
            .arg(root)
            .args(["--disableTelemetry", "--skipApiVersionCheck"]);
        let (child, listening) = start_and_read_address(
            command,
            "azurite-blob",
            AZURITE_INSTALL,
            "successfully listens on ",
        );
        Self {
            child,
            endpoint: format!("{listening}/{}", Self::ACCOUNT),
        }
    }

    /// The account's blob service: `http://127.0.0.1:PORT/devstoreaccount1`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The Azure variables that point a coordinator at this emulator.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AZURE_STORAGE_ACCOUNT_NAME", Self::ACCOUNT.to_owned()),
            ("AZURE_STORAGE_ACCOUNT_KEY", Self::KEY.to_owned()),
            ("AZURE_STORAGE_ENDPOINT", self.endpoint.clone()),
            ("AZURE_ALLOW_HTTP", "true".to_owned()),
        ]
    }
}

impl Drop for Azurite {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One sample of a scrape: metric name, labels, value.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct Sample {
    pub name: String,
    pub labels: std::collections::BTreeMap<String, String>,
    pub value: f64,
}

/// Parses a scrape in Prometheus' text format with the Prometheus client
/// library's own parser (Python's `prometheus_client`), which refuses what
/// Prometheus would. Panics, saying what to install, when no Python has it.
pub fn parse_prometheus(text: &str) -> Vec<Sample> {
    use std::io::Write as _;
    const SCRIPT: &str = "import json, sys\n\
        from prometheus_client.parser import text_string_to_metric_families\n\
        for family in text_string_to_metric_families(sys.stdin.read()):\n\
        \x20   for s in family.samples:\n\
        \x20       print(json.dumps({'name': s.name, 'labels': s.labels, 'value': s.value}))\n";
    let mut child = Command::new(python_with_prometheus_client())
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the python that imports prometheus_client runs");
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(text.as_bytes())
        .expect("the parser reads the scrape");
    let output = child.wait_with_output().expect("the parser runs");
    assert!(
        output.status.success(),
        "prometheus_client refused the scrape:\n{}\n{text}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .expect("the parser prints JSON")
        .lines()
        .map(|line| serde_json::from_str(line).expect("the parser prints one sample a line"))
        .collect()
}

/// The value of the one sample named `name` with exactly `labels`.
pub fn sample_value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let labels: std::collections::BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let found: Vec<f64> = samples
        .iter()
        .filter(|s| s.name == name && s.labels == labels)
        .map(|s| s.value)
        .collect();
    assert_eq!(found.len(), 1, "one sample {name}{labels:?} in {samples:?}");
    found[0]
}

/// A Python that imports `prometheus_client`: the one on the PATH, else
/// the system's, where Debian's python3-prometheus-client installs it (a
/// PATH may lead to another Python first).
fn python_with_prometheus_client() -> &'static str {
    ["python3", "/usr/bin/python3"]
        .into_iter()
        .find(|python| {
            Command::new(python)
                .args(["-c", "import prometheus_client"])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|status| status.success())
        })
        .expect(
            "no python3 imports prometheus_client: apt-get install python3-prometheus-client (.ci/run does)",
        )
}
