//! The ACE playbook: named sections of bullets, each with a stable id and
//! helpful/harmful counters. Versions store it as data; agents receive it
//! rendered after the base text by [`render`], the one function that does so.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// One piece of learned guidance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Bullet {
    /// Stable id (`b-0001`), kept across versions; assigned by combee when absent.
    #[serde(default)]
    pub id: String,
    pub content: String,
    #[serde(default)]
    pub helpful: u32,
    #[serde(default)]
    pub harmful: u32,
}

/// A named group of bullets (`strategies`, `common-mistakes`, …).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Section {
    pub name: String,
    #[serde(default)]
    pub bullets: Vec<Bullet>,
}

/// The learned part of a playbook-mode prompt.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Playbook {
    #[serde(default)]
    pub sections: Vec<Section>,
    /// The next bullet number to hand out; never decreases, so a removed id is never reused.
    #[serde(default)]
    pub next_id: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlaybookError {
    #[error("section name must be 1..=64 characters without newlines")]
    BadSectionName,
    #[error("section {0:?} appears twice")]
    DuplicateSection(String),
    #[error("bullet id {0:?} appears twice")]
    DuplicateBullet(String),
    #[error("bullet id {0:?} must look like b-0001")]
    BadBulletId(String),
    #[error("bullet content must be non-empty")]
    EmptyBullet,
    #[error("bullet numbers end at {MAX_BULLET_NUMBER}: next_id and the ids to hand out must stay within it")]
    BulletNumbersExhausted,
}

/// The largest bullet number: ids have at most twelve digits (`b-999999999999`), a bound the
/// OpenAPI document states, so every id the service hands out matches its published pattern.
pub const MAX_BULLET_NUMBER: u64 = 999_999_999_999;

/// Longest section name, in characters.
pub const MAX_SECTION_CHARS: usize = 64;

pub fn format_bullet_id(n: u64) -> String {
    format!("b-{n:04}")
}

