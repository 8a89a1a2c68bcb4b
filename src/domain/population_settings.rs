//! A prompt's own population knobs (`settings.population`): each one, when
//! set, replaces the server's `[population]` default for this prompt only, so an
//! operator can explore more on one prompt, or hold production longer on
//! another, without restarting anything. Unset members follow the server.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::evaluate::population::PopulationPolicy;

/// The members of `settings.population` (a patch naming another is refused).
pub const POPULATION_FIELDS: &[&str] =
    &["explore_share", "min_traces", "max_arms", "crossover_prob", "margin", "cooldown_windows"];

/// The range of `explore_share` (some traffic must go to each side).
pub const EXPLORE_SHARE_MIN: f64 = 0.001;
pub const EXPLORE_SHARE_MAX: f64 = 0.999;
/// Largest `max_arms` a prompt may ask for.
pub const MAX_ARMS: usize = 32;
/// Largest `min_traces` and `cooldown_windows` a prompt may ask for.
pub const MAX_EVIDENCE: u64 = 1_000_000;
/// Largest `margin` (TrueSkill points; μ₀ is 25).
pub const MAX_MARGIN: f64 = 100.0;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PopulationOverrides {
    /// Share of traffic all challengers together get (0.001–0.999).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.001, maximum = 0.999)]
    pub explore_share: Option<f64>,
    /// Scored traces the champion and a challenger each need before the gate may move production.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 1_000_000)]
    pub min_traces: Option<u64>,
    /// Most challengers beside the champion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 32)]
    pub max_arms: Option<usize>,
    /// Chance per rated window of a crossover (0–1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub crossover_prob: Option<f64>,
    /// How far (TrueSkill points) a challenger's μ−2σ must exceed the champion's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 100.0)]
    pub margin: Option<f64>,
    /// Rating windows production stays after it moved before the gate may move it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 1_000_000)]
    pub cooldown_windows: Option<u64>,
}

/// Reads `settings.population` only from a JSON object (serde would also take
/// an array of the members in order, which no client means).
pub fn from_object<'de, D: serde::Deserializer<'de>>(d: D) -> Result<PopulationOverrides, D::Error> {
    use serde::de::Error;
    let v = serde_json::Value::deserialize(d)?;
    if !v.is_object() {
        return Err(D::Error::custom("`population` must be an object of population knobs"));
    }
    serde_json::from_value(v).map_err(D::Error::custom)
}

impl PopulationOverrides {
    /// The server's policy with this prompt's knobs in place (a challenger's
    /// floor share stays within the prompt's exploration share).
    pub fn applied_to(&self, server: &PopulationPolicy) -> PopulationPolicy {
        let explore_share = self.explore_share.unwrap_or(server.explore_share);
        PopulationPolicy {
            explore_share,
            min_arm_share: server.min_arm_share.min(explore_share),
            min_traces: self.min_traces.unwrap_or(server.min_traces),
            max_arms: self.max_arms.unwrap_or(server.max_arms),
            margin: self.margin.unwrap_or(server.margin),
            cooldown_windows: self.cooldown_windows.unwrap_or(server.cooldown_windows),
            crossover_prob: self.crossover_prob.unwrap_or(server.crossover_prob),
            window_secs: server.window_secs,
            min_window_secs: server.min_window_secs,
        }
    }

    /// Whether nothing is overridden.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The ranges, in words an operator can act on.
    pub fn validate(&self) -> Result<(), String> {
        let field = |name: &str| format!("`settings.population.{name}`");
        if let Some(x) = self.explore_share
            && !(EXPLORE_SHARE_MIN..=EXPLORE_SHARE_MAX).contains(&x)
        {
            return Err(format!(
                "{} must be a number from {EXPLORE_SHARE_MIN} to {EXPLORE_SHARE_MAX}",
                field("explore_share")
            ));
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
        let object_only = |text: &str| from_object(&mut serde_json::Deserializer::from_str(text));
        assert!(object_only("[null, null]").is_err() && object_only("null").is_err());
        assert_eq!(object_only(r#"{"margin": 1}"#).unwrap().margin, Some(1.0));
        // Every member is listed.
        let v = serde_json::to_value(&ok).unwrap();
        let mut names: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        let mut listed = POPULATION_FIELDS.to_vec();
        names.sort();
        listed.sort();
        assert_eq!(names, listed);
    }
}
