//! The learning budget's vocabulary: the caps on what combee's own LLM calls
//! may spend (a prompt's, set through the API, and the server's, from
//! `[budget]`), the spend of a day, and the state a prompt is in when a cap
//! holds its learning back. The caps are checked, and spend is kept, by
//! `service::budget` through the store; this file only holds the types, their
//! validation and the UTC day arithmetic.

use chrono::{DateTime, NaiveDate, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Caps on tokens and US dollars, per UTC day and per round (one attempt of a
/// round: a round that needs more pauses and resumes from its journal). An
/// unset cap does not hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BudgetCaps {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, example = 2_000_000)]
    pub tokens_per_day: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, example = 5.0)]
    pub usd_per_day: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, example = 200_000)]
    pub tokens_per_round: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, example = 0.5)]
    pub usd_per_round: Option<f64>,
}

/// The most a cap may be: far above any real bill, low enough that sums stay exact.
pub const MAX_TOKENS_CAP: u64 = 1 << 50;
pub const MAX_USD_CAP: f64 = 1e12;

impl BudgetCaps {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Rejects a negative, non-finite or absurd cap, naming it.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [("tokens_per_day", self.tokens_per_day), ("tokens_per_round", self.tokens_per_round)] {
            if v.is_some_and(|v| v > MAX_TOKENS_CAP) {
                return Err(format!("budget.{name} must be at most {MAX_TOKENS_CAP}"));
            }
        }
        for (name, v) in [("usd_per_day", self.usd_per_day), ("usd_per_round", self.usd_per_round)] {
            if v.is_some_and(|v| !(v.is_finite() && (0.0..=MAX_USD_CAP).contains(&v))) {
                return Err(format!("budget.{name} must be a number from 0 to {MAX_USD_CAP}"));
            }
        }
        Ok(())
    }

    /// The tighter of two caps on each member.
    pub fn tightest(&self, other: &BudgetCaps) -> BudgetCaps {
        fn min<T: PartialOrd + Copy>(a: Option<T>, b: Option<T>) -> Option<T> {
            match (a, b) {
                (Some(a), Some(b)) => Some(if b < a { b } else { a }),
                (a, b) => a.or(b),
            }
        }
        BudgetCaps {
            tokens_per_day: min(self.tokens_per_day, other.tokens_per_day),
            usd_per_day: min(self.usd_per_day, other.usd_per_day),
            tokens_per_round: min(self.tokens_per_round, other.tokens_per_round),
            usd_per_round: min(self.usd_per_round, other.usd_per_round),
        }
    }
}

/// Tokens and dollars spent; `calls` counts HTTP attempts, retried ones included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, ToSchema)]
pub struct Spent {
    pub tokens: u64,
    pub usd: f64,
    pub calls: u64,
}

/// What is over a cap, given what is spent, what is reserved, and the next
/// call's estimate: the first cap (`tokens` or `usd`) it would pass.
pub fn passes(cap_tokens: Option<u64>, cap_usd: Option<f64>, spent: Spent, estimate: Spent) -> Option<&'static str> {
    if cap_tokens.is_some_and(|c| spent.tokens.saturating_add(estimate.tokens) > c) {
        return Some("tokens");
    }
    if cap_usd.is_some_and(|c| spent.usd + estimate.usd > c + 1e-12) {
        return Some("usd");
    }
    None
}

/// One prompt's spend on one UTC day, by kind of call.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct DaySpend {
    #[schema(value_type = String, example = "2026-11-27")]
    pub day: NaiveDate,
    pub tokens: u64,
    pub usd: f64,
    pub calls: u64,
    /// `reflection`, `aggregation`, `crossover`, … each with its share.
    pub by_kind: std::collections::BTreeMap<String, Spent>,
}

/// A daily cap that holds a prompt's learning back: which one, and until when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct BudgetReached {
    /// `budget reached until <time> (<scope>)`.
    #[schema(example = "budget reached until 2026-11-28T00:00:00Z (prompt tokens_per_day)")]
    pub message: String,
    /// Which cap: `prompt tokens_per_day`, `server usd_per_day`, …
    pub scope: String,
    /// When learning resumes by itself: the next UTC day (sooner when the cap is raised).
    pub until: DateTime<Utc>,
    pub reached_at: DateTime<Utc>,
}

impl BudgetReached {
    pub fn new(scope: String, until: DateTime<Utc>, reached_at: DateTime<Utc>) -> Self {
        let message =
            format!("budget reached until {} ({scope})", until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
        Self { message, scope, until, reached_at }
    }
}

/// The start of the UTC day after `at`.
pub fn next_day(at: DateTime<Utc>) -> DateTime<Utc> {
    let day = at.date_naive().succ_opt().unwrap_or(NaiveDate::MAX);
    day.and_hms_opt(0, 0, 0).map(|t| t.and_utc()).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// A day as the store keeps it (`2026-11-27`).
pub fn day_key(day: NaiveDate) -> String {
    day.format("%Y-%m-%d").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_day_starts_at_utc_midnight() {
        let at = DateTime::parse_from_rfc3339("2026-11-27T23:59:59.9Z").unwrap().with_timezone(&Utc);
        assert_eq!(next_day(at).to_rfc3339(), "2026-11-28T00:00:00+00:00");
        let midnight = next_day(at);
        assert_eq!(next_day(midnight).to_rfc3339(), "2026-11-29T00:00:00+00:00");
        assert_eq!(day_key(at.date_naive()), "2026-11-27");
    }

    #[test]
    fn a_call_passes_a_cap_when_spend_and_estimate_exceed_it() {
        let spent = Spent { tokens: 900, usd: 0.9, calls: 3 };
        let small = Spent { tokens: 100, usd: 0.1, calls: 1 };
        assert_eq!(passes(Some(1000), Some(1.0), spent, small), None);
        assert_eq!(passes(Some(999), None, spent, small), Some("tokens"));
        assert_eq!(passes(None, Some(0.99), spent, small), Some("usd"));
        assert_eq!(passes(None, None, spent, Spent { tokens: u64::MAX, ..small }), None);
    }

    #[test]
    fn caps_combine_to_the_tightest_and_refuse_nonsense() {
        let server = BudgetCaps { tokens_per_day: Some(1000), usd_per_round: Some(1.0), ..Default::default() };
        let prompt = BudgetCaps { tokens_per_day: Some(500), usd_per_day: Some(2.0), ..Default::default() };
        let t = prompt.tightest(&server);
        assert_eq!((t.tokens_per_day, t.usd_per_day, t.usd_per_round), (Some(500), Some(2.0), Some(1.0)));
        assert!(BudgetCaps { usd_per_day: Some(-1.0), ..prompt }.validate().is_err());
        assert!(BudgetCaps { tokens_per_day: Some(MAX_TOKENS_CAP + 1), ..prompt }.validate().is_err());
        assert!(prompt.validate().is_ok());
    }
}
