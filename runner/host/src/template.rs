//! Command templates of the `exec` driver: split like a shell would, with
//! `{placeholder}`s filled in per sandbox.
//!
//! A template is parsed once, at startup, so a typo is refused before the host
//! registers. Splitting follows the POSIX shell's word rules without running
//! a shell: blanks separate words, `'…'` keeps everything literally, `"…"`
//! keeps blanks and lets `\` escape `"`, `\`, `$` and `` ` ``, and a `\`
//! outside quotes escapes the next character. Nothing else is interpreted: no
//! variables, globs, pipes or redirections (a template that wants those calls
//! `sh -c '…'` itself).
//!
//! Placeholders are recognised in every quoting context — also inside
//! `sh -c '…'` — and `{{` / `}}` stand for literal braces. The value of a
//! placeholder lands inside its word as it is, never split. Every value is
//! restricted to [`is_shell_safe`] characters (the host checks its own paths at
//! startup and each run's image when it starts), so a placeholder is safe
//! inside `sh -c '…'` without further quoting.
//!
//! `{env_args}` is special: it must be a word of its own and expands to zero
//! or more words, `-e NAME` for every variable that means the same inside a
//! container (see [`super::driver::EnvVar::portable`]). Only names appear on
//! the command line; `docker`/`podman` take the values from the command's own
//! environment, where the host put them, so the run token never shows in `ps`.

use std::fmt;

/// The placeholders a template may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placeholder {
    SandboxId,
    SandboxDir,
    WorkspaceDir,
    HomeDir,
    CacheDir,
    PackCache,
    Image,
    Runner,
    RunId,
    Attempt,
    GraceSecs,
    EnvArgs,
}

impl Placeholder {
    pub const ALL: &'static [Placeholder] = &[
        Self::SandboxId,
        Self::SandboxDir,
        Self::WorkspaceDir,
        Self::HomeDir,
        Self::CacheDir,
        Self::PackCache,
        Self::Image,
        Self::Runner,
        Self::RunId,
        Self::Attempt,
        Self::GraceSecs,
        Self::EnvArgs,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::SandboxId => "sandbox_id",
            Self::SandboxDir => "sandbox_dir",
            Self::WorkspaceDir => "workspace_dir",
            Self::HomeDir => "home_dir",
            Self::CacheDir => "cache_dir",
            Self::PackCache => "pack_cache",
            Self::Image => "image",
            Self::Runner => "runner",
            Self::RunId => "run_id",
            Self::Attempt => "attempt",
            Self::GraceSecs => "grace_secs",
            Self::EnvArgs => "env_args",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|p| p.name() == name)
    }

    fn known_list() -> String {
        let names: Vec<String> = Self::ALL
            .iter()
            .map(|p| format!("{{{}}}", p.name()))
            .collect();
        names.join(" ")
    }
}

impl fmt::Display for Placeholder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{{{}}}", self.name())
    }
}

/// Why a template was refused at startup.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("{flag} is empty: it needs at least a program to run")]
    Empty { flag: &'static str },
    #[error("{flag}: the {quote} quote opened at character {at} is never closed")]
    UnterminatedQuote {
        flag: &'static str,
        quote: char,
        at: usize,
    },
    #[error("{flag}: the template ends with a lone backslash")]
    TrailingBackslash { flag: &'static str },
    #[error(
        "{flag}: the '{{' at character {at} has no closing '}}' (write '{{{{' for a literal brace)"
    )]
    UnclosedBrace { flag: &'static str, at: usize },
    #[error("{flag}: the '}}' at character {at} closes nothing (write '}}}}' for a literal brace)")]
    StrayBrace { flag: &'static str, at: usize },
    #[error("{flag}: unknown placeholder {{{name}}} (known: {known})", known = Placeholder::known_list())]
    UnknownPlaceholder { flag: &'static str, name: String },
    #[error("{flag}: {{env_args}} must be a word of its own (it expands to several words)")]
    EnvArgsNotAlone { flag: &'static str },
}

/// Why a template could not be filled in for one sandbox.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error(
        "{flag} uses {{image}}, but the run names no image and the host has no --default-image"
    )]
    NoImage { flag: &'static str },
    #[error(
        "{flag}: the value of {placeholder} ({value:?}) may not be put into a command: only \
         letters, digits and {SAFE_PUNCTUATION} are allowed, and it may not start with '-'"
    )]
    UnsafeValue {
        flag: &'static str,
        placeholder: Placeholder,
        value: String,
    },
}

