//! Simulations for tests and benchmarks, named as such wherever their figures
//! appear: the simulated agent world that drives a real server over HTTP
//! (`world`, with its house-rules variant `house_rules`), and the simulated OpenAI-compatible LLM that answers combee's own
//! prompts by rule (`llm`, also `combee sim-llm`).

mod answers;
pub mod house_rules;
pub mod llm;
mod model;
pub mod world;
