//! Failpoints: named places where tests make a real process fail on purpose.
//!
//! Set `CAIRN_FAILPOINTS=name=action[,name=action…]` in the environment of a
//! cairn process. Actions:
//! - `pause`: print `failpoint <name> reached` on stderr and sleep until
//!   killed (tests SIGKILL the process at exactly that point);
//! - `exit`: exit at once with status 101, as if the process had crashed;
//! - `error`: make the operation fail with an error naming the failpoint;
//! - `stop`: print `failpoint <name> reached: stopped` on stderr and stop
//!   the process (SIGSTOP); it goes on where it was when sent SIGCONT, so a
//!   test can change the world at exactly that point (fill a disk) first.
//!
//! Without the variable every failpoint is a no-op.
//!
//! Tests that run a server in their own process interleave it with other
//! work at an async failpoint ([`hit_async`]) instead: [`pause`] arms it,
//! [`reached`] waits until a task stops there, [`release`] lets it go on.
//! Nothing else changes how a failpoint behaves.

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Mutex, OnceLock};

use tokio::sync::watch;

/// The environment variable that arms failpoints.
pub const ENV: &str = "CAIRN_FAILPOINTS";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Pause,
    Exit,
    Error,
    Stop,
}

fn armed() -> &'static HashMap<String, Action> {
    static ARMED: OnceLock<HashMap<String, Action>> = OnceLock::new();
    ARMED.get_or_init(|| {
        let Ok(spec) = std::env::var(ENV) else {
            return HashMap::new();
        };
        spec.split(',')
            .filter(|s| !s.trim().is_empty())
            .filter_map(|item| {
                let (name, action) = item.split_once('=')?;
                let action = match action.trim() {
                    "pause" => Action::Pause,
                    "exit" => Action::Exit,
                    "error" => Action::Error,
                    "stop" => Action::Stop,
                    other => {
                        eprintln!("{ENV}: unknown action {other:?} for {name}; ignored");
                        return None;
                    }
                };
                Some((name.trim().to_owned(), action))
            })
            .collect()
    })
}

/// A failpoint fired with the `error` action.
#[derive(Debug, thiserror::Error)]
#[error("failpoint {0} fired")]
pub struct FailpointError(pub &'static str);

/// Async failpoints paused in this process: whether a task stopped at the
/// point, and whether it may go on.
#[derive(Debug)]
struct Paused {
    reached: watch::Sender<bool>,
    released: watch::Sender<bool>,
}

fn paused() -> &'static Mutex<HashMap<&'static str, Paused>> {
    static PAUSED: OnceLock<Mutex<HashMap<&'static str, Paused>>> = OnceLock::new();
    PAUSED.get_or_init(Default::default)
}

/// Makes the next tasks that reach async failpoint `name` wait there until
/// [`release`]. Arming it again re-arms it.
pub fn pause(name: &'static str) {
    let mut paused = paused().lock().unwrap_or_else(|e| e.into_inner());
    paused.insert(
        name,
        Paused {
            reached: watch::channel(false).0,
            released: watch::channel(false).0,
        },
    );
}

/// Waits until a task stopped at async failpoint `name` (armed by [`pause`]).
pub async fn reached(name: &'static str) {
    let mut reached = {
        let paused = paused().lock().unwrap_or_else(|e| e.into_inner());
        paused
            .get(name)
            .unwrap_or_else(|| panic!("failpoint {name} is not paused"))
            .reached
            .subscribe()
    };
    let _ = reached.wait_for(|r| *r).await;
}

/// Lets every task waiting at `name` go on, and disarms it.
pub fn release(name: &'static str) {
    let mut paused = paused().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(point) = paused.remove(name) {
        point.released.send_replace(true);
    }
}

/// Evaluates the async failpoint `name`: like [`hit`], and also waits while
/// a test of this process paused it.
pub async fn hit_async(name: &'static str) -> Result<(), FailpointError> {
    let released = {
        let paused = paused().lock().unwrap_or_else(|e| e.into_inner());
        paused.get(name).map(|point| {
            point.reached.send_replace(true);
            point.released.subscribe()
        })
    };
    if let Some(mut released) = released {
        let _ = released.wait_for(|r| *r).await;
    }
    hit(name)
}

/// Evaluates the failpoint `name`.
pub fn hit(name: &'static str) -> Result<(), FailpointError> {
    match armed().get(name) {
        None => Ok(()),
        Some(Action::Error) => Err(FailpointError(name)),
        Some(Action::Exit) => {
            eprintln!("failpoint {name} reached: exiting");
            std::process::exit(101);
        }
        Some(Action::Stop) => {
            eprintln!("failpoint {name} reached: stopped");
            let _ = std::io::stderr().flush();
            // SAFETY: raise only sends this process a signal; SIGSTOP
            // cannot be caught, and the process resumes here on SIGCONT.
            unsafe { libc::raise(libc::SIGSTOP) };
            Ok(())
        }
        Some(Action::Pause) => {
            eprintln!("failpoint {name} reached");
            let _ = std::io::stderr().flush();
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_paused_failpoint_holds_its_task_until_released() {
        pause("test.point");
        let task = tokio::spawn(async {
            hit_async("test.point").await.unwrap();
            "went on"
        });
        reached("test.point").await;
        tokio::task::yield_now().await;
        assert!(!task.is_finished(), "the task waits at the point");
        release("test.point");
        assert_eq!(task.await.unwrap(), "went on");
        // Released points are disarmed: the next task does not wait.
        hit_async("test.point").await.unwrap();
    }
}
