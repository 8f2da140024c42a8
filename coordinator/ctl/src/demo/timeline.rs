//! The demo's timeline: one readable line per run event (time since the
//! demo started, state, host, attempt and generation, what happened, and
//! for checkpoints their size, upload and time), with the demo's own moves
//! in between. Also kept as JSON for `--output json`.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use cairn_proto::pb;
use serde_json::{Value, json};

use super::super::output::{self, time_of};

/// Where timeline lines go: stdout for people, stderr when stdout carries
/// the JSON summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    Stdout,
    Stderr,
}

#[derive(Debug)]
pub struct Timeline {
    start: SystemTime,
    sink: Sink,
    /// Host id → "host A".
    hosts: HashMap<String, String>,
    entries: Vec<Value>,
}

impl Timeline {
    pub fn new(start: SystemTime, sink: Sink) -> Self {
        Self {
            start,
            sink,
            hosts: HashMap::new(),
            entries: Vec::new(),
        }
    }

    pub fn name_host(&mut self, id: &str, role: &str) {
        self.hosts.insert(id.to_owned(), format!("host {role}"));
    }

    pub fn knows_host(&self, id: &str) -> bool {
        id.is_empty() || self.hosts.contains_key(id)
    }

    /// "host A", or the id of a host the demo did not start.
    pub fn host_name(&self, id: &str) -> String {
        self.hosts
            .get(id)
            .cloned()
            .unwrap_or_else(|| output::or_dash(id))
    }

    fn elapsed(&self, at: SystemTime) -> Duration {
        at.duration_since(self.start).unwrap_or_default()
    }

    fn print(&self, line: &str) {
        match self.sink {
            Sink::Stdout => {
                // A closed stdout must not stop the demo from cleaning up.
                let _ = super::super::emit(line);
            }
            Sink::Stderr => eprintln!("{line}"),
        }
    }

    /// A line of the demo's own (set-up, what it does to the system).
    pub fn say(&mut self, text: &str) {
        self.print(text);
    }

    /// Something the demo does, placed in time between the events.
    pub fn act(&mut self, text: &str) {
        let elapsed = self.elapsed(SystemTime::now());
        self.print(&format!("{:>7}  ▸ {text}", seconds(elapsed)));
        self.entries.push(json!({
            "elapsed_ms": elapsed.as_millis() as u64,
            "demo": text,
        }));
    }

    /// One run event; `checkpoint` is the checkpoint it names, if it could be read.
    pub fn event(&mut self, event: &pb::RunEvent, checkpoint: Option<&pb::Checkpoint>) {
        let at = time_of!(event.at).unwrap_or_else(SystemTime::now);
        let elapsed = self.elapsed(at);
        let host = if event.host_id.is_empty() {
            String::new()
        } else {
            self.host_name(&event.host_id)
        };
        let line = event_line(elapsed, event, &host, checkpoint);
        self.print(&line);
        self.entries.push(json!({
            "elapsed_ms": elapsed.as_millis() as u64,
            "event": output::event_json(event),
            "host": host,
            "checkpoint": checkpoint.map(checkpoint_facts),
        }));
    }

    pub fn to_json(&self) -> Value {
        Value::Array(self.entries.clone())
    }
}

/// `+12.3s`.
pub fn seconds(d: Duration) -> String {
    format!("+{:.1}s", d.as_secs_f64())
}

/// `+3.2s  waiting    host A  #1 g2  waiting  the agent asks: …`.
pub fn event_line(
    elapsed: Duration,
    event: &pb::RunEvent,
    host: &str,
    checkpoint: Option<&pb::Checkpoint>,
) -> String {
    let mut what = event.reason.clone();
    let detail = event.detail.trim();
    match checkpoint {
        // The checkpoint's own line: what it holds and what it cost.
        Some(c) if event.reason == "checkpoint" => {
            what.push_str(&format!(" {}", checkpoint_text(c)));
        }
        // Other events name their checkpoint in the detail when it matters.
        _ if !detail.is_empty() => what.push_str(&format!(": {detail}")),
        _ if !event.checkpoint_id.is_empty() => {
            what.push_str(&format!(" {}", event.checkpoint_id));
        }
        _ => {}
    }
    let line = format!(
        "{:>7}  {:<9}  {:<6}  {:<6}  {what}",
        seconds(elapsed),
        output::run_state(event.state),
        host,
        output::attempt_generation(event.attempt, event.generation).replace('-', ""),
    );
    line.trim_end().to_owned()
}

/// `ck-… (pause): 7 files, 14.2 KiB, 3.1 KiB uploaded, 45 ms`.
pub fn checkpoint_text(c: &pb::Checkpoint) -> String {
    let stats = c.stats.unwrap_or_default();
    format!(
        "{} ({}): {} files, {}, {} uploaded, {} ms",
        c.id,
        output::reason(c.reason),
        stats.files,
        output::bytes(stats.total_bytes),
        output::bytes(stats.uploaded_bytes),
        stats.duration_ms
    )
}

fn checkpoint_facts(c: &pb::Checkpoint) -> Value {
    let stats = c.stats.unwrap_or_default();
    json!({
        "id": c.id,
        "reason": output::reason(c.reason),
        "generation": c.generation,
        "files": stats.files,
        "total_bytes": stats.total_bytes,
        "uploaded_bytes": stats.uploaded_bytes,
        "duration_ms": stats.duration_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_event_shows_size_upload_and_time() {
        let event = pb::RunEvent {
            state: pb::RunState::Waiting as i32,
            reason: "checkpoint".into(),
            host_id: "host-1".into(),
            attempt: 1,
            generation: 2,
            checkpoint_id: "ck-1".into(),
            detail: "pause checkpoint".into(),
            ..Default::default()
        };
        let checkpoint = pb::Checkpoint {
            id: "ck-1".into(),
            reason: pb::CheckpointReason::Pause as i32,
            stats: Some(pb::CheckpointStats {
                files: 7,
                total_bytes: 14_540,
                uploaded_bytes: 3_174,
                duration_ms: 45,
                ..Default::default()
            }),
            ..Default::default()
        };
        let line = event_line(
            Duration::from_millis(3_240),
            &event,
            "host A",
            Some(&checkpoint),
        );
        assert_eq!(
            line,
            "  +3.2s  waiting    host A  #1 g2   checkpoint ck-1 (pause): 7 files, 14.2 KiB, 3.1 KiB uploaded, 45 ms"
        );
    }

    #[test]
    fn other_events_show_their_detail() {
        let event = pb::RunEvent {
            state: pb::RunState::Queued as i32,
            reason: "created".into(),
            detail: "run created".into(),
            ..Default::default()
        };
        let line = event_line(Duration::ZERO, &event, "", None);
        assert_eq!(
            line,
            "  +0.0s  queued                     created: run created"
        );
        let restored = pb::RunEvent {
            state: pb::RunState::Starting as i32,
            reason: "restored".into(),
            checkpoint_id: "ck-1".into(),
            detail: "restored checkpoint ck-1 into /workspace".into(),
            ..Default::default()
        };
        let line = event_line(
            Duration::ZERO,
            &restored,
            "",
            Some(&pb::Checkpoint::default()),
        );
        assert_eq!(
            line,
            "  +0.0s  starting                   restored: restored checkpoint ck-1 into /workspace"
        );
    }
}
