//! Rebuilds when a migration file is added or changed: `sqlx::migrate!`
//! embeds the folders' files, and cargo does not track them by itself.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
