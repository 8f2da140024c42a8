//! cairnctl for runs and hosts: create a run, see it wait, answer it, move
//! it off a drained host, and read its timeline; list, cordon, uncordon and
//! drain hosts; mint a host token that a host agent then uses; `runs
//! watch` seeing runs created and cancelled.

use cairn_e2e::fleet::{
    Fleet, HostOptions, checkpoint_reason, describe_event, state_of, state_of_host,
};
use cairn_e2e::{ids_with_prefix, run};
use cairn_proto::pb;
use cairn_proto::runs::{HostState, RunState};
use serde_json::Value;

const QUESTION: &str = "Shall I carry on?";

/// Every string value stored under `key`, anywhere in the document.
fn strings_under(value: &Value, key: &str) -> Vec<String> {
    let mut out = Vec::new();
    fn visit(value: &Value, key: &str, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (k, v) in map {
                    if k == key
                        && let Value::String(s) = v
                    {
                        out.push(s.clone());
                    }
                    visit(v, key, out);
                }
            }
            Value::Array(items) => items.iter().for_each(|v| visit(v, key, out)),
            _ => {}
        }
    }
    visit(value, key, &mut out);
    out
}

/// The JSON object (anywhere in the document) whose `id` is `id`.
fn object_with_id<'a>(value: &'a Value, id: &str) -> Option<&'a Value> {
    match value {
        Value::Object(map) => {
            if map.get("id").and_then(Value::as_str) == Some(id) {
                return Some(value);
            }
            map.values().find_map(|v| object_with_id(v, id))
        }
        Value::Array(items) => items.iter().find_map(|v| object_with_id(v, id)),
        _ => None,
    }
}

/// `state` of host `id` in `cairnctl hosts list --output json`.
fn listed_host_state(fleet: &Fleet, id: &str) -> String {
    let hosts = fleet.coordinator.client().ctl_json(&["hosts", "list"]);
    let host = object_with_id(&hosts, id).unwrap_or_else(|| panic!("{id} is not in {hosts}"));
    host.get("state")
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("host {id} has no state in {host}"))
        .to_owned()
}

/// stdout as JSON: one document, or one per line.
fn json_documents(stdout: &str) -> Vec<Value> {
    if let Ok(one) = serde_json::from_str::<Value>(stdout.trim()) {
        return vec![one];
    }
    stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}\n{stdout}"))
        })
        .collect()
}

