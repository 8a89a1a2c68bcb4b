//! What the Postgres and SQLite stores share, written once: each dialect says
//! how it encodes ids, times and JSON (uuid/timestamptz/jsonb on Postgres;
//! text, integer microseconds and text on SQLite) through [`Dialect`], and the
//! row mappers and multi-step rules here run the same SQL (`$n` placeholders
//! work in both) on either. SQL that really differs stays in the backend files.

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use serde_json::Value;
use sqlx::Database;
use uuid::Uuid;

use super::{
    ApiKey, ArmState, Label, LabelMove, OtlpSpan, PopulationArm, StoreError, StoreResult, TraceAction, TraceCharges,
    Webhook, prompt_reference_problem, scopes_from_string, trace_action_refusal,
};
use crate::{
    domain::{
        LabelHistoryEntry, LabelMoveKind, LabelName, MoveCause, Prompt, PromptName, Trace, TraceStatus, Version,
        VersionContent, VersionSource,
        event::{OutboxEvent, events_from_column, events_pattern},
        prompt::NewVersion,
        round::{self, Round, RoundStatus, RoundTrigger},
        trace::ValidTrace,
    },
    evaluate::{outcomes::OutcomeBucket, stats::Moments},
    secret::Secret,
};

pub type Query<'q, D> = sqlx::query::Query<'q, D, <D as Database>::Arguments<'q>>;

/// One bound parameter; each dialect encodes it its own way.
pub enum Param<'q> {
    Int(Option<i64>),
    Int32(Option<i32>),
    Real(Option<f64>),
    Bool(bool),
    Text(Option<String>),
    Id(Option<Uuid>),
    At(Option<DateTime<Utc>>),
    Json(Option<&'q Value>),
    Bytes(Option<&'q [u8]>),
    /// A list of ids (a uuid array on Postgres, a JSON array on SQLite); see [`Dialect::any_of`].
    Ids(Option<&'q [Uuid]>),
    /// A list of integers, bound and matched like [`Param::Ids`].
    Ints(Option<&'q [i64]>),
}

macro_rules! params {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<$t> for Param<'_> {
            fn from(v: $t) -> Self {
                Param::$variant(Some(v.into()))
            }
        }
        impl From<Option<$t>> for Param<'_> {
            fn from(v: Option<$t>) -> Self {
                Param::$variant(v.map(Into::into))
            }
        }
    )*};
}

params!(i64 => Int, i32 => Int32, f64 => Real, String => Text, &str => Text, &String => Text, Uuid => Id,
    DateTime<Utc> => At);

impl<'q> From<&'q [u8]> for Param<'q> {
    fn from(v: &'q [u8]) -> Self {
        Param::Bytes(Some(v))
    }
}

impl From<bool> for Param<'_> {
    fn from(v: bool) -> Self {
        Param::Bool(v)
    }
}

/// A JSON parameter (jsonb on Postgres, text on SQLite).
pub(crate) fn json(v: &Value) -> Param<'_> {
    Param::Json(Some(v))
}

pub(crate) fn opt_json(v: Option<&Value>) -> Param<'_> {
    Param::Json(v)
}

