//! Level 2 of the reduce, its LLM-assisted merges planned as pure functions
//! (the calls are made by the round's reduce step), built so that no LLM call ever has to restate the
//! union of what the groups learned. A model keeps only so many new lessons per
//! answer (the "context overload" the Combee paper measures); a level 2 that asks
//! one call to rewrite all k group results therefore loses most of them again,
//! however well level 1 did. So every level-2 call here writes only what it
//! *changes*, and everything else is carried over mechanically:
//!
//! - **Playbook, `reduce = "llm"`: consolidation by decisions.** The groups'
//!   operations (after the deterministic union and de-duplication) are numbered
//!   `o1…oN` and shown to the aggregator, which answers with decisions only —
//!   `merge` several ops into one new text, `edit` one op's text, `drop` ops —
//!   by op id. Operations no decision mentions pass through unchanged, so a
//!   lesson is lost only if the model actively drops or merges it away, never
//!   because the answer ran out of room. Calls have a bounded fan-in
//!   ([`CONSOLIDATE_MAX_OPS`] ops; larger unions are cut into chunks of related
//!   ops — same section or bullet — consolidated in parallel).
//! - **Rewrite: a structural k-way merge against the base.** Each group's
//!   proposed instruction is diffed line by line against the frozen base. Hunks
//!   no other group touches are applied as they are; insertions several groups
//!   made at the same place are concatenated (lines another group already
//!   inserted there verbatim are not repeated); only regions where groups changed
//!   the *same* base lines differently go to an LLM, one small call per region
//!   with just that passage and its variants, merged in a tree of fan-in
//!   [`REGION_FAN_IN`]. A model that rewrites everything (every group changing
//!   the whole text) makes the whole text one conflict region — the paper's
//!   single merge call, as the worst case rather than the rule.
//!
//! Everything here is a pure function; `round` makes the calls.

use std::collections::{BTreeSet, HashSet};
use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::dedupe::{self, MergedOp, Overruled};
use crate::domain::DeltaOp;
use crate::learn::shuffle::grouping::split_contiguous;

/// Most operations one consolidation call is shown.
pub const CONSOLIDATE_MAX_OPS: usize = 80;
/// Most variants of one conflict region one merge call is shown.
pub const REGION_FAN_IN: usize = 4;
/// Longest text a decision may write (as a playbook bullet).
const MAX_DECISION_CHARS: usize = 2_000;

// ---------------------------------------------------------------------------
// Playbook: consolidation by decisions

/// What a consolidation decision does to the ops it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Two or more ops say the same thing: replace them by one op with `content`.
    Merge,
    /// Replace one op's text by `content`.
    Edit,
    /// Leave these ops out (redundant with the playbook, or wrong).
    Drop,
}

/// One decision of a consolidation answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    pub action: Action,
    /// Op ids as shown to the model (`o1`, `o2`, …).
    pub ops: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default)]
    pub reason: String,
}

/// The consolidation answer: decisions only; ops not mentioned are kept as they are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionsAnswer {
    pub decisions: Vec<Decision>,
}

/// An op dropped by a consolidation decision, for the round record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DroppedOp {
    pub op: DeltaOp,
    pub groups: Vec<usize>,
    pub reason: String,
}

/// The result of applying decisions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Consolidated {
    pub ops: Vec<MergedOp>,
    /// For each op of `ops`, the index of the input op it stands at (a merge: its first op).
    pub positions: Vec<usize>,
    pub dropped: Vec<DroppedOp>,
    /// How many ops were folded into merges (each merge counts its inputs).
    pub merged_inputs: usize,
    /// Calls whose answer could not be used: their ops passed through unchanged.
    pub degraded: Vec<DegradedCall>,
}

/// A level-2 call (a consolidation, or the merge of one rewrite passage) whose
/// answer stayed unreadable after its corrective retry. The round does not fail:
/// what the call was given is carried over as the deterministic union has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DegradedCall {
    /// Ops (consolidation) or passage versions (rewrite merge) the call was given.
    pub inputs: usize,
    /// Why its answer could not be used.
    pub error: String,
}

