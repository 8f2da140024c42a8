//! The image tier (issue 33): the runner image and the example team image
//! FROM it, built here by `scripts/runner-image` (a debootstrap base,
//! buildah, the binaries the tests run), then a run whose sandboxes are
//! podman containers of that image, started by two `cairn-host --driver
//! exec` with the README's templates: the agent asks, the hold expires and
//! the container is removed, and the answer resumes the run in a container
//! on the other host, from the checkpoint, in the same conversation.
//!
//! Needs root, buildah, podman, runc, catatonit and debootstrap (`.ci/run`
//! installs them) and Debian's package mirror; fails saying which is
//! missing. The base is cached (see the script), so a rerun builds only
//! what changed. `scripts/test` runs this tier once, in its SQLite pass.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cairn_e2e::fleet::{ExecDriver, Fleet, HostOptions, codeword, state_of};
use cairn_e2e::{binary, git};
use cairn_proto::pb;
use cairn_proto::runs::{RunState, to_proto_duration};

/// The exec templates, exactly as README.md ("### Sandboxes") shows them.
const CREATE: &str = "podman --runtime runc --cgroup-manager cgroupfs run -d --init --network host --name cairn-{sandbox_id} -v {workspace_dir}:/workspace -v {cache_dir}:/cache -e CAIRN_CACHE_DIR=/cache -v {pack_cache}:/pack-cache -e CAIRN_PACK_CACHE=/pack-cache {env_args} {image} cairn-runner run";
const WAIT: &str = "podman wait cairn-{sandbox_id}";
const DESTROY: &str = r#"sh -c "podman stop --time {grace_secs} cairn-{sandbox_id}; podman rm -f cairn-{sandbox_id}""#;

const QUESTION: &str = "Which colour should the button be?";

/// Long enough to look at the held container, short enough to wait out.
const SHORT_HOLD: Duration = Duration::from_secs(8);

/// What `scripts/runner-image --demo-agent` printed: the images and
/// podman's configuration.
struct Images {
    vars: BTreeMap<String, String>,
}

impl Images {
    /// Builds the images (or finds them cached) with the binaries the tests
    /// run; panics with the script's explanation when it cannot.
    fn build() -> Self {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let bin_dir = binary("cairn-runner")
            .parent()
            .expect("binaries are in a directory")
            .to_path_buf();
        let started = Instant::now();
        let output = Command::new(repo.join("scripts/runner-image"))
            .arg("--demo-agent")
            .env("CAIRN_IMAGE_BIN_DIR", &bin_dir)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("scripts/runner-image cannot be started: {e}"));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "the image tier needs the runner image, and scripts/runner-image could not build \
             it ({}):\n{stderr}",
            output.status
        );
        eprintln!(
            "scripts/runner-image took {:.1?}:\n{stderr}",
            started.elapsed()
        );
        let vars = String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        Self { vars }
    }

    fn get(&self, name: &str) -> &str {
        self.vars
            .get(name)
            .unwrap_or_else(|| panic!("scripts/runner-image printed no {name}: {:?}", self.vars))
    }

    /// What the host agents (and so podman) need in their environment.
    fn podman_env(&self) -> Vec<(String, String)> {
        ["CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF"]
            .into_iter()
            .map(|k| (k.to_owned(), self.get(k).to_owned()))
            .collect()
    }

    /// `podman ARGS` with this machine's configuration; (success, stdout).
    fn podman(&self, args: &[&str]) -> (bool, String) {
        let output = Command::new("podman")
            .args(args)
            .envs(self.podman_env())
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("podman cannot be started: {e}"));
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).trim().to_owned(),
        )
    }

    /// The statuses podman recorded for container `name` (create, start,
    /// died, remove, …) with the image each names, oldest first.
    fn events(&self, name: &str) -> Vec<(String, String)> {
        let (_, out) = self.podman(&[
            "events",
            "--stream=false",
            "--filter",
            &format!("container={name}"),
            "--format",
            "{{.Status}} {{.Image}}",
        ]);
        out.lines()
            .map(|l| {
                let (status, image) = l.split_once(' ').unwrap_or((l, ""));
                (status.to_owned(), image.trim().to_owned())
            })
            .collect()
    }
}

/// Containers of this test, removed however it ends.
struct Containers<'a> {
    images: &'a Images,
    names: Vec<String>,
}

impl Drop for Containers<'_> {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = self.images.podman(&["rm", "-f", "--time", "0", name]);
        }
    }
}

fn first_turn(codeword: &str) -> String {
    format!(
        "The codeword is {codeword}.\n\
         commit notes/plan.md first plan\n\
         edit notes/plan.md second thought, not committed\n\
         untracked scratch/todo.txt buy milk\n\
         ask {QUESTION}"
    )
}

