//! Group commit: requests of one kind that arrive while a transaction of
//! theirs is running wait, then share the next transaction.
//!
//! Every write transaction ends with a commit that waits for the disk (on
//! SQLite, `synchronous = FULL`: an fsync of the log), and on SQLite only
//! one writes at a time. Under load that makes the commit the limit when
//! each request pays for one. Here a request joins a queue; whoever finds no
//! transaction running starts a drainer task, which takes everything
//! queued (up to [`MAX_BATCH`]), runs it in one transaction through the
//! kind's batch function, hands each request its own result, and goes on
//! until the queue is empty. One request alone still runs at once, in a
//! transaction of its own; a burst costs a commit per batch, not per
//! request.
//!
//! The batch runs in a task of its own, so a caller that goes away (a
//! cancelled RPC) never abandons the others' transaction halfway.
//!
//! The same queue batches reads that many callers make at once (heartbeats
//! answered without a write): a batch reads for all of them in a few
//! statements, as each statement costs two thread hops on SQLite.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use futures::future::BoxFuture;
use tokio::sync::oneshot;

use sqlx::AnyConnection;

use super::{DbError, MetadataStore, TxLock, WriteTx, query_error};

/// Most requests one transaction carries: bounds how long the write lock
/// is held at once, and so how long anything else waits for it.
pub(crate) const MAX_BATCH: usize = 64;

/// Runs a batch in one transaction: one result per request, in order.
pub(crate) type BatchFn<T, A> =
    fn(MetadataStore, Vec<T>) -> BoxFuture<'static, Vec<Result<A, DbError>>>;

/// The queue of one kind of request, answered with an `A` each. Clones
/// share the queue.
pub(crate) struct GroupCommit<T, A> {
    queue: Arc<Mutex<Queue<T, Result<A, DbError>>>>,
    run: BatchFn<T, A>,
    drainer: Drainer,
    /// How many batches may run at once: one for writes, whose batches
    /// take turns anyway; more for reads where the database serves them
    /// side by side, so a burst is not read one batch after another.
    drainers: usize,
    /// Most requests one batch takes.
    max_batch: usize,
}

/// Where a queue's batches run.
#[derive(Debug, Clone, Copy)]
enum Drainer {
    /// On the writer thread (see [`writer`]): batches that write.
    Writer,
    /// On the runtime of the caller that started the drainer: batches that
    /// only read, which must not wait behind the writer.
    Caller,
}

impl<T, A> Clone for GroupCommit<T, A> {
    fn clone(&self) -> Self {
        Self {
            queue: Arc::clone(&self.queue),
            run: self.run,
            drainer: self.drainer,
            drainers: self.drainers,
            max_batch: self.max_batch,
        }
    }
}

struct Queue<T, R> {
    waiting: Vec<(T, oneshot::Sender<R>)>,
    /// Drainer tasks running: each takes what is queued before it ends.
    draining: usize,
}

impl<T, A> GroupCommit<T, A>
where
    T: Send + 'static,
    A: Send + 'static,
{
    /// A queue of writes, run on the writer thread.
    pub(crate) fn new(run: BatchFn<T, A>) -> Self {
        Self::with_drainer(run, Drainer::Writer, 1, MAX_BATCH)
    }

    /// A queue of reads, run beside their callers, up to `drainers`
    /// batches of up to `max_batch` requests at once.
    pub(crate) fn reads(run: BatchFn<T, A>, drainers: usize, max_batch: usize) -> Self {
        Self::with_drainer(
            run,
            Drainer::Caller,
            drainers.max(1),
            max_batch.clamp(1, MAX_BATCH),
        )
    }

    fn with_drainer(
        run: BatchFn<T, A>,
        drainer: Drainer,
        drainers: usize,
        max_batch: usize,
    ) -> Self {
        Self {
            queue: Arc::new(Mutex::new(Queue {
                waiting: Vec::new(),
                draining: 0,
            })),
            run,
            drainer,
            drainers,
            max_batch,
        }
    }

    /// Queues `request` and waits for its result.
    pub(crate) async fn submit(&self, store: &MetadataStore, request: T) -> Result<A, DbError> {
        let (answer, answered) = oneshot::channel();
        let start_drainer = {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            queue.waiting.push((request, answer));
            let start = queue.draining < self.drainers;
            if start {
                queue.draining += 1;
            }
            start
        };
        if start_drainer {
            let drain = drain(
                Arc::clone(&self.queue),
                self.run,
                self.max_batch,
                store.clone(),
            );
            match self.drainer {
                Drainer::Writer => drop(writer().spawn(drain)),
                Drainer::Caller => drop(tokio::spawn(drain)),
            }
        }
        answered.await.unwrap_or_else(|_| {
            Err(DbError::Batch {
                retryable: true,
                message: "the batch this request shared with others was abandoned (see the coordinator's log)".to_owned(),
            })
        })
    }
}

