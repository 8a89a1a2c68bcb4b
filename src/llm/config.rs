//! Settings of the LLM backend: where to send requests, which models play which
//! role, and the limits that keep a round polite to the provider. The API key is
//! held in a [`Secret`] so it can never be printed by accident.

use serde::Deserialize;

use crate::secret::Secret;

/// The `[llm]` settings. Every field has a default, unknown fields are rejected.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LlmConfig {
    /// Base URL of an OpenAI-compatible API; requests go to `{base_url}/chat/completions`.
    /// When unset or empty: `OPENAI_BASE_URL`, else `https://api.openai.com/v1`.
    pub base_url: String,
    /// API key sent as `Authorization: Bearer …`. When empty, `OPENAI_API_KEY` is used;
    /// when both are empty no `Authorization` header is sent (local servers, the simulator).
    pub api_key: Secret,
    /// Model for reflector calls (one per trace). Default `gpt-4o-mini`.
    pub reflector_model: String,
    /// Model for aggregator calls (group updates, merges). Default `gpt-4o-mini`.
    pub aggregator_model: String,
    /// Model that answers a regression gate's cases in the agent's place (the version under test is
    /// its system prompt); empty (the default) = `aggregator_model`.
    pub gate_model: String,
    /// Sampling temperature sent with every call. Default 0.2.
    pub temperature: f32,
    /// Most completion tokens of any call: the ceiling over the per-role limits below. Default 4096.
    pub max_tokens: u32,
    /// Most completion tokens of a reflector call: a reflection is four short fields and a few
    /// bullet tags. Default 1024.
    pub reflector_max_tokens: u32,
    /// Most completion tokens of an aggregator call (a group's operations, a rewritten
    /// instruction, a merge). Default 2048.
    pub aggregator_max_tokens: u32,
    /// The model's context window in tokens; 0 (the default) = unknown: combee learns it from
    /// the backend's first "context length exceeded" answer and fits later calls into it.
    pub context_tokens: u32,
    /// The least time one HTTP attempt gets, in seconds (fractions allowed), connection
    /// included. An attempt gets longer where the backend's observed speed says it needs it
    /// (the tokens it asks for, the calls in flight ahead of it); a timed-out attempt's retry
    /// gets twice as long. Waiting for a free slot inside combee is not part of it. Default 120.
    pub request_timeout_secs: f64,
    /// Timeout of establishing the TCP/TLS connection of one attempt, in seconds. Default 10.
    pub connect_timeout_secs: f64,
    /// Retries after the first attempt on 429, 5xx, timeouts and connection errors. Default 5.
    pub max_retries: u32,
    /// Backoff before retry i is a uniform random delay in [0, min(backoff_max_ms, backoff_base_ms·2^i)]
    /// ("full jitter"). Default 500.
    pub backoff_base_ms: u64,
    /// Upper bound of any backoff, including a server's `Retry-After`. Default 30000.
    pub backoff_max_ms: u64,
    /// Client-side limit of requests per minute across all calls of this process; 0 = unlimited. Default 0.
    pub requests_per_minute: u32,
    /// Client-side limit of tokens per minute (estimated as characters/4 before a call, settled
    /// with the real usage after it); 0 = unlimited. Default 0.
    pub tokens_per_minute: u64,
    /// Most LLM requests in flight at once across the whole process: the ceiling of the
    /// adaptive limit, which starts at 2 and grows while the backend's latency holds (a
    /// one-slot local server settles near one or two, a cloud API at dozens). Default 64.
    pub max_concurrency: usize,
    /// Price in USD per million prompt tokens, for cost accounting. Default 0 (unknown).
    pub price_prompt_per_million: f64,
    /// Price in USD per million completion tokens, for cost accounting. Default 0 (unknown).
    pub price_completion_per_million: f64,
    /// Prices of particular models (`[llm.prices."model-name"]`), by the model a call asks
    /// for; a model not named here is priced with `price_prompt_per_million` /
    /// `price_completion_per_million`.
    pub prices: std::collections::BTreeMap<String, ModelPrice>,
}

/// One model's prices, USD per million tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPrice {
    pub prompt_per_million: f64,
    pub completion_per_million: f64,
}

pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

