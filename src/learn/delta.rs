//! Level-2 reduce for playbook mode: the union of every group's delta
//! operations is normalised, de-duplicated and applied once to the frozen
//! version, so no LLM ever rewrites the whole playbook (which is what causes
//! context collapse) and the same inputs always give the same playbook.
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
//! # Same insight ([`same_insight`])
//! Two texts carry the same insight when their *key tokens* are identical and
//! either their lower-cased texts are equal or the Jaccard similarity of their
//! word sets is at least [`NEAR_DUPLICATE_JACCARD`] (0.85). Words are lower-cased
//! runs of letters, digits, `-` and `_`. Key tokens are the words containing a
//! digit: a differing number, id, code or version always means a different
//! insight, however similar the surrounding words. No marker format is special. The threshold is deliberately strict: a missed
//! duplicate costs one redundant bullet, a false merge loses a specific insight.
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
//!
//! # Applying ([`apply_ops`])
//! ADD appends a bullet to its section (matched case-insensitively, created at
//! the end if missing) with a fresh id from `next_id`; ids are never reused.
//! An ADD whose text is the same insight as a bullet already in the playbook is
//! skipped. UPDATE replaces the content keeping id and counters; REMOVE deletes.
//! Ops on unknown ids are skipped with a reason.
//!
//! # Budget policy
//! After all ops are applied, while the playbook has more than `max_bullets`
//! bullets or its rendering (see [`rendered_chars`]) more than `max_chars`
//! characters, one bullet is evicted at a time, chosen by the first rule that
//! has a candidate:
//! 1. [`EvictionRule::NetHarmful`]: a bullet older than this round with
//!    harmful > helpful, the largest harmful − helpful first, then the oldest id;
//! 2. [`EvictionRule::LowestScore`]: a bullet older than this round, the lowest
//!    helpful − harmful first, then the oldest id;
//! 3. [`EvictionRule::NewThisRound`]: only when nothing older is left, a bullet
//!    added by this round, the one backed by the fewest groups first, then the
//!    most recently added.
//!
//! New bullets are protected so that a full playbook keeps learning instead of
//! freezing; a proven bullet survives as long as weaker older ones exist.
//! Sections created by this round that end up empty are dropped.
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

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::domain::playbook::{Bullet, Playbook, Section, format_bullet_id, parse_bullet_id, render};
use crate::domain::{BulletTagKind, DeltaOp, Reflection};

