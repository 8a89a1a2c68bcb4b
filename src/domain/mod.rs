//! The combee domain: prompts, versions, labels, traces and playbooks as plain
//! types with their validation and pure logic. Nothing here touches a database
//! or the network, so every rule can be unit-tested on its own.

pub mod access;
pub mod audit;
pub mod backoff;
pub mod budget;
pub mod clock;
pub mod diff;
pub mod event;
pub mod label;
pub mod label_history;
pub mod learning;
pub mod names;
pub mod people;
pub mod playbook;
pub mod population;
pub mod population_settings;
pub mod project;
pub mod prompt;
pub mod regression;
pub mod round;
pub mod round_detail;
pub mod span;
pub mod trace;
pub mod webhook;

pub use label_history::{LabelHistoryEntry, LabelMoveKind, MoveCause};
pub use learning::{BulletTag, BulletTagKind, DeltaOp, Reflection};
pub use names::{LabelName, NameError, PromptName};
pub use playbook::{Bullet, Playbook, Section};
pub use prompt::{
    AgentReflections, BatchSize, Promotion, Prompt, PromptSettings, ReduceMode, RetentionOverride, Strategy, Version,
    VersionContent, VersionSource,
};
pub use round::Method;
pub use round_detail::{GroupOutput, RoundDetail};
pub use trace::{Feedback, NewTrace, Trace, TraceStatus};
