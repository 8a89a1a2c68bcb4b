//! API keys: generation, hashing, and a bounded cache of verified keys so the
//! hot paths do not query the store on every request. Keys are random
//! (`cmb_` + 40 base62 characters), so a plain SHA-256 is a safe hash.

use std::{
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use rand::{Rng, distributions::Alphanumeric};
use sha2::{Digest, Sha256};

use crate::{
    cache::{FastMap, coarse_now_ms},
    domain::access::{ApiKey, Scope},
    store::{DynStore, StoreError},
};

pub const KEY_PREFIX: &str = "cmb_";
const VISIBLE_PREFIX_LEN: usize = 12;
/// A cached key is read again after this long, whatever happened.
pub const CACHE_TTL: Duration = Duration::from_secs(30);

/// A freshly minted key: the secret is shown once and then only its hash is kept.
pub struct MintedKey {
    pub secret: String,
    pub prefix: String,
    pub hash: String,
}

pub fn mint_key() -> MintedKey {
    let body: String = rand::thread_rng().sample_iter(&Alphanumeric).take(40).map(char::from).collect();
    let secret = format!("{KEY_PREFIX}{body}");
    MintedKey { prefix: secret[..VISIBLE_PREFIX_LEN].to_owned(), hash: hash_key(&secret), secret }
}

pub fn hash_key(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Creates a key in the store (of `project`; `None`: server-wide) and returns it with its secret.
pub async fn create_key(
    store: &DynStore,
    name: &str,
    scopes: &[Scope],
    project: Option<&str>,
) -> Result<(ApiKey, String), StoreError> {
    let minted = mint_key();
    let key = store.create_api_key(name, &minted.prefix, &minted.hash, scopes, project).await?;
    Ok((key, minted.secret))
}

/// Verified keys by the SHA-256 of their secret (raw bytes: no hex on the hot
/// path), bounded to `cache.max_keys` (the least recently used go first) and
/// trusted for at most [`CACHE_TTL`]. A request does no store query for a
/// cached key. Revocations reach every process within a second: the revoking
/// process's `NOTIFY` clears the cache at once on Postgres, and on both stores
/// [`KeyCache::watch`] reads the store's key generation (bumped by any
/// revocation, by any process, `combee keys revoke` included) every
/// [`GENERATION_POLL`] and drops every entry when it moved. An entry counts
/// only for the epoch it was read in, so a read racing with a revocation
/// never re-inserts the old key.
pub struct KeyCache {
    store: DynStore,
    entries: RwLock<FastMap<KeyDigest, CachedKey>>,
    max_keys: usize,
    /// Bumped whenever the cache is dropped.
    epoch: AtomicU64,
}

/// How often [`KeyCache::watch`] reads the store's key generation.
pub const GENERATION_POLL: Duration = Duration::from_millis(250);
/// A process that could not read the key generation for this long stops trusting cached keys.
const BLIND_LIMIT: Duration = Duration::from_secs(1);

type KeyDigest = [u8; 32];

struct CachedKey {
    key: Arc<ApiKey>,
    /// [`coarse_now_ms`] when it was read.
    stored_ms: u64,
    /// The cache epoch the key was read in.
    epoch: u64,
    /// Milliseconds since the cache started, at the last hit (for eviction).
    last_used: AtomicU64,
}

impl crate::cache::LastUsed for CachedKey {
    fn last_used(&self) -> u64 {
        self.last_used.load(Ordering::Relaxed)
    }
}

impl KeyCache {
    pub fn new(store: DynStore, max_keys: usize) -> Self {
        Self { store, entries: RwLock::default(), max_keys: max_keys.max(1), epoch: AtomicU64::new(0) }
    }

    /// The active key for this secret, or `None` when it is unknown or revoked.
    pub async fn authenticate(&self, secret: &str) -> Result<Option<Arc<ApiKey>>, StoreError> {
        if !secret.starts_with(KEY_PREFIX) || secret.len() > 128 {
            return Ok(None);
        }
        let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        // Read before the key itself: a revocation landing after this bumps it.
        let epoch = self.epoch.load(Ordering::Acquire);
        let now = coarse_now_ms();
        if let Some(hit) = self.entries.read().unwrap_or_else(|e| e.into_inner()).get(&digest)
            && now.saturating_sub(hit.stored_ms) < CACHE_TTL.as_millis() as u64
            && hit.epoch == epoch
        {
            if hit.last_used.load(Ordering::Relaxed) + 1_000 <= now {
                hit.last_used.store(now, Ordering::Relaxed);
            }
            return Ok(Some(hit.key.clone()));
        }
        let Some(key) = self.store.api_key_by_hash(&hex::encode(digest)).await?.filter(|k| k.revoked_at.is_none())
        else {
            return Ok(None);
        };
        let key = Arc::new(key);
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= self.max_keys && !entries.contains_key(&digest) {
            crate::cache::evict_least_recent(&mut entries, self.max_keys);
        }
        let now = coarse_now_ms();
        entries.insert(digest, CachedKey { key: key.clone(), stored_ms: now, epoch, last_used: AtomicU64::new(now) });
        Ok(Some(key))
    }

    pub fn clear(&self) {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        self.epoch.fetch_add(1, Ordering::AcqRel);
        entries.clear();
    }

    /// Keys cached now.
    pub fn len(&self) -> usize {
        self.entries.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops the cache whenever the store's key generation moves (any
    /// process revoked or deleted a key), reading it every [`GENERATION_POLL`]
    /// until `shutdown`; and when it could not be read for over a second.
    pub async fn watch(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let mut seen: Option<i64> = None;
        let mut last_read = Instant::now();
        loop {
            match self.store.api_key_generation().await {
                Ok(g) => {
                    if seen.is_some_and(|s| s != g) {
                        self.clear();
                    }
                    seen = Some(g);
                    last_read = Instant::now();
                }
                Err(e) if last_read.elapsed() > BLIND_LIMIT => {
                    tracing::warn!(error = %e, "cannot read the key generation; cached keys are not trusted");
                    self.clear();
                }
                Err(_) => {}
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(GENERATION_POLL) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_keys_have_the_documented_shape() {
        let k = mint_key();
        assert!(k.secret.starts_with("cmb_") && k.secret.len() == 44);
        assert_eq!(k.prefix, &k.secret[..12]);
        assert_eq!(k.hash, hash_key(&k.secret));
        assert_ne!(mint_key().secret, k.secret);
    }
}
