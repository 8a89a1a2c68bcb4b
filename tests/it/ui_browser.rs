//! The operator web UI, driven in real headless Chromium through chromedriver
//! (the W3C WebDriver protocol spoken with reqwest), against the real server
//! on port 0 with a real store and the LLM simulator. Screenshots of every
//! page land in `target/ui-screenshots/` as artefacts. Without a browser,
//! session and CSRF rules are checked with plain HTTP.

use crate::common;

use std::{
    io::{Read, Write},
    path::PathBuf,
    process::Stdio,
    time::Duration,
};

use base64::Engine;
use combee::simulation::llm::SimConfig;
use common::{Backend, TestApp, eventually, learning, round_end, spawn_app, spawn_app_with, spawn_sim};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// One chromedriver process with one browser session.
pub(crate) struct Browser {
    http: reqwest::Client,
    base: String,
    session: String,
    _driver: tokio::process::Child,
    _profile: tempfile::TempDir,
    shots: PathBuf,
    prefix: String,
}

impl Browser {
    pub(crate) async fn start(prefix: &str) -> Browser {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut driver = tokio::process::Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("chromedriver is not installed: run `scripts/test` (it installs chromium and chromium-driver)");
        // chromedriver says when it listens; wait for that line rather than a timer.
        let mut lines = BufReader::new(driver.stdout.take().unwrap()).lines();
        tokio::time::timeout(Duration::from_secs(20), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if line.contains("started successfully") {
                    return;
                }
            }
            panic!("chromedriver exited before it started");
        })
        .await
        .expect("chromedriver did not start within 20 s");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

        let profile = tempfile::tempdir().unwrap();
        let mut chrome = json!({"args": [
            "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--window-size=1280,900", "--disable-dev-shm-usage",
            format!("--user-data-dir={}", profile.path().display()),
        ]});
        if std::path::Path::new("/usr/bin/chromium").exists() {
            chrome["binary"] = json!("/usr/bin/chromium");
        }
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        let res: Value = http
            .post(format!("{base}/session"))
            .json(&json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": chrome}}}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session =
            res["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no WebDriver session: {res}")).to_owned();
        let target = std::env::var("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
        let shots = target.join("ui-screenshots");
        std::fs::create_dir_all(&shots).unwrap();
        let b = Browser { http, base, session, _driver: driver, _profile: profile, shots, prefix: prefix.to_owned() };
        // Element look-ups wait (inside the browser) up to 15 s for the element to appear: a
        // look-up that succeeds returns at once, and a loaded CI machine can take seconds to
        // answer a form post on the debug build.
        b.cmd("POST", "/timeouts", Some(json!({"implicit": 15000, "pageLoad": 30000}))).await;
        b
    }

    async fn try_cmd(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, Value> {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let req = match method {
            "GET" => self.http.get(url),
            "DELETE" => self.http.delete(url),
            _ => self.http.post(url).json(&body.unwrap_or(json!({}))),
        };
        let res = req.send().await.unwrap();
        let ok = res.status().is_success();
        let v: Value = res.json().await.unwrap();
        if ok { Ok(v["value"].clone()) } else { Err(v["value"].clone()) }
    }

    pub(crate) async fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.try_cmd(method, path, body).await.unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"))
    }

    pub(crate) async fn goto(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({"url": url}))).await;
    }

    pub(crate) async fn url(&self) -> String {
        self.cmd("GET", "/url", None).await.as_str().unwrap().to_owned()
    }

    async fn find(&self, css: &str) -> String {
        let v = self.cmd("POST", "/element", Some(json!({"using": "css selector", "value": css}))).await;
        v[ELEMENT].as_str().unwrap().to_owned()
    }

    pub(crate) async fn count(&self, css: &str) -> usize {
        // Counted in the page: a WebDriver element search would wait the whole
        // implicit timeout (15 s) whenever the answer is none.
        let script = json!({"script": "return document.querySelectorAll(arguments[0]).length", "args": [css]});
        self.cmd("POST", "/execute/sync", Some(script)).await.as_u64().unwrap() as usize
    }

    /// Finds the element and runs one command on it. A page that is still
    /// navigating (after a form submit) can make the element stale between the
    /// two steps; then the element is looked up again on the new page.
    async fn on_element(&self, css: &str, method: &str, suffix: &str, body: Option<Value>) -> Value {
        for _ in 0..20 {
            let id = self.find(css).await;
            match self.try_cmd(method, &format!("/element/{id}{suffix}"), body.clone()).await {
                Ok(v) => return v,
                Err(e) if e["error"] == "stale element reference" => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("WebDriver {method} {suffix} on {css}: {e}"),
            }
        }
        panic!("{css} stayed stale");
    }

    pub(crate) async fn click(&self, css: &str) {
        self.on_element(css, "POST", "/click", None).await;
    }

    pub(crate) async fn type_into(&self, css: &str, text: &str) {
        self.on_element(css, "POST", "/clear", None).await;
        self.on_element(css, "POST", "/value", Some(json!({"text": text}))).await;
    }

    pub(crate) async fn text(&self, css: &str) -> String {
        self.on_element(css, "GET", "/text", None).await.as_str().unwrap().to_owned()
    }

    /// The text of an SVG `<title>` (a tooltip, not rendered, so not in `/text`).
    async fn tooltip(&self, css: &str) -> String {
        self.on_element(css, "GET", "/property/textContent", None).await.as_str().unwrap().to_owned()
    }

    pub(crate) async fn value(&self, css: &str) -> String {
        self.on_element(css, "GET", "/property/value", None).await.as_str().unwrap().to_owned()
    }

    pub(crate) async fn source(&self) -> String {
        self.cmd("GET", "/source", None).await.as_str().unwrap().to_owned()
    }

    pub(crate) async fn cookie(&self, name: &str) -> Value {
        self.cmd("GET", &format!("/cookie/{name}"), None).await
    }

    /// Waits (in the browser) until the page at a URL containing `part` is loaded.
    pub(crate) async fn wait_url(&self, part: &str) {
        eventually(&format!("a page at {part}"), Duration::from_secs(10), async || {
            let url = self.url().await;
            if url.contains(part) {
                return Ok(());
            }
            // The next look-up blocks on the loading page itself.
            let _ = self.try_cmd("POST", "/element", Some(json!({"using": "css selector", "value": "main"}))).await;
            Err(format!("still at {url}"))
        })
        .await
    }

    pub(crate) async fn screenshot(&self, name: &str) -> PathBuf {
        let b64 = self.cmd("GET", "/screenshot", None).await;
        let png = base64::engine::general_purpose::STANDARD.decode(b64.as_str().unwrap()).unwrap();
        let path = self.shots.join(format!("{}-{name}.png", self.prefix));
        std::fs::write(&path, png).unwrap();
        path
    }
}