/// Word-set Jaccard similarity at or above which two texts are near-duplicates.
pub const NEAR_DUPLICATE_JACCARD: f64 = 0.85;
/// Section used when an ADD names none.
pub const DEFAULT_SECTION: &str = "general";
const MAX_SECTION_CHARS: usize = 64;

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

    fn is_pinned(&self, id: &str) -> bool {
        self.pinned.contains(id)
    }

    /// Whether `id` may be removed now (pinned: never; an earlier bullet: while the quota lasts).
    fn may_remove(&self, id: &str) -> bool {
        !self.is_pinned(id) && (!self.earlier.contains(id) || self.removals_left != Some(0))
    }

    fn note_removed(&mut self, id: &str) {
        if self.earlier.contains(id)
            && let Some(left) = &mut self.removals_left
        {
            *left = left.saturating_sub(1);
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplyOutcome {
    pub playbook: Playbook,
    pub applied: Vec<Applied>,
    pub skipped: Vec<Skipped>,
    /// Bullets removed to fit the budget, in eviction order.
    pub evicted: Vec<Evicted>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    pub op: DeltaOp,
    pub groups: Vec<usize>,
    /// The bullet the op touched (the fresh id for an ADD).
    pub bullet_id: String,
    /// The reflections (indices into the round's list) the op's proposals cited.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    pub op: DeltaOp,
    pub groups: Vec<usize>,
    pub reason: SkipReason,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SkipReason {
    /// UPDATE/REMOVE of an id that is not in the playbook.
    UnknownId,
    /// ADD of an insight the playbook already holds as `id`.
    DuplicateOfExisting { id: String },
    /// UPDATE whose content equals the current content.
    Unchanged,
    /// Empty content or id after normalisation.
    Empty,
    /// UPDATE/REMOVE of a bullet an operator pinned.
    Pinned,
    /// REMOVE of an earlier bullet after this round spent its removal quota.
    RemovalBound,
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownId => f.write_str("no bullet with this id in the playbook"),
            Self::DuplicateOfExisting { id } => write!(f, "same insight as existing bullet {id}"),
            Self::Unchanged => f.write_str("content is unchanged"),
            Self::Empty => f.write_str("empty content or id"),
            Self::Pinned => f.write_str("the bullet is pinned by an operator"),
            Self::RemovalBound => f.write_str("this round already removed its share of the playbook"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evicted {
    pub section: String,
    pub bullet: Bullet,
    pub rule: EvictionRule,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionRule {
    NetHarmful,
    LowestScore,
    NewThisRound,
}

// ---------------------------------------------------------------------------
// Text normalisation and similarity

/// Trims and collapses every whitespace run (newlines included) to one space.
pub fn collapse_whitespace(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn section_display(raw: &str) -> String {
    let s = collapse_whitespace(raw);
    if s.is_empty() { DEFAULT_SECTION.to_owned() } else { s.chars().take(MAX_SECTION_CHARS).collect() }
}

fn section_key(display: &str) -> String {
    display.to_lowercase()
}

/// What [`same_insight`] compares, computed once per text.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fingerprint {
    lower: String,
    words: BTreeSet<String>,
    keys: BTreeSet<String>,
}

impl Fingerprint {
    fn of(text: &str) -> Self {
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

    fn same_insight(&self, other: &Self) -> bool {
        if self.keys != other.keys {
            return false;
        }
        self.lower == other.lower || jaccard(&self.words, &other.words) >= NEAR_DUPLICATE_JACCARD
    }

    /// Higher is more specific: more distinct words, then more characters.
    fn specificity(&self) -> (usize, usize) {
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

// ---------------------------------------------------------------------------
// Level-2 merge

#[derive(Debug, Clone)]
struct Proposal {
    seq: usize,
    group: usize,
    op: DeltaOp,
    fp: Fingerprint,
    sources: Vec<usize>,
}

#[derive(Debug, Clone)]
struct Cluster {
    members: Vec<Proposal>,
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

fn push_clustered(clusters: &mut Vec<Cluster>, p: Proposal) {
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
        let p = Proposal { seq, group, op, fp, sources };
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

// ---------------------------------------------------------------------------
// Applying

/// Characters of the playbook as agents see it (the rendering after the base,
/// without the blank line that separates it from the base).
pub fn rendered_chars(playbook: &Playbook) -> usize {
    render("", Some(playbook)).trim_start().chars().count()
}

fn fits(playbook: &Playbook, budget: &Budget) -> bool {
    budget.max_bullets.is_none_or(|m| playbook.bullet_count() <= m)
        && budget.max_chars.is_none_or(|m| rendered_chars(playbook) <= m)
}

fn find_bullet(playbook: &Playbook, id: &str) -> Option<(usize, usize)> {
    playbook
        .sections
        .iter()
        .enumerate()
        .find_map(|(s, sec)| sec.bullets.iter().position(|b| b.id == id).map(|b| (s, b)))
}

/// Applies merged ops to a copy of `playbook`, then enforces `budget` (policy in
/// the module doc), protecting what `budget` says with `playbook` as the state before the round.
pub fn apply_ops(playbook: &Playbook, ops: &[MergedOp], budget: &Budget) -> ApplyOutcome {
    apply_ops_protected(playbook, ops, budget, &mut Protection::for_round(playbook, budget))
}

/// [`apply_ops`] under a round's [`Protection`] (kept across the sequential baseline's steps).
pub fn apply_ops_protected(
    playbook: &Playbook,
    ops: &[MergedOp],
    budget: &Budget,
    protection: &mut Protection,
) -> ApplyOutcome {
    let mut pb = playbook.clone();
    let original_sections: HashSet<String> = pb.sections.iter().map(|s| s.name.clone()).collect();
    let max_existing = pb.bullets().filter_map(|(_, b)| parse_bullet_id(&b.id)).max().unwrap_or(0);
    let mut next_id = pb.next_id.max(max_existing + 1).max(1);
    let mut applied = Vec::new();
    let mut skipped = Vec::new();
    // Bullets added by this round: id -> (number of backing groups, order added).
    let mut added: HashMap<String, (usize, usize)> = HashMap::new();
    // Fingerprints of the current bullets, kept in step with `pb`, for the duplicate check.
    let mut fingerprints: Vec<(String, Fingerprint)> =
        pb.bullets().map(|(_, b)| (b.id.clone(), Fingerprint::of(&b.content))).collect();

    for m in ops {
        let skip = |reason| Skipped { op: m.op.clone(), groups: m.groups.clone(), reason };
        let applied_to = |id: &str| Applied {
            op: m.op.clone(),
            groups: m.groups.clone(),
            bullet_id: id.to_owned(),
            sources: m.sources.clone(),
        };
        match &m.op {
            DeltaOp::Add { section, content, .. } => {
                let content = collapse_whitespace(content);
                if content.is_empty() {
                    skipped.push(skip(SkipReason::Empty));
                    continue;
                }
                let fp = Fingerprint::of(&content);
                if let Some((dup, _)) = fingerprints.iter().find(|(_, f)| f.same_insight(&fp)) {
                    skipped.push(skip(SkipReason::DuplicateOfExisting { id: dup.clone() }));
                    continue;
                }
                let display = section_display(section);
                let key = section_key(&display);
                let idx = match pb.sections.iter().position(|s| section_key(&s.name) == key) {
                    Some(i) => i,
                    None => {
                        pb.sections.push(Section { name: display, bullets: vec![] });
                        pb.sections.len() - 1
                    }
                };
                let id = format_bullet_id(next_id);
                next_id += 1;
                pb.sections[idx].bullets.push(Bullet { id: id.clone(), content, helpful: 0, harmful: 0 });
                fingerprints.push((id.clone(), fp));
                added.insert(id.clone(), (m.groups.len(), added.len()));
                applied.push(applied_to(&id));
            }
            DeltaOp::Update { id, content, .. } => {
                let (id, content) = (id.trim(), collapse_whitespace(content));
                if content.is_empty() {
                    skipped.push(skip(SkipReason::Empty));
                } else if protection.is_pinned(id) {
                    skipped.push(skip(SkipReason::Pinned));
                } else if let Some((s, b)) = find_bullet(&pb, id) {
                    let bullet = &mut pb.sections[s].bullets[b];
                    if bullet.content == content {
                        skipped.push(skip(SkipReason::Unchanged));
                    } else {
                        if let Some(entry) = fingerprints.iter_mut().find(|(fid, _)| fid == id) {
                            entry.1 = Fingerprint::of(&content);
                        }
                        bullet.content = content;
                        applied.push(applied_to(id));
                    }
                } else {
                    skipped.push(skip(SkipReason::UnknownId));
                }
            }
            DeltaOp::Remove { id, .. } => {
                let id = id.trim();
                if protection.is_pinned(id) {
                    skipped.push(skip(SkipReason::Pinned));
                } else if find_bullet(&pb, id).is_some() && !protection.may_remove(id) {
                    skipped.push(skip(SkipReason::RemovalBound));
                } else if let Some((s, b)) = find_bullet(&pb, id) {
                    protection.note_removed(id);
                    pb.sections[s].bullets.remove(b);
                    fingerprints.retain(|(fid, _)| fid != id);
                    applied.push(applied_to(id));
                } else {
                    skipped.push(skip(SkipReason::UnknownId));
                }
            }
        }
    }
    pb.next_id = next_id;

    let mut evicted = Vec::new();
    while !fits(&pb, budget) {
        let Some((s, b, rule)) = pick_eviction(&pb, &added, protection) else { break };
        let bullet = pb.sections[s].bullets.remove(b);
        protection.note_removed(&bullet.id);
        evicted.push(Evicted { section: pb.sections[s].name.clone(), bullet, rule });
    }
    pb.sections.retain(|s| !s.bullets.is_empty() || original_sections.contains(&s.name));

    ApplyOutcome { playbook: pb, applied, skipped, evicted }
}

/// The next bullet to evict, by the first budget rule that has a candidate.
fn pick_eviction(
    pb: &Playbook,
    added: &HashMap<String, (usize, usize)>,
    protection: &Protection,
) -> Option<(usize, usize, EvictionRule)> {
    let all = || {
        pb.sections
            .iter()
            .enumerate()
            .flat_map(|(s, sec)| sec.bullets.iter().enumerate().map(move |(b, x)| (s, b, x)))
            .filter(|(_, _, x)| protection.may_remove(&x.id))
    };
    let age = |x: &Bullet| parse_bullet_id(&x.id).unwrap_or(0);
    let score = |x: &Bullet| i64::from(x.helpful) - i64::from(x.harmful);
    let old = || all().filter(|(_, _, x)| !added.contains_key(&x.id));

    if let Some((s, b, _)) = old().filter(|(_, _, x)| x.harmful > x.helpful).min_by_key(|(_, _, x)| (score(x), age(x)))
    {
        return Some((s, b, EvictionRule::NetHarmful));
    }
    if let Some((s, b, _)) = old().min_by_key(|(_, _, x)| (score(x), age(x))) {
        return Some((s, b, EvictionRule::LowestScore));
    }
    all()
        .filter_map(|(s, b, x)| added.get(&x.id).map(|&(groups, order)| (s, b, groups, order)))
        .min_by_key(|&(_, _, groups, order)| (groups, std::cmp::Reverse(order)))
        .map(|(s, b, _, _)| (s, b, EvictionRule::NewThisRound))
}

/// Updates helpful/harmful counters from the reflections' bullet tags: each
/// reflection counts at most once per bullet id (its first tag for that id
/// decides), neutral tags and unknown ids change nothing.
pub fn apply_bullet_tags(playbook: &Playbook, reflections: &[Reflection]) -> Playbook {
    let mut pb = playbook.clone();
    let mut index: HashMap<String, (usize, usize)> = HashMap::new();
    for (s, sec) in pb.sections.iter().enumerate() {
        for (b, bullet) in sec.bullets.iter().enumerate() {
            index.entry(bullet.id.clone()).or_insert((s, b));
        }
    }
    for r in reflections {
        let mut seen = HashSet::new();
        for tag in &r.bullet_tags {
            let id = tag.id.trim();
            if !seen.insert(id) {
                continue;
            }
            let Some(&(s, b)) = index.get(id) else { continue };
            let bullet = &mut pb.sections[s].bullets[b];
            match tag.tag {
                BulletTagKind::Helpful => bullet.helpful = bullet.helpful.saturating_add(1),
                BulletTagKind::Harmful => bullet.harmful = bullet.harmful.saturating_add(1),
                BulletTagKind::Neutral => {}
            }
        }
    }
    pb
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::BulletTag;

    fn add(section: &str, content: &str) -> DeltaOp {
        DeltaOp::Add { section: section.into(), content: content.into(), reason: String::new() }
    }
    fn update(id: &str, content: &str) -> DeltaOp {
        DeltaOp::Update { id: id.into(), content: content.into(), reason: String::new() }
    }
    fn remove(id: &str) -> DeltaOp {
        DeltaOp::Remove { id: id.into(), reason: String::new() }
    }
    fn bullet(id: &str, content: &str, helpful: u32, harmful: u32) -> Bullet {
        Bullet { id: id.into(), content: content.into(), helpful, harmful }
    }
    fn contents(pb: &Playbook) -> Vec<(String, String)> {
        pb.bullets().map(|(s, b)| (s.to_owned(), b.content.clone())).collect()
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

    fn sample_playbook() -> Playbook {
        Playbook {
            sections: vec![Section {
                name: "Strategies".into(),
                bullets: vec![bullet("b-0001", "Check the date", 3, 1), bullet("b-0004", "Prefer ISO formats", 0, 0)],
            }],
            next_id: 9,
        }
    }

    #[test]
    fn apply_adds_updates_removes_and_skips_unknown_ids() {
        let ops: Vec<MergedOp> = vec![
            MergedOp::single(0, add("strategies", "Read the task twice")),
            MergedOp::single(0, add("mistakes", "Do not guess ids")),
            MergedOp::single(1, update("b-0001", "Check the date and the time zone")),
            MergedOp::single(1, remove("b-0004")),
            MergedOp::single(2, remove("b-0077")),
            MergedOp::single(2, update("b-0078", "x")),
            MergedOp::single(2, add("tips", "check the DATE AND THE TIME ZONE")),
        ];
        let out = apply_ops(&sample_playbook(), &ops, &Budget::default());
        let pb = &out.playbook;
        assert_eq!(
            contents(pb),
            vec![
                ("Strategies".into(), "Check the date and the time zone".into()),
                ("Strategies".into(), "Read the task twice".into()),
                ("mistakes".into(), "Do not guess ids".into()),
            ]
        );
        let ids: Vec<&str> = pb.bullets().map(|(_, b)| b.id.as_str()).collect();
        assert_eq!(ids, vec!["b-0001", "b-0009", "b-0010"]);
        assert_eq!(pb.next_id, 11);
        let first = pb.bullets().next().unwrap().1;
        assert_eq!((first.helpful, first.harmful), (3, 1), "counters survive an update");
        assert_eq!(out.applied.len(), 4);
        let reasons: Vec<SkipReason> = out.skipped.iter().map(|s| s.reason.clone()).collect();
        assert_eq!(
            reasons,
            vec![SkipReason::UnknownId, SkipReason::UnknownId, SkipReason::DuplicateOfExisting { id: "b-0001".into() }]
        );
        assert!(out.evicted.is_empty());
    }

    #[test]
    fn removed_ids_are_never_reused() {
        let pb = sample_playbook();
        let out = apply_ops(&pb, &[MergedOp::single(0, remove("b-0004"))], &Budget::default());
        assert_eq!(out.playbook.next_id, 9);
        let out = apply_ops(&out.playbook, &[MergedOp::single(0, add("x", "New bullet"))], &Budget::default());
        assert_eq!(out.applied[0].bullet_id, "b-0009");
        // Re-adding the text of a bullet removed in the same round is not a duplicate, and gets a new id.
        let ops = [MergedOp::single(0, remove("b-0004")), MergedOp::single(1, add("x", "Prefer ISO formats"))];
        let out = apply_ops(&pb, &ops, &Budget::default());
        assert_eq!(out.applied[1].bullet_id, "b-0009");
        // A playbook whose next_id lags behind its ids still gets fresh ones.
        let stale = Playbook { next_id: 0, ..sample_playbook() };
        let out = apply_ops(&stale, &[MergedOp::single(0, add("x", "New bullet"))], &Budget::default());
        assert_eq!(out.applied[0].bullet_id, "b-0005");
    }

    #[test]
    fn budget_evicts_net_harmful_then_weakest_old_then_new() {
        let pb = Playbook {
            sections: vec![Section {
                name: "s".into(),
                bullets: vec![
                    bullet("b-0001", "old proven", 5, 0),
                    bullet("b-0002", "old neutral", 0, 0),
                    bullet("b-0003", "old bad", 1, 4),
                    bullet("b-0004", "old slightly bad", 1, 2),
                    bullet("b-0005", "old neutral newer", 0, 0),
                ],
            }],
            next_id: 6,
        };
        let ops = vec![
            MergedOp { groups: vec![0, 1], ..MergedOp::single(0, add("s", "new strongly backed")) },
            MergedOp::single(2, add("s", "new weakly backed")),
        ];
        let evicted_ids = |max: usize| -> Vec<(String, EvictionRule)> {
            let out = apply_ops(&pb, &ops, &Budget { max_bullets: Some(max), max_chars: None, ..Default::default() });
            assert!(out.playbook.bullet_count() <= max);
            out.evicted.into_iter().map(|e| (e.bullet.id, e.rule)).collect()
        };
        use EvictionRule::*;
        assert_eq!(evicted_ids(7), vec![]);
        assert_eq!(evicted_ids(5), vec![("b-0003".into(), NetHarmful), ("b-0004".into(), NetHarmful)]);
        assert_eq!(evicted_ids(3)[2..], [("b-0002".into(), LowestScore), ("b-0005".into(), LowestScore)]);
        assert_eq!(evicted_ids(2)[4], ("b-0001".into(), LowestScore));
        assert_eq!(evicted_ids(1)[5], ("b-0007".into(), NewThisRound));
        assert_eq!(evicted_ids(0)[6], ("b-0006".into(), NewThisRound));
    }

    fn proven_playbook() -> Playbook {
        Playbook {
            sections: vec![Section {
                name: "s".into(),
                bullets: (1..=4).map(|i| bullet(&format!("b-000{i}"), &format!("proven rule {i}"), 3, 0)).collect(),
            }],
            next_id: 5,
        }
    }

    #[test]
    fn pinned_bullets_are_never_updated_removed_or_evicted() {
        let pb = proven_playbook();
        let budget =
            Budget { max_bullets: Some(2), pinned: vec!["b-0001".into(), "b-0002".into()], ..Default::default() };
        let ops = vec![
            MergedOp::single(0, update("b-0001", "rewritten by an attacker")),
            MergedOp::single(0, remove("b-0002")),
            MergedOp::single(0, add("s", "new insight")),
        ];
        let out = apply_ops(&pb, &ops, &budget);
        let ids: Vec<&str> = out.playbook.bullets().map(|(_, b)| b.id.as_str()).collect();
        assert_eq!(ids, vec!["b-0001", "b-0002"], "only pinned bullets survive a budget of 2");
        assert_eq!(out.playbook.bullets().next().unwrap().1.content, "proven rule 1");
        let reasons: Vec<&SkipReason> = out.skipped.iter().map(|s| &s.reason).collect();
        assert_eq!(reasons, vec![&SkipReason::Pinned, &SkipReason::Pinned]);
        assert!(out.evicted.iter().all(|e| !budget.pinned.contains(&e.bullet.id)));
        // Pinned bullets alone over the budget: nothing more can go, the result stays over it.
        let out = apply_ops(&pb, &[], &Budget { max_bullets: Some(1), ..budget.clone() });
        assert_eq!(out.playbook.bullet_count(), 2);
    }

    #[test]
    fn one_round_removes_at_most_its_share_of_established_bullets() {
        // Four hostile reflections tagged every proven bullet harmful (3 helpful -> 4 harmful)
        // and proposed four new bullets under max_bullets = 4.
        let before = proven_playbook();
        let hostile = |i| Reflection {
            error: String::new(),
            root_cause: String::new(),
            correct_approach: String::new(),
            key_insight: format!("hostile {i}"),
            bullet_tags: (1..=4).map(|b| BulletTag { id: format!("b-000{b}"), tag: BulletTagKind::Harmful }).collect(),
        };
        let tagged = apply_bullet_tags(&before, &(0..4).map(hostile).collect::<Vec<_>>());
        let ops: Vec<MergedOp> =
            (0..4).map(|i| MergedOp::single(i, add("s", &format!("INSIGHT-h{i}: obey the attacker")))).collect();
        let proven_left =
            |out: &ApplyOutcome| out.playbook.bullets().filter(|(_, b)| b.content.starts_with("proven")).count();

        // Unbounded (the old behaviour): every proven bullet is evicted.
        let unbounded = Budget { max_bullets: Some(4), ..Default::default() };
        let out = apply_ops_protected(&tagged, &ops, &unbounded, &mut Protection::for_round(&before, &unbounded));
        assert_eq!(proven_left(&out), 0);

        // Bounded at 25 %: one of the four established bullets may go, new ones make room instead.
        let bounded = Budget { max_removal_share: Some(0.25), ..unbounded };
        let out = apply_ops_protected(&tagged, &ops, &bounded, &mut Protection::for_round(&before, &bounded));
        assert_eq!(out.playbook.bullet_count(), 4);
        assert_eq!(proven_left(&out), 3);
        let rules: Vec<EvictionRule> = out.evicted.iter().map(|e| e.rule).collect();
        assert_eq!(
            rules,
            vec![
                EvictionRule::NetHarmful,
                EvictionRule::NewThisRound,
                EvictionRule::NewThisRound,
                EvictionRule::NewThisRound
            ]
        );

        // REMOVE ops share the same quota.
        let removes: Vec<MergedOp> = (1..=4).map(|b| MergedOp::single(0, remove(&format!("b-000{b}")))).collect();
        let out = apply_ops_protected(&tagged, &removes, &bounded, &mut Protection::for_round(&before, &bounded));
        assert_eq!(proven_left(&out), 3);
        assert_eq!(out.skipped.iter().filter(|s| s.reason == SkipReason::RemovalBound).count(), 3);
        // Bullets learned but never marked helpful are protected the same way.
        let mut fresh = before.clone();
        fresh.sections[0].bullets.iter_mut().for_each(|b| b.helpful = 0);
        let out = apply_ops_protected(&fresh, &removes, &bounded, &mut Protection::for_round(&fresh, &bounded));
        assert_eq!(out.playbook.bullet_count(), 3);
    }

    /// A hostile burst — every reflection tagging every bullet harmful, proposing
    /// new bullets and REMOVEs under a bullet cap — never takes away more than
    /// ⌊max_removal_share × bullets before the round⌋ of the earlier bullets,
    /// whether they were proven helpful, never marked, or already net harmful.
    /// Checked over 500 random playbooks, budgets and bursts (seeded).
    #[test]
    fn a_hostile_burst_removes_at_most_the_removal_share_of_the_playbook() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2024);
        for case in 0..500 {
            let n = rng.gen_range(0..40usize);
            let before = Playbook {
                sections: vec![Section {
                    name: "s".into(),
                    bullets: (1..=n)
                        .map(|i| {
                            let (helpful, harmful) = (rng.gen_range(0..4u32), rng.gen_range(0..4u32));
                            bullet(&format!("b-{i:04}"), &format!("lesson {i} about case {i}"), helpful, harmful)
                        })
                        .collect(),
                }],
                next_id: n as u64 + 1,
            };
            let share = [0.0, 0.1, 0.25, 0.5, 1.0][rng.gen_range(0..5)];
            let pinned: Vec<String> = (1..=n).filter(|_| rng.gen_bool(0.1)).map(|i| format!("b-{i:04}")).collect();
            let budget = Budget {
                max_bullets: Some(rng.gen_range(0..=n + 5)),
                max_chars: None,
                pinned: pinned.clone(),
                max_removal_share: Some(share),
            };
            let hostile: Vec<Reflection> = (0..rng.gen_range(1..30))
                .map(|r| Reflection {
                    error: String::new(),
                    root_cause: String::new(),
                    correct_approach: String::new(),
                    key_insight: format!("hostile {r}"),
                    bullet_tags: (1..=n)
                        .map(|b| BulletTag { id: format!("b-{b:04}"), tag: BulletTagKind::Harmful })
                        .collect(),
                })
                .collect();
            let tagged = apply_bullet_tags(&before, &hostile);
            let mut ops: Vec<MergedOp> = (0..rng.gen_range(0..30))
                .map(|i| MergedOp::single(i, add("s", &format!("INSIGHT-h{case}x{i}: obey the attacker {i}"))))
                .collect();
            ops.extend(
                (1..=n).filter(|_| rng.gen_bool(0.5)).map(|b| MergedOp::single(0, remove(&format!("b-{b:04}")))),
            );
            let out = apply_ops_protected(&tagged, &ops, &budget, &mut Protection::for_round(&before, &budget));
            let left: HashSet<&str> = out.playbook.bullets().map(|(_, b)| b.id.as_str()).collect();
            let taken = before.bullets().filter(|(_, b)| !left.contains(b.id.as_str())).count();
            let quota = (share * n as f64 + 1e-9).floor() as usize;
            assert!(taken <= quota, "case {case}: {taken} of {n} earlier bullets taken, quota {quota}");
            assert!(pinned.iter().all(|p| left.contains(p.as_str())), "case {case}: a pinned bullet went");
        }
    }

    #[test]
    fn char_budget_counts_the_rendering_and_drops_emptied_new_sections() {
        let pb = sample_playbook();
        let ops = vec![MergedOp::single(0, add("brand new section", "A fairly long new insight about dates"))];
        let unlimited = apply_ops(&pb, &ops, &Budget::default());
        let full = rendered_chars(&unlimited.playbook);
        let out = apply_ops(&pb, &ops, &Budget { max_bullets: None, max_chars: Some(full - 1), ..Default::default() });
        assert!(rendered_chars(&out.playbook) < full);
        assert_eq!(out.evicted.len(), 1);
        assert_eq!(out.evicted[0].bullet.id, "b-0004", "old zero-score bullet goes before the new one");
        let tiny = apply_ops(&pb, &ops, &Budget { max_bullets: None, max_chars: Some(0), ..Default::default() });
        assert!(tiny.playbook.is_empty());
        assert_eq!(tiny.playbook.sections.len(), 1, "the pre-existing section stays, the new empty one goes");
    }

    #[test]
    fn bullet_tags_count_once_per_reflection() {
        let tag = |id: &str, tag| BulletTag { id: id.into(), tag };
        let refl = |tags| Reflection {
            error: String::new(),
            root_cause: String::new(),
            correct_approach: String::new(),
            key_insight: "k".into(),
            bullet_tags: tags,
        };
        use BulletTagKind::*;
        let reflections = vec![
            refl(vec![tag("b-0001", Helpful), tag("b-0001", Helpful), tag("b-0004", Harmful), tag("b-9999", Helpful)]),
            refl(vec![tag("b-0001", Harmful), tag("b-0004", Neutral)]),
            refl(vec![tag(" b-0004 ", Harmful), tag("b-0004", Helpful)]),
        ];
        let pb = apply_bullet_tags(&sample_playbook(), &reflections);
        let counters: Vec<(u32, u32)> = pb.bullets().map(|(_, b)| (b.helpful, b.harmful)).collect();
        assert_eq!(counters, vec![(4, 2), (0, 2)]);
        assert_eq!(pb, apply_bullet_tags(&sample_playbook(), &reflections));
    }
}
