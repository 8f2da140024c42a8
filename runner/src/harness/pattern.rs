//! The regular expressions of the `command` adapter (`session_regex`,
//! `session_lost`): a small backtracking matcher, because the workspace's
//! dependency table has no regex crate.
//!
//! Supported syntax, a subset of the usual Perl-style one:
//! - literals, `.` (any character), `^` and `$` (start and end of the line);
//! - escapes `\d \w \s \D \W \S`, `\n \t \r`, and `\` before any punctuation;
//! - classes `[abc]`, `[a-z0-9_-]`, `[^…]` (with `\d \w \s` inside);
//! - groups `(…)`, non-capturing `(?:…)`, named `(?P<name>…)` / `(?<name>…)`;
//! - alternation `|`; quantifiers `* + ? {n} {n,} {n,m}`, lazy with a `?` after.
//!
//! Anything else is refused when the pattern is parsed, with the position.
//! Matching memoises (instruction, position) pairs that failed, so its cost
//! is bounded by the pattern's size times the line's length.

use std::fmt;

/// Repetition counts above this are refused (the program is expanded).
const MAX_REPEAT: u32 = 256;
/// Programs above this many instructions are refused.
const MAX_PROGRAM: usize = 20_000;

/// A pattern that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("regular expression {pattern:?}: {reason} (at character {position})")]
pub struct PatternError {
    pub pattern: String,
    pub position: usize,
    pub reason: String,
}

/// A compiled pattern.
#[derive(Clone)]
pub struct Pattern {
    source: String,
    program: Vec<Inst>,
    /// Capture groups, group 0 (the whole match) included.
    groups: usize,
    names: Vec<(String, usize)>,
}

impl fmt::Debug for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Pattern").field(&self.source).finish()
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Class {
    negated: bool,
    ranges: Vec<(char, char)>,
}

impl Class {
    fn matches(&self, c: char) -> bool {
        self.ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != self.negated
    }

    fn digit(negated: bool) -> Self {
        Self {
            negated,
            ranges: vec![('0', '9')],
        }
    }

    fn word(negated: bool) -> Self {
        Self {
            negated,
            ranges: vec![('a', 'z'), ('A', 'Z'), ('0', '9'), ('_', '_')],
        }
    }

    fn space(negated: bool) -> Self {
        Self {
            negated,
            ranges: vec![(' ', ' '), ('\t', '\r')],
        }
    }
}

#[derive(Debug, Clone)]
enum Node {
    Empty,
    Char(char),
    Any,
    Class(Class),
    Start,
    End,
    Group(Box<Node>, Option<usize>),
    Concat(Vec<Node>),
    Alt(Vec<Node>),
    Repeat {
        node: Box<Node>,
        min: u32,
        max: Option<u32>,
        greedy: bool,
    },
}

#[derive(Debug, Clone)]
enum Inst {
    Char(char),
    Any,
    Class(Class),
    Start,
    End,
    /// Try the first target, then the second.
    Split(usize, usize),
    Jump(usize),
    Save(usize),
    Match,
}

struct Parser<'a> {
    source: &'a str,
    chars: Vec<char>,
    pos: usize,
    groups: usize,
    names: Vec<(String, usize)>,
}

