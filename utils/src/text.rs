//! Words for people: counts, ages, and errors on one line.

use std::time::SystemTime;

/// `1 file`, `2 files`.
pub fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// How long ago `then` was, coarsely: `42s ago`, `5m ago`, `3h ago`, `2d ago`.
pub fn human_age(then: SystemTime) -> String {
    match SystemTime::now().duration_since(then) {
        Ok(d) if d.as_secs() < 60 => format!("{}s ago", d.as_secs()),
        Ok(d) if d.as_secs() < 3600 => format!("{}m ago", d.as_secs() / 60),
        Ok(d) if d.as_secs() < 86_400 => format!("{}h ago", d.as_secs() / 3600),
        Ok(d) => format!("{}d ago", d.as_secs() / 86_400),
        Err(_) => "just now".into(),
    }
}

/// An error and its causes on one line, each cause said once.
pub fn one_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::time::Duration;

    use super::*;

    #[test]
    fn counts_and_ages_read_naturally() {
        assert_eq!(plural(1, "file", "files"), "1 file");
        assert_eq!(plural(0, "file", "files"), "0 files");
        let ago = |secs| human_age(SystemTime::now() - Duration::from_secs(secs));
        assert_eq!(ago(5), "5s ago");
        assert_eq!(ago(300), "5m ago");
        assert_eq!(ago(3 * 3600), "3h ago");
        assert_eq!(ago(2 * 86_400), "2d ago");
        assert_eq!(
            human_age(SystemTime::now() + Duration::from_secs(60)),
            "just now"
        );
    }

    #[test]
    fn error_causes_are_said_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer: {0}")]
        struct Outer(#[source] Inner);
        #[derive(Debug, thiserror::Error)]
        #[error("inner")]
        struct Inner(#[source] io::Error);
        let e = Outer(Inner(io::Error::other("disk on fire")));
        assert_eq!(one_line(&e), "outer: inner: disk on fire");
    }
}
