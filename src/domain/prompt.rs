//! Prompts and their immutable versions.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use utoipa::ToSchema;
use uuid::Uuid;

use super::names::PromptName;
use super::playbook::{self, Playbook};
use super::population_settings::PopulationOverrides;

/// How a round turns reflections into a new version.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// ACE-style delta operations on a playbook (default).
    #[default]
    Playbook,
    /// GEPA-style whole-instruction proposals.
    Rewrite,
}

/// What happens to a learned version.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Promotion {
    /// Learned versions become `production` at once.
    Auto,
    /// Learned versions are labelled `candidate`; an operator promotes them.
    Manual,
    /// The default for new prompts: learned (and crossover) versions join the
    /// prompt's population as challengers, get a share of live traffic, and
    /// replace `production` only when the promotion gate's evidence says they
    /// are better (see `worker::rater`).
    #[default]
    Evaluated,
}

/// Per-prompt learning knobs. Stored as a document so later learning features
/// can add fields without a migration; unknown fields are kept out at the edge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PromptSettings {
    /// Every reflection is duplicated this many times before the shuffle (p).
    #[serde(default = "default_duplication")]
    pub duplication: u32,
    /// Traces per round: `"auto"` (default: the batch-size controller picks it
    /// from measured round times) or a fixed number.
    #[serde(default)]
    #[schema(value_type = Object, example = "auto")]
    pub batch_size: BatchSize,
    /// Start a smaller round once the oldest pending trace has waited this long
    /// (seconds); unset means the worker's `max_wait_secs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait_secs: Option<u64>,
    /// Playbook level-2 reduce: `union` (default, no LLM call) or `llm` (one consolidating call).
    #[serde(default)]
    #[schema(value_type = String)]
    pub reduce: ReduceMode,
    /// Playbook size budget: most bullets (oldest, least helpful dropped first);
    /// unset, a playbook prompt gets the default budget (100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bullets: Option<usize>,
    /// Playbook size budget: most characters of the rendered playbook; unset, a
    /// playbook prompt gets the default budget (12,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_chars: Option<usize>,
    /// Whether a `reflection` sent by an agent with its trace is used (`use`) or
    /// ignored so the reflector diagnoses the trace itself (`ignore`, the default
    /// for new prompts: an agent's own reflection is untrusted text that would
    /// otherwise go straight into learning).
    #[serde(default)]
    pub agent_reflections: AgentReflections,
    /// Playbook bullet ids an operator protected: learning never updates,
    /// removes or evicts them.
    #[serde(default)]
    #[schema(value_type = Vec<String>, max_items = 1000, example = json!(["b-0001"]))]
    pub pinned_bullets: Vec<String>,
    /// The largest share (0–1) of the playbook — the bullets it held before the
    /// round, proven helpful or not yet marked — that one round may remove or
    /// evict. Counters come from untrusted traces; this bounds what a burst of
    /// hostile traces can destroy in one round.
    #[serde(default = "default_max_removal_share")]
    #[schema(minimum = 0.0, maximum = 1.0, example = 0.25)]
    pub max_removal_share: f64,
    /// Whether the regression guard may roll this prompt's production back
    /// (default on: it acts only on significant evidence, see `[guard]`).
    #[serde(default = "default_regression_guard")]
    pub regression_guard: bool,
    /// This prompt's own trace retention, in days; unset members follow `[retention]`.
    #[serde(default, skip_serializing_if = "RetentionOverride::is_empty", deserialize_with = "retention_object")]
    pub retention: RetentionOverride,
    /// This prompt's own population knobs under the `evaluated` policy; each
    /// one set replaces the server's `[population]` default.
    #[serde(
        default,
        skip_serializing_if = "PopulationOverrides::is_empty",
        deserialize_with = "super::population_settings::from_object"
    )]
    pub population: PopulationOverrides,
}

