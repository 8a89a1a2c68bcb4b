//! How SQLite keeps what the shared store code reads and writes (ids as
//! text, times as integer microseconds, JSON as text), and the few clauses
//! it writes its own way: JSON functions, time buckets, the reservation of a
//! round's traces.

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use serde_json::Value;
use sqlx::{Row, Sqlite, SqliteConnection, sqlite::SqliteRow};
use uuid::Uuid;

use crate::evaluate::outcomes::MAX_ABS_VALUE;
use crate::store::StoreResult;
use crate::store::sql::{Dialect, Param, Query, corrupt, direct_getters, executors};

/// SQLite keeps ids as text, times as integer microseconds and JSON as text.
impl Dialect for Sqlite {
    const ROLLUP_ROW_PER_KEY: bool = true;
    const BEGIN_WRITE: &'static str = "BEGIN IMMEDIATE";
    direct_getters!(SqliteRow: get_i64 -> i64, get_i32 -> i32, get_f64 -> f64, get_bool -> bool, get_text -> String, get_bytes -> Vec<u8>);
    fn bind<'q>(q: Query<'q, Self>, p: Param<'q>) -> Query<'q, Self> {
        match p {
            Param::Int(v) => q.bind(v),
            Param::Int32(v) => q.bind(v),
            Param::Real(v) => q.bind(v),
            Param::Bool(v) => q.bind(v),
            Param::Text(v) => q.bind(v),
            Param::Id(v) => q.bind(v.map(|u| u.to_string())),
            Param::At(v) => q.bind(v.map(|t| t.timestamp_micros())),
            Param::Bytes(v) => q.bind(v),
            Param::Ids(v) => {
                q.bind(v.map(|ids| Value::from(ids.iter().map(Uuid::to_string).collect::<Vec<_>>()).to_string()))
            }
            Param::Ints(v) => q.bind(v.map(|ns| Value::from(ns.to_vec()).to_string())),
            Param::Json(v) => q.bind(v.map(|j| j.to_string())),
        }
    }
    executors!(SqliteConnection, SqliteRow);
    fn get_id(row: &SqliteRow, col: &str) -> StoreResult<Option<Uuid>> {
        row.try_get::<Option<&str>, _>(col)?.map(uuid).transpose()
    }
    fn get_at(row: &SqliteRow, col: &str) -> StoreResult<Option<DateTime<Utc>>> {
        row.try_get::<Option<i64>, _>(col)?.map(time).transpose()
    }
    fn get_json(row: &SqliteRow, col: &str) -> StoreResult<Option<Value>> {
        row.try_get::<Option<&str>, _>(col)?.map(json).transpose()
    }
    fn serialize_budget<'c>(_: &'c mut SqliteConnection) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }
    fn serialize_otlp<'c>(_: &'c mut SqliteConnection, _: &'c str) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }
    fn any_of(column: &str, param: &str) -> String {
        format!("{column} IN (SELECT value FROM json_each({param}))")
    }
    fn reserve_traces<'c>(
        c: &'c mut SqliteConnection,
        round: Uuid,
        traces: &'c [Uuid],
        at: DateTime<Utc>,
    ) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async move {
            for (position, trace) in traces.iter().enumerate() {
                sqlx::query("INSERT INTO round_traces (round_id, trace_id, position) VALUES (?, ?, ?)")
                    .bind(round.to_string())
                    .bind(trace.to_string())
                    .bind(position as i64 + 1)
                    .execute(&mut *c)
                    .await?;
                sqlx::query("UPDATE traces SET round_id = ?, updated_at = ? WHERE id = ?")
                    .bind(round.to_string())
                    .bind(at.timestamp_micros())
                    .bind(trace.to_string())
                    .execute(&mut *c)
                    .await?;
            }
            Ok(())
        })
    }
    fn json_number(col: &str, key: &str) -> String {
        format!(
            "CASE WHEN json_type({col}, '$.{key}') IN ('integer', 'real') AND abs(json_extract({col}, '$.{key}')) \
             <= {MAX_ABS_VALUE} THEN CAST(json_extract({col}, '$.{key}') AS REAL) END"
        )
    }
    fn json_flag(col: &str, key: &str) -> String {
        format!("CASE json_type({col}, '$.{key}') WHEN 'true' THEN 1.0 WHEN 'false' THEN 0.0 END")
    }
    fn json_is(col: &str, key: &str, kind: &str) -> String {
        let types = match kind {
            "number" => "'integer', 'real'",
            "boolean" => "'true', 'false'",
            _ => "'text'",
        };
        format!("json_type({col}, '$.{key}') IN ({types})")
    }
    fn json_text(col: &str, key: &str) -> String {
        format!("json_extract({col}, '$.{key}')")
    }
    fn bucket_start(param: &str) -> String {
        format!("(t.created_at / ({param} * 1000000)) * {param}")
    }
    fn real(expr: &str) -> String {
        format!("CAST({expr} AS REAL)")
    }
    fn string_agg(expr: &str) -> String {
        format!("group_concat({expr}, ',')")
    }
    fn lock(_: &'static str) -> &'static str {
        ""
    }
    fn notify<'c>(_: &'c mut SqliteConnection, _: &'c str) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }
}

fn time(us: i64) -> StoreResult<DateTime<Utc>> {
    DateTime::from_timestamp_micros(us).ok_or_else(|| corrupt("timestamp"))
}

pub(super) fn uuid(s: &str) -> StoreResult<Uuid> {
    Uuid::parse_str(s).map_err(|_| corrupt("uuid"))
}

fn json(s: &str) -> StoreResult<Value> {
    serde_json::from_str(s).map_err(|_| corrupt("json"))
}

/// Now, as SQLite keeps times: integer microseconds.
pub(super) fn now_us() -> i64 {
    Utc::now().timestamp_micros()
}