#[test]
fn a_run_in_runner_image_containers_resumes_in_a_container_on_another_host() {
    let images = Images::build();
    let image = images.get("CAIRN_DEMO_IMAGE").to_owned();

    // The README shows these templates, word for word.
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .expect("README.md is readable");
    for (flag, template) in [
        ("--exec-create", CREATE),
        ("--exec-wait", WAIT),
        ("--exec-destroy", DESTROY),
    ] {
        assert!(
            readme.contains(&format!("{flag} '{template}'")),
            "README.md must show the template this test runs: {flag} '{template}'"
        );
    }

    let mut fleet = Fleet::start();
    let options = HostOptions {
        exec: Some(ExecDriver {
            create: CREATE.into(),
            wait: Some(WAIT.into()),
            destroy: Some(DESTROY.into()),
            default_image: Some(image.clone()),
            host_env: images.podman_env(),
        }),
        ..HostOptions::default()
    };
    let host_a = fleet.start_host("a", options.clone()).id.clone();
    let host_b = fleet.start_host("b", options).id.clone();
    fleet.cordon("b");
    let mut containers = Containers {
        images: &images,
        names: Vec::new(),
    };

    // The demo agent is in the image (the team's agent CLI would be).
    let word = codeword("OSPREY");
    let mut request = fleet.run_request("in-a-container", &first_turn(&word));
    request.harness = Some(pb::HarnessSpec {
        name: "claude".into(),
        config: [("binary".to_owned(), "cairn-demo-agent".to_owned())].into(),
    });
    request.hold = Some(to_proto_duration(SHORT_HOLD));
    let created = fleet.create_run(request);
    let run_id = created.id.clone();
    let workspace = created.workspace_id.clone();

    // 1. The agent works in a container on a, asks, and the run waits with
    //    the container held.
    let waiting = fleet.wait_for_state(&run_id, RunState::Waiting);
    assert_eq!(waiting.question, QUESTION, "{waiting:?}");
    let first = waiting.attempts[0].clone();
    assert_eq!(first.host_id, host_a, "the first attempt ran on a");
    let container_a = format!("cairn-{}", first.sandbox_id);
    containers.names.push(container_a.clone());
    let (found, inspected) = images.podman(&[
        "inspect",
        "--format",
        "{{.State.Status}} {{.ImageName}}",
        &container_a,
    ]);
    assert!(
        found && inspected == format!("running {image}"),
        "the held sandbox is a running container {container_a} of {image}: {inspected:?}\n{}",
        fleet.diagnose(&run_id)
    );
    // The container's /workspace is the sandbox's directory on a.
    let on_a = fleet
        .host("a")
        .sandbox_dir(&first.sandbox_id)
        .join("workspace");
    assert_eq!(
        std::fs::read_to_string(on_a.join("notes/plan.md"))
            .ok()
            .as_deref(),
        Some("first plan\nsecond thought, not committed\n"),
        "the agent's file, written in the container, in {}",
        on_a.display()
    );

    // 2. The hold expires: the runner checkpoints, the container is removed.
    let suspended = fleet.wait_for_state(&run_id, RunState::Suspended);
    fleet.wait_for(&format!("container {container_a} to be removed"), || {
        (!images.podman(&["container", "exists", &container_a]).0).then_some(())
    });
    fleet.wait_for_sandbox_gone("a", &first.sandbox_id);
    let newest = fleet.checkpoints(&workspace)[0].clone();
    assert_eq!(suspended.last_checkpoint_id, newest.id);

    // 3. The answer, with a cordoned: a container on b restores and resumes.
    fleet.cordon("a");
    fleet.uncordon("b");
    let answered = fleet
        .answer(
            &run_id,
            "recall codeword\n\
             run tr '\\0' ' ' < /proc/1/cmdline\n\
             run git status --porcelain --untracked-files=all -- notes scratch",
        )
        .unwrap_or_else(|s| panic!("AnswerRun failed: {s}"));
    assert_eq!(state_of(&answered), Some(RunState::Queued), "{answered:?}");
    let done = fleet.wait_for_state(&run_id, RunState::Succeeded);
    let second = done.attempts[1].clone();
    let container_b = format!("cairn-{}", second.sandbox_id);
    containers.names.push(container_b.clone());
    assert_eq!(second.host_id, host_b, "the resumed attempt ran on b");
    assert_eq!(
        second.restored_checkpoint_id, newest.id,
        "attempt 2 restored the newest checkpoint"
    );
    let summary = &done.summary;
    assert!(
        summary.contains(&word),
        "the resumed agent did not recall the codeword {word} from the first turn: {summary:?}"
    );
    assert!(
        summary.contains("/run/podman-init"),
        "the second turn ran in a container (pid 1 is podman's init): {summary:?}"
    );
    assert!(
        summary.contains(" M notes/plan.md") && summary.contains("?? scratch/todo.txt"),
        "the workspace restored in the container on b has the first turn's change and \
         untracked file: {summary:?}"
    );

    // Both sandboxes were containers of the image, created and removed.
    fleet.wait_for(&format!("container {container_b} to be removed"), || {
        (!images.podman(&["container", "exists", &container_b]).0).then_some(())
    });
    for name in [&container_a, &container_b] {
        let events = images.events(name);
        let statuses: Vec<&str> = events.iter().map(|(s, _)| s.as_str()).collect();
        assert!(
            statuses.first() == Some(&"create")
                && statuses.contains(&"start")
                && statuses.last() == Some(&"remove"),
            "podman's events for {name}: {events:?}"
        );
        assert_eq!(
            events.first().map(|(_, i)| i.as_str()),
            Some(image.as_str()),
            "{name} was created from {image}: {events:?}"
        );
    }

    // The run's last checkpoint, checked out: the work of both turns.
    let last = fleet.checkpoints(&workspace)[0].id.clone();
    let (_tmp, checkout) = fleet.checkout(&workspace, &last);
    let log = git(&checkout, &["log", "--format=%s"]);
    assert!(
        log.contains("demo agent: notes/plan.md"),
        "the commit made in the first container: {log:?}"
    );
    assert_eq!(
        std::fs::read_to_string(checkout.join("scratch/todo.txt"))
            .ok()
            .as_deref(),
        Some("buy milk\n")
    );
}
