//! The data a round passes between its phases: what the reflector says about
//! one trace, and the delta operations the aggregator proposes for a playbook.
//! Shared by the LLM protocol (which parses them from answers) and the
//! learning engine (which shuffles, groups, merges and applies them).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// How a bullet the agent used affected the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum BulletTagKind {
    Helpful,
    Harmful,
    Neutral,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BulletTag {
    pub id: String,
    pub tag: BulletTagKind,
}

/// The reflector's diagnosis of one trace (ACE reflector fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Reflection {
    #[serde(default)]
    pub error: String,
    #[serde(default)]
    pub root_cause: String,
    #[serde(default)]
    pub correct_approach: String,
    pub key_insight: String,
    /// Playbook mode: a tag for every bullet the agent used.
    #[serde(default)]
    pub bullet_tags: Vec<BulletTag>,
}

/// One change to a playbook. Operations from many groups are unioned,
/// normalised and de-duplicated, then applied once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "op", rename_all = "UPPERCASE", deny_unknown_fields)]
pub enum DeltaOp {
    Add {
        section: String,
        content: String,
        #[serde(default)]
        reason: String,
    },
    Update {
        id: String,
        content: String,
        #[serde(default)]
        reason: String,
    },
    Remove {
        id: String,
        #[serde(default)]
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_ops_use_the_documented_wire_form() {
        let ops: Vec<DeltaOp> = serde_json::from_str(
            r#"[{"op":"ADD","section":"tips","content":"x","reason":"r"},{"op":"UPDATE","id":"b-0001","content":"y"},{"op":"REMOVE","id":"b-0002"}]"#,
        )
        .unwrap();
        assert_eq!(ops.len(), 3);
        assert!(serde_json::from_str::<DeltaOp>(r#"{"op":"MERGE","id":"b"}"#).is_err());
    }
}
