//! People in the web UI: who signed in through single sign-on, the grants
//! (a role, server-wide or in one project) they hold, and the explicit grants
//! admins give them. API keys keep their scopes (`access.rs`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::access::{Reach, Role};

/// A role, server-wide (`project` absent) or in one project.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, ToSchema)]
pub struct Grant {
    /// The project the role holds in; absent: every project.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    pub role: Role,
}

impl Grant {
    pub fn reach(&self) -> Reach {
        self.project.clone().map_or(Reach::Server, Reach::Project)
    }

    /// `operator in x`, `admin on the whole server`.
    pub fn describe(&self) -> String {
        match &self.project {
            Some(p) => format!("{} in {p}", self.role.as_str()),
            None => format!("{} on the whole server", self.role.as_str()),
        }
    }
}

/// The longest subject, project name or display name accepted.
pub const MAX_NAME_CHARS: usize = 256;

/// A project name as grants and members carry it: the project-name rule
/// (`[a-z0-9][a-z0-9._-]{0,63}`), so every project can be granted.
pub fn valid_project(p: &str) -> bool {
    super::project::check_name(p).is_ok()
}

/// The person a session belongs to, as the provider named them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Person {
    /// The provider's stable `sub`.
    pub subject: String,
    /// The `name` claim, else the email, else the subject.
    pub name: String,
    pub email: Option<String>,
}

/// A person's web UI session: every grant they signed in with, and the one in
/// use (`None` until a person with several picks one).
#[derive(Debug, Clone, PartialEq)]
pub struct PersonSession {
    pub person: Person,
    pub grants: Vec<Grant>,
    pub current: Option<Grant>,
    pub csrf_token: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

#[derive(Debug, Clone)]
pub struct NewPersonSession {
    /// SHA-256 of the cookie's token; the token itself is never stored.
    pub token_hash: String,
    pub person: Person,
    pub grants: Vec<Grant>,
    pub current: Option<Grant>,
    pub csrf_token: String,
    pub expires_at: DateTime<Utc>,
}

/// An explicit grant an admin gave: the person is named by the provider's
/// subject or by an email address.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Member {
    /// The provider's `sub`, or an email address (matched case-insensitively).
    pub subject: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    pub role: Role,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A sign-in under way, kept server-side until its callback takes it once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingLogin {
    pub state_hash: String,
    pub nonce: String,
    pub verifier: String,
    pub expires_at: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_reach_their_project_and_project_names_are_checked() {
        let g = Grant { project: Some("x".into()), role: Role::Operator };
        assert_eq!(g.reach(), Reach::Project("x".into()));
        assert_eq!(g.describe(), "operator in x");
        assert_eq!(Grant { project: None, role: Role::Admin }.reach(), Reach::Server);
        assert!(valid_project("team-x_1"));
        assert!(valid_project("team.eu"), "a project name may hold a dot, so a grant may name it");
        assert!(!valid_project("Team"));
        assert!(!valid_project("-x"));
        assert!(!valid_project(""));
        assert!(!valid_project(&"a".repeat(65)));
    }
}