impl Parser<'_> {
    fn error(&self, reason: impl Into<String>) -> PatternError {
        PatternError {
            pattern: self.source.to_owned(),
            position: self.pos,
            reason: reason.into(),
        }
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn alternation(&mut self) -> Result<Node, PatternError> {
        let mut branches = vec![self.concat()?];
        while self.eat('|') {
            branches.push(self.concat()?);
        }
        Ok(if branches.len() == 1 {
            branches.pop().expect("one branch")
        } else {
            Node::Alt(branches)
        })
    }

    fn concat(&mut self) -> Result<Node, PatternError> {
        let mut items = Vec::new();
        while let Some(c) = self.peek() {
            if c == '|' || c == ')' {
                break;
            }
            let atom = self.atom()?;
            items.push(self.quantified(atom)?);
        }
        Ok(match items.len() {
            0 => Node::Empty,
            1 => items.pop().expect("one item"),
            _ => Node::Concat(items),
        })
    }

    fn atom(&mut self) -> Result<Node, PatternError> {
        let c = self.peek().expect("called with input left");
        self.pos += 1;
        match c {
            '.' => Ok(Node::Any),
            '^' => Ok(Node::Start),
            '$' => Ok(Node::End),
            '(' => self.group(),
            '[' => self.class().map(Node::Class),
            '\\' => match self.escape()? {
                Escaped::Char(c) => Ok(Node::Char(c)),
                Escaped::Class(class) => Ok(Node::Class(class)),
            },
            '*' | '+' | '?' | '{' => {
                self.pos -= 1;
                Err(self.error(format!("{c:?} has nothing to repeat")))
            }
            c => Ok(Node::Char(c)),
        }
    }

    fn group(&mut self) -> Result<Node, PatternError> {
        let index = if self.eat('?') {
            if self.eat(':') {
                None
            } else if self.eat('P') && self.eat('<') || self.eat('<') {
                let start = self.pos;
                while self
                    .peek()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
                {
                    self.pos += 1;
                }
                let name: String = self.chars[start..self.pos].iter().collect();
                if name.is_empty() || !self.eat('>') {
                    return Err(
                        self.error("a group name is letters, digits and '_' between < and >")
                    );
                }
                self.groups += 1;
                self.names.push((name, self.groups));
                Some(self.groups)
            } else {
                return Err(
                    self.error("only (?:…), (?P<name>…) and (?<name>…) groups are supported")
                );
            }
        } else {
            self.groups += 1;
            Some(self.groups)
        };
        let inner = self.alternation()?;
        if !self.eat(')') {
            return Err(self.error("unclosed group: ')' expected"));
        }
        Ok(Node::Group(Box::new(inner), index))
    }

    fn class(&mut self) -> Result<Class, PatternError> {
        let negated = self.eat('^');
        let mut ranges = Vec::new();
        let mut first = true;
        loop {
            let Some(c) = self.peek() else {
                return Err(self.error("unclosed class: ']' expected"));
            };
            self.pos += 1;
            if c == ']' && !first {
                break;
            }
            first = false;
            let lo = if c == '\\' {
                match self.escape()? {
                    Escaped::Char(c) => c,
                    Escaped::Class(class) if !class.negated => {
                        ranges.extend(class.ranges);
                        continue;
                    }
                    Escaped::Class(_) => {
                        return Err(self.error("\\D, \\W and \\S are not supported inside [ ]"));
                    }
                }
            } else {
                c
            };
            if self.peek() == Some('-') && self.chars.get(self.pos + 1).is_some_and(|&n| n != ']') {
                self.pos += 1;
                let hi = match self.peek() {
                    Some('\\') => {
                        self.pos += 1;
                        match self.escape()? {
                            Escaped::Char(c) => c,
                            Escaped::Class(_) => {
                                return Err(self.error("a range cannot end in a class"));
                            }
                        }
                    }
                    Some(c) => {
                        self.pos += 1;
                        c
                    }
                    None => return Err(self.error("unclosed class: ']' expected")),
                };
                if hi < lo {
                    return Err(self.error(format!("range {lo}-{hi} is backwards")));
                }
                ranges.push((lo, hi));
            } else {
                ranges.push((lo, lo));
            }
        }
        Ok(Class { negated, ranges })
    }

    fn escape(&mut self) -> Result<Escaped, PatternError> {
        let Some(c) = self.peek() else {
            return Err(self.error("the pattern ends in a lone backslash"));
        };
        self.pos += 1;
        Ok(match c {
            'd' => Escaped::Class(Class::digit(false)),
            'D' => Escaped::Class(Class::digit(true)),
            'w' => Escaped::Class(Class::word(false)),
            'W' => Escaped::Class(Class::word(true)),
            's' => Escaped::Class(Class::space(false)),
            'S' => Escaped::Class(Class::space(true)),
            'n' => Escaped::Char('\n'),
            't' => Escaped::Char('\t'),
            'r' => Escaped::Char('\r'),
            c if c.is_ascii_punctuation() || c == ' ' => Escaped::Char(c),
            c => {
                self.pos -= 1;
                return Err(self.error(format!("unsupported escape \\{c}")));
            }
        })
    }

    fn number(&mut self) -> Option<u32> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        self.chars[start..self.pos]
            .iter()
            .collect::<String>()
            .parse()
            .ok()
    }

    fn quantified(&mut self, atom: Node) -> Result<Node, PatternError> {
        let (min, max) = match self.peek() {
            Some('*') => (0, None),
            Some('+') => (1, None),
            Some('?') => (0, Some(1)),
            Some('{') => {
                self.pos += 1;
                let Some(min) = self.number() else {
                    return Err(self.error("'{' must start a repetition like {2}, {2,} or {2,5}"));
                };
                let max = if self.eat(',') {
                    if self.peek() == Some('}') {
                        None
                    } else {
                        Some(
                            self.number()
                                .ok_or_else(|| self.error("a number expected"))?,
                        )
                    }
                } else {
                    Some(min)
                };
                if self.peek() != Some('}') {
                    return Err(self.error("'}' expected"));
                }
                if max.is_some_and(|max| max < min) {
                    return Err(self.error(format!(
                        "repetition {{{min},{}}} is backwards",
                        max.unwrap_or(0)
                    )));
                }
                if min.max(max.unwrap_or(0)) > MAX_REPEAT {
                    return Err(
                        self.error(format!("repetitions above {MAX_REPEAT} are not supported"))
                    );
                }
                (min, max)
            }
            _ => return Ok(atom),
        };
        self.pos += 1;
        if matches!(atom, Node::Start | Node::End) {
            return Err(self.error("an anchor cannot be repeated"));
        }
        let greedy = !self.eat('?');
        if matches!(self.peek(), Some('*' | '+' | '?' | '{')) {
            return Err(self.error("a repetition cannot be repeated"));
        }
        Ok(Node::Repeat {
            node: Box::new(atom),
            min,
            max,
            greedy,
        })
    }
}

