//! The learning engine: augmented shuffle, grouping for the Combee/naive/sequential
//! reduce, the level-2 merge of playbook delta operations and the dynamic
//! batch-size controller's math are pure functions (and so is the level-2 plan:
//! consolidation by decisions, the structural rewrite merge); `round` runs one learning
//! round over an LLM backend, recording what it must not lose in a journal; `meter`
//! estimates per-group retention by group size from the rounds' own provenance;
//! `sizing` turns that estimate into the group size a round uses;
//! `crossover` breeds a child of a population's winners (the `evaluated` policy).

pub mod capacity;
pub mod crossover;
pub mod denylist;
pub mod journal;
mod map;
pub mod merge;
pub mod prompts;
pub mod record;
mod reduce;
pub mod round;
pub mod shuffle;
pub mod spec;