/// The dialect-specific half of the shared store code: encodings, execution
/// and the few clauses only one dialect has.
pub trait Dialect: Database + Sized {
    fn bind<'q>(q: Query<'q, Self>, p: Param<'q>) -> Query<'q, Self>;
    fn execute<'c, 'q: 'c>(q: Query<'q, Self>, c: &'c mut Self::Connection) -> BoxFuture<'c, sqlx::Result<u64>>;
    fn fetch_all<'c, 'q: 'c>(
        q: Query<'q, Self>,
        c: &'c mut Self::Connection,
    ) -> BoxFuture<'c, sqlx::Result<Vec<Self::Row>>>;
    fn fetch_optional<'c, 'q: 'c>(
        q: Query<'q, Self>,
        c: &'c mut Self::Connection,
    ) -> BoxFuture<'c, sqlx::Result<Option<Self::Row>>>;

    fn get_i64(row: &Self::Row, col: &str) -> StoreResult<Option<i64>>;
    fn get_i32(row: &Self::Row, col: &str) -> StoreResult<Option<i32>>;
    fn get_f64(row: &Self::Row, col: &str) -> StoreResult<Option<f64>>;
    fn get_bool(row: &Self::Row, col: &str) -> StoreResult<Option<bool>>;
    fn get_text(row: &Self::Row, col: &str) -> StoreResult<Option<String>>;
    fn get_id(row: &Self::Row, col: &str) -> StoreResult<Option<Uuid>>;
    fn get_at(row: &Self::Row, col: &str) -> StoreResult<Option<DateTime<Utc>>>;
    fn get_json(row: &Self::Row, col: &str) -> StoreResult<Option<Value>>;
    fn get_bytes(row: &Self::Row, col: &str) -> StoreResult<Option<Vec<u8>>>;

    /// A row-locking clause (`FOR UPDATE ...`) where the dialect has one; SQLite's single writer needs none.
    fn lock(clause: &'static str) -> &'static str;
    /// `column` is one of the values of the [`Param::Ids`] or [`Param::Ints`] placeholder `param`.
    fn any_of(column: &str, param: &str) -> String;
    /// Reserves `traces` for `round`, in this order (`round_traces.position` from 1).
    fn reserve_traces<'c>(
        c: &'c mut Self::Connection,
        round: Uuid,
        traces: &'c [Uuid],
        at: DateTime<Utc>,
    ) -> BoxFuture<'c, StoreResult<()>>;
    /// SQL: `col`'s JSON member `key` as a double when it is a number within
    /// ±`MAX_ABS_VALUE` (an absurd value is skipped, never fails the query), else NULL.
    fn json_number(col: &str, key: &str) -> String;
    /// SQL: `col`'s JSON boolean member `key` as 1.0 / 0.0, else NULL.
    fn json_flag(col: &str, key: &str) -> String;
    /// SQL: whether `col`'s JSON member `key` is a `kind`: "number", "boolean" or "string".
    fn json_is(col: &str, key: &str, kind: &str) -> String;
    /// SQL: `col`'s JSON string member `key` as text.
    fn json_text(col: &str, key: &str) -> String;
    /// SQL: `t.created_at` in Unix seconds, down to a multiple of the seconds in `param`.
    fn bucket_start(param: &str) -> String;
    /// SQL: `expr` as a double.
    fn real(expr: &str) -> String;
    /// An aggregate joining `expr` of every row with commas.
    fn string_agg(expr: &str) -> String;
    /// Serialises OTLP merges of one trace id until the transaction ends
    /// (an advisory lock on Postgres; SQLite's single writer already does).
    fn serialize_otlp<'c>(c: &'c mut Self::Connection, otel_trace_id: &'c str) -> BoxFuture<'c, StoreResult<()>>;
    /// Tells other processes' caches inside the transaction (NOTIFY on Postgres; SQLite announces after commit).
    fn notify<'c>(c: &'c mut Self::Connection, payload: &'c str) -> BoxFuture<'c, StoreResult<()>>;
}

/// Getters of a [`Dialect`] for the types its driver decodes as they are.
macro_rules! direct_getters {
    ($row:ty: $($get:ident -> $t:ty),* $(,)?) => {$(
        fn $get(row: &$row, col: &str) -> StoreResult<Option<$t>> {
            Ok(sqlx::Row::try_get(row, col)?)
        }
    )*};
}
pub(crate) use direct_getters;

/// The three ways a statement runs, the same on every backend but for its types.
macro_rules! executors {
    ($conn:ty, $row:ty) => {
        fn execute<'c, 'q: 'c>(q: Query<'q, Self>, c: &'c mut $conn) -> BoxFuture<'c, sqlx::Result<u64>> {
            Box::pin(async move { Ok(q.execute(c).await?.rows_affected()) })
        }
        fn fetch_all<'c, 'q: 'c>(q: Query<'q, Self>, c: &'c mut $conn) -> BoxFuture<'c, sqlx::Result<Vec<$row>>> {
            Box::pin(q.fetch_all(c))
        }
        fn fetch_optional<'c, 'q: 'c>(
            q: Query<'q, Self>,
            c: &'c mut $conn,
        ) -> BoxFuture<'c, sqlx::Result<Option<$row>>> {
            Box::pin(q.fetch_optional(c))
        }
    };
}
pub(crate) use executors;

