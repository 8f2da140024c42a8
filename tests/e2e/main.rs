//! End-to-end tests: the real `cairn-coordinator`, `cairn-runner`,
//! `cairn-host`, `cairn-demo-agent` and `cairnctl` binaries, started the way a
//! user, a host or a sandbox would start them (harness: the `cairn_e2e`
//! library in tests/src/lib.rs, runs on hosts in tests/src/fleet.rs).
//!
//! Issue 2 (checkpoints): cairnctl, corruption, fidelity, hostile,
//! incremental, partial, signed_urls, tokens. Issue 3 (runs on hosts): runs
//! (hold, suspend, answer, resume elsewhere), hosts (lost host, stale runner,
//! SIGTERM and cancel, placement), ctl_runs (cairnctl runs/hosts/tokens),
//! demo (`cairnctl demo`). Issue 4: fork (`cairnctl workspace fork`, the
//! conversation forked), chats, stations (handover between stations: notes,
//! briefing, leftovers cleared, fast-forward). Issue 5: restore_speed (the
//! host's pack cache, warm and tampered; restore onto a baked older copy),
//! limits (per-checkpoint size limits, `--if-changed`), watch. Issue 28:
//! attacks (each token scope against what it must not reach), faults (the
//! coordinator SIGKILLed under concurrent checkpoints), server_limits
//! (floods, slow uploads, temp sweep), restore_space (small tmpfs), tls
//! (TLS on both listeners, CAIRN_CA, mutual TLS for hosts). Issue 30: layout
//! (the crate graph ARCHITECTURE.md promises, from `cargo metadata`).
//! Issue 31: retention (keep-last with churn, pins, forks outliving a
//! deleted source, a sweep cut short by a crash). Issue 32: s3_store
//! (`--store s3://…` against s3s-fs: checkpoints, restores and collection
//! through the bucket; refused start-ups). Issue 33: host_metrics
//! (`cairn-host --metrics-listen` after runs on a kept tree), image (the
//! runner image built here by scripts/runner-image; a run paused in a
//! podman container on one exec-driver host, resumed in one on another).
//! Issue 34: resume (orders pushed to hosts on WatchOrders, no heartbeat
//! waited for; a write made while the runner's change tracking arms is
//! kept), replicas (orders made on one replica reach a host watching the
//! other).
//! The issue-3 and -4 tests need root or user namespaces
//! (cairn-host's local driver) and fail saying so otherwise.
//!
//! Run with `cargo build --bins && cargo nextest run -p cairn-e2e`
//! (`scripts/test` does both). Each test starts its own coordinator on
//! ephemeral ports, so they run in parallel.

mod attacks;
mod cairnctl;
mod chats;
mod corruption;
mod ctl_runs;
mod database;
mod demo;
mod faults;
mod fidelity;
mod fork;
mod host_metrics;
mod hostile;
mod hosts;
mod image;
mod incremental;
mod layout;
mod limits;
mod partial;
mod replicas;
mod restore_space;
mod restore_speed;
mod resume;
mod retention;
mod runs;
mod s3_store;
mod server_limits;
mod signed_urls;
mod stations;
mod tls;
mod tokens;
mod watch;
