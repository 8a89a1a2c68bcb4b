//! A wrapper for values that must never reach a log line or an error body
//! (API keys, webhook signing secrets, a database URL with a password). A leaf
//! module: settings, the LLM client, webhooks and the store all hold secrets,
//! and none of them should have to import another to name the type.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A value that must never reach a log line or an error body.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_print_redacted_but_serialise_as_themselves() {
        let s = Secret::new("sk-hunter2");
        assert_eq!((format!("{s}"), format!("{s:?}")), ("[redacted]".to_owned(), "[redacted]".to_owned()));
        assert_eq!(s.expose(), "sk-hunter2");
        // Settings files and the store read and write the plain value.
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"sk-hunter2\"");
        assert_eq!(serde_json::from_str::<Secret>("\"sk-hunter2\"").unwrap(), s);
        assert!(Secret::default().is_empty());
    }
}
