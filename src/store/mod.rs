//! Persistence behind one narrow trait, with a Postgres implementation
//! (production, many processes) and an embedded SQLite one (the default, no
//! server needed). Dispatch on the URL happens once, in [`connect`]. Every SQL
//! statement lives next to the store function that runs it.

mod backend;
pub mod export;
mod migrate;
pub mod postgres;
mod sql;
pub mod sqlite;

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::broadcast;
use utoipa::ToSchema;
use uuid::Uuid;

use crate::{
    domain::{
        Feedback, LabelHistoryEntry, LabelMoveKind, LabelName, MoveCause, Promotion, Prompt, PromptName,
        PromptSettings, Reflection, Strategy, Trace, TraceStatus, Version,
        event::EventType,
        prompt::NewVersion,
        round::{Method, Round, RoundTrigger},
        trace::ValidTrace,
    },
    llm::LlmCall,
    secret::Secret,
};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("not found")]
    NotFound,
    /// A unique constraint (e.g. prompt name) was hit.
    #[error("already exists")]
    AlreadyExists,
    /// An optimistic-concurrency check failed; the value holds the current state.
    #[error("precondition failed")]
    Conflict,
    /// Input referenced something that does not exist (e.g. a trace for an unknown prompt).
    #[error("{0}")]
    Invalid(String),
    /// The database could not be reached in time.
    #[error("store unavailable")]
    Unavailable(#[source] sqlx::Error),
    #[error("database error")]
    Database(#[source] sqlx::Error),
    #[error("corrupt row: {0}")]
    Corrupt(String),
    #[error("migration failed: {0}")]
    Migration(String),
    /// This inbound webhook id already opened a round.
    #[error("already processed")]
    Duplicate,
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::RowNotFound => StoreError::NotFound,
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => StoreError::Unavailable(e),
            sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::AlreadyExists,
            sqlx::Error::Database(db) if db.code().is_some_and(|c| is_outage_sqlstate(&c)) => {
                StoreError::Unavailable(e)
            }
            _ => StoreError::Database(e),
        }
    }
}

/// True for the SQLSTATE classes that mean the server is going away or the
/// connection broke, not that the statement was wrong: `08` (connection
/// exception) and `57` (operator intervention: `57P01` admin shutdown during
/// `pg_ctl restart -m fast`, `57P03` cannot connect now, `57014` canceled).
/// A SQLSTATE is five characters; SQLite's numeric codes never match.
fn is_outage_sqlstate(code: &str) -> bool {
    code.len() == 5 && (code.starts_with("08") || code.starts_with("57"))
}

pub type StoreResult<T> = Result<T, StoreError>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    Postgres,
    Sqlite,
}

/// Something changed that cached readers must drop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Versions or labels of this prompt changed.
    Prompt(String),
    /// An API key was created or revoked.
    Keys,
    /// A round was queued or re-queued: workers may wake up.
    RoundQueued,
    /// Webhook deliveries were queued: the delivery worker may wake up.
    OutboxEvent,
    /// Notifications may have been missed (listener reconnected): drop everything.
    Resync,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize, ToSchema)]
pub enum Scope {
    #[serde(rename = "traces:write")]
    TracesWrite,
    #[serde(rename = "prompts:read")]
    PromptsRead,
    #[serde(rename = "prompts:write")]
    PromptsWrite,
    #[serde(rename = "prompts:promote")]
    PromptsPromote,
    #[serde(rename = "rounds:trigger")]
    RoundsTrigger,
    #[serde(rename = "admin")]
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 6] = [
        Scope::TracesWrite,
        Scope::PromptsRead,
        Scope::PromptsWrite,
        Scope::PromptsPromote,
        Scope::RoundsTrigger,
        Scope::Admin,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::TracesWrite => "traces:write",
            Scope::PromptsRead => "prompts:read",
            Scope::PromptsWrite => "prompts:write",
            Scope::PromptsPromote => "prompts:promote",
            Scope::RoundsTrigger => "rounds:trigger",
            Scope::Admin => "admin",
        }
    }
    pub fn parse(s: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|x| x.as_str() == s)
    }
}

pub fn scopes_to_string(scopes: &[Scope]) -> String {
    scopes.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(" ")
}

pub fn scopes_from_string(s: &str) -> StoreResult<Vec<Scope>> {
    s.split_whitespace()
        .map(|x| Scope::parse(x).ok_or_else(|| StoreError::Corrupt(format!("unknown scope {x:?}"))))
        .collect()
}

