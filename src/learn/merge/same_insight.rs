//! When two lesson texts carry the same insight, and the text normalisation
//! that judgement rests on — used by level 2 of the reduce twice: to
//! de-duplicate the groups' operations ([`super::dedupe`]) and to skip an ADD
//! the playbook already holds ([`super::apply`]).
//!
//! # Same insight ([`same_insight`])
//! Two texts carry the same insight when their *key tokens* are identical and
//! either their lower-cased texts are equal or the Jaccard similarity of their
//! word sets is at least [`NEAR_DUPLICATE_JACCARD`] (0.85). Words are lower-cased
//! runs of letters, digits, `-` and `_`. Key tokens are the words containing a
//! digit: a differing number, id, code or version always means a different
//! insight, however similar the surrounding words. No marker format is special.
//! The threshold is deliberately strict: a missed duplicate costs one redundant bullet, a false merge loses a specific insight.

use std::collections::BTreeSet;

/// Word-set Jaccard similarity at or above which two texts are near-duplicates.
pub const NEAR_DUPLICATE_JACCARD: f64 = 0.85;
/// Section used when an ADD names none.
pub const DEFAULT_SECTION: &str = "general";
pub(super) const MAX_SECTION_CHARS: usize = 64;

/// Trims and collapses every whitespace run (newlines included) to one space.
pub fn collapse_whitespace(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

pub(super) fn section_display(raw: &str) -> String {
    let s = collapse_whitespace(raw);
    if s.is_empty() { DEFAULT_SECTION.to_owned() } else { s.chars().take(MAX_SECTION_CHARS).collect() }
}

pub(super) fn section_key(display: &str) -> String {
    display.to_lowercase()
}

/// What [`same_insight`] compares, computed once per text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Fingerprint {
    lower: String,
    words: BTreeSet<String>,
    keys: BTreeSet<String>,
}

impl Fingerprint {
    pub(super) fn of(text: &str) -> Self {
        let mut words = BTreeSet::new();
        let mut keys = BTreeSet::new();
        let raw_words = text
            .split(|c: char| !(c.is_alphanumeric() || c == '-' || c == '_'))
            .map(|w| w.trim_matches(|c| c == '-' || c == '_'))
            .filter(|w| !w.is_empty());
        for raw in raw_words {
            let lower = raw.to_lowercase();
            if raw.chars().any(|c| c.is_ascii_digit()) {
                keys.insert(lower.clone());
            }
            words.insert(lower);
        }
        Self { lower: collapse_whitespace(text).to_lowercase(), words, keys }
    }

    pub(super) fn same_insight(&self, other: &Self) -> bool {
        if self.keys != other.keys {
            return false;
        }
        self.lower == other.lower || jaccard(&self.words, &other.words) >= NEAR_DUPLICATE_JACCARD
    }

    /// Higher is more specific: more distinct words, then more characters.
    pub(super) fn specificity(&self) -> (usize, usize) {
        (self.words.len(), self.lower.chars().count())
    }
}

fn jaccard(a: &BTreeSet<String>, b: &BTreeSet<String>) -> f64 {
    let union = a.union(b).count();
    if union == 0 {
        return 0.0;
    }
    a.intersection(b).count() as f64 / union as f64
}

/// Whether two bullet texts carry the same insight (see the module doc).
pub fn same_insight(a: &str, b: &str) -> bool {
    Fingerprint::of(a).same_insight(&Fingerprint::of(b))
}
