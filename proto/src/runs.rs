//! Domain types of runs, attempts and hosts.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ValidationError;
use crate::pb;

/// A `word_enum!` that is also a `cairn.v1` enum `$pb` on the wire.
macro_rules! wire_enum {
    ($(#[$doc:meta])* $name:ident, $pb:ty, $field:literal, { $($variant:ident => $word:literal),+ $(,)? }) => {
        word_enum!(
            $(#[$doc])*
            #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
            #[serde(rename_all = "snake_case")]
            $name, $field, { $($variant => $word),+ }
        );

        impl From<$name> for $pb {
            fn from(v: $name) -> Self {
                match v {
                    $($name::$variant => <$pb>::$variant),+
                }
            }
        }

        impl TryFrom<i32> for $name {
            type Error = ValidationError;
            fn try_from(value: i32) -> Result<Self, Self::Error> {
                match <$pb>::try_from(value) {
                    $(Ok(<$pb>::$variant) => Ok(Self::$variant),)+
                    _ => Err(ValidationError::new($field, format!("unknown or unspecified value {value}"))),
                }
            }
        }
    };
}

wire_enum!(
    /// Where a run is in its life (DESIGN.md, Model).
    RunState, pb::RunState, "state", {
        Queued => "queued",
        Assigned => "assigned",
        Starting => "starting",
        Running => "running",
        Waiting => "waiting",
        Suspended => "suspended",
        Succeeded => "succeeded",
        Failed => "failed",
        Cancelled => "cancelled",
    }
);

impl RunState {
    /// Succeeded, failed and cancelled runs never change again.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

wire_enum!(
    /// A host's standing with the scheduler.
    HostState, pb::HostState, "host_state", {
        Ready => "ready",
        Cordoned => "cordoned",
        Draining => "draining",
        Lost => "lost",
        Stopping => "stopping",
    }
);

wire_enum!(
    /// One attempt of a run.
    AttemptState, pb::AttemptState, "attempt_state", {
        Assigned => "assigned",
        Starting => "starting",
        Running => "running",
        Waiting => "waiting",
        Ended => "ended",
    }
);

wire_enum!(
    /// What a host reports about one of its sandboxes.
    SandboxState, pb::SandboxState, "sandbox_state", {
        Starting => "starting",
        Running => "running",
        Exited => "exited",
        Destroyed => "destroyed",
        Failed => "failed",
    }
);

impl SandboxState {
    /// The sandbox no longer exists (its slot is free).
    pub fn is_gone(self) -> bool {
        matches!(self, Self::Exited | Self::Destroyed | Self::Failed)
    }
}

wire_enum!(
    /// How an attempt's work ended, as its runner reports it.
    Outcome, pb::Outcome, "outcome", {
        Succeeded => "succeeded",
        Failed => "failed",
        Interrupted => "interrupted",
    }
);

wire_enum!(
    /// What the runner is doing, as reported.
    AttemptPhase, pb::AttemptPhase, "phase", {
        Restoring => "restoring",
        Preparing => "preparing",
        Running => "running",
        Checkpointed => "checkpointed",
    }
);

/// Placement labels: `key=value` pairs; a run's labels must all match a host's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Labels(pub BTreeMap<String, String>);

impl Labels {
    /// Whether every label of `self` is present with the same value in `host`.
    pub fn satisfied_by(&self, host: &Labels) -> bool {
        self.0.iter().all(|(k, v)| host.0.get(k) == Some(v))
    }

    /// The labels of `self` that `host` lacks or has with another value.
    pub fn unmet_by(&self, host: &Labels) -> Vec<String> {
        self.0
            .iter()
            .filter(|(k, v)| host.0.get(*k) != Some(*v))
            .map(|(k, v)| format!("{k}={v}"))
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Validates labels received on the wire.
    pub fn from_map(
        map: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ValidationError> {
        let mut out = BTreeMap::new();
        for (k, v) in map {
            validate_label_key(&k)?;
            if v.len() > 256 || v.contains(['\n', ',']) {
                return Err(ValidationError::new(
                    "labels",
                    format!("value of {k:?} is not a valid label value"),
                ));
            }
            out.insert(k, v);
        }
        Ok(Self(out))
    }
}

fn validate_label_key(k: &str) -> Result<(), ValidationError> {
    let ok = !k.is_empty()
        && k.len() <= 63
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/'));
    if ok {
        Ok(())
    } else {
        Err(ValidationError::new(
            "labels",
            format!("{k:?} is not a label key (1-63 of letters, digits, '-', '_', '.', '/')"),
        ))
    }
}

impl FromStr for Labels {
    type Err = ValidationError;
    /// Parses `k=v,k2=v2` (empty string: no labels).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut pairs = Vec::new();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| {
                ValidationError::new("labels", format!("{item:?} is not key=value"))
            })?;
            pairs.push((k.trim().to_owned(), v.trim().to_owned()));
        }
        Self::from_map(pairs)
    }
}

impl fmt::Display for Labels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        f.write_str(&parts.join(","))
    }
}

