//! The last part of level 2 of the reduce: the merged operations are applied
//! once to a copy of the frozen playbook, then bullets are evicted until it
//! fits its budget; and, at the end of the map step, the reflections' bullet
//! tags update the helpful/harmful counters.
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

use std::collections::{HashMap, HashSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::budget::{Budget, Protection};
use super::dedupe::MergedOp;
use super::same_insight::{Fingerprint, collapse_whitespace, section_display, section_key};
use crate::domain::playbook::{Bullet, Playbook, Section, format_bullet_id, parse_bullet_id, render};
use crate::domain::{BulletTagKind, DeltaOp, Reflection};

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
    use crate::learn::merge::dedupe::tests::{add, remove, update};

    fn bullet(id: &str, content: &str, helpful: u32, harmful: u32) -> Bullet {
        Bullet { id: id.into(), content: content.into(), helpful, harmful }
    }
    fn contents(pb: &Playbook) -> Vec<(String, String)> {
        pb.bullets().map(|(s, b)| (s.to_owned(), b.content.clone())).collect()
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
