//! The regular expressions of the `command` adapter (`session_regex`,
//! `session_lost`), with the rule for what a pattern extracts.
//!
//! Syntax is the `regex` crate's (Perl-like, linear-time matching, no
//! backreferences or look-around). An invalid pattern is refused when the
//! harness is configured, with the parser's explanation.

use std::fmt;

/// A pattern that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("regular expression {pattern:?}: {reason}")]
pub struct PatternError {
    pub pattern: String,
    pub reason: String,
}

/// A compiled pattern.
#[derive(Clone)]
pub struct Pattern {
    regex: regex::Regex,
    /// The capture group `extract` returns.
    extract_group: usize,
}

impl fmt::Debug for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Pattern")
            .field(&self.regex.as_str())
            .finish()
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.regex.as_str())
    }
}

impl Pattern {
    pub fn new(source: &str) -> Result<Self, PatternError> {
        let regex = regex::RegexBuilder::new(source)
            .size_limit(1 << 20)
            .build()
            .map_err(|e| PatternError {
                pattern: source.to_owned(),
                reason: e.to_string(),
            })?;
        let extract_group = regex
            .capture_names()
            .position(|name| name == Some("id"))
            .unwrap_or(if regex.captures_len() > 1 { 1 } else { 0 });
        Ok(Self {
            regex,
            extract_group,
        })
    }

    pub fn is_match(&self, text: &str) -> bool {
        self.regex.is_match(text)
    }

    /// What the pattern picks out of `text`: the group named `id` if there is
    /// one, else group 1 if there is one, else the whole match.
    pub fn extract<'t>(&self, text: &'t str) -> Option<&'t str> {
        let captures = self.regex.captures(text)?;
        captures
            .get(self.extract_group)
            .map(|m| m.as_str())
            .filter(|s| !s.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extract_prefers_the_id_group_then_group_one_then_the_match() {
        let named = Pattern::new(r#"(x)?"thread_id":"(?P<id>[^"]+)""#).unwrap();
        assert_eq!(named.extract(r#"{"thread_id":"abc-1"}"#), Some("abc-1"));
        let first = Pattern::new(r"session (\w+) in (\w+)").unwrap();
        assert_eq!(first.extract("session s1 in cwd"), Some("s1"));
        let whole = Pattern::new(r"[0-9a-f]{8}").unwrap();
        assert_eq!(whole.extract("id deadbeef!"), Some("deadbeef"));
        assert_eq!(whole.extract("none"), None);
    }

    #[test]
    fn a_bad_pattern_is_refused_with_the_reason() {
        let err = Pattern::new("(x").unwrap_err();
        assert_eq!(err.pattern, "(x");
        assert!(err.reason.contains("unclosed"), "{}", err.reason);
    }
}