impl Default for LlmConfig {
    fn default() -> Self {
        Self {
            base_url: String::new(),
            api_key: Secret::default(),
            reflector_model: "gpt-4o-mini".to_owned(),
            aggregator_model: "gpt-4o-mini".to_owned(),
            gate_model: String::new(),
            temperature: 0.2,
            max_tokens: 4096,
            reflector_max_tokens: 1024,
            aggregator_max_tokens: 2048,
            context_tokens: 0,
            request_timeout_secs: 120.0,
            connect_timeout_secs: 10.0,
            max_retries: 5,
            backoff_base_ms: 500,
            backoff_max_ms: 30_000,
            requests_per_minute: 0,
            tokens_per_minute: 0,
            max_concurrency: 64,
            price_prompt_per_million: 0.0,
            price_completion_per_million: 0.0,
            prices: Default::default(),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid [llm] setting `{field}`: {reason}")]
pub struct LlmConfigError {
    pub field: &'static str,
    pub reason: &'static str,
}

impl LlmConfig {
    /// Fills an empty `api_key` from `OPENAI_API_KEY` and an empty `base_url` from
    /// `OPENAI_BASE_URL` (falling back to the OpenAI URL).
    pub fn with_env_fallbacks(self) -> Self {
        self.with_fallbacks(|name| std::env::var(name).ok())
    }

    /// [`LlmConfig::with_env_fallbacks`] with the environment passed in, for tests.
    pub fn with_fallbacks(mut self, env: impl Fn(&str) -> Option<String>) -> Self {
        if self.api_key.is_empty()
            && let Some(key) = env("OPENAI_API_KEY").filter(|k| !k.trim().is_empty())
        {
            self.api_key = Secret::new(key.trim());
        }
        if self.base_url.trim().is_empty() {
            self.base_url =
                env("OPENAI_BASE_URL").filter(|u| !u.trim().is_empty()).unwrap_or_else(|| DEFAULT_BASE_URL.to_owned());
        }
        self.base_url = self.base_url.trim().trim_end_matches('/').to_owned();
        self
    }

    /// Rejects settings that would make every call fail or hang.
    pub fn validate(&self) -> Result<(), LlmConfigError> {
        let err = |field, reason| Err(LlmConfigError { field, reason });
        if !(self.base_url.starts_with("http://") || self.base_url.starts_with("https://")) {
            return err("base_url", "must start with http:// or https://");
        }
        if self.reflector_model.trim().is_empty() {
            return err("reflector_model", "must not be empty");
        }
        if self.aggregator_model.trim().is_empty() {
            return err("aggregator_model", "must not be empty");
        }
        if !(self.request_timeout_secs.is_finite() && self.request_timeout_secs > 0.0) {
            return err("request_timeout_secs", "must be a positive number");
        }
        if !(self.connect_timeout_secs.is_finite() && self.connect_timeout_secs > 0.0) {
            return err("connect_timeout_secs", "must be a positive number");
        }
        if !(self.temperature.is_finite() && (0.0..=2.0).contains(&self.temperature)) {
            return err("temperature", "must be between 0 and 2");
        }
        if self.max_concurrency == 0 {
            return err("max_concurrency", "must be at least 1");
        }
        if self.max_tokens == 0 {
            return err("max_tokens", "must be at least 1");
        }
        if self.reflector_max_tokens == 0 {
            return err("reflector_max_tokens", "must be at least 1");
        }
        if self.aggregator_max_tokens == 0 {
            return err("aggregator_max_tokens", "must be at least 1");
        }
        if self.context_tokens != 0 && self.context_tokens < 512 {
            return err("context_tokens", "must be 0 (learn it) or at least 512");
        }
        if self.backoff_max_ms < self.backoff_base_ms {
            return err("backoff_max_ms", "must be at least backoff_base_ms");
        }
        for (field, price) in [
            ("price_prompt_per_million", self.price_prompt_per_million),
            ("price_completion_per_million", self.price_completion_per_million),
        ] {
            if !(price.is_finite() && price >= 0.0) {
                return err(field, "must be a non-negative number");
            }
        }
        for p in self.prices.values() {
            if ![p.prompt_per_million, p.completion_per_million].iter().all(|x| x.is_finite() && *x >= 0.0) {
                return err("prices", "every model's prices must be non-negative numbers");
            }
        }
        Ok(())
    }

    /// A request for `role` with the configured model, temperature and token limit.
    pub fn request(&self, role: super::LlmRole, messages: Vec<super::ChatMessage>, json: bool) -> super::ChatRequest {
        let model = match role {
            super::LlmRole::Reflector => &self.reflector_model,
            super::LlmRole::Aggregator | super::LlmRole::Judge => &self.aggregator_model,
            super::LlmRole::Gate if !self.gate_model.trim().is_empty() => &self.gate_model,
            super::LlmRole::Gate => &self.aggregator_model,
        };
        super::ChatRequest {
            role,
            model: model.clone(),
            messages,
            temperature: Some(self.temperature),
            max_tokens: Some(self.max_tokens_for(role)),
            json,
            schema: None,
            tag: super::meter::CallTag::default(),
        }
    }

    /// The completion-token limit of a call of `role`.
    pub fn max_tokens_for(&self, role: super::LlmRole) -> u32 {
        let per_role = match role {
            super::LlmRole::Reflector => self.reflector_max_tokens,
            super::LlmRole::Aggregator | super::LlmRole::Gate | super::LlmRole::Judge => self.aggregator_max_tokens,
        };
        per_role.min(self.max_tokens)
    }

    /// The prices of `model`: its own `[llm.prices."model"]`, else the default prices.
    pub fn price_of(&self, model: &str) -> ModelPrice {
        self.prices.get(model).copied().unwrap_or(ModelPrice {
            prompt_per_million: self.price_prompt_per_million,
            completion_per_million: self.price_completion_per_million,
        })
    }

    /// Cost in USD of `usage` by `model`.
    pub fn cost_usd(&self, model: &str, usage: super::Usage) -> f64 {
        let p = self.price_of(model);
        (usage.prompt_tokens as f64 * p.prompt_per_million + usage.completion_tokens as f64 * p.completion_per_million)
            / 1_000_000.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_unknown_fields() {
        let c: LlmConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(c, LlmConfig::default());
        assert_eq!(c.max_concurrency, 64);
        let c = c.with_fallbacks(|_| None);
        assert_eq!(c.base_url, DEFAULT_BASE_URL);
        assert!(c.validate().is_ok());
        assert!(serde_json::from_str::<LlmConfig>(r#"{"max_retry": 3}"#).is_err());
        let c: LlmConfig = serde_json::from_str(r#"{"request_timeout_secs": 2}"#).unwrap();
        assert_eq!(c.request_timeout_secs, 2.0);
    }

    #[test]
    fn a_model_of_its_own_price_costs_that_and_others_the_default() {
        let c: LlmConfig = serde_json::from_str(
            r#"{"price_prompt_per_million": 1.0, "price_completion_per_million": 2.0,
                "prices": {"big-model": {"prompt_per_million": 10.0, "completion_per_million": 30.0}}}"#,
        )
        .unwrap();
        let usage = super::super::Usage { prompt_tokens: 1_000_000, completion_tokens: 500_000 };
        assert!((c.cost_usd("big-model", usage) - 25.0).abs() < 1e-9);
        assert!((c.cost_usd("small-model", usage) - 2.0).abs() < 1e-9);
        let bad = LlmConfig {
            prices: [("m".to_owned(), ModelPrice { prompt_per_million: -1.0, completion_per_million: 0.0 })].into(),
            ..LlmConfig::default().with_fallbacks(|_| None)
        };
        assert_eq!(bad.validate().unwrap_err().field, "prices");
    }

    #[test]
    fn secret_never_prints() {
        let c: LlmConfig = serde_json::from_str(r#"{"api_key": "sk-very-secret"}"#).unwrap();
        assert_eq!(c.api_key.expose(), "sk-very-secret");
        let shown = format!("{c:?} {}", c.api_key);
        assert!(!shown.contains("sk-very-secret"));
        assert!(shown.contains("[redacted]"));
    }

    #[test]
    fn env_fallbacks_fill_only_empty_fields() {
        let env = |k: &str| match k {
            "OPENAI_API_KEY" => Some("sk-env".to_owned()),
            "OPENAI_BASE_URL" => Some("http://localhost:8090/v1/".to_owned()),
            _ => None,
        };
        let c = LlmConfig::default().with_fallbacks(env);
        assert_eq!(c.api_key.expose(), "sk-env");
        assert_eq!(c.base_url, "http://localhost:8090/v1");
        let c =
            LlmConfig { api_key: Secret::new("sk-file"), base_url: "https://x.test/v1".into(), ..Default::default() }
                .with_fallbacks(env);
        assert_eq!(c.api_key.expose(), "sk-file");
        assert_eq!(c.base_url, "https://x.test/v1");
        let c = LlmConfig { base_url: String::new(), ..Default::default() }.with_fallbacks(|_| None);
        assert_eq!(c.base_url, DEFAULT_BASE_URL);
    }

    #[test]
    fn validation_names_the_field() {
        let ok = LlmConfig::default().with_fallbacks(|_| None);
        assert_eq!(LlmConfig::default().validate().unwrap_err().field, "base_url");
        let c = LlmConfig { max_concurrency: 0, ..ok.clone() };
        assert_eq!(c.validate().unwrap_err().field, "max_concurrency");
        let c = LlmConfig { request_timeout_secs: f64::NAN, ..ok };
        assert_eq!(c.validate().unwrap_err().field, "request_timeout_secs");
    }
}
