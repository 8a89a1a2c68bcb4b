//! The in-memory cache of rendered prompts that agents fetch, of the arms an
//! `evaluated` prompt is served from, and of which prompts exist (prompts are
//! never deleted or renamed). Entries are keyed by the prompt's full name —
//! two projects' `support-agent` are two entries — and a change drops every
//! project's entries of the changed name at once, in other processes too,
//! via the store's change feed (`LISTEN/NOTIFY` on Postgres), which names a
//! prompt by its bare name. A generation counter stops a read that raced
//! with a change from re-inserting the old value. Bounded: at most
//! `cache.max_prompts` prompt names (the least recently used go first) and
//! [`MAX_ANSWERS_PER_PROMPT`] answers per prompt.

use std::{
    collections::HashMap,
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    body::Bytes,
    http::{HeaderMap, HeaderValue, header},
};

use crate::domain::{PromptName, label::Selector, population::ArmState};

/// The caches' maps: hashed with foldhash (seeded per map), several times
/// cheaper than the standard SipHash on the hottest route. Keys are prompt
/// names that exist, selectors and key digests, so a per-map random seed is
/// protection enough against collisions made on purpose.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Most cached answers (labels, versions) per prompt; past it the prompt's answers start over.
pub const MAX_ANSWERS_PER_PROMPT: usize = 64;

