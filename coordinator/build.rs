//! Rebuilds the coordinator when a migration is added: `sqlx::migrate!`
//! embeds the migration directories, and cargo does not notice a new file
//! in them on its own.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
