//! Embedded schema migrations: the SQL files under `migrations/` compiled in
//! (build.rs lists them), read by sqlx's own rules for names and checksums, and
//! applied in order by sqlx's migrator at start-up and by `combee migrate`.
//! sqlx records each one with a checksum in `_sqlx_migrations` (an edited,
//! already-applied file is caught) and, on Postgres, holds an advisory lock so
//! one of several starting processes migrates while the others wait.
//!
//! Databases made before by combee's own migrator kept their bookkeeping in
//! `schema_migrations` (version, name, SHA-256 hex of the file). On the first
//! start without `_sqlx_migrations` those rows are adopted: each one whose
//! checksum still matches its file is recorded as applied, so nothing runs twice.

use std::{borrow::Cow, sync::LazyLock};

use futures_util::{FutureExt, future::BoxFuture};
use sha2::{Digest, Sha256};
use sqlx::{
    Connection, PgPool, SqlitePool,
    error::BoxDynError,
    migrate::{Migrate, MigrateError, Migration, MigrationSource, MigrationType, Migrator},
};

use super::{StoreError, StoreResult};

// `(file name, contents)` of every file under migrations/postgres and migrations/sqlite.
include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

pub(super) static POSTGRES: LazyLock<Migrator> = LazyLock::new(|| embedded(POSTGRES_FILES));
pub(super) static SQLITE: LazyLock<Migrator> = LazyLock::new(|| embedded(SQLITE_FILES));

/// The compiled-in files as a migration source, read as sqlx reads a folder
/// (`<version>_<description>.sql`, `_` read as a space, a first line
/// `-- no-transaction` runs outside a transaction), so versions, descriptions
/// and checksums are those `sqlx::migrate!` and `sqlx migrate` record.
#[derive(Debug)]
struct Embedded(&'static [(&'static str, &'static str)]);

impl MigrationSource<'static> for Embedded {
    fn resolve(self) -> BoxFuture<'static, Result<Vec<Migration>, BoxDynError>> {
        let mut migrations = Vec::with_capacity(self.0.len());
        for (file, sql) in self.0 {
            let Some((version, rest)) = file.split_once('_') else { continue };
            let version: i64 = match version.parse() {
                Ok(v) => v,
                Err(_) => {
                    return async move { Err(format!("migration {file:?} has no integer version").into()) }.boxed();
                }
            };
            let kind = MigrationType::from_filename(rest);
            let description = rest.trim_end_matches(kind.suffix()).replace('_', " ");
            migrations.push(Migration::new(
                version,
                Cow::Owned(description),
                kind,
                Cow::Borrowed(sql),
                sql.starts_with("-- no-transaction"),
            ));
        }
        migrations.sort_by_key(|m| m.version);
        async move { Ok(migrations) }.boxed()
    }
}

fn embedded(files: &'static [(&'static str, &'static str)]) -> Migrator {
    // Resolving compiled-in files does no I/O: the future is ready at once.
    let mut migrator = Migrator::new(Embedded(files))
        .now_or_never()
        .expect("embedded migrations resolve without waiting")
        .expect("build.rs embeds only <version>_<name>.sql files");
    // A database that ran a migration this binary does not have (a parallel
    // branch's number, not merged yet) still opens, as it did before sqlx.
    migrator.set_ignore_missing(true);
    migrator
}

/// Serialises adopting the old bookkeeping between processes ("combee").
const ADOPTION_LOCK: i64 = 0x636f_6d62_6565;

fn failed(e: MigrateError) -> StoreError {
    StoreError::Migration(e.to_string())
}

/// The `_sqlx_migrations` rows for the old migrator's `(version, checksum)`
/// rows: only versions this binary has, and only unchanged files.
fn adopted(migrator: &Migrator, legacy: &[(i64, String)]) -> StoreResult<Vec<(i64, String, Vec<u8>)>> {
    let mut rows = Vec::new();
    for (version, sum) in legacy {
        let Some(m) = migrator.iter().find(|m| m.version == *version) else { continue };
        if hex::encode(Sha256::digest(m.sql.as_bytes())) != *sum {
            return Err(StoreError::Migration(format!(
                "migration {} ({}) was changed after it was applied",
                m.version, m.description
            )));
        }
        rows.push((m.version, m.description.to_string(), m.checksum.to_vec()));
    }
    Ok(rows)
}

const ADOPT: &str = "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
                     VALUES ($1, $2, TRUE, $3, 0)";