/// Milliseconds since the process first asked, kept by a thread that ticks
/// every 10 ms: the caches' freshness and recency checks read this instead of
/// the clock (several clock reads per request add up on the hottest route).
pub fn coarse_now_ms() -> u64 {
    static NOW: std::sync::OnceLock<Arc<AtomicU64>> = std::sync::OnceLock::new();
    NOW.get_or_init(|| {
        let now = Arc::new(AtomicU64::new(0));
        let (tick, start) = (now.clone(), Instant::now());
        let ticking = std::thread::Builder::new().name("combee-coarse-clock".into()).spawn(move || {
            loop {
                tick.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        if ticking.is_err() {
            tracing::error!("cannot start the coarse clock; cached entries will not expire by age");
        }
        now
    })
    .load(Ordering::Relaxed)
}

/// A ready-to-send answer for `GET /v1/prompts/{name}`, also in the two
/// shapes an `evaluated` prompt's arm is served in (with `"arm"`).
#[derive(Debug)]
pub struct CachedPrompt {
    pub etag: HeaderValue,
    pub body: Bytes,
    pub version: i64,
    /// `Combee-Version` for this answer.
    pub version_header: HeaderValue,
    as_champion: Bytes,
    as_challenger: Bytes,
    /// The answer's headers, made once: plain, as the champion, as a challenger.
    headers: [HeaderMap; 3],
    stored_ms: u64,
}

impl CachedPrompt {
    /// `body` is the JSON object agents receive; the arm shapes are made from it once, here.
    pub fn new(etag: HeaderValue, body: Bytes, version: i64) -> Self {
        let with = |state: ArmState| -> Bytes {
            let Ok(serde_json::Value::Object(mut o)) = serde_json::from_slice::<serde_json::Value>(&body) else {
                return body.clone();
            };
            o.insert("arm".into(), state.as_str().into());
            serde_json::to_vec(&o).map(Bytes::from).unwrap_or_else(|_| body.clone())
        };
        let version_header = HeaderValue::from(version);
        let headers = [None, Some(ArmState::Champion), Some(ArmState::Challenger)].map(|arm| {
            let mut h = HeaderMap::with_capacity(8);
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            h.insert(header::ETAG, etag.clone());
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            // Without `label`/`version`, which version is served can depend on the subject.
            h.insert(header::VARY, HeaderValue::from_static("Combee-Subject"));
            if let Some(arm) = arm {
                h.insert("combee-arm", HeaderValue::from_static(arm.as_str()));
                h.insert("combee-version", version_header.clone());
            }
            // The request id's place, filled in every answer by the request middleware
            // (`http/observe.rs`): kept here, a copy of these headers takes it in place
            // rather than growing by one entry (a reallocation per answer).
            h.insert("x-request-id", HeaderValue::from_static(""));
            h
        });
        Self {
            as_champion: with(ArmState::Champion),
            as_challenger: with(ArmState::Challenger),
            headers,
            version_header,
            etag,
            body,
            version,
            stored_ms: coarse_now_ms(),
        }
    }

    /// The body served as this arm.
    pub fn body_as(&self, arm: Option<ArmState>) -> &Bytes {
        match arm {
            Some(ArmState::Champion) => &self.as_champion,
            Some(_) => &self.as_challenger,
            None => &self.body,
        }
    }

    /// The headers of the answer served as this arm: `Content-Type`, `ETag`,
    /// `Cache-Control`, `Vary`, for an arm `Combee-Arm` and `Combee-Version`,
    /// and an empty `X-Request-Id` that the request middleware fills.
    pub fn headers_as(&self, arm: Option<ArmState>) -> &HeaderMap {
        &self.headers[match arm {
            None => 0,
            Some(ArmState::Champion) => 1,
            Some(_) => 2,
        }]
    }
}

/// The live arms of a prompt under the `evaluated` policy, as served:
/// (version, traffic weight), and which is the champion. Empty for other prompts.
#[derive(Debug, Default)]
pub struct ServedArms {
    pub arms: Vec<(i64, f64)>,
    pub champion: Option<i64>,
    stored_ms: Option<u64>,
}

impl ServedArms {
    pub fn new(arms: Vec<(i64, f64)>, champion: Option<i64>) -> Self {
        Self { arms, champion, stored_ms: Some(coarse_now_ms()) }
    }
}

/// Everything cached about one prompt; that it exists, by being here.
#[derive(Default)]
struct PromptEntry {
    answers: FastMap<Selector, Arc<CachedPrompt>>,
    arms: Option<Arc<ServedArms>>,
    /// Milliseconds since the cache started, at the last hit (for eviction).
    last_used: AtomicU64,
}

/// The entries of every project's prompt of one name (usually one), dropped
/// together: a change is announced by the bare name.
#[derive(Default)]
struct NameEntry {
    by_project: Vec<(String, PromptEntry)>,
}

impl NameEntry {
    fn get(&self, project: &str) -> Option<&PromptEntry> {
        self.by_project.iter().find(|(p, _)| p == project).map(|(_, e)| e)
    }
}

pub struct PromptCache {
    prompts: RwLock<FastMap<String, NameEntry>>,
    generation: AtomicU64,
    max_age_ms: u64,
    max_prompts: usize,
}

impl PromptCache {
    pub fn new(max_age: Duration, max_prompts: usize) -> Self {
        Self {
            prompts: RwLock::default(),
            generation: AtomicU64::new(0),
            max_age_ms: max_age.as_millis() as u64,
            max_prompts: max_prompts.max(1),
        }
    }

    fn now_ms(&self) -> u64 {
        coarse_now_ms()
    }

    fn fresh(&self, stored_ms: u64) -> bool {
        self.now_ms().saturating_sub(stored_ms) < self.max_age_ms
    }

    fn touch(&self, entry: &PromptEntry) {
        let now = self.now_ms();
        // Only when it moved on, so concurrent hits do not keep writing one cache line.
        if entry.last_used.load(Ordering::Relaxed) + 1_000 <= now {
            entry.last_used.store(now, Ordering::Relaxed);
        }
    }

    /// Read before loading from the store; pass to [`PromptCache::insert`].
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn get(&self, prompt: &PromptName, selector: &Selector) -> Option<Arc<CachedPrompt>> {
        let prompts = self.prompts.read().unwrap_or_else(|e| e.into_inner());
        let entry = prompts.get(prompt.as_str())?.get(prompt.project())?;
        let hit = entry.answers.get(selector)?;
        if !self.fresh(hit.stored_ms) {
            return None;
        }
        self.touch(entry);
        Some(hit.clone())
    }

    /// The entry of `prompt` to write into, making room first when it is new.
    fn entry<'m>(&self, prompts: &'m mut FastMap<String, NameEntry>, prompt: &PromptName) -> &'m mut PromptEntry {
        if !prompts.contains_key(prompt.as_str()) && prompts.len() >= self.max_prompts {
            evict_least_recent(prompts, self.max_prompts);
        }
        let named = &mut prompts.entry(prompt.as_str().to_owned()).or_default().by_project;
        let at = match named.iter().position(|(p, _)| p == prompt.project()) {
            Some(at) => at,
            None => {
                named.push((prompt.project().to_owned(), PromptEntry::default()));
                named.len() - 1
            }
        };
        let entry = &mut named[at].1;
        entry.last_used.store(self.now_ms(), Ordering::Relaxed);
        entry
    }

    /// Whether `prompt` is known to exist (it was found since its name last changed).
    pub fn knows(&self, prompt: &PromptName) -> bool {
        let prompts = self.prompts.read().unwrap_or_else(|e| e.into_inner());
        prompts.get(prompt.as_str()).is_some_and(|named| named.get(prompt.project()).is_some())
    }

    /// Remembers that `prompt` exists, unless something changed since `generation` was read.
    pub fn found(&self, prompt: &PromptName, generation: u64) {
        let mut prompts = self.prompts.write().unwrap_or_else(|e| e.into_inner());
        if self.generation.load(Ordering::Acquire) == generation {
            self.entry(&mut prompts, prompt);
        }
    }

    /// Inserts unless something changed since `generation` was read.
    pub fn insert(&self, prompt: &PromptName, selector: Selector, generation: u64, value: Arc<CachedPrompt>) {
        let mut prompts = self.prompts.write().unwrap_or_else(|e| e.into_inner());
        if self.generation.load(Ordering::Acquire) != generation {
            return;
        }
        let entry = self.entry(&mut prompts, prompt);
        if entry.answers.len() >= MAX_ANSWERS_PER_PROMPT && !entry.answers.contains_key(&selector) {
            entry.answers.clear();
        }
        entry.answers.insert(selector, value);
    }

    /// The served arms of `prompt`, if cached and fresh.
    pub fn get_arms(&self, prompt: &PromptName) -> Option<Arc<ServedArms>> {
        let prompts = self.prompts.read().unwrap_or_else(|e| e.into_inner());
        let entry = prompts.get(prompt.as_str())?.get(prompt.project())?;
        let hit = entry.arms.as_ref()?;
        if !hit.stored_ms.is_some_and(|t| self.fresh(t)) {
            return None;
        }
        self.touch(entry);
        Some(hit.clone())
    }

    /// Inserts unless something changed since `generation` was read.
    pub fn insert_arms(&self, prompt: &PromptName, generation: u64, value: Arc<ServedArms>) {
        let mut prompts = self.prompts.write().unwrap_or_else(|e| e.into_inner());
        if self.generation.load(Ordering::Acquire) == generation {
            self.entry(&mut prompts, prompt).arms = Some(value);
        }
    }

    /// Drops what is cached of every project's prompt named `name` (the
    /// bare name: what the change feed carries).
    pub fn invalidate(&self, name: &str) {
        let mut prompts = self.prompts.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::AcqRel);
        prompts.remove(name);
    }

    pub fn clear(&self) {
        let mut prompts = self.prompts.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::AcqRel);
        prompts.clear();
    }

    /// Prompt names cached now.
    pub fn len(&self) -> usize {
        self.prompts.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Drops the least recently used tenth of a full map (at least one entry),
/// so a full cache sorts once per `max / 10` insertions, not on each.
pub(crate) fn evict_least_recent<K: Clone + Eq + std::hash::Hash, V>(map: &mut FastMap<K, V>, max: usize)
where
    V: LastUsed,
{
    let mut ages: Vec<(u64, K)> = map.iter().map(|(k, v)| (v.last_used(), k.clone())).collect();
    ages.sort_unstable_by_key(|(t, _)| *t);
    let drop = (max / 10).max(1).max(map.len() + 1 - max);
    for (_, k) in ages.into_iter().take(drop) {
        map.remove(&k);
    }
}

/// An entry that remembers when it was last used (for [`evict_least_recent`]).
pub(crate) trait LastUsed {
    fn last_used(&self) -> u64;
}

impl LastUsed for NameEntry {
    fn last_used(&self) -> u64 {
        self.by_project.iter().map(|(_, e)| e.last_used.load(Ordering::Relaxed)).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::LabelName;

    fn p(name: &str) -> PromptName {
        PromptName::new("default", name).unwrap()
    }

    fn entry(v: i64) -> Arc<CachedPrompt> {
        Arc::new(CachedPrompt::new(HeaderValue::from_static("\"x\""), Bytes::from_static(b"{\"a\":1}"), v))
    }

    #[test]
    fn a_change_during_a_load_keeps_the_stale_value_out() {
        let cache = PromptCache::new(Duration::from_secs(60), 100);
        let sel = Selector::Label(LabelName::production());
        let g = cache.generation();
        cache.invalidate("p"); // a write lands while the reader was loading
        cache.insert(&p("p"), sel.clone(), g, entry(1));
        assert!(cache.get(&p("p"), &sel).is_none());
        let g = cache.generation();
        cache.insert(&p("p"), sel.clone(), g, entry(2));
        assert_eq!(cache.get(&p("p"), &sel).unwrap().version, 2);
        cache.invalidate("other");
        assert!(cache.get(&p("p"), &sel).is_some(), "another prompt's change leaves p cached");
    }

    #[test]
    fn two_projects_prompts_of_one_name_are_two_entries_dropped_together() {
        let cache = PromptCache::new(Duration::from_secs(60), 100);
        let sel = Selector::Label(LabelName::production());
        let (a, b) = (PromptName::new("team-a", "p").unwrap(), PromptName::new("team-b", "p").unwrap());
        cache.insert(&a, sel.clone(), cache.generation(), entry(1));
        assert!(cache.get(&b, &sel).is_none() && !cache.knows(&b), "team-b's p is not team-a's");
        cache.insert(&b, sel.clone(), cache.generation(), entry(7));
        assert_eq!((cache.get(&a, &sel).unwrap().version, cache.get(&b, &sel).unwrap().version), (1, 7));
        assert!(cache.knows(&a) && !cache.knows(&p("p")));
        cache.invalidate("p");
        assert!(cache.get(&a, &sel).is_none() && cache.get(&b, &sel).is_none() && !cache.knows(&a));
    }

    #[test]
    fn the_cache_stays_within_its_bounds_and_keeps_what_is_used() {
        let cache = PromptCache::new(Duration::from_secs(60), 100);
        let sel = Selector::Label(LabelName::production());
        cache.insert(&p("hot"), sel.clone(), cache.generation(), entry(1));
        for i in 0..1_000 {
            cache.insert(&p(&format!("p{i}")), sel.clone(), cache.generation(), entry(1));
            // The hot prompt is read all along (its use is recorded once a second at most).
            if let Some(e) = cache.prompts.read().unwrap().get("hot").and_then(|n| n.get("default")) {
                e.last_used.store(cache.now_ms() + 10_000, Ordering::Relaxed);
            }
            assert!(cache.len() <= 100);
        }
        assert!(cache.get(&p("hot"), &sel).is_some(), "the most recently used prompt stays");
        for v in 1..=200 {
            cache.insert(&p("hot"), Selector::Version(v), cache.generation(), entry(v));
        }
        assert!(cache.prompts.read().unwrap()["hot"].get("default").unwrap().answers.len() <= MAX_ANSWERS_PER_PROMPT);
    }

    #[test]
    fn arm_bodies_carry_the_arm() {
        let e = entry(3);
        let v: serde_json::Value = serde_json::from_slice(e.body_as(Some(ArmState::Challenger))).unwrap();
        assert_eq!(v, serde_json::json!({"a": 1, "arm": "challenger"}));
        assert_eq!(e.body_as(None).as_ref(), b"{\"a\":1}");
        assert_eq!(e.version_header, "3");
        let h = e.headers_as(Some(ArmState::Champion));
        assert_eq!((h["combee-arm"].to_str().unwrap(), h["combee-version"].to_str().unwrap()), ("champion", "3"));
        assert!(e.headers_as(None).get("combee-arm").is_none());
    }
}
