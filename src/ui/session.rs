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
    html::{Section, escape, page},
};
use crate::{
    auth::hash_key,
    domain::{
        access::{ApiKey, NewUiSession, Scope, UiSession},
        audit::Actor,
    },
    service::{
        AppState,
        audit::{Audit, AuditSlot},
        keys, projects, sessions,
    },
};

pub const SESSION_COOKIE: &str = "combee_session";
/// Double-submit token of the sign-in form (there is no session yet to hold one).
const LOGIN_COOKIE: &str = "combee_login";
pub const SESSION_HOURS: i64 = 12;
const LOGIN_FORM_SECS: i64 = 600;

fn random_token() -> String {
    let mut bytes = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut bytes);
    URL_SAFE_NO_PAD.encode(bytes)
}

/// Equal in constant time (the length is not secret).
pub fn tokens_match(given: &str, expected: &str) -> bool {
    !expected.is_empty() && bool::from(given.as_bytes().ct_eq(expected.as_bytes()))
}

fn cookie_value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
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
fn over_https(headers: &HeaderMap) -> bool {
    headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').next().is_some_and(|p| p.trim().eq_ignore_ascii_case("https")))
}

fn cookie(headers: &HeaderMap, name: &str, value: &str, max_age: i64) -> HeaderValue {
    let secure = if over_https(headers) { "; Secure" } else { "" };
    HeaderValue::from_str(&format!("{name}={value}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}"))
        .unwrap_or_else(|_| HeaderValue::from_static("combee_invalid=; Path=/ui; Max-Age=0"))
}

/// A signed-in operator: the session and the (unrevoked) key it was opened with.
pub struct Operator {
    pub session: UiSession,
    pub key: ApiKey,
}

impl Operator {
    /// A 403 page unless the key has the scope (or `admin`).
    pub fn require(&self, scope: Scope) -> Result<(), UiError> {
        if self.can(scope) {
            Ok(())
        } else {
            Err(UiError::Forbidden(format!("This API key lacks the `{}` scope.", scope.as_str())))
        }
    }

    pub fn can(&self, scope: Scope) -> bool {
        self.key.scopes.contains(&scope) || self.key.scopes.contains(&Scope::Admin)
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
        super::html::Who {
            key_name: &self.key.name,
            key_prefix: &self.key.prefix,
            csrf: &self.session.csrf_token,
            admin: self.can(Scope::Admin),
        }
    }

    pub fn actor(&self) -> String {
        format!("key:{} (web UI)", self.key.prefix)
    }
}

impl FromRequestParts<AppState> for Operator {
    type Rejection = UiError;

    async fn from_request_parts(parts: &mut Parts, st: &AppState) -> Result<Self, Self::Rejection> {
        let token = cookie_value(&parts.headers, SESSION_COOKIE).ok_or(UiError::SignIn)?;
        let hash = hash_key(token);
        // A session whose key was revoked after sign-in ends with it.
        let (session, key) = sessions::find(st, &hash).await?.ok_or(UiError::SignIn)?;
        // A form's audit entry names the session's key (see `service/audit.rs`).
        if let Some(slot) = parts.extensions.get::<AuditSlot>() {
            slot.set_actor(Actor::Ui { key_id: key.id, key_name: key.name.clone() });
        }
        // Another project's pages answer 404, as the API does.
        projects::guard_request(st, &key.reach(), parts).await?;
        Ok(Operator { session, key })
    }
}

#[derive(Deserialize)]
pub struct LoginQuery {
    #[serde(default)]
    error: Option<String>,
}

fn login_page(headers: &HeaderMap, message: Option<&str>, status: StatusCode) -> Response {
    let token = random_token();
    let notice =
        message.map_or_else(String::new, |m| format!(r#"<p class="notice bad" id="login-error">{}</p>"#, escape(m)));
    let body = format!(
        r#"<section class="login card">
<h1>Sign in</h1>
<p class="muted">Paste an API key with the <code>prompts:read</code> scope (<code>prompts:promote</code> to promote and roll back). The key is checked once; the browser then holds a session cookie, never the key.</p>
{notice}
<form method="post" action="/ui/login" autocomplete="off">
<input type="hidden" name="login_token" value="{}">
<label for="key">API key</label>
<input type="password" id="key" name="key" placeholder="cmb_…" required autofocus spellcheck="false">
<button type="submit" id="sign-in">Sign in</button>
</form>
</section>"#,
        escape(&token)
    );
    let mut res = (status, page("Sign in", None, Section::None, &body)).into_response();
    res.headers_mut().insert(header::SET_COOKIE, cookie(headers, LOGIN_COOKIE, &token, LOGIN_FORM_SECS));
    res
}

pub async fn login_form(headers: HeaderMap, axum::extract::Query(q): axum::extract::Query<LoginQuery>) -> Response {
    // Only fixed messages: the query string never reaches the page.
    let message = match q.error.as_deref() {
        Some("expired") => Some("Your session ended. Sign in again."),
        _ => None,
    };
    login_page(&headers, message, StatusCode::OK)
}

#[derive(Deserialize)]
pub struct LoginForm {
    #[serde(default)]
    key: String,
    #[serde(default)]
    login_token: Option<String>,
}

pub async fn login(State(st): State<AppState>, headers: HeaderMap, Form(form): Form<LoginForm>) -> Response {
    let expected = cookie_value(&headers, LOGIN_COOKIE).unwrap_or_default();
    if !form.login_token.as_deref().is_some_and(|t| tokens_match(t, expected)) {
        return UiError::Forbidden("The sign-in form expired or did not come from this site. Reload it.".into())
            .into_response();
    }
    let key = match keys::authenticate(&st, form.key.trim()).await {
        Ok(Some(key)) => key,
        Ok(None) => return login_page(&headers, Some("Unknown or revoked API key."), StatusCode::UNAUTHORIZED),
        Err(e) => return UiError::from(e).into_response(),
    };
    if !(key.scopes.contains(&Scope::PromptsRead) || key.scopes.contains(&Scope::Admin)) {
        return login_page(&headers, Some("This key lacks the prompts:read scope."), StatusCode::FORBIDDEN);
    }
    let token = random_token();
    let session = NewUiSession {
        token_hash: hash_key(&token),
        key_id: key.id,
        csrf_token: random_token(),
        expires_at: Utc::now() + chrono::Duration::hours(SESSION_HOURS),
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
    h.append(header::SET_COOKIE, cookie(&headers, SESSION_COOKIE, &token, SESSION_HOURS * 3600));
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
        sessions::close(&st, &hash_key(token)).await?;
    }
    let open =
        serde_json::json!({"key_id": op.key.id, "key_prefix": op.key.prefix, "expires_at": op.session.expires_at});
    Ok((Audit::new("ui.sign_out", "ui_session", op.key.id).before(open), signed_out(&headers)).into_response())
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
