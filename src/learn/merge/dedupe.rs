//! Level 2 of the reduce, its deterministic part for playbooks: the union of
//! every group's delta operations is normalised and de-duplicated into one
//! list of [`MergedOp`]s with their provenance, so no LLM ever rewrites the
//! whole playbook (which is what causes context collapse) and the same inputs
//! always give the same playbook. [`super::apply`] then applies the list once
//! to the frozen version.
//!
//! # Normalisation ([`normalize_ops`])
//! - Contents, reasons and section names are trimmed with whitespace runs
//!   collapsed to one space; an ADD/UPDATE with empty content or an
//!   UPDATE/REMOVE with an empty id is dropped. Section names are matched
//!   case-insensitively; the first spelling seen (in group order) is the display
//!   form; an empty name becomes `general`; names are cut to 64 characters.
//! - Ops are processed in group order (then proposal order), so the result does
//!   not depend on the order in which parallel groups finished.
//!
//! # Duplicates
//! Two ops are duplicates when their texts carry the same insight
//! ([`super::same_insight`]).
//! ADDs are clustered single-linkage (a new ADD joins the first cluster holding
//! any member it matches), across sections. A cluster keeps its most specific
//! text — most distinct words, then most characters, then earliest — with that
//! text's section, and records every group it came from (provenance).
//!
//! # Conflicts on one bullet id
//! UPDATEs of one id are clustered the same way. If REMOVEs of the id come from
//! at least as many distinct groups as all UPDATEs of it together, the REMOVE
//! wins; otherwise the UPDATE cluster backed by the most groups wins (ties: the
//! more specific text, then the earliest). Losers are kept in
//! [`MergedOp::overruled`] so a round can show what it discarded.

use std::collections::{BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use super::same_insight::{Fingerprint, collapse_whitespace, section_display, section_key};
use crate::domain::DeltaOp;

/// One operation after the level-2 merge, with where it came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergedOp {
    pub op: DeltaOp,
    /// Distinct groups that proposed this op or a duplicate of it, ascending.
    pub groups: Vec<usize>,
    /// How many raw proposals were folded into this op.
    pub proposals: usize,
    /// Conflicting ops on the same bullet id that lost to this one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overruled: Vec<Overruled>,
    /// Provenance: the round's reflections (indices into the round's list) that
    /// the folded proposals cited as their sources, ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<usize>,
}

