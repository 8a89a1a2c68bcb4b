//! What one call of the map or the reduce is shown of the playbook: the
//! bullets that call needs, not all of them, so a call's cost stays bounded
//! however large the playbook grows.
//!
//! # The rule ([`View::of`])
//! A playbook within a call's limit ([`Limit`]: bullets and characters) is
//! shown whole. A larger one is shown as the base text, then
//! 1. the bullets the call's data names by id (`b-0007` in a trace's
//!    trajectory, a reflection's `bullet_tags`, an UPDATE's id): a reflector
//!    must be able to tag what the agent used, an aggregator what its
//!    reflections tagged;
//! 2. for each query (the trace; each reflection of the group; each pooled
//!    operation) its [`Limit::per_query`] most relevant bullets by a cheap
//!    lexical score — the sum, over the distinct words the bullet shares with
//!    the query, of their inverse document frequency among the playbook's
//!    bullets, `ln((M − df + ½) / (df + ½))`, words in half the bullets or more
//!    counting nothing (so "check" or "the" make nothing relevant, an id, a
//!    number or a rare term do). Ties go to the most helpful (helpful − harmful),
//!    then the older bullet;
//! 3. until the call's bullet and character limits are reached; the bullets
//!    keep their sections' order, and an outline line after the playbook says
//!    how many of each section's bullets the call does not see.
//!
//! The answer is checked against what was shown, not the whole playbook
//! (`calls`): a reflection may only tag, an aggregator only UPDATE or REMOVE,
//! bullets its call saw. An ADD of a lesson the playbook holds unseen is
//! skipped at level 2 as a duplicate (`merge::apply`), as before.

use std::collections::{HashMap, HashSet};

use crate::domain::playbook::{Bullet, Playbook, parse_bullet_id};
use crate::domain::{DeltaOp, Reflection, Trace, VersionContent};

/// How much of the playbook one call may be shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// Most bullets shown.
    pub bullets: usize,
    /// Most characters of the shown bullets' contents.
    pub chars: usize,
    /// Most bullets one query brings in by relevance.
    pub per_query: usize,
}

/// A reflector call: one trace.
pub const REFLECT: Limit = Limit { bullets: 12, chars: 2_400, per_query: 12 };
/// A level-1 aggregator call, per reflection of its group (at most [`AGGREGATE_MAX`]).
pub const AGGREGATE_PER_REFLECTION: Limit = Limit { bullets: 6, chars: 1_200, per_query: 6 };
/// A level-1 aggregator call, whatever its group size.
pub const AGGREGATE_MAX: Limit = Limit { bullets: 48, chars: 9_600, per_query: 6 };
/// A level-2 consolidation call over pooled operations.
pub const CONSOLIDATE: Limit = Limit { bullets: 48, chars: 9_600, per_query: 2 };

impl Limit {
    /// The aggregator's limit for a group of `n` reflections.
    pub fn aggregate(n: usize) -> Limit {
        let n = n.max(1);
        Limit {
            bullets: (AGGREGATE_PER_REFLECTION.bullets * n).min(AGGREGATE_MAX.bullets),
            chars: (AGGREGATE_PER_REFLECTION.chars * n).min(AGGREGATE_MAX.chars),
            per_query: AGGREGATE_PER_REFLECTION.per_query,
        }
    }
}

/// What one call is shown: the content (base and the bullets kept) and the
/// outline of what it does not see (`None` when the playbook is shown whole).
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    pub content: VersionContent,
    pub outline: Option<String>,
}

impl View {
    /// The whole of `current`.
    pub fn whole(current: &VersionContent) -> View {
        View { content: current.clone(), outline: None }
    }

