//! The store contract: one suite, run unchanged against Postgres and SQLite.

mod common;

use std::sync::Arc;

use combee::{
    domain::{
        Feedback, LabelName, Promotion, PromptName, PromptSettings, Strategy, TraceStatus, VersionContent,
        VersionSource,
        prompt::NewVersion,
        trace::{NewTrace, TraceLimits, ValidTrace},
    },
    store::{
        Change, DynStore, IdempotencyBegin, LabelMove, NewPrompt, NewUiSession, Scope, Selector, StoreError,
        TraceFilter,
    },
};
use common::{Backend, test_store};
use serde_json::json;

fn name(s: &str) -> PromptName {
    PromptName::parse(s).unwrap()
}

fn version(base: &str) -> NewVersion {
    NewVersion {
        parent: None,
        source: VersionSource::Manual,
        round_id: None,
        content: VersionContent { base: base.into(), playbook: None },
        message: "m".into(),
        created_by: "test".into(),
    }
}

async fn make_prompt(store: &DynStore, n: &str) {
    let p = NewPrompt {
        name: name(n),
        strategy: Strategy::Playbook,
        promotion: Promotion::Auto,
        settings: PromptSettings::default(),
        created_by: "test".into(),
    };
    store.create_prompt(p, version("v1")).await.unwrap();
}

fn trace(prompt: &str, v: Option<i64>) -> ValidTrace {
    let t: NewTrace =
        serde_json::from_value(json!({"prompt": prompt, "prompt_version": v, "input": {"q": "x"}})).unwrap();
    t.validate(TraceLimits { max_field_bytes: 1024, max_trace_bytes: 4096 }).unwrap()
}

async fn prompts_start_at_version_one_labelled_production(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let r = s.resolve(&name("p"), &Selector::Label(LabelName::production())).await.unwrap().unwrap();
    assert_eq!(r.version.number, 1);
    assert_eq!(r.labels, vec![LabelName::production()]);
    assert!(r.version.content_hash.starts_with("sha256:"));
    let again = NewPrompt {
        name: name("p"),
        strategy: Strategy::Rewrite,
        promotion: Promotion::Manual,
        settings: PromptSettings::default(),
        created_by: "x".into(),
    };
    assert!(matches!(s.create_prompt(again, version("x")).await, Err(StoreError::AlreadyExists)));
    assert!(s.get_prompt(&name("nope")).await.unwrap().is_none());
}

async fn concurrent_writers_get_gapless_numbers(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let tasks: Vec<_> = (0..30)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(
                async move { s.create_version(&name("p"), version(&format!("v{i}")), &[]).await.unwrap().number },
            )
        })
        .collect();
    let mut numbers = Vec::new();
    for t in tasks {
        numbers.push(t.await.unwrap());
    }
    numbers.sort();
    assert_eq!(numbers, (2..=31).collect::<Vec<_>>());
    let latest = s.resolve(&name("p"), &Selector::Latest).await.unwrap().unwrap();
    assert_eq!(latest.version.number, 31);
    let page = s.list_versions(&name("p"), None, 5).await.unwrap();
    assert_eq!(page.iter().map(|v| v.number).collect::<Vec<_>>(), vec![31, 30, 29, 28, 27]);
    let next = s.list_versions(&name("p"), Some(27), 100).await.unwrap();
    assert_eq!(next.len(), 26);
}

async fn label_moves_are_compare_and_set(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let prod = LabelName::production();
    let mv = |to, expected| LabelMove {
        label: prod.clone(),
        to_version: to,
        expected_current: expected,
        check_current: true,
        by: "t".into(),
    };
    // Version 2 created and made production atomically (`to_version: 0` = the new one).
    let v2 = s.create_version(&name("p"), version("two"), &[mv(0, Some(1))]).await.unwrap();
    assert_eq!(v2.number, 2);
    // A stale expectation fails and changes nothing, including the version it would create.
    let stale = s.create_version(&name("p"), version("three"), &[mv(0, Some(1))]).await;
    assert!(matches!(stale, Err(StoreError::Conflict)));
    assert_eq!(s.resolve(&name("p"), &Selector::Latest).await.unwrap().unwrap().version.number, 2);
    assert!(matches!(s.move_label(&name("p"), &mv(1, Some(1))).await, Err(StoreError::Conflict)));
    let moved = s.move_label(&name("p"), &mv(1, Some(2))).await.unwrap();
    assert_eq!(moved.version, 1);
    assert!(matches!(s.move_label(&name("p"), &mv(9, Some(1))).await, Err(StoreError::Invalid(_))));
    // A new label, then delete it.
    let cand = LabelMove {
        label: LabelName::candidate(),
        to_version: 2,
        expected_current: None,
        check_current: true,
        by: "t".into(),
    };
    s.move_label(&name("p"), &cand).await.unwrap();
    let labels: Vec<_> = s.list_labels(&name("p")).await.unwrap().into_iter().map(|l| (l.name, l.version)).collect();
    assert_eq!(labels, vec![(LabelName::candidate(), 2), (prod.clone(), 1)]);
    assert!(s.delete_label(&name("p"), &LabelName::candidate()).await.unwrap());
    assert!(!s.delete_label(&name("p"), &LabelName::candidate()).await.unwrap());
}

