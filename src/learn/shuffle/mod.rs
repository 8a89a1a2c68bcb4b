//! The shuffle step of the method, between map and reduce: every reflection is
//! copied p times and shuffled (augment), then cut into the groups the level-1
//! reduce calls are given (grouping, including the naive and sequential
//! baselines' groupings).

pub mod augment;
pub mod grouping;