/// Punctuation allowed in placeholder values besides ASCII letters and digits.
pub const SAFE_PUNCTUATION: &str = "._/:@+=,%-";

/// Whether `value` can be spliced into a command line (even inside `sh -c
/// '…'`) without quoting: non-empty, only letters, digits and
/// [`SAFE_PUNCTUATION`], and not starting with `-` (so it is never taken for
/// an option).
pub fn is_shell_safe(value: &str) -> bool {
    !value.is_empty()
        && !value.starts_with('-')
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || SAFE_PUNCTUATION.as_bytes().contains(&b))
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Value(Placeholder),
}

/// A parsed command template.
#[derive(Debug, Clone)]
pub struct Template {
    flag: &'static str,
    source: String,
    words: Vec<Vec<Piece>>,
}

/// The values one sandbox gives the placeholders.
#[derive(Debug, Clone, Default)]
pub struct Values {
    pub sandbox_id: String,
    pub sandbox_dir: String,
    pub workspace_dir: String,
    pub home_dir: String,
    pub cache_dir: String,
    /// The host's pack cache directory (its use is refused at startup when
    /// the host has none).
    pub pack_cache: String,
    /// Empty when the run names no image and there is no default.
    pub image: String,
    pub runner: String,
    pub run_id: String,
    pub attempt: u32,
    pub grace_secs: u64,
    /// Names of the variables `{env_args}` passes on.
    pub env_names: Vec<String>,
}

impl Values {
    fn get(&self, placeholder: Placeholder) -> String {
        match placeholder {
            Placeholder::SandboxId => self.sandbox_id.clone(),
            Placeholder::SandboxDir => self.sandbox_dir.clone(),
            Placeholder::WorkspaceDir => self.workspace_dir.clone(),
            Placeholder::HomeDir => self.home_dir.clone(),
            Placeholder::CacheDir => self.cache_dir.clone(),
            Placeholder::PackCache => self.pack_cache.clone(),
            Placeholder::Image => self.image.clone(),
            Placeholder::Runner => self.runner.clone(),
            Placeholder::RunId => self.run_id.clone(),
            Placeholder::Attempt => self.attempt.to_string(),
            Placeholder::GraceSecs => self.grace_secs.to_string(),
            Placeholder::EnvArgs => unreachable!("{{env_args}} is expanded as whole words"),
        }
    }
}

impl Template {
    /// Parses `source`; `flag` names the option it came from in errors.
    pub fn parse(flag: &'static str, source: &str) -> Result<Self, TemplateError> {
        let words = split(flag, source)?;
        if words.is_empty() {
            return Err(TemplateError::Empty { flag });
        }
        for word in &words {
            if word.len() > 1 && word.contains(&Piece::Value(Placeholder::EnvArgs)) {
                return Err(TemplateError::EnvArgsNotAlone { flag });
            }
        }
        if words[0] == [Piece::Value(Placeholder::EnvArgs)] {
            return Err(TemplateError::Empty { flag });
        }
        Ok(Self {
            flag,
            source: source.to_owned(),
            words,
        })
    }

    /// The option this template came from.
    pub fn flag(&self) -> &'static str {
        self.flag
    }

    /// The template as the operator wrote it.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template refers to `placeholder`.
    pub fn uses(&self, placeholder: Placeholder) -> bool {
        self.words
            .iter()
            .flatten()
            .any(|p| *p == Piece::Value(placeholder))
    }

    /// The program and its arguments for one sandbox.
    pub fn render(&self, values: &Values) -> Result<Vec<String>, RenderError> {
        let flag = self.flag;
        let mut argv = Vec::with_capacity(self.words.len());
        for word in &self.words {
            if word.as_slice() == [Piece::Value(Placeholder::EnvArgs)] {
                for name in &values.env_names {
                    argv.push("-e".to_owned());
                    argv.push(name.clone());
                }
                continue;
            }
            let mut out = String::new();
            for piece in word {
                match piece {
                    Piece::Text(text) => out.push_str(text),
                    Piece::Value(placeholder) => {
                        let value = values.get(*placeholder);
                        if *placeholder == Placeholder::Image && value.is_empty() {
                            return Err(RenderError::NoImage { flag });
                        }
                        if !is_shell_safe(&value) {
                            return Err(RenderError::UnsafeValue {
                                flag,
                                placeholder: *placeholder,
                                value,
                            });
                        }
                        out.push_str(&value);
                    }
                }
            }
            argv.push(out);
        }
        Ok(argv)
    }
}

