//! The audit log's vocabulary: who changed what, when, from where, and the
//! values before and after — and the one rule every entry passes before it is
//! stored: secrets (key material, webhook signing secrets, passwords, tokens)
//! are redacted, whatever route or command the values came from.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;
use uuid::Uuid;

/// Who made a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Actor {
    /// An API key, on the JSON API.
    Key { id: Uuid, name: String },
    /// An operator's web UI session, opened with this key.
    Ui { key_id: Uuid, key_name: String },
    /// A person signed in to the web UI through single sign-on: the provider's
    /// subject and the name it gave.
    Person { subject: String, name: String },
    /// A signed inbound webhook (no key), named by its `webhook-id`.
    Webhook { id: String },
    /// A background job of a worker process (the retention job).
    Worker { name: String },
    /// The command line run directly on the store (`combee keys`, `combee prune`), as this OS user.
    Cli { user: String },
    /// The service itself (the first admin key at start-up).
    System,
    /// A write request no authentication step named (none such succeeds today).
    Unknown,
}

impl Actor {
    /// The `actor_type` column.
    pub fn kind(&self) -> &'static str {
        match self {
            Actor::Key { .. } => "key",
            Actor::Ui { .. } => "ui",
            Actor::Person { .. } => "person",
            Actor::Webhook { .. } => "webhook",
            Actor::Worker { .. } => "worker",
            Actor::Cli { .. } => "cli",
            Actor::System => "system",
            Actor::Unknown => "unknown",
        }
    }

    /// The `actor_id` column: the key's id where a key acted.
    pub fn id(&self) -> Option<String> {
        match self {
            Actor::Key { id, .. } | Actor::Ui { key_id: id, .. } => Some(id.to_string()),
            Actor::Person { subject, .. } => Some(subject.clone()),
            _ => None,
        }
    }

    /// The `actor_name` column.
    pub fn name(&self) -> String {
        match self {
            Actor::Key { name, .. } | Actor::Ui { key_name: name, .. } | Actor::Person { name, .. } => name.clone(),
            Actor::Webhook { id } => id.clone(),
            Actor::Worker { name } => name.clone(),
            Actor::Cli { user } => user.clone(),
            Actor::System => "combee".into(),
            Actor::Unknown => "unknown".into(),
        }
    }
}

/// Where a request came from and which route it took (absent for the worker and the command line).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestOrigin {
    pub request_id: Option<String>,
    pub client_addr: Option<String>,
    pub method: Option<String>,
    pub route: Option<String>,
    pub status: Option<u16>,
}

/// An entry to append. Build it with [`NewAuditEntry::new`], which redacts.
#[derive(Debug, Clone, PartialEq)]
pub struct NewAuditEntry {
    pub actor: Actor,
    pub origin: RequestOrigin,
    pub action: String,
    pub resource_type: Option<String>,
    pub resource_id: Option<String>,
    pub before: Option<Value>,
    pub after: Option<Value>,
    /// The project the change concerns, where there is one.
    pub project: Option<String>,
}

impl NewAuditEntry {
    /// The entry, naming the project it concerns.
    pub fn in_project(mut self, project: Option<String>) -> Self {
        self.project = project;
        self
    }

    /// The entry with `before` and `after` redacted (see [`redact`]).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        actor: Actor,
        origin: RequestOrigin,
        action: impl Into<String>,
        resource_type: Option<String>,
        resource_id: Option<String>,
        before: Option<Value>,
        after: Option<Value>,
    ) -> Self {
        Self {
            actor,
            origin,
            action: action.into(),
            resource_type,
            resource_id,
            before: before.map(redacted),
            after: after.map(redacted),
            project: None,
        }
    }
}