pub fn parse_bullet_id(id: &str) -> Option<u64> {
    let digits = id.strip_prefix("b-")?;
    if digits.is_empty() || digits.len() > 12 || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

impl Playbook {
    /// Checks the structure and assigns ids to bullets that have none, so a
    /// playbook written by hand becomes one with stable ids.
    pub fn normalized(mut self) -> Result<Self, PlaybookError> {
        let mut seen_sections = std::collections::HashSet::new();
        let mut seen_ids = std::collections::HashSet::new();
        let mut max_id = 0u64;
        for s in &mut self.sections {
            s.name = s.name.trim().to_owned();
            if s.name.is_empty() || s.name.chars().count() > 64 || s.name.contains('\n') {
                return Err(PlaybookError::BadSectionName);
            }
            if !seen_sections.insert(s.name.clone()) {
                return Err(PlaybookError::DuplicateSection(s.name.clone()));
            }
            for b in &mut s.bullets {
                b.content = b.content.trim().to_owned();
                if b.content.is_empty() {
                    return Err(PlaybookError::EmptyBullet);
                }
                if !b.id.is_empty() {
                    let n = parse_bullet_id(&b.id).ok_or_else(|| PlaybookError::BadBulletId(b.id.clone()))?;
                    if !seen_ids.insert(b.id.clone()) {
                        return Err(PlaybookError::DuplicateBullet(b.id.clone()));
                    }
                    max_id = max_id.max(n);
                }
            }
        }
        self.next_id = self.next_id.max(max_id + 1);
        if self.next_id > MAX_BULLET_NUMBER + 1 {
            return Err(PlaybookError::BulletNumbersExhausted);
        }
        for s in &mut self.sections {
            for b in &mut s.bullets {
                if b.id.is_empty() {
                    if self.next_id > MAX_BULLET_NUMBER {
                        return Err(PlaybookError::BulletNumbersExhausted);
                    }
                    b.id = format_bullet_id(self.next_id);
                    self.next_id += 1;
                }
            }
        }
        Ok(self)
    }

    pub fn bullets(&self) -> impl Iterator<Item = (&str, &Bullet)> {
        self.sections.iter().flat_map(|s| s.bullets.iter().map(move |b| (s.name.as_str(), b)))
    }

    pub fn bullet_count(&self) -> usize {
        self.sections.iter().map(|s| s.bullets.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.bullet_count() == 0
    }
}

/// The text an agent receives: the base text, then the playbook (if any).
/// Bullets are shown ACE-style with their id and counters so the agent can
/// weigh them and cite them in its trajectory.
pub fn render(base: &str, playbook: Option<&Playbook>) -> String {
    let mut out = base.trim_end().to_owned();
    let Some(pb) = playbook.filter(|p| !p.is_empty()) else {
        return out;
    };
    out.push_str("\n\n## PLAYBOOK\n");
    for section in pb.sections.iter().filter(|s| !s.bullets.is_empty()) {
        out.push_str("\n### ");
        out.push_str(&section.name);
        out.push('\n');
        for b in &section.bullets {
            out.push_str(&format!("[{}] helpful={} harmful={} :: {}\n", b.id, b.helpful, b.harmful, b.content));
        }
    }
    out.truncate(out.trim_end().len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bullet(id: &str, content: &str) -> Bullet {
        Bullet { id: id.into(), content: content.into(), helpful: 0, harmful: 0 }
    }

    #[test]
    fn normalize_assigns_fresh_ids_after_the_highest() {
        let pb = Playbook {
            sections: vec![Section { name: " tips ".into(), bullets: vec![bullet("b-0007", "x"), bullet("", " y ")] }],
            next_id: 0,
        }
        .normalized()
        .unwrap();
        assert_eq!(pb.sections[0].name, "tips");
        assert_eq!(pb.sections[0].bullets[1].id, "b-0008");
        assert_eq!(pb.sections[0].bullets[1].content, "y");
        assert_eq!(pb.next_id, 9);
    }

    #[test]
    fn normalize_rejects_bad_structure() {
        let dup = Playbook {
            sections: vec![Section { name: "a".into(), bullets: vec![bullet("b-1", "x"), bullet("b-1", "y")] }],
            next_id: 0,
        };
        assert_eq!(dup.normalized(), Err(PlaybookError::DuplicateBullet("b-1".into())));
        let bad =
            Playbook { sections: vec![Section { name: "a".into(), bullets: vec![bullet("x1", "x")] }], next_id: 0 };
        assert!(matches!(bad.normalized(), Err(PlaybookError::BadBulletId(_))));
        let empty = Playbook { sections: vec![Section { name: "".into(), bullets: vec![] }], next_id: 0 };
        assert_eq!(empty.normalized(), Err(PlaybookError::BadSectionName));
    }

    #[test]
    fn bullet_numbers_stay_within_twelve_digits() {
        let long = Playbook {
            sections: vec![Section { name: "a".into(), bullets: vec![bullet("b-1000000000000", "x")] }],
            next_id: 0,
        };
        assert!(matches!(long.normalized(), Err(PlaybookError::BadBulletId(_))));
        let huge = Playbook { sections: vec![], next_id: 163_331_943_305_754 };
        assert_eq!(huge.normalized(), Err(PlaybookError::BulletNumbersExhausted));
        let last = Playbook {
            sections: vec![Section { name: "a".into(), bullets: vec![bullet("", "x"), bullet("", "y")] }],
            next_id: MAX_BULLET_NUMBER,
        };
        assert_eq!(last.normalized(), Err(PlaybookError::BulletNumbersExhausted));
        let fits = Playbook {
            sections: vec![Section { name: "a".into(), bullets: vec![bullet("", "x")] }],
            next_id: MAX_BULLET_NUMBER,
        }
        .normalized()
        .unwrap();
        assert_eq!(fits.sections[0].bullets[0].id, "b-999999999999");
    }

    #[test]
    fn render_appends_sections_after_base() {
        let pb = Playbook {
            sections: vec![
                Section {
                    name: "strategies".into(),
                    bullets: vec![Bullet {
                        id: "b-0001".into(),
                        content: "Check the date".into(),
                        helpful: 2,
                        harmful: 1,
                    }],
                },
                Section { name: "empty".into(), bullets: vec![] },
            ],
            next_id: 2,
        };
        assert_eq!(
            render("You are helpful.\n", Some(&pb)),
            "You are helpful.\n\n## PLAYBOOK\n\n### strategies\n[b-0001] helpful=2 harmful=1 :: Check the date"
        );
        assert_eq!(render("base", Some(&Playbook::default())), "base");
        assert_eq!(render("base", None), "base");
    }
}
