//! A prompt's own population knobs (`settings.population`): each one, when
//! set, replaces the server's `[population]` default for this prompt only, so an
//! operator can explore more on one prompt, or hold production longer on
//! another, without restarting anything. Unset members follow the server.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The members of `settings.population` (a patch naming another is refused).
pub const POPULATION_FIELDS: &[&str] =
    &["explore_share", "min_traces", "max_arms", "crossover_prob", "margin", "cooldown_windows"];

/// Largest `max_arms` a prompt may ask for.
pub const MAX_ARMS: usize = 32;
/// Largest `min_traces` and `cooldown_windows` a prompt may ask for.
pub const MAX_EVIDENCE: u64 = 1_000_000;
/// Largest `margin` (TrueSkill points; μ₀ is 25).
pub const MAX_MARGIN: f64 = 100.0;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PopulationOverrides {
    /// Share of traffic all challengers together get (0 < x < 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explore_share: Option<f64>,
    /// Scored traces the champion and a challenger each need before the gate may move production.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_traces: Option<u64>,
    /// Most challengers beside the champion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_arms: Option<usize>,
    /// Chance per rated window of a crossover (0–1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crossover_prob: Option<f64>,
    /// How far (TrueSkill points) a challenger's μ−2σ must exceed the champion's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub margin: Option<f64>,
    /// Rating windows production stays after it moved before the gate may move it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cooldown_windows: Option<u64>,
}

impl PopulationOverrides {
    /// Whether nothing is overridden.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The ranges, in words an operator can act on.
    pub fn validate(&self) -> Result<(), String> {
        let field = |name: &str| format!("`settings.population.{name}`");
        if let Some(x) = self.explore_share
            && !(x > 0.0 && x < 1.0)
        {
            return Err(format!("{} must be a number between 0 and 1 (both excluded)", field("explore_share")));
        }
        if let Some(x) = self.crossover_prob
            && !(0.0..=1.0).contains(&x)
        {
            return Err(format!("{} must be a number from 0 to 1", field("crossover_prob")));
        }
        if let Some(x) = self.margin
            && !(0.0..=MAX_MARGIN).contains(&x)
        {
            return Err(format!("{} must be a number from 0 to {MAX_MARGIN}", field("margin")));
        }
        if self.max_arms.is_some_and(|n| !(1..=MAX_ARMS).contains(&n)) {
            return Err(format!("{} must be between 1 and {MAX_ARMS}", field("max_arms")));
        }
        if self.min_traces.is_some_and(|n| n > MAX_EVIDENCE) {
            return Err(format!("{} must be at most {MAX_EVIDENCE}", field("min_traces")));
        }
        if self.cooldown_windows.is_some_and(|n| n > MAX_EVIDENCE) {
            return Err(format!("{} must be at most {MAX_EVIDENCE}", field("cooldown_windows")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked_and_explained() {
        assert!(PopulationOverrides::default().validate().is_ok());
        let ok = PopulationOverrides {
            explore_share: Some(0.5),
            min_traces: Some(10),
            max_arms: Some(2),
            crossover_prob: Some(0.0),
            margin: Some(2.0),
            cooldown_windows: Some(0),
        };
        assert!(ok.validate().is_ok());
        for (bad, word) in [
            (PopulationOverrides { explore_share: Some(1.0), ..Default::default() }, "explore_share"),
            (PopulationOverrides { crossover_prob: Some(1.5), ..Default::default() }, "crossover_prob"),
            (PopulationOverrides { margin: Some(-1.0), ..Default::default() }, "margin"),
            (PopulationOverrides { max_arms: Some(0), ..Default::default() }, "max_arms"),
        ] {
            let e = bad.validate().unwrap_err();
            assert!(e.contains(word), "{e}");
        }
        assert!(serde_json::from_str::<PopulationOverrides>(r#"{"margins": 1}"#).is_err());
        // Every member is listed.
        let v = serde_json::to_value(&ok).unwrap();
        let mut names: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        let mut listed = POPULATION_FIELDS.to_vec();
        names.sort();
        listed.sort();
        assert_eq!(names, listed);
    }
}
