//! Who may do what: API keys with their scopes, and the operator web UI sessions opened with them.

use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize, ToSchema)]
pub enum Scope {
    #[serde(rename = "traces:write")]
    TracesWrite,
    #[serde(rename = "prompts:read")]
    PromptsRead,
    #[serde(rename = "prompts:write")]
    PromptsWrite,
    #[serde(rename = "prompts:promote")]
    PromptsPromote,
    #[serde(rename = "rounds:trigger")]
    RoundsTrigger,
    #[serde(rename = "admin")]
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 6] = [
        Scope::TracesWrite,
        Scope::PromptsRead,
        Scope::PromptsWrite,
        Scope::PromptsPromote,
        Scope::RoundsTrigger,
        Scope::Admin,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::TracesWrite => "traces:write",
            Scope::PromptsRead => "prompts:read",
            Scope::PromptsWrite => "prompts:write",
            Scope::PromptsPromote => "prompts:promote",
            Scope::RoundsTrigger => "rounds:trigger",
            Scope::Admin => "admin",
        }
    }
    pub fn parse(s: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|x| x.as_str() == s)
    }
}

/// An API key as stored: the secret itself is never kept, only its hash.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ApiKey {
    pub id: Uuid,
    pub name: String,
    /// The visible start of the key (`cmb_abcd1234`), for telling keys apart.
    pub prefix: String,
    #[serde(skip)]
    pub hash: String,
    pub scopes: Vec<Scope>,
    /// The one project the key acts in; absent: server-wide.
    pub project: Option<String>,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}

impl ApiKey {
    /// Where the key may act.
    pub fn reach(&self) -> Reach {
        match &self.project {
            Some(p) => Reach::Project(p.clone()),
            None => Reach::Server,
        }
    }
}

/// An operator's web UI session, opened by signing in with an API key.
#[derive(Debug, Clone, PartialEq)]
pub struct UiSession {
    pub key_id: Uuid,
    /// Rendered into every state-changing form and checked on POST.
    pub csrf_token: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

#[derive(Debug, Clone)]
pub struct NewUiSession {
    /// SHA-256 of the cookie's token; the token itself is never stored.
    pub token_hash: String,
    pub key_id: Uuid,
    pub csrf_token: String,
    pub expires_at: DateTime<Utc>,
}

/// Where a caller may act: every project (server-wide keys and people), or one
/// project. A resource of a project out of reach is answered as absent (404),
/// so its existence is not revealed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reach {
    Server,
    Project(String),
}

impl Reach {
    /// Whether a resource of `project` is within reach.
    pub fn allows(&self, project: &str) -> bool {
        match self {
            Reach::Server => true,
            Reach::Project(p) => p == project,
        }
    }

    /// The one project this caller is bound to, if any.
    pub fn project(&self) -> Option<&str> {
        match self {
            Reach::Server => None,
            Reach::Project(p) => Some(p),
        }
    }
}

/// What a person may do, in one project or server-wide: given by single
/// sign-on (a mapped group claim) or by an admin. API keys keep their scopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads everything in reach.
    Viewer,
    /// Also promotes, rolls back, quarantines and requeues traces, triggers rounds.
    Operator,
    /// Also keys, webhooks, settings and members.
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Viewer, Role::Operator, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// The API scopes a role stands for, so one check serves keys and people.
    pub fn scopes(self) -> &'static [Scope] {
        match self {
            Role::Viewer => &[Scope::PromptsRead],
            Role::Operator => &[Scope::PromptsRead, Scope::PromptsWrite, Scope::PromptsPromote, Scope::RoundsTrigger],
            Role::Admin => &[Scope::Admin],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_project_reach_allows_only_its_project_and_roles_name_their_scopes() {
        assert!(Reach::Server.allows("a"));
        assert!(Reach::Project("a".into()).allows("a"));
        assert!(!Reach::Project("a".into()).allows("b"));
        assert_eq!(Role::parse("operator"), Some(Role::Operator));
        assert_eq!(Role::parse("owner"), None);
        assert!(!Role::Viewer.scopes().contains(&Scope::PromptsPromote));
        assert!(Role::Operator.scopes().contains(&Scope::PromptsPromote));
        assert_eq!(Role::Admin.scopes(), &[Scope::Admin]);
    }
}