async fn traces_are_all_or_nothing(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let ids = s.insert_traces(&[trace("p", Some(1)), trace("p", None)]).await.unwrap();
    assert_eq!(ids.len(), 2);
    let err = s.insert_traces(&[trace("p", None), trace("ghost", None)]).await.unwrap_err();
    assert!(matches!(&err, StoreError::Invalid(m) if m.contains("traces[1]") && m.contains("ghost")), "{err:?}");
    let err = s.insert_traces(&[trace("p", Some(7))]).await.unwrap_err();
    assert!(matches!(&err, StoreError::Invalid(m) if m.contains("no version 7")), "{err:?}");
    let all = s.list_traces(&TraceFilter::default(), 100).await.unwrap();
    assert_eq!(all.len(), 2, "the failed batches left nothing behind");
    assert_eq!(all[0].id, ids[1], "newest first");
    let t = s.get_trace(ids[0]).await.unwrap().unwrap();
    assert_eq!((t.status, t.prompt_version, t.attempts), (TraceStatus::Pending, Some(1), 0));
}

async fn trace_filters_and_cursor(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "a").await;
    make_prompt(&s, "b").await;
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.extend(s.insert_traces(&[trace("a", None)]).await.unwrap());
    }
    s.insert_traces(&[trace("b", None)]).await.unwrap();
    let only_a = TraceFilter { prompt: Some(name("a")), ..Default::default() };
    let page1 = s.list_traces(&only_a, 3).await.unwrap();
    assert_eq!(page1.iter().map(|t| t.id).collect::<Vec<_>>(), vec![ids[4], ids[3], ids[2]]);
    let page2 = s.list_traces(&TraceFilter { before_id: Some(ids[2]), ..only_a.clone() }, 3).await.unwrap();
    assert_eq!(page2.iter().map(|t| t.id).collect::<Vec<_>>(), vec![ids[1], ids[0]]);
    let consumed = TraceFilter { status: Some(TraceStatus::Consumed), ..Default::default() };
    assert!(s.list_traces(&consumed, 10).await.unwrap().is_empty());
    let future = TraceFilter { since: Some(chrono::Utc::now() + chrono::Duration::hours(1)), ..Default::default() };
    assert!(s.list_traces(&future, 10).await.unwrap().is_empty());
    let past = TraceFilter { until: Some(chrono::Utc::now() + chrono::Duration::hours(1)), ..Default::default() };
    assert_eq!(s.list_traces(&past, 10).await.unwrap().len(), 6);
}

async fn late_feedback_merges(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let id = s.insert_traces(&[trace("p", None)]).await.unwrap()[0];
    let t = s.add_feedback(id, Feedback { score: Some(0.5), ..Default::default() }).await.unwrap().unwrap();
    assert_eq!(t.feedback.score, Some(0.5));
    let t = s.add_feedback(id, Feedback { success: Some(true), ..Default::default() }).await.unwrap().unwrap();
    assert_eq!((t.feedback.score, t.feedback.success), (Some(0.5), Some(true)));
    assert!(s.add_feedback(uuid::Uuid::now_v7(), Feedback::default()).await.unwrap().is_none());
}

