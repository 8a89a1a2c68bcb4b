//! Layered settings: defaults in code → `config/default.toml` → optional
//! `config/<COMBEE_ENV>.toml` → `COMBEE__SECTION__KEY` env vars; `DATABASE_URL`
//! picks the store. Secrets are wrapped so they never print.

use std::{net::SocketAddr, path::PathBuf};

use figment::{
    Figment,
    providers::{Env, Format, Serialized, Toml},
};
use serde::{Deserialize, Serialize};

use crate::secret::Secret;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub server: ServerSettings,
    pub database: DatabaseSettings,
    pub limits: LimitSettings,
    pub log: LogSettings,
    pub cache: CacheSettings,
    pub worker: WorkerSettings,
    /// The dynamic batch-size controller for prompts with `batch_size = "auto"`.
    pub controller: crate::learn::capacity::batch_size::ControllerConfig,
    pub webhooks: WebhookSettings,
    /// The regression guard (see `worker::guard`).
    #[serde(default)]
    pub guard: GuardSettings,
    /// The population of prompts under the `evaluated` policy (see `worker::rater`).
    #[serde(default)]
    pub population: PopulationSettings,
    /// What is deleted when (see `worker::retention`).
    #[serde(default)]
    pub retention: RetentionSettings,
    /// Caps on what combee's own LLM calls spend, for the whole server (see `service::budget`).
    #[serde(default)]
    pub budget: BudgetSettings,
    /// Regression sets and the gate a learned version passes before live traffic (see `worker::gate`).
    #[serde(default)]
    pub regression: RegressionSettings,
    /// How people sign in to the web UI: API keys and single sign-on (see `src/oidc/config.rs`).
    #[serde(default)]
    pub auth: crate::oidc::config::AuthSettings,
    /// The OpenAI-compatible backend for learning rounds (see `src/llm/config.rs`).
    #[serde(default, skip_serializing)]
    pub llm: crate::llm::config::LlmConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSettings {
    /// How often the worker looks for due prompts (it schedules no more often
    /// than this, however often changes wake it) and, when idle, for
    /// claimable rounds (ms).
    pub poll_interval_ms: u64,
    /// A claimed round's lease; another process takes the round over when it expires.
    pub lease_secs: u64,
    /// How often a running round renews its lease.
    pub heartbeat_secs: u64,
    /// Rounds one process runs at once (for different prompts).
    pub max_parallel_rounds: usize,
    /// Smallest round a `max_wait` trigger starts.
    pub min_batch: u32,
    /// Start a smaller round when the oldest pending trace waited this long (seconds).
    pub max_wait_secs: u64,
    /// Claims of one round (crashes and retryable failures) before it gives up.
    pub max_round_attempts: i32,
    /// Failed rounds a trace may be part of before it is marked `failed`.
    pub max_trace_attempts: i32,
    /// Delay before a round that failed retryably is tried again (seconds).
    pub retry_delay_secs: u64,
    /// After a prompt's round fails, no round is scheduled for it for this long
    /// (seconds), doubling with each further failure in a row; a success or an
    /// operator's trigger or clear resets it.
    #[serde(default = "default_failure_backoff_secs")]
    pub failure_backoff_secs: u64,
    /// The longest that backoff grows (seconds).
    #[serde(default = "default_failure_backoff_max_secs")]
    pub failure_backoff_max_secs: u64,
    /// Learned content adding a line that contains one of these (case-insensitive)
    /// is not published; the round fails and says which entry matched.
    #[serde(default)]
    pub denylist_substrings: Vec<String>,
    /// The same with regular expressions (Rust `regex` syntax, case-insensitive).
    #[serde(default)]
    pub denylist_patterns: Vec<String>,
    /// A prompt with evaluators: its rounds leave out pending traces the
    /// evaluators have not judged yet, up to this many seconds after they
    /// arrived (a broken judge delays learning, never stops it).
    #[serde(default = "default_judge_wait_secs")]
    pub judge_wait_secs: u64,
}

fn default_judge_wait_secs() -> u64 {
    60
}

fn default_failure_backoff_secs() -> u64 {
    60
}

fn default_failure_backoff_max_secs() -> u64 {
    3600
}