/// The id an op is shown under: `o1` for index 0.
pub fn op_label(i: usize) -> String {
    format!("o{}", i + 1)
}

fn parse_label(s: &str, n: usize) -> Option<usize> {
    let i: usize = s.trim().strip_prefix('o')?.parse().ok()?;
    (1..=n).contains(&i).then(|| i - 1)
}

fn check_text(text: Option<&str>) -> Result<&str, String> {
    let t = text.map(str::trim).filter(|t| !t.is_empty()).ok_or("a merge or edit needs a non-empty `content`")?;
    if t.contains(['\n', '\r']) {
        return Err("`content` must be a single line".into());
    }
    let n = t.chars().count();
    if n > MAX_DECISION_CHARS {
        return Err(format!("`content` is {n} characters; the limit is {MAX_DECISION_CHARS}"));
    }
    Ok(t)
}

/// Checks decisions against `n` numbered ops without applying them (the answer
/// validator: an invalid answer gets one corrective retry).
pub fn check_decisions(ops: &[MergedOp], answer: &DecisionsAnswer) -> Result<(), String> {
    apply_decisions(ops, &answer.decisions).map(|_| ())
}

/// Applies decisions to the numbered `ops`. Ops no decision names pass through
/// unchanged, in their order; a merge takes the place of its first op. A merge
/// combines ADDs (into the first op's section) or UPDATEs of one bullet; an
/// edit rewrites one ADD or UPDATE; a drop removes any ops. An op may appear in
/// at most one decision.
pub fn apply_decisions(ops: &[MergedOp], decisions: &[Decision]) -> Result<Consolidated, String> {
    let n = ops.len();
    // Per op: None = untouched; Some(d) = named by decision d.
    let mut owner: Vec<Option<usize>> = vec![None; n];
    let mut named: Vec<Vec<usize>> = Vec::with_capacity(decisions.len());
    for (d, dec) in decisions.iter().enumerate() {
        let mut idx = Vec::with_capacity(dec.ops.len());
        for label in &dec.ops {
            let i = parse_label(label, n)
                .ok_or_else(|| format!("{:?} is not one of the operations o1…o{n}", short(label)))?;
            if owner[i].is_some() {
                return Err(format!("{} is named by more than one decision", op_label(i)));
            }
            owner[i] = Some(d);
            idx.push(i);
        }
        if idx.is_empty() {
            return Err("a decision must name at least one operation".into());
        }
        match dec.action {
            Action::Drop => {}
            Action::Edit => {
                if idx.len() != 1 {
                    return Err("an edit names exactly one operation".into());
                }
                check_text(dec.content.as_deref())?;
                if matches!(ops[idx[0]].op, DeltaOp::Remove { .. }) {
                    return Err(format!("{} is a REMOVE; it has no text to edit", op_label(idx[0])));
                }
            }
            Action::Merge => {
                if idx.len() < 2 {
                    return Err("a merge names at least two operations".into());
                }
                check_text(dec.content.as_deref())?;
                let all_adds = idx.iter().all(|&i| matches!(ops[i].op, DeltaOp::Add { .. }));
                let update_ids: HashSet<&str> = idx
                    .iter()
                    .filter_map(|&i| match &ops[i].op {
                        DeltaOp::Update { id, .. } => Some(id.as_str()),
                        _ => None,
                    })
                    .collect();
                let one_bullet =
                    update_ids.len() == 1 && idx.iter().all(|&i| matches!(ops[i].op, DeltaOp::Update { .. }));
                if !(all_adds || one_bullet) {
                    return Err("a merge combines ADDs, or UPDATEs of the same bullet".into());
                }
            }
        }
        named.push(idx);
    }

    let mut out = Consolidated::default();
    for (i, op) in ops.iter().enumerate() {
        let Some(d) = owner[i] else {
            out.ops.push(op.clone());
            out.positions.push(i);
            continue;
        };
        let dec = &decisions[d];
        let idx = &named[d];
        match dec.action {
            Action::Drop => {
                out.dropped.push(DroppedOp { op: op.op.clone(), groups: op.groups.clone(), reason: dec.reason.clone() })
            }
            Action::Edit => {
                let text = check_text(dec.content.as_deref())?.to_owned();
                let mut edited = op.clone();
                edited.op = with_text(&op.op, text, &dec.reason);
                out.ops.push(edited);
                out.positions.push(i);
            }
            Action::Merge if idx.iter().min() == Some(&i) => {
                let text = check_text(dec.content.as_deref())?.to_owned();
                let groups: BTreeSet<usize> = idx.iter().flat_map(|&j| ops[j].groups.iter().copied()).collect();
                out.ops.push(MergedOp {
                    op: with_text(&op.op, text, &dec.reason),
                    groups: groups.into_iter().collect(),
                    proposals: idx.iter().map(|&j| ops[j].proposals).sum(),
                    overruled: idx.iter().flat_map(|&j| ops[j].overruled.iter().cloned()).collect(),
                    sources: idx
                        .iter()
                        .flat_map(|&j| ops[j].sources.iter().copied())
                        .collect::<BTreeSet<usize>>()
                        .into_iter()
                        .collect(),
                });
                out.positions.push(i);
                out.merged_inputs += idx.len();
            }
            Action::Merge => {} // folded into the merge at its first op
        }
    }
    Ok(out)
}