impl MergedOp {
    /// An op proposed by a single group, as is (for callers that skip the merge).
    pub fn single(group: usize, op: DeltaOp) -> Self {
        Self { op, groups: vec![group], proposals: 1, overruled: Vec::new(), sources: Vec::new() }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Overruled {
    pub op: DeltaOp,
    pub groups: Vec<usize>,
}

/// One group's operation as proposed, before it joins a cluster of duplicates.
#[derive(Debug, Clone)]
struct ProposedOp {
    seq: usize,
    group: usize,
    op: DeltaOp,
    fp: Fingerprint,
    sources: Vec<usize>,
}

#[derive(Debug, Clone)]
struct Cluster {
    members: Vec<ProposedOp>,
}

impl Cluster {
    fn matches(&self, fp: &Fingerprint) -> bool {
        self.members.iter().any(|m| m.fp.same_insight(fp))
    }

    fn first_seq(&self) -> usize {
        self.members[0].seq
    }

    fn groups(&self) -> Vec<usize> {
        let set: BTreeSet<usize> = self.members.iter().map(|m| m.group).collect();
        set.into_iter().collect()
    }

    /// The most specific member, ties to the earliest; its reason falls back to
    /// the first non-empty reason of the cluster.
    fn representative(&self) -> DeltaOp {
        let best = self
            .members
            .iter()
            .max_by(|a, b| a.fp.specificity().cmp(&b.fp.specificity()).then(b.seq.cmp(&a.seq)))
            .expect("clusters are never empty");
        let fallback = self.members.iter().map(|m| reason_of(&m.op)).find(|r| !r.is_empty()).unwrap_or("");
        let mut op = best.op.clone();
        if let DeltaOp::Add { reason, .. } | DeltaOp::Update { reason, .. } | DeltaOp::Remove { reason, .. } = &mut op
            && reason.is_empty()
        {
            *reason = fallback.to_owned();
        }
        op
    }

    fn merged(&self) -> MergedOp {
        let sources: BTreeSet<usize> = self.members.iter().flat_map(|m| m.sources.iter().copied()).collect();
        MergedOp {
            op: self.representative(),
            groups: self.groups(),
            proposals: self.members.len(),
            overruled: vec![],
            sources: sources.into_iter().collect(),
        }
    }
}

fn reason_of(op: &DeltaOp) -> &str {
    match op {
        DeltaOp::Add { reason, .. } | DeltaOp::Update { reason, .. } | DeltaOp::Remove { reason, .. } => reason,
    }
}

fn text_of(op: &DeltaOp) -> &str {
    match op {
        DeltaOp::Add { content, .. } | DeltaOp::Update { content, .. } => content,
        DeltaOp::Remove { id, .. } => id,
    }
}

fn push_clustered(clusters: &mut Vec<Cluster>, p: ProposedOp) {
    match clusters.iter_mut().find(|c| c.matches(&p.fp)) {
        Some(c) => c.members.push(p),
        None => clusters.push(Cluster { members: vec![p] }),
    }
}

/// Normalises one op; `None` when it is empty after normalisation.
/// `sections` maps a section key to its display form (first spelling wins).
fn normalize_one(op: DeltaOp, sections: &mut HashMap<String, String>) -> Option<DeltaOp> {
    Some(match op {
        DeltaOp::Add { section, content, reason } => {
            let content = collapse_whitespace(&content);
            if content.is_empty() {
                return None;
            }
            let display = section_display(&section);
            let section = sections.entry(section_key(&display)).or_insert(display).clone();
            DeltaOp::Add { section, content, reason: collapse_whitespace(&reason) }
        }
        DeltaOp::Update { id, content, reason } => {
            let (id, content) = (id.trim().to_owned(), collapse_whitespace(&content));
            if id.is_empty() || content.is_empty() {
                return None;
            }
            DeltaOp::Update { id, content, reason: collapse_whitespace(&reason) }
        }
        DeltaOp::Remove { id, reason } => {
            let id = id.trim().to_owned();
            if id.is_empty() {
                return None;
            }
            DeltaOp::Remove { id, reason: collapse_whitespace(&reason) }
        }
    })
}

/// The level-2 merge: `(group index, op)` pairs from every group in, one
/// de-duplicated, conflict-free list out, ordered by first proposal.
pub fn normalize_ops(ops: Vec<(usize, DeltaOp)>) -> Vec<MergedOp> {
    normalize_sourced_ops(ops.into_iter().map(|(g, op)| (g, op, Vec::new())).collect())
}

/// [`normalize_ops`] for ops that cite their source reflections (indices into the
/// round's list): a merged op carries the union of the sources of the proposals
/// folded into it; an overruled op's sources are not carried.
pub fn normalize_sourced_ops(ops: Vec<(usize, DeltaOp, Vec<usize>)>) -> Vec<MergedOp> {
    let mut ops = ops;
    ops.sort_by_key(|(g, _, _)| *g); // stable: keeps each group's own order

    let mut sections = HashMap::new();
    let mut adds: Vec<Cluster> = Vec::new();
    // Per bullet id: UPDATE clusters and REMOVE proposals, in first-seen order of ids.
    let mut id_order: Vec<String> = Vec::new();
    let mut updates: HashMap<String, Vec<Cluster>> = HashMap::new();
    let mut removes: HashMap<String, Cluster> = HashMap::new();

    for (seq, (group, op, sources)) in ops.into_iter().enumerate() {
        let Some(op) = normalize_one(op, &mut sections) else { continue };
        let fp = Fingerprint::of(text_of(&op));
        let id = match &op {
            DeltaOp::Add { .. } => None,
            DeltaOp::Update { id, .. } | DeltaOp::Remove { id, .. } => Some(id.clone()),
        };
        let is_remove = matches!(op, DeltaOp::Remove { .. });
        let p = ProposedOp { seq, group, op, fp, sources };
        match id {
            None => push_clustered(&mut adds, p),
            Some(id) => {
                if !updates.contains_key(&id) && !removes.contains_key(&id) {
                    id_order.push(id.clone());
                }
                if is_remove {
                    removes.entry(id).or_insert_with(|| Cluster { members: vec![] }).members.push(p);
                } else {
                    push_clustered(updates.entry(id).or_default(), p);
                }
            }
        }
    }

    let mut out: Vec<(usize, MergedOp)> = adds.iter().map(|c| (c.first_seq(), c.merged())).collect();
    for id in id_order {
        let ups = updates.remove(&id).unwrap_or_default();
        let rem = removes.remove(&id);
        out.push(resolve_id_conflict(ups, rem));
    }
    out.sort_by_key(|(seq, _)| *seq);
    out.into_iter().map(|(_, m)| m).collect()
}

/// Picks the one op applied to a bullet id (rules in the module doc); returns
/// it with the sequence number it is ordered by.
fn resolve_id_conflict(mut ups: Vec<Cluster>, rem: Option<Cluster>) -> (usize, MergedOp) {
    let seq = ups.iter().chain(rem.as_ref()).map(Cluster::first_seq).min().unwrap_or(0);
    let overruled_of = |c: &Cluster| Overruled { op: c.representative(), groups: c.groups() };
    let update_groups: BTreeSet<usize> = ups.iter().flat_map(|c| c.members.iter().map(|m| m.group)).collect();
    let remove_wins = rem.as_ref().is_some_and(|r| r.groups().len() >= update_groups.len());
    let (winner, losers) = match rem {
        Some(rem) if remove_wins => (rem, ups),
        rem => {
            let winner = pick_update(&mut ups);
            ups.extend(rem);
            (winner, ups)
        }
    };
    let mut merged = winner.merged();
    merged.overruled = losers.iter().map(overruled_of).collect();
    (seq, merged)
}

/// Removes and returns the winning UPDATE cluster: most groups, then most
/// specific representative, then earliest.
fn pick_update(ups: &mut Vec<Cluster>) -> Cluster {
    let best = (0..ups.len())
        .max_by(|&a, &b| {
            let (ca, cb) = (&ups[a], &ups[b]);
            let spec = |c: &Cluster| Fingerprint::of(text_of(&c.representative())).specificity();
            ca.groups()
                .len()
                .cmp(&cb.groups().len())
                .then(spec(ca).cmp(&spec(cb)))
                .then(cb.first_seq().cmp(&ca.first_seq()))
        })
        .expect("an id without REMOVE has at least one UPDATE");
    ups.remove(best)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::domain::Playbook;
    use crate::learn::merge::apply::apply_ops;
    use crate::learn::merge::budget::Budget;
    use crate::learn::merge::same_insight::{DEFAULT_SECTION, same_insight};

    pub(crate) fn add(section: &str, content: &str) -> DeltaOp {
        DeltaOp::Add { section: section.into(), content: content.into(), reason: String::new() }
    }
    pub(crate) fn update(id: &str, content: &str) -> DeltaOp {
        DeltaOp::Update { id: id.into(), content: content.into(), reason: String::new() }
    }
    pub(crate) fn remove(id: &str) -> DeltaOp {
        DeltaOp::Remove { id: id.into(), reason: String::new() }
    }

    const LONG: &str = "Before submitting the final answer always validate the returned JSON payload against the documented response schema";

    #[test]
    fn normalisation_collapses_whitespace_drops_empties_and_unifies_sections() {
        let merged = normalize_ops(vec![
            (0, add("  Strategies ", "  Check   the\n date  ")),
            (1, add("strategies", "Prefer ISO dates")),
            (1, add("tips", "   ")),
            (2, update(" ", "x")),
            (2, add("", "Read the task twice")),
        ]);
        let ops: Vec<DeltaOp> = merged.into_iter().map(|m| m.op).collect();
        assert_eq!(
            ops,
            vec![
                add("Strategies", "Check the date"),
                add("Strategies", "Prefer ISO dates"),
                add(DEFAULT_SECTION, "Read the task twice")
            ]
        );
    }

    #[test]
    fn exact_duplicates_merge_with_provenance() {
        let merged = normalize_ops(vec![
            (2, add("tips", "Check the date.")),
            (0, add("tips", "check the DATE")),
            (0, add("tips", "Something else entirely")),
        ]);
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[0].groups, vec![0, 2]);
        assert_eq!(merged[0].proposals, 2);
        assert_eq!(merged[1].groups, vec![0]);
    }

    #[test]
    fn near_duplicates_merge_keeping_the_more_specific_text() {
        let longer = format!("{LONG} carefully");
        assert!(same_insight(LONG, &longer));
        let merged = normalize_ops(vec![(0, add("tips", LONG)), (3, add("other", &longer))]);
        assert_eq!(merged.len(), 1);
        assert_eq!(merged[0].op, add("other", &longer));
        assert_eq!(merged[0].groups, vec![0, 3]);
        // Below the threshold: two different pieces of advice stay apart.
        assert!(!same_insight("Check the date format", "Check the time zone"));
    }

    #[test]
    fn distinct_ids_and_numbers_never_merge() {
        // Ids are ordinary words with a digit: nothing about their format is special.
        let a = format!("{LONG} (ticket TK-a17)");
        let b = format!("{LONG} (ticket TK-b42)");
        assert!(!same_insight(&a, &b));
        assert!(!same_insight(&a, LONG));
        assert!(same_insight(&a, &format!("{LONG} (ticket tk-A17).")));
        assert!(!same_insight(&format!("{LONG} within 3 retries"), &format!("{LONG} within 5 retries")));
        let merged = normalize_ops(vec![(0, add("tips", &a)), (1, add("tips", &b)), (2, add("tips", &a))]);
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[0].groups, vec![0, 2]);
    }

