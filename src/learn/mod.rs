//! The learning engine: Combee's map–shuffle–reduce over a prompt's traces,
//! in wings named for the step of the method each holds.
//!
//! - [`round`]: the round executor — it runs the map step (one reflector call
//!   per trace), the shuffle and the reduce step (level-1 aggregator calls, the
//!   level-2 merge) against an LLM backend, recording what it must not lose in
//!   a journal, and validates the result.
//! - [`shuffle`]: the shuffle step as pure functions — the augmented shuffle and
//!   the grouping of reflections into level-1 calls.
//! - [`merge`]: level 2 of the reduce as pure functions — de-duplicating the
//!   groups' playbook operations, the removal budget, applying and evicting,
//!   and the plans of the LLM-assisted merges.
//! - [`prompts`]: the prompt protocol of the map and reduce calls — templates,
//!   messages, context fitting, tolerant readers and checks of the answers.
//! - [`capacity`]: capacity control — the overload meter, the group size it
//!   gives a round and the batch-size controller.
//! - [`crossover`] breeds a child of a population's winners (the `evaluated`
//!   policy, outside the round); [`lesson_check`] holds what both may add to
//!   the rules every learned lesson must pass (a statement, not the
//!   protocol's markup, not the base again), and [`denylist`] to the
//!   operator's denylist.
//!
//! Callers import from the wing that holds a name (`learn::round::RoundSpec`,
//! `learn::merge::budget::Budget`); nothing is re-exported here.

pub mod capacity;
pub mod crossover;
pub mod denylist;
pub mod judge;
pub mod lesson_check;
pub mod merge;
pub mod prompts;
pub mod round;
pub mod shuffle;