fn with_text(op: &DeltaOp, content: String, reason: &str) -> DeltaOp {
    let reason = if reason.trim().is_empty() { "consolidated".to_owned() } else { reason.trim().to_owned() };
    match op {
        DeltaOp::Add { section, .. } => DeltaOp::Add { section: section.clone(), content, reason },
        DeltaOp::Update { id, .. } => DeltaOp::Update { id: id.clone(), content, reason },
        DeltaOp::Remove { id, .. } => DeltaOp::Remove { id: id.clone(), reason },
    }
}

/// Splits `ops` into consolidation calls of at most `max` ops each, keeping
/// related ops (same section for ADDs, same bullet for UPDATE/REMOVE) together:
/// index lists into `ops`, each in the ops' own order.
pub fn consolidation_chunks(ops: &[MergedOp], max: usize) -> Vec<Vec<usize>> {
    let n = ops.len();
    if n == 0 {
        return Vec::new();
    }
    let key = |op: &DeltaOp| match op {
        DeltaOp::Add { section, .. } => (0, section.to_lowercase()),
        DeltaOp::Update { id, .. } | DeltaOp::Remove { id, .. } => (1, id.clone()),
    };
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| key(&ops[i].op)); // stable: ties keep their order
    let chunks = n.div_ceil(max.max(1));
    split_contiguous(n, chunks)
        .into_iter()
        .map(|r: Range<usize>| {
            let mut c = order[r].to_vec();
            c.sort_unstable();
            c
        })
        .collect()
}

