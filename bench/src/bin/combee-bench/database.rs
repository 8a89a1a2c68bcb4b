//! The fresh Postgres database a run uses, next to the admin URL's, and
//! dropped afterwards.

use anyhow::Context;
use sqlx::Connection;

/// A fresh database next to the admin URL's, dropped after the run.
pub(crate) struct BenchDatabase {
    admin: String,
    name: String,
    pub(crate) url: String,
    pub(crate) synchronous_commit: String,
    pub(crate) fsync: String,
}

impl BenchDatabase {
    pub(crate) async fn create(admin: &str) -> anyhow::Result<Self> {
        let name = format!("bench_{:08x}", rand::random::<u32>());
        let mut conn = sqlx::PgConnection::connect(admin).await.context("cannot connect to DATABASE_URL")?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await.context("CREATE DATABASE")?;
        let synchronous_commit: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut conn).await?;
        let fsync: String = sqlx::query_scalar("SHOW fsync").fetch_one(&mut conn).await?;
        conn.close().await?;
        Ok(Self { admin: admin.to_owned(), url: with_database(admin, &name)?, name, synchronous_commit, fsync })
    }

    pub(crate) async fn drop_database(self) {
        let dropped = async {
            let mut conn = sqlx::PgConnection::connect(&self.admin).await?;
            sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)).execute(&mut conn).await?;
            conn.close().await
        };
        if let Err(e) = dropped.await {
            eprintln!("combee-bench: could not drop database {}: {e}", self.name);
        }
    }
}

/// The same URL with another database name.
fn with_database(url: &str, db: &str) -> anyhow::Result<String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").context("DATABASE_URL is not a URL")? + 3;
    let authority_end = base[scheme_end..].find('/').map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{db}", &base[..authority_end]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_name_is_swapped_keeping_the_query() {
        assert_eq!(
            with_database("postgres://u:p@127.0.0.1:5432/postgres?sslmode=disable", "bench_1").unwrap(),
            "postgres://u:p@127.0.0.1:5432/bench_1?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "b").unwrap(), "postgres://h/b");
    }
}