/// An API key as stored: the secret itself is never kept, only its hash.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ApiKey {
    pub id: Uuid,
    pub name: String,
    /// The visible start of the key (`cmb_abcd1234`), for telling keys apart.
    pub prefix: String,
    #[serde(skip)]
    pub hash: String,
    pub scopes: Vec<Scope>,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}

/// An operator's web UI session, opened by signing in with an API key.
#[derive(Debug, Clone, PartialEq)]
pub struct UiSession {
    pub key_id: Uuid,
    /// Rendered into every state-changing form and checked on POST.
    pub csrf_token: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

#[derive(Debug, Clone)]
pub struct NewUiSession {
    /// SHA-256 of the cookie's token; the token itself is never stored.
    pub token_hash: String,
    pub key_id: Uuid,
    pub csrf_token: String,
    pub expires_at: DateTime<Utc>,
}

#[derive(Debug, Clone)]
pub struct NewPrompt {
    pub name: PromptName,
    pub strategy: Strategy,
    pub promotion: Promotion,
    pub settings: PromptSettings,
    pub created_by: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Label {
    #[schema(value_type = String)]
    pub name: LabelName,
    pub version: i64,
    pub updated_at: DateTime<Utc>,
    pub updated_by: String,
}

/// How the label moves that come with a new version enter the label history.
pub(crate) fn version_move_kind(source: crate::domain::VersionSource) -> LabelMoveKind {
    match source {
        crate::domain::VersionSource::Rollback => LabelMoveKind::Rollback,
        crate::domain::VersionSource::Learned => LabelMoveKind::AutoPublish,
        crate::domain::VersionSource::Manual => LabelMoveKind::Promote,
        crate::domain::VersionSource::Crossover => LabelMoveKind::Crossover,
    }
}

/// Where an arm of a prompt's population stands (policy `evaluated`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ArmState {
    /// The version `production` points at; gets most of the traffic.
    Champion,
    /// Measured on a share of the traffic; may replace the champion.
    Challenger,
    /// Gets no traffic any more (the version itself stays).
    Retired,
}

impl ArmState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Champion => "champion",
            Self::Challenger => "challenger",
            Self::Retired => "retired",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Champion, Self::Challenger, Self::Retired].into_iter().find(|x| x.as_str() == s)
    }
}

/// One version in a prompt's population, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct PopulationArm {
    pub version: i64,
    pub state: ArmState,
    /// TrueSkill rating (μ, σ) from the rating windows so far.
    pub rating: crate::evaluate::trueskill::Rating,
    /// Share of subjects served this arm (the weights of live arms sum to 1).
    pub weight: f64,
    /// Scored traces of this version counted in rating windows so far.
    pub scored_traces: u64,
    /// The version this one was learned from (`null` for the first champion);
    /// for a crossover child, the champion whose bullets it kept.
    pub created_from: Option<i64>,
    /// Every version this one came from: the one parent of a learned child,
    /// the champion and the winners a crossover child was bred from.
    pub parents: Vec<i64>,
    /// End of the last rating window this arm took part in.
    pub rated_until: Option<DateTime<Utc>>,
}

/// The rewards of one version on one task (traces carrying `metadata.task_key`).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRewards {
    pub version: i64,
    pub task_key: String,
    /// Rewarded traces of this version on this task.
    pub traces: u64,
    /// Sum of their rewards: 1/0 for `feedback.success`, else `feedback.score`.
    pub reward_sum: f64,
}

/// Which version of a prompt a reader wants.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Selector {
    Label(LabelName),
    Latest,
    Version(i64),
}

/// A version with the labels that point at it.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub version: Version,
    pub labels: Vec<LabelName>,
}

/// A compare-and-set label move.
#[derive(Debug, Clone)]
pub struct LabelMove {
    pub label: LabelName,
    pub to_version: i64,
    /// The version the label must point at now (`None`: it must not exist, or don't care — see `require_current`).
    pub expected_current: Option<i64>,
    /// When false the move happens whatever the label points at.
    pub check_current: bool,
    pub by: String,
}

#[derive(Debug, Clone, Default)]
pub struct TraceFilter {
    pub prompt: Option<PromptName>,
    pub status: Option<TraceStatus>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    /// Return traces with ids below this (newest first pagination).
    pub before_id: Option<Uuid>,
}

/// The result of an operator action on one trace.
#[derive(Debug, Clone, PartialEq)]
pub enum TraceAction {
    /// Done; the trace as it is now (for a delete: as it was).
    Done(Box<Trace>),
    NotFound,
    /// Not allowed in the trace's state; the text says why, for the operator.
    Refused(String),
}

