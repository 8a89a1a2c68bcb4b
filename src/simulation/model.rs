//! The SIMULATED model's knobs — its capacity model, latency, faults and answer
//! shapes — as one settings struct that is also the `combee sim-llm` command
//! line (see [`super::llm`] for what each models). Read by the server and by
//! the rules that write its answers.

use serde::{Deserialize, Serialize};

/// Which capacity model the simulated aggregator follows (see the module doc). [simulation]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum CapacityModel {
    /// Each of the m new insights a call must write is kept with probability E(m)/m,
    /// E(m) = K·(1 − e^(−m/K)).
    #[default]
    Soft,
    /// At most K new insights per distilling call, fewer beyond D items.
    Hard,
}

/// E(m) = K·(1 − e^(−m/K)): the expected number of new insights a call that must
/// write m of them keeps under the soft capacity model. [simulation]
pub fn expected_kept(k: usize, m: usize) -> f64 {
    if k == 0 {
        return 0.0;
    }
    let k = k as f64;
    k * (1.0 - (-(m as f64) / k).exp())
}

/// How the simulated model behaves. Every field is also a `combee sim-llm` flag.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    /// Seed of every deterministic choice (insight selection, faults). [simulation]
    #[arg(long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// Capacity model: `soft` (each of the m new insights a call must write is kept with
    /// probability E(m)/m, E(m) = K·(1 − e^(−m/K))) or `hard` (at most K per distilling
    /// call, see `digest_reflections`). [simulation]
    #[arg(long, value_enum, default_value_t = CapacityModel::Soft)]
    pub capacity_model: CapacityModel,
    /// K: soft model — the scale of E(m), about the most new insights one call keeps; hard
    /// model — most distinct new insights one distilling aggregator call keeps (a merge or
    /// consolidation keeps K per level-1 update it combines). [simulation]
    #[arg(long, default_value_t = 12)]
    pub capacity_k: usize,
    /// D (hard model only): input items (reflections, proposals, op lists) a call digests
    /// fully; above it a call's capacity shrinks by D/n. [simulation]
    #[arg(long, default_value_t = 12)]
    pub digest_reflections: usize,
    /// Fixed latency of every answer, in ms. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub fixed_ms: f64,
    /// Latency per prompt token, in ms. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub per_input_token_ms: f64,
    /// Latency per completion token, in ms. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub per_output_token_ms: f64,
    /// Share of requests answered 429 with `Retry-After` (0..=1). [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_429: f64,
    /// The delay a 429 asks for, in ms (sent as `retry-after-ms` and rounded up to whole
    /// seconds in `Retry-After`). [simulation]
    #[arg(long, default_value_t = 1000)]
    pub retry_after_ms: u64,
    /// Share of requests answered 500 or 503. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_5xx: f64,
    /// Share of requests whose answer is held back `hang_ms` longer (a timeout for most clients). [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_hang: f64,
    /// How long a hanging answer is held back, in ms. [simulation]
    #[arg(long, default_value_t = 30_000)]
    pub hang_ms: u64,
    /// Share of requests answered with malformed JSON content. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_malformed: f64,
    /// Answer shapes real models produce, each drawn independently per request
    /// (0..=1; several can apply to one answer). Share of answers wrapped in a
    /// ```` ```json ```` code fence. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_fence: f64,
    /// Share of answers with prose before and after the JSON. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_preamble: f64,
    /// Share of answers carrying keys the format does not have (top level and per item). [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_extra_keys: f64,
    /// Share of answers preceded by a `<think>…</think>` block (which itself holds a JSON draft). [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_think: f64,
    /// Share of answers citing ids that do not exist: a bullet tag or an UPDATE of
    /// bullet `b-9999`, and a source number past the group. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_unknown_ids: f64,
    /// Share of aggregate-playbook answers whose operations carry no `sources` at all
    /// (many small and local models ignore the instruction to cite), drawn per request
    /// from its content, so a corrective retry draws the same. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_no_sources: f64,
    /// Share of aggregate-playbook answers whose `sources` cite the wrong reflections
    /// (each points at another reflection of the group), drawn like `rate_no_sources`. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_wrong_sources: f64,
    /// Share of level-2 answers that cannot be read: a consolidation answered in the
    /// older operations shape, a passage merge answered in prose. Drawn per request from
    /// its content, so the corrective retry fails the same way. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_unreadable_level2: f64,
    /// Share of level-1 answers (aggregate-playbook, aggregate-rewrite) that cannot
    /// be read: prose instead of the JSON object, as a small model writes when the
    /// reflections of a group overwhelm it. Drawn per request from its content, so
    /// the corrective retry fails the same way. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_unreadable_level1: f64,
    /// The simulated agent (any request that is not one of combee's own calls
    /// but has a system prompt, e.g. a regression gate's case) applies every
    /// `INSIGHT-` lesson of its system prompt and names it in its reply; this
    /// share of lessons it overlooks instead, drawn per lesson and conversation. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub agent_lapse_rate: f64,
    /// The simulated LLM judge's accuracy: the probability that its verdict on
    /// a reply is right (drawn per request from its content). Right means: the
    /// reply passes when, trimmed, it equals one of the double-quoted texts of
    /// the rubric (score 1, no critique), and fails otherwise (score 0, a
    /// critique naming what it should have been). [simulation]
    #[arg(long, default_value_t = 0.9)]
    pub judge_accuracy: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            capacity_model: CapacityModel::Soft,
            capacity_k: 12,
            digest_reflections: 12,
            fixed_ms: 0.0,
            per_input_token_ms: 0.0,
            per_output_token_ms: 0.0,
            rate_429: 0.0,
            retry_after_ms: 1000,
            rate_5xx: 0.0,
            rate_hang: 0.0,
            hang_ms: 30_000,
            rate_malformed: 0.0,
            rate_fence: 0.0,
            rate_preamble: 0.0,
            rate_extra_keys: 0.0,
            rate_think: 0.0,
            rate_unknown_ids: 0.0,
            rate_no_sources: 0.0,
            rate_wrong_sources: 0.0,
            rate_unreadable_level2: 0.0,
            rate_unreadable_level1: 0.0,
            agent_lapse_rate: 0.0,
            judge_accuracy: 0.9,
        }
    }
}
