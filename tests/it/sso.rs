//! Single sign-on against a REAL OpenID Connect provider: PyPI's
//! `oidc-provider-mock` (installed by `scripts/test`), started on a free port
//! per test, with people and their group claims registered through its HTTP
//! API. A person signs in through the provider's own authorization form in
//! headless Chromium, or over plain HTTP for the role-by-page checks; the ID
//! tokens are the provider's, signed with its key, checked against its JWKS.

use crate::{
    common::{self, TestApp, eventually, spawn_app_with},
    ui_browser::{Browser, hidden, plain_client, set_cookie},
};

use std::{process::Stdio, time::Duration};

use combee::{
    config::Settings,
    domain::access::Role,
    oidc::config::{GroupMapping, OidcSettings},
    secret::Secret,
};
use common::{Backend, expect_problem};
use serde_json::{Value, json};

/// The provider, stopped when dropped.
pub struct Provider {
    pub url: String,
    _process: tokio::process::Child,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Provider {
    pub async fn start() -> Provider {
        let found = std::process::Command::new("python3").args(["-c", "import oidc_provider_mock"]).output();
        assert!(
            found.is_ok_and(|o| o.status.success()),
            "the OpenID provider for these tests is not installed: run `scripts/test` (it installs oidc-provider-mock)"
        );
        let port = free_port();
        let process = tokio::process::Command::new("python3")
            .args(["-m", "oidc_provider_mock", "--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start oidc-provider-mock");
        let url = format!("http://127.0.0.1:{port}");
        let discovery = format!("{url}/.well-known/openid-configuration");
        eventually("the OpenID provider to answer", Duration::from_secs(30), async || {
            match reqwest::get(&discovery).await {
                Ok(r) if r.status().is_success() => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
        Provider { url, _process: process }
    }

    /// Registers a person with these claims (`groups`, `name`, `email`…).
    pub async fn person(&self, sub: &str, claims: Value) {
        let res = reqwest::Client::new().put(format!("{}/users/{sub}", self.url)).json(&claims).send().await.unwrap();
        assert!(res.status().is_success(), "{}", res.text().await.unwrap());
    }
}

fn mapping(claim: &str, project: Option<&str>, role: Role) -> GroupMapping {
    GroupMapping { claim: claim.into(), project: project.map(Into::into), role }
}

/// An app whose web UI signs people in through `provider`: team-x operates
/// project x, readers view it, sre administers the whole server.
pub async fn sso_app(b: Backend, provider: &Provider, tweak: impl FnOnce(&mut Settings)) -> TestApp {
    let port = free_port();
    let issuer = provider.url.clone();
    spawn_app_with(b, move |s| {
        s.server.bind = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        s.auth.oidc = Some(OidcSettings {
            issuer,
            client_id: "combee-test".into(),
            client_secret: Secret::new("test-client-secret"),
            redirect_url: format!("http://127.0.0.1:{port}/ui/oidc/callback"),
            scopes: "openid email profile".into(),
            groups_claim: "groups".into(),
            groups: vec![
                mapping("team-x", Some("x"), Role::Operator),
                mapping("readers", Some("x"), Role::Viewer),
                mapping("sre", None, Role::Admin),
            ],
        });
        tweak(s);
    })
    .await
}

/// A prompt at v1 (production) with a v2 to promote, and a trace to act on.
async fn seed(app: &TestApp) -> String {
    assert_eq!(app.post("/v1/projects", json!({"name": "x"})).send().await.unwrap().status(), 201);
    let support = json!({"name": "support", "base": "You answer questions.", "promotion": "manual", "project": "x"});
    let res = app.post("/v1/prompts", support).send().await.unwrap();
    assert_eq!(res.status(), 201);
    // A prompt of another project, which people of project x never see.
    let elsewhere = json!({"name": "elsewhere", "base": "You answer other questions."});
    assert_eq!(app.post("/v1/prompts", elsewhere).send().await.unwrap().status(), 201);
    // The server-wide admin key names project x's prompt `x/support`.
    let res = app.post("/v1/prompts/x%2Fsupport/versions", json!({"base": "You answer questions well."})).send().await;
    assert_eq!(res.unwrap().status(), 201);
    let trace = json!({"prompt": "x/support", "input": {"q": "hi"}, "output": "hello", "feedback": {"success": true}});
    let res: Value = app.post("/v1/traces", json!({"traces": [trace]})).send().await.unwrap().json().await.unwrap();
    res["ids"][0].as_str().unwrap().to_owned()
}

/// One sign-in over plain HTTP, as a browser would make it, up to the
/// provider's redirect back: the callback URL and this browser's state cookie.
async fn through_provider(app: &TestApp, sub: &str) -> (String, String) {
    let http = plain_client();
    let start = http.get(app.url("/ui/oidc/start")).send().await.unwrap();
    assert_eq!(start.status(), 303);
    let state = set_cookie(&start, "combee_oidc").expect("a state cookie");
    let authorize = start.headers()["location"].to_str().unwrap().to_owned();
    assert!(authorize.contains("code_challenge_method=S256") && authorize.contains("nonce="), "{authorize}");
    let back = http.post(&authorize).form(&[("sub", sub)]).send().await.unwrap();
    assert!(back.status().is_redirection(), "{}", back.text().await.unwrap());
    (back.headers()["location"].to_str().unwrap().to_owned(), state)
}

/// Signs `sub` in over plain HTTP; the callback's answer.
async fn sso_sign_in(app: &TestApp, sub: &str) -> reqwest::Response {
    let (callback, state) = through_provider(app, sub).await;
    plain_client().get(&callback).header("cookie", format!("combee_oidc={state}")).send().await.unwrap()
}

async fn session_of(app: &TestApp, sub: &str) -> String {
    let res = sso_sign_in(app, sub).await;
    assert_eq!(res.status(), 200, "{sub} signs in");
    set_cookie(&res, "combee_session").expect("a session cookie")
}

async fn page(app: &TestApp, session: &str, path: &str) -> (u16, String) {
    let res =
        plain_client().get(app.url(path)).header("cookie", format!("combee_session={session}")).send().await.unwrap();
    (res.status().as_u16(), res.text().await.unwrap())
}

async fn post(app: &TestApp, session: &str, path: &str, form: &[(&str, &str)]) -> reqwest::Response {
    plain_client()
        .post(app.url(path))
        .header("cookie", format!("combee_session={session}"))
        .form(form)
        .send()
        .await
        .unwrap()
}

async fn people(provider: &Provider) {
    provider.person("ann", json!({"name": "Ann Operator", "email": "ann@example.com", "groups": ["team-x"]})).await;
    provider.person("vic", json!({"name": "Vic Viewer", "email": "vic@example.com", "groups": ["readers"]})).await;
    provider.person("ada", json!({"name": "Ada Admin", "email": "ada@example.com", "groups": ["sre"]})).await;
    provider.person("sam", json!({"name": "Sam Both", "groups": ["team-x", "sre"]})).await;
    provider.person("zed", json!({"name": "Zed Stranger", "email": "zed@example.com", "groups": ["guests"]})).await;
}

async fn sign_in_in_the_browser(b: Backend) {
    let provider = Provider::start().await;
    people(&provider).await;
    let app = sso_app(b, &provider, |_| {}).await;
    seed(&app).await;
    let br = Browser::start("sso").await;

    // A state changed on the way to the provider comes back refused, and opens no session.
    br.goto(&app.url("/ui/login")).await;
    br.click("#sso-sign-in").await;
    br.wait_url(&provider.url).await;
    let authorize = br.url().await;
    let state = authorize.split("state=").nth(1).unwrap().split('&').next().unwrap().to_owned();
    br.goto(&authorize.replace(&format!("state={state}"), "state=tampered")).await;
    br.type_into("input[name=sub]", "ann").await;
    br.click("button[type=submit]").await;
    br.wait_url("/ui/oidc/callback").await;
    assert!(br.text("#bad-state").await.contains("not valid"));
    br.screenshot("00-tampered-state").await;
    br.goto(&app.url("/ui/prompts")).await;
    br.wait_url("/ui/login").await;

    // Ann (team-x) signs in on the provider's own page and lands in project x as an operator.
    br.goto(&app.url("/ui/login")).await;
    br.click("#sso-sign-in").await;
    br.wait_url(&provider.url).await;
    br.type_into("input[name=sub]", "ann").await;
    br.click("button[type=submit]").await;
    br.wait_url("/ui/prompts").await;
    assert_eq!(br.text("#who").await, "Ann Operator operator in x");
    let cookie = br.cookie("combee_session").await;
    assert_eq!((cookie["httpOnly"].as_bool(), cookie["sameSite"].as_str()), (Some(true), Some("Strict")), "{cookie}");
    br.goto(&app.url("/ui/prompts/support")).await;
    assert_eq!(br.count("#promote-2").await, 1, "an operator's promote form");
    assert_eq!(br.count("#nav-audit").await, 0, "an operator is no admin");
    br.screenshot("01-operator").await;
    br.click("#sign-out").await;
    br.wait_url("/ui/login").await;

    // Vic (readers) views: no action forms.
    br.click("#sso-sign-in").await;
    br.wait_url(&provider.url).await;
    br.type_into("input[name=sub]", "vic").await;
    br.click("button[type=submit]").await;
    br.wait_url("/ui/prompts").await;
    assert_eq!(br.text("#who-detail").await, "viewer in x");
    br.goto(&app.url("/ui/prompts/support")).await;
    assert!(br.text("#versions").await.contains("v2"));
    assert_eq!(br.count("#promote-2").await + br.count("#rollback-2").await, 0, "a viewer has no action forms");
    br.screenshot("02-viewer").await;
    br.click("#sign-out").await;
    br.wait_url("/ui/login").await;

    // Zed's groups map to nothing: a clear refusal, and no session.
    br.click("#sso-sign-in").await;
    br.wait_url(&provider.url).await;
    br.type_into("input[name=sub]", "zed").await;
    br.click("button[type=submit]").await;
    br.wait_url("/ui/oidc/callback").await;
    let refusal = br.text("#not-member").await;
    assert!(refusal.contains("not a member of any project on this combee"), "{refusal}");
    assert!(refusal.contains("ask an admin to map one of your groups"), "{refusal}");
    br.screenshot("03-not-a-member").await;
    br.goto(&app.url("/ui/prompts")).await;
    br.wait_url("/ui/login").await;

    // Sam holds two grants: picks where to work, then may switch.
    br.click("#sso-sign-in").await;
    br.wait_url(&provider.url).await;
    br.type_into("input[name=sub]", "sam").await;
    br.click("button[type=submit]").await;
    br.wait_url("/ui/pick").await;
    let grants = br.text("#grants").await;
    assert!(grants.contains("operator in x") && grants.contains("admin on the whole server"), "{grants}");
    br.screenshot("04-pick").await;
    br.click("#pick-1").await;
    br.wait_url("/ui/prompts").await;
    assert_eq!(br.text("#who-detail").await, "admin on the whole server");
    assert_eq!(br.count("#nav-members").await, 1);
    assert_eq!(br.count("#switch-grant").await, 1);

    // Sign-ins are audited, naming the person, never a token.
    let log: Value = app.get("/v1/audit?action=ui.sign_in").send().await.unwrap().json().await.unwrap();
    let names: Vec<&str> =
        log["entries"].as_array().unwrap().iter().map(|e| e["actor_name"].as_str().unwrap()).collect();
    assert_eq!(names, ["Sam Both", "Vic Viewer", "Ann Operator"], "{log}");
    let first = &log["entries"][2];
    assert_eq!((first["actor_type"].as_str(), first["actor_id"].as_str()), (Some("person"), Some("ann")), "{first}");
}

async fn state_is_single_use_and_bound_to_the_browser(b: Backend) {
    let provider = Provider::start().await;
    people(&provider).await;
    let app = sso_app(b, &provider, |_| {}).await;

    // A tampered state: the provider's answer with another state, or this browser's cookie changed.
    let (callback, state) = through_provider(&app, "ann").await;
    let http = plain_client();
    let tampered = callback.replace(&format!("state={state}"), "state=forged");
    assert_ne!(tampered, callback);
    let res = http.get(&tampered).header("cookie", format!("combee_oidc={state}")).send().await.unwrap();
    assert_eq!(res.status(), 403);
    assert!(res.text().await.unwrap().contains("id=\"bad-state\""));
    let res = http.get(&callback).header("cookie", "combee_oidc=forged").send().await.unwrap();
    assert_eq!(res.status(), 403, "a state from another browser");
    let res = http.get(&callback).send().await.unwrap();
    assert_eq!(res.status(), 403, "no state cookie");
    assert!(set_cookie(&res, "combee_session").is_none());

    // The genuine callback works once; replayed, it is refused.
    let (callback, state) = through_provider(&app, "ann").await;
    let first = http.get(&callback).header("cookie", format!("combee_oidc={state}")).send().await.unwrap();
    assert_eq!(first.status(), 200);
    let session = set_cookie(&first, "combee_session").unwrap();
    assert_eq!(set_cookie(&first, "combee_oidc").as_deref(), Some(""), "the state cookie is cleared");
    assert!(first.text().await.unwrap().contains("url=/ui/prompts"));
    let again = http.get(&callback).header("cookie", format!("combee_oidc={state}")).send().await.unwrap();
    assert_eq!(again.status(), 403, "a replayed state");
    assert!(set_cookie(&again, "combee_session").is_none());
    assert_eq!(page(&app, &session, "/ui/prompts").await.0, 200, "the first sign-in stands");
}

async fn each_role_sees_and_may_post_what_it_allows(b: Backend) {
    let provider = Provider::start().await;
    people(&provider).await;
    let app = sso_app(b, &provider, |_| {}).await;
    let trace = seed(&app).await;
    let trace_page = format!("/ui/traces/{trace}");

    for (sub, role) in [("vic", "viewer"), ("ann", "operator"), ("ada", "admin")] {
        let s = session_of(&app, sub).await;
        let operates = role != "viewer";
        let admin = role == "admin";
        // People of x write its prompt bare; a server-wide admin writes `x/support` (so may they).
        let support = if admin { "/ui/prompts/x%2Fsupport" } else { "/ui/prompts/support" };
        let (status, prompt) = page(&app, &s, support).await;
        assert_eq!(status, 200);
        // Project x's people meet another project's prompt as absent; a server-wide admin sees it.
        let elsewhere = page(&app, &s, "/ui/prompts/elsewhere").await.0;
        assert_eq!(elsewhere, if admin { 200 } else { 404 }, "{role}: another project's prompt");
        let (_, list) = page(&app, &s, "/ui/prompts").await;
        assert_eq!(list.contains("elsewhere"), admin, "{role}: the prompt list");
        assert_eq!(prompt.contains(r#"id="promote-2""#), operates, "{role}: promote form");
        assert_eq!(prompt.contains(r#"id="rollback-2""#), operates, "{role}: rollback form");
        assert_eq!(prompt.contains(r#"id="nav-members""#), admin, "{role}: members link");
        let (status, trace_html) = page(&app, &s, &trace_page).await;
        assert_eq!(status, 200);
        if !operates {
            // Sign-out is a viewer's one form.
            let forms = |html: &str| html.matches(r#"method="post""#).count();
            assert_eq!((forms(&prompt), forms(&trace_html)), (1, 1), "a viewer sees no action form");
        }
        assert_eq!(trace_html.contains(r#"id="quarantine""#), operates, "{role}: quarantine form");
        assert_eq!(page(&app, &s, "/ui/audit").await.0, if admin { 200 } else { 403 }, "{role}: audit page");
        let (status, members) = page(&app, &s, "/ui/members").await;
        assert_eq!(status, if admin { 200 } else { 403 }, "{role}: members page");
        assert_eq!(members.contains(r#"id="member-form""#), admin);

        // The forms' POSTs, with this session's CSRF token.
        let csrf = hidden(&page(&app, &s, "/ui/prompts").await.1, "csrf");
        let promote =
            post(&app, &s, "/ui/prompts/x%2Fsupport/promote", &[("csrf", &csrf), ("version", "2"), ("expected", "1")])
                .await;
        if operates {
            assert_eq!(promote.status(), 303, "{role} promotes");
            let back = [("csrf", csrf.as_str()), ("version", "1"), ("expected", "2")];
            assert_eq!(post(&app, &s, &format!("{support}/promote"), &back).await.status(), 303);
        } else {
            assert_eq!(promote.status(), 403, "a viewer's POST is refused");
            assert!(promote.text().await.unwrap().contains("Your role (viewer in x) does not allow this"));
        }
        let quarantine =
            post(&app, &s, &format!("{trace_page}/quarantine"), &[("csrf", &csrf), ("reason", role)]).await;
        assert_eq!(quarantine.status().as_u16(), if operates { 303 } else { 403 }, "{role} quarantines");
        if operates {
            assert_eq!(post(&app, &s, &format!("{trace_page}/release"), &[("csrf", &csrf)]).await.status(), 303);
        }
        let member = [("csrf", csrf.as_str()), ("subject", "lee@example.com"), ("project", "x"), ("role", "viewer")];
        assert_eq!(post(&app, &s, "/ui/members", &member).await.status().as_u16(), if admin { 303 } else { 403 });
    }

    // The changes name the person who made them.
    let log: Value = app.get("/v1/audit?action=member.set").send().await.unwrap().json().await.unwrap();
    let e = &log["entries"][0];
    assert_eq!((e["actor_type"].as_str(), e["actor_name"].as_str()), (Some("person"), Some("Ada Admin")), "{log}");
    let api: Value = app.get("/v1/prompts/x%2Fsupport/labels/history").send().await.unwrap().json().await.unwrap();
    assert!(api.to_string().contains("person:ann (web UI)"), "{api}");
}

async fn members_give_grants_and_key_sign_in_can_be_switched_off(b: Backend) {
    let provider = Provider::start().await;
    provider.person("lee", json!({"name": "Lee", "email": "Lee@Example.com", "groups": []})).await;
    let app = sso_app(b, &provider, |s| s.auth.key_sign_in = false).await;

    // No group maps: refused until an admin makes Lee a member (by email, any case).
    let res = sso_sign_in(&app, "lee").await;
    assert_eq!(res.status(), 403);
    assert!(res.text().await.unwrap().contains("not a member of any project"));
    let grant = json!({"project": "x", "role": "operator"});
    let put = app.put("/v1/members/lee@example.com", grant.clone()).send().await.unwrap();
    assert_eq!(put.status(), 404, "a grant names a project that exists");
    assert_eq!(app.post("/v1/projects", json!({"name": "x"})).send().await.unwrap().status(), 201);
    let put = app.put("/v1/members/lee@example.com", grant).send().await.unwrap();
    assert_eq!(put.status(), 200);
    let member: Value = put.json().await.unwrap();
    assert_eq!(
        (member["subject"].as_str(), member["project"].as_str(), member["role"].as_str()),
        (Some("lee@example.com"), Some("x"), Some("operator"))
    );
    let s = session_of(&app, "lee").await;
    assert!(page(&app, &s, "/ui/prompts").await.1.contains("operator in x"));
    let list: Value = app.get("/v1/members").send().await.unwrap().json().await.unwrap();
    assert_eq!(list["members"].as_array().unwrap().len(), 1, "{list}");
    // A grant in each project: y's admin gives Lee a role in y without learning of x's, and
    // takes back only its own.
    assert_eq!(app.post("/v1/projects", json!({"name": "y"})).send().await.unwrap().status(), 201);
    let y_key = json!({"name": "y admin", "scopes": ["admin"], "project": "y"});
    let y_key: Value = app.post("/v1/keys", y_key).send().await.unwrap().json().await.unwrap();
    let y_admin = y_key["secret"].as_str().unwrap();
    let as_y = |req: reqwest::RequestBuilder| req.bearer_auth(y_admin).send();
    let put = as_y(app.http.put(app.url("/v1/members/lee@example.com")).json(&json!({"role": "viewer"}))).await;
    let member: Value = put.unwrap().json().await.unwrap();
    assert_eq!((member["project"].as_str(), member["role"].as_str()), (Some("y"), Some("viewer")), "{member}");
    let seen_by_y: Value = as_y(app.http.get(app.url("/v1/members"))).await.unwrap().json().await.unwrap();
    assert_eq!(seen_by_y["members"].as_array().unwrap().len(), 1, "y sees its grant only: {seen_by_y}");
    let all: Value = app.get("/v1/members").send().await.unwrap().json().await.unwrap();
    assert_eq!(all["members"].as_array().unwrap().len(), 2, "{all}");
    let gone = as_y(app.http.delete(app.url("/v1/members/lee@example.com?project=x"))).await.unwrap();
    expect_problem(gone, 404).await;
    let gone = as_y(app.http.delete(app.url("/v1/members/lee@example.com"))).await.unwrap();
    assert_eq!(gone.status(), 204);
    let all: Value = app.get("/v1/members").send().await.unwrap().json().await.unwrap();
    assert_eq!(all["members"][0]["project"], "x", "x's grant stays: {all}");

    // Untrusted input is refused with a reason, and only admins manage members.
    expect_problem(
        app.put("/v1/members/lee", json!({"project": "Not A Project", "role": "viewer"})).send().await.unwrap(),
        422,
    )
    .await;
    expect_problem(app.put("/v1/members/lee", json!({"role": "owner"})).send().await.unwrap(), 422).await;
    expect_problem(app.put("/v1/members/%20lee", json!({"role": "viewer"})).send().await.unwrap(), 422).await;
    let reader = app.key_with(&["prompts:read"]).await;
    let res = app.http.get(app.url("/v1/members")).bearer_auth(&reader).send().await.unwrap();
    expect_problem(res, 403).await;
    let del = app.http.delete(app.url("/v1/members/lee@example.com")).bearer_auth(&app.admin_key).send().await.unwrap();
    assert_eq!(del.status(), 204);
    let del = app.http.delete(app.url("/v1/members/lee@example.com")).bearer_auth(&app.admin_key).send().await.unwrap();
    expect_problem(del, 404).await;

    // With key sign-in off, the page offers single sign-on only and the form's POST is refused.
    let login = plain_client().get(app.url("/ui/login")).send().await.unwrap();
    let html = login.text().await.unwrap();
    assert!(html.contains("id=\"sso-sign-in\"") && !html.contains("name=\"key\""), "{html}");
    let form = [("key", app.admin_key.as_str()), ("login_token", "t")];
    let res = plain_client().post(app.url("/ui/login")).header("cookie", "combee_login=t").form(&form).send().await;
    let res = res.unwrap();
    assert_eq!(res.status(), 403);
    assert!(set_cookie(&res, "combee_session").is_none());
}

on_one_store!(
    sign_in_in_the_browser_on_postgres: sign_in_in_the_browser(Postgres),
    state_is_single_use_on_sqlite: state_is_single_use_and_bound_to_the_browser(Sqlite),
    roles_by_page_on_postgres: each_role_sees_and_may_post_what_it_allows(Postgres),
);
on_both_stores!(members_give_grants_and_key_sign_in_can_be_switched_off);
