//! End-to-end tests of issue 2: the real `cairn-coordinator`, `cairn-runner`
//! and `cairnctl` binaries, started the way a user or a sandbox would start
//! them (harness: the `cairn_e2e` library in tests/src/lib.rs).
//!
//! Run with `cargo build --bins && cargo nextest run -p cairn-e2e`
//! (`scripts/test` does both). Each test starts its own coordinator on
//! ephemeral ports, so they run in parallel.

mod cairnctl;
mod corruption;
mod fidelity;
mod hostile;
mod incremental;
mod partial;
mod signed_urls;
mod tokens;