/// A value that can be read from a column.
pub trait Column: Sized {
    fn read<D: Dialect>(row: &D::Row, col: &str) -> StoreResult<Self>;
}

macro_rules! columns {
    ($($t:ty => $get:ident),* $(,)?) => {$(
        impl Column for Option<$t> {
            fn read<D: Dialect>(row: &D::Row, col: &str) -> StoreResult<Self> {
                D::$get(row, col)
            }
        }
        impl Column for $t {
            fn read<D: Dialect>(row: &D::Row, col: &str) -> StoreResult<Self> {
                D::$get(row, col)?.ok_or_else(|| corrupt(col))
            }
        }
    )*};
}

columns!(i64 => get_i64, i32 => get_i32, f64 => get_f64, bool => get_bool, String => get_text, Uuid => get_id,
    DateTime<Utc> => get_at, Value => get_json, Vec<u8> => get_bytes);

/// A row of dialect `D`, read by column name.
pub(crate) struct Cols<'r, D: Dialect>(pub &'r D::Row);

impl<D: Dialect> Cols<'_, D> {
    pub fn get<T: Column>(&self, col: &str) -> StoreResult<T> {
        T::read::<D>(self.0, col)
    }
}

/// A statement with its parameters, run on a connection of dialect `D`.
pub(crate) struct Sql<'q, D: Dialect>(Query<'q, D>);

pub(crate) fn sql<D: Dialect>(text: &str) -> Sql<'_, D> {
    Sql(sqlx::query(text))
}

impl<'q, D: Dialect> Sql<'q, D> {
    pub fn bind(self, p: impl Into<Param<'q>>) -> Self {
        Sql(D::bind(self.0, p.into()))
    }

    /// Rows affected.
    pub async fn execute(self, c: &mut D::Connection) -> StoreResult<u64> {
        Ok(D::execute(self.0, c).await?)
    }

    pub async fn fetch_all(self, c: &mut D::Connection) -> StoreResult<Vec<D::Row>> {
        Ok(D::fetch_all(self.0, c).await?)
    }

    pub async fn fetch_optional(self, c: &mut D::Connection) -> StoreResult<Option<D::Row>> {
        Ok(D::fetch_optional(self.0, c).await?)
    }

    pub async fn fetch_one(self, c: &mut D::Connection) -> StoreResult<D::Row> {
        self.fetch_optional(c).await?.ok_or(StoreError::NotFound)
    }

    /// The column `col` of the first row, if any.
    pub async fn value<T: Column>(self, c: &mut D::Connection, col: &str) -> StoreResult<Option<T>> {
        self.fetch_optional(c).await?.map(|r| Cols::<D>(&r).get(col)).transpose()
    }

    /// Every row through `map`.
    pub async fn map<T>(self, c: &mut D::Connection, map: impl Fn(&D::Row) -> StoreResult<T>) -> StoreResult<Vec<T>> {
        self.fetch_all(c).await?.iter().map(map).collect()
    }
}

/// A serde enum's name (`"playbook"`), as its text column keeps it.
pub(crate) fn enum_str<T: serde::Serialize>(v: T) -> String {
    serde_json::to_value(v).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

pub(crate) fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(what.to_owned())
}

/// Now, to the microsecond both dialects keep.
pub(crate) fn now() -> DateTime<Utc> {
    let us = Utc::now().timestamp_micros();
    DateTime::from_timestamp_micros(us).unwrap_or_default()
}

