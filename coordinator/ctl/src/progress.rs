//! Progress on stderr for the commands that take a while: checkout, verify
//! and gc.
//!
//! Drawn only for people: when stderr is a terminal and the output is a
//! table, never with `-o json|yaml`, so what a script reads (and what it
//! captures of stderr) is the same with or without a terminal.

use std::io::IsTerminal as _;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use super::Output;

/// Whether progress is drawn for output `out` when stderr is (or is not) a
/// terminal.
pub fn shown(out: Output, stderr_is_terminal: bool) -> bool {
    stderr_is_terminal && !out.is_document()
}

/// A bar of `template` (indicatif's syntax), or a hidden one when progress
/// is not [`shown`]; a hidden bar takes every call and draws nothing.
pub fn bar(out: Output, template: &str) -> ProgressBar {
    if !shown(out, std::io::stderr().is_terminal()) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(0);
    let style = ProgressStyle::with_template(template)
        .expect("the template is valid")
        .progress_chars("=> ");
    bar.set_style(style);
    // Ticks keep the spinner and rates moving while nothing completes.
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_for_people_at_a_terminal_only() {
        assert!(shown(Output::Table, true));
        assert!(shown(Output::Wide, true));
        assert!(!shown(Output::Json, true), "scripts read JSON");
        assert!(!shown(Output::Yaml, true), "scripts read YAML");
        assert!(!shown(Output::Table, false), "stderr is a file or a pipe");
    }

    #[test]
    fn the_templates_of_every_command_parse() {
        for template in [
            super::super::checkout::TEMPLATE,
            super::super::verify::TEMPLATE,
            super::super::gc::TEMPLATE,
        ] {
            ProgressStyle::with_template(template).unwrap();
        }
    }
}
