//! Operator sessions: sign in by pasting an API key (verified through the
//! same `KeyCache` as bearer requests), a random session token in an HttpOnly
//! `SameSite=Strict` cookie scoped to `/ui` (only its SHA-256 is stored), a
//! per-session CSRF token checked in constant time on every POST, and sign-out.

use axum::{
    Form,
    extract::{FromRequestParts, State},
    http::{HeaderMap, HeaderValue, StatusCode, header, request::Parts},
    response::{IntoResponse, Redirect, Response},
};
use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use chrono::Utc;
use rand::RngCore;
use serde::Deserialize;
use subtle::ConstantTimeEq;

use super::{
    UiError,
    html::{NavSection, escape, page},
};
use crate::{
    auth::hash_key,
    domain::{
        access::{ApiKey, NewUiSession, Reach, Role, Scope},
        audit::Actor,
        people::{Grant, Person},
    },
    service::{
        AppState,
        audit::{Audit, AuditSlot},
        keys, people, projects, sessions,
    },
};

pub const SESSION_COOKIE: &str = "combee_session";
/// Double-submit token of the sign-in form (there is no session yet to hold one).
const LOGIN_COOKIE: &str = "combee_login";
const LOGIN_FORM_SECS: i64 = 600;

/// How long a session opened now lasts (`auth.session_hours`), for its row and its cookie.
pub(super) fn session_length(st: &AppState) -> chrono::Duration {
    chrono::Duration::hours(i64::from(st.settings.auth.session_hours))
}

pub(super) fn random_token() -> String {
    let mut bytes = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut bytes);
    URL_SAFE_NO_PAD.encode(bytes)
}

/// Equal in constant time (the length is not secret).
pub fn tokens_match(given: &str, expected: &str) -> bool {
    !expected.is_empty() && bool::from(given.as_bytes().ct_eq(expected.as_bytes()))
}

pub(super) fn cookie_value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// `Secure` when the request reached the proxy over https: combee itself speaks
/// plain HTTP behind a TLS-terminating proxy, which sets `X-Forwarded-Proto`.
pub(super) fn over_https(headers: &HeaderMap) -> bool {
    headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').next().is_some_and(|p| p.trim().eq_ignore_ascii_case("https")))
}

pub(super) fn cookie(headers: &HeaderMap, name: &str, value: &str, max_age: i64) -> HeaderValue {
    let secure = if over_https(headers) { "; Secure" } else { "" };
    HeaderValue::from_str(&format!("{name}={value}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}"))
        .unwrap_or_else(|_| HeaderValue::from_static("combee_invalid=; Path=/ui; Max-Age=0"))
}

/// What a session's page needs of it, whoever opened it.
pub struct SessionInfo {
    /// Rendered into every state-changing form and checked on POST.
    pub csrf_token: String,
    pub expires_at: chrono::DateTime<Utc>,
}

/// Who opened the session: an API key, or a person through single sign-on
/// with the grant (role, and project or server-wide) in use.
pub enum SignedIn {
    Key(ApiKey),
    Person { person: Person, grant: Grant, grants: usize },
}

/// A signed-in operator: the session and who opened it (an unrevoked key, or a person).
pub struct Operator {
    pub session: SessionInfo,
    pub by: SignedIn,
}

impl Operator {
    /// A 403 page unless the key has the scope (or `admin`), or the person's role stands for it.
    pub fn require(&self, scope: Scope) -> Result<(), UiError> {
        if self.can(scope) {
            return Ok(());
        }
        Err(UiError::Forbidden(match &self.by {
            SignedIn::Key(_) => format!("This API key lacks the `{}` scope.", scope.as_str()),
            SignedIn::Person { grant, .. } => {
                format!("Your role ({}) does not allow this: it needs `{}`.", grant.describe(), scope.as_str())
            }
        }))
    }

    /// Whether this session may act with `scope`: a key's scopes, a person's role's.
    pub fn can(&self, scope: Scope) -> bool {
        let scopes = match &self.by {
            SignedIn::Key(key) => key.scopes.as_slice(),
            SignedIn::Person { grant, .. } => grant.role.scopes(),
        };
        scopes.contains(&scope) || scopes.contains(&Scope::Admin)
    }

    /// Where this session may act: a key's reach (server-wide until keys are
    /// bound to projects), or the project of the person's grant in use.
    pub fn reach(&self) -> Reach {
        match &self.by {
            SignedIn::Key(key) => key.reach(),
            SignedIn::Person { grant, .. } => grant.reach(),
        }
    }

    /// A person's role; `None` for a key session.
    pub fn role(&self) -> Option<Role> {
        match &self.by {
            SignedIn::Key(_) => None,
            SignedIn::Person { grant, .. } => Some(grant.role),
        }
    }

    /// A 403 page unless the form carried this session's CSRF token.
    pub fn check_csrf(&self, given: Option<&str>) -> Result<(), UiError> {
        match given {
            Some(t) if tokens_match(t, &self.session.csrf_token) => Ok(()),
            _ => Err(UiError::Forbidden(
                "The form's security token is missing or wrong. Reload the page and try again.".into(),
            )),
        }
    }

