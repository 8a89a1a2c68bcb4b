//! API keys: generation, hashing, and a small cache of verified keys so the
//! hot paths do not query the store on every request. Keys are random
//! (`cmb_` + 40 base62 characters), so a plain SHA-256 is a safe hash.

use std::{
    collections::HashMap,
    sync::{Arc, RwLock},
    time::{Duration, Instant},
};

use rand::{Rng, distributions::Alphanumeric};
use sha2::{Digest, Sha256};

use crate::store::{ApiKey, DynStore, Scope, StoreError, StoreKind};

pub const KEY_PREFIX: &str = "cmb_";
const VISIBLE_PREFIX_LEN: usize = 12;
const CACHE_TTL: Duration = Duration::from_secs(30);
const CACHE_MAX: usize = 10_000;

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

/// Creates a key in the store and returns it with its secret.
pub async fn create_key(store: &DynStore, name: &str, scopes: &[Scope]) -> Result<(ApiKey, String), StoreError> {
    let minted = mint_key();
    let key = store.create_api_key(name, &minted.prefix, &minted.hash, scopes).await?;
    Ok((key, minted.secret))
}

/// Verified keys by the SHA-256 of their secret (raw bytes: no hex on the hot
/// path), dropped on any key change this process hears of (see `Change::Keys`)
/// and after a TTL. On SQLite nothing tells the server that another process
/// (`combee keys revoke`) revoked a key, so there every request also reads the
/// store's key generation and an entry counts only for the generation it was
/// read at: a revocation takes effect at once. On Postgres the revoking
/// process's `NOTIFY` clears the cache instead, with no query per request.
pub struct KeyCache {
    store: DynStore,
    entries: RwLock<HashMap<KeyDigest, CachedKey>>,
    check_generation: bool,
}

type KeyDigest = [u8; 32];

struct CachedKey {
    key: Arc<ApiKey>,
    stored_at: Instant,
    /// The store's key generation when the key was read (`None`: not checked).
    generation: Option<i64>,
}

impl KeyCache {
    pub fn new(store: DynStore) -> Self {
        let check_generation = store.kind() == StoreKind::Sqlite;
        Self { store, entries: RwLock::new(HashMap::new()), check_generation }
    }

    /// The active key for this secret, or `None` when it is unknown or revoked.
    pub async fn authenticate(&self, secret: &str) -> Result<Option<Arc<ApiKey>>, StoreError> {
        if !secret.starts_with(KEY_PREFIX) || secret.len() > 128 {
            return Ok(None);
        }
        let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        // Read before the key itself: a revocation landing in between then
        // shows in the key row, and one landing after bumps the generation.
        let generation = if self.check_generation { Some(self.store.api_key_generation().await?) } else { None };
        if let Some(hit) = self.entries.read().unwrap_or_else(|e| e.into_inner()).get(&digest)
            && hit.stored_at.elapsed() < CACHE_TTL
            && hit.generation == generation
        {
            return Ok(Some(hit.key.clone()));
        }
        let Some(key) = self.store.api_key_by_hash(&hex::encode(digest)).await?.filter(|k| k.revoked_at.is_none())
        else {
            return Ok(None);
        };
        let key = Arc::new(key);
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= CACHE_MAX {
            entries.clear();
        }
        entries.insert(digest, CachedKey { key: key.clone(), stored_at: Instant::now(), generation });
        Ok(Some(key))
    }

    pub fn clear(&self) {
        self.entries.write().unwrap_or_else(|e| e.into_inner()).clear();
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
