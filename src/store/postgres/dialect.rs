//! How Postgres runs what the shared store code asks of it: ids, times and
//! JSON in their native types, the executors that keep every statement safe
//! behind a transaction pooler (see [`Route`](super::Route)), and the clauses
//! only Postgres has (row locks, advisory locks, `NOTIFY`, jsonb functions).

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use serde_json::Value;
use sqlx::{PgConnection, Postgres, postgres::PgRow};
use uuid::Uuid;

use super::listener::CHANNEL;
use super::route::through_pooler;
use crate::evaluate::outcomes::MAX_ABS_VALUE;
use crate::store::StoreResult;
use crate::store::sql::{Dialect, Param, Query, direct_getters};

/// Runs `$run`, an async block over the query `$q` and the connection `$c`,
/// as [`Route`](super::Route) needs: as written, or (on a connection through
/// a transaction pooler, see [`through_pooler`]) unnamed and inside a
/// transaction of its own unless one is open already.
macro_rules! pooler_safe {
    ($query:expr, $conn:expr, |$q:ident, $c:ident| $run:expr) => {{
        let (query, conn) = ($query, $conn);
        if !through_pooler(&*conn) {
            let ($q, $c) = (query, conn);
            $run.await
        } else if sqlx::Connection::is_in_transaction(&*conn) {
            let ($q, $c) = (query.persistent(false), conn);
            $run.await
        } else {
            let mut tx = sqlx::Connection::begin(conn).await?;
            let ($q, $c) = (query.persistent(false), &mut *tx);
            match $run.await {
                Ok(v) => {
                    tx.commit().await?;
                    Ok(v)
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    Err(e)
                }
            }
        }
    }};
}

/// Postgres encodes ids, times and JSON natively (uuid, timestamptz, jsonb).
impl Dialect for Postgres {
    const ROLLUP_ROW_PER_KEY: bool = false;
    const BEGIN_WRITE: &'static str = "BEGIN";
    direct_getters!(PgRow: get_i64 -> i64, get_i32 -> i32, get_f64 -> f64, get_bool -> bool, get_text -> String, get_id -> Uuid, get_at -> DateTime<Utc>, get_json -> Value, get_bytes -> Vec<u8>);
    fn bind<'q>(q: Query<'q, Self>, p: Param<'q>) -> Query<'q, Self> {
        match p {
            Param::Int(v) => q.bind(v),
            Param::Int32(v) => q.bind(v),
            Param::Real(v) => q.bind(v),
            Param::Bool(v) => q.bind(v),
            Param::Text(v) => q.bind(v),
            Param::Id(v) => q.bind(v),
            Param::At(v) => q.bind(v),
            Param::Bytes(v) => q.bind(v),
            Param::Ids(v) => q.bind(v),
            Param::Ints(v) => q.bind(v),
            Param::Json(v) => q.bind(v),
        }
    }
    fn execute<'c, 'q: 'c>(q: Query<'q, Self>, c: &'c mut PgConnection) -> BoxFuture<'c, sqlx::Result<u64>> {
        Box::pin(async move { pooler_safe!(q, c, |q, c| async move { Ok(q.execute(c).await?.rows_affected()) }) })
    }
    fn fetch_all<'c, 'q: 'c>(q: Query<'q, Self>, c: &'c mut PgConnection) -> BoxFuture<'c, sqlx::Result<Vec<PgRow>>> {
        Box::pin(async move { pooler_safe!(q, c, |q, c| q.fetch_all(c)) })
    }
    fn fetch_optional<'c, 'q: 'c>(
        q: Query<'q, Self>,
        c: &'c mut PgConnection,
    ) -> BoxFuture<'c, sqlx::Result<Option<PgRow>>> {
        Box::pin(async move { pooler_safe!(q, c, |q, c| q.fetch_optional(c)) })
    }
    fn serialize_budget<'c>(c: &'c mut PgConnection) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async move {
            Self::execute(sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('combee:budget', 0))"), c).await?;
            Ok(())
        })
    }
    fn serialize_otlp<'c>(c: &'c mut PgConnection, otel_trace_id: &'c str) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async move {
            let q = sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('otlp:' || $1, 0))").bind(otel_trace_id);
            Self::execute(q, c).await?;
            Ok(())
        })
    }
    fn any_of(column: &str, param: &str) -> String {
        format!("{column} = ANY({param})")
    }
    fn reserve_traces<'c>(
        c: &'c mut PgConnection,
        round: Uuid,
        traces: &'c [Uuid],
        at: DateTime<Utc>,
    ) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async move {
            let q = sqlx::query(
                "INSERT INTO round_traces (round_id, trace_id, position)
                 SELECT $1, t.id, t.ord FROM unnest($2::uuid[]) WITH ORDINALITY AS t(id, ord)",
            );
            Self::execute(q.bind(round).bind(traces), &mut *c).await?;
            let q = sqlx::query("UPDATE traces SET round_id = $1, updated_at = $3 WHERE id = ANY($2)");
            Self::execute(q.bind(round).bind(traces).bind(at), &mut *c).await?;
            Ok(())
        })
    }
    fn json_number(col: &str, key: &str) -> String {
        // jsonb numbers are `numeric`: range-check before the float8 cast. Nested
        // CASEs because Postgres does not promise to short-circuit AND.
        format!(
            "CASE WHEN jsonb_typeof({col}->'{key}') = 'number' THEN CASE WHEN abs(({col}->'{key}')::numeric) \
             <= {MAX_ABS_VALUE} THEN ({col}->'{key}')::numeric::float8 END END"
        )
    }
    fn json_flag(col: &str, key: &str) -> String {
        format!(
            "CASE WHEN jsonb_typeof({col}->'{key}') = 'boolean' THEN CASE WHEN ({col}->>'{key}')::boolean THEN 1.0::float8 ELSE 0.0::float8 END END"
        )
    }
    fn json_is(col: &str, key: &str, kind: &str) -> String {
        format!("jsonb_typeof({col}->'{key}') = '{kind}'")
    }
    fn json_text(col: &str, key: &str) -> String {
        format!("{col}->>'{key}'")
    }
    fn bucket_start(param: &str) -> String {
        format!("floor(extract(epoch FROM t.created_at) / {param})::bigint * {param}")
    }
    fn real(expr: &str) -> String {
        format!("({expr})::float8")
    }
    fn string_agg(expr: &str) -> String {
        format!("string_agg({expr}, ',')")
    }
    fn lock(clause: &'static str) -> &'static str {
        clause
    }
    fn notify<'c>(c: &'c mut PgConnection, payload: &'c str) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async move {
            Self::execute(sqlx::query("SELECT pg_notify($1, $2)").bind(CHANNEL).bind(payload), c).await?;
            Ok(())
        })
    }
}
