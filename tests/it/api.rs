//! The HTTP API against the real server on port 0, on both stores: every
//! route, each kind of bad input, auth, idempotency, ETags and label moves.

use crate::common;

use common::{Backend, TestApp, expect_problem, spawn_app};
use serde_json::{Value, json};

async fn prompt_lifecycle(b: Backend) {
    let app = spawn_app(b).await;
    let created = app.create_prompt("support-agent").await;
    assert_eq!(created["version"]["number"], 1);
    assert_eq!(created["labels"], json!(["production"]));
    assert_eq!(created["strategy"], "playbook");

    let res = app.get("/v1/prompts/support-agent").send().await.unwrap();
    assert_eq!(res.status(), 200);
    let etag = res.headers()["etag"].to_str().unwrap().to_owned();
    assert!(etag.starts_with("\"v1-"), "strong ETag: {etag}");
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["text"], "You are a helpful agent.");
    assert_eq!(body["labels"], json!(["production"]));

    let res = app.get("/v1/prompts/support-agent").header("if-none-match", &etag).send().await.unwrap();
    assert_eq!(res.status(), 304);
    assert_eq!(res.headers()["etag"], etag.as_str());
    let res = app.get("/v1/prompts/support-agent").header("if-none-match", "\"other\"").send().await.unwrap();
    assert_eq!(res.status(), 200);

    // A manual edit makes version 2, not production until promoted.
    let res = app
        .post("/v1/prompts/support-agent/versions", json!({"base": "You are a careful agent.", "message": "tone"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let v2: Value = res.json().await.unwrap();
    assert_eq!((v2["number"].as_i64(), v2["parent"].as_i64()), (Some(2), Some(1)));
    assert_eq!(v2["labels"], json!([]));
    let still: Value = app.get("/v1/prompts/support-agent").send().await.unwrap().json().await.unwrap();
    assert_eq!(still["version"], 1);
    let latest: Value = app.get("/v1/prompts/support-agent?label=latest").send().await.unwrap().json().await.unwrap();
    assert_eq!(latest["version"], 2);
    let by_number: Value = app.get("/v1/prompts/support-agent?version=2").send().await.unwrap().json().await.unwrap();
    assert_eq!(by_number["text"], "You are a careful agent.");

    // Promote with the current ETag; the cached GET switches at once.
    let res = app
        .put("/v1/prompts/support-agent/labels/production", json!({"version": 2}))
        .header("if-match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let now: Value = app.get("/v1/prompts/support-agent").send().await.unwrap().json().await.unwrap();
    assert_eq!(now["version"], 2);
    // The old ETag is stale now: 412, and nothing moves.
    let res = app
        .put("/v1/prompts/support-agent/labels/production", json!({"version": 1}))
        .header("if-match", &etag)
        .send()
        .await
        .unwrap();
    let p = expect_problem(res, 412).await;
    assert!(p["detail"].as_str().unwrap().contains("moved"));
    let res = app.get("/v1/prompts/support-agent").header("if-none-match", &etag).send().await.unwrap();
    assert_eq!(res.status(), 200, "the old ETag no longer matches");

    // Roll back to version 1: a new version 3 with v1's content, source rollback.
    let res = app.post("/v1/prompts/support-agent/rollback", json!({"to": 1})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let v3: Value = res.json().await.unwrap();
    assert_eq!(
        (v3["number"].as_i64(), v3["source"].as_str(), v3["parent"].as_i64()),
        (Some(3), Some("rollback"), Some(2))
    );
    let now: Value = app.get("/v1/prompts/support-agent").send().await.unwrap().json().await.unwrap();
    assert_eq!((now["version"].as_i64(), now["text"].as_str()), (Some(3), Some("You are a helpful agent.")));
    // Rollback with a stale If-Match is refused.
    let res = app
        .post("/v1/prompts/support-agent/rollback", json!({"to": 2}))
        .header("if-match", &etag)
        .send()
        .await
        .unwrap();
    expect_problem(res, 412).await;

    // History newest first, with a cursor.
    let page: Value =
        app.get("/v1/prompts/support-agent/versions?page_size=2").send().await.unwrap().json().await.unwrap();
    let numbers: Vec<_> = page["versions"].as_array().unwrap().iter().map(|v| v["number"].as_i64().unwrap()).collect();
    assert_eq!(numbers, vec![3, 2]);
    let token = page["next_page_token"].as_str().unwrap();
    let rest: Value = app
        .get(&format!("/v1/prompts/support-agent/versions?page_size=2&page_token={token}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(rest["versions"][0]["number"], 1);
    assert!(rest["next_page_token"].is_null());
    let one: Value = app.get("/v1/prompts/support-agent/versions/2").send().await.unwrap().json().await.unwrap();
    assert_eq!(one["message"], "tone");
    expect_problem(app.get("/v1/prompts/support-agent/versions/99").send().await.unwrap(), 404).await;

    let labels: Value = app.get("/v1/prompts/support-agent/labels").send().await.unwrap().json().await.unwrap();
    assert_eq!(labels["labels"][0]["name"], "production");
    assert_eq!(labels["labels"][0]["version"], 3);
}

async fn playbook_diff_and_candidate_label(b: Backend) {
    let app = spawn_app(b).await;
    let res = app
        .post(
            "/v1/prompts",
            json!({"name": "pb", "base": "Base.", "playbook": {"sections": [{"name": "tips", "bullets": [
                {"content": "keep"}, {"content": "change me"}, {"content": "drop me"}]}]}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let v1: Value = res.json().await.unwrap();
    let bullets = &v1["version"]["playbook"]["sections"][0]["bullets"];
    assert_eq!(bullets[0]["id"], "b-0001");
    let edited = json!({"sections": [{"name": "tips", "bullets": [
        {"id": "b-0001", "content": "keep"}, {"id": "b-0002", "content": "changed"}, {"content": "brand new"}]}]});
    let res =
        app.post("/v1/prompts/pb/versions", json!({"playbook": edited, "labels": ["candidate"]})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let v2: Value = res.json().await.unwrap();
    assert_eq!(v2["labels"], json!(["candidate"]));
    assert_eq!(v2["playbook"]["sections"][0]["bullets"][2]["id"], "b-0004", "ids are never reused");
    let cand: Value = app.get("/v1/prompts/pb?label=candidate").send().await.unwrap().json().await.unwrap();
    assert!(cand["text"].as_str().unwrap().contains("[b-0004] helpful=0 harmful=0 :: brand new"));

    let diff: Value = app.get("/v1/prompts/pb/diff?from=1&to=2").send().await.unwrap().json().await.unwrap();
    let ids = |k: &str| -> Vec<String> {
        diff["playbook"][k].as_array().unwrap().iter().map(|b| b["id"].as_str().unwrap().to_owned()).collect()
    };
    assert_eq!(ids("added"), vec!["b-0004"]);
    assert_eq!(ids("removed"), vec!["b-0003"]);
    assert_eq!(ids("changed"), vec!["b-0002"]);
    assert!(diff["unified"].as_str().unwrap().contains("+[b-0002] helpful=0 harmful=0 :: changed"));
    assert!(diff["lines"].as_array().unwrap().iter().any(|l| l["tag"] == "delete"));
    expect_problem(app.get("/v1/prompts/pb/diff?from=1&to=9").send().await.unwrap(), 404).await;
    expect_problem(app.get("/v1/prompts/pb/diff?from=x&to=2").send().await.unwrap(), 400).await;

    // Labels: production cannot be deleted; others can.
    let res =
        app.http.delete(app.url("/v1/prompts/pb/labels/production")).bearer_auth(&app.admin_key).send().await.unwrap();
    expect_problem(res, 409).await;
    let res =
        app.http.delete(app.url("/v1/prompts/pb/labels/candidate")).bearer_auth(&app.admin_key).send().await.unwrap();
    assert_eq!(res.status(), 204);
    expect_problem(app.get("/v1/prompts/pb?label=candidate").send().await.unwrap(), 404).await;
}

async fn prompt_input_is_validated(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    let cases = [
        (json!({"name": "p", "base": "x"}), 409),
        (json!({"name": "Bad Name", "base": "x"}), 422),
        (json!({"name": "q", "base": "   "}), 422),
        (json!({"name": "q", "base": "x", "colour": "red"}), 422),
        (json!({"name": "q", "base": 5}), 422),
        (json!({"name": "q", "base": "x", "strategy": "magic"}), 422),
        (json!({"name": "q", "base": "x", "strategy": "rewrite", "playbook": {"sections": []}}), 422),
        (
            json!({"name": "q", "base": "x", "playbook": {"sections": [{"name": "a", "bullets": [{"id": "zz", "content": "c"}]}]}}),
            422,
        ),
        (json!({"name": "q", "base": "x".repeat(17 * 1024)}), 413),
        (json!({"name": "q", "base": "x", "settings": {"duplication": 0}}), 422),
        (json!({"name": "q", "base": "a\u{0}b"}), 422),
    ];
    for (body, status) in cases {
        let res = app.post("/v1/prompts", body.clone()).send().await.unwrap();
        expect_problem(res, status).await;
    }
    // Malformed JSON, missing content type, body over the limit.
    let res = app
        .http
        .post(app.url("/v1/prompts"))
        .bearer_auth(&app.admin_key)
        .header("content-type", "application/json")
        .body("{\"name\":")
        .send()
        .await
        .unwrap();
    expect_problem(res, 400).await;
    let res = app.http.post(app.url("/v1/prompts")).bearer_auth(&app.admin_key).body("{}").send().await.unwrap();
    expect_problem(res, 415).await;
    let huge = json!({"name": "q", "base": "x".repeat(300 * 1024)});
    expect_problem(app.post("/v1/prompts", huge).send().await.unwrap(), 413).await;
    // Unknown prompts, labels, bad selectors.
    expect_problem(app.get("/v1/prompts/ghost").send().await.unwrap(), 404).await;
    expect_problem(app.get("/v1/prompts/NOT%20VALID").send().await.unwrap(), 404).await;
    expect_problem(app.get("/v1/prompts/p?label=nope").send().await.unwrap(), 404).await;
    // Both a label and a version: that version, only while the label points at it.
    assert_eq!(app.get("/v1/prompts/p?label=production&version=1").send().await.unwrap().status(), 200);
    expect_problem(app.get("/v1/prompts/p?label=production&version=2").send().await.unwrap(), 404).await;
    expect_problem(app.get("/v1/prompts/p?version=0").send().await.unwrap(), 400).await;
    expect_problem(app.get("/v1/prompts/p?version=abc").send().await.unwrap(), 400).await;
    expect_problem(app.put("/v1/prompts/p/labels/latest", json!({"version": 1})).send().await.unwrap(), 422).await;
    // A version that does not exist (yet) conflicts with the prompt's state.
    expect_problem(app.put("/v1/prompts/p/labels/production", json!({"version": 9})).send().await.unwrap(), 409).await;
    expect_problem(app.post("/v1/prompts/p/versions", json!({"parent": 7})).send().await.unwrap(), 409).await;
    expect_problem(app.post("/v1/prompts/p/rollback", json!({"to": 7})).send().await.unwrap(), 409).await;
    expect_problem(app.post("/v1/prompts/p/rollback", json!({"to": 0})).send().await.unwrap(), 422).await;
    // A body must be an object; integral floats are integers; details name no Rust types.
    expect_problem(app.post("/v1/prompts/p/versions", json!([null, null])).send().await.unwrap(), 422).await;
    assert_eq!(app.post("/v1/prompts/p/rollback", json!({"to": 1.0})).send().await.unwrap().status(), 201);
    let p = expect_problem(app.post("/v1/prompts/p/rollback", json!({"to": "one"})).send().await.unwrap(), 422).await;
    let detail = p["detail"].as_str().unwrap();
    assert!(detail.contains("expected a whole number") && !detail.contains("i64"), "{detail}");
    expect_problem(app.post("/v1/prompts/ghost/versions", json!({})).send().await.unwrap(), 404).await;
    expect_problem(app.get("/v1/prompts?page_token=%%%").send().await.unwrap(), 400).await;
}

async fn prompts_list_paginates(b: Backend) {
    let app = spawn_app(b).await;
    for n in ["c", "a", "b"] {
        app.create_prompt(n).await;
    }
    let page: Value = app.get("/v1/prompts?page_size=2").send().await.unwrap().json().await.unwrap();
    let names: Vec<_> = page["prompts"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, vec!["a", "b"]);
    assert_eq!(page["prompts"][0]["production_version"], 1);
    let token = page["next_page_token"].as_str().unwrap();
    let rest: Value =
        app.get(&format!("/v1/prompts?page_size=2&page_token={token}")).send().await.unwrap().json().await.unwrap();
    assert_eq!(rest["prompts"][0]["name"], "c");
    assert!(rest["next_page_token"].is_null());
}

fn one_trace(prompt: &str) -> Value {
    json!({"prompt": prompt, "prompt_version": 1, "input": {"q": "reset password"}, "trajectory": [{"role": "assistant", "content": "…"}],
           "output": "done", "feedback": {"success": true, "score": 1.0}, "metadata": {"agent": "a1"}})
}

async fn traces_ingest_list_and_feedback(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    app.create_prompt("other").await;
    let res = app.post("/v1/traces", one_trace("p")).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let one: Value = res.json().await.unwrap();
    assert_eq!(one["count"], 1);
    let id = one["ids"][0].as_str().unwrap().to_owned();

    let batch: Vec<Value> = (0..5).map(|_| one_trace("p")).chain([one_trace("other")]).collect();
    let res = app.post("/v1/traces", json!({"traces": batch})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let many: Value = res.json().await.unwrap();
    assert_eq!(many["count"], 6);

    // Durable before the answer: the store has them.
    let t: Value = app.get(&format!("/v1/traces/{id}")).send().await.unwrap().json().await.unwrap();
    assert_eq!((t["status"].as_str(), t["prompt_version"].as_i64()), (Some("pending"), Some(1)));
    assert_eq!(t["metadata"]["agent"], "a1");

    let page: Value =
        app.get("/v1/traces?prompt=p&status=pending&page_size=4").send().await.unwrap().json().await.unwrap();
    assert_eq!(page["traces"].as_array().unwrap().len(), 4);
    let token = page["next_page_token"].as_str().unwrap();
    let rest: Value = app
        .get(&format!("/v1/traces?prompt=p&page_size=4&page_token={token}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(rest["traces"].as_array().unwrap().len(), 2);
    let none: Value = app.get("/v1/traces?status=consumed").send().await.unwrap().json().await.unwrap();
    assert!(none["traces"].as_array().unwrap().is_empty());
    let later = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339().replace('+', "%2B");
    let none: Value = app.get(&format!("/v1/traces?since={later}")).send().await.unwrap().json().await.unwrap();
    assert!(none["traces"].as_array().unwrap().is_empty());
    expect_problem(app.get("/v1/traces?status=odd").send().await.unwrap(), 400).await;
    expect_problem(app.get("/v1/traces?since=yesterday").send().await.unwrap(), 400).await;
    // A range from the year 1 to the year 9999 is a range like any other; a time further off
    // (which chrono reads, but no store keeps) is refused with the reason.
    let all: Value = app
        .get("/v1/traces?prompt=p&since=0001-01-01T00:00:00Z&until=9999-12-31T23:59:59Z")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(all["traces"].as_array().map(Vec::len), Some(6), "{all}");
    let far = expect_problem(app.get("/v1/traces?since=-262143-01-01T00:00:00Z").send().await.unwrap(), 400).await;
    assert!(far["detail"].as_str().is_some_and(|d| d.contains("between the years 1 and 9999")), "{far}");
    let far = app.get("/v1/audit?until=%2B12000-01-01T00:00:00Z").send().await.unwrap();
    assert_eq!(far.status(), 400);

    // Late feedback.
    let res = app
        .post(&format!("/v1/traces/{id}/feedback"), json!({"comment": "actually wrong", "success": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let t: Value = res.json().await.unwrap();
    assert_eq!((t["feedback"]["success"].as_bool(), t["feedback"]["score"].as_f64()), (Some(false), Some(1.0)));
    expect_problem(app.post(&format!("/v1/traces/{id}/feedback"), json!({"stars": 5})).send().await.unwrap(), 422)
        .await;
    let nul = json!({"comment": "a\u{0}"});
    let p = expect_problem(app.post(&format!("/v1/traces/{id}/feedback"), nul).send().await.unwrap(), 422).await;
    assert!(p["detail"].as_str().unwrap().contains("`comment` holds U+0000"), "{p}");
    let ghost = uuid::Uuid::now_v7();
    expect_problem(app.post(&format!("/v1/traces/{ghost}/feedback"), json!({})).send().await.unwrap(), 404).await;
    expect_problem(app.get("/v1/traces/not-a-uuid").send().await.unwrap(), 404).await;
}

async fn trace_input_is_validated(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    let mut missing_input = one_trace("p");
    missing_input.as_object_mut().unwrap().remove("input");
    let mut bad_version = one_trace("p");
    bad_version["prompt_version"] = json!(5);
    let mut wrong_type = one_trace("p");
    wrong_type["feedback"]["score"] = json!("high");
    let mut big_field = one_trace("p");
    big_field["output"] = json!("x".repeat(9 * 1024));
    let mut big_trace = one_trace("p");
    big_trace["input"] = json!((0..10).map(|i| format!("{i}{}", "y".repeat(4000))).collect::<Vec<_>>());
    let cases = [
        (one_trace("ghost"), 422, "unknown prompt"),
        (missing_input, 422, "input"),
        (bad_version, 422, "no version 5"),
        (wrong_type, 422, "score"),
        (big_field, 413, "output"),
        (big_trace, 413, "limit"),
        (json!([1, 2]), 422, "one trace object"),
        (json!({"traces": "no"}), 422, "array"),
        (json!({"traces": []}), 422, "no traces"),
        (json!({"traces": [one_trace("p"), {"prompt": "p"}]}), 422, "traces[1]"),
        (json!({"traces": (0..51).map(|_| one_trace("p")).collect::<Vec<_>>()}), 413, "max_traces_per_batch"),
        // U+0000, which Postgres keeps in neither text nor jsonb: refused on both stores.
        (json!({"prompt": "p", "input": {"q": "a\u{0}b"}}), 422, "input.q holds U+0000"),
        (json!({"traces": [one_trace("p"), {"prompt": "p", "input": 1, "external_id": "\u{0}"}]}), 422, "traces[1]"),
    ];
    for (body, status, needle) in cases {
        let res = app.post("/v1/traces", body).send().await.unwrap();
        let p = expect_problem(res, status).await;
        assert!(p["detail"].as_str().unwrap().contains(needle), "{needle:?} in {p}");
    }
    let res = app
        .http
        .post(app.url("/v1/traces"))
        .bearer_auth(&app.admin_key)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    expect_problem(res, 400).await;
    let res = app
        .http
        .post(app.url("/v1/traces"))
        .bearer_auth(&app.admin_key)
        .header("content-type", "application/json")
        .body(vec![b' '; 300 * 1024])
        .send()
        .await
        .unwrap();
    expect_problem(res, 413).await;
    // Nothing from the failed requests was stored.
    let all: Value = app.get("/v1/traces").send().await.unwrap().json().await.unwrap();
    assert!(all["traces"].as_array().unwrap().is_empty());
}

async fn post(app: &TestApp, key: &str, body: &Value) -> reqwest::Response {
    app.post("/v1/traces", body.clone()).header("idempotency-key", key).send().await.unwrap()
}

async fn idempotency_key_replays_and_rejects(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    let body = json!({"traces": [one_trace("p"), one_trace("p")]});
    let first = post(&app, "k-1", &body).await;
    assert_eq!(first.status(), 201);
    let first: Value = first.json().await.unwrap();
    let again = post(&app, "k-1", &body).await;
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<Value>().await.unwrap(), first, "the first answer, replayed");
    let stored: Value = app.get("/v1/traces").send().await.unwrap().json().await.unwrap();
    assert_eq!(stored["traces"].as_array().unwrap().len(), 2, "nothing stored twice");

    let p = expect_problem(post(&app, "k-1", &json!({"traces": [one_trace("p")]})).await, 422).await;
    assert!(p["detail"].as_str().unwrap().contains("different request body"));

    // Concurrent requests with one key: one stores, the others wait for it and replay.
    let twins = json!({"traces": [one_trace("p")]});
    let sends: Vec<_> =
        (0..6).map(|_| app.post("/v1/traces", twins.clone()).header("idempotency-key", "k-2").send()).collect();
    let mut answers = Vec::new();
    for res in futures_util::future::join_all(sends).await {
        let res = res.unwrap();
        assert_eq!(res.status(), 201);
        answers.push(res.json::<Value>().await.unwrap());
    }
    assert!(answers.iter().all(|a| *a == answers[0]), "one answer for all: {answers:?}");
    let stored: Value = app.get("/v1/traces").send().await.unwrap().json().await.unwrap();
    assert_eq!(stored["traces"].as_array().unwrap().len(), 3, "the twins stored once");

    // A failed request is not remembered: fixing it and retrying with the same key works.
    expect_problem(post(&app, "k-3", &json!({"traces": [one_trace("ghost")]})).await, 422).await;
    assert_eq!(post(&app, "k-3", &json!({"traces": [one_trace("p")]})).await.status(), 201);
    expect_problem(post(&app, &"k".repeat(300), &body).await, 400).await;
}

async fn failed_traces_are_requeued_through_the_api(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    let res = app
        .post("/v1/traces", json!({"traces": [one_trace("p"), one_trace("p"), one_trace("p")]}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let failed = common::fail_pending_traces(&app.store, "p").await;
    let status = |id: uuid::Uuid| {
        let req = app.get(&format!("/v1/traces/{id}"));
        async move { req.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    assert_eq!(status(failed[0]).await["status"], "failed");
    let requeue = |body: Value| app.post("/v1/prompts/p/traces/requeue", body).send();

    // Bad requests say what is wrong; nothing changes.
    let p = expect_problem(requeue(json!({})).await.unwrap(), 422).await;
    assert!(p["detail"].as_str().unwrap().contains("`ids`"), "{p}");
    expect_problem(requeue(json!({"ids": [failed[0]], "all": true})).await.unwrap(), 422).await;
    expect_problem(requeue(json!({"ids": []})).await.unwrap(), 422).await;
    expect_problem(requeue(json!({"ids": ["not-a-uuid"]})).await.unwrap(), 422).await;
    expect_problem(requeue(json!({"all": true, "since": "yesterday"})).await.unwrap(), 422).await;
    let far =
        expect_problem(requeue(json!({"all": true, "since": "+12000-01-01T00:00:00Z"})).await.unwrap(), 422).await;
    assert!(far["detail"].as_str().unwrap().contains("between the years 1 and 9999"), "{far}");
    expect_problem(requeue(json!({"all": true, "extra": 1})).await.unwrap(), 422).await;
    let ghost = app.post("/v1/prompts/ghost/traces/requeue", json!({"all": true})).send().await.unwrap();
    expect_problem(ghost, 404).await;
    // Scope-checked like other trace writes.
    let reader = app.key_with(&["prompts:read"]).await;
    let res = app
        .http
        .post(app.url("/v1/prompts/p/traces/requeue"))
        .bearer_auth(&reader)
        .json(&json!({"all": true}))
        .send()
        .await
        .unwrap();
    expect_problem(res, 403).await;
    assert_eq!(status(failed[0]).await["status"], "failed");

    let writer = app.key_with(&["traces:write"]).await;
    let res = app
        .http
        .post(app.url("/v1/prompts/p/traces/requeue"))
        .bearer_auth(&writer)
        .json(&json!({"ids": [failed[0]]}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.json::<Value>().await.unwrap(), json!({"ids": [failed[0]], "count": 1}));
    let t = status(failed[0]).await;
    assert_eq!((t["status"].as_str(), t["attempts"].as_i64()), (Some("pending"), Some(0)), "{t}");
    assert!(t["failure_reason"].is_null(), "{t}");
    assert_eq!(status(failed[1]).await["status"], "failed", "only the named trace");

    let all: Value = requeue(json!({"all": true})).await.unwrap().json().await.unwrap();
    assert_eq!(all["count"], 2);
    let again: Value = requeue(json!({"all": true})).await.unwrap().json().await.unwrap();
    assert_eq!(again["count"], 0, "nothing failed is left");
    let pending: Value = app.get("/v1/traces?prompt=p&status=pending").send().await.unwrap().json().await.unwrap();
    assert_eq!(pending["traces"].as_array().unwrap().len(), 3);
}

async fn keys_and_scopes(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    // Missing, malformed and unknown keys → 401 with a Bearer challenge.
    let res = app.http.get(app.url("/v1/prompts/p")).send().await.unwrap();
    assert_eq!(res.headers()["www-authenticate"], "Bearer");
    expect_problem(res, 401).await;
    let res = app.http.get(app.url("/v1/prompts/p")).header("authorization", "Basic abc").send().await.unwrap();
    expect_problem(res, 401).await;
    let res = app.http.get(app.url("/v1/prompts/p")).bearer_auth("cmb_wrongwrongwrong").send().await.unwrap();
    expect_problem(res, 401).await;

    // An agent key can send traces and read prompts, nothing else.
    let agent = app.key_with(&["traces:write", "prompts:read"]).await;
    assert!(agent.starts_with("cmb_"));
    let ok = app.http.post(app.url("/v1/traces")).bearer_auth(&agent).json(&one_trace("p")).send().await.unwrap();
    assert_eq!(ok.status(), 201);
    assert_eq!(app.http.get(app.url("/v1/prompts/p")).bearer_auth(&agent).send().await.unwrap().status(), 200);
    let denied = app
        .http
        .post(app.url("/v1/prompts/p/versions"))
        .bearer_auth(&agent)
        .json(&json!({"base": "x"}))
        .send()
        .await
        .unwrap();
    let p = expect_problem(denied, 403).await;
    assert!(p["detail"].as_str().unwrap().contains("prompts:write"));
    let writer = app.key_with(&["prompts:write"]).await;
    let res = app
        .http
        .put(app.url("/v1/prompts/p/labels/production"))
        .bearer_auth(&writer)
        .json(&json!({"version": 1}))
        .send()
        .await
        .unwrap();
    expect_problem(res, 403).await;
    let res = app.http.get(app.url("/v1/keys")).bearer_auth(&writer).send().await.unwrap();
    expect_problem(res, 403).await;
    let res = app.http.get(app.url("/v1/prompts/p")).bearer_auth(&writer).send().await.unwrap();
    expect_problem(res, 403).await;

    // Keys are listed without secrets, and revocation takes effect at once.
    let list: Value = app.get("/v1/keys").send().await.unwrap().json().await.unwrap();
    assert_eq!(list["keys"].as_array().unwrap().len(), 3);
    assert!(!list.to_string().contains(&agent[4..]), "secrets never listed");
    let prefix = &agent[..12];
    let res = app.http.delete(app.url(&format!("/v1/keys/{prefix}"))).bearer_auth(&app.admin_key).send().await.unwrap();
    assert_eq!(res.status(), 204);
    let res = app.http.get(app.url("/v1/prompts/p")).bearer_auth(&agent).send().await.unwrap();
    expect_problem(res, 401).await;
    let res = app.http.delete(app.url("/v1/keys/cmb_nope")).bearer_auth(&app.admin_key).send().await.unwrap();
    expect_problem(res, 404).await;
    expect_problem(app.post("/v1/keys", json!({"name": "x", "scopes": ["root"]})).send().await.unwrap(), 422).await;
    expect_problem(app.post("/v1/keys", json!({"name": "x", "scopes": []})).send().await.unwrap(), 422).await;
}

async fn first_start_writes_a_private_admin_key(b: Backend) {
    let app = spawn_app(b).await;
    let path = app.data_dir.join("admin-key");
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&path).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    // A second start on the same store does not mint another.
    assert_eq!(combee::app::ensure_admin_key(&app.store, &app.data_dir).await.unwrap(), None);
    assert_eq!(app.store.count_active_api_keys().await.unwrap(), 1);
}

async fn operational_routes(b: Backend) {
    let app = spawn_app(b).await;
    let res = app.http.get(app.url("/healthz")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert!(res.headers().contains_key("x-request-id"));
    let ready: Value = app.http.get(app.url("/readyz")).send().await.unwrap().json().await.unwrap();
    assert_eq!(ready["status"], "ready");
    app.create_prompt("p").await;
    let metrics = app.http.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("combee_http_requests_total"), "{metrics}");
    let doc: Value = app.http.get(app.url("/v1/openapi.json")).send().await.unwrap().json().await.unwrap();
    for path in ["/v1/prompts", "/v1/prompts/{name}", "/v1/traces", "/v1/prompts/{name}/rollback", "/v1/keys"] {
        assert!(doc["paths"].get(path).is_some(), "{path} documented");
    }
    assert!(doc["components"]["securitySchemes"]["bearer"].is_object());
    let res = app.http.get(app.url("/v2/anything")).send().await.unwrap();
    expect_problem(res, 404).await;
    let res = app.http.delete(app.url("/v1/prompts")).bearer_auth(&app.admin_key).send().await.unwrap();
    expect_problem(res, 405).await;
    // A given request id is propagated.
    let res = app.http.get(app.url("/healthz")).header("x-request-id", "abc-123").send().await.unwrap();
    assert_eq!(res.headers()["x-request-id"], "abc-123");
    // Answers are counted by route template (API and web UI alike), unknown paths as one
    // `unmatched` route and invented methods as one `other` method.
    let res = app.http.get(app.url("/v1/prompts/p")).bearer_auth(&app.admin_key).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(app.http.get(app.url("/ui/login")).send().await.unwrap().status(), 200);
    let brew = reqwest::Method::from_bytes(b"BREW").unwrap();
    let res = app.http.request(brew, app.url("/v1/prompts/p")).bearer_auth(&app.admin_key).send().await.unwrap();
    expect_problem(res, 405).await;
    let metrics = app.http.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let counted = |method: &str, route: &str, status: u16| {
        metrics.lines().any(|l| {
            l.starts_with("combee_http_requests_total{")
                && l.contains(&format!("method=\"{method}\""))
                && l.contains(&format!("route=\"{route}\""))
                && l.contains(&format!("status=\"{status}\""))
        })
    };
    assert!(counted("POST", "/v1/prompts", 201), "{metrics}");
    assert!(counted("GET", "/v1/prompts/{name}", 200), "{metrics}");
    assert!(counted("GET", "/ui/login", 200), "{metrics}");
    assert!(counted("GET", "unmatched", 404), "{metrics}");
    assert!(counted("other", "/v1/prompts/{name}", 405), "{metrics}");
    assert!(!metrics.contains("BREW"), "{metrics}");
}

async fn graceful_shutdown_stops_the_server(b: Backend) {
    let mut app = spawn_app(b).await;
    app.create_prompt("p").await;
    app.shutdown.cancel();
    let server = std::mem::replace(&mut app.server, tokio::spawn(async { Ok(()) }));
    tokio::time::timeout(std::time::Duration::from_secs(10), server).await.expect("stops").unwrap().unwrap();
    assert!(app.http.get(app.url("/healthz")).send().await.is_err(), "no longer listening");
}

/// Where the trace writes' time went, on either store: the groups they were
/// committed in (a large batch, which Postgres commits alone, counted too)
/// and the phases of those commits.
async fn trace_writes_say_where_their_time_went(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    let read = async || {
        let text = app.get("/metrics").send().await.unwrap().text().await.unwrap();
        let value = |series: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
                .map_or(0.0, |v| v.trim().parse().unwrap())
        };
        (value("combee_store_write_group_rows_sum"), value("combee_store_write_phase_seconds_count{phase=\"insert\"}"))
    };
    let (rows, phases) = read().await;
    let one = json!({"prompt": "p", "input": {"q": "one"}});
    assert_eq!(app.post("/v1/traces", one).send().await.unwrap().status(), 201);
    let batch: Vec<Value> = (0..40).map(|i| json!({"prompt": "p", "input": {"q": i}})).collect();
    assert_eq!(app.post("/v1/traces", json!({"traces": batch})).send().await.unwrap().status(), 201);
    let (rows_after, phases_after) = read().await;
    assert_eq!(rows_after - rows, 41.0, "every trace written is counted in a group");
    assert!(phases_after - phases >= 1.0, "the commits' phases are timed: {phases} → {phases_after}");
}

async fn per_version_metrics_reflect_rewards_usage_and_late_feedback(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    let res = app.post("/v1/prompts/p/versions", json!({"base": "You are a careful agent."})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let trace = |v: i64, success: bool, score: f64, tokens: i64| {
        json!({"prompt": "p", "prompt_version": v, "input": {"q": "x"},
               "feedback": {"success": success, "score": score}, "metadata": {"tokens": tokens, "latency_ms": 40}})
    };
    let batch: Vec<Value> = (0..8)
        .map(|i| trace(1, i < 6, if i < 6 { 1.0 } else { 0.0 }, 100))
        .chain((0..4).map(|i| trace(2, i < 1, 0.25, 300)))
        .chain([json!({"prompt": "p", "prompt_version": 2, "input": {"q": "no feedback yet"}})])
        .collect();
    let posted: Value = app.post("/v1/traces", json!({"traces": batch})).send().await.unwrap().json().await.unwrap();
    let late_id = posted["ids"][12].as_str().unwrap().to_owned();

    let res = app.get("/v1/prompts/p/metrics?window=24h").send().await.unwrap();
    assert_eq!(res.status(), 200);
    let m: Value = res.json().await.unwrap();
    assert_eq!((m["prompt"].as_str(), m["bucket_seconds"].as_i64()), (Some("p"), Some(900)));
    let versions = m["versions"].as_array().unwrap();
    assert_eq!(versions.iter().map(|v| v["version"].as_i64()).collect::<Vec<_>>(), vec![Some(2), Some(1)]);
    let (v2, v1) = (&versions[0], &versions[1]);
    assert_eq!(v1["labels"], json!(["production"]));
    assert_eq!((v1["traces"].as_u64(), v1["with_feedback"].as_u64()), (Some(8), Some(8)));
    assert_eq!(v1["success"]["rate"].as_f64(), Some(0.75));
    // Wilson 95% for 6/8.
    let (lo, hi) =
        (v1["success"]["interval"]["low"].as_f64().unwrap(), v1["success"]["interval"]["high"].as_f64().unwrap());
    assert!((lo - 0.4093).abs() < 1e-3 && (hi - 0.9285).abs() < 1e-3, "{lo} {hi}");
    assert_eq!(v1["score"]["mean"].as_f64(), Some(0.75));
    assert!(v1["score"]["interval"]["low"].as_f64().unwrap() < 0.75);
    assert_eq!((v1["tokens"]["mean"].as_f64(), v1["latency_ms"]["mean"].as_f64()), (Some(100.0), Some(40.0)));
    assert!(v1["cost_usd"].is_null());
    assert_eq!(v1["series"].as_array().unwrap().len(), 1);
    assert_eq!(v1["series"][0]["success_rate"].as_f64(), Some(0.75));
    assert_eq!((v2["traces"].as_u64(), v2["with_feedback"].as_u64()), (Some(5), Some(4)));
    assert_eq!(v2["success"]["rate"].as_f64(), Some(0.25));
    assert_eq!(v2["labels"], json!([]));

    // Late feedback counts on the next read.
    let res = app
        .post(&format!("/v1/traces/{late_id}/feedback"), json!({"success": true, "score": 1.0}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let m: Value = app.get("/v1/prompts/p/metrics").send().await.unwrap().json().await.unwrap();
    let v2 = &m["versions"][0];
    assert_eq!((v2["with_feedback"].as_u64(), v2["success"]["successes"].as_u64()), (Some(5), Some(2)));
    assert_eq!(v2["score"]["mean"].as_f64(), Some(0.4));

    // The answer lists the newest versions and the labelled ones; `newest` asks for more or fewer.
    assert!(m["omitted_before"].is_null(), "{m}");
    let res = app.post("/v1/prompts/p/versions", json!({"base": "three"})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let listed =
        |m: &Value| m["versions"].as_array().unwrap().iter().map(|v| v["version"].as_i64()).collect::<Vec<_>>();
    let few: Value = app.get("/v1/prompts/p/metrics?newest=1").send().await.unwrap().json().await.unwrap();
    assert_eq!((listed(&few), &few["omitted_before"]), (vec![Some(1)], &json!(3)), "v3 has no traces, v1 is labelled");
    let more: Value = app.get("/v1/prompts/p/metrics?newest=2").send().await.unwrap().json().await.unwrap();
    assert_eq!((listed(&more), &more["omitted_before"]), (vec![Some(2), Some(1)], &Value::Null), "v1 is labelled");
    let all: Value = app.get("/v1/prompts/p/metrics?newest=3").send().await.unwrap().json().await.unwrap();
    assert_eq!((listed(&all), &all["omitted_before"]), (vec![Some(2), Some(1)], &Value::Null));

    // Prometheus: gauges for labelled versions only.
    let text = app.get("/metrics").send().await.unwrap().text().await.unwrap();
    assert!(
        text.contains(
            "combee_version_success_rate{prompt=\"p\",project=\"default\",version=\"1\",labels=\"production\"} 0.75"
        ),
        "{text}"
    );
    assert!(text.contains(
        "combee_version_mean_score{prompt=\"p\",project=\"default\",version=\"1\",labels=\"production\"} 0.75"
    ));
    assert!(!text.contains("version=\"2\""), "unlabelled versions have no series");
    let res = app.put("/v1/prompts/p/labels/candidate", json!({"version": 2})).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let text = app.get("/metrics").send().await.unwrap().text().await.unwrap();
    assert!(
        text.contains(
            "combee_version_success_rate{prompt=\"p\",project=\"default\",version=\"2\",labels=\"candidate\"} 0.4"
        ),
        "{text}"
    );

    // A window before the traces is empty; bad parameters are explained.
    let since = (chrono::Utc::now() - chrono::Duration::days(2)).to_rfc3339().replace('+', "%2B");
    let old: Value =
        app.get(&format!("/v1/prompts/p/metrics?since={since}&window=1d")).send().await.unwrap().json().await.unwrap();
    assert_eq!(old["versions"], json!([]));
    for bad in
        ["window=7", "window=1w", "window=0h", "since=yesterday", "bucket=0m", "newest=0", "newest=1001", "newest=x"]
    {
        let body = expect_problem(app.get(&format!("/v1/prompts/p/metrics?{bad}")).send().await.unwrap(), 400).await;
        assert!(!body["detail"].as_str().unwrap().contains("internal"), "{bad}: {body}");
    }
    // Past the limits, the answer says what it read instead of refusing.
    let cut: Value = app.get("/v1/prompts/p/metrics?window=999d").send().await.unwrap().json().await.unwrap();
    let span = |v: &Value, a: &str| chrono::DateTime::parse_from_rfc3339(v[a].as_str().unwrap()).unwrap();
    assert_eq!((span(&cut, "until") - span(&cut, "from")).num_days(), 366, "{cut}");
    let wide: Value = app.get("/v1/prompts/p/metrics?window=30d&bucket=1m").send().await.unwrap().json().await.unwrap();
    assert!(wide["bucket_seconds"].as_i64().unwrap() >= 30 * 86_400 / 2_000, "{wide}");
    expect_problem(app.get("/v1/prompts/nope/metrics").send().await.unwrap(), 404).await;
    let doc: Value = app.get("/v1/openapi.json").send().await.unwrap().json().await.unwrap();
    assert!(doc["paths"]["/v1/prompts/{name}/metrics"]["get"]["responses"]["400"].is_object());
}

/// `GET /v1/prompts/{name}/labels/history`: every move made through the API,
/// newest first, with its actor, kind and reason; filtered by label; paged;
/// read with `prompts:read`; bad input answered with problems.
async fn label_history_over_the_api(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("hist").await;
    let res = app
        .post("/v1/prompts/hist/versions", json!({"base": "two", "labels": ["candidate"], "message": "try two"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let res = app
        .put("/v1/prompts/hist/labels/production", json!({"version": 2, "reason": "candidate won"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let res = app.post("/v1/prompts/hist/rollback", json!({"to": 1, "message": "too slow"})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let res =
        app.http.delete(app.url("/v1/prompts/hist/labels/candidate")).bearer_auth(&app.admin_key).send().await.unwrap();
    assert_eq!(res.status(), 204);

    let reader = app.key_with(&["prompts:read"]).await;
    let get = |path: &str| app.http.get(app.url(path)).bearer_auth(&reader);
    let page: Value = get("/v1/prompts/hist/labels/history").send().await.unwrap().json().await.unwrap();
    let moves = page["moves"].as_array().unwrap();
    let summary: Vec<(String, String, Value, Value, String)> = moves
        .iter()
        .map(|m| {
            (
                m["label"].as_str().unwrap().into(),
                m["kind"].as_str().unwrap().into(),
                m["from_version"].clone(),
                m["to_version"].clone(),
                m["reason"].as_str().unwrap().into(),
            )
        })
        .collect();
    let row = |l: &str, k: &str, f: Value, t: Value, r: &str| (l.to_owned(), k.to_owned(), f, t, r.to_owned());
    assert_eq!(
        summary,
        vec![
            row("candidate", "delete", json!(2), json!(null), "label deleted"),
            row("production", "rollback", json!(2), json!(3), "too slow"),
            row("production", "promote", json!(1), json!(2), "candidate won"),
            row("candidate", "promote", json!(null), json!(2), "try two"),
            row("production", "create", json!(null), json!(1), "prompt created"),
        ]
    );
    assert!(moves.iter().all(|m| m["actor"].as_str().unwrap().starts_with("key:")), "{page}");
    assert!(!page.to_string().contains(&app.admin_key), "a secret in the history");
    assert!(page["next_page_token"].is_null());

    // Filter and pages.
    let prod: Value =
        get("/v1/prompts/hist/labels/history?label=production").send().await.unwrap().json().await.unwrap();
    assert_eq!(prod["moves"].as_array().unwrap().len(), 3);
    let p1: Value = get("/v1/prompts/hist/labels/history?page_size=2").send().await.unwrap().json().await.unwrap();
    let token = p1["next_page_token"].as_str().unwrap().to_owned();
    let p2: Value = get(&format!("/v1/prompts/hist/labels/history?page_size=2&page_token={token}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(p2["moves"][0]["kind"], "promote");
    assert_eq!(p2["moves"][0]["label"], "production");

    // Errors.
    expect_problem(get("/v1/prompts/nope/labels/history").send().await.unwrap(), 404).await;
    expect_problem(get("/v1/prompts/hist/labels/history?label=Bad!").send().await.unwrap(), 422).await;
    expect_problem(get("/v1/prompts/hist/labels/history?page_token=abc").send().await.unwrap(), 400).await;
    let writer = app.key_with(&["traces:write"]).await;
    let res = app.http.get(app.url("/v1/prompts/hist/labels/history")).bearer_auth(&writer).send().await.unwrap();
    expect_problem(res, 403).await;
    // `history` is the history's path, never a label.
    let res = app.put("/v1/prompts/hist/labels/history", json!({"version": 1})).send().await.unwrap();
    assert!(res.status().is_client_error(), "{}", res.status());
    let res = app.post("/v1/prompts/hist/versions", json!({"base": "x", "labels": ["history"]})).send().await.unwrap();
    expect_problem(res, 422).await;
    let long = "x".repeat(2001);
    let res =
        app.put("/v1/prompts/hist/labels/production", json!({"version": 1, "reason": long})).send().await.unwrap();
    expect_problem(res, 422).await;
}

on_both_stores!(
    label_history_over_the_api,
    failed_traces_are_requeued_through_the_api,
    prompt_lifecycle,
    playbook_diff_and_candidate_label,
    prompt_input_is_validated,
    prompts_list_paginates,
    traces_ingest_list_and_feedback,
    trace_input_is_validated,
    idempotency_key_replays_and_rejects,
    keys_and_scopes,
    first_start_writes_a_private_admin_key,
    operational_routes,
    graceful_shutdown_stops_the_server,
    per_version_metrics_reflect_rewards_usage_and_late_feedback,
    trace_writes_say_where_their_time_went,
);
