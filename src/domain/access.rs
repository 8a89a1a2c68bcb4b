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
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
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