/// The objects with a `reason` (the events) in a JSON output, in order.
fn event_objects(documents: &[Value]) -> Vec<Value> {
    fn visit(value: &Value, out: &mut Vec<Value>) {
        match value {
            Value::Object(map) if map.contains_key("reason") => out.push(value.clone()),
            Value::Object(map) => map.values().for_each(|v| visit(v, out)),
            Value::Array(items) => items.iter().for_each(|v| visit(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    documents.iter().for_each(|d| visit(d, &mut out));
    out
}

#[test]
fn cairnctl_creates_answers_and_follows_runs_and_manages_hosts() {
    let mut fleet = Fleet::start();
    let client = fleet.coordinator.client();

    // A host token minted with cairnctl is what host a registers with.
    let minted = client.ctl_json(&["tokens", "create", "--scope", "host"]);
    let host_token = strings_under(&minted, "token")
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no token in {minted}"));
    let a = fleet
        .start_host(
            "a",
            HostOptions {
                token: Some(host_token),
                ..HostOptions::default()
            },
        )
        .id
        .clone();
    let b = fleet.start_host("b", HostOptions::default()).id.clone();

    let hosts = client.ctl_json(&["hosts", "list"]);
    let mut listed = ids_with_prefix(&hosts, "host-");
    listed.sort();
    let mut started = vec![a.clone(), b.clone()];
    started.sort();
    assert_eq!(listed, started, "{hosts}");
    assert_eq!(listed_host_state(&fleet, &a), "ready");
    let table = run(client.ctl().args(["hosts", "list"])).assert_success();
    assert!(
        table.stdout.contains(&a) && table.stdout.contains(&b) && table.stdout.contains("ready"),
        "{table}"
    );

    run(client.ctl().args(["hosts", "cordon", "b"])).assert_success();
    assert_eq!(listed_host_state(&fleet, &b), "cordoned");
    assert_eq!(
        state_of_host(&fleet.host_info("b")),
        Some(HostState::Cordoned)
    );

    // A run created with cairnctl lands on a (b is cordoned) and asks.
    let binary = format!("binary={}", fleet.agent_binary().display());
    let prompt = format!("commit cli.txt made through cairnctl\nask {QUESTION}");
    let created = client.ctl_json(&[
        "runs",
        "create",
        "--new-workspace",
        "--name",
        "cli",
        "--harness",
        "claude",
        "--harness-config",
        &binary,
        "--prompt",
        &prompt,
        "--hold",
        "5m",
        "--max-attempts",
        "3",
    ]);
    let run_id = ids_with_prefix(&created, "run-")
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no run id in {created}"));
    let waiting = fleet.wait_for_state(&run_id, RunState::Waiting);
    assert_eq!(waiting.attempts[0].host_id, a);
    assert_eq!(
        waiting.harness.as_ref().map(|h| h.name.as_str()),
        Some("claude")
    );
    assert_eq!(waiting.hold.map(|h| h.seconds), Some(300), "--hold 5m");
    let shown = client.ctl_json(&["runs", "show", &run_id]);
    assert!(
        shown.to_string().contains("\"waiting\"") && shown.to_string().contains(QUESTION),
        "runs show says waiting and the question: {shown}"
    );
    let shown_table = run(client.ctl().args(["runs", "show", &run_id])).assert_success();
    assert!(
        shown_table.stdout.contains("waiting") && shown_table.stdout.contains(QUESTION),
        "{shown_table}"
    );
    let waiting_list = client.ctl_json(&["runs", "list", "--state", "waiting"]);
    assert_eq!(
        ids_with_prefix(&waiting_list, "run-"),
        vec![run_id.clone()],
        "{waiting_list}"
    );
    let done_list = client.ctl_json(&["runs", "list", "--state", "succeeded"]);
    assert!(
        ids_with_prefix(&done_list, "run-").is_empty(),
        "{done_list}"
    );

    // The answer goes to the held sandbox: the agent works on (sleeps).
    run(client.ctl().args(["runs", "answer", &run_id, "sleep 600"])).assert_success();
    fleet.wait_for_event(&run_id, "the answer", |e| e.reason == "answered");
    let working = fleet.wait_for_run(&run_id, "running again", |r| {
        state_of(r) == Some(RunState::Running)
    });
    assert_eq!(
        working.attempts.len(),
        1,
        "same attempt after an answer in time"
    );
    let sandbox_a = working.attempts[0].sandbox_id.clone();
    fleet.wait_for(&format!("the second turn in {sandbox_a}"), || {
        (fleet.agent_turns_in(&sandbox_a).len() == 2).then_some(())
    });
    let refused = run(client.ctl().args(["runs", "answer", &run_id, "too late"])).assert_exit(1);
    assert!(
        refused.stderr.contains("error:") && refused.stderr.contains("running"),
        "answering a running run is refused, naming its state: {refused}"
    );

    // Drain a: the running run is stopped there (destroy checkpoint) and
    // resumes on b from that checkpoint.
    run(client.ctl().args(["hosts", "uncordon", "b"])).assert_success();
    assert_eq!(listed_host_state(&fleet, &b), "ready");
    run(client.ctl().args(["hosts", "drain", "a"])).assert_success();
    assert_eq!(listed_host_state(&fleet, &a), "draining");
    let done = fleet.wait_for_state(&run_id, RunState::Succeeded);
    fleet.wait_for_sandbox_gone("a", &sandbox_a);
    assert_eq!(done.attempts.len(), 2, "{done:?}");
    let (drained, resumed) = (&done.attempts[0], &done.attempts[1]);
    assert!(
        drained.end_reason.contains("drain"),
        "{:?}",
        drained.end_reason
    );
    assert_eq!(resumed.host_id, b);
    let destroy = fleet
        .checkpoints(&done.workspace_id)
        .into_iter()
        .find(|c| {
            checkpoint_reason(c) == pb::CheckpointReason::Destroy
                && c.generation == drained.generation
        })
        .unwrap_or_else(|| {
            panic!(
                "drain did not checkpoint the run\n{}",
                fleet.diagnose(&run_id)
            )
        });
    assert_eq!(
        resumed.restored_checkpoint_id, destroy.id,
        "resumed from the drain's checkpoint"
    );
    assert!(
        fleet.host_info("a").run_ids.is_empty(),
        "a drained host runs nothing: {:?}",
        fleet.host_info("a")
    );

    // The timeline: every transition, with its time and reason, in order.
    let events = fleet.events(&run_id);
    let table = run(client.ctl().args(["runs", "events", &run_id])).assert_success();
    let mut lines = table.stdout.lines();
    for event in &events {
        let found = lines
            .by_ref()
            .any(|line| line.contains(event.reason.as_str()));
        assert!(
            found,
            "`cairnctl runs events` lacks (or misorders) {}:\n{table}",
            describe_event(event)
        );
    }
    let as_json = run(client
        .ctl()
        .args(["--output", "json", "runs", "events", &run_id]))
    .assert_success();
    let listed = event_objects(&json_documents(&as_json.stdout));
    let reasons: Vec<&str> = listed
        .iter()
        .map(|e| e["reason"].as_str().unwrap_or_default())
        .collect();
    let expected: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
    assert_eq!(
        reasons, expected,
        "runs events --output json: {}",
        as_json.stdout
    );
    for event in &listed {
        let time = ["at", "time", "timestamp"]
            .iter()
            .find_map(|k| event.get(*k).and_then(Value::as_str));
        assert!(
            time.is_some_and(|t| t.len() >= 19 && t.contains('T')),
            "an event without an RFC 3339 time: {event}"
        );
    }
    for word in ["created", "assigned", "waiting", "answered", "succeeded"] {
        assert!(expected.contains(&word), "no {word} event: {expected:?}");
    }
    // --follow on an ended run prints everything and returns.
    let followed = run(client.ctl().args(["runs", "events", &run_id, "--follow"])).assert_success();
    assert!(followed.stdout.contains("succeeded"), "{followed}");

    let by_workspace = client.ctl_json(&["runs", "list", "--workspace", "cli"]);
    assert_eq!(
        ids_with_prefix(&by_workspace, "run-"),
        vec![run_id.clone()],
        "{by_workspace}"
    );

    // Suspend a working run: its sandbox is released after a destroy
    // checkpoint; then cancel it for good.
    let second = client.ctl_json(&[
        "runs",
        "create",
        "--workspace",
        "cli",
        "--harness",
        "claude",
        "--harness-config",
        &binary,
        "--prompt",
        "commit later.txt second run\nsleep 600",
    ]);
    let second_id = ids_with_prefix(&second, "run-")
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no run id in {second}"));
    let sandbox = fleet
        .wait_for_run(&second_id, "a sandbox for the second run", |r| {
            r.attempts.iter().any(|a| !a.sandbox_id.is_empty())
        })
        .attempts[0]
        .clone();
    fleet.wait_for_agent_turn(&sandbox.sandbox_id);
    run(client.ctl().args(["runs", "suspend", &second_id])).assert_success();
    let suspended = fleet.wait_for_state(&second_id, RunState::Suspended);
    fleet.wait_for_sandbox_gone("b", &sandbox.sandbox_id);
    assert_eq!(suspended.attempts.len(), 1, "{suspended:?}");
    assert!(
        fleet.checkpoints("cli").iter().any(|c| {
            checkpoint_reason(c) == pb::CheckpointReason::Destroy
                && c.generation == sandbox.generation
        }),
        "suspend checkpoints before releasing the sandbox\n{}",
        fleet.diagnose(&second_id)
    );
    run(client.ctl().args(["runs", "cancel", &second_id])).assert_success();
    assert_eq!(
        state_of(&fleet.get_run(&second_id)),
        Some(RunState::Cancelled)
    );
    let all = client.ctl_json(&["runs", "list"]);
    let mut listed = ids_with_prefix(&all, "run-");
    listed.sort();
    let mut both = vec![run_id, second_id];
    both.sort();
    assert_eq!(listed, both, "{all}");
}

/// A running `cairnctl runs watch` and the lines it has printed.
struct Watch {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Watch {
    fn start(mut cmd: std::process::Command) -> Self {
        use std::io::BufRead as _;
        let mut child = cmd
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("cairnctl starts");
        let stdout = child.stdout.take().expect("piped");
        let (sender, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The first new line `matches` accepts, within 30 s.
    fn wait_for(&mut self, what: &str, matches: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if matches(&line) {
                        return line;
                    }
                }
                Err(_) => break,
            }
        }
        panic!(
            "runs watch printed no line with {what}; it printed:\n{}",
            self.seen.join("\n")
        );
    }

    /// Ctrl-C, then its exit status (within 10 s).
    fn interrupt(mut self) -> std::process::ExitStatus {
        cairn_e2e::fleet::signal(&[self.child.id()], "INT");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("status") {
                return status;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("runs watch still ran 10 s after Ctrl-C");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A queued run on `workspace`, created with cairnctl; its id.
fn queued_run(client: &cairn_e2e::Client, workspace: &str) -> String {
    let created = client.ctl_json(&[
        "runs",
        "create",
        "--workspace",
        workspace,
        "--harness",
        "claude",
        "--prompt",
        "watch me",
        "--label",
        "pool=nowhere",
    ]);
    ids_with_prefix(&created, "run-")
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no run id in {created}"))
}

/// `runs watch` as a script sees it (stdout a pipe): a JSON object per
/// change with `-o json`, a line per change otherwise, and exit 0 on Ctrl-C.
#[test]
fn runs_watch_prints_each_change_and_stops_on_ctrl_c() {
    let coordinator = cairn_e2e::Coordinator::start();
    let client = coordinator.client();
    coordinator.create_workspace("watched");

    let mut watch = Watch::start({
        let mut cmd = client.ctl();
        cmd.args(["-o", "json", "runs", "watch", "--interval", "200ms"]);
        cmd
    });
    let run_id = queued_run(&client, "watched");
    let change = |line: &str| {
        serde_json::from_str::<Value>(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
    };
    let is = |line: &str, kind: &str, state: &str| {
        let value = change(line);
        value["change"] == kind
            && value["run"]["id"] == run_id.as_str()
            && value["run"]["state"] == state
    };
    watch.wait_for("the new queued run", |l| is(l, "new", "queued"));
    run(client.ctl().args(["runs", "cancel", &run_id])).assert_success();
    let cancelled = watch.wait_for("the run cancelled", |l| is(l, "changed", "cancelled"));
    assert_eq!(
        change(&cancelled)["previous_state"],
        "queued",
        "{cancelled}"
    );
    assert!(watch.interrupt().success(), "Ctrl-C is a clean stop");

    let mut watch = Watch::start({
        let mut cmd = client.ctl();
        cmd.args([
            "runs",
            "watch",
            "--workspace",
            "watched",
            "--interval",
            "200ms",
        ]);
        cmd
    });
    let header = watch.wait_for("a header", |_| true);
    assert!(
        header.starts_with("TIME") && header.contains("CHANGE"),
        "{header}"
    );
    let old = watch.wait_for("the cancelled run, as it is now", |l| l.contains(&run_id));
    assert!(old.contains(" new ") && old.contains("cancelled"), "{old}");
    let second = queued_run(&client, "watched");
    let line = watch.wait_for("the second run", |l| l.contains(&second));
    assert!(line.contains(" new ") && line.contains("queued"), "{line}");
    run(client.ctl().args(["runs", "cancel", &second])).assert_success();
    let line = watch.wait_for("the second run cancelled", |l| l.contains(&second));
    assert!(
        line.contains("changed") && line.contains("queued → cancelled"),
        "{line}"
    );
    assert!(
        !watch.seen.iter().any(|l| l.contains('\x1b')),
        "no terminal control codes in a pipe: {:?}",
        watch.seen
    );
    assert!(watch.interrupt().success(), "Ctrl-C is a clean stop");
}

/// On a terminal `runs watch` redraws the whole table in place: the
/// cursor goes home and each line is cleared, no line per change.
#[test]
fn runs_watch_redraws_the_table_in_place_on_a_terminal() {
    let coordinator = cairn_e2e::Coordinator::start();
    let client = coordinator.client();
    coordinator.create_workspace("watched");
    let run_id = queued_run(&client, "watched");

    // `script` (util-linux) runs cairnctl on a pseudo-terminal and copies
    // what it draws to our pipe.
    let ctl = client.ctl();
    let line = format!(
        "{} runs watch --interval 200ms",
        ctl.get_program().to_string_lossy()
    );
    let mut cmd = std::process::Command::new("script");
    cmd.args(["-qfec", &line, "/dev/null"]);
    for (key, value) in ctl.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    let mut watch = Watch::start(cmd);
    watch.wait_for("the queued run in the table", |l| {
        l.contains(&run_id) && l.contains("queued")
    });
    run(client.ctl().args(["runs", "cancel", &run_id])).assert_success();
    watch.wait_for("the same row, now cancelled", |l| {
        l.contains(&run_id) && l.contains("cancelled")
    });
    let screen = watch.seen.join("\n");
    assert!(
        screen.contains("\x1b[H") && screen.contains("Ctrl-C to stop"),
        "not redrawn in place: {screen:?}"
    );
    assert!(
        !screen.contains("CHANGE"),
        "a terminal gets the table, not change lines: {screen:?}"
    );
}
