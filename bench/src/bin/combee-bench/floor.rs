//! The store's own floor: what Postgres or SQLite does alone, on this
//! machine and in the same run, with the rows combee's batched figure
//! writes. Each figure writes the trace rows combee stored (the same JSON
//! text, fresh ids) in transactions of the batched figure's size into (a) a
//! table with only a primary key and (b) a copy of combee's `traces` table
//! with all its indexes, so combee's rate can be read as a share of each:
//! b ÷ a is what the schema costs, combee ÷ b what the service costs.
//!
//! Postgres is written by as many connections as the server's pool holds,
//! with `COPY … FROM STDIN` and with one multi-row `INSERT` a transaction;
//! SQLite by one connection (it has one writer) with combee's pragmas (WAL,
//! `synchronous = FULL`, foreign keys on), multi-row `INSERT`s of the batch's
//! size, as many rows a transaction as combee's one writer committed a group
//! in the batched figure's warm-up, into the server's own database file.

use std::{
    path::Path,
    str::FromStr,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use sqlx::{
    Connection, Executor, PgPool, Row, SqliteConnection,
    postgres::PgPoolOptions,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous},
};
use tokio::sync::Mutex;
use uuid::Uuid;

/// Where the floor's rows go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Table {
    /// (a) The same columns, only a primary key.
    PrimaryKeyOnly,
    /// (b) A copy of combee's `traces` table with every index it has.
    Traces,
}

impl Table {
    fn name(self) -> &'static str {
        match self {
            Table::PrimaryKeyOnly => "floor_pk",
            Table::Traces => "floor_traces",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Table::PrimaryKeyOnly => "(a) primary key only",
            Table::Traces => "(b) combee's traces table, its indexes",
        }
    }
}

/// How the floor's rows are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Way {
    /// `COPY … FROM STDIN` (Postgres), one a transaction.
    Copy,
    /// One multi-row `INSERT … VALUES` a transaction.
    Insert,
}

impl Way {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Way::Copy => "COPY",
            Way::Insert => "multi-row INSERT",
        }
    }
}

/// A trace row as combee stored it: its prompt and the text of its JSON columns.
#[derive(Debug, Clone)]
pub(crate) struct RowText {
    prompt_id: String,
    input: String,
    trajectory: String,
    output: String,
    feedback: String,
    metadata: String,
}

/// What one floor figure wrote.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Written {
    pub(crate) rows: u64,
    pub(crate) elapsed: Duration,
}

impl Written {
    pub(crate) fn absorb(&mut self, other: Written) {
        self.rows += other.rows;
        self.elapsed += other.elapsed;
    }