/// The runtime drainers run on: one thread of its own. A drainer is the
/// one writer every request of its kind waits for, and each of its
/// statements wakes it from a database thread; on the server's busy
/// workers that wakeup waits behind every queued task (heartbeats,
/// reads), so the writer would crawl while the readers it serves pile up.
fn writer() -> &'static tokio::runtime::Handle {
    static WRITER: OnceLock<tokio::runtime::Handle> = OnceLock::new();
    WRITER.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("cairn-db-writer")
            .build()
            .expect("the database writer's runtime starts");
        let handle = runtime.handle().clone();
        std::thread::Builder::new()
            .name("cairn-db-writer".into())
            .spawn(move || runtime.block_on(std::future::pending::<()>()))
            .expect("the database writer's thread starts");
        handle
    })
}

/// Runs batches until the queue is empty.
async fn drain<T, A>(
    queue: Arc<Mutex<Queue<T, Result<A, DbError>>>>,
    run: BatchFn<T, A>,
    max_batch: usize,
    store: MetadataStore,
) {
    // Should a batch panic, the next request starts a new drainer rather
    // than waiting for this one forever; the panicked batch's callers see
    // their answers dropped.
    let mut release = Release {
        queue: &queue,
        armed: true,
    };
    loop {
        let batch = {
            let mut queue = queue.lock().unwrap_or_else(PoisonError::into_inner);
            if queue.waiting.is_empty() {
                queue.draining -= 1;
                release.armed = false;
                return;
            }
            let take = queue.waiting.len().min(max_batch);
            queue.waiting.drain(..take).collect::<Vec<_>>()
        };
        let (requests, answers): (Vec<T>, Vec<_>) = batch.into_iter().unzip();
        let count = requests.len();
        let results = run(store.clone(), requests).await;
        if results.len() != count {
            tracing::error!(
                requests = count,
                results = results.len(),
                "a group commit answered a different number of requests than it was given"
            );
        }
        for (answer, result) in answers.into_iter().zip(results) {
            // A caller that went away no longer wants its answer.
            let _ = answer.send(result);
        }
    }
}

struct Release<'a, T, R> {
    queue: &'a Mutex<Queue<T, R>>,
    armed: bool,
}

impl<T, R> Drop for Release<'_, T, R> {
    fn drop(&mut self) {
        if self.armed {
            self.queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .draining -= 1;
        }
    }
}

impl<T, A> std::fmt::Debug for GroupCommit<T, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("GroupCommit")
            .field("waiting", &queue.waiting.len())
            .field("draining", &queue.draining)
            .finish()
    }
}

/// What a batch's writes hold while they run, on PostgreSQL (SQLite has
/// one writer whatever is asked; see [`MetadataStore::begin_batch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Locking {
    /// The write lock, all of them: the batch reads what it decides on,
    /// and no other writer may change that meanwhile.
    All,
    /// Written at once ([`WriteRequest::write_all`]): nothing at first
    /// ([`TxLock::Nothing`]), beside the write lock's holders, as nothing
    /// it writes is what they decide on without re-checking it in the
    /// statement that acts. Written one by one: the host-rows turn, then
    /// the write lock.
    OneByOne,
    /// Nothing: every request only inserts rows under ids made for it.
    None,
}

impl Locking {
    fn at_once(self) -> TxLock {
        match self {
            Self::All => TxLock::Write,
            Self::OneByOne => TxLock::Nothing,
            Self::None => TxLock::Nothing,
        }
    }

