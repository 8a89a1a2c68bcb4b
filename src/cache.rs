//! The in-memory cache of rendered prompts that agents fetch. Any change to a
//! prompt drops its entries at once — in other processes too, via the store's
//! change feed (`LISTEN/NOTIFY` on Postgres). A generation counter stops a
//! read that raced with a change from re-inserting the old value.

use std::{
    collections::HashMap,
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{body::Bytes, http::HeaderValue};

use crate::store::Selector;

/// A ready-to-send answer for `GET /v1/prompts/{name}`.
#[derive(Debug)]
pub struct CachedPrompt {
    pub etag: HeaderValue,
    pub body: Bytes,
    pub version: i64,
    stored_at: Instant,
}

impl CachedPrompt {
    pub fn new(etag: HeaderValue, body: Bytes, version: i64) -> Self {
        Self { etag, body, version, stored_at: Instant::now() }
    }
}

/// Prompt name → selector → answer; nested so a lookup borrows the name.
type Entries = HashMap<String, HashMap<Selector, Arc<CachedPrompt>>>;

/// The live arms of a prompt under the `evaluated` policy, as served:
/// (version, traffic weight, champion?). Empty for other prompts.
#[derive(Debug, Default)]
pub struct ServedArms {
    pub arms: Vec<(i64, f64)>,
    pub champion: Option<i64>,
    stored_at: Option<Instant>,
}

impl ServedArms {
    pub fn new(arms: Vec<(i64, f64)>, champion: Option<i64>) -> Self {
        Self { arms, champion, stored_at: Some(Instant::now()) }
    }
}

pub struct PromptCache {
    entries: RwLock<Entries>,
    arms: RwLock<HashMap<String, Arc<ServedArms>>>,
    generation: AtomicU64,
    max_age: Duration,
}

impl PromptCache {
    pub fn new(max_age: Duration) -> Self {
        Self { entries: RwLock::new(HashMap::new()), arms: RwLock::default(), generation: AtomicU64::new(0), max_age }
    }

    /// Read before loading from the store; pass to [`PromptCache::insert`].
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn get(&self, prompt: &str, selector: &Selector) -> Option<Arc<CachedPrompt>> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let hit = entries.get(prompt)?.get(selector)?;
        (hit.stored_at.elapsed() < self.max_age).then(|| hit.clone())
    }

    /// Inserts unless something changed since `generation` was read.
    pub fn insert(&self, prompt: &str, selector: Selector, generation: u64, value: Arc<CachedPrompt>) {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        if self.generation.load(Ordering::Acquire) == generation {
            entries.entry(prompt.to_owned()).or_default().insert(selector, value);
        }
    }

    /// The served arms of `prompt`, if cached and fresh.
    pub fn get_arms(&self, prompt: &str) -> Option<Arc<ServedArms>> {
        let arms = self.arms.read().unwrap_or_else(|e| e.into_inner());
        let hit = arms.get(prompt)?;
        hit.stored_at.is_some_and(|t| t.elapsed() < self.max_age).then(|| hit.clone())
    }

    /// Inserts unless something changed since `generation` was read.
    pub fn insert_arms(&self, prompt: &str, generation: u64, value: Arc<ServedArms>) {
        let mut arms = self.arms.write().unwrap_or_else(|e| e.into_inner());
        if self.generation.load(Ordering::Acquire) == generation {
            arms.insert(prompt.to_owned(), value);
        }
    }

    pub fn invalidate(&self, prompt: &str) {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        let mut arms = self.arms.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::AcqRel);
        entries.remove(prompt);
        arms.remove(prompt);
    }

    pub fn clear(&self) {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        let mut arms = self.arms.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::AcqRel);
        entries.clear();
        arms.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::LabelName;

    fn entry(v: i64) -> Arc<CachedPrompt> {
        Arc::new(CachedPrompt::new(HeaderValue::from_static("\"x\""), Bytes::from_static(b"{}"), v))
    }

    #[test]
    fn a_change_during_a_load_keeps_the_stale_value_out() {
        let cache = PromptCache::new(Duration::from_secs(60));
        let sel = Selector::Label(LabelName::production());
        let g = cache.generation();
        cache.invalidate("p"); // a write lands while the reader was loading
        cache.insert("p", sel.clone(), g, entry(1));
        assert!(cache.get("p", &sel).is_none());
        let g = cache.generation();
        cache.insert("p", sel.clone(), g, entry(2));
        assert_eq!(cache.get("p", &sel).unwrap().version, 2);
        cache.invalidate("other");
        assert!(cache.get("p", &sel).is_some(), "another prompt's change leaves p cached");
    }
}
