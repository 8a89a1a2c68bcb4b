//! The prompt protocol of the map and the reduce: what combee says to the
//! reflector and aggregator models and what it accepts back. The prompts are
//! versioned template files in `prompts/` ([`task`]); untrusted content is
//! fenced as data ([`fence`]); every answer is asked to follow a schema
//! ([`schema`]), read tolerantly ([`answer`], [`decode`]) and then checked
//! ([`checks`]), because an LLM answer is untrusted input too. [`select`]
//! bounds what of the playbook one call is shown; [`calls`] makes one call end
//! to end.

pub mod answer;
pub mod calls;
pub mod checks;
pub mod decode;
pub mod fence;
pub mod fit;
pub mod messages;
pub mod schema;
pub mod select;
pub mod task;

#[cfg(test)]
#[path = "tests.rs"]
pub(crate) mod tests;

#[cfg(test)]
#[path = "schema_tests.rs"]
mod schema_tests;