    pub fn who(&self) -> super::html::Who<'_> {
        let (name, detail, title, switch) = match &self.by {
            SignedIn::Key(key) => (key.name.as_str(), format!("{}…", key.prefix), "API key", false),
            SignedIn::Person { person, grants, .. } => {
                let role = self.role().map_or("", Role::as_str);
                let place = match self.reach() {
                    Reach::Server => "on the whole server".to_owned(),
                    Reach::Project(p) => format!("in {p}"),
                };
                (person.name.as_str(), format!("{role} {place}"), "signed in through single sign-on", *grants > 1)
            }
        };
        super::html::Who { name, detail, title, csrf: &self.session.csrf_token, admin: self.can(Scope::Admin), switch }
    }

    /// The `by` of what this session changes.
    pub fn actor(&self) -> String {
        match &self.by {
            SignedIn::Key(key) => format!("key:{} (web UI)", key.prefix),
            SignedIn::Person { person, .. } => format!("person:{} (web UI)", person.subject),
        }
    }

    /// The audit log's actor for this session.
    pub fn audit_actor(&self) -> Actor {
        match &self.by {
            SignedIn::Key(key) => Actor::Ui { key_id: key.id, key_name: key.name.clone() },
            SignedIn::Person { person, .. } => {
                Actor::Person { subject: person.subject.clone(), name: person.name.clone() }
            }
        }
    }
}

impl FromRequestParts<AppState> for Operator {
    type Rejection = UiError;

    async fn from_request_parts(parts: &mut Parts, st: &AppState) -> Result<Self, Self::Rejection> {
        let token = cookie_value(&parts.headers, SESSION_COOKIE).ok_or(UiError::SignIn)?;
        let hash = hash_key(token);
        // A session whose key was revoked after sign-in ends with it.
        let op = if let Some((session, key)) = sessions::find(st, &hash).await? {
            Operator {
                session: SessionInfo { csrf_token: session.csrf_token, expires_at: session.expires_at },
                by: SignedIn::Key(key),
            }
        } else {
            let p = people::find_session(st, &hash).await?.ok_or(UiError::SignIn)?;
            // A person with several grants picks one before any page.
            let grant = p.current.ok_or(UiError::PickGrant)?;
            Operator {
                session: SessionInfo { csrf_token: p.csrf_token, expires_at: p.expires_at },
                by: SignedIn::Person { person: p.person, grant, grants: p.grants.len() },
            }
        };
        // A form's audit entry names the session's key or person (see `service/audit.rs`).
        if let Some(slot) = parts.extensions.get::<AuditSlot>() {
            slot.set_actor(op.audit_actor());
        }
        // Another project's pages answer 404, as the API does.
        projects::guard_request(st, &op.reach(), parts).await?;
        Ok(op)
    }
}

#[derive(Deserialize)]
pub struct LoginQuery {
    #[serde(default)]
    error: Option<String>,
}

/// What the sign-in page offers: single sign-on, the API key form, or both.
#[derive(Clone, Copy)]
struct Offer {
    sso: bool,
    keys: bool,
}

fn offer(st: &AppState) -> Offer {
    Offer { sso: st.oidc.is_some(), keys: st.settings.auth.key_sign_in }
}