/// The deterministic union of several nodes' ops (one scan-tree node's input):
/// duplicates across children fold as in the level-1 union, and each result
/// keeps the groups, proposal counts and sources of everything folded into it.
pub fn union_of_nodes(children: Vec<Vec<MergedOp>>) -> Vec<MergedOp> {
    let flat: Vec<MergedOp> = children.into_iter().flatten().collect();
    // Each flat op enters the union as "group" = its position, mapped back below.
    let raw = flat.iter().enumerate().map(|(i, m)| (i, m.op.clone(), m.sources.clone())).collect();
    let groups_of = |idx: &[usize]| -> Vec<usize> {
        idx.iter().flat_map(|&i| flat[i].groups.iter().copied()).collect::<BTreeSet<usize>>().into_iter().collect()
    };
    dedupe::normalize_sourced_ops(raw)
        .into_iter()
        .map(|m| {
            let mut overruled: Vec<Overruled> =
                m.overruled.iter().map(|o| Overruled { op: o.op.clone(), groups: groups_of(&o.groups) }).collect();
            overruled.extend(m.groups.iter().flat_map(|&i| flat[i].overruled.iter().cloned()));
            MergedOp {
                groups: groups_of(&m.groups),
                proposals: m.groups.iter().map(|&i| flat[i].proposals).sum(),
                overruled,
                sources: m.sources,
                op: m.op,
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Rewrite: structural k-way merge against the base

/// One change of a proposal against the base: base lines `start..end` replaced
/// by `lines` (`start == end`: a pure insertion before base line `start`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hunk {
    pub start: usize,
    pub end: usize,
    pub lines: Vec<String>,
}

/// The line hunks turning `base` into `proposal` (Myers diff).
pub fn hunks(base: &[&str], proposal: &[&str]) -> Vec<Hunk> {
    let mut out: Vec<Hunk> = Vec::new();
    for op in similar::capture_diff_slices(similar::Algorithm::Myers, base, proposal) {
        let (old, new) = (op.old_range(), op.new_range());
        if matches!(op, similar::DiffOp::Equal { .. }) {
            continue;
        }
        let lines: Vec<String> = proposal[new].iter().map(|s| (*s).to_owned()).collect();
        match out.last_mut() {
            // Adjacent delete + insert of one change come as separate ops: join them.
            Some(last) if last.end == old.start => {
                last.end = old.end;
                last.lines.extend(lines);
            }
            _ => out.push(Hunk { start: old.start, end: old.end, lines }),
        }
    }
    out
}

/// One piece of the merged text: settled mechanically, or a region where the
/// groups changed the same base lines differently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Settled(Vec<String>),
    Conflict {
        /// The base lines of the region.
        base: Vec<String>,
        /// Each distinct version of the region the groups proposed (≥ 2).
        variants: Vec<Vec<String>>,
    },
}

/// Hunks of several proposals over one base region `start..end`: `(start, end, [(proposal, hunk)])`.
type HunkCluster = (usize, usize, Vec<(usize, Hunk)>);

/// `text` as lines, exactly: joining them with `\n` gives `text` back.
pub fn split_lines(text: &str) -> Vec<&str> {
    text.split('\n').collect()
}

/// The k-way merge plan of `proposals` against `base` (see the module doc).
pub fn plan_rewrite_merge(base: &str, proposals: &[String]) -> Vec<Piece> {
    let base_lines = split_lines(base);
    // (proposal, hunk), ordered by position in the base.
    let mut all: Vec<(usize, Hunk)> = proposals
        .iter()
        .enumerate()
        .flat_map(|(g, p)| hunks(&base_lines, &split_lines(p)).into_iter().map(move |h| (g, h)))
        .collect();
    all.sort_by_key(|(g, h)| (h.start, h.end, *g));

    // Clusters of hunks whose base ranges overlap; an insertion at a region's
    // edge belongs to it (its place relative to the change is ambiguous), two
    // changes of adjacent lines do not.
    let mut clusters: Vec<HunkCluster> = Vec::new();
    for (g, h) in all {
        let joins = clusters.last().is_some_and(|(_, end, members)| {
            let insertion_at_end = members.iter().any(|(_, m)| m.start == m.end && m.start == *end);
            h.start < *end || (h.start == *end && (h.start == h.end || insertion_at_end))
        });
        match clusters.last_mut() {
            Some((_, end, members)) if joins => {
                *end = (*end).max(h.end);
                members.push((g, h));
            }
            _ => clusters.push((h.start, h.end, vec![(g, h)])),
        }
    }

    let owned = |r: Range<usize>| base_lines[r].iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let mut pieces = Vec::new();
    let mut at = 0;
    for (start, end, members) in clusters {
        if start > at {
            pieces.push(Piece::Settled(owned(at..start)));
        }
        // Each touching proposal's version of base[start..end].
        let mut variants: Vec<Vec<String>> = Vec::new();
        let touching: BTreeSet<usize> = members.iter().map(|(g, _)| *g).collect();
        for g in &touching {
            let mut v = Vec::new();
            let mut pos = start;
            for (_, h) in members.iter().filter(|(m, _)| m == g) {
                v.extend(owned(pos..h.start));
                v.extend(h.lines.iter().cloned());
                pos = h.end;
            }
            v.extend(owned(pos..end));
            if !variants.contains(&v) {
                variants.push(v);
            }
        }
        let all_insertions = start == end;
        pieces.push(if variants.len() == 1 {
            Piece::Settled(variants.remove(0))
        } else if all_insertions {
            Piece::Settled(union_of_insertions(&variants))
        } else {
            Piece::Conflict { base: owned(start..end), variants }
        });
        at = end;
    }
    if at < base_lines.len() {
        pieces.push(Piece::Settled(owned(at..base_lines.len())));
    }
    pieces
}

/// Insertions several groups made at one place: the first in full, then each
/// other's lines not already inserted there (blank lines at their edges trimmed).
pub fn union_of_insertions(variants: &[Vec<String>]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    for v in variants {
        let fresh: Vec<&String> = v.iter().filter(|l| l.trim().is_empty() || !seen.contains(l.trim())).collect();
        let first = fresh.iter().position(|l| !l.trim().is_empty());
        let last = fresh.iter().rposition(|l| !l.trim().is_empty());
        let keep: &[&String] = match (out.is_empty(), first, last) {
            (true, _, _) => &fresh,
            (false, Some(a), Some(b)) => &fresh[a..=b],
            (false, _, _) => &[],
        };
        for l in keep {
            if !l.trim().is_empty() {
                seen.insert(l.trim().to_owned());
            }
            out.push((*l).clone());
        }
    }
    out
}

/// The deterministic union of several versions of one passage, used when the
/// model's merge of them cannot be read: every line of the first version, then
/// the lines of each later version that no earlier one has, in order. Nothing a
/// group wrote is lost; contradictions stay side by side for a person to settle.
pub fn union_of_lines(versions: &[String]) -> String {
    let mut seen: HashSet<&str> = HashSet::new();
    let mut out: Vec<&str> = Vec::new();
    for v in versions {
        for line in split_lines(v) {
            if line.trim().is_empty() || seen.insert(line) {
                out.push(line);
            }
        }
    }
    out.join("\n")
}

/// The conflict regions of a plan, in order: `(base text, variant texts)`.
pub fn conflicts(pieces: &[Piece]) -> Vec<(String, Vec<String>)> {
    pieces
        .iter()
        .filter_map(|p| match p {
            Piece::Conflict { base, variants } => {
                Some((base.join("\n"), variants.iter().map(|v| v.join("\n")).collect()))
            }
            Piece::Settled(_) => None,
        })
        .collect()
}

/// The merged text: settled pieces as they are, conflict regions replaced by
/// `resolved` in order. `None` when `resolved` does not match the conflicts.
pub fn assemble(pieces: &[Piece], resolved: &[String]) -> Option<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut next = resolved.iter();
    for p in pieces {
        match p {
            Piece::Settled(l) => lines.extend(l.iter().cloned()),
            Piece::Conflict { .. } => lines.extend(split_lines(next.next()?).into_iter().map(str::to_owned)),
        }
    }
    next.next().is_none().then(|| lines.join("\n"))
}

/// How a tree of fan-in `fan_in` cuts `n` variants into merge calls at one level:
/// ranges of at most `fan_in`; a range of one needs no call.
pub fn tree_level(n: usize, fan_in: usize) -> Vec<Range<usize>> {
    split_contiguous(n, n.div_ceil(fan_in.max(2)))
}

/// A scan tree of bounded fan-in over `leaves` inputs: one entry per level
/// above the leaves, each the ranges (into the level below) that one node
/// merges, until a single root. `leaves <= fan_in` is one node (the paper's
/// single level-2 merge); no leaves, no levels. Every input reaches the root
/// through exactly one node per level.
pub fn scan_tree(leaves: usize, fan_in: usize) -> Vec<Vec<Range<usize>>> {
    let mut levels = Vec::new();
    let mut width = leaves;
    while width > 0 {
        let level = tree_level(width, fan_in);
        width = level.len();
        levels.push(level);
        if width == 1 {
            break;
        }
    }
    levels
}

fn short(s: &str) -> String {
    s.chars().take(20).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(section: &str, content: &str, group: usize) -> MergedOp {
        MergedOp::single(
            group,
            DeltaOp::Add { section: section.into(), content: content.into(), reason: String::new() },
        )
    }

    fn upd(id: &str, content: &str, group: usize) -> MergedOp {
        MergedOp::single(group, DeltaOp::Update { id: id.into(), content: content.into(), reason: String::new() })
    }

    fn dec(action: Action, ops: &[&str], content: Option<&str>) -> Decision {
        Decision {
            action,
            ops: ops.iter().map(|s| (*s).to_owned()).collect(),
            content: content.map(str::to_owned),
            reason: "r".into(),
        }
    }

    fn texts(c: &Consolidated) -> Vec<String> {
        c.ops
            .iter()
            .map(|m| match &m.op {
                DeltaOp::Add { content, .. } | DeltaOp::Update { content, .. } => content.clone(),
                DeltaOp::Remove { id, .. } => format!("remove {id}"),
            })
            .collect()
    }

    #[test]
    fn ops_no_decision_mentions_pass_through_unchanged() {
        let ops = vec![add("s", "a", 0), add("s", "b", 1), add("t", "c", 2)];
        let c = apply_decisions(&ops, &[]).unwrap();
        assert_eq!(c.ops, ops);
        let c = apply_decisions(&ops, &[dec(Action::Drop, &["o2"], None)]).unwrap();
        assert_eq!(texts(&c), ["a", "c"]);
        assert_eq!((c.dropped.len(), c.dropped[0].groups.as_slice()), (1, &[1][..]));
    }

    #[test]
    fn a_merge_takes_the_place_of_its_first_op_and_keeps_provenance() {
        let ops = vec![add("s", "a", 0), add("s", "b", 1), add("t", "a again", 2), add("s", "d", 3)];
        let c = apply_decisions(&ops, &[dec(Action::Merge, &["o3", "o1"], Some("a, merged"))]).unwrap();
        assert_eq!(texts(&c), ["a, merged", "b", "d"]);
        assert_eq!(c.positions, [0, 1, 3]);
        assert_eq!(c.ops[0].groups, vec![0, 2]);
        assert_eq!((c.ops[0].proposals, c.merged_inputs), (2, 2));
        assert!(matches!(&c.ops[0].op, DeltaOp::Add { section, .. } if section == "s"));
        let c = apply_decisions(&ops, &[dec(Action::Edit, &["o4"], Some("d, sharper"))]).unwrap();
        assert_eq!(texts(&c), ["a", "b", "a again", "d, sharper"]);
    }

    #[test]
    fn invalid_decisions_are_rejected_with_a_reason() {
        let ops = vec![
            add("s", "a", 0),
            add("s", "b", 1),
            upd("b-0001", "x", 0),
            upd("b-0002", "y", 1),
            MergedOp::single(0, DeltaOp::Remove { id: "b-0003".into(), reason: String::new() }),
        ];
        for (bad, why) in [
            (vec![dec(Action::Drop, &["o9"], None)], "not one of"),
            (vec![dec(Action::Drop, &["x1"], None)], "not one of"),
            (vec![dec(Action::Drop, &["o1"], None), dec(Action::Drop, &["o1"], None)], "more than one"),
            (vec![dec(Action::Merge, &["o1"], Some("m"))], "at least two"),
            (vec![dec(Action::Merge, &["o1", "o2"], None)], "content"),
            (vec![dec(Action::Merge, &["o1", "o2"], Some("two\nlines"))], "single line"),
            (vec![dec(Action::Merge, &["o1", "o3"], Some("m"))], "combines"),
            (vec![dec(Action::Merge, &["o3", "o4"], Some("m"))], "combines"),
            (vec![dec(Action::Edit, &["o1", "o2"], Some("m"))], "exactly one"),
            (vec![dec(Action::Edit, &["o5"], Some("m"))], "REMOVE"),
            (vec![dec(Action::Drop, &[], None)], "at least one"),
        ] {
            let err = apply_decisions(&ops, &bad).unwrap_err();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
        let same_bullet = vec![upd("b-0001", "x", 0), upd("b-0001", "x2", 1)];
        let c = apply_decisions(&same_bullet, &[dec(Action::Merge, &["o1", "o2"], Some("x merged"))]).unwrap();
        assert_eq!(texts(&c), ["x merged"]);
    }

    #[test]
    fn chunks_are_bounded_and_keep_sections_together() {
        let ops: Vec<MergedOp> = (0..10).map(|i| add(if i % 2 == 0 { "even" } else { "odd" }, "x", i)).collect();
        let chunks = consolidation_chunks(&ops, 5);
        assert_eq!(chunks, vec![vec![0, 2, 4, 6, 8], vec![1, 3, 5, 7, 9]]);
        let chunks = consolidation_chunks(&ops, 4);
        assert_eq!(chunks.len(), 3);
        assert!(chunks.iter().all(|c| c.len() <= 4));
        let mut all: Vec<usize> = chunks.concat();
        all.sort_unstable();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        assert!(consolidation_chunks(&[], 5).is_empty());
        assert_eq!(consolidation_chunks(&ops, 100), vec![(0..10).collect::<Vec<_>>()]);
    }

    fn lines(s: &[&str]) -> String {
        s.join("\n")
    }

    #[test]
    fn hunks_of_a_diff() {
        let base = ["a", "b", "c"];
        assert_eq!(hunks(&base, &base), vec![]);
        assert_eq!(hunks(&base, &["a", "b", "c", "d"]), vec![Hunk { start: 3, end: 3, lines: vec!["d".into()] }]);
        assert_eq!(hunks(&base, &["a", "B", "c"]), vec![Hunk { start: 1, end: 2, lines: vec!["B".into()] }]);
        assert_eq!(hunks(&base, &["a", "c"]), vec![Hunk { start: 1, end: 2, lines: vec![] }]);
    }

    #[test]
    fn appended_lessons_of_every_group_are_all_kept_without_an_llm() {
        let base = "You answer {task}.";
        let proposals = vec![
            lines(&[base, "", "Lessons:", "- one", "- two"]),
            lines(&[base, "", "Lessons:", "- two", "- three"]),
            lines(&[base, "", "Lessons:", "- four"]),
        ];
        let plan = plan_rewrite_merge(base, &proposals);
        assert!(conflicts(&plan).is_empty(), "{plan:?}");
        let merged = assemble(&plan, &[]).unwrap();
        assert_eq!(merged, lines(&[base, "", "Lessons:", "- one", "- two", "- three", "- four"]));
    }

    #[test]
    fn separate_edits_apply_mechanically_and_only_real_conflicts_need_a_call() {
        let base = lines(&["intro", "rule 1", "rule 2", "rule 3", "outro"]);
        let a = lines(&["intro", "rule 1, sharper", "rule 2", "rule 3", "outro", "- lesson a"]);
        let b = lines(&["intro", "rule 1", "rule 2", "rule 3 (careful)", "outro", "- lesson b"]);
        let plan = plan_rewrite_merge(&base, &[a.clone(), b.clone()]);
        assert!(conflicts(&plan).is_empty(), "{plan:?}");
        assert_eq!(
            assemble(&plan, &[]).unwrap(),
            lines(&["intro", "rule 1, sharper", "rule 2", "rule 3 (careful)", "outro", "- lesson a", "- lesson b"])
        );
        // Both change rule 2, differently: one conflict region with two variants.
        let c = lines(&["intro", "rule 1", "rule 2 per C", "rule 3", "outro"]);
        let d = lines(&["intro", "rule 1", "rule 2 per D", "rule 3", "outro"]);
        let plan = plan_rewrite_merge(&base, &[c, d, a]);
        let cs = conflicts(&plan);
        assert_eq!(cs, vec![("rule 2".to_owned(), vec!["rule 2 per C".to_owned(), "rule 2 per D".to_owned()])]);
        let merged = assemble(&plan, &["rule 2 per C and D".to_owned()]).unwrap();
        assert_eq!(merged, lines(&["intro", "rule 1, sharper", "rule 2 per C and D", "rule 3", "outro", "- lesson a"]));
        assert_eq!(assemble(&plan, &[]), None, "a missing resolution is an error");
        assert_eq!(assemble(&plan, &["x".into(), "y".into()]), None, "so is an extra one");
    }

    #[test]
    fn identical_changes_are_applied_once_and_untouched_proposals_change_nothing() {
        let base = lines(&["a", "b"]);
        let same = lines(&["a", "B"]);
        let plan = plan_rewrite_merge(&base, &[same.clone(), same.clone(), base.clone()]);
        assert_eq!(assemble(&plan, &[]).unwrap(), same);
        assert_eq!(assemble(&plan_rewrite_merge(&base, std::slice::from_ref(&base)), &[]).unwrap(), base);
    }

    #[test]
    fn union_of_insertions_trims_blank_edges_of_later_ones() {
        let v = |s: &[&str]| s.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        let got = union_of_insertions(&[v(&["", "H:", "- a"]), v(&["", "H:", "- a", "- b", ""]), v(&["", "H:"])]);
        assert_eq!(got, v(&["", "H:", "- a", "- b"]));
    }

    #[test]
    fn merge_tree_levels_have_bounded_fan_in() {
        assert_eq!(tree_level(10, 4), vec![0..4, 4..7, 7..10]);
        assert_eq!(tree_level(3, 4), vec![0..3]);
        assert_eq!(tree_level(1, 4), vec![0..1]);
        assert!(tree_level(0, 4).is_empty());
    }

    #[test]
    fn scan_tree_has_bounded_fan_in_and_every_input_reaches_the_root_once() {
        for leaves in 1..=70 {
            for fan_in in 2..=9 {
                let tree = scan_tree(leaves, fan_in);
                // Levels: ⌈log_fan_in(leaves)⌉, at least one.
                let mut expect = 1;
                while fan_in.pow(expect) < leaves {
                    expect += 1;
                }
                assert_eq!(tree.len(), expect as usize, "leaves {leaves} fan-in {fan_in}");
                assert_eq!(tree.last().map(Vec::len), Some(1), "one root");
                // Follow each leaf up: every level covers the level below exactly once.
                let mut width = leaves;
                for level in &tree {
                    assert!(level.iter().all(|r| !r.is_empty() && r.len() <= fan_in));
                    let covered: Vec<usize> = level.iter().cloned().flatten().collect();
                    assert_eq!(covered, (0..width).collect::<Vec<_>>());
                    width = level.len();
                }
            }
        }
        assert!(scan_tree(0, 4).is_empty());
        // The paper's two levels are the special case k ≤ fan-in.
        assert_eq!(scan_tree(5, 8), vec![vec![0..5]]);
        assert_eq!(scan_tree(20, 4), vec![vec![0..4, 4..8, 8..12, 12..16, 16..20], vec![0..3, 3..5], vec![0..2]]);
    }

    #[test]
    fn the_union_of_nodes_folds_duplicates_across_children_and_keeps_provenance() {
        let mut a = add("s", "Check the date format", 0);
        a.sources = vec![1];
        let mut b = add("s", "Check the date format", 3);
        b.groups = vec![3, 4];
        b.proposals = 2;
        b.sources = vec![7];
        let c = add("t", "Unrelated", 5);
        let out = union_of_nodes(vec![vec![a], vec![b, c]]);
        assert_eq!(
            texts(&Consolidated { ops: out.clone(), ..Default::default() }),
            ["Check the date format", "Unrelated"]
        );
        assert_eq!(out[0].groups, vec![0, 3, 4]);
        assert_eq!((out[0].proposals, out[0].sources.clone()), (3, vec![1, 7]));
        assert_eq!(out[1].groups, vec![5]);
    }

    #[test]
    fn a_merge_cites_the_sources_of_every_op_it_folds() {
        let mut a = add("s", "Check the date format", 0);
        a.sources = vec![4, 1];
        let mut b = add("s", "Check date formats", 1);
        b.sources = vec![1, 7];
        let mut c = add("s", "Unrelated", 2);
        c.sources = vec![9];
        let out =
            apply_decisions(&[a, b, c], &[dec(Action::Merge, &["o1", "o2"], Some("Check the date format"))]).unwrap();
        assert_eq!(out.ops[0].sources, vec![1, 4, 7]);
        assert_eq!(out.ops[1].sources, vec![9], "an op no decision names keeps its sources");
    }
}
