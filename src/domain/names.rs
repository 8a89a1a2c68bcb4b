//! Validated names: a prompt or label name is checked once at the edge and
//! then carried as a type that cannot hold an invalid value.

use std::fmt;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NameError {
    #[error("{kind} name must match [a-z0-9][a-z0-9._-]{{0,63}}, got {got:?}")]
    Invalid { kind: &'static str, got: String },
    #[error(
        "label name {0:?} is reserved: `latest` is derived from the version history and `history` names the label history (`/labels/history`); neither is stored"
    )]
    Reserved(String),
}

fn valid_slug(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b[1..].iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'.' | b'_' | b'-'))
}

fn shown(s: &str) -> String {
    // Never echo back an unbounded attacker-chosen string.
    s.chars().take(80).collect()
}

/// True when `s` is a valid prompt or label name (no allocation).
pub fn is_valid_name(s: &str) -> bool {
    valid_slug(s)
}

/// The project every prompt made before projects existed belongs to, and
/// the one a bare name means for a caller bound to no project.
pub const DEFAULT_PROJECT: &str = "default";

/// A prompt's name, which is unique within its project — so it carries the
/// project: two projects may each have `support-agent`, and equality, hashing
/// and every store lookup take both. A name is `[a-z0-9][a-z0-9._-]{0,63}`,
/// and so is a project's.
///
/// Written out, a prompt is `name` within its project and `project/name`
/// from anywhere ([`PromptName::qualified`] writes `default`'s bare, as they
/// were before projects existed). It displays, debug-formats and serializes
/// as its bare name: what a caller of its project calls it.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PromptName {
    // Field order is the sort order: by name, then project.
    name: String,
    project: String,
}

impl PromptName {
    /// The prompt `name` of `project`; both must be valid names.
    pub fn new(project: &str, name: &str) -> Result<Self, NameError> {
        if !valid_slug(name) {
            return Err(NameError::Invalid { kind: "prompt", got: shown(name) });
        }
        if !valid_slug(project) {
            return Err(NameError::Invalid { kind: "project", got: shown(project) });
        }
        Ok(Self { name: name.to_owned(), project: project.to_owned() })
    }

    /// A prompt as a caller writes it: `project/name`, or a bare `name` of
    /// the `home` project (the caller's own; `default` for a server-wide
    /// caller). Whether the caller may reach that project is the caller's check.
    pub fn written(written: &str, home: &str) -> Result<Self, NameError> {
        match written.split_once('/') {
            Some((project, name)) => Self::new(project, name),
            None => Self::new(home, written),
        }
    }

    /// The name within its project.
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// The project the prompt belongs to.
    pub fn project(&self) -> &str {
        &self.project
    }

    /// The prompt as written from anywhere: `project/name`, or the bare name
    /// for `default`'s (how every prompt was named before projects, and how
    /// a server-wide caller still names them).
    pub fn qualified(&self) -> std::borrow::Cow<'_, str> {
        if self.project == DEFAULT_PROJECT {
            std::borrow::Cow::Borrowed(&self.name)
        } else {
            std::borrow::Cow::Owned(format!("{}/{}", self.project, self.name))
        }
    }

    /// The prompt as a caller whose bare names are of `home` writes it: the
    /// bare name in `home`, `project/name` elsewhere.
    pub fn written_from(&self, home: &str) -> String {
        if self.project == home { self.name.clone() } else { format!("{}/{}", self.project, self.name) }
    }

    /// [`PromptName::qualified`] as one path segment (`team-a%2Fsupport-agent`):
    /// names hold nothing else to escape.
    pub fn in_path(&self) -> String {
        self.qualified().replace('/', "%2F")
    }
}

/// Debug-formats as a quoted string (`"support-agent"`), so messages built
/// with `{:?}` read naturally.
impl fmt::Debug for PromptName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.name, f)
    }
}

impl fmt::Display for PromptName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// The bare name: every answer about a prompt is read in its project.
impl serde::Serialize for PromptName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name)
    }
}

/// A label's name: same alphabet as prompt names; `latest` and `history` are reserved.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(transparent)]
pub struct LabelName(std::borrow::Cow<'static, str>);

impl LabelName {
    pub const PRODUCTION: &'static str = "production";
    pub const CANDIDATE: &'static str = "candidate";
    pub const LATEST: &'static str = "latest";
    /// The path segment of the label history (`/v1/prompts/{name}/labels/history`).
    pub const HISTORY: &'static str = "history";

    pub fn parse(s: &str) -> Result<Self, NameError> {
        if s == Self::LATEST || s == Self::HISTORY {
            return Err(NameError::Reserved(s.to_owned()));
        }
        if valid_slug(s) {
            Ok(Self(std::borrow::Cow::Owned(s.to_owned())))
        } else {
            Err(NameError::Invalid { kind: "label", got: shown(s) })
        }
    }
    /// No allocation: the agents' hot path builds this on every request.
    pub fn production() -> Self {
        Self(std::borrow::Cow::Borrowed(Self::PRODUCTION))
    }
    pub fn candidate() -> Self {
        Self(std::borrow::Cow::Borrowed(Self::CANDIDATE))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LabelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for LabelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_names_follow_the_pattern() {
        for ok in ["a", "support-agent", "0.v2_x", &"a".repeat(64)] {
            assert!(PromptName::new(DEFAULT_PROJECT, ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", ".a", "A", "a b", "a/b", &"a".repeat(65), "é"] {
            assert!(PromptName::new(DEFAULT_PROJECT, bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_prompt_is_written_bare_in_its_project_and_with_its_project_from_anywhere() {
        let mine = PromptName::written("support-agent", "team-a").unwrap();
        assert_eq!((mine.project(), mine.as_str()), ("team-a", "support-agent"));
        assert_eq!(mine, PromptName::written("team-a/support-agent", "team-b").unwrap());
        assert_ne!(mine, PromptName::written("support-agent", "team-b").unwrap(), "the same name in two projects");
        assert_eq!(mine.qualified(), "team-a/support-agent");
        assert_eq!(
            (mine.written_from("team-a"), mine.written_from("default")),
            ("support-agent".into(), mine.qualified().into_owned())
        );
        assert_eq!(mine.in_path(), "team-a%2Fsupport-agent");
        assert_eq!(PromptName::written("default/x", "team-a").unwrap().qualified(), "x");
        assert_eq!(mine.to_string(), "support-agent");
        assert_eq!(serde_json::to_value(&mine).unwrap(), "support-agent");
        for bad in ["a/b/c", "/x", "x/", "Team/x", "a//b"] {
            assert!(PromptName::written(bad, "default").is_err(), "{bad}");
        }
    }

    #[test]
    fn names_debug_format_as_quoted_strings() {
        assert_eq!(format!("{:?}", PromptName::new("team-a", "demo").unwrap()), "\"demo\"");
        assert_eq!(format!("{:?}", LabelName::production()), "\"production\"");
    }

    #[test]
    fn latest_is_not_a_storable_label() {
        assert_eq!(LabelName::parse("latest"), Err(NameError::Reserved("latest".into())));
        assert_eq!(LabelName::parse("history"), Err(NameError::Reserved("history".into())));
        assert!(LabelName::parse("production").is_ok());
    }
}