    fn one_by_one(self) -> TxLock {
        match self {
            Self::All => TxLock::Write,
            Self::OneByOne => TxLock::HostRowsThenWrite,
            Self::None => TxLock::Nothing,
        }
    }
}

/// A request that writes in a write transaction it may share.
pub(crate) trait WriteRequest: Sized + Send + Sync + 'static {
    type Answer: Send + 'static;

    /// Which of this batch's writes take the write lock.
    fn locking(_batch: &[Self]) -> Locking {
        Locking::All
    }

    /// Whether [`Self::write_all`] can write this batch; most kinds write
    /// one by one.
    fn writes_all_at_once(_batch: &[Self]) -> bool {
        false
    }

    /// Writes a batch at once in a few statements (only called where
    /// [`Self::writes_all_at_once`] says so): one entry per request, in
    /// order, its answer or `None` for a request it leaves to be written on
    /// its own afterwards (as if it had come after the others). On any error
    /// what it wrote is undone and the requests are written one by one, so
    /// each gets its own answer.
    fn write_all<'a>(
        _batch: &'a [Self],
        _tx: &'a mut WriteTx,
    ) -> BoxFuture<'a, Result<Vec<Option<Self::Answer>>, DbError>> {
        Box::pin(async { Err(DbError::Invalid("this kind is written one by one".into())) })
    }

    /// Writes this request inside `tx`; what it writes is undone if it
    /// fails.
    fn write(self, tx: &mut WriteTx) -> BoxFuture<'_, Result<Self::Answer, DbError>>;
}

/// The [`BatchFn`] of [`WriteRequest`]s: see [`write_together`].
pub(crate) fn write_batch<T: WriteRequest>(
    store: MetadataStore,
    batch: Vec<T>,
) -> BoxFuture<'static, Vec<Result<T::Answer, DbError>>> {
    Box::pin(async move { write_together(&store, batch).await })
}

/// Writes `batch`: at once where the kind can ([`WriteRequest::write_all`]),
/// the rest one by one, each in a savepoint of its own when it shares the
/// transaction, so one that fails leaves the others: one result per
/// request, in order. Usually one transaction; two when what was written at
/// once holds no write lock and the rest must (that transaction commits
/// before the lock is asked for: waiting for it while holding the rows
/// written could deadlock with a holder that waits for those rows).
pub(crate) async fn write_together<T: WriteRequest>(
    store: &MetadataStore,
    batch: Vec<T>,
) -> Vec<Result<T::Answer, DbError>> {
    let total = batch.len();
    let locking = T::locking(&batch);
    let (at_once_lock, one_by_one_lock) = (
        store.effective(locking.at_once()),
        store.effective(locking.one_by_one()),
    );
    // Answers written at once (empty when nothing was), and the transaction
    // they are in if it is still open (the rest is written in it too).
    let mut at_once: Vec<Option<T::Answer>> = Vec::new();
    let mut open = None;
    // One request alone is written at once only where that spares the lock.
    if T::writes_all_at_once(&batch) && (total > 1 || at_once_lock != TxLock::Write) {
        let mut tx = match store.begin_batch(at_once_lock).await {
            Ok(tx) => tx,
            Err(e) => return fail_all(total, &e),
        };
        match T::write_all(&batch, &mut tx).await {
            Ok(answers) if answers.len() == total => {
                let rest_locked_apart = one_by_one_lock != at_once_lock;
                if rest_locked_apart && answers.iter().any(Option::is_none) {
                    if let Err(e) = store.commit(tx).await {
                        return fail_all(total, &e);
                    }
                } else {
                    open = Some(tx);
                }
                at_once = answers;
            }
            outcome => {
                if let Err(e) = outcome {
                    tracing::debug!(error = %e, requests = total, "a batch is written one by one");
                }
                // It was the transaction's first work: undoing the
                // transaction undoes it (cheaper than a savepoint around
                // every batch that succeeds).
                if let Err(e) = tx.rollback().await {
                    return fail_all(total, &e);
                }
            }
        }
    }
    let at_once_in_open = open.is_some();
    let rest = if at_once.is_empty() {
        total
    } else {
        at_once.iter().filter(|answer| answer.is_none()).count()
    };
    // Each result, and whether it waits for `open` to commit.
    let mut results: Vec<(Result<T::Answer, DbError>, bool)> = Vec::with_capacity(total);
    let mut at_once = at_once.into_iter();
    // When everything was answered at once, `open` holds it and the loop
    // below only collects the answers.
    let mut tx = match open {
        Some(tx) => tx,
        None => match store.begin_batch(one_by_one_lock).await {
            Ok(tx) => tx,
            Err(e) => {
                // What was written at once is committed; the rest is not.
                let left = at_once.map(|answer| answer.ok_or_else(|| batch_error(&e)));
                return left.collect();
            }
        },
    };
    // Alone in its transaction, a request needs no savepoint: undoing
    // the transaction undoes it.
    let savepoints = rest > 1 || at_once_in_open;
    let mut failed_alone = false;
    for request in batch {
        if let Some(Some(answer)) = at_once.next() {
            results.push((Ok(answer), at_once_in_open));
            continue;
        }
        if !savepoints {
            let written = request.write(&mut tx).await;
            failed_alone = written.is_err();
            results.push((written, true));
            continue;
        }
        if let Err(e) = begin_savepoint(tx.conn()).await {
            return fail_pending(results, total, &e);
        }
        // Runs a failed request touched are not announced.
        let announced = tx.changed_runs.clone();
        let written = request.write(&mut tx).await;
        if written.is_err() {
            tx.changed_runs = announced;
        }
        let ended = end_savepoint(tx.conn(), written.is_ok()).await;
        results.push((written, true));
        if let Err(e) = ended {
            return fail_pending(results, total, &e);
        }
    }
    if failed_alone {
        // Nothing else is in it; an error undoing it is the next
        // transaction's to find.
        if let Err(e) = tx.rollback().await {
            tracing::debug!(error = %e, "could not roll back a failed request's transaction");
        }
        return results.into_iter().map(|(result, _)| result).collect();
    }
    match store.commit(tx).await {
        Ok(()) => results.into_iter().map(|(result, _)| result).collect(),
        Err(e) => fail_pending(results, total, &e),
    }
}