/// A prompt's own trace retention (days; unset: the server's `[retention]` value).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RetentionOverride {
    /// Consumed traces (with their OTLP spans and reflections) are deleted this many days after they arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 36500)]
    pub consumed_days: Option<u32>,
    /// Failed traces are deleted this many days after they arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 36500)]
    pub failed_days: Option<u32>,
    /// Quarantined traces are deleted this many days after they were quarantined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 36500)]
    pub quarantined_days: Option<u32>,
}

impl RetentionOverride {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// A retention override is a JSON object (serde would also read a struct from an array).
fn retention_object<'de, D: serde::Deserializer<'de>>(d: D) -> Result<RetentionOverride, D::Error> {
    struct RetentionVisitor;
    impl<'de> serde::de::Visitor<'de> for RetentionVisitor {
        type Value = RetentionOverride;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object with consumed_days, failed_days and quarantined_days")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            RetentionOverride::deserialize(serde::de::value::MapAccessDeserializer::new(map))
        }
    }
    d.deserialize_map(RetentionVisitor)
}

/// Longest retention a prompt may name, in days (100 years).
pub const MAX_RETENTION_DAYS: u32 = 36_500;

fn default_regression_guard() -> bool {
    true
}

/// How level 2 of a playbook round combines the groups' operations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceMode {
    /// Union, normalise, de-duplicate and apply once — no LLM call.
    #[default]
    Union,
    /// One more aggregator call consolidates the k operation lists first (paper-literal).
    Llm,
}

/// What a round does with the reflection an agent sent with its trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum AgentReflections {
    /// The reflector runs on every trace; agent-supplied reflections are kept but not used.
    #[default]
    Ignore,
    /// A valid agent-supplied reflection replaces the reflector call.
    Use,
}

/// Upper bounds of the numeric settings.
pub const MAX_WAIT_SECS: u64 = 31_536_000;
pub const MAX_BULLETS: usize = 100_000;
pub const MAX_CHARS: usize = 10_000_000;

/// Most pinned bullets per prompt.
pub const MAX_PINNED_BULLETS: usize = 1000;

fn default_max_removal_share() -> f64 {
    0.25
}

impl PromptSettings {
    /// Every member a settings document may have (a patch naming another is refused).
    pub const FIELDS: &[&str] = &[
        "duplication",
        "batch_size",
        "max_wait_secs",
        "reduce",
        "max_bullets",
        "max_chars",
        "agent_reflections",
        "pinned_bullets",
        "max_removal_share",
        "regression_guard",
        "retention",
        "population",
    ];

    /// The rules a settings document must follow, in words an operator can act
    /// on; pinned ids come back in their canonical form (`b-1` → `b-0001`).
    pub fn validated(mut self) -> Result<Self, String> {
        if !(1..=8).contains(&self.duplication) {
            return Err("`settings.duplication` must be between 1 and 8".into());
        }
        if self.max_wait_secs.is_some_and(|w| w > MAX_WAIT_SECS) {
            return Err(format!("`settings.max_wait_secs` must be at most {MAX_WAIT_SECS} (a year)"));
        }
        if self.max_bullets.is_some_and(|b| b > MAX_BULLETS) {
            return Err(format!("`settings.max_bullets` must be at most {MAX_BULLETS}"));
        }
        if self.max_chars.is_some_and(|c| c > MAX_CHARS) {
            return Err(format!("`settings.max_chars` must be at most {MAX_CHARS}"));
        }
        if !(0.0..=1.0).contains(&self.max_removal_share) {
            return Err("`settings.max_removal_share` must be a number from 0 to 1".into());
        }
        let r = &self.retention;
        for (name, days) in [
            ("consumed_days", r.consumed_days),
            ("failed_days", r.failed_days),
            ("quarantined_days", r.quarantined_days),
        ] {
            if days.is_some_and(|d| !(1..=MAX_RETENTION_DAYS).contains(&d)) {
                return Err(format!("`settings.retention.{name}` must be from 1 to {MAX_RETENTION_DAYS} days"));
            }
        }
        if self.pinned_bullets.len() > MAX_PINNED_BULLETS {
            return Err(format!("`settings.pinned_bullets` holds more than {MAX_PINNED_BULLETS} ids"));
        }
        let mut seen = std::collections::HashSet::new();
        let mut canonical = Vec::with_capacity(self.pinned_bullets.len());
        for id in &self.pinned_bullets {
            let Some(n) = playbook::parse_bullet_id(id.trim()) else {
                let shown: String = id.chars().take(40).collect();
                return Err(format!("`settings.pinned_bullets`: {shown:?} is not a bullet id such as \"b-0001\""));
            };
            // Pinning an id twice is pinning it once.
            if seen.insert(n) {
                canonical.push(playbook::format_bullet_id(n));
            }
        }
        self.pinned_bullets = canonical;
        self.population.validate()?;
        Ok(self)
    }
}

