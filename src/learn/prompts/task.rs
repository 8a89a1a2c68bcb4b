//! The five calls combee makes of a model — the map's reflection, level 1's
//! aggregation (playbook or rewrite) and level 2's passage merge and
//! consolidation — with their versioned templates in `prompts/`, the size caps
//! their answers must keep and the schema each answer is asked to follow.

use serde::{Deserialize, Serialize};

use crate::domain::VersionContent;
use crate::llm::{AnswerSchema, LlmRole};

use super::schema;

const REFLECTOR: &str = include_str!("../../../prompts/reflector.md");
const AGGREGATE_PLAYBOOK: &str = include_str!("../../../prompts/aggregate_playbook.md");
const AGGREGATE_REWRITE: &str = include_str!("../../../prompts/aggregate_rewrite.md");
const MERGE_REWRITE: &str = include_str!("../../../prompts/merge_rewrite.md");
const CONSOLIDATE_PLAYBOOK: &str = include_str!("../../../prompts/consolidate_playbook.md");

/// Longest accepted reflection field, in characters.
pub const MAX_REFLECTION_FIELD_CHARS: usize = 4_000;
/// Most bullet tags in one reflection.
pub const MAX_BULLET_TAGS: usize = 500;
/// Most operations in one aggregator answer.
pub const MAX_OPERATIONS: usize = 200;
/// Longest bullet content, in characters.
pub const MAX_BULLET_CHARS: usize = 2_000;
/// Longest rewritten instruction, in characters.
pub const MAX_INSTRUCTION_CHARS: usize = 100_000;

/// The five kinds of call combee makes. The system message of each carries a
/// `combee-task: <name>` line so a simulator (or a proxy) can recognise it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Task {
    Reflect,
    AggregatePlaybook,
    AggregateRewrite,
    MergeRewrite,
    ConsolidatePlaybook,
}

impl Task {
    pub const ALL: [Task; 5] =
        [Task::Reflect, Task::AggregatePlaybook, Task::AggregateRewrite, Task::MergeRewrite, Task::ConsolidatePlaybook];

    /// The name on the `combee-task:` line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reflect => "reflect",
            Self::AggregatePlaybook => "aggregate-playbook",
            Self::AggregateRewrite => "aggregate-rewrite",
            Self::MergeRewrite => "merge-rewrite",
            Self::ConsolidatePlaybook => "consolidate-playbook",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == s)
    }

    pub fn role(self) -> LlmRole {
        if self == Self::Reflect { LlmRole::Reflector } else { LlmRole::Aggregator }
    }

    pub(super) fn template(self) -> &'static str {
        match self {
            Self::Reflect => REFLECTOR,
            Self::AggregatePlaybook => AGGREGATE_PLAYBOOK,
            Self::AggregateRewrite => AGGREGATE_REWRITE,
            Self::MergeRewrite => MERGE_REWRITE,
            Self::ConsolidatePlaybook => CONSOLIDATE_PLAYBOOK,
        }
    }

    /// `<name> v<n>` from the template's first line, for round records.
    pub fn template_id(self) -> &'static str {
        self.template().lines().next().and_then(|l| l.strip_prefix("combee-template:")).map_or("unknown", str::trim)
    }
}

/// The schema of `task`'s answer about `current` (see [`super::schema`]).
pub fn answer_schema(task: Task, current: &VersionContent) -> std::sync::Arc<AnswerSchema> {
    match task {
        Task::Reflect => schema::reflection(current),
        Task::AggregatePlaybook => schema::operations(current),
        Task::AggregateRewrite | Task::MergeRewrite => schema::instruction(),
        Task::ConsolidatePlaybook => schema::decisions(),
    }
}
