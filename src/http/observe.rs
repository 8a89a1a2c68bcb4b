//! The middleware every request passes through, wrapped once around the whole
//! route table: a request id, a tracing span, the time limit, panics answered
//! as problems, and each answer counted in `/metrics` by route template.
//! Around the table rather than layered on each route, because axum clones
//! and boxes a per-route layer's services on every request, which cost about
//! as much as a cached prompt's whole answer. So that the route is still
//! known out here, [`RouteTable`] registers every route twice: in the axum
//! router and in a matcher of the same kind that names its template.
//!
//! It also keeps the audit log true by construction: every write request
//! (POST, PUT, PATCH, DELETE) on a route not declared exempt
//! ([`RouteTable::not_audited`]) that succeeds (status below 400) appends
//! exactly one entry before it is answered (`http/audit.rs`); a failed one
//! appends none.

use std::{
    cell::RefCell,
    collections::HashMap,
    convert::Infallible,
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll, ready},
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::HttpBody as _,
    extract::Request,
    http::{HeaderName, HeaderValue, Method},
    response::{IntoResponse, Response},
    routing::MethodRouter,
};
use futures_util::{FutureExt as _, future::CatchUnwind};
use tokio::time::Timeout;
use tower::Service;
use tracing::{Instrument as _, instrument::Instrumented};

use super::{AppState, audit, error::ApiError};

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The route label of a request no route matched (the fallbacks).
const UNMATCHED: &str = "unmatched";

/// The routes, each registered in the axum router and, by its template, in
/// the matcher [`Observed`] names the route of a request with. Built through
/// this type only, so the two cannot disagree.
#[derive(Default)]
pub struct RouteTable {
    router: Router<AppState>,
    templates: Vec<String>,
    /// Write operations (method, template) that append no audit entry.
    unaudited: Vec<(Method, String)>,
}

impl RouteTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn route(mut self, path: &str, method_router: MethodRouter<AppState>) -> Self {
        self.router = self.router.route(path, method_router);
        self.templates.push(path.to_owned());
        self
    }

    /// Declares that `method` on the route `path` appends no audit entry,
    /// and why (`why` is for the reader: say it where the route is added).
    /// Every other write operation is audited.
    pub fn not_audited(mut self, method: Method, path: &str, why: &'static str) -> Self {
        let _ = why;
        self.unaudited.push((method, path.to_owned()));
        self
    }

    /// `other`'s routes under `prefix`, with the templates axum gives them.
    pub fn nest(mut self, prefix: &str, other: RouteTable) -> Self {
        self.router = self.router.nest(prefix, other.router);
        // As axum names a nested route (`Router::nest`): the prefix alone for `/`.
        let nested = |path: &str| match path {
            "/" => prefix.to_owned(),
            _ => format!("{}{path}", prefix.trim_end_matches('/')),
        };
        self.templates.extend(other.templates.iter().map(|path| nested(path)));
        self.unaudited.extend(other.unaudited.iter().map(|(method, path)| (method.clone(), nested(path))));
        self
    }

    /// The router changed in what adds no route: fallbacks, layers.
    pub fn map_router(mut self, f: impl FnOnce(Router<AppState>) -> Router<AppState>) -> Self {
        self.router = f(self.router);
        self
    }

    /// The router, the templates, and the write operations not audited.
    pub fn into_parts(self) -> (Router<AppState>, Vec<String>, Vec<(Method, String)>) {
        (self.router, self.templates, self.unaudited)
    }
}

/// Request ids without a system call per request: a random process prefix
/// (drawn once) and a counter, e.g. `3f9c2a71-000000000042`.
struct SequentialRequestId {
    /// The random prefix in hex and the dash, written once.
    prefix: [u8; 9],
    next: AtomicU64,
}

impl Default for SequentialRequestId {
    fn default() -> Self {
        let random: u32 = rand::random();
        let mut prefix = [b'-'; 9];
        for (i, digit) in prefix[..8].iter_mut().enumerate() {
            *digit = b"0123456789abcdef"[(random >> (28 - 4 * i) & 0xf) as usize];
        }
        Self { prefix, next: Default::default() }
    }
}

impl SequentialRequestId {
    fn make(&self) -> Option<HeaderValue> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        // Written in place: this runs on every request.
        let mut id = [b'0'; 21];
        id[..9].copy_from_slice(&self.prefix);
        let mut rest = n % 1_000_000_000_000;
        for digit in id[9..].iter_mut().rev() {
            *digit = b'0' + (rest % 10) as u8;
            rest /= 10;
        }
        HeaderValue::from_bytes(&id).ok()
    }
}

/// What every request of one [`Observed`] service shares.
struct Observer {
    /// Distinguishes this observer's route ids in the per-thread metric handles.
    serial: u64,
    time_limit: Duration,
    ids: SequentialRequestId,
    /// Route template → its index in `labels`.
    matcher: matchit::Router<u16>,
    labels: Vec<String>,
    /// Per route, the write methods that append no audit entry.
    unaudited: Vec<Vec<Method>>,
    /// Where audit entries are appended.
    state: AppState,
}

