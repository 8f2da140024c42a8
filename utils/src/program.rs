//! How every cairn binary runs its `main`: one multi-threaded runtime,
//! and an error printed on stderr as `error: …` with its causes.

use std::fmt::Display;
use std::future::Future;
use std::process::ExitCode;

/// Runs `main` to completion: its exit code, or `FAILURE` after printing
/// its error (`{:#}`, so an `anyhow` error shows its whole chain).
pub fn run<E: Display>(main: impl Future<Output = Result<ExitCode, E>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(main) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("the disk is full")]
    struct Full;

    #[test]
    fn the_future_runs_on_a_runtime_and_its_code_or_error_becomes_the_exit() {
        let ran = run(async {
            tokio::task::yield_now().await;
            Ok::<_, Full>(ExitCode::from(3))
        });
        assert_eq!(ran, ExitCode::from(3));
        assert_eq!(run(async { Err::<ExitCode, _>(Full) }), ExitCode::FAILURE);
    }
}