async fn idempotency_state_machine(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    let owner = uuid::Uuid::now_v7();
    assert_eq!(s.idempotency_begin(owner, "k", "h1").await.unwrap(), IdempotencyBegin::Started);
    assert_eq!(s.idempotency_begin(owner, "k", "h1").await.unwrap(), IdempotencyBegin::InFlight);
    assert_eq!(s.idempotency_begin(owner, "k", "h2").await.unwrap(), IdempotencyBegin::Mismatch);
    // Keys are per owner.
    assert_eq!(s.idempotency_begin(uuid::Uuid::now_v7(), "k", "h2").await.unwrap(), IdempotencyBegin::Started);
    s.idempotency_finish(owner, "k", 201, b"{\"ok\":1}").await.unwrap();
    assert_eq!(
        s.idempotency_begin(owner, "k", "h1").await.unwrap(),
        IdempotencyBegin::Replay { status: 201, body: b"{\"ok\":1}".to_vec() }
    );
    // An aborted request is forgotten, so a retry runs again.
    assert_eq!(s.idempotency_begin(owner, "j", "h").await.unwrap(), IdempotencyBegin::Started);
    s.idempotency_abort(owner, "j").await.unwrap();
    assert_eq!(s.idempotency_begin(owner, "j", "h").await.unwrap(), IdempotencyBegin::Started);
    let purged = s.idempotency_purge(chrono::Utc::now() + chrono::Duration::seconds(5)).await.unwrap();
    assert_eq!(purged, 3);
}

async fn concurrent_idempotency_claims_have_one_winner(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    let owner = uuid::Uuid::now_v7();
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move { s.idempotency_begin(owner, "same", "h").await.unwrap() })
        })
        .collect();
    let mut started = 0;
    for t in tasks {
        match t.await.unwrap() {
            IdempotencyBegin::Started => started += 1,
            IdempotencyBegin::InFlight => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(started, 1);
}

async fn api_keys_are_stored_hashed_and_revocable(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    let key =
        s.create_api_key("agent", "cmb_abcdefgh", "hash1", &[Scope::TracesWrite, Scope::PromptsRead]).await.unwrap();
    assert_eq!(s.api_key_by_hash("hash1").await.unwrap().unwrap().scopes, vec![Scope::TracesWrite, Scope::PromptsRead]);
    assert_eq!(s.count_active_api_keys().await.unwrap(), 1);
    assert!(s.revoke_api_key("cmb_abcdefgh").await.unwrap());
    assert!(!s.revoke_api_key(&key.id.to_string()).await.unwrap(), "already revoked");
    assert!(s.api_key_by_hash("hash1").await.unwrap().unwrap().revoked_at.is_some());
    assert_eq!(s.count_active_api_keys().await.unwrap(), 0);
}

async fn ui_sessions_expire_and_show_their_key(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    let key = s.create_api_key("ops", "cmb_opsopsop", "keyhash", &[Scope::PromptsRead]).await.unwrap();
    let now = chrono::Utc::now();
    let open = |token_hash: &str, expires_at| NewUiSession {
        token_hash: token_hash.into(),
        key_id: key.id,
        csrf_token: format!("csrf-{token_hash}"),
        expires_at,
    };
    s.create_ui_session(&open("live", now + chrono::Duration::hours(1))).await.unwrap();
    s.create_ui_session(&open("stale", now - chrono::Duration::seconds(1))).await.unwrap();
    let (session, k) = s.ui_session("live").await.unwrap().unwrap();
    assert_eq!((session.key_id, session.csrf_token.as_str(), k.id), (key.id, "csrf-live", key.id));
    assert!(session.expires_at > now);
    assert!(s.ui_session("stale").await.unwrap().is_none(), "an expired session is no session");
    assert!(s.ui_session("unknown").await.unwrap().is_none());
    // The key's revocation is visible through the session, for the caller to end it.
    s.revoke_api_key("cmb_opsopsop").await.unwrap();
    assert!(s.ui_session("live").await.unwrap().unwrap().1.revoked_at.is_some());
    assert!(s.delete_ui_session("live").await.unwrap());
    assert!(!s.delete_ui_session("live").await.unwrap());
    assert!(s.ui_session("live").await.unwrap().is_none());
    // Opening a session sweeps the expired ones.
    s.create_ui_session(&open("next", now + chrono::Duration::hours(1))).await.unwrap();
    assert!(!s.delete_ui_session("stale").await.unwrap(), "swept");
}

async fn writes_announce_changes(b: Backend) {
    let ts = test_store(b).await;
    let s: Arc<_> = ts.store.clone();
    let mut rx = s.changes();
    make_prompt(&s, "p").await;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await.expect("a change within 5 s").unwrap() {
            Change::Prompt(n) if n == "p" => break,
            _ => continue,
        }
    }
}

