//! Capacity control: how much each round and each level-1 reduce call is given.
//! The overload meter measures how much an aggregator call keeps per group
//! size, sizing turns that into the group size a round uses, and the batch-size
//! controller decides how many pending traces the next round takes.

pub mod batch_size;
pub mod meter;
pub mod sizing;
