//! The operator web UI at `/ui`: server-rendered HTML over the same service
//! operations as the JSON API (`service/`), behind a cookie session opened with an API
//! key. No script; one local stylesheet; charts are inline SVG. Every page
//! sends a strict Content-Security-Policy and is never cached.

mod actions;
mod html;
mod members;
mod pages;
mod plot;
mod session;
mod sso;

pub use html::escape;

use axum::{
    extract::Request,
    http::{HeaderValue, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Redirect, Response},
    routing::{get, post},
};

use crate::{http::RouteTable, service::ServiceError};
use html::{NavSection, page};

pub fn router() -> RouteTable {
    RouteTable::new()
        .route("/", get(|| async { Redirect::to("/ui/prompts") }))
        .route("/login", get(session::login_form).post(session::login))
        .route("/logout", post(session::logout))
        .route("/oidc/start", get(sso::start))
        .route("/oidc/callback", get(sso::callback))
        .route("/pick", get(sso::pick_page).post(sso::pick))
        .route("/members", get(members::page).post(members::set))
        .route("/members/remove", post(members::remove))
        .route("/prompts", get(pages::prompts))
        .route("/prompts/{name}", get(pages::prompt))
        .route("/prompts/{name}/diff", get(pages::diff))
        .route("/prompts/{name}/versions/{number}", get(pages::version))
        .route("/prompts/{name}/rounds", get(pages::rounds))
        .route("/prompts/{name}/controller", get(pages::controller))
        .route("/prompts/{name}/promote", post(actions::promote))
        .route("/prompts/{name}/rollback", post(actions::rollback))
        .route("/rounds/{id}", get(pages::round))
        .route("/traces", get(pages::traces))
        .route("/audit", get(pages::audit))
        .route("/traces/{id}", get(pages::trace))
        .route("/traces/{id}/label", post(actions::label_trace))
        .route("/traces/{id}/{button}", post(actions::trace_button))
        .route("/static/style.css", get(stylesheet))
        .map_router(|pages| {
            pages
                .fallback(|| async { UiError::NotFound("No such page.".into()) })
                .layer(middleware::from_fn(security_headers))
        })
}

/// How a UI request fails: to the sign-in page, or an HTML error page.
#[derive(Debug)]
pub enum UiError {
    /// No valid session (none, expired, or its key was revoked).
    SignIn,
    /// A person with several grants has not picked the one to use yet.
    PickGrant,
    Forbidden(String),
    NotFound(String),
    Service(ServiceError),
}

impl From<ServiceError> for UiError {
    fn from(e: ServiceError) -> Self {
        match e {
            ServiceError::NotFound(m) => UiError::NotFound(m),
            other => UiError::Service(other),
        }
    }
}

impl IntoResponse for UiError {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            UiError::SignIn => {
                let mut res = Redirect::to("/ui/login?error=expired").into_response();
                res.headers_mut().insert(
                    header::SET_COOKIE,
                    HeaderValue::from_static("combee_session=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0"),
                );
                // A redirect, but a refusal: no audit entry.
                res.extensions_mut().insert(crate::service::audit::Refused);
                return res;
            }
            UiError::PickGrant => return Redirect::to("/ui/pick").into_response(),
            UiError::Forbidden(m) => (StatusCode::FORBIDDEN, m),
            UiError::NotFound(m) => (StatusCode::NOT_FOUND, m),
            UiError::Service(e) => {
                if let ServiceError::Internal(inner) = &e {
                    tracing::error!(error = ?inner, "web UI request failed");
                }
                // The API's messages are written for callers; internal details are not in them.
                (e.status(), e.to_string())
            }
        };
        let title = status.canonical_reason().unwrap_or("Error");
        let body = format!(
            r#"<section class="card error-page"><h1>{} {}</h1><p id="error-message">{}</p><p><a href="/ui/prompts">Back to the prompts</a></p></section>"#,
            status.as_u16(),
            html::escape(title),
            html::escape(&message)
        );
        (status, page(title, None, NavSection::None, &body)).into_response()
    }
}

const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
                   frame-ancestors 'none'; base-uri 'none'";

async fn security_headers(req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    res
}

async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("text/css; charset=utf-8")),
            (header::CACHE_CONTROL, HeaderValue::from_static("public, max-age=300")),
        ],
        include_str!("style.css"),
    )
        .into_response()
}
