//! Signing in through single sign-on (OpenID Connect): `/ui/oidc/start`
//! keeps the sign-in's state, nonce and PKCE verifier server-side and sends
//! the browser to the provider, with the state also in a short-lived HttpOnly
//! cookie of this browser; `/ui/oidc/callback` takes the sign-in once (the
//! query's state must match the cookie's and a kept sign-in), has the code
//! exchanged and the ID token verified (`oidc/`), and opens a person's
//! session with the grants their groups and an admin gave them — or refuses,
//! saying why. A person with several grants picks one at `/ui/pick`.

use axum::{
    Form,
    extract::{Query, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Redirect, Response},
};
use chrono::Utc;
use serde::Deserialize;

use super::{
    UiError,
    html::{NavSection, escape, page},
    session::{SESSION_COOKIE, cookie, cookie_value, over_https, random_token, session_length, tokens_match},
};
use crate::{
    auth::hash_key,
    domain::{
        audit::{Actor, NewAuditEntry, RequestOrigin},
        people::{Grant, NewPersonSession, Person},
    },
    service::{AppState, audit, people},
};

/// The sign-in's state, for the callback to compare; `Lax`, since the
/// provider's redirect back is a cross-site navigation.
const STATE_COOKIE: &str = "combee_oidc";

fn state_cookie(headers: &HeaderMap, value: &str, max_age: i64) -> HeaderValue {
    let secure = if over_https(headers) { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{STATE_COOKIE}={value}; Path=/ui/oidc; HttpOnly; SameSite=Lax; Max-Age={max_age}{secure}"
    ))
    .unwrap_or_else(|_| HeaderValue::from_static("combee_invalid=; Path=/ui/oidc; Max-Age=0"))
}

/// A page that refuses the sign-in, saying why; `id` names the reason for tests and styles.
fn refusal(status: StatusCode, headline: &str, message: &str, id: &str) -> Response {
    let body = format!(
        r#"<section class="card error-page" id="{id}"><h1>{}</h1><p id="error-message">{}</p><p><a href="/ui/login">Back to sign-in</a></p></section>"#,
        escape(headline),
        escape(message)
    );
    let mut res = (status, page(headline, None, NavSection::None, &body)).into_response();
    res.extensions_mut().insert(crate::service::audit::Refused);
    res
}

pub async fn start(State(st): State<AppState>, headers: HeaderMap) -> Response {
    let Some(client) = st.oidc.clone() else {
        return UiError::NotFound("Single sign-on is not set up on this server.".into()).into_response();
    };
    let (state, nonce, verifier) = (random_token(), random_token(), random_token());
    let url = match client.authorize_url(&state, &nonce, &verifier).await {
        Ok(url) => url,
        Err(e) => {
            tracing::warn!(error = %e, "single sign-on: no authorization URL");
            return refusal(StatusCode::BAD_GATEWAY, "Single sign-on is unavailable", &e.to_string(), "sso-down");
        }
    };
    if let Err(e) = people::start_login(&st, hash_key(&state), nonce, verifier).await {
        return UiError::from(e).into_response();
    }
    let mut res = Redirect::to(&url).into_response();
    let max_age = people::LOGIN_MINUTES * 60;
    res.headers_mut().insert(header::SET_COOKIE, state_cookie(&headers, &state, max_age));
    res
}

#[derive(Deserialize)]
pub struct CallbackQuery {
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    error: Option<String>,
}

const NOT_MEMBER: &str = "You are not a member of any project on this combee; ask an admin to map one of your groups \
                          (or to add you as a member).";

pub async fn callback(State(st): State<AppState>, headers: HeaderMap, Query(q): Query<CallbackQuery>) -> Response {
    let mut res = signed_in_or_refused(&st, &headers, q).await;
    // The sign-in's cookie is spent, whatever happened.
    res.headers_mut().append(header::SET_COOKIE, state_cookie(&headers, "", 0));
    res
}

