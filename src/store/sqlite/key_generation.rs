//! The API key generation on SQLite, read from its table only when a commit
//! may have changed it: every request checks it (has any process revoked a
//! key?), so the check must cost next to nothing.

use std::path::Path;

use sqlx::Sqlite;

use crate::store::{StoreResult, backend::SqlStore};

/// Makes the per-request "did any process revoke a key?" check cheap. Every
/// commit, by any process, rewrites the WAL index header at the start of the
/// `-shm` file (its change counter, frame count and salts; see
/// <https://sqlite.org/walformat.html>). While those bytes are unchanged no
/// transaction has committed, so the key generation read under them still
/// holds and no query is needed; when they changed, or cannot be read, the
/// generation is read from the table again.
pub struct KeyGenerationCache {
    shm: Option<std::fs::File>,
    seen: std::sync::Mutex<Option<(WalIndexHeader, i64)>>,
}

/// The first copy of the WAL index header.
type WalIndexHeader = [u8; 48];

impl KeyGenerationCache {
    pub(super) fn open(db: &Path) -> Self {
        let mut shm = db.as_os_str().to_owned();
        shm.push("-shm");
        Self { shm: std::fs::File::open(shm).ok(), seen: std::sync::Mutex::new(None) }
    }

    fn header(&self) -> Option<WalIndexHeader> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 48];
        self.shm.as_ref()?.read_exact_at(&mut buf, 0).ok()?;
        Some(buf)
    }

    fn lookup(&self, header: &WalIndexHeader) -> Option<i64> {
        match *self.seen.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((seen, generation)) if seen == *header => Some(generation),
            _ => None,
        }
    }

    fn remember(&self, header: WalIndexHeader, generation: i64) {
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = Some((header, generation));
    }
}

/// The generation, from the cache while no commit has happened since it was read.
pub(super) async fn api_key_generation(s: &SqlStore<Sqlite>) -> StoreResult<i64> {
    // The header is read before the query: a commit landing in between
    // changes it, so the next call queries again.
    let header = s.watch.header();
    if let Some(generation) = header.as_ref().and_then(|h| s.watch.lookup(h)) {
        return Ok(generation);
    }
    let generation: i64 = sqlx::query_scalar("SELECT generation FROM api_key_generation").fetch_one(&s.reader).await?;
    if let Some(header) = header {
        s.watch.remember(header, generation);
    }
    Ok(generation)
}
