//! Level 2 of the reduce as pure functions: how the level-1 groups' answers
//! become one new version. For playbooks the groups' operations are
//! normalised and de-duplicated ([`dedupe`], judged by [`same_insight`]), and
//! applied once under the removal budget ([`budget`], [`apply`]); what an LLM
//! may still decide on top of that — consolidation by decisions, the
//! structural rewrite merge, the scan tree — is planned in [`level2`]. The
//! round's reduce step (`round::reduce`) makes the calls.

pub mod apply;
pub mod budget;
pub mod dedupe;
pub mod level2;
pub mod same_insight;