async fn signed_in_or_refused(st: &AppState, headers: &HeaderMap, q: CallbackQuery) -> Response {
    let Some(client) = st.oidc.clone() else {
        return UiError::NotFound("Single sign-on is not set up on this server.".into()).into_response();
    };
    let stale = || {
        refusal(
            StatusCode::FORBIDDEN,
            "This sign-in link is not valid",
            "It was used already, has expired, or did not start in this browser. Sign in again.",
            "bad-state",
        )
    };
    let state = q.state.as_deref().filter(|s| (1..=256).contains(&s.len())).unwrap_or_default();
    let expected = cookie_value(headers, STATE_COOKIE).unwrap_or_default();
    if !tokens_match(state, expected) {
        return stale();
    }
    // Taken once: a replayed callback finds nothing.
    let login = match people::take_login(st, &hash_key(state)).await {
        Ok(Some(login)) => login,
        Ok(None) => return stale(),
        Err(e) => return UiError::from(e).into_response(),
    };
    if let Some(error) = q.error {
        let why = format!("The provider answered `{}`.", error.chars().take(64).collect::<String>());
        return refusal(StatusCode::FORBIDDEN, "The provider refused the sign-in", &why, "provider-refused");
    }
    let Some(code) = q.code.filter(|c| (1..=4096).contains(&c.len())) else {
        return refusal(StatusCode::BAD_REQUEST, "No code", "The provider sent no authorization code.", "no-code");
    };
    let who = match client.sign_in(&code, &login.verifier, &login.nonce).await {
        Ok(who) => who,
        Err(e) => {
            tracing::warn!(error = %e, "single sign-on refused");
            return refusal(StatusCode::FORBIDDEN, "Sign-in failed", &e.to_string(), "sign-in-failed");
        }
    };
    let grants = match people::grants_for(st, &who).await {
        Ok(g) => g,
        Err(e) => return UiError::from(e).into_response(),
    };
    let clip = |s: &str| s.chars().take(crate::domain::people::MAX_NAME_CHARS).collect::<String>();
    let person = Person {
        subject: clip(&who.subject),
        name: clip(who.name.as_deref().or(who.email.as_deref()).unwrap_or(&who.subject)),
        email: who.email.as_deref().map(clip),
    };
    if grants.is_empty() {
        tracing::info!(subject = %person.subject, groups = ?who.groups, "single sign-on: no mapped grant");
        return refusal(StatusCode::FORBIDDEN, "Not a member", NOT_MEMBER, "not-member");
    }
    let token = random_token();
    let current = (grants.len() == 1).then(|| grants[0].clone());
    let length = session_length(st);
    let session = NewPersonSession {
        token_hash: hash_key(&token),
        person: person.clone(),
        grants: grants.clone(),
        current: current.clone(),
        csrf_token: random_token(),
        expires_at: Utc::now() + length,
    };
    if let Err(e) = people::open_session(st, &session).await {
        return UiError::from(e).into_response();
    }
    tracing::info!(subject = %person.subject, grants = grants.len(), "web UI sign-in through single sign-on");
    // A GET, so the write middleware does not see it: the entry is appended here.
    let entry = NewAuditEntry::new(
        Actor::Person { subject: person.subject.clone(), name: person.name.clone() },
        RequestOrigin {
            method: Some("GET".into()),
            route: Some("/ui/oidc/callback".into()),
            status: Some(200),
            ..RequestOrigin::default()
        },
        "ui.sign_in",
        Some("person_session".into()),
        Some(person.subject.clone()),
        None,
        Some(serde_json::json!({"subject": person.subject, "name": person.name, "grants": grants,
                                "expires_at": session.expires_at})),
    );
    audit::record_entry(st, &entry).await;
    // A page, not a redirect: the browser arrived here from the provider's
    // site, and a `SameSite=Strict` cookie rides only on a navigation that
    // starts on this site.
    let next = if current.is_some() { "/ui/prompts" } else { "/ui/pick" };
    let body = format!(
        r#"<section class="card"><h1>Signed in</h1><p>Welcome, {}. <a href="{next}" id="continue">Continue</a></p></section>"#,
        escape(&person.name)
    );
    let html = page("Signed in", None, NavSection::None, &body).0.replacen(
        "<head>",
        &format!(r#"<head><meta http-equiv="refresh" content="0; url={next}">"#),
        1,
    );
    let mut res = (StatusCode::OK, axum::response::Html(html)).into_response();
    res.headers_mut().append(header::SET_COOKIE, cookie(headers, SESSION_COOKIE, &token, length.num_seconds()));
    res
}

/// The person's session, whether or not a grant is picked yet.
async fn person_session(
    st: &AppState,
    headers: &HeaderMap,
) -> Result<(String, crate::domain::people::PersonSession), UiError> {
    let token = cookie_value(headers, SESSION_COOKIE).ok_or(UiError::SignIn)?;
    let hash = hash_key(token);
    let s = people::find_session(st, &hash).await?.ok_or(UiError::SignIn)?;
    Ok((hash, s))
}

pub async fn pick_page(State(st): State<AppState>, headers: HeaderMap) -> Result<Response, UiError> {
    let (_, s) = person_session(&st, &headers).await?;
    let mut items = String::new();
    for (i, g) in s.grants.iter().enumerate() {
        let current = if s.current.as_ref() == Some(g) { " (in use)" } else { "" };
        items.push_str(&format!(
            r#"<li><form method="post" action="/ui/pick" class="inline"><input type="hidden" name="csrf" value="{}"><input type="hidden" name="grant" value="{i}"><button type="submit" id="pick-{i}">{}</button>{current}</form></li>"#,
            escape(&s.csrf_token),
            escape(&g.describe()),
        ));
    }
    let body = format!(
        r#"<section class="card"><h1>Where to work</h1><p class="muted">{}, you hold several roles here. Pick one; you can switch later.</p><ul id="grants">{items}</ul></section>"#,
        escape(&s.person.name)
    );
    Ok(page("Pick a project", None, NavSection::None, &body).into_response())
}

#[derive(Deserialize)]
pub struct PickForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    grant: Option<String>,
}

pub async fn pick(
    State(st): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<PickForm>,
) -> Result<Response, UiError> {
    let (hash, s) = person_session(&st, &headers).await?;
    if !form.csrf.as_deref().is_some_and(|t| tokens_match(t, &s.csrf_token)) {
        return Err(UiError::Forbidden(
            "The form's security token is missing or wrong. Reload the page and try again.".into(),
        ));
    }
    let grant: &Grant = form
        .grant
        .as_deref()
        .and_then(|g| g.parse::<usize>().ok())
        .and_then(|i| s.grants.get(i))
        .ok_or_else(|| UiError::Forbidden("That is not one of your roles.".into()))?;
    people::pick(&st, &hash, grant).await?;
    let audit = crate::service::audit::Audit::new("ui.pick", "person_session", &s.person.subject)
        .by(Actor::Person { subject: s.person.subject.clone(), name: s.person.name.clone() })
        .before(&s.current)
        .after(grant);
    Ok((audit, Redirect::to("/ui/prompts")).into_response())
}
