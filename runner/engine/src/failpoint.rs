//! Failpoints: named places where tests make a real process fail on purpose.
//!
//! Set `CAIRN_FAILPOINTS=name=action[,name=action…]` in the environment of a
//! cairn process. Actions:
//! - `pause`: print `failpoint <name> reached` on stderr and sleep until
//!   killed (tests SIGKILL the process at exactly that point);
//! - `exit`: exit at once with status 101, as if the process had crashed;
//! - `error`: make the operation fail with an error naming the failpoint.
//!
//! Without the variable every failpoint is a no-op.

use std::collections::HashMap;
use std::io::Write;
use std::sync::OnceLock;

/// The environment variable that arms failpoints.
pub const ENV: &str = "CAIRN_FAILPOINTS";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Pause,
    Exit,
    Error,
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

/// Evaluates the failpoint `name`.
pub fn hit(name: &'static str) -> Result<(), FailpointError> {
    match armed().get(name) {
        None => Ok(()),
        Some(Action::Error) => Err(FailpointError(name)),
        Some(Action::Exit) => {
            eprintln!("failpoint {name} reached: exiting");
            std::process::exit(101);
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