/// `d` after `at`, or the end of time.
pub(crate) fn later(at: DateTime<Utc>, d: std::time::Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(d).ok().and_then(|d| at.checked_add_signed(d)).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

pub(crate) fn prompt_name(s: &str) -> StoreResult<PromptName> {
    PromptName::parse(s).map_err(|_| corrupt("prompt name"))
}

fn label_name(s: &str) -> StoreResult<LabelName> {
    LabelName::parse(s).map_err(|_| corrupt("label name"))
}

pub(crate) fn prompt_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Prompt> {
    let r = Cols::<D>(row);
    Ok(Prompt {
        id: r.get("id")?,
        name: prompt_name(&r.get::<String>("name")?)?,
        strategy: serde_json::from_value(Value::String(r.get("strategy")?)).map_err(|_| corrupt("strategy"))?,
        promotion: serde_json::from_value(Value::String(r.get("promotion")?)).map_err(|_| corrupt("promotion"))?,
        settings: serde_json::from_value(r.get("settings")?).map_err(|_| corrupt("settings"))?,
        created_at: r.get("created_at")?,
        created_by: r.get("created_by")?,
    })
}

pub(crate) const VERSION_COLUMNS: &str = "p.name AS prompt_name, v.number, v.parent, v.source, v.round_id, v.base, \
     v.playbook, v.content_hash, v.message, v.created_by, v.created_at";

pub(crate) fn version_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Version> {
    let r = Cols::<D>(row);
    let source: String = r.get("source")?;
    let playbook: Option<Value> = r.get("playbook")?;
    Ok(Version {
        prompt: prompt_name(&r.get::<String>("prompt_name")?)?,
        number: r.get("number")?,
        parent: r.get("parent")?,
        source: VersionSource::parse(&source).ok_or_else(|| corrupt("version source"))?,
        round_id: r.get("round_id")?,
        content: VersionContent {
            base: r.get("base")?,
            playbook: playbook.map(serde_json::from_value).transpose().map_err(|_| corrupt("playbook"))?,
        },
        content_hash: r.get("content_hash")?,
        message: r.get("message")?,
        created_by: r.get("created_by")?,
        created_at: r.get("created_at")?,
    })
}

pub(crate) fn label_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Label> {
    let r = Cols::<D>(row);
    Ok(Label {
        name: label_name(&r.get::<String>("name")?)?,
        version: r.get("version")?,
        updated_at: r.get("updated_at")?,
        updated_by: r.get("updated_by")?,
    })
}

pub(crate) fn key_from_row<D: Dialect>(row: &D::Row) -> StoreResult<ApiKey> {
    let r = Cols::<D>(row);
    Ok(ApiKey {
        id: r.get("id")?,
        name: r.get("name")?,
        prefix: r.get("prefix")?,
        hash: r.get("hash")?,
        scopes: scopes_from_string(&r.get::<String>("scopes")?)?,
        created_at: r.get("created_at")?,
        revoked_at: r.get("revoked_at")?,
    })
}

pub(crate) const TRACE_COLUMNS: &str = "t.id, p.name AS prompt_name, t.prompt_version, t.status, t.input, \
     t.trajectory, t.output, t.feedback, t.reflection, t.external_id, t.metadata, t.attempts, t.failure_reason, \
     t.round_id, t.created_at, t.updated_at, t.quarantined_at, t.quarantine_reason";

pub(crate) fn trace_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Trace> {
    let r = Cols::<D>(row);
    let status: String = r.get("status")?;
    let reflection: Option<Value> = r.get("reflection")?;
    let quarantined_at: Option<DateTime<Utc>> = r.get("quarantined_at")?;
    Ok(Trace {
        id: r.get("id")?,
        prompt: prompt_name(&r.get::<String>("prompt_name")?)?,
        prompt_version: r.get("prompt_version")?,
        status: match quarantined_at {
            Some(_) => TraceStatus::Quarantined,
            None => TraceStatus::parse(&status).ok_or_else(|| corrupt("trace status"))?,
        },
        input: r.get("input")?,
        trajectory: r.get("trajectory")?,
        output: r.get("output")?,
        feedback: serde_json::from_value(r.get("feedback")?).map_err(|_| corrupt("feedback"))?,
        reflection: reflection.filter(|r| !r.is_null()),
        external_id: r.get("external_id")?,
        metadata: r.get("metadata")?,
        attempts: r.get("attempts")?,
        failure_reason: r.get("failure_reason")?,
        round_id: r.get("round_id")?,
        quarantined_at,
        quarantine_reason: r.get("quarantine_reason")?,
        created_at: r.get("created_at")?,
        updated_at: r.get("updated_at")?,
    })
}

pub(crate) fn history_from_row<D: Dialect>(row: &D::Row) -> StoreResult<LabelHistoryEntry> {
    let r = Cols::<D>(row);
    let kind: String = r.get("kind")?;
    Ok(LabelHistoryEntry {
        id: r.get("id")?,
        label: label_name(&r.get::<String>("label")?)?,
        from_version: r.get("from_version")?,
        to_version: r.get("to_version")?,
        kind: LabelMoveKind::parse(&kind).ok_or_else(|| corrupt("label move kind"))?,
        actor: r.get("actor")?,
        reason: r.get("reason")?,
        evidence: r.get("evidence")?,
        at: r.get("at")?,
    })
}

pub(crate) fn arm_from_row<D: Dialect>(row: &D::Row) -> StoreResult<PopulationArm> {
    let r = Cols::<D>(row);
    let state: String = r.get("state")?;
    Ok(PopulationArm {
        version: r.get("version")?,
        state: ArmState::parse(&state).ok_or_else(|| corrupt("arm state"))?,
        rating: crate::evaluate::trueskill::Rating { mu: r.get("mu")?, sigma: r.get("sigma")? },
        weight: r.get("weight")?,
        scored_traces: r.get::<i64>("scored_traces")?.max(0) as u64,
        // Arms written before crossover (migration 0014) name one parent, in `created_from`.
        parents: match r.get::<Option<Value>>("parents")? {
            Some(v) => serde_json::from_value(v).map_err(|_| corrupt("arm parents"))?,
            None => r.get::<Option<i64>>("created_from")?.into_iter().collect(),
        },
        created_from: r.get("created_from")?,
        rated_until: r.get("rated_until")?,
    })
}

pub(crate) const WEBHOOK_COLUMNS: &str = "id, url, events, description, secret, enabled, disabled_reason, created_at";

pub(crate) fn webhook_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Webhook> {
    let r = Cols::<D>(row);
    Ok(Webhook {
        id: r.get("id")?,
        url: r.get("url")?,
        events: events_from_column(&r.get::<String>("events")?).ok_or_else(|| corrupt("webhook events"))?,
        description: r.get("description")?,
        enabled: r.get("enabled")?,
        disabled_reason: r.get("disabled_reason")?,
        created_at: r.get("created_at")?,
        secret: Secret::new(r.get::<String>("secret")?),
    })
}

pub(crate) const ROUND_COLUMNS: &str = "r.id, p.name AS prompt_name, r.status, r.trigger, r.method, r.strategy, \
     r.seed, r.duplication, r.n, r.k, r.base_version, r.result_version, r.attempt, r.error, r.detail, r.created_at, \
     r.started_at, r.finished_at, r.updated_at";

pub(crate) fn round_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Round> {
    let r = Cols::<D>(row);
    let (status, trigger): (String, String) = (r.get("status")?, r.get("trigger")?);
    let (method, strategy): (String, String) = (r.get("method")?, r.get("strategy")?);
    Ok(Round {
        id: r.get("id")?,
        prompt: prompt_name(&r.get::<String>("prompt_name")?)?,
        status: RoundStatus::parse(&status).ok_or_else(|| corrupt("round status"))?,
        trigger: RoundTrigger::parse(&trigger).ok_or_else(|| corrupt("round trigger"))?,
        method: round::parse_method(&method).ok_or_else(|| corrupt("round method"))?,
        strategy: round::parse_strategy(&strategy).ok_or_else(|| corrupt("round strategy"))?,
        seed: r.get("seed")?,
        duplication: r.get("duplication")?,
        n: r.get("n")?,
        k: r.get("k")?,
        base_version: r.get("base_version")?,
        result_version: r.get("result_version")?,
        attempt: r.get("attempt")?,
        error: r.get("error")?,
        detail: r.get("detail")?,
        created_at: r.get("created_at")?,
        started_at: r.get("started_at")?,
        finished_at: r.get("finished_at")?,
        updated_at: r.get("updated_at")?,
    })
}

/// Writes an event into the outbox and fans it out to every enabled
/// subscription that asked for its type — inside the caller's transaction, so
/// the event exists exactly when the change it announces does. True when a
/// delivery was queued (other processes are told at commit).
pub(crate) async fn record_event<D: Dialect>(c: &mut D::Connection, e: &OutboxEvent) -> StoreResult<bool> {
    let now = now();
    sql::<D>("INSERT INTO webhook_events (id, type, body, created_at) VALUES ($1, $2, $3, $4)")
        .bind(&e.id)
        .bind(e.kind.as_str())
        .bind(&e.body)
        .bind(e.created_at)
        .execute(c)
        .await?;
    let subscribers = sql::<D>("SELECT id FROM webhook_subscriptions WHERE enabled = TRUE AND events LIKE $1")
        .bind(events_pattern(e.kind))
        .map(c, |row| Cols::<D>(row).get::<Uuid>("id"))
        .await?;
    for sub in &subscribers {
        sql::<D>(
            "INSERT INTO webhook_deliveries (id, event_id, subscription_id, status, next_attempt_at, created_at, updated_at)
             VALUES ($1, $2, $3, 'pending', $4, $4, $4)",
        )
        .bind(Uuid::now_v7())
        .bind(&e.id)
        .bind(*sub)
        .bind(now)
        .execute(c)
        .await?;
    }
    if !subscribers.is_empty() {
        D::notify(c, "outbox").await?;
    }
    Ok(!subscribers.is_empty())
}

/// Appends one entry to the label history (inside the caller's transaction).
// The columns of one history row; a struct would only rename them.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn record_history<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    label: &LabelName,
    from: Option<i64>,
    to: Option<i64>,
    actor: &str,
    cause: &MoveCause,
) -> StoreResult<()> {
    sql::<D>(
        "INSERT INTO label_moves (prompt_id, label, from_version, to_version, kind, actor, reason, evidence, at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(prompt_id)
    .bind(label.as_str())
    .bind(from)
    .bind(to)
    .bind(cause.kind.as_str())
    .bind(actor)
    .bind(&cause.reason)
    .bind(opt_json(cause.evidence.as_ref()))
    .bind(now())
    .execute(c)
    .await?;
    Ok(())
}

/// The history entry and outbox events of one label move (none when it did
/// not change anything). True when a delivery was queued.
pub(crate) async fn record_move<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    prompt: &PromptName,
    label: &Label,
    previous: Option<i64>,
    cause: &MoveCause,
) -> StoreResult<bool> {
    if previous == Some(label.version) {
        return Ok(false);
    }
    record_history::<D>(c, prompt_id, &label.name, previous, Some(label.version), &label.updated_by, cause).await?;
    let moved = OutboxEvent::label_moved(prompt, &label.name, label.version, previous, &label.updated_by);
    let mut queued = record_event::<D>(c, &moved).await?;
    if matches!(cause.kind, LabelMoveKind::Rollback | LabelMoveKind::GuardRollback) {
        let e = OutboxEvent::rolled_back(prompt, &label.name, label.version, previous, &label.updated_by, cause);
        queued |= record_event::<D>(c, &e).await?;
    }
    Ok(queued)
}