/// The methods that change something.
fn is_write(method: &Method) -> bool {
    matches!(*method, Method::POST | Method::PUT | Method::PATCH | Method::DELETE)
}

/// The service every request enters by: an `x-request-id` (the caller's, or
/// a new one) echoed in the answer; a `request` span carrying method, path and
/// id for the logs of whatever runs inside; the time limit
/// (`server.request_timeout_secs`, then 503); a panic answered as a 500
/// problem; a debug line when answered; and the count and duration in
/// `/metrics` by method, route template and status.
///
/// It holds the routes twice: as sent to requests with a body (`inner`:
/// behind the body limit, a request extension the body extractors read) and
/// to those without one (`bodiless`, spared an extension nothing would read).
#[derive(Clone)]
pub struct Observed<S, B> {
    inner: S,
    bodiless: B,
    observer: Arc<Observer>,
}

impl<S, B> Observed<S, B> {
    /// `inner` and `bodiless` are the same routes, `templates` their templates
    /// and `unaudited` their write operations without audit entries
    /// ([`RouteTable::into_parts`]); `inner` is what requests with a body go to.
    pub fn new(
        inner: S,
        bodiless: B,
        (templates, unaudited): (Vec<String>, Vec<(Method, String)>),
        time_limit: Duration,
        state: AppState,
    ) -> Self {
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let mut matcher = matchit::Router::new();
        let mut labels = Vec::with_capacity(templates.len());
        for template in templates {
            // axum accepted the same templates into the same matcher, so this cannot fail.
            if matcher.insert(template.as_str(), labels.len() as u16).is_ok() {
                labels.push(template);
            }
        }
        let unaudited = labels
            .iter()
            .map(|label| unaudited.iter().filter(|(_, path)| path == label).map(|(m, _)| m.clone()).collect())
            .collect();
        let observer = Observer {
            serial: SERIAL.fetch_add(1, Ordering::Relaxed),
            time_limit,
            ids: SequentialRequestId::default(),
            matcher,
            labels,
            unaudited,
            state,
        };
        Self { inner, bodiless, observer: Arc::new(observer) }
    }
}

impl<S, B> Service<Request> for Observed<S, B>
where
    S: Service<Request, Response = Response, Error = Infallible>,
    B: Service<Request, Response = Response, Error = Infallible, Future = S::Future>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = ObservedAnswer<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        ready!(self.inner.poll_ready(cx))?;
        self.bodiless.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request) -> Self::Future {
        let start = Instant::now();
        let o = &self.observer;
        let id = match req.headers().get(REQUEST_ID) {
            Some(id) => Some(id.clone()),
            None => o.ids.make(),
        };
        let route = o.matcher.at(req.uri().path()).ok().map(|m| *m.value);
        let method = req.method().clone();
        let audit = match route {
            Some(r) if is_write(&method) && !o.unaudited[usize::from(r)].contains(&method) => {
                Some(Box::new(audit::Pending::start(&mut req, o.labels[usize::from(r)].clone())))
            }
            _ => None,
        };
        let span = tracing::info_span!(
            "request",
            method = %req.method(),
            path = %req.uri().path(),
            request_id = %id.as_ref().and_then(|v| v.to_str().ok()).unwrap_or("-"),
        );
        let deadline = tokio::time::Instant::from_std(start + o.time_limit);
        let (inner, bodiless) = (&mut self.inner, &mut self.bodiless);
        // Routing runs here, the handler when polled: a panic in either is answered.
        let running = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let route = || if req.body().is_end_stream() { bodiless.call(req) } else { inner.call(req) };
            let answer = span.in_scope(route).instrument(span.clone());
            AssertUnwindSafe(tokio::time::timeout_at(deadline, answer)).catch_unwind()
        }))
        .ok();
        ObservedAnswer {
            running,
            recording: None,
            audit,
            span,
            start,
            id,
            route,
            method,
            observer: self.observer.clone(),
        }
    }
}

type Guarded<F> = CatchUnwind<AssertUnwindSafe<Timeout<Instrumented<F>>>>;

pin_project_lite::pin_project! {
    /// The answer of an [`Observed`] request: stamped and counted once ready.
    pub struct ObservedAnswer<F> {
        // `None` when routing panicked.
        #[pin]
        running: Option<Guarded<F>>,
        // Appending the audit entry of a successful write, once answered.
        recording: Option<Pin<Box<dyn Future<Output = Response> + Send>>>,
        audit: Option<Box<audit::Pending>>,
        span: tracing::Span,
        start: Instant,
        id: Option<HeaderValue>,
        route: Option<u16>,
        method: Method,
        observer: Arc<Observer>,
    }
}

