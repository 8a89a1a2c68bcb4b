//! Projects keep teams apart. Every operation of the served OpenAPI document
//! runs with a key of project B against project A's resources — named as B
//! names its own (`pa-b`) and as `team-a/pa-b` — and against absent resources
//! of the same shape, each request valid and malformed (a broken body, a bad
//! query, bad headers): B gets the same status and the same words either way,
//! since whether a resource is within reach is decided before anything else
//! of the request is read; its lists show nothing of A, and A's state is the
//! same afterwards. A's key and the server-wide key get the documented
//! answers, and an absent resource is a 404 for them too, whatever the body.
//! Then the web UI (another project's pages are 404) and webhooks (a
//! project's subscription hears only of its project).

use std::collections::BTreeSet;

use base64::{Engine, engine::general_purpose::STANDARD};
use serde_json::{Value, json};

use crate::{
    common::{Backend, TestApp, eventually, spawn_app_with},
    ui_browser::{set_cookie, sign_in},
};

const ABSENT_ID: &str = "0190a5b3-0000-7000-8000-000000000000";
const ABSENT_MEMBER: &str = "nobody@a.example";

/// Operations whose answer does not depend on a key's project, and why.
const UNSCOPED: [(&str, &str, &str); 5] = [
    ("GET", "/healthz", "liveness: no key, nothing of any project"),
    ("GET", "/readyz", "readiness: no key, nothing of any project"),
    ("GET", "/metrics", "Prometheus scrape: no key; per-prompt series name their project"),
    ("GET", "/v1/openapi.json", "the document itself"),
    ("POST", "/v1/hooks/rounds/{name}", "signed with the deployment's inbound secret, not a key: server-wide"),
];

/// Project A's resources, made fresh for each caller (its deletions use them up).
struct Fixture {
    /// The prompt's name in project A.
    prompt: String,
    traces: Vec<String>,
    round: String,
    case: String,
    hook: String,
    key: String,
    member: String,
}

/// How a request names A's prompt: bare (a name of the caller's own project)
/// or `team-a/name`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Form {
    Bare,
    Qualified,
}

impl Fixture {
    /// The prompt as `form` writes it, in a body.
    fn written(&self, form: Form) -> String {
        match form {
            Form::Bare => self.prompt.clone(),
            Form::Qualified => format!("team-a/{}", self.prompt),
        }
    }

    /// The prompt as `form` writes it, as a path segment.
    fn in_path(&self, form: Form) -> String {
        self.written(form).replace('/', "%2F")
    }

    fn ids(&self) -> impl Iterator<Item = &String> {
        self.traces.iter().chain([&self.round, &self.case, &self.hook, &self.key])
    }
}

fn trace(prompt: &str, i: usize) -> Value {
    json!({"prompt": prompt, "input": {"task": i}, "output": format!("answer {i}"), "feedback": {"success": true}})
}

async fn created(res: reqwest::Response, what: &str) -> Value {
    let status = res.status().as_u16();
    let body = res.text().await.unwrap();
    assert!((200..300).contains(&status), "{what}: {status} {body}");
    serde_json::from_str(&body).unwrap()
}