fn login_page(headers: &HeaderMap, offer: Offer, message: Option<&str>, status: StatusCode) -> Response {
    let token = random_token();
    let notice =
        message.map_or_else(String::new, |m| format!(r#"<p class="notice bad" id="login-error">{}</p>"#, escape(m)));
    let sso = if offer.sso {
        r#"<p><a class="button" href="/ui/oidc/start" id="sso-sign-in">Sign in with single sign-on</a></p>"#
    } else {
        ""
    };
    let form = if offer.keys {
        format!(
            r#"<p class="muted">Paste an API key with the <code>prompts:read</code> scope (<code>prompts:promote</code> to promote and roll back). The key is checked once; the browser then holds a session cookie, never the key.</p>
<form method="post" action="/ui/login" autocomplete="off">
<input type="hidden" name="login_token" value="{}">
<label for="key">API key</label>
<input type="password" id="key" name="key" placeholder="cmb_…" required autofocus spellcheck="false">
<button type="submit" id="sign-in">Sign in</button>
</form>"#,
            escape(&token)
        )
    } else {
        String::new()
    };
    let body = format!(
        r#"<section class="login card">
<h1>Sign in</h1>
{notice}
{sso}
{form}
</section>"#
    );
    let mut res = (status, page("Sign in", None, NavSection::None, &body)).into_response();
    res.headers_mut().insert(header::SET_COOKIE, cookie(headers, LOGIN_COOKIE, &token, LOGIN_FORM_SECS));
    res
}

pub async fn login_form(
    State(st): State<AppState>,
    headers: HeaderMap,
    axum::extract::Query(q): axum::extract::Query<LoginQuery>,
) -> Response {
    // Only fixed messages: the query string never reaches the page.
    let message = match q.error.as_deref() {
        Some("expired") => Some("Your session ended. Sign in again."),
        _ => None,
    };
    login_page(&headers, offer(&st), message, StatusCode::OK)
}

#[derive(Deserialize)]
pub struct LoginForm {
    #[serde(default)]
    key: String,
    #[serde(default)]
    login_token: Option<String>,
}

pub async fn login(State(st): State<AppState>, headers: HeaderMap, Form(form): Form<LoginForm>) -> Response {
    if !st.settings.auth.key_sign_in {
        return UiError::Forbidden("Signing in with an API key is switched off here: use single sign-on.".into())
            .into_response();
    }
    let expected = cookie_value(&headers, LOGIN_COOKIE).unwrap_or_default();
    if !form.login_token.as_deref().is_some_and(|t| tokens_match(t, expected)) {
        return UiError::Forbidden("The sign-in form expired or did not come from this site. Reload it.".into())
            .into_response();
    }
    let key = match keys::authenticate(&st, form.key.trim()).await {
        Ok(Some(key)) => key,
        Ok(None) => {
            return login_page(&headers, offer(&st), Some("Unknown or revoked API key."), StatusCode::UNAUTHORIZED);
        }
        Err(e) => return UiError::from(e).into_response(),
    };
    if !(key.scopes.contains(&Scope::PromptsRead) || key.scopes.contains(&Scope::Admin)) {
        let why = Some("This key lacks the prompts:read scope.");
        return login_page(&headers, offer(&st), why, StatusCode::FORBIDDEN);
    }
    let token = random_token();
    let length = session_length(&st);
    let session = NewUiSession {
        token_hash: hash_key(&token),
        key_id: key.id,
        csrf_token: random_token(),
        expires_at: Utc::now() + length,
    };
    if let Err(e) = sessions::open(&st, &session).await {
        return UiError::from(e).into_response();
    }
    tracing::info!(key = %key.prefix, "web UI sign-in");
    let mut res = Redirect::to("/ui/prompts").into_response();
    let opened = serde_json::json!({"key_id": key.id, "key_prefix": key.prefix, "expires_at": session.expires_at});
    let actor = Actor::Ui { key_id: key.id, key_name: key.name.clone() };
    let audit = Audit::new("ui.sign_in", "ui_session", key.id).by(actor).after(opened).in_project(key.project.clone());
    res.extensions_mut().insert(audit);
    let h = res.headers_mut();
    h.append(header::SET_COOKIE, cookie(&headers, SESSION_COOKIE, &token, length.num_seconds()));
    h.append(header::SET_COOKIE, cookie(&headers, LOGIN_COOKIE, "", 0));
    res
}

#[derive(Deserialize)]
pub struct CsrfForm {
    #[serde(default)]
    pub csrf: Option<String>,
}

pub async fn logout(
    State(st): State<AppState>,
    op: Operator,
    headers: HeaderMap,
    Form(form): Form<CsrfForm>,
) -> Result<Response, UiError> {
    op.check_csrf(form.csrf.as_deref())?;
    if let Some(token) = cookie_value(&headers, SESSION_COOKIE) {
        match op.by {
            SignedIn::Key(_) => sessions::close(&st, &hash_key(token)).await?,
            SignedIn::Person { .. } => people::close_session(&st, &hash_key(token)).await?,
        }
    }
    let audit = match &op.by {
        SignedIn::Key(key) => Audit::new("ui.sign_out", "ui_session", key.id).before(
            serde_json::json!({"key_id": key.id, "key_prefix": key.prefix, "expires_at": op.session.expires_at}),
        ),
        SignedIn::Person { person, grant, .. } => Audit::new("ui.sign_out", "person_session", &person.subject).before(
            serde_json::json!({"subject": person.subject, "grant": grant, "expires_at": op.session.expires_at}),
        ),
    };
    Ok((audit, signed_out(&headers)).into_response())
}

/// Back to the sign-in page with the session cookie cleared.
pub fn signed_out(headers: &HeaderMap) -> Response {
    let mut res = Redirect::to("/ui/login").into_response();
    res.headers_mut().insert(header::SET_COOKIE, cookie(headers, SESSION_COOKIE, "", 0));
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_exactly_and_never_match_empty() {
        assert!(tokens_match("abc", "abc"));
        assert!(!tokens_match("abd", "abc"));
        assert!(!tokens_match("ab", "abc"));
        assert!(!tokens_match("", ""));
    }

    #[test]
    fn cookies_are_read_from_every_header_and_secure_follows_the_proxy() {
        let mut h = HeaderMap::new();
        h.append(header::COOKIE, HeaderValue::from_static("a=1; combee_session=tok"));
        h.append(header::COOKIE, HeaderValue::from_static("b=2"));
        assert_eq!(cookie_value(&h, SESSION_COOKIE), Some("tok"));
        assert_eq!(cookie_value(&h, "b"), Some("2"));
        let c = cookie(&h, SESSION_COOKIE, "x", 60);
        assert_eq!(c.to_str().unwrap(), "combee_session=x; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=60");
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        assert!(cookie(&h, SESSION_COOKIE, "x", 60).to_str().unwrap().ends_with("; Secure"));
    }
}