impl TraceAction {
    /// `Done` with the trace as it is now, or `NotFound`.
    pub(crate) fn found(trace: Option<Trace>) -> Self {
        trace.map_or(Self::NotFound, |t| Self::Done(Box::new(t)))
    }
}

/// Why an operator action on a trace in this state is refused, if it is.
/// `status` is the stored status column (never `quarantined`).
pub(crate) fn trace_action_refusal(delete: bool, status: &str, round_id: Option<Uuid>) -> Option<String> {
    let verb = if delete { "deleted" } else { "quarantined" };
    if status == "consumed" {
        return Some(format!(
            "the trace was consumed by a round and a version was learned from it; it cannot be {verb} \
             (roll back the version instead)"
        ));
    }
    round_id.map(|r| {
        format!("the trace is reserved by round {r}, which is in flight; it can be {verb} once the round ends")
    })
}

/// Which failed traces of a prompt to put back to pending.
#[derive(Debug, Clone)]
pub struct RequeueFailed {
    pub prompt: PromptName,
    /// Only these traces (ids of traces that are not failed are skipped); `None`: every failed one.
    pub ids: Option<Vec<Uuid>>,
    /// Only traces received at or after this.
    pub since: Option<DateTime<Utc>>,
}

/// An `Idempotency-Key` as the store keeps it: per caller, bound to the hash
/// of the request it first came with.
#[derive(Debug, Clone, Copy)]
pub struct IdempotencyKey<'a> {
    pub owner: Uuid,
    pub key: &'a str,
    pub request_hash: &'a str,
}

/// How an ingest under an `Idempotency-Key` ended.
#[derive(Debug, Clone, PartialEq)]
pub enum IdempotentIngest {
    /// First sighting: the traces and the answer were committed together.
    Stored { ids: Vec<Uuid>, status: u16, body: Vec<u8> },
    /// The same request was stored before: replay its answer (nothing stored now).
    Replay { status: u16, body: Vec<u8> },
    /// The same key was used with another payload (nothing stored).
    Mismatch,
}

/// One OTLP span as the store keeps it (see [`Store::merge_otlp_spans`]).
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpSpan {
    /// 16 lowercase hex digits, unique within its OpenTelemetry trace.
    pub span_id: String,
    /// Opaque to the store: the OTLP module's encoding of the span with its resource.
    pub body: Vec<u8>,
}

/// What the OTLP mapping makes of every span a trace id has so far; the store
/// asks it inside the merge transaction, with the stored spans first.
#[derive(Debug, Clone, PartialEq)]
pub enum OtlpRemap {
    /// The spans map to this trace.
    Mapped(Box<ValidTrace>),
    /// Not yet (no prompt or no input so far): hold the spans for the rest of the trace.
    Incomplete(String),
    /// They cannot map: the new spans are rejected for this reason.
    Invalid(String),
}

/// The outcome of [`Store::merge_otlp_spans`]. `added` counts spans stored by this call.
#[derive(Debug, Clone, PartialEq)]
pub enum OtlpMerge {
    /// A new pending trace was made (with any spans held before).
    Created { trace: Uuid, added: usize },
    /// The pending trace of this trace id was re-mapped with the new spans.
    Extended { trace: Uuid, added: usize },
    /// Stored, but not a trace yet.
    Held { added: usize, reason: String },
    /// Every span was stored before: nothing changed.
    Duplicate,
    /// The trace was already taken by a round; the `spans` new ones were not stored.
    Closed { trace: Uuid, spans: usize },
    /// The `spans` new ones were not stored, for this reason.
    Rejected { spans: usize, reason: String },
}

/// The mapping callback of [`Store::merge_otlp_spans`]: stored bodies first, then the new ones.
pub type OtlpRemapFn<'a> = dyn Fn(&[&[u8]]) -> OtlpRemap + Send + Sync + 'a;