async fn list_prompts_pages_by_name_with_summaries(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    for n in ["c", "a", "b"] {
        make_prompt(&s, n).await;
    }
    s.insert_traces(&[trace("a", None), trace("a", None)]).await.unwrap();
    let page = s.list_prompts(None, 2).await.unwrap();
    assert_eq!(page.iter().map(|p| p.prompt.name.as_str()).collect::<Vec<_>>(), vec!["a", "b"]);
    assert_eq!((page[0].pending_traces, page[0].production_version, page[0].latest_version), (2, Some(1), 1));
    let rest = s.list_prompts(Some("b"), 2).await.unwrap();
    assert_eq!(rest.len(), 1);
}

/// The outbox commits with its change (a failed CAS writes no event), fans out
/// only to matching subscriptions, and deliveries are leased and fenced.
async fn outbox_events_commit_with_their_change_and_deliveries_are_leased(b: Backend) {
    use combee::{
        config::Secret,
        domain::event::EventType,
        store::{AttemptRecord, DeliveryOutcome, NewWebhook},
    };
    use std::time::Duration;
    let ts = test_store(b).await;
    let s = ts.store.clone();
    let mut rx = s.changes();
    let hook = NewWebhook {
        url: "https://example.com/hook".into(),
        events: vec![EventType::LabelMoved],
        description: None,
        secret: Secret::new("whsec_c2VjcmV0"),
    };
    let sub = s.create_webhook(&hook).await.unwrap();
    assert_eq!(s.get_webhook(sub.id).await.unwrap().unwrap().secret.expose(), "whsec_c2VjcmV0");
    make_prompt(&s, "p").await; // version.created (not subscribed) + label.moved
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while tokio::time::timeout_at(deadline, rx.recv()).await.expect("an outbox wake-up").unwrap() != Change::OutboxEvent
    {
    }
    s.create_version(&name("p"), version("v2"), &[]).await.unwrap(); // version.created only
    let stale = LabelMove {
        label: LabelName::production(),
        to_version: 2,
        expected_current: Some(5),
        check_current: true,
        by: "t".into(),
    };
    assert!(matches!(s.move_label(&name("p"), &stale).await, Err(StoreError::Conflict)));
    s.move_label(&name("p"), &LabelMove { expected_current: Some(1), ..stale }).await.unwrap();

    let claimed = s.claim_deliveries("a", Duration::ZERO, 10).await.unwrap();
    assert_eq!(claimed.len(), 2, "one delivery per committed label move, none for the rolled-back one");
    assert!(claimed.iter().all(|d| d.event_type == "label.moved" && d.attempt == 1));
    let bodies: Vec<serde_json::Value> = claimed.iter().map(|d| serde_json::from_str(&d.body).unwrap()).collect();
    let mut moves: Vec<_> =
        bodies.iter().map(|b| (b["data"]["previous_version"].as_i64(), b["data"]["version"].as_i64())).collect();
    moves.sort();
    assert_eq!(moves, vec![(None, Some(1)), (Some(1), Some(2))]);

    // A zero lease expires at once: another worker takes the delivery, and the first one's result is refused.
    let retaken = s.claim_deliveries("b", Duration::from_secs(60), 1).await.unwrap();
    assert_eq!(retaken[0].attempt, 2);
    let stale_owner = claimed.iter().find(|d| d.id == retaken[0].id).unwrap();
    let ok = AttemptRecord { status_code: Some(200), error: None, latency_ms: 3, outcome: DeliveryOutcome::Succeeded };
    assert!(!s.finish_delivery(stale_owner, &ok).await.unwrap());
    assert!(
        s.claim_deliveries("c", Duration::from_secs(60), 10).await.unwrap().iter().all(|d| d.id != retaken[0].id),
        "leased"
    );
    assert!(s.finish_delivery(&retaken[0], &ok).await.unwrap());
    let log = s.webhook_attempts(sub.id, None, 10).await.unwrap();
    assert_eq!(
        (log.len(), log[0].attempt, log[0].status_code, log[0].delivery_status.as_str()),
        (1, 2, Some(200), "succeeded")
    );
    assert!(s.delete_webhook(sub.id).await.unwrap());
    assert!(s.list_webhooks().await.unwrap().is_empty());
}

