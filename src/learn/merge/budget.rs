//! The removal budget of level 2 of the reduce: the limits on the playbook a
//! round may publish ([`Budget`]) and what one round may take away
//! ([`Protection`]), which [`super::apply`] enforces.
//!
//! # The default playbook budget ([`Budget::for_prompt`])
//! A prompt whose settings leave `max_bullets` or `max_chars` unset gets
//! [`DEFAULT_MAX_BULLETS`] bullets and [`DEFAULT_MAX_CHARS`] characters. The
//! playbook rides on every call the agent makes, so it is sized for the
//! agent's context and bill, not the learner's: 12,000 characters are about
//! 3,000 tokens (at four characters a token), under 3 % of a 128 k window and
//! leaving more than half of an 8 k small model's window to the task; at a few
//! dollars per million input tokens that is about a cent per agent call.
//! 100 bullets of the ≈ 80 characters a lesson takes (≈ 112 as rendered,
//! with id and counters) fill about 11,000 of them, so neither limit makes
//! the other idle. Without a budget a playbook grows
//! by every distinct lesson (≈ 5 k tokens per 300), and so does each agent
//! call. The budget is curated, not collapsed: near-duplicate lessons are
//! merged by [`super::same_insight`] (and by the consolidation of
//! `reduce = "llm"`), UPDATEs refine bullets in place, and only then the least
//! useful bullets are evicted (net harmful, then lowest score, then oldest;
//! see [`super::apply`]) — no step rewrites many lessons into a few generic
//! ones. An operator who wants no budget sets the limits to their maxima.
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
//!   of what was learned before it. A playbook already over its budget before
//!   a round (a budget lowered, or the default one met by a playbook learned
//!   without it) shrinks toward it by at most that share a round, and a
//!   round's result may not be larger than the playbook before it; a playbook
//!   within its budget before the round must stay within it.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::domain::{Playbook, PromptSettings, Strategy};

/// Default `max_bullets` of a playbook prompt whose settings leave it unset (module doc).
pub const DEFAULT_MAX_BULLETS: usize = 100;
/// Default `max_chars` of a playbook prompt whose settings leave it unset (module doc).
pub const DEFAULT_MAX_CHARS: usize = 12_000;

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

impl Budget {
    /// The budget of a prompt's rounds: its settings, with the default
    /// playbook budget where they leave a limit unset. A rewrite prompt's
    /// `max_chars` bounds its instruction and has no default.
    pub fn for_prompt(settings: &PromptSettings, strategy: Strategy) -> Budget {
        let playbook = strategy == Strategy::Playbook;
        Budget {
            max_bullets: settings.max_bullets.or(playbook.then_some(DEFAULT_MAX_BULLETS)),
            max_chars: settings.max_chars.or(playbook.then_some(DEFAULT_MAX_CHARS)),
            pinned: settings.pinned_bullets.clone(),
            max_removal_share: Some(settings.max_removal_share),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_limits_of_a_playbook_prompt_take_the_default_budget_and_set_ones_are_kept() {
        let mut settings = PromptSettings::default();
        let b = Budget::for_prompt(&settings, Strategy::Playbook);
        assert_eq!((b.max_bullets, b.max_chars), (Some(DEFAULT_MAX_BULLETS), Some(DEFAULT_MAX_CHARS)));
        assert_eq!(b.max_removal_share, Some(settings.max_removal_share));
        settings.max_bullets = Some(40);
        settings.pinned_bullets = vec!["b-0001".into()];
        let b = Budget::for_prompt(&settings, Strategy::Playbook);
        assert_eq!((b.max_bullets, b.max_chars, b.pinned.len()), (Some(40), Some(DEFAULT_MAX_CHARS), 1));
        // A rewrite prompt's instruction has no default limit.
        let b = Budget::for_prompt(&PromptSettings::default(), Strategy::Rewrite);
        assert_eq!((b.max_bullets, b.max_chars), (None, None));
    }

    #[test]
    fn the_default_budget_holds_a_full_playbook_of_typical_lessons_in_its_characters() {
        use crate::domain::playbook::{Bullet, Section, format_bullet_id};
        use crate::learn::merge::apply::rendered_chars;
        // A full playbook of lessons of about 80 characters, rendered as agents see them.
        let bullets = (0..DEFAULT_MAX_BULLETS as u64)
            .map(|i| Bullet {
                id: format_bullet_id(i + 1),
                content: format!("INSIGHT-t{i:04}: check field {i} of the order before you answer the customer"),
                helpful: 0,
                harmful: 0,
            })
            .collect();
        let pb = Playbook {
            sections: vec![Section { name: "insights".into(), bullets }],
            next_id: DEFAULT_MAX_BULLETS as u64 + 1,
        };
        let chars = rendered_chars(&pb);
        // Neither limit is idle: the bullets fill most of the characters, without passing them by much.
        assert!((DEFAULT_MAX_CHARS * 8 / 10..=DEFAULT_MAX_CHARS * 14 / 10).contains(&chars), "{chars}");
    }
}