/// Converts a duration to protobuf.
pub fn to_proto_duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// Converts a protobuf duration back; negative durations are refused.
pub fn from_proto_duration(
    d: &prost_types::Duration,
    field: &'static str,
) -> Result<Duration, ValidationError> {
    if d.seconds < 0 || d.nanos < 0 {
        return Err(ValidationError::new(field, "is negative"));
    }
    Ok(Duration::new(d.seconds as u64, d.nanos as u32))
}

/// What one checkpoint may hold ([`pb::CheckpointLimits`], and the runner's
/// `--max-file-size` / `--max-total-size`); `None` is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointLimits {
    /// Files larger than this are left out.
    pub max_file_bytes: Option<u64>,
    /// The logical size of all file contents but repository and
    /// conversation files; the largest files are left out until the rest
    /// fits.
    pub max_total_bytes: Option<u64>,
}

impl CheckpointLimits {
    pub fn is_unlimited(&self) -> bool {
        self.max_file_bytes.is_none() && self.max_total_bytes.is_none()
    }

    /// Each limit the lower of the two, where either sets it: a run's
    /// limits can tighten a runner's, never loosen them.
    pub fn stricter(self, other: Self) -> Self {
        let lower = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Self {
            max_file_bytes: lower(self.max_file_bytes, other.max_file_bytes),
            max_total_bytes: lower(self.max_total_bytes, other.max_total_bytes),
        }
    }
}

impl From<pb::CheckpointLimits> for CheckpointLimits {
    /// Every value is valid: 0 is "no limit" on the wire.
    fn from(limits: pb::CheckpointLimits) -> Self {
        let set = |bytes: u64| (bytes != 0).then_some(bytes);
        Self {
            max_file_bytes: set(limits.max_file_bytes),
            max_total_bytes: set(limits.max_total_bytes),
        }
    }
}

impl From<CheckpointLimits> for pb::CheckpointLimits {
    fn from(limits: CheckpointLimits) -> Self {
        Self {
            max_file_bytes: limits.max_file_bytes.unwrap_or(0),
            max_total_bytes: limits.max_total_bytes.unwrap_or(0),
        }
    }
}

/// Stations: a task's stages (implement, review, …). Same rules as names.
pub fn validate_station(station: &str) -> Result<(), ValidationError> {
    crate::domain::validate_name(station).map_err(|e| ValidationError::new("station", e.reason))
}

/// The harness adapters every runner has, each with the settings it accepts
/// (`HarnessSpec.config` keys). The coordinator refuses a run whose harness
/// or settings are not here, so a typo fails at `runs create`, not on a host.
pub const HARNESS_ADAPTERS: &[(&str, &[&str])] = &[
    ("claude", CLAUDE_SETTINGS),
    ("codex", CODEX_SETTINGS),
    ("gemini", GEMINI_SETTINGS),
    ("pi", PI_SETTINGS),
    ("opencode", OPENCODE_SETTINGS),
    ("goose", GOOSE_SETTINGS),
    ("openhands", OPENHANDS_SETTINGS),
    ("aider", AIDER_SETTINGS),
    ("command", COMMAND_SETTINGS),
];

