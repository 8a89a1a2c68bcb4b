//! Keeping the concurrency limit a backend earned across processes. The
//! client recalls it before its first call, so a new process sends a large
//! round's calls at the rate the last one had proven instead of climbing from
//! 2 again ([`super::limit::AdaptiveLimit::resume`]); a backend never seen
//! starts as a new one. What the client learns is kept again at most once a
//! second, by a task of its own. The storage lives above this layer (the
//! service's store-backed [`LimitMemory`]); this file holds the vocabulary.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{OnceCell, watch};

use super::config::LlmConfig;
use super::limit::AdaptiveLimit;

/// Where limits are kept (the store, in a running service).
#[async_trait]
pub trait LimitMemory: Send + Sync {
    /// The limit last kept for `backend`, if it was ever seen.
    async fn recall(&self, backend: &BackendKey) -> Option<u32>;
    /// Keeps `limit` for `backend`.
    async fn keep(&self, backend: &BackendKey, limit: u32);
}

/// Which backend a limit belongs to: its base URL (without credentials, query
/// or fragment: nothing secret is kept) and the models the client asks it for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendKey {
    pub base_url: String,
    /// The reflector's model, and the aggregator's after `+` when it is another.
    pub model: String,
}

impl BackendKey {
    pub fn of(cfg: &LlmConfig) -> Self {
        let base_url = match reqwest::Url::parse(cfg.base_url.trim()) {
            Ok(mut url) => {
                let _ = url.set_username("");
                let _ = url.set_password(None);
                url.set_query(None);
                url.set_fragment(None);
                url.to_string()
            }
            Err(_) => cfg.base_url.trim().to_owned(),
        };
        let model = if cfg.aggregator_model == cfg.reflector_model {
            cfg.reflector_model.clone()
        } else {
            format!("{} + {}", cfg.reflector_model, cfg.aggregator_model)
        };
        Self { base_url: base_url.trim_end_matches('/').to_owned(), model }
    }
}

/// How often at most a client writes what its limit learned.
const KEEP_EVERY: Duration = Duration::from_secs(1);

/// One client's link to its [`LimitMemory`], shared by its clones.
pub(super) struct Remembered {
    memory: Arc<dyn LimitMemory>,
    key: BackendKey,
    recalled: OnceCell<()>,
    /// The limit to keep next (0: nothing learned yet); its task writes it.
    learned: watch::Sender<u32>,
}

impl Remembered {
    /// Links a client of `cfg` to `memory`; starts the task that keeps what it learns.
    pub(super) fn new(memory: Arc<dyn LimitMemory>, cfg: &LlmConfig) -> Arc<Self> {
        let key = BackendKey::of(cfg);
        let (learned, mut changes) = watch::channel(0u32);
        let (keeper, kept_key) = (memory.clone(), key.clone());
        tokio::spawn(async move {
            let mut kept = 0;
            loop {
                let open = changes.changed().await.is_ok();
                let limit = *changes.borrow_and_update();
                if limit > 0 && limit != kept {
                    keeper.keep(&kept_key, limit).await;
                    kept = limit;
                }
                if !open {
                    return;
                }
                tokio::time::sleep(KEEP_EVERY).await;
            }
        });
        Arc::new(Self { memory, key, recalled: OnceCell::new(), learned })
    }

    /// Before the client's first call: its limit resumes from what was kept.
    pub(super) async fn recall_into(&self, limit: &AdaptiveLimit) {
        self.recalled
            .get_or_init(|| async {
                if let Some(remembered) = self.memory.recall(&self.key).await {
                    limit.resume(remembered);
                }
            })
            .await;
    }

    /// After a call: what the limit has learned, to keep.
    pub(super) fn note(&self, limit: &AdaptiveLimit) {
        if let Some(earned) = limit.earned() {
            self.learned.send_if_modified(|kept| std::mem::replace(kept, earned) != earned);
        }
    }

    /// Keeps what the limit has learned now, without waiting for the task.
    pub(super) async fn keep_now(&self, limit: &AdaptiveLimit) {
        if let Some(earned) = limit.earned() {
            self.memory.keep(&self.key, earned).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::llm::{ChatMessage, LlmBackend, LlmRole, client::OpenAiClient, one_slot::OneSlotServer};

    /// Limits kept in memory, as the store keeps them.
    #[derive(Default)]
    struct Kept(Mutex<std::collections::HashMap<String, u32>>);

    #[async_trait]
    impl LimitMemory for Kept {
        async fn recall(&self, backend: &BackendKey) -> Option<u32> {
            self.0.lock().unwrap().get(&backend.base_url).copied()
        }
        async fn keep(&self, backend: &BackendKey, limit: u32) {
            self.0.lock().unwrap().insert(backend.base_url.clone(), limit);
        }
    }

    /// `n` calls at once through `c`; every one must be answered at its first attempt.
    async fn wave(c: &OpenAiClient, n: usize) -> Vec<u32> {
        let calls: Vec<_> = (0..n)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move {
                    c.chat(c.request(LlmRole::Reflector, vec![ChatMessage::user("hello")], true)).await
                })
            })
            .collect();
        let mut limits = Vec::new();
        for call in calls {
            let resp = call.await.unwrap().unwrap();
            assert_eq!(resp.retries, 0, "no attempt timed out");
            limits.push(resp.concurrency_limit.unwrap());
        }
        limits
    }

    #[tokio::test]
    async fn a_one_slot_server_seen_larger_before_is_cut_to_one_slot_and_nothing_times_out() {
        let (base_url, server) = OneSlotServer::spawn().await;
        let cfg = LlmConfig {
            base_url,
            // A floor far below a queue's wait: only the fitted limit keeps attempts alive.
            request_timeout_secs: 0.15,
            max_retries: 0,
            ..LlmConfig::default()
        };
        // An earlier process saw 64 calls served at once at this address.
        let memory = Arc::new(Kept::default());
        memory.keep(&BackendKey::of(&cfg), 64).await;
        let c = OpenAiClient::new(cfg).unwrap().with_limit_memory(memory.clone());
        // The first wave goes out at the remembered limit, and every call is answered.
        let first = wave(&c, 32).await;
        assert_eq!(first[0], 64, "resumed: {first:?}");
        assert!(server.most_waiting() > 8, "{first:?}");
        // The queue showed within a few answers: the next wave sees one or two in flight (a
        // probe above that, latency noise on a loaded machine, is taken back within a call or two).
        let second = wave(&c, 12).await;
        assert!(second.iter().filter(|&&l| l > 2).count() <= 2, "{second:?}");
        c.keep_limit_now().await;
        let kept = memory.recall(&BackendKey::of(c.config())).await;
        assert!(kept.is_some_and(|l| l <= 2), "what it learned is kept: {kept:?}");
    }

    #[test]
    fn a_backend_is_named_without_its_secrets() {
        let cfg = LlmConfig {
            base_url: "https://user:pw@llm.example.com/v1/?api-key=s3cret#x".into(),
            reflector_model: "small".into(),
            aggregator_model: "small".into(),
            ..LlmConfig::default()
        };
        let key = BackendKey::of(&cfg);
        assert_eq!(key, BackendKey { base_url: "https://llm.example.com/v1".into(), model: "small".into() });
        let two = LlmConfig { aggregator_model: "large".into(), ..cfg };
        assert_eq!(BackendKey::of(&two).model, "small + large");
    }
}