fn default_duplication() -> u32 {
    2
}

impl Default for PromptSettings {
    fn default() -> Self {
        Self {
            duplication: default_duplication(),
            batch_size: BatchSize::Auto,
            max_wait_secs: None,
            reduce: Default::default(),
            max_bullets: None,
            max_chars: None,
            agent_reflections: AgentReflections::default(),
            pinned_bullets: Vec::new(),
            max_removal_share: default_max_removal_share(),
            regression_guard: true,
            retention: RetentionOverride::default(),
            population: PopulationOverrides::default(),
        }
    }
}

/// A prompt's batch size: chosen by the controller, or fixed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BatchSize {
    #[default]
    Auto,
    Fixed(u32),
}

impl BatchSize {
    pub fn fixed(self) -> Option<u32> {
        match self {
            Self::Auto => None,
            Self::Fixed(n) => Some(n),
        }
    }
}

impl Serialize for BatchSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::Fixed(n) => s.serialize_u32(*n),
        }
    }
}

impl<'de> Deserialize<'de> for BatchSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(s) if s == "auto" => Ok(Self::Auto),
            serde_json::Value::Number(n) => match n.as_u64() {
                Some(v @ 1..=10_000) => Ok(Self::Fixed(v as u32)),
                _ => Err(serde::de::Error::custom("batch_size must be \"auto\" or an integer from 1 to 10000")),
            },
            _ => Err(serde::de::Error::custom("batch_size must be \"auto\" or an integer from 1 to 10000")),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Prompt {
    #[serde(skip)]
    pub id: Uuid,
    #[schema(value_type = String)]
    pub name: PromptName,
    /// The project the prompt belongs to.
    pub project: String,
    pub strategy: Strategy,
    pub promotion: Promotion,
    pub settings: PromptSettings,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum VersionSource {
    Manual,
    Learned,
    Rollback,
    /// Made by crossing the population's winners (the `evaluated` policy).
    Crossover,
}

impl VersionSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Manual => "manual",
            Self::Learned => "learned",
            Self::Rollback => "rollback",
            Self::Crossover => "crossover",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "manual" => Self::Manual,
            "learned" => Self::Learned,
            "rollback" => Self::Rollback,
            "crossover" => Self::Crossover,
            _ => return None,
        })
    }
}

/// What a version holds: the base text and, in playbook mode, the playbook.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct VersionContent {
    pub base: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub playbook: Option<Playbook>,
}

impl VersionContent {
    /// The rendered text agents receive.
    pub fn render(&self) -> String {
        playbook::render(&self.base, self.playbook.as_ref())
    }

    /// Whether an agent would be served the same text: a playbook without
    /// bullets (or with empty sections only) says as much as none.
    pub fn serves_as(&self, other: &Self) -> bool {
        self == other || self.render() == other.render()
    }

    /// Whether two versions teach the same: the same base text and the same
    /// bullets (section and text), whatever their ids, order or counters — the
    /// counters are evidence the agents' runs wrote, not a lesson.
    pub fn same_lessons(&self, other: &Self) -> bool {
        self.base.trim() == other.base.trim() && self.lessons() == other.lessons()
    }

