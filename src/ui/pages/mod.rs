//! The UI's read-only pages: prompts, one prompt (text, labels, history,
//! promote / roll back forms, the regression set), a version with its
//! regression gate, a diff, rounds, one round, the batch-size
//! controller, the trace browser, and the audit log, one file per page; the small helpers
//! they share are here. GET handlers never change state.

use std::fmt::Write;

use axum::{
    extract::{Path, Query, State},
    response::Html,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::{
    UiError,
    html::{NavSection, badge, clip, duration_ms, escape, opt_time, page, time, url_encode},
    plot,
    session::Operator,
};
use crate::{
    domain::{
        DeltaOp, LabelName, PromptName, RoundDetail, Strategy, TraceStatus,
        diff::{LineTag, SectionBullet},
        round::{Round, method_str, strategy_str},
    },
    domain::{access::Scope, label::Selector, trace::TraceFilter},
    learn::round::{LearnedRoundDetail, OutcomeRecord},
    service::{
        self, AppState, ServiceError,
        controller::controller_view,
        pagination::{PageParams, next_token},
        projects::PathPrompt,
        prompts::{existing_prompt, version_diff},
        rounds::round_view,
    },
};

mod audit;
mod budget;
mod controller;
mod diff;
mod prompts;
mod rounds;
mod traces;
mod versions;

pub use audit::audit;
pub use controller::controller;
pub use diff::diff;
pub use prompts::{prompt, prompts};
pub use rounds::{round, rounds};
pub use traces::{trace, traces};
pub use versions::version;

type PageResult = Result<Html<String>, UiError>;

const PAGE: u32 = 50;

/// A serde enum's wire name (`"auto"`, `"reflector"`, …).
fn word<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        _ => "?".to_owned(),
    }
}

/// A prompt as this session writes it in a path, percent-encoded: its bare
/// name in the session's project (`default` for a server-wide session),
/// `project/name` otherwise.
fn in_path(op: &Operator, name: &PromptName) -> String {
    url_encode(&name.written_from(op.reach().project().unwrap_or(crate::domain::names::DEFAULT_PROJECT)))
}

fn prompt_link(op: &Operator, name: &PromptName) -> String {
    format!(r#"<a href="/ui/prompts/{}">{}</a>"#, escape(&in_path(op, name)), escape(name.as_str()))
}

fn round_link(id: Uuid, text: &str) -> String {
    format!(r#"<a href="/ui/rounds/{id}" title="{id}">{}</a>"#, escape(text))
}

/// The last 8 hex digits: ids are UUIDv7, whose first digits are a timestamp
/// shared by everything made in the same millisecond.
fn short_id(id: Uuid) -> String {
    let hex = id.simple().to_string();
    hex[hex.len() - 8..].to_owned()
}

fn pretty(v: &Value) -> String {
    escape(&serde_json::to_string_pretty(v).unwrap_or_default())
}

fn round_duration_ms(r: &Round) -> Option<f64> {
    Some((r.finished_at? - r.started_at?).num_milliseconds() as f64)
}

fn prompt_tabs(op: &Operator, name: &PromptName, current: &str) -> String {
    let n = escape(&in_path(op, name));
    let tab = |href: String, label: &str, key: &str| {
        let class = if key == current { r#" class="current""# } else { "" };
        format!(r#"<a href="{href}"{class}>{label}</a>"#)
    };
    format!(
        r#"<nav class="tabs">{}{}{}{}</nav>"#,
        tab(format!("/ui/prompts/{n}"), "Versions", "prompt"),
        tab(format!("/ui/prompts/{n}/rounds"), "Rounds", "rounds"),
        tab(format!("/ui/prompts/{n}/controller"), "Controller", "controller"),
        tab(format!("/ui/traces?prompt={n}"), "Traces", "traces"),
    )
}