impl Drop for Browser {
    /// Ends the browser session (closing Chromium) even when the test failed;
    /// a blocking, dependency-free DELETE since Drop cannot await.
    fn drop(&mut self) {
        let addr = self.base.trim_start_matches("http://").to_owned();
        if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
            let _ = write!(s, "DELETE /session/{} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n", self.session);
            // chromedriver answers once Chromium has quit, then may keep the
            // connection open: the answer's first bytes are the signal, not EOF.
            let _ = s.read(&mut [0u8; 512]);
        }
    }
}

fn insight_trace(prompt: &str, i: usize) -> Value {
    json!({
        "prompt": prompt,
        "input": {"task": format!("task {i}")},
        "trajectory": [{"role": "assistant", "content": format!("worked on task {i}")}],
        "output": format!("answer {i}"),
        "feedback": {"success": !i.is_multiple_of(3), "comment": format!("INSIGHT-u{i:03}: check field {i} before answering")}
    })
}

async fn run_round(app: &TestApp, name: &str, batch: u32) -> String {
    let res = app.post(&format!("/v1/prompts/{name}/rounds"), json!({"batch_size": batch})).send().await.unwrap();
    assert_eq!(res.status(), 202, "{}", res.text().await.unwrap());
    let id = res.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    let r = round_end(app, &id, Duration::from_secs(60)).await;
    assert_eq!(r["status"], "succeeded", "{r}");
    id
}

async fn api_prompt(app: &TestApp, name: &str) -> Value {
    app.get(&format!("/v1/prompts/{name}")).send().await.unwrap().json().await.unwrap()
}

/// A client that keeps cookies to itself and never follows redirects.
pub(crate) fn plain_client() -> reqwest::Client {
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap()
}