/// Why a trace (posted, or re-mapped from OTLP spans) cannot be stored, or `None`: `version_count` is
/// the prompt's, `None` when it does not exist. Shared by both backends.
pub(crate) fn prompt_reference_problem(trace: &ValidTrace, version_count: Option<i64>) -> Option<String> {
    let prompt = trace.prompt.as_str();
    match (version_count, trace.prompt_version) {
        (None, _) => Some(format!("unknown prompt {prompt:?}; create it first (POST /v1/prompts)")),
        (Some(last), Some(v)) if v > last => {
            Some(format!("prompt {prompt:?} has no version {v} (the latest is {last})"))
        }
        _ => None,
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PromptSummary {
    #[serde(flatten)]
    pub prompt: Prompt,
    pub production_version: Option<i64>,
    pub latest_version: i64,
    pub pending_traces: i64,
}

/// A request to open a round over a prompt's oldest pending traces.
#[derive(Debug, Clone)]
pub struct OpenRound {
    pub prompt: PromptName,
    pub trigger: RoundTrigger,
    pub method: Method,
    /// Take at most this many traces.
    pub batch: u32,
    /// Open nothing when fewer traces are pending.
    pub min_traces: u32,
    pub seed: i64,
    /// The `webhook-id` of the inbound trigger asking for this round: it is
    /// remembered in the round's transaction, so only with a round opened.
    pub inbound_webhook_id: Option<String>,
}

/// A prompt's learning backlog, for the scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct Backlog {
    pub prompt: Prompt,
    /// Pending traces not reserved by a round.
    pub pending: i64,
    pub oldest: Option<DateTime<Utc>>,
    /// A round is queued or running.
    pub active_round: bool,
}

/// A round a worker now holds the lease of, with everything needed to run it.
#[derive(Debug, Clone)]
pub struct ClaimedRound {
    pub round: Round,
    pub prompt: Prompt,
    pub base: Version,
    pub traces: Vec<Trace>,
}

/// One stored LLM call of a round.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RoundCall {
    pub attempt: i32,
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub call: LlmCall,
    pub created_at: DateTime<Utc>,
}

/// One delay sample of the batch-size controller, as stored.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ControllerSample {
    pub batch_size: u32,
    pub round_secs: f64,
    pub round_id: Uuid,
    pub created_at: DateTime<Utc>,
}

/// Overload-meter counts of one group-size bucket (see `learn::meter`):
/// copies marked by another covered copy of their reflection, and of them
/// those their own group covered too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct MeterCounts {
    /// Smallest group size of the bucket (a power of two).
    pub size_min: u32,
    pub marked: u64,
    pub recaptured: u64,
    /// Rounds that contributed (1 when recording one round).
    pub rounds: u64,
}

/// An outbound webhook subscription. The secret signs deliveries; it is
/// shown once when the subscription is created and never serialised.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Webhook {
    pub id: Uuid,
    pub url: String,
    pub events: Vec<EventType>,
    pub description: Option<String>,
    /// False once the receiver answered 410 Gone.
    pub enabled: bool,
    pub disabled_reason: Option<String>,
    pub created_at: DateTime<Utc>,
    #[serde(skip)]
    #[schema(ignore)]
    pub secret: Secret,
}

#[derive(Debug, Clone)]
pub struct NewWebhook {
    pub url: String,
    pub events: Vec<EventType>,
    pub description: Option<String>,
    pub secret: Secret,
}

/// A delivery a worker holds the lease of: everything needed to send it.
#[derive(Debug, Clone)]
pub struct ClaimedDelivery {
    pub id: Uuid,
    pub subscription_id: Uuid,
    pub event_id: String,
    pub event_type: String,
    pub body: String,
    pub url: String,
    pub secret: Secret,
    /// This attempt's number (1 for the first), fencing its result.
    pub attempt: i32,
}

/// What became of one delivery attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum DeliveryOutcome {
    Succeeded,
    /// Try again at `at`.
    Retry {
        at: DateTime<Utc>,
    },
    /// No more attempts.
    GiveUp,
    /// The receiver answered 410 Gone: give up and disable the subscription.
    Gone,
}

/// One attempt as recorded in the delivery log.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    pub status_code: Option<u16>,
    pub error: Option<String>,
    pub latency_ms: u64,
    pub outcome: DeliveryOutcome,
}

/// One line of a subscription's delivery log.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DeliveryAttempt {
    /// Cursor position in the log.
    #[serde(skip)]
    pub seq: i64,
    pub delivery_id: Uuid,
    /// The event's id, sent as `webhook-id` on every attempt.
    pub event_id: String,
    pub event_type: String,
    pub attempt: i32,
    pub status_code: Option<u16>,
    pub error: Option<String>,
    pub latency_ms: u64,
    pub attempted_at: DateTime<Utc>,
    /// When the next attempt is due; absent when this one succeeded or was the last.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// The delivery's state now: `pending`, `succeeded` or `failed`.
    pub delivery_status: String,
}

/// A trace that failed on its own account in a round: its reflection could not be obtained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceFault {
    pub trace_id: Uuid,
    pub reason: String,
}