    #[test]
    fn many_distinct_markers_all_survive() {
        let ops = (0..50)
            .map(|i| (i % 7, add("facts", &format!("The answer to task family {LONG} is INSIGHT-q{i}x"))))
            .collect();
        assert_eq!(normalize_ops(ops).len(), 50);
    }

    #[test]
    fn sources_follow_ops_through_the_merge_and_onto_the_playbook() {
        let longer = format!("{LONG} carefully");
        let merged = normalize_sourced_ops(vec![
            (0, add("tips", LONG), vec![3]),
            (1, add("tips", &longer), vec![0, 3]),
            (1, update("b-0001", "loser"), vec![5]),
            (2, remove("b-0001"), vec![6]),
            (3, remove("b-0001"), vec![8]),
        ]);
        assert_eq!(merged[0].sources, vec![0, 3], "a cluster cites the union of its members' sources");
        assert_eq!(merged[1].sources, vec![6, 8], "an overruled op's sources are not carried");
        let out = apply_ops(&Playbook::default(), &merged, &Budget::default());
        let add_applied = out.applied.iter().find(|a| matches!(a.op, DeltaOp::Add { .. })).unwrap();
        assert_eq!(add_applied.sources, vec![0, 3], "{out:?}");
    }

    #[test]
    fn remove_wins_only_with_at_least_as_many_groups() {
        let merged =
            normalize_ops(vec![(0, update("b-0001", "new text")), (1, remove("b-0001")), (2, remove("b-0001"))]);
        assert_eq!(merged.len(), 1);
        assert_eq!(merged[0].op, remove("b-0001"));
        assert_eq!(merged[0].groups, vec![1, 2]);
        assert_eq!(merged[0].overruled.len(), 1);

        let tie = normalize_ops(vec![(0, update("b-0001", "new text")), (1, remove("b-0001"))]);
        assert_eq!(tie[0].op, remove("b-0001"));

        let merged = normalize_ops(vec![
            (0, update("b-0001", "new text")),
            (1, update("b-0001", "other text")),
            (2, remove("b-0001")),
        ]);
        assert!(matches!(merged[0].op, DeltaOp::Update { .. }));
        assert_eq!(merged[0].overruled.len(), 2);
    }