impl WorkerSettings {
    /// The failing prompts' backoff policy.
    pub fn failure_backoff(&self) -> crate::domain::backoff::FailureBackoff {
        crate::domain::backoff::FailureBackoff {
            base_secs: self.failure_backoff_secs,
            max_secs: self.failure_backoff_max_secs,
        }
    }
}

/// The regression guard: rolls production back when its reward falls
/// significantly (see `evaluate::guard` for the test, `worker::guard` for the rules).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GuardSettings {
    /// Run the guard in worker processes (prompts opt out with `settings.regression_guard = false`).
    pub enabled: bool,
    /// How often the guard looks at every prompt (seconds).
    pub tick_secs: u64,
    /// Length of the current window, and of the windows it is compared with (seconds).
    pub window_secs: u64,
    /// Level of the one-sided test (a drop fires only when p < alpha).
    pub alpha: f64,
    /// Smallest drop that counts (success rate or mean score units).
    pub min_drop: f64,
    /// Traces with a reward each side needs before anything is judged.
    pub min_traces: u64,
}

impl Default for GuardSettings {
    fn default() -> Self {
        Self { enabled: true, tick_secs: 60, window_secs: 3600, alpha: 0.01, min_drop: 0.05, min_traces: 50 }
    }
}

/// The population of a prompt under the `evaluated` policy: how traffic is
/// split between the champion and its challengers, how often arms are rated,
/// and the promotion gate's evidence (see `worker::rater`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PopulationSettings {
    /// Rate arms and run the gate in worker processes (`all` and `worker` roles).
    pub enabled: bool,
    /// How often the rater looks at every `evaluated` prompt (seconds).
    pub tick_secs: u64,
    /// Longest rating window (seconds): arms are ranked once per window.
    pub window_secs: u64,
    /// Shortest rating window (seconds): a window closes this early once the
    /// champion and the leading challenger each have `min_window_traces`
    /// (above `window_secs` it means `window_secs`).
    pub min_window_secs: u64,
    /// Share of traffic all challengers together receive.
    pub explore_share: f64,
    /// Share every challenger receives at least (so the newest child is measured).
    pub min_arm_share: f64,
    /// Scored traces the champion and a challenger each need before the gate may promote.
    pub min_traces: u64,
    /// Most challengers beside the champion; the weakest is retired to make room.
    pub max_arms: usize,
    /// Scored traces an arm needs in a window to be ranked in it.
    pub min_window_traces: u64,
    /// Chance, per rated window, of a crossover when at least two arms each
    /// won some task keys (one LLM call; needs a configured LLM). The draw is
    /// seeded by the prompt and the window, so 0 never and 1 always crosses.
    pub crossover_prob: f64,
    /// TrueSkill points by which a challenger's μ−2σ must exceed the champion's
    /// before the gate moves production.
    pub margin: f64,
    /// Rating windows production stays after it last moved before the gate may move it again.
    pub cooldown_windows: u64,
}

impl Default for PopulationSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            tick_secs: 10,
            window_secs: 600,
            min_window_secs: 60,
            explore_share: 0.2,
            min_arm_share: 0.02,
            min_traces: 50,
            max_arms: 4,
            min_window_traces: 10,
            crossover_prob: 0.2,
            margin: crate::evaluate::population::DEFAULT_MARGIN,
            cooldown_windows: crate::evaluate::population::DEFAULT_COOLDOWN_WINDOWS,
        }
    }
}