/// An entry as stored and read back (`GET /v1/audit`).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct AuditEntry {
    /// Increasing; the page cursor.
    pub id: i64,
    pub at: DateTime<Utc>,
    /// `key`, `ui`, `person`, `webhook`, `worker`, `cli` or `system`.
    pub actor_type: String,
    /// The API key's id, when a key (or a web UI session opened with one) acted;
    /// a person's subject at the single sign-on provider.
    pub actor_id: Option<String>,
    /// The key's name, a person's name, the webhook id, the worker's job, or the OS user of the command line.
    pub actor_name: String,
    /// The request's `x-request-id`.
    pub request_id: Option<String>,
    /// The client's address as the server saw it (the proxy's, behind one).
    pub client_addr: Option<String>,
    pub method: Option<String>,
    /// The route template, e.g. `/v1/keys/{id}`.
    pub route: Option<String>,
    /// The answer's status.
    pub status: Option<u16>,
    /// What was done, e.g. `key.create`, `label.move`, `retention.run`.
    pub action: String,
    pub resource_type: Option<String>,
    pub resource_id: Option<String>,
    /// The value before the change (null for a creation); secrets redacted.
    #[schema(value_type = Option<Object>)]
    pub before: Option<Value>,
    /// The value after the change (null for a deletion); secrets redacted.
    #[schema(value_type = Option<Object>)]
    pub after: Option<Value>,
    /// The project the change concerned, where there is one.
    pub project: Option<String>,
}

/// Which entries to read (every condition given must hold).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AuditQuery {
    /// The actor's id (a key id) or name.
    pub actor: Option<String>,
    pub action: Option<String>,
    pub resource_type: Option<String>,
    pub resource_id: Option<String>,
    /// At or after.
    pub since: Option<DateTime<Utc>>,
    /// Before.
    pub until: Option<DateTime<Utc>>,
    /// Entries with ids below this one (the page cursor).
    pub before_id: Option<i64>,
    /// Only entries concerning this project.
    pub project: Option<String>,
}

/// What replaces a secret.
pub const REDACTED: &str = "[redacted]";

/// Object members whose value is a secret, whatever it looks like.
const SECRET_FIELDS: [&str; 12] = [
    "secret",
    "secrets",
    "password",
    "token",
    "api_key",
    "key_material",
    "hash",
    "csrf",
    "csrf_token",
    "authorization",
    "signature",
    "inbound_secrets",
];

/// Whether a string is key material on its own: a whole API key (`cmb_` and
/// 40 characters, as `auth.rs` mints them; the 12-character visible prefix is not secret) or a
/// webhook signing secret (`whsec_…`).
fn looks_secret(s: &str) -> bool {
    (s.starts_with("cmb_") && s.len() > 12) || s.starts_with("whsec_")
}

/// `value` with every secret replaced by `"[redacted]"`: the members named
/// in the secret list (any depth, any case), and any string that is key
/// material on its own.
pub fn redacted(mut value: Value) -> Value {
    redact(&mut value);
    value
}

fn redact(value: &mut Value) {
    match value {
        Value::Object(members) => {
            for (name, v) in members.iter_mut() {
                let lower = name.to_ascii_lowercase();
                if SECRET_FIELDS.contains(&lower.as_str()) && !v.is_null() {
                    *v = Value::String(REDACTED.into());
                } else {
                    redact(v);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact),
        Value::String(s) if looks_secret(s) => *s = REDACTED.into(),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn secrets_are_redacted_at_any_depth_and_prefixes_stay() {
        let key = format!("cmb_{}", "a".repeat(40));
        let v = redacted(json!({
            "key": {"id": "k", "prefix": "cmb_abcd1234", "name": "ci"},
            "secret": key,
            "webhook": {"url": "https://x", "Secret": "whsec_abc"},
            "notes": [key.clone(), "whsec_zzz", "plain"],
            "password": null,
        }));
        assert_eq!(v["key"]["prefix"], "cmb_abcd1234");
        assert_eq!(v["secret"], REDACTED);
        assert_eq!(v["webhook"]["Secret"], REDACTED);
        assert_eq!(v["notes"], json!([REDACTED, REDACTED, "plain"]));
        assert_eq!(v["password"], Value::Null, "nothing to hide in a null");
        assert!(!v.to_string().contains(&key));
    }

    #[test]
    fn actors_name_themselves_for_the_columns() {
        let id = Uuid::nil();
        let key = Actor::Key { id, name: "ci".into() };
        assert_eq!((key.kind(), key.id(), key.name()), ("key", Some(id.to_string()), "ci".into()));
        let worker = Actor::Worker { name: "retention".into() };
        assert_eq!((worker.kind(), worker.id()), ("worker", None));
    }
}
