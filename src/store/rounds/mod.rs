//! Rounds: opened over a prompt's oldest pending traces, claimed under a lease with a fenced
//! heartbeat, their reflections and LLM calls, and their end (published or failed). One
//! sub-trait per job, [`RoundStore`] their union: `claims.rs` opens rounds and leases them,
//! `journal.rs` keeps what a running round learns and spends, `record.rs` ends rounds and
//! reads them back, `failures.rs` keeps a prompt's streak of failed rounds.

mod claims;
mod failures;
mod journal;
mod record;

pub use claims::{Backlog, ClaimedRound, OpenRound, RoundClaimStore};
pub use failures::FailureStreakStore;
pub use journal::{RoundCall, RoundJournalStore};
pub use record::{RoundEnd, RoundFailure, RoundRecordStore, TraceCharges, TraceFault};

/// Learning rounds, from opening through the lease to their end: every job's
/// sub-trait, so a store that has them all is a `RoundStore`.
pub trait RoundStore: RoundClaimStore + RoundJournalStore + RoundRecordStore + FailureStreakStore {}

impl<T: RoundClaimStore + RoundJournalStore + RoundRecordStore + FailureStreakStore + ?Sized> RoundStore for T {}

/// `text` cut to at most `max` characters.
fn bounded(text: &str, max: usize) -> &str {
    text.char_indices().nth(max).map_or(text, |(i, _)| &text[..i])
}
