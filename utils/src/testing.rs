//! For tests that start another package's binary.

use std::path::PathBuf;

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