    pub(crate) fn per_sec(&self) -> f64 {
        self.rows as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// The floor of one store, ready to measure.
pub(crate) enum Floor {
    Postgres {
        pool: PgPool,
        connections: usize,
        row: RowText,
        batch: usize,
    },
    /// `per_commit` statements of `batch` rows each a transaction (combee's one
    /// writer commits many requests together: its floor commits as many rows).
    Sqlite {
        conn: Arc<Mutex<SqliteConnection>>,
        row: RowText,
        batch: usize,
        per_commit: usize,
    },
}

/// The figures a store's floor measures, in the order they run.
pub(crate) fn figures(postgres: bool) -> Vec<(Way, Table)> {
    let tables = [Table::PrimaryKeyOnly, Table::Traces];
    let ways: &[Way] = if postgres { &[Way::Copy, Way::Insert] } else { &[Way::Insert] };
    ways.iter().flat_map(|&w| tables.iter().map(move |&t| (w, t))).collect()
}

impl Floor {
    /// Creates the floor's tables next to combee's in its Postgres database and
    /// reads the row to write from what combee stored (at least one trace).
    pub(crate) async fn postgres(url: &str, connections: usize, batch: usize) -> anyhow::Result<Self> {
        let pool = PgPoolOptions::new()
            .max_connections(connections as u32)
            .connect(url)
            .await
            .context("the floor cannot connect to the bench database")?;
        let setup = "DROP TABLE IF EXISTS floor_pk, floor_traces;
             CREATE TABLE floor_pk (LIKE traces INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
             ALTER TABLE floor_pk ADD PRIMARY KEY (id);
             CREATE TABLE floor_traces (LIKE traces INCLUDING ALL);";
        pool.execute(setup).await.context("creating the floor's tables")?;
        let r = sqlx::query(
            "SELECT prompt_id::text AS prompt_id, input::text AS input, trajectory::text AS trajectory,
                    output::text AS output, feedback::text AS feedback, metadata::text AS metadata
             FROM traces ORDER BY id DESC LIMIT 1",
        )
        .fetch_optional(&pool)
        .await?
        .context("combee stored no trace to copy")?;
        let row = row_text(&r)?;
        Ok(Floor::Postgres { pool, connections: connections.max(1), row, batch: batch.max(1) })
    }

    /// Creates the floor's tables in the server's own SQLite file (combee's
    /// `traces` definition and indexes under other names) and reads the row to write.
    pub(crate) async fn sqlite(db: &Path, batch: usize) -> anyhow::Result<Self> {
        // The writer's options in `SqlStore::<Sqlite>::open`.
        let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", db.display()))?
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let mut conn = SqliteConnection::connect_with(&options).await.context("the floor cannot open the database")?;
        let table: String =
            sqlx::query_scalar("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'traces'")
                .fetch_one(&mut conn)
                .await
                .context("reading the traces table's definition")?;
        let indexes: Vec<String> = sqlx::query_scalar(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'traces' AND sql IS NOT NULL",
        )
        .fetch_all(&mut conn)
        .await?;
        conn.execute("DROP TABLE IF EXISTS floor_pk; DROP TABLE IF EXISTS floor_traces;").await?;
        let body = table.strip_prefix("CREATE TABLE traces").context("unexpected traces definition")?;
        // (a): the columns alone (no reference to the prompts either); (b): all of it.
        conn.execute(format!("CREATE TABLE floor_pk{}", body.replace("REFERENCES prompts (id)", "")).as_str()).await?;
        conn.execute(format!("CREATE TABLE floor_traces{body}").as_str()).await?;
        for index in &indexes {
            let renamed = index.replacen("CREATE INDEX ", "CREATE INDEX floor_", 1).replacen(
                " ON traces ",
                " ON floor_traces ",
                1,
            );
            anyhow::ensure!(renamed.contains(" ON floor_traces "), "unexpected index definition: {index}");
            conn.execute(renamed.as_str()).await.with_context(|| format!("copying {index}"))?;
        }
        let r = sqlx::query(
            "SELECT prompt_id, input, trajectory, output, feedback, metadata FROM traces ORDER BY id DESC LIMIT 1",
        )
        .fetch_optional(&mut conn)
        .await?
        .context("combee stored no trace to copy")?;
        let row = row_text(&r)?;
        Ok(Floor::Sqlite { conn: Arc::new(Mutex::new(conn)), row, batch: batch.max(1), per_commit: 1 })
    }

    /// Writes rows `way` into `table` for `duration`, as fast as the store takes them.
    pub(crate) async fn run(&self, way: Way, table: Table, duration: Duration) -> anyhow::Result<Written> {
        let start = Instant::now();
        let deadline = start + duration;
        let rows = match self {
            Floor::Postgres { pool, connections, row, batch } => {
                let mut writers = tokio::task::JoinSet::new();
                for _ in 0..*connections {
                    let (pool, row, batch) = (pool.clone(), row.clone(), *batch);
                    writers.spawn(async move {
                        let mut conn = pool.acquire().await?;
                        let mut rows = 0u64;
                        while Instant::now() < deadline {
                            rows += match way {
                                Way::Copy => copy_batch(&mut conn, table, &row, batch).await?,
                                Way::Insert => insert_batch_pg(&mut conn, table, &row, batch).await?,
                            };
                        }
                        anyhow::Ok(rows)
                    });
                }
                let mut rows = 0;
                while let Some(joined) = writers.join_next().await {
                    rows += joined.context("a floor writer failed")??;
                }
                rows
            }
            Floor::Sqlite { conn, row, batch, per_commit } => {
                let mut conn = conn.lock().await;
                let mut rows = 0u64;
                while Instant::now() < deadline {
                    rows += insert_batches_sqlite(&mut conn, table, row, *batch, *per_commit).await?;
                }
                rows
            }
        };
        Ok(Written { rows, elapsed: start.elapsed() })
    }

    /// Rows a transaction writes.
    pub(crate) fn commit_rows(&self) -> usize {
        match self {
            Floor::Postgres { batch, .. } => *batch,
            Floor::Sqlite { batch, per_commit, .. } => batch * per_commit,
        }
    }

    /// On SQLite, commits about `rows` rows a transaction (whole statements of the batch's size).
    pub(crate) fn commit_about(&mut self, rows: f64) {
        if let Floor::Sqlite { batch, per_commit, .. } = self {
            *per_commit = ((rows / *batch as f64).round() as usize).max(1);
        }
    }

    /// Drops the floor's tables (a SQLite file is the server's own).
    pub(crate) async fn finish(self) {
        let dropped = match self {
            Floor::Postgres { pool, .. } => {
                let r = pool.execute("DROP TABLE IF EXISTS floor_pk, floor_traces").await.map(drop);
                pool.close().await;
                r
            }
            Floor::Sqlite { conn, .. } => {
                let mut conn = conn.lock().await;
                conn.execute("DROP TABLE IF EXISTS floor_pk; DROP TABLE IF EXISTS floor_traces;").await.map(drop)
            }
        };
        if let Err(e) = dropped {
            eprintln!("combee-bench: could not drop the floor's tables: {e}");
        }
    }
}

fn row_text<R: Row>(r: &R) -> anyhow::Result<RowText>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'a> String: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
{
    Ok(RowText {
        prompt_id: r.try_get("prompt_id")?,
        input: r.try_get("input")?,
        trajectory: r.try_get("trajectory")?,
        output: r.try_get("output")?,
        feedback: r.try_get("feedback")?,
        metadata: r.try_get("metadata")?,
    })
}

/// A value in `COPY`'s text format: backslash, tab and line ends escaped.
fn copy_text(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    out
}

/// The columns the floor writes; the others take their defaults (as combee's insert leaves them).
const COLUMNS: &str = "id, prompt_id, input, trajectory, output, feedback, metadata";

/// One `COPY` of `batch` rows (its own transaction); the rows written.
async fn copy_batch(conn: &mut sqlx::PgConnection, table: Table, row: &RowText, batch: usize) -> anyhow::Result<u64> {
    let tail = format!(
        "\t{}\t{}\t{}\t{}\t{}\t{}\n",
        row.prompt_id,
        copy_text(&row.input),
        copy_text(&row.trajectory),
        copy_text(&row.output),
        copy_text(&row.feedback),
        copy_text(&row.metadata)
    );
    let mut data = String::with_capacity(batch * (tail.len() + 36));
    for _ in 0..batch {
        data.push_str(&Uuid::now_v7().to_string());
        data.push_str(&tail);
    }
    let mut copy = conn.copy_in_raw(&format!("COPY {} ({COLUMNS}) FROM STDIN", table.name())).await?;
    copy.send(data.into_bytes()).await?;
    Ok(copy.finish().await?)
}

/// The text of a multi-row insert of `rows` rows, each row `row` with its
/// parameters numbered from `first` by `params` a row.
fn values(rows: usize, params: usize, row: impl Fn(usize) -> String) -> String {
    (0..rows).map(|i| row(i * params + 1)).collect::<Vec<_>>().join(", ")
}

/// One multi-row `INSERT` of `batch` rows on Postgres (its own transaction).
async fn insert_batch_pg(
    conn: &mut sqlx::PgConnection,
    table: Table,
    row: &RowText,
    batch: usize,
) -> anyhow::Result<u64> {
    let text = format!(
        "INSERT INTO {} ({COLUMNS}) VALUES {}",
        table.name(),
        values(batch, 7, |p| format!(
            "(${p}, ${}::uuid, ${}::jsonb, ${}::jsonb, ${}::jsonb, ${}::jsonb, ${}::jsonb)",
            p + 1,
            p + 2,
            p + 3,
            p + 4,
            p + 5,
            p + 6
        ))
    );
    let mut q = sqlx::query(&text);
    for _ in 0..batch {
        q = q
            .bind(Uuid::now_v7())
            .bind(&row.prompt_id)
            .bind(&row.input)
            .bind(&row.trajectory)
            .bind(&row.output)
            .bind(&row.feedback)
            .bind(&row.metadata);
    }
    Ok(q.execute(conn).await?.rows_affected())
}

/// One transaction of `per_commit` multi-row `INSERT`s of `batch` rows each
/// on SQLite, as combee's writer begins and commits its groups.
async fn insert_batches_sqlite(
    conn: &mut SqliteConnection,
    table: Table,
    row: &RowText,
    batch: usize,
    per_commit: usize,
) -> anyhow::Result<u64> {
    let text = format!(
        "INSERT INTO {} ({COLUMNS}, created_at, updated_at) VALUES {}",
        table.name(),
        values(batch, 9, |p| format!("({})", (p..p + 9).map(|n| format!("?{n}")).collect::<Vec<_>>().join(", ")))
    );
    let now = chrono::Utc::now().timestamp_micros();
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    let mut n = 0;
    for _ in 0..per_commit {
        let mut q = sqlx::query(&text);
        for _ in 0..batch {
            q = q
                .bind(Uuid::now_v7().to_string())
                .bind(&row.prompt_id)
                .bind(&row.input)
                .bind(&row.trajectory)
                .bind(&row.output)
                .bind(&row.feedback)
                .bind(&row.metadata)
                .bind(now)
                .bind(now);
        }
        n += q.execute(&mut *tx).await?.rows_affected();
    }
    tx.commit().await?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_text_escapes_what_copy_reads_specially() {
        assert_eq!(copy_text(r#"{"a":"x\"y"}"#), r#"{"a":"x\\"y"}"#);
        assert_eq!(copy_text("a\tb\nc"), "a\\tb\\nc");
    }

    #[test]
    fn multi_row_values_number_their_parameters() {
        assert_eq!(values(2, 2, |p| format!("(${p}, ${})", p + 1)), "($1, $2), ($3, $4)");
    }
}