    /// The view of `current` for a call whose data is `queries` (texts) and
    /// which names the bullet ids `named`, within `limit` (rule in the module doc).
    pub fn of(current: &VersionContent, queries: &[String], named: &[String], limit: Limit) -> View {
        let Some(pb) = current.playbook.as_ref() else { return View::whole(current) };
        let all: Vec<&Bullet> = pb.bullets().map(|(_, b)| b).collect();
        let chars: usize = all.iter().map(|b| b.content.chars().count()).sum();
        if all.len() <= limit.bullets && chars <= limit.chars {
            return View::whole(current);
        }
        let index = Index::of(&all);
        let mut chosen: Vec<usize> = Vec::new();
        let mut taken: HashSet<usize> = HashSet::new();
        let mut used = 0usize;
        let mut take = |i: usize, chosen: &mut Vec<usize>| -> bool {
            if chosen.len() >= limit.bullets {
                return false;
            }
            let len = all[i].content.chars().count();
            if used + len > limit.chars || !taken.insert(i) {
                return true;
            }
            used += len;
            chosen.push(i);
            true
        };
        let by_id: HashMap<&str, usize> = all.iter().enumerate().map(|(i, b)| (b.id.as_str(), i)).collect();
        for id in named {
            if let Some(&i) = by_id.get(id.as_str())
                && !take(i, &mut chosen)
            {
                break;
            }
        }
        'queries: for q in queries {
            for i in index.best(q, &all, limit.per_query) {
                if !take(i, &mut chosen) {
                    break 'queries;
                }
            }
        }
        let keep: HashSet<&str> = chosen.iter().map(|&i| all[i].id.as_str()).collect();
        let mut shown = pb.clone();
        let mut hidden = Vec::new();
        for section in &mut shown.sections {
            let before = section.bullets.len();
            section.bullets.retain(|b| keep.contains(b.id.as_str()));
            if before > section.bullets.len() {
                hidden.push(format!("{} ({} not shown)", section.name, before - section.bullets.len()));
            }
        }
        let outline = format!(
            "[{} of the playbook's {} bullets are shown: those this call's data names or is most related to. \
             Sections: {}.]",
            chosen.len(),
            all.len(),
            hidden.join("; ")
        );
        View { content: VersionContent { base: current.base.clone(), playbook: Some(shown) }, outline: Some(outline) }
    }

    /// The view for a reflector call on `trace`.
    pub fn for_trace(current: &VersionContent, trace: &Trace) -> View {
        if small(current, REFLECT) {
            return View::whole(current);
        }
        let text = serde_json::to_string(&(&trace.input, &trace.trajectory, &trace.output, &trace.feedback))
            .unwrap_or_default();
        let own = trace.reflection.as_ref().map(|r| r.to_string()).unwrap_or_default();
        let text = format!("{text}\n{own}");
        let named = ids_in(&text);
        View::of(current, &[text], &named, REFLECT)
    }

    /// The view for a level-1 aggregator call over `reflections`.
    pub fn for_reflections(current: &VersionContent, reflections: &[Reflection]) -> View {
        let limit = Limit::aggregate(reflections.len());
        if small(current, limit) {
            return View::whole(current);
        }
        let queries: Vec<String> = reflections
            .iter()
            .map(|r| format!("{} {} {} {}", r.key_insight, r.correct_approach, r.root_cause, r.error))
            .collect();
        let named: Vec<String> = reflections.iter().flat_map(|r| r.bullet_tags.iter().map(|t| t.id.clone())).collect();
        View::of(current, &queries, &named, limit)
    }

    /// The view for a level-2 consolidation over pooled `ops`.
    pub fn for_ops(current: &VersionContent, ops: &[DeltaOp]) -> View {
        if small(current, CONSOLIDATE) {
            return View::whole(current);
        }
        let mut named = Vec::new();
        let queries: Vec<String> = ops
            .iter()
            .map(|op| match op {
                DeltaOp::Add { content, .. } => content.clone(),
                DeltaOp::Update { id, content, .. } => {
                    named.push(id.clone());
                    content.clone()
                }
                DeltaOp::Remove { id, reason } => {
                    named.push(id.clone());
                    reason.clone()
                }
            })
            .collect();
        View::of(current, &queries, &named, CONSOLIDATE)
    }
}

/// Whether `current`'s playbook fits `limit` whole (the common case of a young playbook).
fn small(current: &VersionContent, limit: Limit) -> bool {
    current.playbook.as_ref().is_none_or(|pb: &Playbook| {
        pb.bullet_count() <= limit.bullets
            && pb.bullets().map(|(_, b)| b.content.chars().count()).sum::<usize>() <= limit.chars
    })
}

/// Bullet ids (`b-` and digits) named in `text`, canonical, each once, in order.
pub fn ids_in(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (at, _) in text.match_indices("b-") {
        if text[..at].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '-' || c == '_') {
            continue;
        }
        let digits: String = text[at + 2..].chars().take_while(char::is_ascii_digit).take(12).collect();
        if let Some(id) = parse_bullet_id(&format!("b-{digits}")).map(crate::domain::playbook::format_bullet_id)
            && !out.contains(&id)
        {
            out.push(id);
        }
    }
    out
}

/// Lower-cased words: runs of letters, digits, `-` and `_`, trimmed of `-`/`_`.
pub fn words(text: &str) -> HashSet<String> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '-' || c == '_'))
        .map(|w| w.trim_matches(|c| c == '-' || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// The playbook's words with their weights, and each bullet's words.
struct Index {
    idf: HashMap<String, f64>,
    bullets: Vec<HashSet<String>>,
}

impl Index {
    fn of(all: &[&Bullet]) -> Index {
        let bullets: Vec<HashSet<String>> = all.iter().map(|b| words(&b.content)).collect();
        let mut df: HashMap<&str, usize> = HashMap::new();
        for w in bullets.iter().flatten() {
            *df.entry(w.as_str()).or_default() += 1;
        }
        let m = all.len() as f64;
        let idf = df
            .into_iter()
            .map(|(w, d)| (w.to_owned(), ((m - d as f64 + 0.5) / (d as f64 + 0.5)).ln()))
            .filter(|(_, v)| *v > 0.0)
            .collect();
        Index { idf, bullets }
    }

    /// The `k` bullets most relevant to `query` with a positive score, best first.
    fn best(&self, query: &str, all: &[&Bullet], k: usize) -> Vec<usize> {
        let q: Vec<(String, f64)> =
            words(query).into_iter().filter_map(|w| self.idf.get(&w).map(|&v| (w, v))).collect();
        if q.is_empty() || k == 0 {
            return Vec::new();
        }
        let mut scored: Vec<(f64, i64, usize)> = self
            .bullets
            .iter()
            .enumerate()
            .filter_map(|(i, ws)| {
                let s: f64 = q.iter().filter(|(w, _)| ws.contains(w)).map(|(_, v)| v).sum();
                (s > 0.0).then(|| (s, i64::from(all[i].helpful) - i64::from(all[i].harmful), i))
            })
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        scored.into_iter().take(k).map(|(_, _, i)| i).collect()
    }
}

#[cfg(test)]
#[path = "select_tests.rs"]
mod tests;