/// What the end of a round charges to its traces. Only a trace's own failure
/// costs it an attempt: each faulted trace returns to pending with one more
/// attempt and the reason in `failure_reason`, or is marked `failed` once its
/// attempts reach `max_trace_attempts`. Every other trace of the round pays nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceCharges {
    pub faults: Vec<TraceFault>,
    pub max_trace_attempts: i32,
}

/// How a round ends when it cannot publish.
#[derive(Debug, Clone)]
pub enum RoundFailure {
    /// Try again later (same traces, same seed) — after `after`.
    Retry { after: std::time::Duration },
    /// Give up: the traces return to pending; only those in `charges` (their own
    /// reflection failed) pay an attempt — a failure elsewhere in the round is not theirs.
    GiveUp { charges: TraceCharges },
}

#[async_trait]
pub trait Store: export::ExportStore + Send + Sync + 'static {
    fn kind(&self) -> StoreKind;
    /// Cheap reachability check for `/readyz`.
    async fn ping(&self) -> StoreResult<()>;
    /// Cache invalidations; on Postgres they arrive from every process.
    fn changes(&self) -> broadcast::Receiver<Change>;

    // API keys
    async fn create_api_key(&self, name: &str, prefix: &str, hash: &str, scopes: &[Scope]) -> StoreResult<ApiKey>;
    async fn api_key_by_hash(&self, hash: &str) -> StoreResult<Option<ApiKey>>;
    async fn list_api_keys(&self) -> StoreResult<Vec<ApiKey>>;
    /// Revokes by id or by visible prefix; false when nothing matched.
    async fn revoke_api_key(&self, id_or_prefix: &str) -> StoreResult<bool>;
    async fn count_active_api_keys(&self) -> StoreResult<i64>;
    /// A counter that grows with every revocation (or deletion) of a key, by
    /// any process: one cheap read tells whether cached keys are still current.
    async fn api_key_generation(&self) -> StoreResult<i64>;

    // Operator web UI sessions
    /// Opens a session, and deletes expired ones on the way.
    async fn create_ui_session(&self, session: &NewUiSession) -> StoreResult<()>;
    /// The unexpired session with this token hash and the key it was opened
    /// with — revoked or not: the caller decides what a revoked key means.
    async fn ui_session(&self, token_hash: &str) -> StoreResult<Option<(UiSession, ApiKey)>>;
    /// False when there was no such session.
    async fn delete_ui_session(&self, token_hash: &str) -> StoreResult<bool>;

    // Prompts and versions
    /// Creates the prompt and its version 1, labelled `production` (a `create`
    /// entry in the label history).
    async fn create_prompt(&self, prompt: NewPrompt, first: NewVersion) -> StoreResult<(Prompt, Version)>;
    async fn get_prompt(&self, name: &PromptName) -> StoreResult<Option<Prompt>>;
    /// Replaces a prompt's settings if they still equal `expected` (`Conflict`
    /// otherwise: read again and retry); `None` when the prompt does not exist.
    async fn update_prompt_settings(
        &self,
        name: &PromptName,
        expected: &PromptSettings,
        new: &PromptSettings,
    ) -> StoreResult<Option<Prompt>>;
    /// Prompts ordered by name, starting after `after`.
    async fn list_prompts(&self, after: Option<&str>, limit: u32) -> StoreResult<Vec<PromptSummary>>;
    /// Appends a version (number = previous + 1, never a gap or a duplicate) and
    /// applies the label moves in the same transaction. A failed CAS rolls all back.
    /// The moves enter the label history as `rollback` when the version's source
    /// is `rollback`, as `promote` otherwise, with the version's message as reason.
    async fn create_version(
        &self,
        prompt: &PromptName,
        version: NewVersion,
        moves: &[LabelMove],
    ) -> StoreResult<Version>;
    async fn resolve(&self, prompt: &PromptName, selector: &Selector) -> StoreResult<Option<Resolved>>;
    /// Versions newest first, with numbers below `before`.
    async fn list_versions(&self, prompt: &PromptName, before: Option<i64>, limit: u32) -> StoreResult<Vec<Version>>;
    async fn list_labels(&self, prompt: &PromptName) -> StoreResult<Vec<Label>>;
    /// Applies one compare-and-set label move (`Conflict` when the CAS fails),
    /// recorded in the label history as an operator's `promote`.
    async fn move_label(&self, prompt: &PromptName, mv: &LabelMove) -> StoreResult<Label> {
        self.move_label_because(prompt, mv, &MoveCause::new(LabelMoveKind::Promote, "")).await
    }
    /// [`Store::move_label`] recording `cause` in the label history, in the
    /// same transaction (a move that changes nothing records nothing). A
    /// `guard-rollback` or `rollback` also queues a `prompt.rolled_back` event.
    async fn move_label_because(&self, prompt: &PromptName, mv: &LabelMove, cause: &MoveCause) -> StoreResult<Label>;
    /// Per (version, `metadata.task_key`) reward sums of the prompt's rewarded,
    /// unquarantined traces created in `[from, until)` (traces without a string
    /// task key or a version are left out), so arms can be compared on matched work.
    async fn task_rewards(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<Vec<TaskRewards>>;
    /// The prompt's population (every arm, retired ones too), by version.
    async fn population(&self, prompt: &PromptName) -> StoreResult<Vec<PopulationArm>>;
    /// Inserts or replaces these arms (by version) in one transaction, and
    /// tells every process's cache (NOTIFY on Postgres). `NotFound` for an
    /// unknown prompt, `Invalid` for a version it does not have.
    async fn save_population(&self, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()>;
    /// Deletes a label, recording who did it in the label history; false when
    /// there was no such label.
    async fn delete_label(&self, prompt: &PromptName, label: &LabelName, by: &str) -> StoreResult<bool>;
    /// The prompt's label history, newest first: moves with ids below
    /// `before`, of `label` only when given. Empty for an unknown prompt.
    async fn label_history(
        &self,
        prompt: &PromptName,
        label: Option<&LabelName>,
        before: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<LabelHistoryEntry>>;

    // Traces
    /// Stores traces durably, all or none; `Invalid` names the first unknown prompt or version.
    async fn insert_traces(&self, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>>;
    async fn get_trace(&self, id: Uuid) -> StoreResult<Option<Trace>>;
    /// Newest first.
    async fn list_traces(&self, filter: &TraceFilter, limit: u32) -> StoreResult<Vec<Trace>>;
    async fn add_feedback(&self, id: Uuid, feedback: Feedback) -> StoreResult<Option<Trace>>;
    /// Puts the prompt's matching `failed` traces back to `pending` with their
    /// attempts reset and failure reason cleared; returns their ids, oldest
    /// first. `NotFound` when the prompt does not exist.
    async fn requeue_failed_traces(&self, req: &RequeueFailed) -> StoreResult<Vec<Uuid>>;
    /// Adds the spans of one OpenTelemetry trace id, in one transaction
    /// serialised per trace id (a row lock on Postgres, the single writer on
    /// SQLite): spans whose id is stored already are ignored; if any are new,
    /// `remap` maps the union and the trace id's pending trace is made or
    /// re-mapped, or the spans are held. A trace already taken by a round is
    /// not changed (`Closed`).
    async fn merge_otlp_spans(
        &self,
        otel_trace_id: &str,
        spans: &[OtlpSpan],
        remap: &OtlpRemapFn<'_>,
    ) -> StoreResult<OtlpMerge>;
    /// Forgets held spans (that never became a trace) of trace ids that got
    /// nothing since `older_than`; returns how many spans.
    async fn purge_held_otlp_spans(&self, older_than: DateTime<Utc>) -> StoreResult<u64>;
    /// Holds a pending or failed trace back from learning (idempotent); refused
    /// while a round has it reserved or once it was consumed.
    async fn quarantine_trace(&self, id: Uuid, reason: &str) -> StoreResult<TraceAction>;
    /// Quarantines every unreserved pending trace of `filter.prompt` created in
    /// `[since, until)`; returns how many. `filter.status` and `before_id` are ignored.
    async fn quarantine_traces(&self, filter: &TraceFilter, reason: &str) -> StoreResult<u64>;
    /// Lifts a trace's quarantine: it is learned from again (a pending trace
    /// rejoins the backlog). Idempotent: a trace not quarantined is unchanged.
    async fn release_trace(&self, id: Uuid) -> StoreResult<TraceAction>;
    /// Deletes a trace that no version was learned from (with its reflections
    /// in failed rounds); refused while a round has it reserved or once consumed.
    async fn delete_trace(&self, id: Uuid) -> StoreResult<TraceAction>;
    /// Per (version, time bucket) outcome aggregates of the prompt's traces
    /// created in `[from, until)`; buckets are `bucket_secs` wide, aligned to
    /// the Unix epoch. Read from the trace rows, so late feedback counts at once.
    /// Quarantined traces are left out: their rewards are not trusted.
    async fn version_outcomes(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_secs: i64,
    ) -> StoreResult<Vec<crate::evaluate::outcomes::OutcomeBucket>>;

    // Idempotency
    /// Stores traces and remembers the key with its answer (`status`, and the
    /// body `answer` renders from the new ids) in ONE transaction: an outage
    /// at any point leaves either both or neither, so a retry either replays
    /// or stores — never twice, and never a key stuck "in flight". A
    /// concurrent request with the same key waits for the first to end.
    /// `Invalid` (nothing stored, key not remembered) as for `insert_traces`.
    async fn insert_traces_idempotent(
        &self,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
        status: u16,
        answer: &(dyn for<'i> Fn(&'i [Uuid]) -> Vec<u8> + Send + Sync),
    ) -> StoreResult<IdempotentIngest>;
    /// Deletes keys older than the retention; returns how many.
    async fn idempotency_purge(&self, older_than: DateTime<Utc>) -> StoreResult<u64>;

    // Rounds
    /// Reserves up to `batch` of the prompt's oldest pending traces for a new
    /// queued round. `None` when fewer than `min_traces` are pending;
    /// `AlreadyExists` when the prompt has a round in flight; `Duplicate` when
    /// `inbound_webhook_id` opened a round before. The id is remembered only
    /// when this call opens the round: a refused trigger can be retried.
    async fn open_round(&self, req: &OpenRound) -> StoreResult<Option<Round>>;
    /// Per prompt: unreserved pending traces, the oldest one's age, whether a round is in flight.
    async fn backlogs(&self) -> StoreResult<Vec<Backlog>>;
    /// Takes the lease of the oldest claimable round (queued and due, or
    /// running with an expired lease) and bumps its attempt number.
    async fn claim_round(&self, owner: &str, lease: std::time::Duration) -> StoreResult<Option<ClaimedRound>>;
    /// Extends the lease; false when this attempt no longer holds it.
    async fn heartbeat_round(&self, round: Uuid, attempt: i32, lease: std::time::Duration) -> StoreResult<bool>;
    /// Copies into `round` the reflections that earlier rounds of the same prompt
    /// stored for the round's traces against the same base version and strategy,
    /// so a re-run over the same base pays no reflector call twice. Returns how many
    /// were copied; reflections the round already has are kept.
    async fn adopt_reflections(&self, round: Uuid) -> StoreResult<u64>;
    /// Stores a reflection once (a repeat for the same trace is ignored).
    async fn save_reflection(
        &self,
        round: Uuid,
        trace: Uuid,
        reflection: &Reflection,
        from_trace: bool,
    ) -> StoreResult<()>;
    async fn round_reflections(&self, round: Uuid) -> StoreResult<Vec<(Uuid, Reflection, bool)>>;
    async fn record_llm_call(&self, round: Uuid, attempt: i32, call: &LlmCall) -> StoreResult<()>;
    async fn round_calls(&self, round: Uuid) -> StoreResult<Vec<RoundCall>>;
    /// Saves progress (k, phase timings, group outputs); false when the lease was lost.
    async fn update_round(
        &self,
        round: Uuid,
        attempt: i32,
        k: Option<i32>,
        detail: &serde_json::Value,
    ) -> StoreResult<bool>;
    /// In one transaction, fenced by the attempt: writes the version, moves
    /// `label` to it (an `auto-publish` entry in the label history), charges the traces in `charges` (see [`TraceCharges`]),
    /// marks consumed the round's traces that have a stored reflection (the others
    /// return to pending uncharged: nothing was learned from them), marks the round succeeded,
    /// and (given `sample_secs`) records the batch-size controller's delay sample
    /// — atomically, so the scheduler never sees the round done but unsampled.
    /// `Conflict` when the lease was lost.
    // One fenced transaction needs all of these; a wrapper struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    async fn publish_round(
        &self,
        round: Uuid,
        attempt: i32,
        version: NewVersion,
        label: LabelName,
        detail: &serde_json::Value,
        sample_secs: Option<f64>,
        charges: &TraceCharges,
    ) -> StoreResult<Version>;
    /// Ends an attempt that could not publish (fenced by the attempt).
    async fn fail_round(&self, round: Uuid, attempt: i32, error: &str, how: RoundFailure) -> StoreResult<()>;
    async fn get_round(&self, id: Uuid) -> StoreResult<Option<Round>>;
    /// Newest first, optionally for one prompt, before a round id (cursor).
    async fn list_rounds(
        &self,
        prompt: Option<&PromptName>,
        before: Option<Uuid>,
        limit: u32,
    ) -> StoreResult<Vec<Round>>;
    /// The trace ids a round reserved, in batch order.
    async fn round_trace_ids(&self, round: Uuid) -> StoreResult<Vec<Uuid>>;

    // Outbound webhooks
    async fn create_webhook(&self, hook: &NewWebhook) -> StoreResult<Webhook>;
    async fn list_webhooks(&self) -> StoreResult<Vec<Webhook>>;
    async fn get_webhook(&self, id: Uuid) -> StoreResult<Option<Webhook>>;
    /// Deletes the subscription with its pending deliveries and log; false when unknown.
    async fn delete_webhook(&self, id: Uuid) -> StoreResult<bool>;
    /// The subscription's delivery log, newest first, below the `before` cursor.
    async fn webhook_attempts(&self, id: Uuid, before: Option<i64>, limit: u32) -> StoreResult<Vec<DeliveryAttempt>>;
    /// Takes the lease of up to `limit` due deliveries (pending with
    /// `next_attempt_at` passed — an expired lease counts as due) of enabled
    /// subscriptions, bumping each one's attempt number.
    async fn claim_deliveries(&self, owner: &str, lease: Duration, limit: u32) -> StoreResult<Vec<ClaimedDelivery>>;
    /// Records an attempt and its outcome; false when the attempt no longer holds the lease.
    async fn finish_delivery(&self, d: &ClaimedDelivery, record: &AttemptRecord) -> StoreResult<bool>;

    // Batch-size controller
    /// The prompt's most recent samples, oldest first.
    async fn controller_samples(&self, prompt: &PromptName, limit: u32) -> StoreResult<Vec<ControllerSample>>;
    async fn save_controller_choice(&self, prompt: &PromptName, choice: &serde_json::Value) -> StoreResult<()>;
    async fn controller_choice(&self, prompt: &PromptName) -> StoreResult<Option<(serde_json::Value, DateTime<Utc>)>>;

    // Overload meter
    /// Records one round's meter counts per bucket; recording the same round
    /// again changes nothing (`rounds` of the input is ignored).
    async fn record_meter_counts(&self, prompt: &PromptName, round: Uuid, counts: &[MeterCounts]) -> StoreResult<()>;
    /// The prompt's meter: counts summed over its rounds, per bucket, smallest first.
    async fn meter_counts(&self, prompt: &PromptName) -> StoreResult<Vec<MeterCounts>>;
}

pub type DynStore = Arc<dyn Store>;

/// Opens the store the URL names, creating and migrating it as needed.
pub async fn connect(url: &str, max_connections: u32, acquire_timeout: std::time::Duration) -> StoreResult<DynStore> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(Arc::new(postgres::PgStore::connect(url, max_connections, acquire_timeout).await?))
    } else if let Some(path) = url.strip_prefix("sqlite://") {
        Ok(Arc::new(sqlite::SqliteStore::open(std::path::Path::new(path), max_connections, acquire_timeout).await?))
    } else {
        Err(StoreError::Invalid("database url must start with postgres://, postgresql:// or sqlite://".into()))
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;

    /// A database error carrying just a SQLSTATE, as a driver would report it.
    #[derive(Debug)]
    struct Coded(&'static str);

    impl std::fmt::Display for Coded {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "error {}", self.0)
        }
    }

    impl std::error::Error for Coded {}

    impl sqlx::error::DatabaseError for Coded {
        fn message(&self) -> &str {
            "simulated"
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            if self.0 == "23505" { sqlx::error::ErrorKind::UniqueViolation } else { sqlx::error::ErrorKind::Other }
        }
    }

    fn mapped(code: &'static str) -> StoreError {
        StoreError::from(sqlx::Error::Database(Box::new(Coded(code))))
    }

    #[test]
    fn server_shutdown_and_broken_connections_are_outages_not_bugs() {
        // 57P01 admin_shutdown is what `pg_ctl restart -m fast` sends to open sessions.
        for code in ["57P01", "57P02", "57P03", "57014", "08000", "08003", "08006", "08P01"] {
            assert!(matches!(mapped(code), StoreError::Unavailable(_)), "{code} is an outage");
        }
        assert!(matches!(mapped("23505"), StoreError::AlreadyExists));
        for code in ["42P01", "22P02", "40001", "5", "517"] {
            assert!(matches!(mapped(code), StoreError::Database(_)), "{code} is not an outage");
        }
    }
}