/// A's resources, made with the server-wide key (which writes A's prompt `team-a/…`).
async fn fixture(app: &TestApp, tag: &str) -> Fixture {
    let prompt = format!("pa-{tag}");
    let body = json!({"name": prompt, "base": "You help.", "project": "team-a"});
    let p = created(app.post("/v1/prompts", body).send().await.unwrap(), "prompt").await;
    assert_eq!(p["project"], "team-a");
    let (path, written) = (format!("team-a%2F{prompt}"), format!("team-a/{prompt}"));
    let v2 = json!({"base": "You help, twice."});
    created(app.post(&format!("/v1/prompts/{path}/versions"), v2).send().await.unwrap(), "version").await;
    // The round reserves the traces pending when it opens; the operations get later ones.
    let batch = json!({"traces": [trace(&written, 0), trace(&written, 1)]});
    created(app.post("/v1/traces", batch).send().await.unwrap(), "traces").await;
    let round = created(app.post(&format!("/v1/prompts/{path}/rounds"), json!({})).send().await.unwrap(), "round")
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let batch = json!({"traces": [trace(&written, 2), trace(&written, 3), trace(&written, 4)]});
    let ids = created(app.post("/v1/traces", batch).send().await.unwrap(), "traces").await;
    let traces: Vec<String> = ids["ids"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect();
    let checks = json!([{"type": "contains", "text": "answer"}]);
    let case = json!({"input": "hi", "checks": checks});
    let case = created(app.post(&format!("/v1/prompts/{path}/regression-cases"), case).send().await.unwrap(), "case")
        .await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let hook = json!({"url": "http://127.0.0.1:9/hook", "events": ["round.failed"], "project": "team-a"});
    let hook = created(app.post("/v1/webhooks", hook).send().await.unwrap(), "webhook").await;
    assert_eq!(hook["project"], "team-a");
    let key = json!({"name": format!("a-{tag}"), "scopes": ["prompts:read"], "project": "team-a"});
    let key = created(app.post("/v1/keys", key).send().await.unwrap(), "key").await;
    assert_eq!(key["project"], "team-a");
    let member = format!("person-{tag}@a.example");
    let grant = json!({"project": "team-a", "role": "viewer"});
    let res = app.put(&format!("/v1/members/{member}"), grant).send().await.unwrap();
    assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    Fixture {
        prompt,
        traces,
        round,
        case,
        hook: hook["id"].as_str().unwrap().to_owned(),
        key: key["id"].as_str().unwrap().to_owned(),
        member,
    }
}

/// One operation's concrete request: the path with the resources, its body
/// (as sent) and headers.
#[derive(Clone)]
struct Call {
    path: String,
    body: Option<String>,
    /// `Content-Type` when not JSON (`None`: JSON).
    content_type: Option<&'static str>,
    headers: Vec<(&'static str, String)>,
}

/// The request of `method path` against `fx`, naming its prompt as `form`
/// does; `None` for an operation this matrix does not know (the coverage
/// check then fails).
fn call(method: &str, template: &str, fx: &Fixture, tag: &str, form: Form) -> Option<Call> {
    let (p, written) = (fx.in_path(form), fx.written(form));
    let (t0, t1, t2) = (&fx.traces[0], &fx.traces[1], &fx.traces[2]);
    let checks = json!([{"type": "contains", "text": "answer"}]);
    let with = |path: String, body: Value, content_type: Option<&'static str>| {
        Some(Call { path, body: Some(body.to_string()), content_type, headers: Vec::new() })
    };
    let json = |path: String, body: Value| with(path, body, None);
    let bare = |path: String| Some(Call { path, body: None, content_type: None, headers: Vec::new() });
    match (method, template) {
        ("GET", "/healthz" | "/readyz" | "/metrics" | "/v1/openapi.json") => bare(template.to_owned()),
        ("GET", "/v1/prompts") => bare("/v1/prompts".into()),
        ("POST", "/v1/prompts") => {
            json("/v1/prompts".into(), json!({"name": format!("new-{tag}"), "base": "Hi.", "project": "team-a"}))
        }
        ("GET", "/v1/prompts/{name}") => bare(format!("/v1/prompts/{p}")),
        ("GET", "/v1/prompts/{name}/population") => bare(format!("/v1/prompts/{p}/population")),
        ("PATCH", "/v1/prompts/{name}/settings") => with(
            format!("/v1/prompts/{p}/settings"),
            json!({"max_wait_secs": 60}),
            Some("application/merge-patch+json"),
        ),
        ("GET", "/v1/prompts/{name}/evaluators") => bare(format!("/v1/prompts/{p}/evaluators")),
        ("PUT", "/v1/prompts/{name}/evaluators") => json(
            format!("/v1/prompts/{p}/evaluators"),
            json!({"evaluators": [{"name": "mentions", "kind": "checks", "checks": checks}]}),
        ),
        ("GET", "/v1/prompts/{name}/evaluators/calibration") => bare(format!("/v1/prompts/{p}/evaluators/calibration")),
        ("POST", "/v1/prompts/{name}/versions") => json(format!("/v1/prompts/{p}/versions"), json!({"base": "Three."})),
        ("GET", "/v1/prompts/{name}/versions") => bare(format!("/v1/prompts/{p}/versions")),
        ("GET", "/v1/prompts/{name}/versions/{number}") => bare(format!("/v1/prompts/{p}/versions/1")),
        ("GET", "/v1/prompts/{name}/versions/{number}/gate") => bare(format!("/v1/prompts/{p}/versions/2/gate")),
        ("POST", "/v1/prompts/{name}/versions/{number}/evaluation") => {
            json(format!("/v1/prompts/{p}/versions/2/evaluation"), json!({"passed": true}))
        }
        ("POST", "/v1/prompts/{name}/regression-cases") => {
            json(format!("/v1/prompts/{p}/regression-cases"), json!({"input": "hey", "checks": checks}))
        }
        ("GET", "/v1/prompts/{name}/regression-cases") => bare(format!("/v1/prompts/{p}/regression-cases")),
        ("POST", "/v1/prompts/{name}/regression-cases/import") => with(
            format!("/v1/prompts/{p}/regression-cases/import"),
            json!({"input": [{"role": "user", "content": "2+2?"}], "ideal": "4"}),
            Some("application/x-ndjson"),
        ),
        ("DELETE", "/v1/prompts/{name}/regression-cases/{id}") => {
            bare(format!("/v1/prompts/{p}/regression-cases/{}", fx.case))
        }
        ("GET", "/v1/prompts/{name}/gate") => bare(format!("/v1/prompts/{p}/gate")),
        ("PUT", "/v1/prompts/{name}/gate") => json(format!("/v1/prompts/{p}/gate"), json!({"mode": "cases"})),
        ("GET", "/v1/prompts/{name}/diff") => bare(format!("/v1/prompts/{p}/diff?from=1&to=2")),
        ("GET", "/v1/prompts/{name}/labels") => bare(format!("/v1/prompts/{p}/labels")),
        ("GET", "/v1/prompts/{name}/labels/history") => bare(format!("/v1/prompts/{p}/labels/history")),
        ("PUT", "/v1/prompts/{name}/labels/{label}") => {
            json(format!("/v1/prompts/{p}/labels/staging"), json!({"version": 1}))
        }
        ("DELETE", "/v1/prompts/{name}/labels/{label}") => bare(format!("/v1/prompts/{p}/labels/staging")),
        ("POST", "/v1/prompts/{name}/rollback") => json(format!("/v1/prompts/{p}/rollback"), json!({"to": 1})),
        ("POST", "/v1/prompts/{name}/rounds") => json(format!("/v1/prompts/{p}/rounds"), json!({})),
        ("GET", "/v1/prompts/{name}/rounds") => bare(format!("/v1/prompts/{p}/rounds")),
        ("GET", "/v1/rounds/{id}") => bare(format!("/v1/rounds/{}", fx.round)),
        ("GET", "/v1/prompts/{name}/learning") => bare(format!("/v1/prompts/{p}/learning")),
        ("DELETE", "/v1/prompts/{name}/backoff") => bare(format!("/v1/prompts/{p}/backoff")),
        ("GET", "/v1/prompts/{name}/controller") => bare(format!("/v1/prompts/{p}/controller")),
        ("GET", "/v1/prompts/{name}/metrics") => bare(format!("/v1/prompts/{p}/metrics")),
        ("GET", "/v1/prompts/{name}/spend") => bare(format!("/v1/prompts/{p}/spend")),
        ("POST", "/v1/traces") => json("/v1/traces".into(), json!({"traces": [trace(&written, 9)]})),
        ("GET", "/v1/traces") => bare("/v1/traces".into()),
        ("POST", "/v1/traces/quarantine") => json("/v1/traces/quarantine".into(), json!({"prompt": written})),
        ("GET", "/v1/traces/{id}") => bare(format!("/v1/traces/{t0}")),
        ("DELETE", "/v1/traces/{id}") => bare(format!("/v1/traces/{t2}")),
        ("POST", "/v1/traces/{id}/quarantine") => json(format!("/v1/traces/{t0}/quarantine"), json!({"reason": "odd"})),
        ("DELETE", "/v1/traces/{id}/quarantine") => bare(format!("/v1/traces/{t0}/quarantine")),
        ("POST", "/v1/traces/{id}/feedback") => json(format!("/v1/traces/{t0}/feedback"), json!({"comment": "late"})),
        ("POST", "/v1/traces/{id}/pin") => json(format!("/v1/traces/{t1}/pin"), json!({"checks": checks})),
        ("POST", "/v1/otlp/v1/traces") => json("/v1/otlp/v1/traces".into(), json!({"resourceSpans": []})),
        ("POST", "/v1/otlp/v1/logs") => json("/v1/otlp/v1/logs".into(), json!({"resourceLogs": []})),
        ("POST", "/api/public/otel/v1/traces") => {
            json("/api/public/otel/v1/traces".into(), json!({"resourceSpans": []}))
        }
        ("GET", "/api/public/v2/prompts/{name}") => bare(format!("/api/public/v2/prompts/{p}")),
        ("POST", "/v1/prompts/{name}/traces/requeue") => {
            json(format!("/v1/prompts/{p}/traces/requeue"), json!({"all": true}))
        }
        ("GET", "/v1/prompts/{name}/export") => bare(format!("/v1/prompts/{p}/export")),
        ("POST", "/v1/keys") => json(
            "/v1/keys".into(),
            json!({"name": format!("k-{tag}"), "scopes": ["prompts:read"], "project": "team-a"}),
        ),
        ("GET", "/v1/keys") => bare("/v1/keys".into()),
        ("DELETE", "/v1/keys/{id}") => bare(format!("/v1/keys/{}", fx.key)),
        ("POST", "/v1/webhooks") => json(
            "/v1/webhooks".into(),
            json!({"url": "http://127.0.0.1:9/h", "events": ["label.moved"], "project": "team-a"}),
        ),
        ("GET", "/v1/webhooks") => bare("/v1/webhooks".into()),
        ("GET", "/v1/webhooks/{id}") => bare(format!("/v1/webhooks/{}", fx.hook)),
        ("GET", "/v1/webhooks/{id}/deliveries") => bare(format!("/v1/webhooks/{}/deliveries", fx.hook)),
        ("DELETE", "/v1/webhooks/{id}") => bare(format!("/v1/webhooks/{}", fx.hook)),
        ("GET", "/v1/audit") => bare("/v1/audit".into()),
        ("GET", "/v1/members") => bare("/v1/members".into()),
        ("PUT", "/v1/members/{subject}") => json(format!("/v1/members/{}", fx.member), json!({"role": "operator"})),
        ("DELETE", "/v1/members/{subject}") => bare(format!("/v1/members/{}", fx.member)),
        ("GET", "/v1/projects") => bare("/v1/projects".into()),
        ("POST", "/v1/projects") => json("/v1/projects".into(), json!({"name": format!("made-{tag}")})),
        ("GET", "/v1/projects/{name}") => bare("/v1/projects/team-a".into()),
        ("PATCH", "/v1/projects/{name}") => {
            json("/v1/projects/team-a".into(), json!({"settings": {"prompt_defaults": {"max_wait_secs": 120}}}))
        }
        _ => None,
    }
}

/// The same request, malformed every way it can be: a body that is not
/// JSON (where the operation takes one), a query whose every parameter is
/// wrong, and headers too long to accept.
fn malformed(c: &Call) -> Call {
    let sep = if c.path.contains('?') { '&' } else { '?' };
    let query = "page_size=none&page_token=%00&from=x&to=y&version=zero&label=No%20Label&window=forever\
                 &bucket=x&format=bogus&newest=-1&days=x&ideal=bogus&subject=&status=sideways&since=never\
                 &until=never&project=Not%20A%20Project&prompt=Not%20A%20Prompt";
    Call {
        path: format!("{}{sep}{query}", c.path),
        body: c.body.as_ref().map(|_| r#"{"broken": "#.to_owned()),
        content_type: c.content_type,
        headers: vec![
            ("idempotency-key", "k".repeat(300)),
            ("combee-subject", "s".repeat(300)),
            ("if-match", "not an etag".into()),
        ],
    }
}

/// The same request against absent resources of the same shape: the
/// prompt's name (bare, or in project A), the ids, the member and the
/// project replaced.
fn absent(c: &Call, fx: &Fixture) -> Call {
    let mut path = c.path.replace(&fx.prompt, "absent-prompt").replace(&fx.member, ABSENT_MEMBER);
    for id in fx.ids() {
        path = path.replace(id.as_str(), ABSENT_ID);
    }
    path = path.replace("/v1/projects/team-a", "/v1/projects/absent-project");
    let body =
        c.body.as_ref().map(|b| b.replace(&fx.prompt, "absent-prompt").replace("\"team-a\"", "\"absent-project\""));
    Call { path, body, ..c.clone() }
}

/// An answer's detail with the absent names put back as A's (`c`: the request of A's resource).
fn as_of_a(detail: &str, fx: &Fixture, c: &Call) -> String {
    let real_id = fx.ids().find(|id| c.path.contains(id.as_str())).cloned().unwrap_or_else(|| ABSENT_ID.to_owned());
    detail
        .replace("absent-prompt", &fx.prompt)
        .replace("absent-project", "team-a")
        .replace(ABSENT_MEMBER, &fx.member)
        .replace(ABSENT_ID, &real_id)
}

/// Deletions and what they need last, so every operation finds its resource.
fn order(method: &str, template: &str) -> u8 {
    match (method, template) {
        ("DELETE", "/v1/prompts/{name}/labels/{label}") => 2,
        ("DELETE", "/v1/traces/{id}/quarantine") => 2,
        ("DELETE", _) => 3,
        _ => 1,
    }
}

/// Whether the path names a resource the reach check looks up (a prompt,
/// trace, round, webhook or project): absent or out of reach, it is a 404
/// before anything else of the request is read.
fn names_a_resource(template: &str) -> bool {
    ["/prompts/{name}", "/traces/{id}", "/rounds/{id}", "/webhooks/{id}", "/projects/{name}"]
        .iter()
        .any(|t| template.contains(t))
}

/// What the documented answer is for A's key and the server-wide key, where
/// it is not a success.
fn documented(who: &str, method: &str, template: &str) -> Option<u16> {
    match (who, method, template) {
        // Version 2 was made by hand: it has no gate, so none awaits a harness.
        (_, "GET", "/v1/prompts/{name}/versions/{number}/gate") => Some(404),
        (_, "POST", "/v1/prompts/{name}/versions/{number}/evaluation") => Some(404),
        // The fixture's own round is still in flight: at most one runs at a time.
        (_, "POST", "/v1/prompts/{name}/rounds") => Some(409),
        // Only a server-wide key creates projects.
        ("a", "POST", "/v1/projects") => Some(403),
        _ => None,
    }
}

fn send(app: &TestApp, key: &str, method: &str, c: &Call) -> reqwest::RequestBuilder {
    let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut req = app.http.request(m, app.url(&c.path)).bearer_auth(key);
    if let Some(body) = &c.body {
        req = req.header("content-type", c.content_type.unwrap_or("application/json")).body(body.clone());
    }
    for (name, value) in &c.headers {
        req = req.header(*name, value);
    }
    req
}

/// The status and the problem's detail (empty for an answer that is none).
async fn answer(app: &TestApp, key: &str, method: &str, c: &Call) -> (u16, String) {
    let res = send(app, key, method, c).send().await.unwrap();
    let status = res.status().as_u16();
    let text = res.text().await.unwrap();
    let detail = serde_json::from_str::<Value>(&text).ok().and_then(|v| v["detail"].as_str().map(str::to_owned));
    (status, detail.unwrap_or_default())
}

/// A's state as the server-wide key reads it: what any operation could change.
async fn state_of_a(app: &TestApp, fx: &Fixture) -> Value {
    let p = fx.in_path(Form::Qualified);
    let mut state = serde_json::Map::new();
    for path in [
        format!("/v1/prompts/{p}"),
        format!("/v1/prompts/{p}/versions"),
        format!("/v1/prompts/{p}/labels"),
        format!("/v1/prompts/{p}/regression-cases"),
        format!("/v1/prompts/{p}/evaluators"),
        format!("/v1/prompts/{p}/gate"),
        format!("/v1/prompts/{p}/learning"),
        format!("/v1/traces?prompt=team-a/{}", fx.prompt),
        format!("/v1/webhooks/{}", fx.hook),
        "/v1/projects".into(),
        "/v1/members".into(),
        "/v1/keys?project=team-a".into(),
        "/v1/webhooks?project=team-a".into(),
    ] {
        let mut v: Value = app.get(&path).send().await.unwrap().json().await.unwrap();
        // A round in flight moves on by itself; what B could change is whether rounds exist.
        if let Some(traces) = v.get_mut("traces").and_then(Value::as_array_mut) {
            for t in traces {
                t.as_object_mut()
                    .unwrap()
                    .retain(|k, _| ["id", "status", "quarantined_at", "feedback"].contains(&k.as_str()));
            }
        }
        // B may give people roles in B; A's grants are what must not move.
        if let Some(members) = v.get_mut("members").and_then(Value::as_array_mut) {
            members.retain(|m| m["project"] == "team-a");
        }
        if let Some(keys) = v.get_mut("keys").and_then(Value::as_array_mut) {
            keys.retain(|k| k["project"] == "team-a");
        }
        if let Some(l) = v.get_mut("state") {
            *l = Value::Null;
        }
        state.insert(path, v);
    }
    let rounds: Value = app.get(&format!("/v1/prompts/{p}/rounds")).send().await.unwrap().json().await.unwrap();
    state.insert("rounds".into(), json!(rounds["rounds"].as_array().map_or(0, Vec::len)));
    Value::Object(state)
}

async fn operations(app: &TestApp) -> Vec<(String, String)> {
    let doc: Value = app.get("/v1/openapi.json").send().await.unwrap().json().await.unwrap();
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            if ["get", "post", "put", "patch", "delete"].contains(&method.as_str()) {
                ops.push((method.to_uppercase(), path.clone()));
            }
        }
    }
    ops.sort_by_key(|(m, p)| (order(m, p), p.clone(), m.clone()));
    ops
}