fn rewarded_trace(
    prompt: &str,
    v: Option<i64>,
    feedback: serde_json::Value,
    metadata: serde_json::Value,
) -> ValidTrace {
    let t: NewTrace = serde_json::from_value(
        json!({"prompt": prompt, "prompt_version": v, "input": {"q": "x"}, "feedback": feedback, "metadata": metadata}),
    )
    .unwrap();
    t.validate(TraceLimits { max_field_bytes: 1024, max_trace_bytes: 4096 }).unwrap()
}

async fn version_outcomes_aggregate_rewards_usage_and_late_feedback(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    make_prompt(&s, "other").await;
    s.create_version(&name("p"), version("v2"), &[]).await.unwrap();
    let ids = s
        .insert_traces(&[
            rewarded_trace(
                "p",
                Some(1),
                json!({"success": true, "score": 1.0}),
                json!({"tokens": 100, "latency_ms": 20.5}),
            ),
            rewarded_trace(
                "p",
                Some(1),
                json!({"success": false, "score": 0.0}),
                json!({"tokens": 300, "cost_usd": 0.01}),
            ),
            // Not numbers, or absurd: left out of the usage and score aggregates.
            rewarded_trace("p", Some(1), json!({"score": 1e300}), json!({"tokens": "many", "cost_usd": null})),
            rewarded_trace("p", Some(2), json!({}), json!({})),
            rewarded_trace("p", None, json!({"success": true}), json!({})),
            rewarded_trace("other", Some(1), json!({"success": true}), json!({})),
        ])
        .await
        .unwrap();
    let from = chrono::Utc::now() - chrono::Duration::hours(1);
    let until = chrono::Utc::now() + chrono::Duration::minutes(1);
    let mut got = s.version_outcomes(&name("p"), from, until, 3600).await.unwrap();
    got.sort_by_key(|b| b.version);
    assert_eq!(got.iter().map(|b| b.version).collect::<Vec<_>>(), vec![None, Some(1), Some(2)], "{got:?}");
    let v1 = got[1];
    assert_eq!(v1.start % 3600, 0);
    assert!(v1.start <= until.timestamp() && v1.start + 3600 > from.timestamp());
    assert_eq!((v1.traces, v1.with_feedback, v1.success_trials, v1.successes), (3, 3, 2, 1));
    assert_eq!((v1.score.count, v1.score.sum, v1.score.sum_sq), (2, 1.0, 1.0));
    assert_eq!((v1.tokens.count, v1.tokens.sum, v1.tokens.sum_sq), (2, 400.0, 100_000.0));
    assert_eq!((v1.cost_usd.count, v1.latency_ms.count, v1.latency_ms.sum), (1, 1, 20.5));
    assert_eq!((got[2].traces, got[2].with_feedback, got[2].success_trials), (1, 0, 0));
    assert_eq!((got[0].traces, got[0].successes), (1, 1));

    // Late feedback on the version-2 trace shows up in the next read.
    s.add_feedback(ids[3], Feedback { success: Some(true), score: Some(0.5), ..Default::default() }).await.unwrap();
    let got = s.version_outcomes(&name("p"), from, until, 3600).await.unwrap();
    let v2 = got.iter().find(|b| b.version == Some(2)).unwrap();
    assert_eq!((v2.with_feedback, v2.successes, v2.score.count, v2.score.sum), (1, 1, 1, 0.5));

    // The window is half-open and per prompt.
    assert!(s.version_outcomes(&name("p"), until, until + chrono::Duration::hours(1), 60).await.unwrap().is_empty());
    assert!(s.version_outcomes(&name("nope"), from, until, 60).await.unwrap().is_empty());
}

on_both_stores!(
    outbox_events_commit_with_their_change_and_deliveries_are_leased,
    prompts_start_at_version_one_labelled_production,
    concurrent_writers_get_gapless_numbers,
    label_moves_are_compare_and_set,
    traces_are_all_or_nothing,
    trace_filters_and_cursor,
    late_feedback_merges,
    idempotency_state_machine,
    concurrent_idempotency_claims_have_one_winner,
    api_keys_are_stored_hashed_and_revocable,
    ui_sessions_expire_and_show_their_key,
    writes_announce_changes,
    list_prompts_pages_by_name_with_summaries,
    version_outcomes_aggregate_rewards_usage_and_late_feedback,
);
