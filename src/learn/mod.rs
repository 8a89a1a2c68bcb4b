//! The learning engine's pure core: augmented shuffle, grouping for the
//! Combee/naive/sequential reduce, the level-2 merge of playbook delta
//! operations, and the dynamic batch-size controller's math. Nothing here does
//! I/O, so the worker can call it from any phase and every rule is unit-tested.

pub mod controller;
pub mod delta;
pub mod grouping;
pub mod shuffle;