/// Inserts version `number` of the prompt, created `at`.
pub(crate) async fn insert_version<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    number: i64,
    v: &NewVersion,
    at: DateTime<Utc>,
) -> StoreResult<()> {
    let playbook =
        v.content.playbook.as_ref().map(serde_json::to_value).transpose().map_err(|_| corrupt("playbook"))?;
    sql::<D>(
        "INSERT INTO versions (prompt_id, number, parent, source, round_id, base, playbook, content_hash, message,
                               created_by, created_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    )
    .bind(prompt_id)
    .bind(number)
    .bind(v.parent)
    .bind(v.source.as_str())
    .bind(v.round_id)
    .bind(&v.content.base)
    .bind(opt_json(playbook.as_ref()))
    .bind(v.content.hash())
    .bind(&v.message)
    .bind(&v.created_by)
    .bind(at)
    .execute(c)
    .await?;
    Ok(())
}

/// `Invalid("version N does not exist")` unless the prompt has version `number`.
pub(crate) async fn require_version<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    number: i64,
) -> StoreResult<()> {
    let exists = sql::<D>("SELECT 1 AS one FROM versions WHERE prompt_id = $1 AND number = $2")
        .bind(prompt_id)
        .bind(number)
        .fetch_optional(c)
        .await?
        .is_some();
    if exists { Ok(()) } else { Err(StoreError::Invalid(format!("version {number} does not exist"))) }
}