/// Applies the Postgres migrations, one starting process at a time (the
/// adoption lock, then sqlx's own). A migration that cannot take a table lock
/// within [`SET_MIGRATION_LOCK_TIMEOUT`] is rolled back and tried again, so it
/// never holds one table while it waits for another against live writes.
pub(super) async fn postgres(pool: &PgPool) -> StoreResult<()> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let mut conn = pool.acquire().await?;
        sqlx::query("SELECT pg_advisory_lock($1)").bind(ADOPTION_LOCK).execute(&mut *conn).await?;
        let result = async {
            let legacy: bool = sqlx::query_scalar(
                "SELECT to_regclass('schema_migrations') IS NOT NULL AND to_regclass('_sqlx_migrations') IS NULL",
            )
            .fetch_one(&mut *conn)
            .await?;
            if legacy {
                adopt::<sqlx::Postgres>(&mut conn, &POSTGRES).await?;
            }
            sqlx::query(SET_MIGRATION_LOCK_TIMEOUT).execute(&mut *conn).await?;
            let ran = POSTGRES.run(&mut *conn).await;
            sqlx::query("RESET lock_timeout").execute(&mut *conn).await?;
            gave_way(ran)
        }
        .await;
        sqlx::query("SELECT pg_advisory_unlock($1)").bind(ADOPTION_LOCK).execute(&mut *conn).await?;
        match result? {
            None => return Ok(()),
            Some(why) if attempt < GIVE_WAY_ATTEMPTS => {
                // Closing the connection releases its advisory locks: sqlx's
                // migrator keeps its own after a failed migration.
                let _ = conn.detach().close().await;
                tracing::info!(attempt, %why, "a migration gave way to the writes on a table it locks; trying again");
                tokio::time::sleep(GIVE_WAY_PAUSE * attempt.min(10)).await;
            }
            Some(why) => {
                return Err(StoreError::Migration(format!(
                    "a migration could not take its table locks in {GIVE_WAY_ATTEMPTS} attempts: {why}"
                )));
            }
        }
    }
}

/// Why a pass of the migrations gave way (a lock not taken within the
/// timeout, 55P03, or chosen to break a deadlock, 40P01); `None` when it
/// finished. Any other failure is the pass's error.
fn gave_way(ran: Result<(), MigrateError>) -> StoreResult<Option<String>> {
    match ran {
        Ok(()) => Ok(None),
        Err(
            MigrateError::Execute(sqlx::Error::Database(e))
            | MigrateError::ExecuteMigration(sqlx::Error::Database(e), _),
        ) if matches!(e.code().as_deref(), Some("55P03" | "40P01")) => Ok(Some(e.message().to_owned())),
        Err(e) => Err(failed(e)),
    }
}

/// How long a migration's statement waits for a table lock before the
/// migration is rolled back and tried again. A schema change that waits for
/// a lock on one table while holding another (dropping a foreign key locks
/// both tables) can deadlock with the writes of a release still serving; a
/// short wait makes the migration give way first, so those writes go on.
const SET_MIGRATION_LOCK_TIMEOUT: &str = "SET lock_timeout = '250ms'";