/// Every `Set-Cookie` header of a response, whole (value and attributes).
fn set_cookie_lines(res: &reqwest::Response) -> Vec<String> {
    res.headers().get_all("set-cookie").iter().filter_map(|v| v.to_str().ok()).map(str::to_owned).collect()
}

/// The value a response sets for cookie `name`.
pub(crate) fn set_cookie(res: &reqwest::Response, name: &str) -> Option<String> {
    set_cookie_lines(res)
        .iter()
        .find_map(|c| c.strip_prefix(&format!("{name}=")).map(|rest| rest.split(';').next().unwrap_or("").to_owned()))
}

pub(crate) fn hidden(html: &str, name: &str) -> String {
    let marker = format!(r#"name="{name}" value=""#);
    let start = html.find(&marker).unwrap_or_else(|| panic!("no hidden {name} in page")) + marker.len();
    html[start..].split('"').next().unwrap().to_owned()
}

/// Signs in over plain HTTP; returns the session cookie's value.
pub(crate) async fn sign_in(app: &TestApp, key: &str) -> reqwest::Response {
    let http = plain_client();
    let form = http.get(app.url("/ui/login")).send().await.unwrap();
    let login_cookie = set_cookie(&form, "combee_login").unwrap();
    let token = hidden(&form.text().await.unwrap(), "login_token");
    http.post(app.url("/ui/login"))
        .header("cookie", format!("combee_login={login_cookie}"))
        .form(&[("key", key), ("login_token", token.as_str())])
        .send()
        .await
        .unwrap()
}

async fn operator_story(b: Backend) {
    // Some realistic answer shapes (simulated), so the round page has tolerated answers to show.
    let sim =
        spawn_sim(SimConfig { seed: 11, rate_extra_keys: 0.5, rate_unknown_ids: 0.5, ..SimConfig::default() }).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    let res = app
        .post(
            "/v1/prompts",
            json!({"name": "support", "base": "You answer support questions. Use {customer_name}.",
            "strategy": "playbook", "promotion": "auto", "settings": {"batch_size": 1000, "duplication": 1}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let traces: Vec<Value> = (0..28).map(|i| insight_trace("support", i)).collect();
    assert_eq!(app.post("/v1/traces", json!({"traces": traces})).send().await.unwrap().status(), 201);
    // Three Combee rounds of 4, 8 and 16 traces: versions 2–4, and three controller sizes to fit.
    let mut rounds = Vec::new();
    for bs in [4, 8, 16] {
        rounds.push(run_round(&app, "support", bs).await);
    }
    assert_eq!(api_prompt(&app, "support").await["version"], 4);
    // Untrusted trace content that must stay text.
    let evil = json!({"prompt": "support", "input": {"q": "<script>window.pwned=1</script>"},
        "output": "<img src=x onerror=\"window.pwned=2\"><b>bold?</b>", "feedback": {"success": false}});
    assert_eq!(app.post("/v1/traces", evil).send().await.unwrap().status(), 201);

    let br = Browser::start(&format!("{b:?}").to_lowercase()).await;

    // Signed out: any page leads to the sign-in form; a wrong key is refused there.
    br.goto(&app.url("/ui/prompts")).await;
    br.wait_url("/ui/login").await;
    br.type_into("#key", "cmb_not-a-real-key").await;
    br.click("#sign-in").await;
    assert!(br.text("#login-error").await.contains("Unknown or revoked"), "wrong key refused");
    br.screenshot("01-login-refused").await;
    br.type_into("#key", &app.admin_key).await;
    br.click("#sign-in").await;
    br.wait_url("/ui/prompts").await;
    let cookie = br.cookie("combee_session").await;
    assert_eq!((cookie["httpOnly"].as_bool(), cookie["sameSite"].as_str()), (Some(true), Some("Strict")), "{cookie}");
    assert_eq!(cookie["path"], "/ui");
    let list = br.text("#prompts").await;
    assert!(list.contains("support") && list.contains("v4"), "{list}");
    br.screenshot("02-prompts").await;

    // A prompt: production text, labels, history with round links.
    br.click("#prompts a[href='/ui/prompts/support']").await;
    br.wait_url("/ui/prompts/support").await;
    let v4 = api_prompt(&app, "support").await;
    assert_eq!(br.text("#production-text").await.trim(), v4["text"].as_str().unwrap().trim());
    assert!(br.text("#versions").await.contains("learned"));
    assert_eq!(br.count("#versions a[href^='/ui/rounds/']").await, 3);
    // Reward over time: the traces named no version, so one line, labelled so.
    assert_eq!(br.count("svg#reward-plot path.series").await, 1);
    assert!(br.text("#reward-legend").await.contains("no version"));
    br.screenshot("03-prompt").await;

    // A diff chosen with the form: v1 → v4 added bullets.
    br.click("#diff-from option[value='1']").await;
    br.click("#diff-to option[value='4']").await;
    br.click("#diff-submit").await;
    br.wait_url("from=1").await;
    assert!(br.count("#bullets-added li").await >= 4, "bullets added by three rounds");
    assert!(br.count("#diff tr.ins").await >= 4);
    assert!(br.text("#diff-stats").await.starts_with('+'));
    br.screenshot("04-diff").await;

    // Roll back to v1 with the button; the API now serves v1's content as v5.
    br.goto(&app.url("/ui/prompts/support")).await;
    br.click("#rollback-1").await;
    br.wait_url("notice=rolled_back").await;
    assert!(br.text("#notice").await.contains("version 5"));
    let v1: Value = app.get("/v1/prompts/support/versions/1").send().await.unwrap().json().await.unwrap();
    let now = api_prompt(&app, "support").await;
    assert_eq!((now["version"].as_i64(), now["text"].as_str()), (Some(5), v1["text"].as_str()), "{now}");
    assert!(br.text("#version-5").await.contains("rollback"));
    br.screenshot("05-rolled-back").await;
    // The label history on the same page: the three publishes, then the operator's rollback on top.
    assert_eq!(br.count("#label-history tr.move-auto-publish").await, 3);
    let newest = br.text("#label-history tbody tr:first-child").await;
    assert!(newest.contains("v4 → v5") && newest.contains("rollback") && newest.contains("web UI"), "{newest}");
    assert_eq!(br.count("#label-history tr.move-create").await, 1);

    // One round: facts, phase timeline, calls with usage, operations.
    br.goto(&app.url(&format!("/ui/rounds/{}", rounds[2]))).await;
    let facts = br.text("#round-facts").await;
    assert!(facts.contains("succeeded") && facts.contains("16") && facts.contains("combee"), "{facts}");
    assert!(br.text("#phases").await.contains("map"));
    assert!(br.text("#usage").await.contains("LLM calls"));
    assert!(br.count("#operations tr").await > 1, "operations listed");
    // What tolerant reading ignored or dropped, and provenance per reflection.
    let answers = br.text("#answers-box summary").await;
    assert!(answers.contains("tolerated answers") && answers.contains("items dropped"), "{answers}");
    assert!(br.count("#answer-notes tbody tr").await >= 1, "shaped answers are listed");
    assert!(br.text("#answer-notes").await.contains("b-9999"), "the unknown id is named with its reason");
    assert!(br.text("#covered-share").await.contains("of 16"));
    br.screenshot("06-round").await;
    br.click("#llm-calls-box summary").await;
    assert!(br.count("#llm-calls tbody tr").await >= 17, "16 reflections + groups");
    br.screenshot("06b-round-calls").await;

    // The controller: an SVG with a point per profiled size, the fitted curve, bs*.
    br.goto(&app.url("/ui/prompts/support/controller")).await;
    assert_eq!(br.count("svg#controller-plot circle.point").await, 3);
    assert_eq!(br.count("svg#controller-plot path.fit").await, 1);
    assert!(br.text("#controller-facts").await.contains("α ="));
    br.screenshot("07-controller").await;

    // Traces: filtered, and hostile content is shown as text, never run.
    br.goto(&app.url("/ui/traces")).await;
    br.click("#filter-prompt option[value='support']").await;
    br.click("#filter-status option[value='pending']").await;
    br.click("#filter-submit").await;
    br.wait_url("status=pending").await;
    assert_eq!(br.count("#traces tbody tr").await, 1);
    assert!(br.text("#traces").await.contains("<script>window.pwned=1</script>"));
    assert_eq!((br.count("main script").await, br.count("main img").await), (0, 0));
    br.screenshot("08-traces").await;
    br.click("#traces tbody a[href^='/ui/traces/']").await;
    br.wait_url("/ui/traces/").await;
    assert!(br.source().await.contains("&lt;img src=x onerror="));
    assert_eq!(
        br.cmd("POST", "/execute/sync", Some(json!({"script": "return window.pwned === undefined", "args": []}))).await,
        true
    );
    br.screenshot("09-trace").await;

    // Quarantine the hostile trace from its page: it stays visible, marked, and out of the backlog.
    let trace_url = br.url().await;
    br.type_into("#quarantine-reason", "script injection attempt").await;
    br.click("#quarantine").await;
    br.wait_url("notice=quarantined").await;
    assert!(br.text("#trace-facts").await.contains("quarantined"));
    assert!(br.text("#quarantine-info").await.contains("script injection attempt"));
    assert_eq!(br.count("#quarantine").await, 0, "no second quarantine button");
    let id = trace_url.rsplit('/').next().unwrap().split('?').next().unwrap().to_owned();
    let t: Value = app.get(&format!("/v1/traces/{id}")).send().await.unwrap().json().await.unwrap();
    assert_eq!(
        (t["status"].as_str(), t["quarantine_reason"].as_str()),
        (Some("quarantined"), Some("script injection attempt"))
    );
    br.screenshot("09b-trace-quarantined").await;
    // Release it (a quarantine by mistake), then quarantine it again for the rest of the tour.
    br.click("#release").await;
    br.wait_url("notice=released").await;
    let t: Value = app.get(&format!("/v1/traces/{id}")).send().await.unwrap().json().await.unwrap();
    assert_eq!(t["status"].as_str(), Some("pending"));
    assert_eq!(br.count("#release").await, 0, "no release button on a trace not quarantined");
    br.type_into("#quarantine-reason", "script injection attempt").await;
    br.click("#quarantine").await;
    br.wait_url("notice=quarantined").await;

    // CSRF: the session cookie alone cannot change anything.
    br.goto(&app.url("/ui/prompts/support")).await;
    let csrf = br.value("input[name=csrf]").await;
    let session = br.cookie("combee_session").await["value"].as_str().unwrap().to_owned();
    let http = plain_client();
    let post = |fields: Vec<(&'static str, String)>| {
        http.post(app.url("/ui/prompts/support/rollback"))
            .header("cookie", format!("combee_session={session}"))
            .form(&fields)
            .send()
    };
    let base = vec![("version", "2".to_owned()), ("expected", "5".to_owned())];
    let missing = post(base.clone()).await.unwrap();
    assert_eq!(missing.status(), 403);
    assert!(missing.text().await.unwrap().contains("security token"));
    let mut wrong = base.clone();
    wrong.push(("csrf", format!("{}x", &csrf[..csrf.len() - 1])));
    assert_eq!(post(wrong).await.unwrap().status(), 403);
    let mut empty = base.clone();
    empty.push(("csrf", String::new()));
    assert_eq!(post(empty).await.unwrap().status(), 403);
    assert_eq!(api_prompt(&app, "support").await["version"], 5, "nothing changed");
    // The same request with the token goes through, so the token was the only thing missing.
    let mut good = base.clone();
    good.push(("csrf", csrf));
    let ok = post(good).await.unwrap();
    assert_eq!(
        (ok.status().as_u16(), ok.headers()["location"].to_str().unwrap()),
        (303, "/ui/prompts/support?notice=rolled_back&v=6")
    );
    assert_eq!(api_prompt(&app, "support").await["version"], 6);

    // Sign out: the session is gone for the browser and for the stolen cookie.
    br.goto(&app.url("/ui/prompts")).await;
    br.click("#sign-out").await;
    br.wait_url("/ui/login").await;
    br.goto(&app.url("/ui/prompts")).await;
    br.wait_url("/ui/login").await;
    let after =
        http.get(app.url("/ui/prompts")).header("cookie", format!("combee_session={session}")).send().await.unwrap();
    assert_eq!(
        (after.status().as_u16(), after.headers()["location"].to_str().unwrap()),
        (303, "/ui/login?error=expired")
    );
    br.screenshot("10-signed-out").await;
}

async fn sessions_follow_their_key(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    let http = plain_client();

    // A key that cannot read prompts cannot open a session.
    let res = sign_in(&app, &app.key_with(&["traces:write"]).await).await;
    assert_eq!(res.status(), 403);
    assert!(set_cookie(&res, "combee_session").is_none());

    // A sign-in form not from this site (no double-submit cookie) is refused.
    let res = http
        .post(app.url("/ui/login"))
        .form(&[("key", app.admin_key.as_str()), ("login_token", "x")])
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 403);

    // A read-only key reads, sees no promote buttons, and is refused a promote even with the right token.
    let reader = app.key_with(&["prompts:read"]).await;
    let res = sign_in(&app, &reader).await;
    assert_eq!((res.status().as_u16(), res.headers()["location"].to_str().unwrap()), (303, "/ui/prompts"));
    let cookie = set_cookie(&res, "combee_session").unwrap();
    let set = set_cookie_lines(&res);
    assert!(
        set.iter().any(|c| c.starts_with("combee_session=")
            && c.contains("HttpOnly")
            && c.contains("SameSite=Strict")
            && c.contains("Path=/ui")
            && !c.contains("Secure")),
        "{set:?}"
    );
    let get = |path: &str| http.get(app.url(path)).header("cookie", format!("combee_session={cookie}")).send();
    let page = get("/ui/prompts/p").await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.headers()["content-security-policy"].to_str().unwrap().contains("default-src 'none'"));
    let html = page.text().await.unwrap();
    assert!(!html.contains("rollback-") && html.contains("need the <code>prompts:promote</code> scope"));
    let csrf = hidden(&html, "csrf");
    let res = http
        .post(app.url("/ui/prompts/p/promote"))
        .header("cookie", format!("combee_session={cookie}"))
        .form(&[("csrf", csrf.as_str()), ("version", "1"), ("expected", "1")])
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 403);
    assert!(res.text().await.unwrap().contains("prompts:promote"));

    // Over https (as a proxy reports it) the cookie is Secure.
    let form = http.get(app.url("/ui/login")).header("x-forwarded-proto", "https").send().await.unwrap();
    assert!(form.headers()["set-cookie"].to_str().unwrap().contains("; Secure"));

    // A forged cookie is no session; revoking the key ends the real one.
    let forged = http.get(app.url("/ui/prompts")).header("cookie", "combee_session=forged").send().await.unwrap();
    assert_eq!(forged.status(), 303);
    let keys: Value = app.get("/v1/keys").send().await.unwrap().json().await.unwrap();
    let prefix = &reader[..12];
    let id = keys["keys"].as_array().unwrap().iter().find(|k| k["prefix"] == prefix).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let res = app.http.delete(app.url(&format!("/v1/keys/{id}"))).bearer_auth(&app.admin_key).send().await.unwrap();
    assert!(res.status().is_success());
    let res = get("/ui/prompts").await.unwrap();
    assert_eq!((res.status().as_u16(), res.headers()["location"].to_str().unwrap()), (303, "/ui/login?error=expired"));
    assert_eq!(get("/ui/prompts").await.unwrap().status(), 303, "and stays signed out");

    // Unknown pages and prompts are HTML 404s; GET never changes state.
    let admin = set_cookie(&sign_in(&app, &app.admin_key).await, "combee_session").unwrap();
    let res = http
        .get(app.url("/ui/prompts/ghost"))
        .header("cookie", format!("combee_session={admin}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
    assert!(res.headers()["content-type"].to_str().unwrap().starts_with("text/html"));
    let res = http
        .get(app.url("/ui/prompts/p/rollback?version=1"))
        .header("cookie", format!("combee_session={admin}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 405);
}

/// The reward chart marks `production`'s promotions and rollbacks
/// (vertical lines from the label history, the move as tooltip), so a change
/// in reward can be read against what changed the served version.
async fn reward_chart_marks_promotions_and_rollbacks(b: Backend) {
    let app = spawn_app(b).await;
    let res = app
        .post("/v1/prompts", json!({"name": "chart", "base": "You answer.", "promotion": "manual"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let res = app.post("/v1/prompts/chart/versions", json!({"base": "You answer carefully."})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let rewarded = |version: i64, n: usize| -> Value {
        let traces: Vec<Value> = (0..n)
            .map(|i| {
                json!({"prompt": "chart", "prompt_version": version, "input": {"q": i}, "output": "a",
                    "feedback": {"success": i % 2 == 0}})
            })
            .collect();
        json!({"traces": traces})
    };
    assert_eq!(app.post("/v1/traces", rewarded(1, 6)).send().await.unwrap().status(), 201);
    // An operator promotes v2, then rolls back to v1's content (v3).
    let res = app.put("/v1/prompts/chart/labels/production", json!({"version": 2})).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(app.post("/v1/traces", rewarded(2, 6)).send().await.unwrap().status(), 201);
    let res =
        app.post("/v1/prompts/chart/rollback", json!({"to": 1, "message": "v2 answers worse"})).send().await.unwrap();
    assert_eq!(res.status(), 201);

    let br = Browser::start(&format!("markers-{b:?}").to_lowercase()).await;
    br.goto(&app.url("/ui/login")).await;
    br.type_into("#key", &app.admin_key).await;
    br.click("#sign-in").await;
    br.wait_url("/ui/prompts").await;
    br.goto(&app.url("/ui/prompts/chart")).await;
    assert!(br.count("svg#reward-plot path.series").await >= 1, "the chart is drawn");
    // A run of seconds is drawn by the minute, on an axis that spans it (not the whole week).
    assert!(br.text("#reward-span").await.contains("by the minute"), "{}", br.text("#reward-span").await);
    assert_eq!(br.count("svg#reward-plot g.marker.promotion").await, 1, "one promotion marked");
    assert_eq!(br.count("svg#reward-plot g.marker.rollback").await, 1, "one rollback marked");
    let promoted = br.tooltip("svg#reward-plot g.marker.promotion title").await;
    assert!(promoted.starts_with("promote production: v1 → v2 by "), "{promoted}");
    let rolled_back = br.tooltip("svg#reward-plot g.marker.rollback title").await;
    assert!(
        rolled_back.starts_with("rollback production: v2 → v3 by ") && rolled_back.contains("v2 answers worse"),
        "{rolled_back}"
    );
    // The prompt's creation is in the history but is not a marker.
    assert_eq!(br.count("#label-history tr.move-create").await, 1);
    assert_eq!(br.count("svg#reward-plot g.marker").await, 2);
    assert!(br.text("#reward-legend").await.contains("rollback"));
    br.screenshot("reward-markers").await;
}

/// At 1280 px wide (the browser's window) and a few widths above, a prompt's
/// version table fits: every Promote and Roll back button is inside the table
/// and the window, no one-word label chip breaks inside its word, and nothing
/// scrolls sideways — with long messages, several labels per version and
/// actors named by key.
async fn version_table_fits_a_1280_pixel_window(b: Backend) {
    let app = spawn_app(b).await;
    let res = app
        .post("/v1/prompts", json!({"name": "a-rather-long-prompt-name.for-the-eu-west-region", "base": "You answer."}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let name = "a-rather-long-prompt-name.for-the-eu-west-region";
    let words = "Tightened the refund rules after the escalation review; kept the greeting, dropped the \
        apology template and the second follow-up question that confused customers in the pilot";
    let link = "see https://wiki.example.com/support/playbooks/refunds/escalation-review-2026-11-24-final-v3-approved";
    let long_label = "canary-internal-eu-west-1-shadow-traffic-ab";
    for (i, (labels, message)) in
        [(vec!["candidate", "staging-eu-west-1"], words), (vec![long_label, "shadow-traffic"], link), (vec![], words)]
            .into_iter()
            .enumerate()
    {
        let body = json!({"base": format!("You answer, version {}.", i + 2), "message": message, "labels": labels});
        let res = app.post(&format!("/v1/prompts/{name}/versions"), body).send().await.unwrap();
        assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    }

    let br = Browser::start(&format!("width-{b:?}").to_lowercase()).await;
    br.goto(&app.url("/ui/login")).await;
    br.type_into("#key", &app.admin_key).await;
    br.click("#sign-in").await;
    br.wait_url("/ui/prompts").await;
    br.goto(&app.url(&format!("/ui/prompts/{name}"))).await;
    // A rollback from the web UI: its actor is the longest (`key:… (web UI)`).
    br.click("#rollback-2").await;
    br.wait_url("notice=rolled_back").await;
    assert_eq!(br.count("#versions button").await, 8, "Promote and Roll back on the four versions not in production");
    let script = json!({"script": r#"
        const table = document.querySelector('#versions').getBoundingClientRect();
        const cut = [...document.querySelectorAll('#versions button')]
            .map(b => [b.id, b.getBoundingClientRect()])
            .filter(([, r]) => r.right > table.right + 0.5 || r.right > window.innerWidth || r.width < 10)
            .map(([id]) => id);
        // A label chip of one word (no hyphen to break at) stays on one line.
        const chips = [...document.querySelectorAll('#versions .badge')];
        const line = Math.min(...chips.map(c => c.getBoundingClientRect().height));
        const broken = chips.filter(c => !c.textContent.includes('-') && c.getBoundingClientRect().height > line + 1)
            .map(c => c.textContent);
        document.querySelector('#versions').scrollIntoView();
        return {cut, broken, inner: window.innerWidth, page: document.documentElement.scrollWidth,
                table: document.querySelector('#versions').scrollWidth,
                shown: document.querySelector('#versions').clientWidth};
    "#, "args": []});
    // A second prompt whose labels are all short words: nothing holds the
    // labels column open but the chips themselves.
    assert_eq!(
        app.post("/v1/prompts", json!({"name": "plain", "base": "You answer."})).send().await.unwrap().status(),
        201
    );
    for message in [words, link, words] {
        let body = json!({"base": format!("You answer: {message}"), "message": message, "labels": ["candidate"]});
        let res = app.post("/v1/prompts/plain/versions", body).send().await.unwrap();
        assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    }
    // 1280 px, then the widths where the table's columns settle differently.
    for (page, width) in [name, "plain"].into_iter().flat_map(|p| [1280, 1300, 1366, 1440].map(|w| (p, w))) {
        br.cmd("POST", "/window/rect", Some(json!({"width": width, "height": 900}))).await;
        if page == "plain" {
            br.goto(&app.url("/ui/prompts/plain")).await;
        }
        let fit = br.cmd("POST", "/execute/sync", Some(script.clone())).await;
        br.screenshot(&format!("versions-{}-{width}", if page == "plain" { "plain" } else { "long" })).await;
        assert_eq!(fit["inner"], width, "the window is {width} px wide: {fit}");
        assert_eq!(fit["cut"], json!([]), "buttons outside the table or the window: {fit}");
        assert_eq!(fit["broken"], json!([]), "label chips broken inside a word: {fit}");
        assert!(fit["page"].as_u64() <= fit["inner"].as_u64(), "the page scrolls sideways: {fit}");
        assert!(fit["table"].as_u64() <= fit["shown"].as_u64(), "the table overflows its box: {fit}");
    }
}

/// `auth.session_hours` sets how long a session lasts: the cookie's `Max-Age` and the
/// session's end in the audit log say the same.
async fn a_session_lasts_the_configured_hours(b: Backend) {
    let app = spawn_app_with(b, |s| s.auth.session_hours = 2).await;
    let before = chrono::Utc::now();
    let res = sign_in(&app, &app.admin_key).await;
    assert_eq!(res.status(), 303);
    let set = set_cookie_lines(&res);
    assert!(set.iter().any(|c| c.starts_with("combee_session=") && c.contains("; Max-Age=7200")), "{set:?}");
    let after = chrono::Utc::now();
    let page: Value = app.get("/v1/audit?action=ui.sign_in").send().await.unwrap().json().await.unwrap();
    let ends = page["entries"][0]["after"]["expires_at"].as_str().unwrap_or_else(|| panic!("{page}"));
    let ends: chrono::DateTime<chrono::Utc> = ends.parse().unwrap();
    let two_hours = chrono::Duration::hours(2);
    assert!(before + two_hours <= ends && ends <= after + two_hours, "{ends} is not two hours after sign-in");
}

on_both_stores!(sessions_follow_their_key);
on_one_store!(a_session_lasts_the_configured_hours_on_sqlite: a_session_lasts_the_configured_hours(Sqlite));
on_one_store!(
    operator_story_on_postgres: operator_story(Postgres),
    reward_chart_marks_promotions_and_rollbacks_on_sqlite: reward_chart_marks_promotions_and_rollbacks(Sqlite),
    version_table_fits_1280_on_postgres: version_table_fits_a_1280_pixel_window(Postgres),
);
