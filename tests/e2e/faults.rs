//! Faults (issue 28): the coordinator SIGKILLed and restarted again and
//! again while many runners checkpoint at once. Every runner finishes
//! (calls cut off mid-way are retried; a retried commit makes one
//! checkpoint), nothing is half-recorded, and every committed checkpoint
//! reads back whole.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cairn_e2e::{Coordinator, json_u64, populate_small_workspace, tempdir};

/// Workspaces checkpointing at once, and checkpoints each cuts in a row.
const WORKSPACES: usize = 12;
const ROUNDS: u64 = 5;
/// Crashes of the coordinator while they run.
const CRASHES: usize = 6;

#[test]
fn checkpoints_survive_a_coordinator_killed_again_and_again() {
    let tmp = tempdir("faults");
    let mut coordinator = Coordinator::start();
    let client = coordinator.client();
    let workspaces: Vec<(String, PathBuf)> = (0..WORKSPACES)
        .map(|i| {
            let root = tmp.path().join(format!("ws-{i}"));
            populate_small_workspace(&root, i as u64);
            (coordinator.create_workspace(&format!("fault-{i}")), root)
        })
        .collect();

    // Each workspace cuts ROUNDS checkpoints in a row (an edit before each),
    // all workspaces at once, while the coordinator is killed and started
    // again on the same ports.
    let script = |workspace: &str, root: &PathBuf| -> Child {
        let mut rounds = String::new();
        for round in 0..ROUNDS {
            rounds.push_str(&format!(
                "echo round {round} >> {root}/src/rounds.txt && \
                 \"$RUNNER\" checkpoint --root {root} --workspace {workspace} --output json || exit $?; ",
                root = root.display(),
            ));
        }
        let runner = client.runner();
        let program = runner.get_program().to_owned();
        let mut shell = Command::new("sh");
        shell
            .args(["-c", &rounds])
            .env("RUNNER", program)
            .envs(
                runner
                    .get_envs()
                    .filter_map(|(k, v)| v.map(|v| (k.to_owned(), v.to_owned()))),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        shell.spawn().expect("sh starts")
    };
    let children: Vec<Child> = workspaces
        .iter()
        .map(|(workspace, root)| script(workspace, root))
        .collect();

    let started = Instant::now();
    for crash in 0..CRASHES {
        std::thread::sleep(Duration::from_millis(150 + 50 * crash as u64));
        coordinator.restart_in_place();
    }
    let crashed_for = started.elapsed();

    let mut finished = 0;
    for ((workspace, _), child) in workspaces.iter().zip(children) {
        let output = child.wait_with_output().expect("the runner script ends");
        assert!(
            output.status.success(),
            "the runners of {workspace} did not all finish across {CRASHES} crashes \
             ({crashed_for:?}): {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let reports: Vec<serde_json::Value> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|line| serde_json::from_str(line).expect("one JSON report a checkpoint"))
            .collect();
        assert_eq!(reports.len() as u64, ROUNDS, "{workspace}");

        // One checkpoint per cut, numbered without gaps: a commit retried
        // after its answer was lost did not make a second one.
        let listed = coordinator.list_checkpoints(workspace);
        let mut sequences: Vec<u64> = listed.iter().map(|c| c.sequence).collect();
        sequences.sort_unstable();
        assert_eq!(
            sequences,
            (1..=ROUNDS).collect::<Vec<_>>(),
            "{workspace}: {reports:?}"
        );
        for report in &reports {
            assert!(json_u64(report, "sequence") >= 1);
        }

        // Nothing half-recorded: every pack every checkpoint names is in
        // the store and reads back whole.
        let verify = cairn_e2e::run(client.ctl().args(["verify", workspace, "--read-data"]));
        assert!(verify.status.success(), "verify {workspace}: {verify}");
        finished += 1;
    }
    assert_eq!(finished, WORKSPACES);

    // The newest checkpoint of one of them restores exactly.
    let (workspace, _) = &workspaces[0];
    let restored = tmp.path().join("restored");
    coordinator.client().restore(&restored, workspace);
    let rounds = std::fs::read_to_string(restored.join("src/rounds.txt")).unwrap();
    assert_eq!(rounds.lines().count() as u64, ROUNDS);
}