    /// Whether this version teaches everything `other` does (the same base
    /// text, and every bullet of `other`, by section and text).
    pub fn holds_lessons_of(&self, other: &Self) -> bool {
        let mine = self.lessons();
        self.base.trim() == other.base.trim() && other.lessons().iter().all(|l| mine.binary_search(l).is_ok())
    }

    /// The bullets as (section, text), sorted: what [`Self::same_lessons`] compares.
    fn lessons(&self) -> Vec<(&str, &str)> {
        let mut all: Vec<(&str, &str)> =
            self.playbook.iter().flat_map(|p| p.bullets()).map(|(s, b)| (s, b.content.trim())).collect();
        all.sort_unstable();
        all
    }

    /// `sha256:<hex>` over a canonical encoding of base and playbook.
    pub fn hash(&self) -> String {
        let canonical = serde_json::to_vec(self).unwrap_or_default();
        format!("sha256:{}", hex::encode(Sha256::digest(&canonical)))
    }
}

/// An immutable snapshot of a prompt.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Version {
    #[schema(value_type = String)]
    pub prompt: PromptName,
    pub number: i64,
    pub parent: Option<i64>,
    pub source: VersionSource,
    /// The learning round that produced a learned version.
    pub round_id: Option<Uuid>,
    #[serde(flatten)]
    pub content: VersionContent,
    pub content_hash: String,
    pub message: String,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
}

/// Everything needed to write a new version; the store assigns the number.
#[derive(Debug, Clone)]
pub struct NewVersion {
    pub parent: Option<i64>,
    pub source: VersionSource,
    pub round_id: Option<Uuid>,
    pub content: VersionContent,
    pub message: String,
    pub created_by: String,
}

impl NewVersion {
    /// The stored version, once the store has given it a number and a time.
    pub fn into_version(self, prompt: PromptName, number: i64, created_at: DateTime<Utc>) -> Version {
        Version {
            prompt,
            number,
            parent: self.parent,
            source: self.source,
            round_id: self.round_id,
            content_hash: self.content.hash(),
            content: self.content,
            message: self.message,
            created_by: self.created_by,
            created_at,
        }
    }
}

/// A prompt to create; its version 1 is given beside it.
#[derive(Debug, Clone)]
pub struct NewPrompt {
    /// With the project it is created in.
    pub name: PromptName,
    pub strategy: Strategy,
    pub promotion: Promotion,
    pub settings: PromptSettings,
    pub created_by: String,
}

/// A prompt as listed: with where `production` points, its latest version
/// number and how many traces wait to be learned from.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PromptSummary {
    #[serde(flatten)]
    pub prompt: Prompt,
    pub production_version: Option<i64>,
    pub latest_version: i64,
    pub pending_traces: i64,
}

/// Where each `{name}` placeholder of a prompt text is, braces included: a name
/// of identifier characters (ASCII letters, digits, `_`) between single braces;
/// `{{` opens none. The one scanner behind the placeholders a learned version
/// must keep and their Langfuse spelling.
pub fn placeholder_spans(text: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'{' && b.get(i + 1) != Some(&b'{') && (i == 0 || b[i - 1] != b'{') {
            let end = b[i + 1..].iter().position(|c| !(c.is_ascii_alphanumeric() || *c == b'_')).map(|p| i + 1 + p);
            if let Some(end) = end
                && end > i + 1
                && b[end] == b'}'
            {
                out.push(i..end + 1);
                i = end;
            }
        }
        i += 1;
    }
    out
}

