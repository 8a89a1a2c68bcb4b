//! The removal budget of level 2 of the reduce: the limits on the playbook a
//! round may publish ([`Budget`]) and what one round may take away
//! ([`Protection`]), which [`super::apply`] enforces.
//!
//! # Protection against poisoned rounds ([`Protection`])
//! Counters, ADDs and REMOVEs all come from untrusted traces, so one round's
//! evidence is bounded in what it can destroy:
//! - a *pinned* bullet (an operator's choice, `settings.pinned_bullets`) is never
//!   updated, removed or evicted ([`SkipReason::Pinned`]);
//! - every bullet the playbook held before the round — proven helpful or not
//!   yet marked at all — counts against a per-round quota of
//!   ⌊`max_removal_share` × bullets before the round⌋ removals (REMOVE ops and
//!   evictions together). Once the quota is spent, REMOVEs of earlier bullets are
//!   skipped ([`SkipReason::RemovalBound`]) and eviction takes this round's new
//!   bullets instead. So however many hostile traces tag bullets harmful or
//!   propose new ones under a bullet cap, a round takes away at most that share
//!   of what was learned before it. If only protected bullets are left over the
//!   budget, the round's result is over budget and is refused at validation.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::domain::Playbook;

/// Limits on the playbook a round may publish; `None` means unlimited.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Budget {
    pub max_bullets: Option<usize>,
    pub max_chars: Option<usize>,
    /// Bullet ids learning never updates, removes or evicts.
    #[serde(default)]
    pub pinned: Vec<String>,
    /// Most of the playbook's earlier bullets one round may remove or evict, as a
    /// share of them (0–1); `None` means unbounded.
    #[serde(default)]
    pub max_removal_share: Option<f64>,
}

/// What one round may not take away (module doc, "Protection").
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Protection {
    pinned: HashSet<String>,
    /// The bullets of the playbook before the round.
    earlier: HashSet<String>,
    /// Earlier bullets this round may still remove or evict; `None`: no bound.
    removals_left: Option<usize>,
}

impl Protection {
    /// The protection for a round whose playbook was `before_round`.
    pub fn for_round(before_round: &Playbook, budget: &Budget) -> Self {
        let earlier: HashSet<String> = before_round.bullets().map(|(_, b)| b.id.clone()).collect();
        let removals_left = budget
            .max_removal_share
            .map(|share| (share.clamp(0.0, 1.0) * earlier.len() as f64 + 1e-9).floor() as usize);
        Self { pinned: budget.pinned.iter().cloned().collect(), earlier, removals_left }
    }

    pub(super) fn is_pinned(&self, id: &str) -> bool {
        self.pinned.contains(id)
    }

    /// Whether `id` may be removed now (pinned: never; an earlier bullet: while the quota lasts).
    pub(super) fn may_remove(&self, id: &str) -> bool {
        !self.is_pinned(id) && (!self.earlier.contains(id) || self.removals_left != Some(0))
    }

    pub(super) fn note_removed(&mut self, id: &str) {
        if self.earlier.contains(id)
            && let Some(left) = &mut self.removals_left
        {
            *left = left.saturating_sub(1);
        }
    }
}