/// How many times a migration gives way before start-up fails, and the
/// pause after each (growing with the attempt, to ten times this).
const GIVE_WAY_ATTEMPTS: u32 = 30;
const GIVE_WAY_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Records the old migrator's unchanged rows in `_sqlx_migrations`, in one transaction.
async fn adopt<DB>(conn: &mut DB::Connection, migrator: &Migrator) -> StoreResult<()>
where
    DB: sqlx::Database,
    DB::Connection: Migrate,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'r> (i64, String): sqlx::FromRow<'r, DB::Row>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> Vec<u8>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
{
    let legacy: Vec<(i64, String)> =
        sqlx::query_as("SELECT version, checksum FROM schema_migrations").fetch_all(&mut *conn).await?;
    let rows = adopted(migrator, &legacy)?;
    let mut tx = conn.begin().await?;
    tx.ensure_migrations_table().await.map_err(failed)?;
    for (version, description, checksum) in rows {
        sqlx::query(ADOPT).bind(version).bind(description).bind(checksum).execute(&mut *tx).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// SQLite has one writer (the pool given), so no lock is needed.
pub(super) async fn sqlite(pool: &SqlitePool) -> StoreResult<()> {
    let mut conn = pool.acquire().await?;
    let legacy: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations')
            AND NOT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations')",
    )
    .fetch_one(&mut *conn)
    .await?;
    if legacy {
        adopt::<sqlx::Sqlite>(&mut conn, &SQLITE).await?;
    }
    SQLITE.run(&mut *conn).await.map_err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The embedded files read exactly as sqlx reads the folders (what
    /// `sqlx::migrate!` recorded before): same versions, names and checksums,
    /// so databases migrated by earlier builds are not seen as edited.
    #[tokio::test]
    async fn embedded_migrations_match_sqlx_reading_the_folders() {
        for (migrator, folder) in [(&*POSTGRES, "postgres"), (&*SQLITE, "sqlite")] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations").join(folder);
            let from_disk = Migrator::new(dir.as_path()).await.expect("the folder resolves");
            let key = |m: &Migration| (m.version, m.description.to_string(), m.checksum.to_vec(), m.no_tx);
            let embedded: Vec<_> = migrator.iter().map(key).collect();
            assert_eq!(embedded, from_disk.iter().map(key).collect::<Vec<_>>(), "{folder}");
            assert!(embedded.len() >= 13, "{folder}: {} migrations", embedded.len());
        }
    }

    /// 0045 leaves the embedded store one rollup row per key: each key's rows
    /// folded into one with the same sums, a key whose traces all went
    /// dropped, and a second row for a key refused (the writes' upsert needs it).
    #[tokio::test]
    async fn sqlite_rollups_fold_into_one_row_per_key() {
        use sqlx::sqlite::SqliteConnectOptions;
        let options = SqliteConnectOptions::new().in_memory(true).foreign_keys(false);
        let mut c = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
        let before = SQLITE_FILES.iter().position(|(f, _)| f.starts_with("0045_")).expect("0045 is embedded");
        embedded(&SQLITE_FILES[..before]).run_direct(&mut c).await.unwrap();
        for row in [
            "('p', 1, 60, 0, 1, 1, 0, 0, 1, 0.5, 0.25, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1)",
            "('p', 1, 60, 0, 2, 2, 0, 0, 2, 1.0, 0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)",
            "('p', 1, 60, 60, 1, 1, 0, 0, 1, 0.5, 0.25, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1)",
            "('p', 1, 60, 60, -1, -1, 0, 0, -1, -0.5, -0.25, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)",
        ] {
            sqlx::query(&format!(
                "INSERT INTO outcome_rollups (prompt_id, version, width, start_secs, traces, with_feedback,
                     success_trials, successes, score_n, score_sum, score_sq, tokens_n, tokens_sum, tokens_sq,
                     cost_n, cost_sum, cost_sq, latency_n, latency_sum, latency_sq, judged, compacted) VALUES {row}"
            ))
            .execute(&mut c)
            .await
            .unwrap();
        }
        for row in ["('p', 1, 'k', 60, 0, 1, 0.5, 1)", "('p', 1, 'k', 60, 0, 3, 2.0, 0)"] {
            sqlx::query(&format!(
                "INSERT INTO task_rollups (prompt_id, version, task_key, width, start_secs, traces, reward_sum,
                     compacted) VALUES {row}"
            ))
            .execute(&mut c)
            .await
            .unwrap();
        }
        SQLITE.run_direct(&mut c).await.unwrap();
        let outcomes: Vec<(i64, i64, f64, i64)> =
            sqlx::query_as("SELECT start_secs, traces, score_sum, judged FROM outcome_rollups ORDER BY start_secs")
                .fetch_all(&mut c)
                .await
                .unwrap();
        assert_eq!(outcomes, [(0, 3, 1.5, 1)]);
        let tasks: Vec<(i64, f64)> =
            sqlx::query_as("SELECT traces, reward_sum FROM task_rollups").fetch_all(&mut c).await.unwrap();
        assert_eq!(tasks, [(4, 2.5)]);
        let again = sqlx::query("INSERT INTO task_rollups (prompt_id, version, task_key, width, start_secs, traces, reward_sum) VALUES ('p', 1, 'k', 60, 0, 1, 1.0)")
            .execute(&mut c)
            .await;
        assert!(again.is_err(), "a second row for a key is refused");
    }

    #[test]
    fn both_stores_have_the_same_migration_sequence() {
        let pg: Vec<_> = POSTGRES.iter().map(|m| (m.version, m.description.clone())).collect();
        let lite: Vec<_> = SQLITE.iter().map(|m| (m.version, m.description.clone())).collect();
        assert_eq!(pg, lite);
        // Strictly increasing; a gap is allowed while a parallel branch's number is not merged yet.
        assert!(pg.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn an_edited_file_is_not_adopted() {
        let first = POSTGRES.iter().next().expect("a migration");
        let sum = hex::encode(Sha256::digest(first.sql.as_bytes()));
        assert_eq!(adopted(&POSTGRES, &[(first.version, sum)]).unwrap().len(), 1);
        assert!(matches!(adopted(&POSTGRES, &[(first.version, "0".repeat(64))]), Err(StoreError::Migration(_))));
        // Versions this binary does not know are left to sqlx (not adopted).
        assert!(adopted(&POSTGRES, &[(9999, String::new())]).unwrap().is_empty());
    }
}