/// The settings of the adapters of agent CLIs (all but OpenHands).
const AGENT_CLI_SETTINGS: &[&str] = &["binary", "model", "args", "cwd", "credentials_dir"];

/// Settings of the Claude Code adapter (docs/harnesses.md).
pub const CLAUDE_SETTINGS: &[&str] = AGENT_CLI_SETTINGS;

/// Settings of the Codex CLI adapter (docs/harnesses.md).
pub const CODEX_SETTINGS: &[&str] = AGENT_CLI_SETTINGS;

/// Settings of the Gemini CLI adapter (docs/harnesses.md).
pub const GEMINI_SETTINGS: &[&str] = AGENT_CLI_SETTINGS;

/// Settings of the pi adapter (docs/harnesses.md).
pub const PI_SETTINGS: &[&str] = AGENT_CLI_SETTINGS;

/// Settings of the opencode adapter (docs/harnesses.md).
pub const OPENCODE_SETTINGS: &[&str] = AGENT_CLI_SETTINGS;

/// Settings of the goose adapter (docs/harnesses.md).
pub const GOOSE_SETTINGS: &[&str] = AGENT_CLI_SETTINGS;

/// Settings of the OpenHands CLI adapter (docs/harnesses.md). OpenHands
/// takes its model from its own settings file, so there is no `model`.
pub const OPENHANDS_SETTINGS: &[&str] = &["binary", "args", "cwd", "credentials_dir"];

/// Settings of the Aider adapter (docs/harnesses.md).
pub const AIDER_SETTINGS: &[&str] = AGENT_CLI_SETTINGS;

/// Settings of the templated `command` adapter (docs/harnesses.md).
pub const COMMAND_SETTINGS: &[&str] = &["start", "resume", "session_regex", "session_lost", "cwd"];

/// The settings of harness adapter `name`, if there is one.
pub fn harness_settings(name: &str) -> Option<&'static [&'static str]> {
    HARNESS_ADAPTERS
        .iter()
        .find(|(adapter, _)| *adapter == name)
        .map(|(_, settings)| *settings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_can_tighten_the_runners_limits_but_not_loosen_them() {
        let runner = CheckpointLimits {
            max_file_bytes: Some(100 << 20),
            max_total_bytes: None,
        };
        let run = CheckpointLimits::from(pb::CheckpointLimits {
            max_file_bytes: 1 << 30,
            max_total_bytes: 2 << 30,
        });
        let kept = runner.stricter(run);
        assert_eq!(kept.max_file_bytes, Some(100 << 20));
        assert_eq!(kept.max_total_bytes, Some(2 << 30));
        assert_eq!(kept, run.stricter(runner));
        let none = CheckpointLimits::from(pb::CheckpointLimits::default());
        assert!(none.is_unlimited());
        assert_eq!(runner.stricter(none), runner);
        assert_eq!(pb::CheckpointLimits::from(kept).max_file_bytes, 100 << 20);
    }

    #[test]
    fn labels_parse_and_match() {
        let run: Labels = "gpu=a100, zone=eu".parse().unwrap();
        let host: Labels = "zone=eu,gpu=a100,arch=x86".parse().unwrap();
        assert!(run.satisfied_by(&host));
        let other: Labels = "zone=us".parse().unwrap();
        assert_eq!(run.unmet_by(&other), vec!["gpu=a100", "zone=eu"]);
        assert!("novalue".parse::<Labels>().is_err());
        assert!("".parse::<Labels>().unwrap().is_empty());
        assert_eq!(run.to_string(), "gpu=a100,zone=eu");
    }

    #[test]
    fn states_round_trip() {
        for s in RunState::ALL {
            assert_eq!(s.as_str().parse::<RunState>().unwrap(), *s);
            let wire: pb::RunState = (*s).into();
            assert_eq!(RunState::try_from(wire as i32).unwrap(), *s);
        }
        assert!(RunState::try_from(0).is_err());
        assert!(RunState::Cancelled.is_terminal());
        assert!(!RunState::Suspended.is_terminal());
    }
}