impl PopulationSettings {
    pub fn policy(&self) -> crate::evaluate::population::PopulationPolicy {
        crate::evaluate::population::PopulationPolicy {
            explore_share: self.explore_share,
            min_arm_share: self.min_arm_share,
            min_traces: self.min_traces,
            max_arms: self.max_arms,
            margin: self.margin,
            cooldown_windows: self.cooldown_windows,
            crossover_prob: self.crossover_prob,
            window_secs: self.window_secs,
            min_window_secs: self.min_window_secs,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSettings {
    /// `whsec_…` secrets accepted for inbound round triggers (several allow rotation).
    /// Empty: `POST /v1/hooks/rounds/{name}` answers 404.
    pub inbound_secrets: Vec<Secret>,
    /// Largest accepted distance between `webhook-timestamp` and now (seconds).
    pub tolerance_secs: i64,
    /// Allow outbound subscriptions and deliveries to loopback, private,
    /// link-local and other non-public addresses (off: such targets are refused).
    pub allow_private_targets: bool,
    /// Delays between delivery attempts (seconds); the last one repeats. Each
    /// gets ±10 % jitter; a `Retry-After` answer overrides it.
    pub retry_schedule_secs: Vec<u64>,
    /// Attempts of one delivery (the first included) before it is marked failed.
    pub max_attempts: u32,
    /// Time limit of one delivery attempt (connect, send, answer).
    pub request_timeout_secs: u64,
    /// How often an idle delivery worker looks for due deliveries (ms); new
    /// events wake it at once.
    pub poll_interval_ms: u64,
    /// Deliveries one process sends at once.
    pub max_concurrency: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ProcessRole {
    /// HTTP API and background worker in one process.
    All,
    /// Only the HTTP API.
    Api,
    /// Only the background worker.
    Worker,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    /// Address the HTTP API listens on (`serve --bind` overrides it).
    pub bind: SocketAddr,
    /// Which parts run in this process (`serve --role` overrides it).
    pub role: ProcessRole,
    /// Longest time a request may take before it is answered with 503.
    pub request_timeout_secs: u64,
    /// Longest time in-flight requests get to finish after SIGTERM/SIGINT.
    pub shutdown_grace_secs: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseSettings {
    /// `postgres://…` for Postgres; `sqlite://PATH` or empty for the embedded
    /// SQLite store at `<data_dir>/combee.db`. `DATABASE_URL` sets it too.
    pub url: Secret,
    /// Where the embedded store and the first admin key file live.
    pub data_dir: PathBuf,
    /// Connection pool size (Postgres; SQLite uses this many readers and one writer).
    pub max_connections: u32,
    /// How long a request waits for a free connection before failing with 503.
    pub acquire_timeout_secs: u64,
    /// What `url` reaches: Postgres itself (`none`) or a pooler in transaction
    /// mode (`transaction`, e.g. PgBouncer's `pool_mode = transaction`); see
    /// `store::postgres::Route`.
    #[serde(default)]
    pub pooler: Pooler,
    /// Postgres itself, bypassing the pooler, for the statements that need a
    /// session of their own (LISTEN, the migrations' advisory locks). Needed
    /// with `pooler = "transaction"`; empty: `url`.
    #[serde(default)]
    pub direct_url: Secret,
}

/// What stands between combee and Postgres at `database.url`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooler {
    /// Nothing (or a pooler in session mode): a connection is a session.
    #[default]
    None,
    /// A pooler in transaction mode: a server connection is lent per transaction.
    Transaction,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSettings {
    /// Largest request body, in bytes (413 above it).
    pub max_body_bytes: usize,
    /// Most traces in one `POST /v1/traces` batch (413 above it).
    pub max_traces_per_batch: usize,
    /// Largest single trace, as JSON, in bytes (413 above it).
    pub max_trace_bytes: usize,
    /// Largest single string inside a trace, in bytes (413 above it).
    pub max_field_bytes: usize,
    /// Largest base text of a prompt version, in bytes (413 above it).
    pub max_prompt_bytes: usize,
    /// Largest page a list endpoint returns (`page_size` is clamped to it).
    pub max_page_size: u32,
    /// How long an `Idempotency-Key` is remembered, and how long OTLP spans
    /// that do not map yet are held for the rest of their trace, in hours.
    pub idempotency_ttl_hours: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogSettings {
    /// `text` for people, `json` for log shippers.
    pub format: LogFormat,
    /// A `tracing` filter, e.g. `info` or `combee=debug,tower_http=info`. `RUST_LOG` wins when set.
    pub level: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSettings {
    /// Upper bound on how long a cached prompt is served without re-reading the
    /// store, in seconds; changes invalidate it at once (across processes on Postgres).
    pub max_age_secs: u64,
    /// Most prompts whose answers (and served arms) are kept in memory; past
    /// it the least recently used go.
    #[serde(default = "default_cache_max_prompts")]
    pub max_prompts: usize,
    /// Most verified API keys kept in memory; past it the least recently used go.
    #[serde(default = "default_cache_max_keys")]
    pub max_keys: usize,
}

fn default_cache_max_prompts() -> usize {
    10_000
}

fn default_cache_max_keys() -> usize {
    10_000
}

/// Data retention, run by worker processes: what is deleted (or compacted)
/// after how many days, in batches of `batch_size` rows, each its own short
/// transaction, every `interval_secs`. Per-prompt overrides of the trace
/// retention live in the prompt's settings (`settings.retention`). The label
/// history is never deleted; outcome rollups (per-version metrics) outlive
/// the traces they count.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionSettings {
    /// Delete anything at all (false: keep everything forever).
    pub enabled: bool,
    /// Consumed traces (learned from), with their OTLP spans and reflections, after this many days.
    pub consumed_days: u32,
    /// Failed traces (attempts used up) after this many days.
    pub failed_days: u32,
    /// Quarantined traces after this many days in quarantine.
    pub quarantined_days: u32,
    /// Finished rounds' group outputs and per-call LLM records after this many
    /// days; the round and its usage totals stay.
    pub round_detail_days: u32,
    /// Outbound webhook events with their deliveries and delivery log after this many days.
    pub events_days: u32,
    /// Audit log entries after this many days; 0 (the default) keeps them forever.
    pub audit_days: u32,
    /// Rows per batch (one transaction each).
    pub batch_size: u32,
    /// Pause between two batches, so deletion never crowds out live traffic (milliseconds).
    pub batch_pause_ms: u64,
    /// How often a pass runs (seconds).
    pub interval_secs: u64,
    /// When set, consumed traces are appended to gzip-compressed JSON Lines
    /// files under this directory (`<prompt>/<YYYY-MM-DD>.jsonl.gz`, by the
    /// day the trace was created) before they are deleted. Empty: no archive.
    pub archive_dir: String,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            consumed_days: 30,
            failed_days: 30,
            quarantined_days: 90,
            round_detail_days: 30,
            events_days: 30,
            audit_days: 0,
            batch_size: 500,
            batch_pause_ms: 20,
            interval_secs: 300,
            archive_dir: String::new(),
        }
    }
}

/// The server's learning budget: caps on the tokens and US dollars combee's
/// own LLM calls (reflection, aggregation, crossover, …) spend, over all
/// prompts per UTC day, and per round (every pass of it together); a prompt's own caps
/// (`PATCH /v1/prompts/{name}/settings`, `budget`) hold beside them. Unset
/// caps do not hold. Dollars come from `llm.price_*` and `[llm.prices."model"]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BudgetSettings {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_day: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usd_per_day: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_round: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usd_per_round: Option<f64>,
    /// How often a round waiting for the budget looks again (seconds): it
    /// makes no LLM call while a cap still holds, and is due at once when a
    /// prompt's cap is raised.
    pub recheck_secs: u64,
}

impl Default for BudgetSettings {
    fn default() -> Self {
        Self { tokens_per_day: None, usd_per_day: None, tokens_per_round: None, usd_per_round: None, recheck_secs: 60 }
    }
}

impl BudgetSettings {
    pub fn caps(&self) -> crate::domain::budget::BudgetCaps {
        crate::domain::budget::BudgetCaps {
            tokens_per_day: self.tokens_per_day,
            usd_per_day: self.usd_per_day,
            tokens_per_round: self.tokens_per_round,
            usd_per_round: self.usd_per_round,
        }
    }
}

/// Regression sets and their gate: how far below production's mean score a
/// version may fall, how long an operator's harness is awaited, and the
/// limits on a set (see `domain::regression`, `worker::gate`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegressionSettings {
    /// A version whose mean case score is below production's by more than this is rejected (0–1).
    pub margin: f64,
    /// How long a gate in `harness` mode waits for the harness's result before rejecting (seconds).
    pub harness_timeout_secs: u64,
    /// Most cases in one prompt's set.
    pub max_cases: usize,
    /// Largest case input, as JSON, in bytes.
    pub max_case_input_bytes: usize,
    /// Cases of one gate run at once (each one LLM call per version).
    pub concurrency: usize,
}

impl Default for RegressionSettings {
    fn default() -> Self {
        Self {
            margin: 0.05,
            harness_timeout_secs: 3600,
            max_cases: 200,
            max_case_input_bytes: 32 * 1024,
            concurrency: 4,
        }
    }
}

/// Longest retention a setting may name, in days (100 years).
pub const MAX_RETENTION_DAYS: u32 = 36_500;

impl Default for Settings {
    fn default() -> Self {
        Self {
            server: ServerSettings {
                bind: SocketAddr::from(([127, 0, 0, 1], 8080)),
                role: ProcessRole::All,
                request_timeout_secs: 30,
                shutdown_grace_secs: 30,
            },
            database: DatabaseSettings {
                url: Secret::default(),
                data_dir: PathBuf::from("data"),
                max_connections: 16,
                acquire_timeout_secs: 5,
                pooler: Pooler::None,
                direct_url: Secret::default(),
            },
            limits: LimitSettings {
                max_body_bytes: 8 * 1024 * 1024,
                max_traces_per_batch: 500,
                max_trace_bytes: 256 * 1024,
                max_field_bytes: 64 * 1024,
                max_prompt_bytes: 256 * 1024,
                max_page_size: 200,
                idempotency_ttl_hours: 24,
            },
            log: LogSettings { format: LogFormat::Text, level: "info".into() },
            cache: CacheSettings {
                max_age_secs: 60,
                max_prompts: default_cache_max_prompts(),
                max_keys: default_cache_max_keys(),
            },
            worker: WorkerSettings {
                poll_interval_ms: 1000,
                lease_secs: 30,
                heartbeat_secs: 10,
                max_parallel_rounds: 4,
                min_batch: 1,
                max_wait_secs: 600,
                max_round_attempts: 3,
                max_trace_attempts: 3,
                retry_delay_secs: 5,
                failure_backoff_secs: default_failure_backoff_secs(),
                failure_backoff_max_secs: default_failure_backoff_max_secs(),
                denylist_substrings: Vec::new(),
                denylist_patterns: Vec::new(),
                judge_wait_secs: default_judge_wait_secs(),
            },
            controller: Default::default(),
            webhooks: WebhookSettings {
                inbound_secrets: Vec::new(),
                tolerance_secs: 300,
                allow_private_targets: false,
                retry_schedule_secs: vec![5, 300, 1800, 7200, 18000, 36000],
                max_attempts: 8,
                request_timeout_secs: 15,
                poll_interval_ms: 1000,
                max_concurrency: 16,
            },
            guard: GuardSettings::default(),
            population: PopulationSettings::default(),
            retention: RetentionSettings::default(),
            budget: BudgetSettings::default(),
            regression: RegressionSettings::default(),
            auth: Default::default(),
            llm: Default::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(String);

impl Settings {
    /// Loads the layers from `config_dir` and the process environment.
    pub fn load(config_dir: &std::path::Path) -> Result<Self, ConfigError> {
        let mut fig =
            Figment::from(Serialized::defaults(Settings::default())).merge(Toml::file(config_dir.join("default.toml")));
        if let Ok(env) = std::env::var("COMBEE_ENV")
            && !env.is_empty()
        {
            fig = fig.merge(Toml::file(config_dir.join(format!("{env}.toml"))));
        }
        fig = fig.merge(Env::prefixed("COMBEE__").split("__"));
        if let Ok(url) = std::env::var("DATABASE_URL")
            && !url.is_empty()
        {
            fig = fig.merge(Serialized::default("database.url", url));
        }
        // figment's messages name keys and files, never values, so no secret leaks here.
        let mut s: Settings = fig.extract().map_err(|e| ConfigError(e.to_string()))?;
        s.llm = s.llm.with_env_fallbacks();
        s.check()?;
        Ok(s)
    }

    fn check(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        let positive = [
            ("limits.max_body_bytes", l.max_body_bytes),
            ("limits.max_traces_per_batch", l.max_traces_per_batch),
            ("limits.max_trace_bytes", l.max_trace_bytes),
            ("limits.max_field_bytes", l.max_field_bytes),
            ("limits.max_prompt_bytes", l.max_prompt_bytes),
            ("limits.max_page_size", l.max_page_size as usize),
            ("database.max_connections", self.database.max_connections as usize),
        ];
        if let Some((k, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError(format!("{k} must be greater than 0")));
        }
        let r = &self.retention;
        let days = [
            ("retention.consumed_days", r.consumed_days),
            ("retention.failed_days", r.failed_days),
            ("retention.quarantined_days", r.quarantined_days),
            ("retention.round_detail_days", r.round_detail_days),
            ("retention.events_days", r.events_days),
        ];
        if let Some((k, _)) = days.iter().find(|(_, d)| !(1..=MAX_RETENTION_DAYS).contains(d)) {
            return Err(ConfigError(format!("{k} must be from 1 to {MAX_RETENTION_DAYS}")));
        }
        if r.audit_days > MAX_RETENTION_DAYS {
            return Err(ConfigError(format!(
                "retention.audit_days must be from 0 (keep forever) to {MAX_RETENTION_DAYS}"
            )));
        }
        if r.batch_size == 0 || r.interval_secs == 0 {
            return Err(ConfigError("retention.batch_size and retention.interval_secs must be greater than 0".into()));
        }
        if self.cache.max_prompts == 0 || self.cache.max_keys == 0 {
            return Err(ConfigError("cache.max_prompts and cache.max_keys must be greater than 0".into()));
        }
        let w = &self.worker;
        if w.lease_secs == 0 || w.heartbeat_secs == 0 || w.heartbeat_secs * 2 > w.lease_secs {
            return Err(ConfigError("worker.heartbeat_secs must be > 0 and at most half of worker.lease_secs".into()));
        }
        if w.min_batch == 0 || w.max_parallel_rounds == 0 {
            return Err(ConfigError("worker.min_batch and worker.max_parallel_rounds must be greater than 0".into()));
        }
        if w.max_round_attempts < 1 || w.max_trace_attempts < 1 {
            return Err(ConfigError("worker.max_round_attempts and max_trace_attempts must be at least 1".into()));
        }
        if w.failure_backoff_max_secs < w.failure_backoff_secs {
            return Err(ConfigError(
                "worker.failure_backoff_max_secs must be at least worker.failure_backoff_secs".into(),
            ));
        }
        crate::learn::denylist::ContentDenylist::new(&w.denylist_substrings, &w.denylist_patterns)
            .map_err(|e| ConfigError(e.to_string()))?;
        for s in &self.webhooks.inbound_secrets {
            if crate::webhooks::decode_secret(s).is_none() {
                return Err(ConfigError("webhooks.inbound_secrets must be `whsec_<base64>` values".into()));
            }
        }
        let h = &self.webhooks;
        if h.retry_schedule_secs.is_empty() || h.max_attempts == 0 {
            return Err(ConfigError(
                "webhooks.retry_schedule_secs must not be empty and max_attempts must be > 0".into(),
            ));
        }
        if h.request_timeout_secs == 0 || h.poll_interval_ms == 0 || h.max_concurrency == 0 {
            return Err(ConfigError(
                "webhooks.request_timeout_secs, poll_interval_ms and max_concurrency must be greater than 0".into(),
            ));
        }
        let r = &self.regression;
        if !(0.0..=1.0).contains(&r.margin) || r.harness_timeout_secs == 0 || r.max_cases == 0 || r.concurrency == 0 {
            return Err(ConfigError(
                "regression.margin must be in [0, 1]; harness_timeout_secs, max_cases and concurrency greater than 0"
                    .into(),
            ));
        }
        let g = &self.guard;
        if g.tick_secs == 0 || g.window_secs == 0 || g.min_traces == 0 {
            return Err(ConfigError("guard.tick_secs, window_secs and min_traces must be greater than 0".into()));
        }
        if !(g.alpha > 0.0 && g.alpha < 0.5 && (0.0..=1.0e12).contains(&g.min_drop)) {
            return Err(ConfigError("guard.alpha must be in (0, 0.5) and guard.min_drop at least 0".into()));
        }
        let p = &self.population;
        if p.tick_secs == 0 || p.window_secs == 0 || p.min_traces == 0 || p.min_window_traces == 0 {
            return Err(ConfigError(
                "population.tick_secs, window_secs, min_traces and min_window_traces must be greater than 0".into(),
            ));
        }
        // Above window_secs it means window_secs (no window closes early): a
        // deployment that shortened window_secs alone keeps starting.
        if p.min_window_secs == 0 {
            return Err(ConfigError("population.min_window_secs must be greater than 0".into()));
        }
        p.policy().validate().map_err(|e| ConfigError(format!("population: {e}")))?;
        if !(0.0..=1.0).contains(&p.crossover_prob) {
            return Err(ConfigError(format!("population.crossover_prob must be in [0, 1], got {}", p.crossover_prob)));
        }
        self.budget.caps().validate().map_err(ConfigError)?;
        if self.budget.recheck_secs == 0 {
            return Err(ConfigError("budget.recheck_secs must be greater than 0".into()));
        }
        self.check_database()?;
        self.auth.validate().map_err(ConfigError)?;
        self.llm.validate().map_err(|e| ConfigError(e.to_string()))?;
        self.controller.validate().map_err(|e| ConfigError(format!("controller: {e}")))?;
        Ok(())
    }

    /// A direct URL and a pooler only mean something for Postgres, and a
    /// transaction pooler needs the direct URL.
    fn check_database(&self) -> Result<(), ConfigError> {
        let d = &self.database;
        let postgres = crate::store::is_postgres(d.url.expose());
        let direct_ok = d.direct_url.is_empty() || (postgres && crate::store::is_postgres(d.direct_url.expose()));
        if !direct_ok {
            return Err(ConfigError(
                "database.direct_url is for Postgres: it and database.url must both start with postgres:// or postgresql://"
                    .into(),
            ));
        }
        if d.pooler == Pooler::Transaction && (!postgres || d.direct_url.is_empty()) {
            return Err(ConfigError(
                "database.pooler = \"transaction\" needs a Postgres database.url (the pooler) and database.direct_url \
                 (Postgres itself, for LISTEN and the migrations' advisory locks)"
                    .into(),
            ));
        }
        Ok(())
    }

    pub fn database_url(&self) -> String {
        let url = self.database.url.expose();
        if url.is_empty() {
            format!("sqlite://{}", self.database.data_dir.join("combee.db").display())
        } else {
            url.to_owned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_do_not_print() {
        let s = Secret::new("postgres://u:hunter2@h/db");
        assert_eq!(format!("{s:?}"), "[redacted]");
        let mut settings = Settings::default();
        settings.database.url = s;
        assert!(!format!("{settings:?}").contains("hunter2"));
    }

    #[test]
    fn empty_url_means_embedded_sqlite_in_data_dir() {
        let s = Settings::default();
        assert_eq!(s.database_url(), "sqlite://data/combee.db");
    }

    #[test]
    fn a_transaction_pooler_needs_postgres_on_both_urls() {
        let with = |url: &str, direct: &str, pooler: Pooler| {
            let mut s = Settings::default();
            s.database.url = Secret::new(url);
            s.database.direct_url = Secret::new(direct);
            s.database.pooler = pooler;
            s.check_database().map_err(|e| e.to_string())
        };
        let (bouncer, pg) = ("postgres://u@bouncer:6432/db", "postgresql://u@db:5432/db");
        assert_eq!(with(bouncer, pg, Pooler::Transaction), Ok(()));
        assert!(with(bouncer, pg, Pooler::None).is_ok(), "a direct URL alone is allowed");
        assert!(with(pg, "", Pooler::None).is_ok());
        let no_direct = with(bouncer, "", Pooler::Transaction).unwrap_err();
        assert!(no_direct.contains("database.direct_url"), "{no_direct}");
        assert!(with("", pg, Pooler::Transaction).unwrap_err().contains("database.direct_url"));
        assert!(with("sqlite://x.db", pg, Pooler::None).unwrap_err().contains("database.direct_url"));
        assert!(with(bouncer, "mysql://db/x", Pooler::Transaction).unwrap_err().contains("database.direct_url"));
    }
}
