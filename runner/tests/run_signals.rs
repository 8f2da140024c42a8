//! `cairn-runner run` stops on a real SIGTERM: the handler it installs
//! cancels the attempt's shutdown token (the state machine's tests drive
//! that token directly). A test binary of its own, since the handler stays
//! installed for the rest of the process.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn sigterm_cancels_the_attempt_instead_of_killing_the_runner() {
    let token = CancellationToken::new();
    cairn_runner::run::cancel_on_signals(token.clone()).unwrap();
    assert!(!token.is_cancelled());
    // SAFETY: signalling our own process; the handler above catches it.
    unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
    tokio::time::timeout(Duration::from_secs(30), token.cancelled())
        .await
        .expect("the signal cancels the token, and the process lives on");
}
