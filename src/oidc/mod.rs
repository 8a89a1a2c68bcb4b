//! Single sign-on for the web UI through an OpenID Connect provider: the
//! provider's discovery document and key set (both cached; the key set is
//! read again when a token names a key it lacks), the authorization request
//! (code flow with PKCE S256, `state` and `nonce`), and the code exchange at
//! the token endpoint whose ID token is verified (`token.rs`) before anyone
//! is believed. What a person may then do is the caller's affair.

pub mod config;
pub mod token;

use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{Map, Value};
use tokio::sync::Mutex;

use config::OidcSettings;
use token::{Expected, Jwk, JwkSet, TokenError};

/// How long the discovery document is trusted before it is read again.
const DISCOVERY_TTL: Duration = Duration::from_secs(3600);
/// The key set is read again at most this often when a token names an unknown key.
const JWKS_REFRESH_MIN: Duration = Duration::from_secs(10);
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Deserialize)]
struct Discovery {
    issuer: String,
    authorization_endpoint: String,
    token_endpoint: String,
    jwks_uri: String,
}

/// Why a sign-in failed; shown to the person, so never a secret or a token.
#[derive(Debug, thiserror::Error)]
pub enum OidcError {
    #[error("the single sign-on provider could not be reached or answered badly: {0}")]
    Provider(String),
    #[error("the single sign-on provider refused the sign-in: {0}")]
    Refused(String),
    #[error("{0}")]
    Token(#[from] TokenError),
}

/// Who the verified ID token names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub subject: String,
    pub name: Option<String>,
    pub email: Option<String>,
    /// The values of the configured groups claim (a list or one string).
    pub groups: Vec<String>,
}

/// The provider client; one per process.
pub struct Client {
    settings: OidcSettings,
    http: reqwest::Client,
    discovery: Mutex<Option<(Discovery, Instant)>>,
    keys: Mutex<(Vec<Jwk>, Option<Instant>)>,
}

