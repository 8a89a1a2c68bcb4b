//! One [`Store`] implementation for both SQL backends: [`SqlStore`] holds the
//! pools and the change broadcast; each method is either written once here
//! over [`Dialect`](super::sql::Dialect), or handed to the backend's
//! [`Backend`] implementation where its SQL really differs.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::evaluate::outcomes::OutcomeBucket;
use serde_json::Value;
use sqlx::Pool;
use tokio::sync::broadcast;
use uuid::Uuid;

use super::{
    ApiKey, AttemptRecord, Backlog, Change, ClaimedDelivery, ClaimedRound, DeliveryAttempt, IdempotencyKey,
    IdempotentIngest, Label, LabelMove, NewPrompt, NewUiSession, NewWebhook, OpenRound, OtlpMerge, OtlpRemapFn,
    OtlpSpan, PopulationArm, PromptSummary, RequeueFailed, Resolved, RoundCall, RoundFailure, Scope, Selector, Store,
    StoreKind, StoreResult, TaskRewards, TraceAction, TraceCharges, TraceFilter, UiSession, Webhook, sql::Dialect,
};
use crate::{
    domain::{
        Feedback, LabelHistoryEntry, LabelName, MoveCause, Prompt, PromptName, PromptSettings, Reflection, Trace,
        Version, prompt::NewVersion, round::Round, trace::ValidTrace,
    },
    llm::LlmCall,
};

/// A SQL store: `writer` takes every write (SQLite: one connection, so writers
/// queue in-process), `reader` the reads (on Postgres the same pool).
pub struct SqlStore<D: Backend> {
    pub(super) writer: Pool<D>,
    pub(super) reader: Pool<D>,
    pub(super) changes: broadcast::Sender<Change>,
    /// What only this backend keeps (Postgres: its listener; SQLite: the key generation cache).
    pub(super) extra: D::Extra,
}

impl<D: Backend> SqlStore<D> {
    /// Tells this process's cache readers (SQLite; Postgres hears its own NOTIFY instead).
    pub(super) fn announce(&self, change: Change) {
        if D::ANNOUNCE_LOCALLY {
            let _ = self.changes.send(change);
        }
    }

    pub(super) fn announce_outbox(&self, queued: bool) {
        if queued {
            self.announce(Change::OutboxEvent);
        }
    }
}

/// The store methods whose SQL differs between the backends.
#[async_trait]
pub trait Backend: Dialect {
    const KIND: StoreKind;
    /// True when changes are announced in-process after commit rather than by NOTIFY.
    const ANNOUNCE_LOCALLY: bool;
    type Extra: Send + Sync + 'static;

