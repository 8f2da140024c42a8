//! Processes as the host agent and the runner see them: exit statuses in
//! words, process groups, and the fields of `/proc/<pid>/stat`.

use std::io;
use std::process::ExitStatus;

/// A wait status as one number: the exit status, or `-N` for signal N
/// (the convention of cairn's sandbox and attempt records).
pub fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt as _;
    match status.code() {
        Some(code) => code,
        None => -status.signal().unwrap_or(0),
    }
}

/// An [`exit_code`] for people (`None`: the status could not be learned).
pub fn describe_exit(code: Option<i32>) -> String {
    match code {
        Some(n) if n < 0 => format!("was killed by signal {}", -n),
        Some(n) => format!("exited with status {n}"),
        None => "ended (exit status unknown)".to_owned(),
    }
}

/// `exited with status 1`, `was killed by signal 9`.
pub fn describe_status(status: ExitStatus) -> String {
    describe_exit(Some(exit_code(status)))
}

/// Sends `signal` to process group `pgid` (a gone group is not an error).
pub fn signal_group(pgid: i32, signal: libc::c_int) {
    // SAFETY: killpg takes no pointers.
    let rc = unsafe { libc::killpg(pgid, signal) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ESRCH) {
            tracing::warn!(pgid, signal, error = %err, "cannot signal a process group");
        }
    }
}

/// Live (not zombie) processes whose session is `sid`.
pub fn session_members(sid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| matches!(read_stat(pid), Some(s) if s.session == sid && !s.is_zombie()))
        .collect()
}

/// The fields of `/proc/<pid>/stat` the host agent and the demo need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub state: char,
    pub parent: i32,
    pub group: i32,
    pub session: i32,
    pub start_time: u64,
}

impl ProcStat {
    pub fn is_zombie(&self) -> bool {
        self.state == 'Z'
    }
}

/// Reads `/proc/<pid>/stat`; `None` when the process does not exist.
pub fn read_stat(pid: i32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Parses the text of `/proc/<pid>/stat`; `None` when it is malformed.
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    // The command name (field 2) may contain spaces and ')'; fields resume after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Numbering from `man proc`: field 3 is state, 4 ppid, 5 pgrp, 6 session, 22 starttime.
    Some(ProcStat {
        state: fields.first()?.chars().next()?,
        parent: fields.get(1)?.parse().ok()?,
        group: fields.get(2)?.parse().ok()?,
        session: fields.get(3)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_signal_convention() {
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(9)), -9);
        assert_eq!(
            describe_status(ExitStatus::from_raw(9)),
            "was killed by signal 9"
        );
        assert_eq!(describe_exit(Some(-15)), "was killed by signal 15");
        assert_eq!(describe_exit(Some(0)), "exited with status 0");
        assert_eq!(describe_exit(None), "ended (exit status unknown)");
    }

    #[test]
    fn parses_proc_stat_with_odd_command_names() {
        let line = "4242 (we ird) name)) S 17 4240 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 \
                    200 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        let stat = parse_stat(line).unwrap();
        assert_eq!(
            stat,
            ProcStat {
                state: 'S',
                parent: 17,
                group: 4240,
                session: 4242,
                start_time: 987654
            }
        );
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn reads_its_own_stat() {
        let me = std::process::id() as i32;
        let stat = read_stat(me).unwrap();
        assert!(stat.start_time > 0);
        // SAFETY: getsid takes no pointers.
        assert_eq!(stat.session, unsafe { libc::getsid(0) });
    }

    #[test]
    fn statuses_are_described_in_words() {
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(
            describe_status(ExitStatus::from_raw(1 << 8)),
            "exited with status 1"
        );
        assert_eq!(
            describe_status(ExitStatus::from_raw(9)),
            "was killed by signal 9"
        );
    }
}
