//! The lesson check ([`crate::learn::lesson_check`]) at the reduce's doors:
//! every operation a level-1 group proposes is checked before level 2 sees it
//! (so a junk proposal can neither be merged with a real one nor outvote it),
//! every operation a consolidation rewrote is checked again before it is
//! applied, and every rewritten instruction — each group's, and the merged
//! one — before it may replace the base. What is refused goes on the round's
//! record with its rule and reason ([`RefusedChange`]); a round whose every
//! change was refused is left with its base's content and publishes nothing.

use super::record::RefusedChange;
use crate::domain::DeltaOp;
use crate::learn::lesson_check::{self, Refusal};
use crate::learn::merge::dedupe::MergedOp;
use crate::llm::REFUSED_ANSWER_CHARS;

/// Records a refusal, folding the same change refused again (another group
/// proposed it too) into one entry.
fn note(refused: &mut Vec<RefusedChange>, change: RefusedChange) {
    match refused.iter_mut().find(|r| r.op == change.op && r.instruction == change.instruction) {
        Some(r) => {
            r.groups.extend(change.groups);
            r.groups.sort_unstable();
            r.groups.dedup();
        }
        None => refused.push(change),
    }
}

fn refused_op(op: DeltaOp, groups: Vec<usize>, why: Refusal) -> RefusedChange {
    RefusedChange { op: Some(op), instruction: None, groups, rule: why.rule, reason: why.reason }
}

/// The level-1 operations (group, op, sources) the check admits.
pub(super) fn raw_ops(
    ops: Vec<(usize, DeltaOp, Vec<usize>)>,
    base: &str,
    refused: &mut Vec<RefusedChange>,
) -> Vec<(usize, DeltaOp, Vec<usize>)> {
    let mut kept = Vec::with_capacity(ops.len());
    for (g, op, sources) in ops {
        match lesson_check::check_op(&op, base) {
            Ok(()) => kept.push((g, op, sources)),
            Err(why) => note(refused, refused_op(op, vec![g], why)),
        }
    }
    kept
}

/// The merged operations (after a consolidation may have rewritten them) the check admits.
pub(super) fn merged_ops(ops: Vec<MergedOp>, base: &str, refused: &mut Vec<RefusedChange>) -> Vec<MergedOp> {
    let mut kept = Vec::with_capacity(ops.len());
    for m in ops {
        match lesson_check::check_op(&m.op, base) {
            Ok(()) => kept.push(m),
            Err(why) => note(refused, refused_op(m.op, m.groups, why)),
        }
    }
    kept
}

/// The instruction, when the check admits it as the replacement of `base`.
pub(super) fn instruction(
    text: String,
    groups: Vec<usize>,
    base: &str,
    max_chars: Option<usize>,
    refused: &mut Vec<RefusedChange>,
) -> Option<String> {
    match lesson_check::check_instruction(&text, base, max_chars) {
        Ok(()) => Some(text),
        Err(why) => {
            let mut kept: String = text.chars().take(REFUSED_ANSWER_CHARS).collect();
            if text.chars().count() > REFUSED_ANSWER_CHARS {
                kept.push('…');
            }
            let change =
                RefusedChange { op: None, instruction: Some(kept), groups, rule: why.rule, reason: why.reason };
            note(refused, change);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learn::lesson_check::Rule;

    fn add(section: &str, content: &str) -> DeltaOp {
        DeltaOp::Add { section: section.into(), content: content.into(), reason: String::new() }
    }

    #[test]
    fn refused_operations_are_kept_on_record_once_with_every_group() {
        let mut refused = Vec::new();
        let ops = vec![
            (0, add("tips", "1"), vec![0]),
            (1, add("tips", "Check the order number first."), vec![1]),
            (2, add("tips", "1"), vec![2]),
        ];
        let kept = raw_ops(ops, "Help customers.", &mut refused);
        assert_eq!(kept.len(), 1);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!((refused[0].groups.clone(), refused[0].rule), (vec![0, 2], Rule::NoStatement));
        let merged = merged_ops(vec![MergedOp::single(3, add("Section 9", "Check twice."))], "x", &mut refused);
        assert!(merged.is_empty());
        assert_eq!(refused[1].rule, Rule::SectionName);
        let long = "x".repeat(REFUSED_ANSWER_CHARS + 10);
        assert_eq!(instruction(long, vec![0], "A long enough base text.", None, &mut refused), None);
        assert_eq!(refused[2].instruction.as_ref().map(|t| t.chars().count()), Some(REFUSED_ANSWER_CHARS + 1));
    }
}
