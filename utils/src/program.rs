//! How every cairn binary runs its `main`: one multi-threaded runtime,
//! and an error printed on stderr as `error: …` with its causes.

use std::error::Error;
use std::future::Future;
use std::process::ExitCode;

/// Runs `main` to completion: its exit code, or `FAILURE` after printing
/// its error with its causes, each said once ([`crate::text::one_line`]:
/// many errors name their cause in their own message, and a chain printed
/// whole would say it twice).
pub fn run<E>(main: impl Future<Output = Result<ExitCode, E>>) -> ExitCode
where
    E: Into<Box<dyn Error + Send + Sync + 'static>>,
{
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
            let error: Box<dyn Error + Send + Sync> = e.into();
            eprintln!("error: {}", crate::text::one_line(&*error));
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