impl<F: Future<Output = Result<Response, Infallible>>> Future for ObservedAnswer<F> {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if this.recording.is_none() {
            let panicked = || ApiError::internal(anyhow::anyhow!("a handler panicked")).into_response();
            let mut res = match this.running.as_pin_mut() {
                None => panicked(),
                Some(running) => match ready!(running.poll(cx)) {
                    Ok(Ok(Ok(res))) => res,
                    Ok(Ok(Err(never))) => match never {},
                    Ok(Err(_elapsed)) => ApiError::Timeout.into_response(),
                    Err(_panic) => panicked(),
                },
            };
            let id = this.id.take();
            match &id {
                Some(id) => res.headers_mut().insert(REQUEST_ID, id.clone()),
                // Never without an id; but no empty place left for one either.
                None => res.headers_mut().remove(REQUEST_ID),
            };
            match this.audit.take() {
                // Only a success is a change; the answer waits for its entry.
                Some(pending) if audit::Pending::succeeded(&res) => {
                    let request_id = id.and_then(|v| v.to_str().ok().map(str::to_owned));
                    let recording =
                        pending.record(this.observer.state.clone(), this.method.to_string(), request_id, res);
                    *this.recording = Some(Box::pin(recording.instrument(this.span.clone())));
                }
                _ => {
                    return Poll::Ready(Ok(finish(
                        this.span,
                        this.start,
                        this.observer,
                        *this.route,
                        this.method,
                        res,
                    )));
                }
            }
        }
        let Some(recording) = this.recording.as_mut() else { unreachable!("set above") };
        let res = ready!(recording.as_mut().poll(cx));
        Poll::Ready(Ok(finish(this.span, this.start, this.observer, *this.route, this.method, res)))
    }
}

/// Logs and counts an answer.
fn finish(
    span: &tracing::Span,
    start: &Instant,
    observer: &Observer,
    route: Option<u16>,
    method: &Method,
    res: Response,
) -> Response {
    let elapsed = start.elapsed();
    let status = res.status().as_u16();
    span.in_scope(|| tracing::debug!(status, latency_ms = elapsed.as_secs_f64() * 1e3, "finished processing request"));
    observer.count(route, method, status, elapsed);
    res
}

/// The request count and duration of one (observer, route, method, status).
type AnswerHandles = (metrics::Counter, metrics::Histogram);

thread_local! {
    /// Registered handles, per thread: counting takes no lock and builds no label.
    static ANSWER_HANDLES: RefCell<HashMap<(u64, u64), AnswerHandles, foldhash::fast::RandomState>> =
        RefCell::default();
}

/// The `method` label: the standard methods by name, any other as `other`
/// (a client cannot add series by inventing methods).
fn method_label(method: &Method) -> (u8, &'static str) {
    match *method {
        Method::GET => (0, "GET"),
        Method::POST => (1, "POST"),
        Method::PUT => (2, "PUT"),
        Method::DELETE => (3, "DELETE"),
        Method::PATCH => (4, "PATCH"),
        Method::HEAD => (5, "HEAD"),
        Method::OPTIONS => (6, "OPTIONS"),
        Method::CONNECT => (7, "CONNECT"),
        Method::TRACE => (8, "TRACE"),
        _ => (9, "other"),
    }
}

impl Observer {
    fn count(&self, route: Option<u16>, method: &Method, status: u16, elapsed: Duration) {
        let (method_slot, method_name) = method_label(method);
        let route_slot = route.map_or(u64::from(u16::MAX), u64::from);
        let key = (self.serial, route_slot << 32 | u64::from(method_slot) << 16 | u64::from(status));
        ANSWER_HANDLES.with(|handles| {
            let mut handles = handles.borrow_mut();
            let (counter, histogram) = handles.entry(key).or_insert_with(|| {
                let route = route.and_then(|r| self.labels.get(usize::from(r))).map_or(UNMATCHED, String::as_str);
                let labels =
                    [("method", method_name.to_owned()), ("route", route.to_owned()), ("status", status.to_string())];
                (
                    metrics::counter!("combee_http_requests_total", &labels),
                    metrics::histogram!("combee_http_request_duration_seconds", &labels),
                )
            });
            counter.increment(1);
            histogram.record(elapsed.as_secs_f64());
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_distinct_and_header_safe() {
        let ids = SequentialRequestId::default();
        let (a, b) = (ids.make().unwrap(), ids.make().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.len(), 21);
        assert!(a.to_str().unwrap().bytes().all(|c| c.is_ascii_hexdigit() || c == b'-'));
    }

    #[test]
    fn methods_beyond_the_standard_ones_share_one_label() {
        assert_eq!(method_label(&Method::GET).1, "GET");
        assert_eq!(method_label(&Method::from_bytes(b"BREW").unwrap()), (9, "other"));
    }
}