/// [`require_version`] for several versions in one statement: `Invalid`
/// naming the first of `numbers` the prompt does not have.
pub(crate) async fn require_versions<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    numbers: &[i64],
) -> StoreResult<()> {
    if numbers.is_empty() {
        return Ok(());
    }
    let list = (0..numbers.len()).map(|i| format!("${}", i + 2)).collect::<Vec<_>>().join(", ");
    let text = format!("SELECT number FROM versions WHERE prompt_id = $1 AND number IN ({list})");
    let mut q = sql::<D>(&text).bind(prompt_id);
    for n in numbers {
        q = q.bind(*n);
    }
    let found = q.map(c, |row| Cols::<D>(row).get::<i64>("number")).await?;
    match numbers.iter().find(|n| !found.contains(n)) {
        Some(missing) => Err(StoreError::Invalid(format!("version {missing} does not exist"))),
        None => Ok(()),
    }
}

/// Moves a label; returns it with the version it pointed at before.
pub(crate) async fn apply_move<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    mv: &LabelMove,
) -> StoreResult<(Label, Option<i64>)> {
    let current: Option<i64> =
        sql::<D>(&format!("SELECT version FROM labels WHERE prompt_id = $1 AND name = $2{}", D::lock(" FOR UPDATE")))
            .bind(prompt_id)
            .bind(mv.label.as_str())
            .value(c, "version")
            .await?;
    if mv.check_current && current != mv.expected_current {
        return Err(StoreError::Conflict);
    }
    require_version::<D>(c, prompt_id, mv.to_version).await?;
    let row = sql::<D>(
        "INSERT INTO labels (prompt_id, name, version, updated_at, updated_by) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (prompt_id, name) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at,
             updated_by = excluded.updated_by
         RETURNING name, version, updated_at, updated_by",
    )
    .bind(prompt_id)
    .bind(mv.label.as_str())
    .bind(mv.to_version)
    .bind(now())
    .bind(&mv.by)
    .fetch_one(c)
    .await?;
    Ok((label_from_row::<D>(&row)?, current))
}