/// Splits `source` into words of text and placeholders (see the module doc).
fn split(flag: &'static str, source: &str) -> Result<Vec<Vec<Piece>>, TemplateError> {
    #[derive(PartialEq)]
    enum Quote {
        None,
        Single(usize),
        Double(usize),
    }

    let chars: Vec<char> = source.chars().collect();
    let mut words: Vec<Vec<Piece>> = Vec::new();
    let mut word: Vec<Piece> = Vec::new();
    let mut text = String::new();
    // A word exists once anything (even an empty quote) was seen since the last blank.
    let mut in_word = false;
    let mut quote = Quote::None;
    let mut i = 0;

    while i < chars.len() {
        let c = chars[i];
        match (&quote, c) {
            (Quote::None, c) if c.is_whitespace() => {
                if in_word {
                    if !text.is_empty() {
                        word.push(Piece::Text(std::mem::take(&mut text)));
                    }
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (Quote::None, '\'') => {
                quote = Quote::Single(i + 1);
                in_word = true;
            }
            (Quote::None, '"') => {
                quote = Quote::Double(i + 1);
                in_word = true;
            }
            (Quote::None, '\\') => {
                let next = *chars
                    .get(i + 1)
                    .ok_or(TemplateError::TrailingBackslash { flag })?;
                // A backslash-newline is a line continuation, as in the shell.
                if next != '\n' {
                    text.push(next);
                    in_word = true;
                }
                i += 1;
            }
            (Quote::Single(_), '\'') | (Quote::Double(_), '"') => quote = Quote::None,
            (Quote::Double(_), '\\')
                if matches!(chars.get(i + 1), Some('"' | '\\' | '$' | '`' | '\n')) =>
            {
                if chars[i + 1] != '\n' {
                    text.push(chars[i + 1]);
                }
                i += 1;
            }
            (_, '{') => {
                in_word = true;
                if chars.get(i + 1) == Some(&'{') {
                    text.push('{');
                    i += 1;
                } else {
                    let close = chars[i + 1..]
                        .iter()
                        .position(|&c| c == '}')
                        .ok_or(TemplateError::UnclosedBrace { flag, at: i + 1 })?;
                    let name: String = chars[i + 1..i + 1 + close].iter().collect();
                    let placeholder = Placeholder::from_name(&name).ok_or_else(|| {
                        TemplateError::UnknownPlaceholder {
                            flag,
                            name: name.clone(),
                        }
                    })?;
                    if !text.is_empty() {
                        word.push(Piece::Text(std::mem::take(&mut text)));
                    }
                    word.push(Piece::Value(placeholder));
                    i += close + 1;
                }
            }
            (_, '}') => {
                if chars.get(i + 1) == Some(&'}') {
                    text.push('}');
                    in_word = true;
                    i += 1;
                } else {
                    return Err(TemplateError::StrayBrace { flag, at: i + 1 });
                }
            }
            (_, c) => {
                text.push(c);
                in_word = true;
            }
        }
        i += 1;
    }
    match quote {
        Quote::None => {}
        Quote::Single(at) => {
            return Err(TemplateError::UnterminatedQuote {
                flag,
                quote: '\'',
                at,
            });
        }
        Quote::Double(at) => {
            return Err(TemplateError::UnterminatedQuote {
                flag,
                quote: '"',
                at,
            });
        }
    }
    if in_word {
        if !text.is_empty() {
            word.push(Piece::Text(text));
        }
        words.push(word);
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values() -> Values {
        Values {
            sandbox_id: "sbx-run1-a2".into(),
            sandbox_dir: "/var/lib/cairn/sandboxes/sbx-run1-a2".into(),
            workspace_dir: "/var/lib/cairn/sandboxes/sbx-run1-a2/workspace".into(),
            home_dir: "/var/lib/cairn/sandboxes/sbx-run1-a2/home".into(),
            cache_dir: "/var/lib/cairn/sandboxes/sbx-run1-a2/cache".into(),
            pack_cache: "/var/lib/cairn/pack-cache".into(),
            image: "ghcr.io/acme/agent:1.2".into(),
            runner: "/usr/local/bin/cairn-runner".into(),
            run_id: "run-1".into(),
            attempt: 2,
            grace_secs: 30,
            env_names: vec!["CAIRN_COORDINATOR".into(), "CAIRN_RUN_TOKEN".into()],
        }
    }

    fn render(source: &str) -> Vec<String> {
        Template::parse("--exec-create", source)
            .unwrap()
            .render(&values())
            .unwrap()
    }

    #[test]
    fn splits_like_a_shell() {
        assert_eq!(render("a  b\tc"), ["a", "b", "c"]);
        assert_eq!(
            render(r#"say 'two words' "and \"more\"" x\ y '' end"#),
            ["say", "two words", "and \"more\"", "x y", "", "end"]
        );
        assert_eq!(
            render(r#"a "back\slash" 'lit\eral'"#),
            ["a", r"back\slash", r"lit\eral"]
        );
        assert_eq!(render("a \\\n b"), ["a", "b"]);
    }

    #[test]
    fn fills_placeholders_inside_words_and_quotes() {
        assert_eq!(
            render(
                "unshare -m sh -c 'mount --bind {workspace_dir} /workspace && exec {runner} run'"
            ),
            [
                "unshare",
                "-m",
                "sh",
                "-c",
                "mount --bind /var/lib/cairn/sandboxes/sbx-run1-a2/workspace /workspace && exec \
                 /usr/local/bin/cairn-runner run",
            ]
        );
        assert_eq!(
            render("--name=cairn-{sandbox_id} {attempt}/{grace_secs}"),
            ["--name=cairn-sbx-run1-a2", "2/30"]
        );
        assert_eq!(render("x '{{\"a\":{attempt}}}'"), ["x", "{\"a\":2}"]);
    }

    #[test]
    fn env_args_expand_to_names_only() {
        assert_eq!(
            render("docker run {env_args} {image}"),
            [
                "docker",
                "run",
                "-e",
                "CAIRN_COORDINATOR",
                "-e",
                "CAIRN_RUN_TOKEN",
                "ghcr.io/acme/agent:1.2"
            ]
        );
        let err = Template::parse("--exec-create", "docker run x{env_args}").unwrap_err();
        assert_eq!(
            err,
            TemplateError::EnvArgsNotAlone {
                flag: "--exec-create"
            }
        );
    }

    #[test]
    fn refuses_broken_templates_with_the_cause() {
        let cases = [
            ("", "--exec-create is empty"),
            ("   ", "--exec-create is empty"),
            (
                "run {sandbox}",
                "unknown placeholder {sandbox} (known: {sandbox_id} {sandbox_dir}",
            ),
            (
                "sh -c 'echo",
                "the ' quote opened at character 7 is never closed",
            ),
            (
                "echo \"x",
                "the \" quote opened at character 6 is never closed",
            ),
            ("echo {image", "the '{' at character 6 has no closing '}'"),
            ("echo }x", "the '}' at character 6 closes nothing"),
            ("echo x\\", "ends with a lone backslash"),
        ];
        for (source, expected) in cases {
            let err = Template::parse("--exec-create", source)
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{source:?}: {err}");
        }
    }

    #[test]
    fn refuses_values_that_could_escape_their_word() {
        let template = Template::parse("--exec-create", "docker run {image}").unwrap();
        for image in ["--privileged", "img; rm -rf /", "a b", "img'x", "$(id)"] {
            let v = Values {
                image: image.into(),
                ..values()
            };
            let err = template.render(&v).unwrap_err();
            assert!(
                matches!(
                    err,
                    RenderError::UnsafeValue {
                        placeholder: Placeholder::Image,
                        ..
                    }
                ),
                "{image}"
            );
        }
        let v = Values {
            image: String::new(),
            ..values()
        };
        assert_eq!(
            template.render(&v).unwrap_err(),
            RenderError::NoImage {
                flag: "--exec-create"
            }
        );
        assert!(template.uses(Placeholder::Image));
        assert!(!template.uses(Placeholder::Runner));
    }
}