/// The results of a batch whose transaction failed as a whole (its begin,
/// a savepoint, or its commit) with `cause`: requests that had succeeded
/// in it, and those not reached, fail with the shared cause; requests that
/// had failed on their own keep their own error, and those committed in an
/// earlier transaction (`false` beside them) keep their answer.
fn fail_pending<A>(
    done: Vec<(Result<A, DbError>, bool)>,
    total: usize,
    cause: &DbError,
) -> Vec<Result<A, DbError>> {
    let reached = done.len();
    done.into_iter()
        .map(|(result, pending)| match result {
            Ok(_) if pending => Err(batch_error(cause)),
            kept => kept,
        })
        .chain((reached..total).map(|_| Err(batch_error(cause))))
        .collect()
}

/// What a request gets when the transaction it shared failed with `cause`.
fn batch_error(cause: &DbError) -> DbError {
    DbError::Batch {
        retryable: cause.is_retryable(),
        message: cause.to_string(),
    }
}

/// The results of a batch whose transaction failed as a whole (its begin,
/// a savepoint, or its commit) with `cause`: requests that had succeeded
/// inside it, and those not reached, fail with the shared cause; requests
/// that had failed on their own keep their own error.
pub(crate) fn fail_batch<A, R>(
    done: Vec<Result<A, DbError>>,
    total: usize,
    cause: &DbError,
) -> Vec<Result<R, DbError>> {
    let failed = done
        .into_iter()
        .map(|result| (result.and_then(|_| Err(batch_error(cause))), false))
        .collect();
    fail_pending(failed, total, cause)
}

/// Starts the savepoint one request of a batch runs in.
pub(crate) async fn begin_savepoint(conn: &mut AnyConnection) -> Result<(), DbError> {
    sqlx::query("SAVEPOINT batch_request")
        .execute(conn)
        .await
        .map(drop)
        .map_err(query_error("start a request's savepoint"))
}

