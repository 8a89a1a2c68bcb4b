//! The population of a prompt under the `evaluated` policy: its arms (versions competing for
//! traffic) with their state, rating and weight.

use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

use crate::evaluate::{population::Arm, trueskill::Rating};

/// Where an arm of a prompt's population stands (policy `evaluated`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ArmState {
    /// The version `production` points at; gets most of the traffic.
    Champion,
    /// Measured on a share of the traffic; may replace the champion.
    Challenger,
    /// Gets no traffic any more (the version itself stays).
    Retired,
}

impl ArmState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Champion => "champion",
            Self::Challenger => "challenger",
            Self::Retired => "retired",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Champion, Self::Challenger, Self::Retired].into_iter().find(|x| x.as_str() == s)
    }
}

/// One version in a prompt's population, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct PopulationArm {
    pub version: i64,
    pub state: ArmState,
    /// TrueSkill rating (μ, σ) from the rating windows so far.
    pub rating: Rating,
    /// Share of subjects served this arm (the weights of live arms sum to 1).
    pub weight: f64,
    /// Scored traces of this version counted in rating windows so far.
    pub scored_traces: u64,
    /// The version this one was learned from (`null` for the first champion);
    /// for a crossover child, the champion whose bullets it kept.
    pub created_from: Option<i64>,
    /// Every version this one came from: the one parent of a learned child,
    /// the champion and the winners a crossover child was bred from.
    pub parents: Vec<i64>,
    /// End of the last rating window this arm took part in.
    pub rated_until: Option<DateTime<Utc>>,
    /// When the arm joined the population (`null` until it is stored).
    pub joined_at: Option<DateTime<Utc>>,
}

impl From<&PopulationArm> for Arm {
    fn from(a: &PopulationArm) -> Self {
        Arm { version: a.version, rating: a.rating, scored_traces: a.scored_traces }
    }
}