async fn every_operation_keeps_project_b_out_of_project_a(b: Backend) {
    let secret = format!("whsec_{}", STANDARD.encode(b"a test secret of thirty-two bytes"));
    let app = spawn_app_with(b, |s| {
        s.webhooks.inbound_secrets = vec![combee::secret::Secret::new(secret)];
        s.webhooks.allow_private_targets = true;
    })
    .await;
    for name in ["team-a", "team-b"] {
        created(app.post("/v1/projects", json!({"name": name})).send().await.unwrap(), "project").await;
    }
    let mint = async |project: &str| {
        let body = json!({"name": format!("{project} admin"), "scopes": ["admin"], "project": project});
        created(app.post("/v1/keys", body).send().await.unwrap(), "key").await["secret"].as_str().unwrap().to_owned()
    };
    let key_a = mint("team-a").await;
    let key_b = mint("team-b").await;
    let ops = operations(&app).await;
    let known: BTreeSet<(String, String)> = ops.iter().cloned().collect();
    assert!(known.len() > 60, "{known:?}");

    // B's key, against A's resources and against absent ones: the same answer, and nothing changes.
    let fx = fixture(&app, "b").await;
    let before = state_of_a(&app, &fx).await;
    let (mut compared, mut refused) = (0, 0);
    let unscoped = |m: &str, t: &str| UNSCOPED.iter().any(|(um, ut, _)| (*um, *ut) == (m, t));
    for form in [Form::Bare, Form::Qualified] {
        for (method, template) in &ops {
            if unscoped(method, template) {
                continue;
            }
            let c = call(method, template, &fx, "b", form)
                .unwrap_or_else(|| panic!("the matrix does not run {method} {template}"));
            let lists = method == "GET" && !template.contains('{');
            if lists {
                let text = send(&app, &key_b, method, &c).send().await.unwrap().text().await.unwrap();
                for secret_of_a in [&fx.prompt, &fx.hook, &fx.key, &fx.traces[0], &"team-a".to_owned()] {
                    assert!(!text.contains(secret_of_a.as_str()), "B's {template} shows A's {secret_of_a}: {text}");
                }
            }
            for (how, request) in [("valid", c.clone()), ("malformed", malformed(&c))] {
                let of_a = answer(&app, &key_b, method, &request).await;
                let missing = absent(&request, &fx);
                let (status, detail) = answer(&app, &key_b, method, &missing).await;
                let of_absent = (status, as_of_a(&detail, &fx, &request));
                assert_eq!(
                    of_a, of_absent,
                    "B, {form:?}, {how}: {method} {template} answers A's resource unlike an absent one"
                );
                compared += 1;
                if names_a_resource(template) {
                    assert_eq!(of_a.0, 404, "B, {form:?}, {how}: {method} {template}: {}", of_a.1);
                    refused += 1;
                }
            }
        }
    }
    assert!(compared > 240 && refused > 170, "{compared} compared, {refused} refused");
    assert_eq!(state_of_a(&app, &fx).await, before, "B's key changed something of A");
    // B's audit log names nothing of A, and B's failed writes wrote no entry of A.
    let audit: Value =
        app.http.get(app.url("/v1/audit")).bearer_auth(&key_b).send().await.unwrap().json().await.unwrap();
    assert!(audit["entries"].as_array().unwrap().iter().all(|e| e["project"] == "team-b"), "{audit}");

    // A's key (bare names) and the server-wide key (`team-a/…`): the documented answers, each on
    // fresh resources; and an absent resource is a 404 before a malformed request is read.
    let mut covered = BTreeSet::new();
    for (who, key, form) in [("a", key_a.clone(), Form::Bare), ("server", app.admin_key.clone(), Form::Qualified)] {
        let fx = fixture(&app, who).await;
        for (method, template) in &ops {
            covered.insert((method.clone(), template.clone()));
            if template.starts_with("/v1/hooks/") {
                continue;
            }
            let c = call(method, template, &fx, who, form).unwrap();
            if names_a_resource(template) {
                let (status, detail) = answer(&app, &key, method, &absent(&malformed(&c), &fx)).await;
                assert_eq!(status, 404, "{who}: a malformed {method} {template} of an absent resource: {detail}");
            }
            let res = send(&app, &key, method, &c).send().await.unwrap();
            let status = res.status().as_u16();
            let text = res.text().await.unwrap();
            match documented(who, method, template) {
                Some(want) => assert_eq!(status, want, "{who}: {method} {template}: {text}"),
                None => assert!((200..300).contains(&status), "{who}: {method} {template}: {status} {text}"),
            }
        }
        // The list routes show A's resources to both.
        let list: Value =
            app.http.get(app.url("/v1/prompts")).bearer_auth(&key).send().await.unwrap().json().await.unwrap();
        assert!(list["prompts"].as_array().unwrap().iter().any(|p| p["name"] == fx.prompt.as_str()), "{who}: {list}");
    }
    assert_eq!(covered, known, "every operation of the document ran");

    // The inbound trigger (signed, server-wide) finds its prompt before it reads the body too.
    let hook = |prompt: &str| {
        let (id, ts, body) = ("msg_matrix", chrono::Utc::now().timestamp(), r#"{"broken": "#);
        let mut mac =
            <hmac::Hmac<sha2::Sha256> as hmac::Mac>::new_from_slice(b"a test secret of thirty-two bytes").unwrap();
        hmac::Mac::update(&mut mac, format!("{id}.{ts}.{body}").as_bytes());
        let sig = STANDARD.encode(hmac::Mac::finalize(mac).into_bytes());
        app.http
            .post(app.url(&format!("/v1/hooks/rounds/{prompt}")))
            .header("webhook-id", id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", format!("v1,{sig}"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    assert_eq!(hook("team-a%2Fabsent-prompt").await.unwrap().status(), 404);
    assert_eq!(hook(&format!("team-a%2F{}", fx.prompt)).await.unwrap().status(), 400, "found; then the body");

    // The server-wide key filters lists by project; A's key sees its project only.
    let of_b: Value = app.get("/v1/prompts?project=team-b").send().await.unwrap().json().await.unwrap();
    assert!(of_b["prompts"].as_array().unwrap().is_empty(), "{of_b}");
    let of_a: Value = app.get("/v1/prompts?project=team-a").send().await.unwrap().json().await.unwrap();
    assert!(of_a["prompts"].as_array().unwrap().iter().all(|p| p["project"] == "team-a"), "{of_a}");
    let projects: Value =
        app.http.get(app.url("/v1/projects")).bearer_auth(&key_a).send().await.unwrap().json().await.unwrap();
    let names: Vec<&str> =
        projects["projects"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["team-a"]);
    // A project's key mints keys of its own project only.
    let res = app.http.post(app.url("/v1/keys")).bearer_auth(&key_a).json(&json!({"name": "x", "scopes": ["admin"]}));
    assert_eq!(created(res.send().await.unwrap(), "key").await["project"], "team-a");
    // A name another project holds is B's to take: names are per project.
    let taken = json!({"name": "pa-a", "base": "Mine.", "project": "team-b"});
    let res = app.http.post(app.url("/v1/prompts")).bearer_auth(&key_b).json(&taken).send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    let again = app.http.post(app.url("/v1/prompts")).bearer_auth(&key_b).json(&taken).send().await.unwrap();
    let text = crate::common::expect_problem(again, 409).await.to_string();
    assert!(text.contains("team-b") && !text.contains("team-a"), "taken in B's own project: {text}");
}

async fn another_projects_ui_pages_are_absent(b: Backend) {
    let app = spawn_app_with(b, |s| s.webhooks.allow_private_targets = true).await;
    for name in ["team-a", "team-b"] {
        created(app.post("/v1/projects", json!({"name": name})).send().await.unwrap(), "project").await;
    }
    let fx = fixture(&app, "ui").await;
    let key = async |project: &str| {
        let body = json!({"name": project, "scopes": ["prompts:read"], "project": project});
        created(app.post("/v1/keys", body).send().await.unwrap(), "key").await["secret"].as_str().unwrap().to_owned()
    };
    let session = async |key: &str| set_cookie(&sign_in(&app, key).await, "combee_session").unwrap();
    let page = async |cookie: &str, path: &str| {
        let res = crate::ui_browser::plain_client()
            .get(app.url(path))
            .header("cookie", format!("combee_session={cookie}"))
            .send()
            .await
            .unwrap();
        (res.status().as_u16(), res.text().await.unwrap())
    };
    let b_session = session(&key("team-b").await).await;
    let a_session = session(&key("team-a").await).await;
    let p = &fx.prompt;
    for path in [
        format!("/ui/prompts/{p}"),
        format!("/ui/prompts/{p}/diff?from=1&to=2"),
        format!("/ui/prompts/{p}/versions/1"),
        format!("/ui/prompts/{p}/rounds"),
        format!("/ui/prompts/{p}/controller"),
        format!("/ui/rounds/{}", fx.round),
        format!("/ui/traces/{}", fx.traces[0]),
    ] {
        let (status, body) = page(&b_session, &path).await;
        assert_eq!(status, 404, "B: {path}");
        assert!(!body.contains("You help"), "B: {path} shows A's text");
        let (status, _) = page(&a_session, &path).await;
        assert_eq!(status, 200, "A: {path}");
    }
    let (_, list) = page(&b_session, "/ui/prompts").await;
    assert!(!list.contains(p.as_str()) && list.contains("team-b"), "{list}");
    let (_, traces) = page(&b_session, "/ui/traces").await;
    assert!(!traces.contains(&fx.traces[0]), "B's trace list shows A's traces");
    let (_, mine) = page(&a_session, &format!("/ui/prompts/{p}")).await;
    assert!(mine.contains("project team-a"), "the prompt's page names its project");
    // A server-wide session has a project column and filter.
    let server = session(&app.admin_key).await;
    let (_, all) = page(&server, "/ui/prompts").await;
    assert!(all.contains("<th>Project</th>") && all.contains(r#"<td class="project">team-a</td>"#), "{all}");
    let (_, only_b) = page(&server, "/ui/prompts?project=team-b").await;
    assert!(!only_b.contains(p.as_str()));
    // Another project's prompt is written with its project: B's session finds it absent so too; a
    // server-wide session reaches it so (its links are written so), and its bare name is `default`'s.
    let qualified = format!("team-a%2F{p}");
    assert_eq!(page(&b_session, &format!("/ui/prompts/{qualified}")).await.0, 404);
    assert!(all.contains(&format!(r#"href="/ui/prompts/{qualified}""#)), "{all}");
    let (status, html) = page(&server, &format!("/ui/prompts/{qualified}")).await;
    assert_eq!(status, 200);
    assert!(html.contains(&format!("/ui/prompts/{qualified}/rounds")), "{html}");
    assert_eq!(page(&server, &format!("/ui/prompts/{p}")).await.0, 404);
}

async fn a_projects_webhook_hears_only_its_projects_events(b: Backend) {
    let app = spawn_app_with(b, |s| {
        s.server.role = combee::config::ProcessRole::All;
        s.llm.base_url = "http://127.0.0.1:9/v1".into();
        s.webhooks.allow_private_targets = true;
        s.webhooks.poll_interval_ms = 50;
    })
    .await;
    for name in ["team-a", "team-b"] {
        created(app.post("/v1/projects", json!({"name": name})).send().await.unwrap(), "project").await;
    }
    // Receivers that answer 200 and count.
    let hits = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(String, String)>::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let seen = hits.clone();
    let receiver = axum::Router::new().route(
        "/{who}",
        axum::routing::post(async move |axum::extract::Path(who): axum::extract::Path<String>, body: String| {
            seen.lock().unwrap().push((who, body));
            axum::http::StatusCode::OK
        }),
    );
    tokio::spawn(async move { axum::serve(listener, receiver).await });
    let subscribe = async |who: &str, project: Option<&str>| {
        let mut body = json!({"url": format!("{base}/{who}"), "events": ["version.created"]});
        if let Some(p) = project {
            body["project"] = json!(p);
        }
        created(app.post("/v1/webhooks", body).send().await.unwrap(), "webhook").await
    };
    subscribe("a", Some("team-a")).await;
    subscribe("b", Some("team-b")).await;
    subscribe("all", None).await;
    for (name, project) in [("in-a", "team-a"), ("in-b", "team-b")] {
        let body = json!({"name": name, "base": "Hi.", "project": project});
        created(app.post("/v1/prompts", body).send().await.unwrap(), "prompt").await;
    }
    let got = eventually("four deliveries", std::time::Duration::from_secs(30), async || {
        let got = hits.lock().unwrap().clone();
        if got.len() >= 4 { Ok(got) } else { Err(format!("{got:?}")) }
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let got = if hits.lock().unwrap().len() > got.len() { hits.lock().unwrap().clone() } else { got };
    let to = |who: &str| {
        let mut prompts: Vec<String> = got
            .iter()
            .filter(|(w, _)| w == who)
            .map(|(_, body)| {
                serde_json::from_str::<Value>(body).unwrap()["data"]["prompt"].as_str().unwrap().to_owned()
            })
            .collect();
        prompts.sort();
        prompts
    };
    assert_eq!(to("a"), ["in-a"], "{got:?}");
    assert_eq!(to("b"), ["in-b"], "{got:?}");
    assert_eq!(to("all"), ["in-a", "in-b"], "{got:?}");
}

/// Any name a project may have, a grant may name: a dot included.
async fn a_project_named_with_a_dot_takes_members(b: Backend) {
    let app = spawn_app_with(b, |_| {}).await;
    created(app.post("/v1/projects", json!({"name": "team.eu"})).send().await.unwrap(), "project").await;
    let res =
        app.put("/v1/members/ann@eu.example", json!({"project": "team.eu", "role": "operator"})).send().await.unwrap();
    assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    let listed: Value = app.get("/v1/members").send().await.unwrap().json().await.unwrap();
    let ann = listed["members"].as_array().unwrap().iter().find(|m| m["subject"] == "ann@eu.example").unwrap().clone();
    assert_eq!(ann["project"], "team.eu", "{listed}");
    // A name the project rule refuses is still refused, with the rule.
    let res = app.put("/v1/members/ann@eu.example", json!({"project": ".eu", "role": "viewer"})).send().await.unwrap();
    assert_eq!(res.status(), 422);
    assert!(res.text().await.unwrap().contains("`.`, `-` and `_`"));
}

crate::on_one_store!(
    matrix_on_postgres: every_operation_keeps_project_b_out_of_project_a(Postgres),
    matrix_on_sqlite: every_operation_keeps_project_b_out_of_project_a(Sqlite),
    ui_on_postgres: another_projects_ui_pages_are_absent(Postgres),
    webhooks_on_postgres: a_projects_webhook_hears_only_its_projects_events(Postgres),
    dotted_name_on_sqlite: a_project_named_with_a_dot_takes_members(Sqlite),
);