/// Ends the savepoint [`begin_savepoint`] started: keeps what the request
/// wrote, or undoes it (a refused request leaves nothing behind, and on
/// PostgreSQL a failed statement no longer aborts the whole transaction).
pub(crate) async fn end_savepoint(conn: &mut AnyConnection, keep: bool) -> Result<(), DbError> {
    if !keep {
        sqlx::query("ROLLBACK TO SAVEPOINT batch_request")
            .execute(&mut *conn)
            .await
            .map_err(query_error("undo a request's savepoint"))?;
    }
    sqlx::query("RELEASE SAVEPOINT batch_request")
        .execute(conn)
        .await
        .map(drop)
        .map_err(query_error("release a request's savepoint"))
}

/// The results of a batch whose transaction could not even start.
pub(crate) fn fail_all<R>(total: usize, cause: &DbError) -> Vec<Result<R, DbError>> {
    fail_pending(Vec::new(), total, cause)
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// Batches running now, the most seen at once, and the permits that let
    /// one finish (the batch function is a plain `fn`: it reaches these
    /// through statics, which no other test uses).
    static RUNNING: AtomicUsize = AtomicUsize::new(0);
    static MOST: AtomicUsize = AtomicUsize::new(0);
    static LARGEST: AtomicUsize = AtomicUsize::new(0);
    static FINISH: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

    fn held_batch(
        _store: MetadataStore,
        batch: Vec<u32>,
    ) -> BoxFuture<'static, Vec<Result<u32, DbError>>> {
        Box::pin(async move {
            let now = RUNNING.fetch_add(1, Ordering::SeqCst) + 1;
            MOST.fetch_max(now, Ordering::SeqCst);
            LARGEST.fetch_max(batch.len(), Ordering::SeqCst);
            FINISH.acquire().await.expect("never closed").forget();
            RUNNING.fetch_sub(1, Ordering::SeqCst);
            batch.into_iter().map(|n| Ok(n * 10)).collect()
        })
    }

    async fn until_running(n: usize) {
        tokio::time::timeout(Duration::from_secs(30), async {
            while RUNNING.load(Ordering::SeqCst) != n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{n} batches never ran at once"));
    }

    #[tokio::test]
    async fn a_read_queue_runs_up_to_its_drainers_batches_at_once_and_answers_each() {
        let (_dir, store, _tenant) = crate::db::tests::open().await;
        let queue = GroupCommit::reads(held_batch, 2, 2);
        let submit = |n: u32| {
            let (queue, store) = (queue.clone(), store.clone());
            tokio::spawn(async move { queue.submit(&store, n).await })
        };
        let first = submit(1);
        until_running(1).await;
        let second = submit(2);
        until_running(2).await;
        // Both drainers are busy: these wait, and share the next batches,
        // two at most each.
        let rest: Vec<_> = (3..=5).map(submit).collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(RUNNING.load(Ordering::SeqCst), 2, "no third batch starts");
        FINISH.add_permits(100);
        let mut answers = vec![
            first.await.unwrap().unwrap(),
            second.await.unwrap().unwrap(),
        ];
        for waiting in rest {
            answers.push(waiting.await.unwrap().unwrap());
        }
        assert_eq!(answers, [10, 20, 30, 40, 50], "each gets its own answer");
        assert_eq!(MOST.load(Ordering::SeqCst), 2);
        assert_eq!(LARGEST.load(Ordering::SeqCst), 2, "no batch over two");
        assert_eq!(RUNNING.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_failed_batch_keeps_each_requests_own_error_and_fails_the_rest() {
        let cause = DbError::Corrupt("disk went away".into());
        let done: Vec<Result<u32, DbError>> = vec![Ok(1), Err(DbError::NotFound("run x".into()))];
        let results: Vec<Result<u32, DbError>> = fail_batch(done, 4, &cause);
        assert_eq!(results.len(), 4);
        let messages: Vec<String> = results
            .iter()
            .map(|r| r.as_ref().unwrap_err().to_string())
            .collect();
        assert_eq!(
            messages,
            [
                "metadata is inconsistent: disk went away",
                "run x",
                "metadata is inconsistent: disk went away",
                "metadata is inconsistent: disk went away",
            ]
        );
        assert!(matches!(
            results[0],
            Err(DbError::Batch {
                retryable: false,
                ..
            })
        ));
    }
}
