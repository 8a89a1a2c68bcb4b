//! The `[auth]` settings: whether people may sign in to the web UI with a
//! pasted API key, and the OpenID Connect provider they sign in through, with
//! the mapping from their group claims to roles. Checked at start-up.

use serde::{Deserialize, Serialize};

use crate::{
    domain::{access::Role, people::valid_project},
    secret::Secret,
};

/// How people sign in to the web UI.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthSettings {
    /// Signing in by pasting an API key; `false` leaves single sign-on only.
    #[serde(default = "yes")]
    pub key_sign_in: bool,
    /// How long a web UI session lasts from sign-in, in hours (1 to `MAX_SESSION_HOURS`),
    /// whichever way the person signed in.
    #[serde(default = "default_session_hours")]
    pub session_hours: u32,
    /// Single sign-on through an OpenID Connect provider; absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oidc: Option<OidcSettings>,
}

/// The longest a web UI session may be set to last: 30 days.
pub const MAX_SESSION_HOURS: u32 = 720;

fn yes() -> bool {
    true
}

fn default_session_hours() -> u32 {
    12
}

impl Default for AuthSettings {
    fn default() -> Self {
        Self { key_sign_in: true, session_hours: default_session_hours(), oidc: None }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OidcSettings {
    /// The provider's issuer URL; discovery reads `{issuer}/.well-known/openid-configuration`.
    pub issuer: String,
    pub client_id: String,
    pub client_secret: Secret,
    /// The public URL of combee's `/ui/oidc/callback`, as registered at the provider.
    pub redirect_url: String,
    #[serde(default = "default_scopes")]
    pub scopes: String,
    /// The ID token claim that lists the person's groups.
    #[serde(default = "default_groups_claim")]
    pub groups_claim: String,
    /// Which groups give which role where.
    #[serde(default)]
    pub groups: Vec<GroupMapping>,
}

fn default_scopes() -> String {
    "openid email profile".into()
}

fn default_groups_claim() -> String {
    "groups".into()
}

/// A group claim value that gives a role, in one project or (`project`
/// absent) on the whole server.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GroupMapping {
    pub claim: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    pub role: Role,
}

/// `https://…`, or `http://` to a loopback host (a provider on the same machine, tests).
fn web_url(url: &str) -> Option<reqwest::Url> {
    let u = reqwest::Url::parse(url).ok()?;
    let loopback = matches!(u.host_str(), Some("localhost" | "127.0.0.1" | "[::1]"));
    let ok = u.scheme() == "https" || (u.scheme() == "http" && loopback);
    (ok && u.host_str().is_some() && u.query().is_none() && u.fragment().is_none()).then_some(u)
}

impl AuthSettings {
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_SESSION_HOURS).contains(&self.session_hours) {
            return Err(format!(
                "auth.session_hours must be between 1 and {MAX_SESSION_HOURS} (30 days), got {}",
                self.session_hours
            ));
        }
        let Some(o) = &self.oidc else {
            if !self.key_sign_in {
                return Err(
                    "auth.key_sign_in = false needs [auth.oidc]: otherwise nobody can sign in to the web UI".into()
                );
            }
            return Ok(());
        };
        if web_url(&o.issuer).is_none() {
            return Err(format!(
                "auth.oidc.issuer must be an https:// URL (http:// only to localhost) without query, got {:?}",
                o.issuer
            ));
        }
        if o.client_id.trim().is_empty() {
            return Err("auth.oidc.client_id must be set".into());
        }
        if o.client_secret.expose().trim().is_empty() {
            return Err(
                "auth.oidc.client_secret must be set (COMBEE__AUTH__OIDC__CLIENT_SECRET keeps it out of files)".into(),
            );
        }
        if !web_url(&o.redirect_url).is_some_and(|u| u.path().ends_with("/ui/oidc/callback")) {
            return Err(format!(
                "auth.oidc.redirect_url must be the public https:// URL of combee's /ui/oidc/callback, got {:?}",
                o.redirect_url
            ));
        }
        if !o.scopes.split_whitespace().any(|s| s == "openid") {
            return Err("auth.oidc.scopes must include `openid`".into());
        }
        if o.groups_claim.trim().is_empty() {
            return Err("auth.oidc.groups_claim must not be empty".into());
        }
        for (i, g) in o.groups.iter().enumerate() {
            if g.claim.is_empty() {
                return Err(format!("auth.oidc.groups[{i}].claim must not be empty"));
            }
            if let Some(p) = &g.project
                && !valid_project(p)
            {
                return Err(format!(
                    "auth.oidc.groups[{i}].project {p:?} is not a project name (1-64 of a-z, 0-9, `.`, `-`, `_`, starting with a letter or digit)"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oidc() -> OidcSettings {
        OidcSettings {
            issuer: "https://id.example.com/realms/main".into(),
            client_id: "combee".into(),
            client_secret: Secret::new("s3cret"),
            redirect_url: "https://combee.example.com/ui/oidc/callback".into(),
            scopes: default_scopes(),
            groups_claim: default_groups_claim(),
            groups: vec![GroupMapping { claim: "team-x".into(), project: Some("x".into()), role: Role::Operator }],
        }
    }

    fn check(o: OidcSettings) -> Result<(), String> {
        AuthSettings { oidc: Some(o), ..AuthSettings::default() }.validate()
    }

    #[test]
    fn settings_are_checked_with_clear_errors() {
        assert_eq!(check(oidc()), Ok(()));
        assert!(AuthSettings::default().validate().is_ok());
        let off = AuthSettings { key_sign_in: false, ..AuthSettings::default() }.validate().unwrap_err();
        assert!(off.contains("auth.key_sign_in"), "{off}");
        for (hours, ok) in [(0, false), (1, true), (MAX_SESSION_HOURS, true), (MAX_SESSION_HOURS + 1, false)] {
            let checked = AuthSettings { session_hours: hours, ..AuthSettings::default() }.validate();
            assert_eq!(checked.is_ok(), ok, "{hours} hours: {checked:?}");
            if let Err(e) = checked {
                assert!(e.contains("auth.session_hours") && e.contains(&hours.to_string()), "{e}");
            }
        }
        type SettingsEdit = fn(&mut OidcSettings);
        let cases: [(SettingsEdit, &str); 7] = [
            (|o| o.issuer = "http://id.example.com".into(), "auth.oidc.issuer"),
            (|o| o.issuer = "not a url".into(), "auth.oidc.issuer"),
            (|o| o.client_id = " ".into(), "auth.oidc.client_id"),
            (|o| o.client_secret = Secret::default(), "auth.oidc.client_secret"),
            (|o| o.redirect_url = "https://combee.example.com/elsewhere".into(), "auth.oidc.redirect_url"),
            (|o| o.scopes = "email".into(), "openid"),
            (|o| o.groups[0].project = Some("Not A Project".into()), "auth.oidc.groups[0].project"),
        ];
        for (change, want) in cases {
            let mut o = oidc();
            change(&mut o);
            let e = check(o).unwrap_err();
            assert!(e.contains(want), "{e} should name {want}");
            assert!(!e.contains("s3cret"), "{e}");
        }
        let printed = format!("{:?}", AuthSettings { oidc: Some(oidc()), ..AuthSettings::default() });
        assert!(printed.contains("client_secret: [redacted]") && !printed.contains("s3cret"), "{printed}");
        let mut local = oidc();
        local.issuer = "http://127.0.0.1:9400".into();
        local.redirect_url = "http://127.0.0.1:8080/ui/oidc/callback".into();
        assert_eq!(check(local), Ok(()));
    }

    #[test]
    fn mappings_read_from_toml() {
        use figment::providers::Format;
        let s: AuthSettings = figment::Figment::from(figment::providers::Toml::string(
            r#"
key_sign_in = false
[oidc]
issuer = "https://id.example.com"
client_id = "combee"
client_secret = "x"
redirect_url = "https://c.example.com/ui/oidc/callback"
[[oidc.groups]]
claim = "team-x"
project = "x"
role = "operator"
[[oidc.groups]]
claim = "sre"
role = "admin"
"#,
        ))
        .extract()
        .unwrap();
        let o = s.oidc.unwrap();
        assert!(!s.key_sign_in);
        assert_eq!((o.scopes.as_str(), o.groups_claim.as_str()), ("openid email profile", "groups"));
        assert_eq!(o.groups[1], GroupMapping { claim: "sre".into(), project: None, role: Role::Admin });
    }
}
