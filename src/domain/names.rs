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

/// A prompt's name: `[a-z0-9][a-z0-9._-]{0,63}`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(transparent)]
pub struct PromptName(String);

impl PromptName {
    pub fn parse(s: &str) -> Result<Self, NameError> {
        if valid_slug(s) { Ok(Self(s.to_owned())) } else { Err(NameError::Invalid { kind: "prompt", got: shown(s) }) }
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Debug-formats as a quoted string (`"support-agent"`), so messages built
/// with `{:?}` read naturally.
impl fmt::Debug for PromptName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for PromptName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
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
            assert!(PromptName::parse(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", ".a", "A", "a b", "a/b", &"a".repeat(65), "é"] {
            assert!(PromptName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_debug_format_as_quoted_strings() {
        assert_eq!(format!("{:?}", PromptName::parse("demo").unwrap()), "\"demo\"");
        assert_eq!(format!("{:?}", LabelName::production()), "\"production\"");
    }

    #[test]
    fn latest_is_not_a_storable_label() {
        assert_eq!(LabelName::parse("latest"), Err(NameError::Reserved("latest".into())));
        assert_eq!(LabelName::parse("history"), Err(NameError::Reserved("history".into())));
        assert!(LabelName::parse("production").is_ok());
    }
}