    #[test]
    fn conflicting_updates_pick_the_most_backed_text() {
        let merged = normalize_ops(vec![
            (0, update("b-0002", "Use the v2 endpoint for all writes")),
            (1, update("b-0002", "Never write")),
            (2, update("b-0002", "Use the v2 endpoint for all writes")),
        ]);
        assert_eq!(merged.len(), 1);
        assert_eq!(merged[0].op, update("b-0002", "Use the v2 endpoint for all writes"));
        assert_eq!(merged[0].groups, vec![0, 2]);
        assert_eq!(merged[0].overruled, vec![Overruled { op: update("b-0002", "Never write"), groups: vec![1] }]);
    }

    #[test]
    fn merge_does_not_depend_on_group_arrival_order() {
        let groups = [
            vec![(0, add("tips", "Alpha insight here"))],
            vec![(1, add("Tips", "Beta insight here")), (1, remove("b-0003"))],
            vec![(2, update("b-0003", "Gamma")), (2, add("tips", "alpha insight here"))],
        ];
        let in_order: Vec<_> = groups.iter().flatten().cloned().collect();
        let finished_late_first: Vec<_> = [2, 0, 1].iter().flat_map(|&g| groups[g].clone()).collect();
        let a = normalize_ops(in_order);
        assert_eq!(a, normalize_ops(finished_late_first));
        assert_eq!(a[0].groups, vec![0, 2]);
        assert_eq!(a[1].op, add("tips", "Beta insight here"), "first spelling of a section (group order) wins");
    }
}
