//! Running blocking work (file I/O, hashing, sealing) off the async runtime.

/// Runs `work` on tokio's blocking pool and returns what it returns.
///
/// A panic in `work` is passed on to the caller, exactly as a panic in the
/// caller's own code would be: a worker's panic is a bug in the engine, not
/// a condition a caller can handle, and its message and location survive.
/// (A blocking task is never cancelled while it is awaited: the runtime
/// only drops it at shutdown, together with the task awaiting it.)
pub async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(work).await {
        Ok(value) => value,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => panic!("a blocking task was cancelled while awaited: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn returns_the_value_and_passes_a_panic_on() {
        assert_eq!(blocking(|| 6 * 7).await, 42);
        let panicked = tokio::spawn(blocking(|| -> u8 { panic!("worker bug") }))
            .await
            .expect_err("the panic reaches the caller");
        let message = panicked.into_panic();
        assert_eq!(message.downcast_ref::<&str>(), Some(&"worker bug"));
    }
}