enum Escaped {
    Char(char),
    Class(Class),
}

struct Compiler {
    program: Vec<Inst>,
}

impl Compiler {
    fn emit(&mut self, inst: Inst) -> usize {
        self.program.push(inst);
        self.program.len() - 1
    }

    fn compile(&mut self, node: &Node) -> Result<(), String> {
        if self.program.len() > MAX_PROGRAM {
            return Err(format!(
                "the pattern is too large (over {MAX_PROGRAM} instructions once expanded)"
            ));
        }
        match node {
            Node::Empty => {}
            Node::Char(c) => {
                self.emit(Inst::Char(*c));
            }
            Node::Any => {
                self.emit(Inst::Any);
            }
            Node::Class(class) => {
                self.emit(Inst::Class(class.clone()));
            }
            Node::Start => {
                self.emit(Inst::Start);
            }
            Node::End => {
                self.emit(Inst::End);
            }
            Node::Group(inner, index) => {
                if let Some(i) = index {
                    self.emit(Inst::Save(2 * i));
                }
                self.compile(inner)?;
                if let Some(i) = index {
                    self.emit(Inst::Save(2 * i + 1));
                }
            }
            Node::Concat(items) => {
                for item in items {
                    self.compile(item)?;
                }
            }
            Node::Alt(branches) => {
                let mut jumps = Vec::new();
                for (i, branch) in branches.iter().enumerate() {
                    if i + 1 < branches.len() {
                        let split = self.emit(Inst::Split(0, 0));
                        self.compile(branch)?;
                        jumps.push(self.emit(Inst::Jump(0)));
                        let next = self.program.len();
                        self.program[split] = Inst::Split(split + 1, next);
                    } else {
                        self.compile(branch)?;
                    }
                }
                let end = self.program.len();
                for jump in jumps {
                    self.program[jump] = Inst::Jump(end);
                }
            }
            Node::Repeat {
                node,
                min,
                max,
                greedy,
            } => {
                for _ in 0..*min {
                    self.compile(node)?;
                }
                match max {
                    None => {
                        let split = self.emit(Inst::Split(0, 0));
                        self.compile(node)?;
                        self.emit(Inst::Jump(split));
                        let out = self.program.len();
                        self.program[split] = self.split(split + 1, out, *greedy);
                    }
                    Some(max) => {
                        let mut splits = Vec::new();
                        for _ in *min..*max {
                            splits.push(self.emit(Inst::Split(0, 0)));
                            self.compile(node)?;
                        }
                        let out = self.program.len();
                        for split in splits {
                            self.program[split] = self.split(split + 1, out, *greedy);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn split(&self, body: usize, out: usize, greedy: bool) -> Inst {
        if greedy {
            Inst::Split(body, out)
        } else {
            Inst::Split(out, body)
        }
    }
}

enum Job {
    Step(usize, usize),
    Restore(usize, Option<usize>),
}

impl Pattern {
    /// Parses and compiles `source`.
    pub fn new(source: &str) -> Result<Self, PatternError> {
        let mut parser = Parser {
            source,
            chars: source.chars().collect(),
            pos: 0,
            groups: 0,
            names: Vec::new(),
        };
        let node = parser.alternation()?;
        if parser.pos < parser.chars.len() {
            return Err(parser.error("unmatched ')'"));
        }
        let mut compiler = Compiler {
            program: Vec::new(),
        };
        compiler
            .compile(&Node::Group(Box::new(node), Some(0)))
            .map_err(|reason| PatternError {
                pattern: source.to_owned(),
                position: 0,
                reason,
            })?;
        compiler.emit(Inst::Match);
        Ok(Self {
            source: source.to_owned(),
            program: compiler.program,
            groups: parser.groups + 1,
            names: parser.names,
        })
    }

    /// The capture groups of the leftmost match in `text` (group 0 is the
    /// whole match), or None when nothing matches.
    pub fn captures<'t>(&self, text: &'t str) -> Option<Vec<Option<&'t str>>> {
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let byte_at = |i: usize| chars.get(i).map_or(text.len(), |(b, _)| *b);
        let slots = self.run(&chars)?;
        Some(
            (0..self.groups)
                .map(|g| match (slots[2 * g], slots[2 * g + 1]) {
                    (Some(start), Some(end)) => Some(&text[byte_at(start)..byte_at(end)]),
                    _ => None,
                })
                .collect(),
        )
    }

    /// Whether the pattern matches anywhere in `text`.
    pub fn is_match(&self, text: &str) -> bool {
        self.captures(text).is_some()
    }

    /// What the pattern picks out of `text`: the group named `id` if there is
    /// one, else group 1 if there is one, else the whole match.
    pub fn extract<'t>(&self, text: &'t str) -> Option<&'t str> {
        let groups = self.captures(text)?;
        let index = match self.names.iter().find(|(name, _)| name == "id") {
            Some((_, i)) => *i,
            None if self.groups > 1 => 1,
            None => 0,
        };
        groups[index].filter(|s| !s.is_empty())
    }

    fn run(&self, chars: &[(usize, char)]) -> Option<Vec<Option<usize>>> {
        let len = chars.len();
        let width = len + 1;
        let mut failed = vec![false; self.program.len() * width];
        let mut slots = vec![None; 2 * self.groups];
        let mut stack = Vec::new();
        for start in 0..=len {
            stack.push(Job::Step(0, start));
            while let Some(job) = stack.pop() {
                let (mut pc, mut pos) = match job {
                    Job::Restore(slot, value) => {
                        slots[slot] = value;
                        continue;
                    }
                    Job::Step(pc, pos) => (pc, pos),
                };
                loop {
                    let seen = &mut failed[pc * width + pos];
                    if *seen {
                        break;
                    }
                    *seen = true;
                    match &self.program[pc] {
                        Inst::Char(c) => {
                            if pos < len && chars[pos].1 == *c {
                                pc += 1;
                                pos += 1;
                            } else {
                                break;
                            }
                        }
                        Inst::Any => {
                            if pos < len {
                                pc += 1;
                                pos += 1;
                            } else {
                                break;
                            }
                        }
                        Inst::Class(class) => {
                            if pos < len && class.matches(chars[pos].1) {
                                pc += 1;
                                pos += 1;
                            } else {
                                break;
                            }
                        }
                        Inst::Start => {
                            if pos == 0 {
                                pc += 1;
                            } else {
                                break;
                            }
                        }
                        Inst::End => {
                            if pos == len {
                                pc += 1;
                            } else {
                                break;
                            }
                        }
                        Inst::Split(first, second) => {
                            stack.push(Job::Step(*second, pos));
                            pc = *first;
                        }
                        Inst::Jump(to) => pc = *to,
                        Inst::Save(slot) => {
                            stack.push(Job::Restore(*slot, slots[*slot]));
                            slots[*slot] = Some(pos);
                            pc += 1;
                        }
                        Inst::Match => return Some(slots),
                    }
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find(pattern: &str, text: &str) -> Option<String> {
        Pattern::new(pattern)
            .unwrap()
            .captures(text)
            .map(|g| g[0].unwrap_or_default().to_owned())
    }

    #[test]
    fn literals_classes_and_quantifiers_match_like_perl() {
        assert_eq!(find("b+", "abbbc").as_deref(), Some("bbb"));
        assert_eq!(find("b+?", "abbbc").as_deref(), Some("b"));
        assert_eq!(find("a.c", "xxabcxx").as_deref(), Some("abc"));
        assert_eq!(find("^abc$", "abc").as_deref(), Some("abc"));
        assert_eq!(find("^abc$", "abcd"), None);
        assert_eq!(
            find(r"\d{3}-\d{2,}", "call 555-1234 now").as_deref(),
            Some("555-1234")
        );
        assert_eq!(
            find(r"[a-f0-9-]{8}", "id: 0badf00d-x").as_deref(),
            Some("0badf00d")
        );
        assert_eq!(find(r"[^ ]+$", "one two three").as_deref(), Some("three"));
        assert_eq!(find("cat|dog", "hotdog").as_deref(), Some("dog"));
        assert_eq!(find(r"colou?r", "the color red").as_deref(), Some("color"));
        assert_eq!(find(r"\.json", "a.json").as_deref(), Some(".json"));
        assert_eq!(find(r"x*", "").as_deref(), Some(""));
        assert_eq!(find(r"é+", "café!").as_deref(), Some("é"));
    }

    #[test]
    fn extract_prefers_the_id_group_then_group_one() {
        let named = Pattern::new(r"(\w+) session (?P<id>[0-9a-f-]+)").unwrap();
        assert_eq!(named.extract("new session 1234-ab done"), Some("1234-ab"));
        let first = Pattern::new(r#""thread_id":"([^"]+)""#).unwrap();
        assert_eq!(
            first.extract(r#"{"type":"thread.started","thread_id":"t-42"}"#),
            Some("t-42")
        );
        let whole = Pattern::new(r"[0-9a-f]{8}").unwrap();
        assert_eq!(whole.extract("id deadbeef!"), Some("deadbeef"));
        assert_eq!(whole.extract("nothing here"), None);
        let alt = Pattern::new(r"(?<id>a+)|b").unwrap();
        assert_eq!(
            alt.extract("b"),
            None,
            "an empty or unset group extracts nothing"
        );
    }

    #[test]
    fn pathological_patterns_stay_bounded() {
        let text = "a".repeat(200);
        assert!(!Pattern::new("(a*)*b").unwrap().is_match(&text));
        assert!(!Pattern::new("(a|aa)+$x").unwrap().is_match(&text));
    }

    #[test]
    fn bad_patterns_are_refused_with_the_place() {
        for (pattern, words) in [
            ("(ab", "unclosed group"),
            ("ab)", "unmatched ')'"),
            ("[ab", "unclosed class"),
            ("*a", "nothing to repeat"),
            ("a{2", "'}' expected"),
            ("a{5,2}", "backwards"),
            (r"\q", "unsupported escape"),
            ("(?=x)", "only (?:…)"),
            ("a{1000}", "above 256"),
            ("[z-a]", "backwards"),
        ] {
            let err = Pattern::new(pattern).unwrap_err();
            assert!(err.to_string().contains(words), "{pattern}: {err}");
        }
    }
}