impl Client {
    pub fn new(settings: OidcSettings) -> Self {
        let http = reqwest::Client::builder()
            .timeout(HTTP_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        Self { settings, http, discovery: Mutex::new(None), keys: Mutex::new((Vec::new(), None)) }
    }

    pub fn settings(&self) -> &OidcSettings {
        &self.settings
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, url: &str) -> Result<T, OidcError> {
        let res = self.http.get(url).send().await.map_err(|e| OidcError::Provider(e.without_url().to_string()))?;
        if !res.status().is_success() {
            return Err(OidcError::Provider(format!("{url} answered {}", res.status())));
        }
        res.json().await.map_err(|e| OidcError::Provider(format!("{url}: {}", e.without_url())))
    }

    async fn discovery(&self) -> Result<Discovery, OidcError> {
        let mut cached = self.discovery.lock().await;
        if let Some((d, at)) = cached.as_ref()
            && at.elapsed() < DISCOVERY_TTL
        {
            return Ok(d.clone());
        }
        let url = format!("{}/.well-known/openid-configuration", self.settings.issuer.trim_end_matches('/'));
        let d: Discovery = self.get_json(&url).await?;
        if d.issuer.trim_end_matches('/') != self.settings.issuer.trim_end_matches('/') {
            return Err(OidcError::Provider(format!(
                "its discovery document names the issuer {:?}, not the configured {:?}",
                d.issuer, self.settings.issuer
            )));
        }
        *cached = Some((d.clone(), Instant::now()));
        Ok(d)
    }

    /// The provider's authorization URL for this sign-in.
    pub async fn authorize_url(&self, state: &str, nonce: &str, verifier: &str) -> Result<String, OidcError> {
        let d = self.discovery().await?;
        let s = &self.settings;
        let challenge = token::pkce_challenge(verifier);
        let url = reqwest::Url::parse_with_params(
            &d.authorization_endpoint,
            [
                ("response_type", "code"),
                ("client_id", s.client_id.as_str()),
                ("redirect_uri", s.redirect_url.as_str()),
                ("scope", s.scopes.as_str()),
                ("state", state),
                ("nonce", nonce),
                ("code_challenge", challenge.as_str()),
                ("code_challenge_method", "S256"),
            ],
        )
        .map_err(|e| OidcError::Provider(format!("bad authorization_endpoint: {e}")))?;
        Ok(url.into())
    }

    /// The key set, read again when `kid` is not in the cached one (a
    /// rotated key), at most every [`JWKS_REFRESH_MIN`].
    async fn keys_for(&self, jwks_uri: &str, kid: Option<&str>) -> Result<Vec<Jwk>, OidcError> {
        let mut cached = self.keys.lock().await;
        let fresh_enough = cached.1.is_some_and(|at| at.elapsed() < JWKS_REFRESH_MIN);
        if !token::has_key(&cached.0, kid) && !fresh_enough {
            let set: JwkSet = self.get_json(jwks_uri).await?;
            *cached = (set.keys, Some(Instant::now()));
        }
        Ok(cached.0.clone())
    }

    /// Exchanges the code (with the client secret and the PKCE verifier) and
    /// returns who the verified ID token names.
    pub async fn sign_in(&self, code: &str, verifier: &str, nonce: &str) -> Result<Identity, OidcError> {
        let d = self.discovery().await?;
        let s = &self.settings;
        let form = [
            ("grant_type", "authorization_code"),
            ("code", code),
            ("redirect_uri", s.redirect_url.as_str()),
            ("code_verifier", verifier),
            ("client_id", s.client_id.as_str()),
        ];
        let res = self
            .http
            .post(&d.token_endpoint)
            .basic_auth(&s.client_id, Some(s.client_secret.expose()))
            .form(&form)
            .send()
            .await
            .map_err(|e| OidcError::Provider(e.without_url().to_string()))?;
        let status = res.status();
        let body: Value = res.json().await.map_err(|e| OidcError::Provider(e.without_url().to_string()))?;
        if !status.is_success() {
            // The OAuth error code only: a description may echo what was sent.
            let code = body.get("error").and_then(Value::as_str).unwrap_or("unknown error");
            return Err(OidcError::Refused(code.chars().take(64).collect()));
        }
        let id_token = body
            .get("id_token")
            .and_then(Value::as_str)
            .ok_or_else(|| OidcError::Provider("the token endpoint answered without an id_token".into()))?;
        let kid = token::key_id(id_token)?;
        let keys = self.keys_for(&d.jwks_uri, kid.as_deref()).await?;
        let now = chrono::Utc::now().timestamp();
        let want = Expected { issuer: &s.issuer, client_id: &s.client_id, nonce, now };
        let claims = token::verify(id_token, &keys, &want)?;
        Ok(identity(&claims, &s.groups_claim))
    }
}

fn text(claims: &Map<String, Value>, name: &str) -> Option<String> {
    claims.get(name).and_then(Value::as_str).map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned)
}

/// Who verified claims name; the groups claim may be a list or one string.
pub fn identity(claims: &Map<String, Value>, groups_claim: &str) -> Identity {
    let groups = match claims.get(groups_claim) {
        Some(Value::Array(all)) => all.iter().filter_map(Value::as_str).map(str::to_owned).collect(),
        Some(Value::String(one)) => vec![one.clone()],
        _ => Vec::new(),
    };
    Identity {
        subject: text(claims, "sub").unwrap_or_default(),
        name: text(claims, "name").or_else(|| text(claims, "preferred_username")),
        email: text(claims, "email"),
        groups,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn groups_are_a_list_or_one_string_and_names_fall_back() {
        let c = json!({"sub": "u1", "email": "a@x.org", "roles": ["a", 3, "b"]});
        let id = identity(c.as_object().unwrap(), "roles");
        assert_eq!((id.subject.as_str(), id.name, id.groups), ("u1", None, vec!["a".to_owned(), "b".to_owned()]));
        let c = json!({"sub": "u2", "preferred_username": "ann", "groups": "ops"});
        let id = identity(c.as_object().unwrap(), "groups");
        assert_eq!((id.name.as_deref(), id.groups), (Some("ann"), vec!["ops".to_owned()]));
    }
}
