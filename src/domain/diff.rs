//! Differences between two versions: a line diff of the rendered text and,
//! for playbooks, which bullets were added, removed or changed (by stable id).

use serde::Serialize;
use similar::{ChangeTag, TextDiff};
use utoipa::ToSchema;

use super::playbook::{Bullet, Playbook};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum LineTag {
    Equal,
    Insert,
    Delete,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct DiffLine {
    pub tag: LineTag,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct SectionBullet {
    pub section: String,
    #[serde(flatten)]
    pub bullet: Bullet,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct BulletChange {
    pub id: String,
    pub before: SectionBullet,
    pub after: SectionBullet,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct PlaybookDiff {
    pub added: Vec<SectionBullet>,
    pub removed: Vec<SectionBullet>,
    /// Same id, different content, section or counters.
    pub changed: Vec<BulletChange>,
}

/// A unified diff (`---`/`+++` headers, `@@` hunks) and the same as tagged lines.
pub fn text_diff(old: &str, new: &str, old_name: &str, new_name: &str) -> (String, Vec<DiffLine>) {
    let diff = TextDiff::from_lines(old, new);
    let unified = diff.unified_diff().context_radius(3).header(old_name, new_name).to_string();
    let lines = diff
        .iter_all_changes()
        .map(|c| DiffLine {
            tag: match c.tag() {
                ChangeTag::Equal => LineTag::Equal,
                ChangeTag::Insert => LineTag::Insert,
                ChangeTag::Delete => LineTag::Delete,
            },
            text: c.value().trim_end_matches('\n').to_owned(),
        })
        .collect();
    (unified, lines)
}

pub fn playbook_diff(old: Option<&Playbook>, new: Option<&Playbook>) -> PlaybookDiff {
    let index = |pb: Option<&Playbook>| -> Vec<SectionBullet> {
        pb.map(|p| p.bullets().map(|(s, b)| SectionBullet { section: s.to_owned(), bullet: b.clone() }).collect())
            .unwrap_or_default()
    };
    let (before, after) = (index(old), index(new));
    let find = |list: &[SectionBullet], id: &str| list.iter().find(|b| b.bullet.id == id).cloned();
    let mut out = PlaybookDiff::default();
    for b in &after {
        match find(&before, &b.bullet.id) {
            None => out.added.push(b.clone()),
            Some(old) if old != *b => {
                out.changed.push(BulletChange { id: b.bullet.id.clone(), before: old, after: b.clone() })
            }
            Some(_) => {}
        }
    }
    out.removed = before.into_iter().filter(|b| find(&after, &b.bullet.id).is_none()).collect();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::playbook::Section;

    fn pb(bullets: &[(&str, &str, u32)]) -> Playbook {
        Playbook {
            sections: vec![Section {
                name: "s".into(),
                bullets: bullets
                    .iter()
                    .map(|(id, c, h)| Bullet { id: (*id).into(), content: (*c).into(), helpful: *h, harmful: 0 })
                    .collect(),
            }],
            next_id: 10,
        }
    }

    #[test]
    fn text_diff_tags_lines() {
        let (unified, lines) = text_diff("a\nb\n", "a\nc\n", "v1", "v2");
        assert!(
            unified.contains("--- v1")
                && unified.contains("+++ v2")
                && unified.contains("-b")
                && unified.contains("+c")
        );
        let tags: Vec<_> = lines.iter().map(|l| (l.tag.clone(), l.text.as_str())).collect();
        assert_eq!(tags, vec![(LineTag::Equal, "a"), (LineTag::Delete, "b"), (LineTag::Insert, "c")]);
    }

    #[test]
    fn playbook_diff_by_stable_id() {
        let old = pb(&[("b-0001", "keep", 0), ("b-0002", "drop", 0), ("b-0003", "edit", 0)]);
        let new = pb(&[("b-0001", "keep", 0), ("b-0003", "edited", 1), ("b-0004", "new", 0)]);
        let d = playbook_diff(Some(&old), Some(&new));
        assert_eq!(d.added.iter().map(|b| b.bullet.id.as_str()).collect::<Vec<_>>(), ["b-0004"]);
        assert_eq!(d.removed.iter().map(|b| b.bullet.id.as_str()).collect::<Vec<_>>(), ["b-0002"]);
        assert_eq!(d.changed.len(), 1);
        assert_eq!(d.changed[0].after.bullet.content, "edited");
        assert_eq!(playbook_diff(None, None), PlaybookDiff::default());
    }
}