/// Why `trace` cannot be stored, or `None` when its prompt and version exist.
pub(crate) async fn reference_problem<D: Dialect>(
    c: &mut D::Connection,
    trace: &ValidTrace,
) -> StoreResult<Option<String>> {
    let count = sql::<D>("SELECT version_count FROM prompts WHERE name = $1")
        .bind(trace.prompt.as_str())
        .value(c, "version_count")
        .await?;
    Ok(prompt_reference_problem(trace, count))
}

pub(crate) async fn prompt_id<D: Dialect>(c: &mut D::Connection, name: &PromptName) -> StoreResult<Uuid> {
    sql::<D>("SELECT id FROM prompts WHERE name = $1")
        .bind(name.as_str())
        .value(c, "id")
        .await?
        .ok_or(StoreError::NotFound)
}

/// Checks that `attempt` still holds the round's lease (locking the round row
/// on Postgres; SQLite's single writer makes check-then-write atomic).
/// Returns the round's prompt id and name.
pub(crate) async fn fence<D: Dialect>(c: &mut D::Connection, round: Uuid, attempt: i32) -> StoreResult<(Uuid, String)> {
    let row = sql::<D>(&format!(
        "SELECT r.prompt_id, p.name, r.status, r.attempt FROM rounds r JOIN prompts p ON p.id = r.prompt_id
         WHERE r.id = $1{}",
        D::lock(" FOR UPDATE OF r")
    ))
    .bind(round)
    .fetch_optional(c)
    .await?
    .ok_or(StoreError::NotFound)?;
    let r = Cols::<D>(&row);
    if r.get::<String>("status")? != "running" || r.get::<i32>("attempt")? != attempt {
        return Err(StoreError::Conflict);
    }
    Ok((r.get("prompt_id")?, r.get("name")?))
}

