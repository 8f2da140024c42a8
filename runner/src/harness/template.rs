//! Command templates of the `command` adapter: split into words the way a
//! POSIX shell would (quotes and backslashes, no expansion), then
//! placeholders like `{message}` are filled in word by word — a message with
//! spaces or quotes stays exactly one argument, and nothing is ever handed
//! to a shell unless the template itself calls one (`sh -c '…'`).

use std::collections::BTreeMap;

/// A template that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("template {template:?} has an unterminated {quote} quote")]
    Unterminated {
        template: String,
        quote: &'static str,
    },
    #[error("template {template:?} ends in a lone backslash")]
    TrailingBackslash { template: String },
    #[error("template {template:?} is empty")]
    Empty { template: String },
    #[error("template {template:?} uses {{{name}}}, which is not one of {known}")]
    UnknownPlaceholder {
        template: String,
        name: String,
        known: String,
    },
    #[error("template {template:?} has an unclosed '{{' (write {{{{ for a literal brace)")]
    UnclosedBrace { template: String },
}

/// One word of a template: literal text and placeholders in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Placeholder(String),
}

/// A parsed command template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    words: Vec<Vec<Piece>>,
}

impl Template {
    /// Parses `source`, accepting only the placeholders in `known`.
    pub fn parse(source: &str, known: &[&str]) -> Result<Self, TemplateError> {
        let words = split(source)?;
        if words.is_empty() {
            return Err(TemplateError::Empty {
                template: source.to_owned(),
            });
        }
        let words = words
            .iter()
            .map(|word| pieces(source, word, known))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            source: source.to_owned(),
            words,
        })
    }

    /// Whether the template uses `{name}`.
    pub fn uses(&self, name: &str) -> bool {
        self.words
            .iter()
            .flatten()
            .any(|piece| matches!(piece, Piece::Placeholder(p) if p == name))
    }

    /// The argument vector with every placeholder filled in. Placeholders
    /// missing from `values` become empty text.
    pub fn render(&self, values: &BTreeMap<&str, String>) -> Vec<String> {
        self.words
            .iter()
            .map(|word| {
                word.iter()
                    .map(|piece| match piece {
                        Piece::Text(text) => text.as_str(),
                        Piece::Placeholder(name) => {
                            values.get(name.as_str()).map_or("", String::as_str)
                        }
                    })
                    .collect()
            })
            .collect()
    }

    pub fn source(&self) -> &str {
        &self.source
    }
}

/// Finds the placeholders of one word. Quoting does not hide a brace; `{{`
/// and `}}` stand for literal braces.
fn pieces(template: &str, word: &str, known: &[&str]) -> Result<Vec<Piece>, TemplateError> {
    let mut out = Vec::new();
    let mut text = String::new();
    let mut chars = word.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                text.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                text.push('}');
            }
            '{' => {
                let mut name = String::new();
                loop {
                    match chars.next().ok_or_else(|| TemplateError::UnclosedBrace {
                        template: template.to_owned(),
                    })? {
                        '}' => break,
                        c => name.push(c),
                    }
                }
                if !known.contains(&name.as_str()) {
                    return Err(TemplateError::UnknownPlaceholder {
                        template: template.to_owned(),
                        name,
                        known: known
                            .iter()
                            .map(|k| format!("{{{k}}}"))
                            .collect::<Vec<_>>()
                            .join(", "),
                    });
                }
                if !text.is_empty() {
                    out.push(Piece::Text(std::mem::take(&mut text)));
                }
                out.push(Piece::Placeholder(name));
            }
            c => text.push(c),
        }
    }
    if !text.is_empty() || out.is_empty() {
        out.push(Piece::Text(text));
    }
    Ok(out)
}

/// Splits like a POSIX shell: whitespace separates words; '…' is literal;
/// "…" keeps everything but lets `\` escape `"`, `\`, `$` and `` ` ``;
/// outside quotes `\` escapes the next character.
pub fn split(source: &str) -> Result<Vec<String>, TemplateError> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = source.chars();
    let unterminated = |quote| TemplateError::Unterminated {
        template: source.to_owned(),
        quote,
    };
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next().ok_or_else(|| unterminated("single"))? {
                        '\'' => break,
                        c => word.push(c),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next().ok_or_else(|| unterminated("double"))? {
                        '"' => break,
                        '\\' => match chars.next().ok_or_else(|| unterminated("double"))? {
                            c @ ('"' | '\\' | '$' | '`') => word.push(c),
                            '\n' => {}
                            c => {
                                word.push('\\');
                                word.push(c);
                            }
                        },
                        c => word.push(c),
                    }
                }
            }
            '\\' => match chars.next() {
                Some('\n') => {}
                Some(c) => {
                    in_word = true;
                    word.push(c);
                }
                None => {
                    return Err(TemplateError::TrailingBackslash {
                        template: source.to_owned(),
                    });
                }
            },
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_like_a_shell() {
        assert_eq!(
            split(r#"a  'b c' "d \"e\" $f" g\ h ''"#).unwrap(),
            ["a", "b c", r#"d "e" $f"#, "g h", ""]
        );
        assert_eq!(split("  ").unwrap(), Vec::<String>::new());
        assert!(matches!(
            split("a 'b").unwrap_err(),
            TemplateError::Unterminated {
                quote: "single",
                ..
            }
        ));
        assert!(matches!(
            split("a \"b").unwrap_err(),
            TemplateError::Unterminated {
                quote: "double",
                ..
            }
        ));
        assert!(matches!(
            split("a \\").unwrap_err(),
            TemplateError::TrailingBackslash { .. }
        ));
    }

    #[test]
    fn placeholders_fill_whole_words_without_splitting_values() {
        let template = Template::parse(
            "agent --resume={session_id} -m {message} '{{literal}}'",
            &["session_id", "message"],
        )
        .unwrap();
        assert!(template.uses("message") && template.uses("session_id"));
        let values = BTreeMap::from([
            ("session_id", "s-1".to_owned()),
            ("message", "two words; $(rm -rf /)".to_owned()),
        ]);
        assert_eq!(
            template.render(&values),
            [
                "agent",
                "--resume=s-1",
                "-m",
                "two words; $(rm -rf /)",
                "{literal}"
            ]
        );
    }

    #[test]
    fn unknown_placeholders_and_empty_templates_are_refused() {
        let err =
            Template::parse("agent {prompt} {sesion}", &["prompt", "session_id"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "template \"agent {prompt} {sesion}\" uses {sesion}, which is not one of {prompt}, {session_id}"
        );
        assert!(matches!(
            Template::parse("  ", &[]).unwrap_err(),
            TemplateError::Empty { .. }
        ));
        assert!(matches!(
            Template::parse("a {b", &["b"]).unwrap_err(),
            TemplateError::UnclosedBrace { .. }
        ));
    }
}
