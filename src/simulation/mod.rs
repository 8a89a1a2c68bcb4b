//! Simulations for tests and benchmarks, named as such wherever their figures
//! appear: the simulated agent world that drives a real server over HTTP.
//! (The LLM simulator is `llm::sim`.)

pub mod llm;
pub mod world;