/// Charges each faulted trace of the round one attempt (see [`TraceCharges`]).
pub(crate) async fn charge_traces<D: Dialect>(
    c: &mut D::Connection,
    round: Uuid,
    charges: &TraceCharges,
) -> StoreResult<()> {
    for fault in &charges.faults {
        sql::<D>(
            "UPDATE traces SET round_id = NULL, attempts = attempts + 1, updated_at = $5, failure_reason = $3,
                    status = CASE WHEN attempts + 1 >= $4 THEN 'failed' ELSE 'pending' END
             WHERE id = $1 AND round_id = $2 AND status = 'pending'",
        )
        .bind(fault.trace_id)
        .bind(round)
        .bind(&fault.reason)
        .bind(charges.max_trace_attempts)
        .bind(now())
        .execute(c)
        .await?;
    }
    Ok(())
}

/// Returns the round's still-reserved pending traces to the backlog, uncharged.
pub(crate) async fn release_traces<D: Dialect>(c: &mut D::Connection, round: Uuid) -> StoreResult<()> {
    sql::<D>("UPDATE traces SET round_id = NULL, updated_at = $2 WHERE round_id = $1 AND status = 'pending'")
        .bind(round)
        .bind(now())
        .execute(c)
        .await?;
    Ok(())
}

/// Locks trace `id` for an operator action (`delete` or quarantine); the
/// answer to give instead when it is missing or in a state that refuses it.
pub(crate) async fn lock_for_action<D: Dialect>(
    c: &mut D::Connection,
    id: Uuid,
    delete: bool,
) -> StoreResult<Option<TraceAction>> {
    let text = format!("SELECT status, round_id FROM traces WHERE id = $1{}", D::lock(" FOR UPDATE"));
    let Some(row) = sql::<D>(&text).bind(id).fetch_optional(c).await? else {
        return Ok(Some(TraceAction::NotFound));
    };
    let r = Cols::<D>(&row);
    Ok(trace_action_refusal(delete, &r.get::<String>("status")?, r.get("round_id")?).map(TraceAction::Refused))
}

/// Stores new spans of `otel_trace_id`, attached to `trace` or held (`None`).
pub(crate) async fn insert_otlp_spans<D: Dialect>(
    c: &mut D::Connection,
    otel_trace_id: &str,
    trace: Option<Uuid>,
    spans: &[&OtlpSpan],
) -> StoreResult<()> {
    let now = now();
    for span in spans {
        sql::<D>(
            "INSERT INTO otlp_spans (otel_trace_id, span_id, trace_id, body, received_at) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(otel_trace_id)
        .bind(&span.span_id)
        .bind(trace)
        .bind(span.body.as_slice())
        .bind(now)
        .execute(c)
        .await?;
    }
    Ok(())
}

/// One row of the outcome aggregate query.
pub(crate) fn outcome_bucket_from_row<D: Dialect>(row: &D::Row) -> StoreResult<OutcomeBucket> {
    let r = Cols::<D>(row);
    let count = |c: &str| -> StoreResult<u64> { Ok(u64::try_from(r.get::<i64>(c)?).unwrap_or(0)) };
    let moments = |p: &str| -> StoreResult<Moments> {
        Ok(Moments {
            count: count(&format!("{p}_n"))?,
            sum: r.get(&format!("{p}_sum"))?,
            sum_sq: r.get(&format!("{p}_sq"))?,
        })
    };
    Ok(OutcomeBucket {
        version: r.get("version")?,
        start: r.get("start")?,
        traces: count("traces")?,
        with_feedback: count("with_feedback")?,
        success_trials: count("success_trials")?,
        successes: count("successes")?,
        score: moments("score")?,
        tokens: moments("tokens")?,
        cost_usd: moments("cost")?,
        latency_ms: moments("latency")?,
    })
}
