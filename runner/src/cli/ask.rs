//! `cairn-runner ask "question"`: ends the agent's turn with a question
//! for a person, by writing the outcome file the runner reads.

use super::AskArgs;
use crate::run::outcome::{Outcome, path_from_env, write};

pub(super) fn main(args: AskArgs) -> anyhow::Result<()> {
    let question = args.question.join(" ");
    let path = args.outcome_file.unwrap_or_else(path_from_env);
    let previous = write(
        &path,
        &Outcome::NeedsInput {
            question: question.trim().to_owned(),
        },
    )?;
    if let Some(previous) = previous {
        println!(
            "replaced the earlier outcome ({}) in {}",
            previous.status(),
            path.display()
        );
    }
    println!("asked: {}", question.trim());
    println!(
        "wrote {}: when this turn ends the runner saves the workspace and waits for an answer, \
         which arrives as the next message of this conversation",
        path.display()
    );
    Ok(())
}
