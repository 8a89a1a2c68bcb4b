//! The SQL dialect the Postgres and SQLite stores share, written once: each
//! says how it encodes ids, times and JSON (uuid/timestamptz/jsonb on
//! Postgres; text, integer microseconds and text on SQLite) through
//! [`Dialect`], so the statements in the resource files (`$n` placeholders
//! work in both) run on either. Here too: binding parameters, reading columns,
//! and the few helpers every resource uses (`now`, `corrupt`…). Each row
//! mapper and multi-step helper lives in the file of the resource it belongs
//! to; SQL that really differs stays in the backend files.

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use serde_json::Value;
use sqlx::Database;
use uuid::Uuid;

use super::{StoreError, StoreResult};

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
    /// Whether each rollup key keeps one row that writes add their deltas
    /// to (SQLite: one writer, so the row is never contended), rather than
    /// appending delta rows that compaction folds (Postgres: concurrent
    /// writers would queue on a shared row).
    const ROLLUP_ROW_PER_KEY: bool;
    /// The statement that opens a write transaction. SQLite's is `BEGIN
    /// IMMEDIATE`: it takes the write lock first, waiting out other processes'
    /// writes under the busy timeout. A deferred `BEGIN` reads a snapshot
    /// first, and if another process commits before the first write, that
    /// write fails at once with `SQLITE_BUSY_SNAPSHOT`, which no timeout waits out.
    const BEGIN_WRITE: &'static str;
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
    /// Serialises every spending reservation of every process until the
    /// transaction ends (an advisory lock on Postgres; SQLite's single writer already does).
    fn serialize_budget<'c>(c: &'c mut Self::Connection) -> BoxFuture<'c, StoreResult<()>>;
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

/// The three ways a statement runs, as the driver runs it (SQLite; Postgres
/// writes its own, to run through a transaction pooler).
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
