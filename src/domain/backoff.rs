//! A failing prompt's backoff: after a round of a prompt fails, the scheduler
//! opens no new round for it until an exponential delay has passed since the
//! failure, so a round that fails the same way every time (a model that
//! cannot answer) is not re-run every second over the same traces. A round
//! that publishes, or an operator (a manual trigger, a clear), resets it.
//!
//! The store keeps only what happened (the streak, when and why the last
//! round failed); the delay is read from the settings when it is needed, so
//! changing them takes effect at once.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The delay policy (`worker.failure_backoff_secs`, `worker.failure_backoff_max_secs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailureBackoff {
    /// The delay after the first failure of a streak.
    pub base_secs: u64,
    /// No delay is longer.
    pub max_secs: u64,
}

impl FailureBackoff {
    /// The wait after `streak` rounds failed in a row: none for 0, then
    /// `base_secs` doubling with each further failure, at most `max_secs`.
    pub fn delay(&self, streak: u32) -> Duration {
        if streak == 0 {
            return Duration::ZERO;
        }
        let doublings = (streak - 1).min(63);
        let secs = self.base_secs.saturating_mul(1u64 << doublings);
        Duration::from_secs(secs.min(self.max_secs))
    }
}

/// What the store keeps of a prompt's failing rounds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailureStreak {
    /// Rounds failed in a row since the last success or operator reset.
    pub failures: u32,
    pub last_failed_at: Option<DateTime<Utc>>,
    /// The last failed round's error.
    pub last_failure: Option<String>,
}

impl FailureStreak {
    /// When the scheduler may open the next round; `None` outside a streak.
    pub fn backoff_until(&self, policy: &FailureBackoff) -> Option<DateTime<Utc>> {
        let at = self.last_failed_at.filter(|_| self.failures > 0)?;
        let delay = chrono::Duration::from_std(policy.delay(self.failures)).unwrap_or(chrono::Duration::MAX);
        Some(at.checked_add_signed(delay).unwrap_or(DateTime::<Utc>::MAX_UTC))
    }

    /// True while no round may be scheduled at `now`.
    pub fn backing_off(&self, policy: &FailureBackoff, now: DateTime<Utc>) -> bool {
        self.backoff_until(policy).is_some_and(|until| until > now)
    }

    /// The state as the API, the web UI and the metrics show it.
    pub fn state(&self, policy: &FailureBackoff, now: DateTime<Utc>) -> LearningState {
        let backing_off = self.backing_off(policy, now);
        LearningState {
            state: if backing_off { LearningStatus::BackingOff } else { LearningStatus::Ok },
            failure_streak: self.failures,
            backoff_until: self.backoff_until(policy).filter(|_| backing_off),
            last_failed_at: self.last_failed_at,
            last_failure: self.last_failure.clone(),
            budget: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LearningStatus {
    /// The scheduler opens rounds as the backlog asks.
    Ok,
    /// Rounds failed; no round is scheduled before `backoff_until`.
    BackingOff,
    /// A daily spending cap holds learning back until `budget.until`: traces
    /// stay pending, no round calls the LLM.
    BudgetReached,
}

/// A prompt's learning state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct LearningState {
    pub state: LearningStatus,
    /// Rounds failed in a row since the last success or operator reset.
    pub failure_streak: u32,
    /// While backing off: when the scheduler may open the next round.
    pub backoff_until: Option<DateTime<Utc>>,
    /// When the last round of the streak failed.
    pub last_failed_at: Option<DateTime<Utc>>,
    /// Why it failed (the round's error).
    pub last_failure: Option<String>,
    /// While a daily spending cap holds learning back: which, and until when.
    pub budget: Option<crate::domain::budget::BudgetReached>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: FailureBackoff = FailureBackoff { base_secs: 60, max_secs: 3600 };

    #[test]
    fn the_delay_doubles_from_the_base_up_to_the_cap() {
        let secs: Vec<u64> = (0..9).map(|n| POLICY.delay(n).as_secs()).collect();
        assert_eq!(secs, [0, 60, 120, 240, 480, 960, 1920, 3600, 3600]);
        // No overflow, however long the streak.
        assert_eq!(POLICY.delay(u32::MAX).as_secs(), 3600);
        let huge = FailureBackoff { base_secs: u64::MAX / 2, max_secs: u64::MAX };
        assert_eq!(huge.delay(3).as_secs(), u64::MAX);
        assert_eq!(FailureBackoff { base_secs: 0, max_secs: 3600 }.delay(5), Duration::ZERO);
    }

    #[test]
    fn a_streak_backs_off_from_its_last_failure_until_the_delay_passed() {
        let t0 = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let none = FailureStreak::default();
        assert_eq!(none.backoff_until(&POLICY), None);
        assert_eq!(none.state(&POLICY, t0).state, LearningStatus::Ok);

        let two = FailureStreak { failures: 2, last_failed_at: Some(t0), last_failure: Some("bad JSON".into()) };
        assert_eq!(two.backoff_until(&POLICY), Some(t0 + chrono::Duration::seconds(120)));
        assert!(two.backing_off(&POLICY, t0 + chrono::Duration::seconds(119)));
        assert!(!two.backing_off(&POLICY, t0 + chrono::Duration::seconds(120)));
        let s = two.state(&POLICY, t0);
        assert_eq!(
            (s.state, s.failure_streak, s.last_failure.as_deref()),
            (LearningStatus::BackingOff, 2, Some("bad JSON"))
        );
        // Once the delay passed the streak stays (a success or an operator resets it), the wait does not.
        let later = two.state(&POLICY, t0 + chrono::Duration::hours(1));
        assert_eq!((later.state, later.failure_streak, later.backoff_until), (LearningStatus::Ok, 2, None));
        // A streak without a time (not written so) never blocks.
        let odd = FailureStreak { failures: 3, last_failed_at: None, last_failure: None };
        assert!(!odd.backing_off(&POLICY, t0));
    }
}