    async fn ping(s: &SqlStore<Self>) -> StoreResult<()>;
    async fn create_api_key(
        s: &SqlStore<Self>,
        name: &str,
        prefix: &str,
        hash: &str,
        scopes: &[Scope],
    ) -> StoreResult<ApiKey>;
    async fn api_key_by_hash(s: &SqlStore<Self>, hash: &str) -> StoreResult<Option<ApiKey>>;
    async fn list_api_keys(s: &SqlStore<Self>) -> StoreResult<Vec<ApiKey>>;
    async fn revoke_api_key(s: &SqlStore<Self>, id_or_prefix: &str) -> StoreResult<bool>;
    async fn api_key_generation(s: &SqlStore<Self>) -> StoreResult<i64>;
    async fn count_active_api_keys(s: &SqlStore<Self>) -> StoreResult<i64>;
    async fn create_ui_session(s: &SqlStore<Self>, session: &NewUiSession) -> StoreResult<()>;
    async fn ui_session(s: &SqlStore<Self>, token_hash: &str) -> StoreResult<Option<(UiSession, ApiKey)>>;
    async fn delete_ui_session(s: &SqlStore<Self>, token_hash: &str) -> StoreResult<bool>;
    async fn create_prompt(s: &SqlStore<Self>, p: NewPrompt, first: NewVersion) -> StoreResult<(Prompt, Version)>;
    async fn get_prompt(s: &SqlStore<Self>, name: &PromptName) -> StoreResult<Option<Prompt>>;
    async fn update_prompt_settings(
        s: &SqlStore<Self>,
        name: &PromptName,
        expected: &PromptSettings,
        new: &PromptSettings,
    ) -> StoreResult<Option<Prompt>>;
    async fn list_prompts(s: &SqlStore<Self>, after: Option<&str>, limit: u32) -> StoreResult<Vec<PromptSummary>>;
    async fn create_version(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        v: NewVersion,
        moves: &[LabelMove],
    ) -> StoreResult<Version>;
    async fn resolve(s: &SqlStore<Self>, prompt: &PromptName, selector: &Selector) -> StoreResult<Option<Resolved>>;
    async fn list_versions(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        before: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<Version>>;
    async fn list_labels(s: &SqlStore<Self>, prompt: &PromptName) -> StoreResult<Vec<Label>>;
    async fn move_label_because(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        mv: &LabelMove,
        cause: &MoveCause,
    ) -> StoreResult<Label>;
    async fn delete_label(s: &SqlStore<Self>, prompt: &PromptName, label: &LabelName, by: &str) -> StoreResult<bool>;
    async fn task_rewards(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<Vec<TaskRewards>>;
    async fn population(s: &SqlStore<Self>, prompt: &PromptName) -> StoreResult<Vec<PopulationArm>>;
    async fn save_population(s: &SqlStore<Self>, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()>;
    async fn label_history(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        label: Option<&LabelName>,
        before: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<LabelHistoryEntry>>;
    async fn insert_traces(s: &SqlStore<Self>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>>;
    async fn get_trace(s: &SqlStore<Self>, id: Uuid) -> StoreResult<Option<Trace>>;
    async fn list_traces(s: &SqlStore<Self>, f: &TraceFilter, limit: u32) -> StoreResult<Vec<Trace>>;
    async fn add_feedback(s: &SqlStore<Self>, id: Uuid, feedback: Feedback) -> StoreResult<Option<Trace>>;
    async fn version_outcomes(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_secs: i64,
    ) -> StoreResult<Vec<OutcomeBucket>>;
    async fn quarantine_trace(s: &SqlStore<Self>, id: Uuid, reason: &str) -> StoreResult<TraceAction>;
    async fn quarantine_traces(s: &SqlStore<Self>, f: &TraceFilter, reason: &str) -> StoreResult<u64>;
    async fn release_trace(s: &SqlStore<Self>, id: Uuid) -> StoreResult<TraceAction>;
    async fn delete_trace(s: &SqlStore<Self>, id: Uuid) -> StoreResult<TraceAction>;
    async fn merge_otlp_spans(
        s: &SqlStore<Self>,
        otel_trace_id: &str,
        spans: &[OtlpSpan],
        remap: &OtlpRemapFn<'_>,
    ) -> StoreResult<OtlpMerge>;
    async fn purge_held_otlp_spans(s: &SqlStore<Self>, older_than: DateTime<Utc>) -> StoreResult<u64>;
    async fn requeue_failed_traces(s: &SqlStore<Self>, req: &RequeueFailed) -> StoreResult<Vec<Uuid>>;
    async fn insert_traces_idempotent(
        s: &SqlStore<Self>,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
        status: u16,
        answer: &(dyn for<'i> Fn(&'i [Uuid]) -> Vec<u8> + Send + Sync),
    ) -> StoreResult<IdempotentIngest>;
    async fn idempotency_purge(s: &SqlStore<Self>, older_than: DateTime<Utc>) -> StoreResult<u64>;
    async fn open_round(s: &SqlStore<Self>, req: &OpenRound) -> StoreResult<Option<Round>>;
    async fn backlogs(s: &SqlStore<Self>) -> StoreResult<Vec<Backlog>>;
    async fn claim_round(s: &SqlStore<Self>, owner: &str, lease: Duration) -> StoreResult<Option<ClaimedRound>>;
    async fn heartbeat_round(s: &SqlStore<Self>, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool>;
    async fn adopt_reflections(s: &SqlStore<Self>, round: Uuid) -> StoreResult<u64>;
    async fn save_reflection(
        s: &SqlStore<Self>,
        round: Uuid,
        trace: Uuid,
        r: &Reflection,
        from_trace: bool,
    ) -> StoreResult<()>;
    async fn round_reflections(s: &SqlStore<Self>, round: Uuid) -> StoreResult<Vec<(Uuid, Reflection, bool)>>;
    async fn record_llm_call(s: &SqlStore<Self>, round: Uuid, attempt: i32, call: &LlmCall) -> StoreResult<()>;
    async fn round_calls(s: &SqlStore<Self>, round: Uuid) -> StoreResult<Vec<RoundCall>>;
    async fn update_round(
        s: &SqlStore<Self>,
        round: Uuid,
        attempt: i32,
        k: Option<i32>,
        detail: &Value,
    ) -> StoreResult<bool>;
    // One fenced transaction needs all of these; a wrapper struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    async fn publish_round(
        s: &SqlStore<Self>,
        round: Uuid,
        attempt: i32,
        v: NewVersion,
        label: LabelName,
        detail: &Value,
        sample_secs: Option<f64>,
        charges: &TraceCharges,
    ) -> StoreResult<Version>;
    async fn fail_round(
        s: &SqlStore<Self>,
        round: Uuid,
        attempt: i32,
        error: &str,
        how: RoundFailure,
    ) -> StoreResult<()>;
    async fn get_round(s: &SqlStore<Self>, id: Uuid) -> StoreResult<Option<Round>>;
    async fn list_rounds(
        s: &SqlStore<Self>,
        prompt: Option<&PromptName>,
        before: Option<Uuid>,
        limit: u32,
    ) -> StoreResult<Vec<Round>>;
    async fn round_trace_ids(s: &SqlStore<Self>, round: Uuid) -> StoreResult<Vec<Uuid>>;
    async fn create_webhook(s: &SqlStore<Self>, h: &NewWebhook) -> StoreResult<Webhook>;
    async fn list_webhooks(s: &SqlStore<Self>) -> StoreResult<Vec<Webhook>>;
    async fn get_webhook(s: &SqlStore<Self>, id: Uuid) -> StoreResult<Option<Webhook>>;
    async fn delete_webhook(s: &SqlStore<Self>, id: Uuid) -> StoreResult<bool>;
    async fn webhook_attempts(
        s: &SqlStore<Self>,
        id: Uuid,
        before: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<DeliveryAttempt>>;
    async fn claim_deliveries(
        s: &SqlStore<Self>,
        owner: &str,
        lease: Duration,
        limit: u32,
    ) -> StoreResult<Vec<ClaimedDelivery>>;
    async fn finish_delivery(s: &SqlStore<Self>, d: &ClaimedDelivery, rec: &AttemptRecord) -> StoreResult<bool>;
    async fn controller_samples(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        limit: u32,
    ) -> StoreResult<Vec<super::ControllerSample>>;
    async fn save_controller_choice(s: &SqlStore<Self>, prompt: &PromptName, choice: &Value) -> StoreResult<()>;
    async fn controller_choice(s: &SqlStore<Self>, prompt: &PromptName) -> StoreResult<Option<(Value, DateTime<Utc>)>>;
    async fn record_meter_counts(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        round: Uuid,
        counts: &[super::MeterCounts],
    ) -> StoreResult<()>;
    async fn meter_counts(s: &SqlStore<Self>, prompt: &PromptName) -> StoreResult<Vec<super::MeterCounts>>;
}

#[async_trait]
impl<D: Backend> Store for SqlStore<D> {
    fn kind(&self) -> StoreKind {
        D::KIND
    }

    fn changes(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    async fn ping(&self) -> StoreResult<()> {
        D::ping(self).await
    }

    async fn create_api_key(&self, name: &str, prefix: &str, hash: &str, scopes: &[Scope]) -> StoreResult<ApiKey> {
        D::create_api_key(self, name, prefix, hash, scopes).await
    }

    async fn api_key_by_hash(&self, hash: &str) -> StoreResult<Option<ApiKey>> {
        D::api_key_by_hash(self, hash).await
    }

    async fn list_api_keys(&self) -> StoreResult<Vec<ApiKey>> {
        D::list_api_keys(self).await
    }

    async fn revoke_api_key(&self, id_or_prefix: &str) -> StoreResult<bool> {
        D::revoke_api_key(self, id_or_prefix).await
    }

    async fn api_key_generation(&self) -> StoreResult<i64> {
        D::api_key_generation(self).await
    }

    async fn count_active_api_keys(&self) -> StoreResult<i64> {
        D::count_active_api_keys(self).await
    }

    async fn create_ui_session(&self, session: &NewUiSession) -> StoreResult<()> {
        D::create_ui_session(self, session).await
    }

    async fn ui_session(&self, token_hash: &str) -> StoreResult<Option<(UiSession, ApiKey)>> {
        D::ui_session(self, token_hash).await
    }

    async fn delete_ui_session(&self, token_hash: &str) -> StoreResult<bool> {
        D::delete_ui_session(self, token_hash).await
    }

    async fn create_prompt(&self, p: NewPrompt, first: NewVersion) -> StoreResult<(Prompt, Version)> {
        D::create_prompt(self, p, first).await
    }

    async fn get_prompt(&self, name: &PromptName) -> StoreResult<Option<Prompt>> {
        D::get_prompt(self, name).await
    }

    async fn update_prompt_settings(
        &self,
        name: &PromptName,
        expected: &PromptSettings,
        new: &PromptSettings,
    ) -> StoreResult<Option<Prompt>> {
        D::update_prompt_settings(self, name, expected, new).await
    }

    async fn list_prompts(&self, after: Option<&str>, limit: u32) -> StoreResult<Vec<PromptSummary>> {
        D::list_prompts(self, after, limit).await
    }

    async fn create_version(&self, prompt: &PromptName, v: NewVersion, moves: &[LabelMove]) -> StoreResult<Version> {
        D::create_version(self, prompt, v, moves).await
    }

    async fn resolve(&self, prompt: &PromptName, selector: &Selector) -> StoreResult<Option<Resolved>> {
        D::resolve(self, prompt, selector).await
    }

    async fn list_versions(&self, prompt: &PromptName, before: Option<i64>, limit: u32) -> StoreResult<Vec<Version>> {
        D::list_versions(self, prompt, before, limit).await
    }

    async fn list_labels(&self, prompt: &PromptName) -> StoreResult<Vec<Label>> {
        D::list_labels(self, prompt).await
    }

    async fn move_label_because(&self, prompt: &PromptName, mv: &LabelMove, cause: &MoveCause) -> StoreResult<Label> {
        D::move_label_because(self, prompt, mv, cause).await
    }

    async fn delete_label(&self, prompt: &PromptName, label: &LabelName, by: &str) -> StoreResult<bool> {
        D::delete_label(self, prompt, label, by).await
    }

    async fn task_rewards(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<Vec<TaskRewards>> {
        D::task_rewards(self, prompt, from, until).await
    }

    async fn population(&self, prompt: &PromptName) -> StoreResult<Vec<PopulationArm>> {
        D::population(self, prompt).await
    }

    async fn save_population(&self, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()> {
        D::save_population(self, prompt, arms).await
    }

    async fn label_history(
        &self,
        prompt: &PromptName,
        label: Option<&LabelName>,
        before: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<LabelHistoryEntry>> {
        D::label_history(self, prompt, label, before, limit).await
    }

    async fn insert_traces(&self, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
        D::insert_traces(self, traces).await
    }

    async fn get_trace(&self, id: Uuid) -> StoreResult<Option<Trace>> {
        D::get_trace(self, id).await
    }

    async fn list_traces(&self, f: &TraceFilter, limit: u32) -> StoreResult<Vec<Trace>> {
        D::list_traces(self, f, limit).await
    }

    async fn add_feedback(&self, id: Uuid, feedback: Feedback) -> StoreResult<Option<Trace>> {
        D::add_feedback(self, id, feedback).await
    }

    async fn version_outcomes(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_secs: i64,
    ) -> StoreResult<Vec<OutcomeBucket>> {
        D::version_outcomes(self, prompt, from, until, bucket_secs).await
    }

    async fn quarantine_trace(&self, id: Uuid, reason: &str) -> StoreResult<TraceAction> {
        D::quarantine_trace(self, id, reason).await
    }

    async fn quarantine_traces(&self, f: &TraceFilter, reason: &str) -> StoreResult<u64> {
        D::quarantine_traces(self, f, reason).await
    }

    async fn release_trace(&self, id: Uuid) -> StoreResult<TraceAction> {
        D::release_trace(self, id).await
    }

    async fn delete_trace(&self, id: Uuid) -> StoreResult<TraceAction> {
        D::delete_trace(self, id).await
    }

    async fn merge_otlp_spans(
        &self,
        otel_trace_id: &str,
        spans: &[OtlpSpan],
        remap: &OtlpRemapFn<'_>,
    ) -> StoreResult<OtlpMerge> {
        D::merge_otlp_spans(self, otel_trace_id, spans, remap).await
    }

    async fn purge_held_otlp_spans(&self, older_than: DateTime<Utc>) -> StoreResult<u64> {
        D::purge_held_otlp_spans(self, older_than).await
    }

    async fn requeue_failed_traces(&self, req: &RequeueFailed) -> StoreResult<Vec<Uuid>> {
        D::requeue_failed_traces(self, req).await
    }

    async fn insert_traces_idempotent(
        &self,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
        status: u16,
        answer: &(dyn for<'i> Fn(&'i [Uuid]) -> Vec<u8> + Send + Sync),
    ) -> StoreResult<IdempotentIngest> {
        D::insert_traces_idempotent(self, key, traces, status, answer).await
    }

    async fn idempotency_purge(&self, older_than: DateTime<Utc>) -> StoreResult<u64> {
        D::idempotency_purge(self, older_than).await
    }

    async fn open_round(&self, req: &OpenRound) -> StoreResult<Option<Round>> {
        D::open_round(self, req).await
    }

    async fn backlogs(&self) -> StoreResult<Vec<Backlog>> {
        D::backlogs(self).await
    }

    async fn claim_round(&self, owner: &str, lease: Duration) -> StoreResult<Option<ClaimedRound>> {
        D::claim_round(self, owner, lease).await
    }

    async fn heartbeat_round(&self, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool> {
        D::heartbeat_round(self, round, attempt, lease).await
    }

    async fn adopt_reflections(&self, round: Uuid) -> StoreResult<u64> {
        D::adopt_reflections(self, round).await
    }

    async fn save_reflection(&self, round: Uuid, trace: Uuid, r: &Reflection, from_trace: bool) -> StoreResult<()> {
        D::save_reflection(self, round, trace, r, from_trace).await
    }

    async fn round_reflections(&self, round: Uuid) -> StoreResult<Vec<(Uuid, Reflection, bool)>> {
        D::round_reflections(self, round).await
    }

    async fn record_llm_call(&self, round: Uuid, attempt: i32, call: &LlmCall) -> StoreResult<()> {
        D::record_llm_call(self, round, attempt, call).await
    }

    async fn round_calls(&self, round: Uuid) -> StoreResult<Vec<RoundCall>> {
        D::round_calls(self, round).await
    }

    async fn update_round(&self, round: Uuid, attempt: i32, k: Option<i32>, detail: &Value) -> StoreResult<bool> {
        D::update_round(self, round, attempt, k, detail).await
    }

    // One fenced transaction needs all of these; a wrapper struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    async fn publish_round(
        &self,
        round: Uuid,
        attempt: i32,
        v: NewVersion,
        label: LabelName,
        detail: &Value,
        sample_secs: Option<f64>,
        charges: &TraceCharges,
    ) -> StoreResult<Version> {
        D::publish_round(self, round, attempt, v, label, detail, sample_secs, charges).await
    }

    async fn fail_round(&self, round: Uuid, attempt: i32, error: &str, how: RoundFailure) -> StoreResult<()> {
        D::fail_round(self, round, attempt, error, how).await
    }

    async fn get_round(&self, id: Uuid) -> StoreResult<Option<Round>> {
        D::get_round(self, id).await
    }

    async fn list_rounds(
        &self,
        prompt: Option<&PromptName>,
        before: Option<Uuid>,
        limit: u32,
    ) -> StoreResult<Vec<Round>> {
        D::list_rounds(self, prompt, before, limit).await
    }

    async fn round_trace_ids(&self, round: Uuid) -> StoreResult<Vec<Uuid>> {
        D::round_trace_ids(self, round).await
    }

    async fn create_webhook(&self, h: &NewWebhook) -> StoreResult<Webhook> {
        D::create_webhook(self, h).await
    }

    async fn list_webhooks(&self) -> StoreResult<Vec<Webhook>> {
        D::list_webhooks(self).await
    }

    async fn get_webhook(&self, id: Uuid) -> StoreResult<Option<Webhook>> {
        D::get_webhook(self, id).await
    }

    async fn delete_webhook(&self, id: Uuid) -> StoreResult<bool> {
        D::delete_webhook(self, id).await
    }

    async fn webhook_attempts(&self, id: Uuid, before: Option<i64>, limit: u32) -> StoreResult<Vec<DeliveryAttempt>> {
        D::webhook_attempts(self, id, before, limit).await
    }

    async fn claim_deliveries(&self, owner: &str, lease: Duration, limit: u32) -> StoreResult<Vec<ClaimedDelivery>> {
        D::claim_deliveries(self, owner, lease, limit).await
    }

    async fn finish_delivery(&self, d: &ClaimedDelivery, rec: &AttemptRecord) -> StoreResult<bool> {
        D::finish_delivery(self, d, rec).await
    }

    async fn controller_samples(&self, prompt: &PromptName, limit: u32) -> StoreResult<Vec<super::ControllerSample>> {
        D::controller_samples(self, prompt, limit).await
    }

    async fn save_controller_choice(&self, prompt: &PromptName, choice: &Value) -> StoreResult<()> {
        D::save_controller_choice(self, prompt, choice).await
    }

    async fn controller_choice(&self, prompt: &PromptName) -> StoreResult<Option<(Value, DateTime<Utc>)>> {
        D::controller_choice(self, prompt).await
    }

    async fn record_meter_counts(
        &self,
        prompt: &PromptName,
        round: Uuid,
        counts: &[super::MeterCounts],
    ) -> StoreResult<()> {
        D::record_meter_counts(self, prompt, round, counts).await
    }

    async fn meter_counts(&self, prompt: &PromptName) -> StoreResult<Vec<super::MeterCounts>> {
        D::meter_counts(self, prompt).await
    }
}