/// The names of a text's `{name}` placeholders (see [`placeholder_spans`]).
pub fn placeholders(text: &str) -> std::collections::BTreeSet<String> {
    placeholder_spans(text).into_iter().map(|s| text[s.start + 1..s.end - 1].to_owned()).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_settings_fields_list_names_every_member() {
        let full = PromptSettings {
            max_wait_secs: Some(1),
            max_bullets: Some(1),
            max_chars: Some(1),
            retention: RetentionOverride { consumed_days: Some(90), ..Default::default() },
            population: super::PopulationOverrides { margin: Some(1.0), ..Default::default() },
            ..PromptSettings::default()
        };
        let doc = serde_json::to_value(&full).unwrap();
        let mut names: Vec<&str> = doc.as_object().unwrap().keys().map(String::as_str).collect();
        let mut listed = PromptSettings::FIELDS.to_vec();
        names.sort();
        listed.sort();
        assert_eq!(names, listed);
    }

    use super::*;

    #[test]
    fn a_retention_override_is_an_object() {
        let ok: PromptSettings =
            serde_json::from_value(serde_json::json!({"retention": {"consumed_days": 9}})).unwrap();
        assert_eq!(ok.retention.consumed_days, Some(9));
        assert!(serde_json::from_value::<PromptSettings>(serde_json::json!({"retention": [null, null]})).is_err());
        assert!(serde_json::from_value::<PromptSettings>(serde_json::json!({"retention": {"days": 1}})).is_err());
    }

    #[test]
    fn the_same_lessons_whatever_their_ids_order_or_counters() {
        use crate::domain::{Bullet, Playbook, Section};
        let bullet =
            |id: &str, content: &str, helpful| Bullet { id: id.into(), content: content.into(), helpful, harmful: 0 };
        let with = |bullets: Vec<Bullet>| VersionContent {
            base: "b".into(),
            playbook: Some(Playbook { sections: vec![Section { name: "s".into(), bullets }], next_id: 9 }),
        };
        let a = with(vec![bullet("b-0001", "x", 0), bullet("b-0002", "y", 3)]);
        assert!(a.same_lessons(&with(vec![bullet("b-0007", "y", 0), bullet("b-0003", " x ", 5)])));
        assert!(!a.same_lessons(&with(vec![bullet("b-0001", "x", 0)])));
        assert!(!a.same_lessons(&with(vec![bullet("b-0001", "x", 0), bullet("b-0002", "z", 3)])));
        let no_playbook = VersionContent { base: "b".into(), playbook: None };
        assert!(no_playbook.same_lessons(&with(Vec::new())), "no playbook teaches what an empty one does");
        assert!(!no_playbook.same_lessons(&VersionContent { base: "c".into(), playbook: None }));
        let more = with(vec![bullet("b-0004", "y", 0), bullet("b-0001", "x", 0), bullet("b-0009", "w", 0)]);
        assert!(more.holds_lessons_of(&a) && !a.holds_lessons_of(&more) && a.holds_lessons_of(&no_playbook));
    }

    #[test]
    fn hash_depends_on_content_only() {
        let a = VersionContent { base: "x".into(), playbook: None };
        let b = VersionContent { base: "x".into(), playbook: None };
        let c = VersionContent { base: "y".into(), playbook: None };
        assert_eq!(a.hash(), b.hash());
        assert_ne!(a.hash(), c.hash());
        assert!(a.hash().starts_with("sha256:"));
    }

    #[test]
    fn batch_size_is_auto_or_a_number() {
        let parse = |v: &str| serde_json::from_str::<PromptSettings>(&format!(r#"{{"batch_size": {v}}}"#));
        assert_eq!(parse(r#""auto""#).unwrap().batch_size, BatchSize::Auto);
        assert_eq!(parse("64").unwrap().batch_size, BatchSize::Fixed(64));
        for bad in ["0", "-1", "1.5", r#""big""#, "null", "10001"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert_eq!(serde_json::to_value(PromptSettings::default()).unwrap()["batch_size"], "auto");
    }

    #[test]
    fn settings_reject_unknown_fields() {
        assert!(serde_json::from_str::<PromptSettings>(r#"{"duplicaton": 3}"#).is_err());
        assert_eq!(serde_json::from_str::<PromptSettings>("{}").unwrap().duplication, 2);
    }
}
