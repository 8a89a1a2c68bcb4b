//! The store contract: one suite, run unchanged against Postgres and SQLite.

use crate::common;

use std::sync::Arc;

use combee::{
    domain::{
        AgentReflections, Feedback, LabelName, Promotion, PromptName, PromptSettings, Strategy, TraceStatus,
        VersionContent, VersionSource,
        access::{NewUiSession, Scope},
        label::{LabelMove, Selector},
        prompt::{NewPrompt, NewVersion},
        round::{Method, RoundTrigger},
        span::{OtlpMerge, OtlpRemap, OtlpSpan},
        trace::{IdempotencyKey, IdempotentIngest, NewTrace, RequeueFailed, TraceFilter, TraceLimits, ValidTrace},
    },
    store::{
        Change, DynStore, MeterCounts, OpenRound, RoundEnd, RoundFailure, StoreError, TraceAction, TraceCharges,
        TraceFault,
    },
};
use common::{Backend, eventually, published, test_store};
use serde_json::json;

fn name(s: &str) -> PromptName {
    PromptName::written(s, "default").unwrap()
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

/// A server-wide subscription to `event` (secret `whsec_c2VjcmV0`).
async fn subscribe(s: &DynStore, event: combee::domain::event::EventType) -> combee::domain::webhook::Webhook {
    let hook = combee::domain::webhook::NewWebhook {
        url: "https://example.com/hook".into(),
        project: None,
        events: vec![event],
        description: None,
        secret: combee::secret::Secret::new("whsec_c2VjcmV0"),
    };
    s.create_webhook(&hook).await.unwrap()
}

fn trace(prompt: &str, v: Option<i64>) -> ValidTrace {
    let t: NewTrace =
        serde_json::from_value(json!({"prompt": prompt, "prompt_version": v, "input": {"q": "x"}})).unwrap();
    t.validate(TraceLimits { max_field_bytes: 1024, max_trace_bytes: 4096 }, "default").unwrap()
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
    assert!(s.delete_label(&name("p"), &LabelName::candidate(), "key:test").await.unwrap());
    assert!(!s.delete_label(&name("p"), &LabelName::candidate(), "key:test").await.unwrap());
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

/// Concurrent writes are committed in groups, yet each request stands alone:
/// one naming an unknown prompt fails by itself, late feedback lands once,
/// and the rollups count every stored trace exactly once.
async fn grouped_writes_fail_alone_and_count_once(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let early = s.insert_traces(&[trace("p", Some(1))]).await.unwrap()[0];
    let writes = (0..120).map(|i| {
        let s = s.clone();
        tokio::spawn(async move {
            match i % 12 {
                0 => (i, s.insert_traces(&[trace("p", None), trace("ghost", None)]).await.map(|ids| ids.len())),
                1 => (i, s.insert_traces(&[trace("p", Some(9))]).await.map(|ids| ids.len())),
                2 => {
                    let fb = Feedback { score: Some(0.5), ..Default::default() };
                    (i, s.add_feedback(early, fb).await.map(|t| usize::from(t.is_some()) * 100))
                }
                3 => (
                    i,
                    s.insert_traces(&[trace("p", Some(1)), trace("p", None), trace("p", None)]).await.map(|v| v.len()),
                ),
                _ => (i, s.insert_traces(&[trace("p", Some(1))]).await.map(|ids| ids.len())),
            }
        })
    });
    let mut stored = 1;
    for w in futures_util::future::join_all(writes).await {
        let (i, result) = w.unwrap();
        match (i % 12, result) {
            (0, Err(StoreError::Invalid(m))) => assert!(m.contains("traces[1]") && m.contains("ghost"), "{m}"),
            (1, Err(StoreError::Invalid(m))) => assert!(m.contains("no version 9"), "{m}"),
            (2, Ok(100)) => {}
            (3, Ok(3)) => stored += 3,
            (k, Ok(1)) if k > 3 => stored += 1,
            (k, other) => panic!("write {i} (kind {k}) answered {other:?}"),
        }
    }
    let all = s.list_traces(&TraceFilter::default(), 1000).await.unwrap();
    assert_eq!(all.len(), stored, "the failed requests left nothing behind, the others everything");
    assert_eq!(s.get_trace(early).await.unwrap().unwrap().feedback.score, Some(0.5));
    let now = chrono::Utc::now();
    let buckets = s
        .version_outcomes(&name("p"), now - chrono::Duration::hours(1), now + chrono::Duration::minutes(1), 3600, None)
        .await
        .unwrap();
    let counted: u64 = buckets.iter().map(|b| b.traces).sum();
    let rewarded: u64 = buckets.iter().map(|b| b.with_feedback).sum();
    assert_eq!(counted, stored as u64, "each stored trace counted once: {buckets:?}");
    assert_eq!(rewarded, 1, "the late feedback counted once: {buckets:?}");
}

fn otlp_span(id: &str) -> OtlpSpan {
    OtlpSpan { span_id: id.into(), body: id.as_bytes().to_vec() }
}

/// A stand-in for the OTLP mapping (the store never looks inside span bodies):
/// no `root` span yet is incomplete, a `bad` one is invalid, else a trace of
/// `prompt` whose input lists the bodies in the order the store gave them.
fn fake_remap(prompt: &str, otel_id: &str, bodies: &[&[u8]]) -> OtlpRemap {
    let names: Vec<String> = bodies.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect();
    if names.iter().any(|n| n == "bad") {
        return OtlpRemap::Invalid("a bad span".into());
    }
    if !names.iter().any(|n| n == "root") {
        return OtlpRemap::Incomplete("no root yet".into());
    }
    let t: NewTrace = serde_json::from_value(json!({
        "prompt": prompt, "input": {"spans": names}, "external_id": otel_id,
        "feedback": {"score": 0.25}, "metadata": {"spans": bodies.len()},
    }))
    .unwrap();
    OtlpRemap::Mapped(Box::new(
        t.validate(TraceLimits { max_field_bytes: 1024, max_trace_bytes: 4096 }, "default").unwrap(),
    ))
}

async fn otlp_spans_merge_into_one_pending_trace(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let remap = |bodies: &[&[u8]]| {
        calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        fake_remap("p", "t1", bodies)
    };
    let calls_so_far = || calls.load(std::sync::atomic::Ordering::SeqCst);

    // A part that does not map yet is held, not a trace.
    let held = s.merge_otlp_spans("t1", &[otlp_span("tool")], &remap).await.unwrap();
    assert_eq!(held, OtlpMerge::Held { added: 1, reason: "no root yet".into() });
    assert!(s.list_traces(&TraceFilter::default(), 10).await.unwrap().is_empty());

    // The next part completes it; the held span is in the union, stored first, and a
    // span repeated within the call counts once.
    let created =
        s.merge_otlp_spans("t1", &[otlp_span("tool"), otlp_span("root"), otlp_span("root")], &remap).await.unwrap();
    let OtlpMerge::Created { trace: id, added: 1 } = created else { panic!("{created:?}") };
    let t = s.get_trace(id).await.unwrap().unwrap();
    assert_eq!(t.input, json!({"spans": ["tool", "root"]}));
    assert_eq!((t.external_id.as_deref(), t.status), (Some("t1"), TraceStatus::Pending));

    // Everything again, in another grouping: nothing to do, the mapping is not even asked.
    let before = calls_so_far();
    let again = s.merge_otlp_spans("t1", &[otlp_span("root"), otlp_span("tool")], &remap).await.unwrap();
    assert_eq!(again, OtlpMerge::Duplicate);
    assert_eq!(calls_so_far(), before);

    // A later part re-maps the union into the same trace; feedback given
    // through the API in between survives where the spans say nothing.
    s.add_feedback(id, Feedback { comment: Some("from a human".into()), ..Default::default() }).await.unwrap();
    let extended = s.merge_otlp_spans("t1", &[otlp_span("chat"), otlp_span("root")], &remap).await.unwrap();
    assert_eq!(extended, OtlpMerge::Extended { trace: id, added: 1 });
    let t = s.get_trace(id).await.unwrap().unwrap();
    assert_eq!(t.input, json!({"spans": ["tool", "root", "chat"]}));
    assert_eq!((t.feedback.score, t.feedback.comment.as_deref()), (Some(0.25), Some("from a human")));
    assert_eq!(t.metadata, json!({"spans": 3}));

    // A part that makes the trace invalid is rejected and leaves nothing behind.
    let rejected = s.merge_otlp_spans("t1", &[otlp_span("bad")], &remap).await.unwrap();
    assert_eq!(rejected, OtlpMerge::Rejected { spans: 1, reason: "a bad span".into() });
    let before = calls_so_far();
    assert!(matches!(s.merge_otlp_spans("t1", &[otlp_span("bad")], &remap).await.unwrap(), OtlpMerge::Rejected { .. }));
    assert_eq!(calls_so_far(), before + 1, "the rejected span was not stored, so it is new again");

    // Unknown prompts and versions are rejected with the reason the API gives.
    let ghost = s.merge_otlp_spans("t2", &[otlp_span("root")], &|b: &[&[u8]]| fake_remap("ghost", "t2", b)).await;
    assert!(
        matches!(ghost.unwrap(), OtlpMerge::Rejected { spans: 1, reason } if reason.contains("unknown prompt \"ghost\""))
    );

    // Once a round took the trace, new spans are not added; known ones are still duplicates.
    let round = OpenRound { batch: 10, seed: 1, ..open_req("p") };
    let round = s.open_round(&round).await.unwrap().expect("a round opens");
    assert_eq!(s.round_trace_ids(round.id).await.unwrap(), vec![id]);
    let closed = s.merge_otlp_spans("t1", &[otlp_span("late"), otlp_span("chat")], &remap).await.unwrap();
    assert_eq!(closed, OtlpMerge::Closed { trace: id, spans: 1 });
    assert_eq!(s.merge_otlp_spans("t1", &[otlp_span("chat")], &remap).await.unwrap(), OtlpMerge::Duplicate);
    assert_eq!(s.get_trace(id).await.unwrap().unwrap().input, json!({"spans": ["tool", "root", "chat"]}));

    // Held spans are forgotten after the retention; spans of a trace are not.
    s.merge_otlp_spans("t3", &[otlp_span("tool"), otlp_span("chat")], &remap).await.unwrap();
    assert_eq!(s.purge_held_otlp_spans(chrono::Utc::now() - chrono::Duration::hours(1)).await.unwrap(), 0);
    assert_eq!(s.purge_held_otlp_spans(chrono::Utc::now() + chrono::Duration::seconds(1)).await.unwrap(), 2);
    assert_eq!(s.merge_otlp_spans("t1", &[otlp_span("root")], &remap).await.unwrap(), OtlpMerge::Duplicate);
}

async fn concurrent_otlp_parts_make_one_trace(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    // Two exports of the same new trace id at once, each mappable on its own:
    // one creates the trace, the other extends it (never two traces).
    for round in 0..5 {
        let otel = format!("c{round}");
        let (a, b) = {
            let (s1, s2) = (s.clone(), s.clone());
            let (o1, o2) = (otel.clone(), otel.clone());
            tokio::join!(
                tokio::spawn(async move {
                    s1.merge_otlp_spans(&o1, &[otlp_span("root"), otlp_span("a")], &|b: &[&[u8]]| {
                        fake_remap("p", &o1, b)
                    })
                    .await
                }),
                tokio::spawn(async move {
                    s2.merge_otlp_spans(&o2, &[otlp_span("root"), otlp_span("b")], &|b: &[&[u8]]| {
                        fake_remap("p", &o2, b)
                    })
                    .await
                }),
            )
        };
        let mut outcomes = [a.unwrap().unwrap(), b.unwrap().unwrap()];
        outcomes.sort_by_key(|o| matches!(o, OtlpMerge::Extended { .. }));
        let OtlpMerge::Created { trace, added: 2 } = outcomes[0] else { panic!("{outcomes:?}") };
        assert_eq!(outcomes[1], OtlpMerge::Extended { trace, added: 1 });
        let t = s.get_trace(trace).await.unwrap().unwrap();
        assert_eq!(t.input["spans"].as_array().unwrap().len(), 3, "{}", t.input);
    }
    assert_eq!(s.list_traces(&TraceFilter::default(), 100).await.unwrap().len(), 5);
}

fn idem<'a>(owner: uuid::Uuid, key: &'a str, hash: &'a str) -> IdempotencyKey<'a> {
    IdempotencyKey { owner, key, request_hash: hash }
}

async fn pending_count(s: &DynStore) -> usize {
    s.list_traces(&TraceFilter::default(), 1000).await.unwrap().len()
}

async fn idempotent_ingest_commits_traces_and_key_together(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let owner = uuid::Uuid::now_v7();
    let batch = [trace("p", None), trace("p", Some(1))];
    let IdempotentIngest::Stored { ids } = s.insert_traces_idempotent(idem(owner, "k", "h1"), &batch).await.unwrap()
    else {
        panic!("first sighting stores")
    };
    assert_eq!(ids.len(), 2);
    assert_eq!(pending_count(&s).await, 2, "the ids named are the traces stored");
    // The same request again: the first request's traces, nothing stored.
    assert_eq!(
        s.insert_traces_idempotent(idem(owner, "k", "h1"), &batch).await.unwrap(),
        IdempotentIngest::Replay { ids: ids.clone() }
    );
    assert_eq!(s.insert_traces_idempotent(idem(owner, "k", "h2"), &batch).await.unwrap(), IdempotentIngest::Mismatch);
    assert_eq!(pending_count(&s).await, 2);
    // Keys are per owner.
    let other = s.insert_traces_idempotent(idem(uuid::Uuid::now_v7(), "k", "h2"), &batch).await.unwrap();
    assert!(matches!(other, IdempotentIngest::Stored { .. }));
    assert_eq!(pending_count(&s).await, 4);

    // A failure inside the transaction (the second trace names an unknown
    // prompt) stores no trace and does not remember the key: a retry runs anew.
    let bad = [trace("p", None), trace("ghost", None)];
    let err = s.insert_traces_idempotent(idem(owner, "j", "h"), &bad).await.unwrap_err();
    assert!(matches!(err, StoreError::Invalid(ref m) if m.contains("traces[1]")), "{err:?}");
    assert_eq!(pending_count(&s).await, 4, "nothing of the failed batch is stored");
    make_prompt(&s, "ghost").await;
    let retried = s.insert_traces_idempotent(idem(owner, "j", "h"), &bad).await.unwrap();
    assert!(matches!(retried, IdempotentIngest::Stored { ref ids, .. } if ids.len() == 2), "{retried:?}");
    assert_eq!(pending_count(&s).await, 6);

    let purged = s.idempotency_purge(chrono::Utc::now() + chrono::Duration::seconds(5)).await.unwrap();
    assert_eq!(purged, 3);
}

async fn concurrent_idempotent_ingests_store_once(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let owner = uuid::Uuid::now_v7();
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move {
                let batch = [trace("p", None), trace("p", None), trace("p", None)];
                s.insert_traces_idempotent(idem(owner, "same", "h"), &batch).await.unwrap()
            })
        })
        .collect();
    let (mut stored, mut replays) = (None, Vec::new());
    for t in tasks {
        match t.await.unwrap() {
            IdempotentIngest::Stored { ids } => {
                assert!(stored.replace(ids).is_none(), "stored twice");
            }
            IdempotentIngest::Replay { ids } => replays.push(ids),
            other => panic!("unexpected {other:?}"),
        }
    }
    let stored = stored.expect("one request stored the batch");
    assert!(replays.iter().all(|r| *r == stored), "every other request is told the first one's traces");
    assert_eq!(pending_count(&s).await, 3);
}

async fn key_generation_grows_with_every_revocation(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    let start = s.api_key_generation().await.unwrap();
    let key = s.create_api_key("k", "cmb_gen00001", "hash-gen", &[Scope::PromptsRead], None).await.unwrap();
    assert_eq!(s.api_key_generation().await.unwrap(), start, "a new key invalidates nothing");
    assert!(s.revoke_api_key(&key.prefix).await.unwrap());
    let after = s.api_key_generation().await.unwrap();
    assert!(after > start, "a revocation bumps the generation ({start} → {after})");
    // Read on a second connection to the same database, as another process would.
    let other = combee::store::connect(&ts.url, 2, std::time::Duration::from_secs(5)).await.unwrap();
    assert_eq!(other.api_key_generation().await.unwrap(), after);
    // A revocation by that other store is seen here at the next read, however
    // often the unchanged generation was read before.
    let second = s.create_api_key("k2", "cmb_gen00002", "hash-gen-2", &[Scope::PromptsRead], None).await.unwrap();
    for _ in 0..3 {
        assert_eq!(s.api_key_generation().await.unwrap(), after);
    }
    assert!(other.revoke_api_key(&second.prefix).await.unwrap());
    assert!(s.api_key_generation().await.unwrap() > after, "another connection's revocation is seen at once");
}

/// Two processes may share one store (the embedded file included): each
/// write waits its turn for the other's commits, however they interleave, and
/// none is refused as busy. Here one store writes traces, late feedback and
/// versions while a second, opened on the same database as another process
/// would, writes versions and traces of its own.
async fn two_processes_write_one_store_and_none_is_refused(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let other = combee::store::connect(&ts.url, 2, std::time::Duration::from_secs(10)).await.unwrap();
    const ROUNDS: usize = 60;
    let here = tokio::spawn({
        let s = s.clone();
        async move {
            for i in 0..ROUNDS {
                let ids = s.insert_traces(&[trace("p", None), trace("p", Some(1))]).await.unwrap();
                let feedback = Feedback { score: Some(0.5), ..Default::default() };
                assert!(s.add_feedback(ids[0], feedback).await.unwrap().is_some());
                s.create_version(&name("p"), version(&format!("here {i}")), &[]).await.unwrap();
            }
        }
    });
    let there = tokio::spawn({
        let other = other.clone();
        async move {
            for i in 0..ROUNDS {
                other.create_version(&name("p"), version(&format!("there {i}")), &[]).await.unwrap();
                other.insert_traces(&[trace("p", None)]).await.unwrap();
            }
        }
    });
    here.await.expect("this process's writes");
    there.await.expect("the other process's writes");
    let latest = s.resolve(&name("p"), &Selector::Latest).await.unwrap().unwrap();
    assert_eq!(latest.version.number, 1 + 2 * ROUNDS as i64);
    assert_eq!(pending_count(&s).await, 3 * ROUNDS);
}

/// A schema change that locks two tables gives way to the writes of a
/// release still serving instead of deadlocking with them. Here the database
/// lacks the change that drops the foreign key from `traces` to `prompts`
/// (which locks both tables): a transaction of the serving release reads
/// `prompts`, a new process starts and migrates, another write of the serving
/// release comes, and the transaction then writes `traces`. All succeed; with
/// the migration waiting on `prompts` while holding `traces`, the other write
/// waited for the reading transaction, and the two transactions deadlocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_gives_way_to_the_serving_releases_writes() {
    use sqlx::Connection;
    let ts = test_store(Backend::Postgres).await;
    let mut setup = sqlx::PgConnection::connect(&ts.url).await.unwrap();
    sqlx::raw_sql(
        "ALTER TABLE traces ADD CONSTRAINT traces_prompt_id_fkey FOREIGN KEY (prompt_id) REFERENCES prompts (id);
         DELETE FROM _sqlx_migrations WHERE version = 46;",
    )
    .execute(&mut setup)
    .await
    .unwrap();
    let mut serving = sqlx::PgConnection::connect(&ts.url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT count(*) FROM prompts;").execute(&mut serving).await.unwrap();
    let mut writer = sqlx::PgConnection::connect(&ts.url).await.unwrap();
    let starting = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        combee::store::connect(&ts.url, 2, std::time::Duration::from_secs(10)),
    );
    let serve = async {
        // Until the migration waits for a lock (or gave way already and waits to try again).
        let waiting =
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%DROP CONSTRAINT%'";
        for _ in 0..300 {
            if sqlx::query_scalar::<_, i64>(waiting).fetch_one(&mut setup).await.unwrap() > 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // A write of the serving release beside them waits out the
        // migration's short lock wait, not the transaction reading `prompts`
        // (here it would wait for good: that transaction goes on after it).
        sqlx::raw_sql("SET lock_timeout = '3s'; BEGIN; LOCK TABLE traces IN ROW EXCLUSIVE MODE; COMMIT;")
            .execute(&mut writer)
            .await
            .expect("a write beside the migration");
        sqlx::raw_sql("LOCK TABLE traces IN ROW EXCLUSIVE MODE")
            .execute(&mut serving)
            .await
            .expect("the serving write");
        sqlx::raw_sql("COMMIT").execute(&mut serving).await.unwrap();
    };
    let (started, ()) = tokio::join!(starting, serve);
    started.expect("start-up ends").expect("the new process migrates");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_constraint WHERE conname = 'traces_prompt_id_fkey'")
        .fetch_one(&mut setup)
        .await
        .unwrap();
    assert_eq!(left, 0, "the migration ran");
}

async fn failed_traces_can_be_requeued(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    make_prompt(&s, "q").await;
    s.insert_traces(&[trace("p", None), trace("p", None), trace("p", None)]).await.unwrap();
    s.insert_traces(&[trace("q", None)]).await.unwrap();
    let failed = common::fail_pending_traces(&s, "p").await;
    let q_failed = common::fail_pending_traces(&s, "q").await;
    let t = s.get_trace(failed[0]).await.unwrap().unwrap();
    assert_eq!((t.status, t.attempts, t.failure_reason.is_some()), (TraceStatus::Failed, 1, true));
    let later = s.insert_traces(&[trace("p", None)]).await.unwrap(); // pending: never touched

    let only = |ids: Vec<uuid::Uuid>| RequeueFailed { prompt: name("p"), ids: Some(ids), since: None };
    // One by id; an id of a pending trace or of another prompt's trace is skipped.
    let one = s.requeue_failed_traces(&only(vec![failed[1], later[0], q_failed[0]])).await.unwrap();
    assert_eq!(one, vec![failed[1]]);
    let t = s.get_trace(failed[1]).await.unwrap().unwrap();
    assert_eq!((t.status, t.attempts, t.failure_reason, t.round_id), (TraceStatus::Pending, 0, None, None));
    assert_eq!(s.get_trace(q_failed[0]).await.unwrap().unwrap().status, TraceStatus::Failed);
    // `since` in the future matches nothing; then all the rest.
    let future = Some(chrono::Utc::now() + chrono::Duration::hours(1));
    let none = RequeueFailed { prompt: name("p"), ids: None, since: future };
    assert!(s.requeue_failed_traces(&none).await.unwrap().is_empty());
    let all = RequeueFailed { prompt: name("p"), ids: None, since: None };
    let mut rest = vec![failed[0], failed[2]];
    rest.sort();
    assert_eq!(s.requeue_failed_traces(&all).await.unwrap(), rest);
    assert!(s.requeue_failed_traces(&all).await.unwrap().is_empty(), "nothing failed is left");
    // Requeued traces are learnable again: a new round takes them.
    let backlog = s.backlogs().await.unwrap().into_iter().find(|b| b.prompt.name.as_str() == "p").unwrap();
    assert_eq!(backlog.pending, 4);
    let ghost = RequeueFailed { prompt: name("ghost"), ids: None, since: None };
    assert!(matches!(s.requeue_failed_traces(&ghost).await, Err(StoreError::NotFound)));
}

async fn api_keys_are_stored_hashed_and_revocable(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    let key = s
        .create_api_key("agent", "cmb_abcdefgh", "hash1", &[Scope::TracesWrite, Scope::PromptsRead], None)
        .await
        .unwrap();
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
    let key = s.create_api_key("ops", "cmb_opsopsop", "keyhash", &[Scope::PromptsRead], None).await.unwrap();
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
    write_until_announced(&s, &mut rx).await;
}

/// Writes prompts until one write is announced, within 10 s. On Postgres the
/// listener may still be connecting when a test starts: a write before LISTEN
/// is covered by the resync it then sends, not announced.
async fn write_until_announced(s: &DynStore, rx: &mut tokio::sync::broadcast::Receiver<Change>) {
    let mut written = 0;
    eventually("an announced write", std::time::Duration::from_secs(10), async || {
        let name = format!("probe{written}");
        written += 1;
        make_prompt(s, &name).await;
        let wait = tokio::time::Instant::now() + std::time::Duration::from_millis(500);
        while let Ok(change) = tokio::time::timeout_at(wait, rx.recv()).await {
            if matches!(change.unwrap(), Change::Prompt(n) if n == name) {
                return Ok(());
            }
        }
        Err(format!("{written} writes, none announced"))
    })
    .await
}

async fn list_prompts_pages_by_name_with_summaries(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    for n in ["c", "a", "b"] {
        make_prompt(&s, n).await;
    }
    s.insert_traces(&[trace("a", None), trace("a", None)]).await.unwrap();
    let page = s.list_prompts(None, None, 2).await.unwrap();
    assert_eq!(page.iter().map(|p| p.prompt.name.as_str()).collect::<Vec<_>>(), vec!["a", "b"]);
    assert_eq!((page[0].pending_traces, page[0].production_version, page[0].latest_version), (2, Some(1), 1));
    let rest = s.list_prompts(Some(&name("b")), None, 2).await.unwrap();
    assert_eq!(rest.len(), 1);
    // The same pages without the counts, for the periodic jobs.
    let bare = s.prompts_page(None, 2).await.unwrap();
    assert_eq!(bare.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), vec!["a", "b"]);
    assert_eq!(bare[0], page[0].prompt);
    let rest = s.prompts_page(Some(&name("b")), 2).await.unwrap();
    assert_eq!(rest.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), vec!["c"]);
}

/// Projects on the store: `default` exists from the migration; a prompt,
/// trace and round answer which project they belong to; prompt, trace,
/// webhook and audit lists filter by project; a project's webhook is told
/// only of its project's events, a server-wide one of all.
/// Two projects each hold a prompt `support-agent`: every row hangs off its
/// own (versions, labels, traces, rounds, budget caps, events), and the
/// lists page through both (by name, then project).
async fn two_projects_prompts_of_one_name_keep_apart(b: Backend) {
    use combee::domain::{budget::BudgetCaps, project::ProjectSettings};
    let ts = test_store(b).await;
    let s = ts.store.clone();
    s.create_project("team-a", &ProjectSettings::default()).await.unwrap();
    let (mine, theirs) = (name("support-agent"), name("team-a/support-agent"));
    assert_ne!(mine, theirs);
    for (n, base) in [(&mine, "Default's."), (&theirs, "Team A's.")] {
        let p = NewPrompt {
            name: n.clone(),
            strategy: Strategy::Playbook,
            promotion: Promotion::Auto,
            settings: PromptSettings::default(),
            created_by: "test".into(),
        };
        let (made, _) = s.create_prompt(p, version(base)).await.unwrap();
        assert_eq!(made.project, n.project());
    }
    let again = NewPrompt {
        name: theirs.clone(),
        strategy: Strategy::Playbook,
        promotion: Promotion::Auto,
        settings: PromptSettings::default(),
        created_by: "test".into(),
    };
    assert!(matches!(s.create_prompt(again, version("x")).await, Err(StoreError::AlreadyExists)), "unique per project");
    s.create_version(&theirs, version("Team A's, learned."), &[]).await.unwrap();
    let latest = |n: &PromptName| {
        let (s, n) = (s.clone(), n.clone());
        async move { s.resolve(&n, &Selector::Latest).await.unwrap().unwrap().version }
    };
    assert_eq!((latest(&mine).await.number, latest(&theirs).await.number), (1, 2));
    assert_eq!(latest(&mine).await.content.base, "Default's.");
    assert_eq!(latest(&theirs).await.prompt, theirs);
    s.move_label(
        &mine,
        &LabelMove {
            label: LabelName::parse("staging").unwrap(),
            to_version: 1,
            expected_current: None,
            check_current: false,
            by: "t".into(),
        },
    )
    .await
    .unwrap();
    assert_eq!(s.list_labels(&mine).await.unwrap().len(), 2);
    assert_eq!(s.list_labels(&theirs).await.unwrap().len(), 1);

    let ids = s.insert_traces(&[trace("team-a/support-agent", Some(2)), trace("support-agent", None)]).await.unwrap();
    // Version 2 is team-a's only.
    assert!(matches!(s.insert_traces(&[trace("support-agent", Some(2))]).await, Err(StoreError::Invalid(_))));
    let of = |n: &PromptName| TraceFilter { prompt: Some(n.clone()), ..Default::default() };
    assert_eq!(s.list_traces(&of(&theirs), 10).await.unwrap().iter().map(|t| t.id).collect::<Vec<_>>(), [ids[0]]);
    let listed = s.list_traces(&of(&mine), 10).await.unwrap();
    assert_eq!((listed.len(), &listed[0].prompt), (1, &mine));
    let round = s.open_round(&OpenRound { batch: 10, ..open_req("team-a/support-agent") }).await.unwrap().unwrap();
    assert_eq!(round.prompt, theirs);
    assert_eq!(s.round_trace_ids(round.id).await.unwrap(), [ids[0]]);
    assert!(s.list_rounds(Some(&mine), None, 10).await.unwrap().is_empty());

    // Pages of one prompt each walk both, the same name in project order.
    let first = s.list_prompts(None, None, 1).await.unwrap();
    let second = s.list_prompts(Some(&first[0].prompt.name), None, 1).await.unwrap();
    assert_eq!((&first[0].prompt.name, &second[0].prompt.name), (&mine, &theirs));
    assert_eq!((first[0].pending_traces, second[0].pending_traces), (1, 1), "one trace each");
    let bare = s.prompts_page(Some(&mine), 10).await.unwrap();
    assert_eq!(bare.iter().map(|p| &p.name).collect::<Vec<_>>(), [&theirs]);
    assert_eq!(s.projects_holding("support-agent").await.unwrap(), ["default", "team-a"]);

    // The budget names a prompt by its key: the bare name in `default`, `project/name` elsewhere.
    let caps = BudgetCaps { tokens_per_day: Some(10), ..Default::default() };
    s.set_prompt_caps(&theirs.qualified(), &caps, chrono::Utc::now().date_naive(), false).await.unwrap();
    assert_eq!(s.prompt_caps("team-a/support-agent").await.unwrap(), caps);
    assert_eq!(s.prompt_caps("support-agent").await.unwrap(), BudgetCaps::default());
}

async fn projects_scope_lookups_lists_and_event_fan_out(b: Backend) {
    use combee::{
        domain::{
            audit::{Actor, AuditQuery, NewAuditEntry, RequestOrigin},
            event::EventType,
            project::ProjectSettings,
            webhook::NewWebhook,
        },
        secret::Secret,
    };
    let ts = test_store(b).await;
    let s = ts.store.clone();
    assert_eq!(s.list_projects().await.unwrap().iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["default"]);
    s.create_project("team-a", &ProjectSettings::default()).await.unwrap();
    assert!(matches!(s.create_project("team-a", &ProjectSettings::default()).await, Err(StoreError::AlreadyExists)));
    let defaults = ProjectSettings {
        prompt_defaults: json!({"max_wait_secs": 60}).as_object().unwrap().clone(),
        ..Default::default()
    };
    let updated = s.update_project_settings("team-a", &defaults).await.unwrap().unwrap();
    assert_eq!(s.get_project("team-a").await.unwrap().unwrap(), updated);
    assert!(s.update_project_settings("nope", &defaults).await.unwrap().is_none());

    make_prompt(&s, "in-default").await;
    let a = NewPrompt {
        name: name("team-a/in-a"),
        strategy: Strategy::Playbook,
        promotion: Promotion::Auto,
        settings: PromptSettings::default(),
        created_by: "test".into(),
    };
    // Server-wide and project webhooks, before the events.
    let hook = |project: Option<&str>| NewWebhook {
        url: "http://127.0.0.1:9/h".into(),
        project: project.map(str::to_owned),
        events: vec![EventType::VersionCreated],
        description: None,
        secret: Secret::new("whsec_x".to_owned()),
    };
    let everyone = s.create_webhook(&hook(None)).await.unwrap();
    let only_a = s.create_webhook(&hook(Some("team-a"))).await.unwrap();
    let only_default = s.create_webhook(&hook(Some("default"))).await.unwrap();
    assert_eq!(only_a.project.as_deref(), Some("team-a"));
    let (created, _) = s.create_prompt(a, version("v1")).await.unwrap();
    assert_eq!(created.project, "team-a");
    assert_eq!(s.get_prompt(&name("team-a/in-a")).await.unwrap().unwrap().project, "team-a");
    assert!(s.get_prompt(&name("in-a")).await.unwrap().is_none(), "a bare name is `default`'s");
    assert_eq!(s.projects_holding("in-a").await.unwrap(), ["team-a"]);
    assert!(s.projects_holding("absent").await.unwrap().is_empty());

    let ids = s.insert_traces(&[trace("team-a/in-a", None), trace("in-default", None)]).await.unwrap();
    assert_eq!(s.trace_project(ids[0]).await.unwrap().as_deref(), Some("team-a"));
    assert_eq!(s.trace_project(ids[1]).await.unwrap().as_deref(), Some("default"));
    assert_eq!(s.trace_project(uuid::Uuid::now_v7()).await.unwrap(), None);
    let filter = TraceFilter { project: Some("team-a".into()), ..Default::default() };
    let listed = s.list_traces(&filter, 10).await.unwrap();
    assert_eq!(listed.iter().map(|t| t.id).collect::<Vec<_>>(), [ids[0]]);
    let page = s.list_prompts(None, Some("team-a"), 10).await.unwrap();
    assert_eq!(page.iter().map(|p| p.prompt.name.as_str()).collect::<Vec<_>>(), ["in-a"]);
    assert_eq!(s.list_prompts(None, None, 10).await.unwrap().len(), 2);
    assert!(s.list_prompts(None, Some("nope"), 10).await.unwrap().is_empty());

    let req = OpenRound { batch: 10, seed: 1, ..open_req("team-a/in-a") };
    let round = s.open_round(&req).await.unwrap().expect("a round opens");
    assert_eq!(s.round_project(round.id).await.unwrap().as_deref(), Some("team-a"));

    // Version 1 of `in-a` announced itself: to the server-wide and team-a subscriptions, not to default's.
    let claimed = s.claim_deliveries("w", std::time::Duration::from_secs(30), 100).await.unwrap();
    let to = |id: uuid::Uuid| claimed.iter().filter(|d| d.subscription_id == id && d.body.contains("in-a")).count();
    assert_eq!((to(everyone.id), to(only_a.id), to(only_default.id)), (1, 1, 0));
    assert_eq!(s.list_webhooks(Some("team-a")).await.unwrap(), [only_a]);
    assert_eq!(s.list_webhooks(None).await.unwrap().len(), 3);

    let entry = |project: Option<&str>| {
        NewAuditEntry::new(Actor::System, RequestOrigin::default(), "x.y", None, None, None, None)
            .in_project(project.map(str::to_owned))
    };
    s.append_audit(&entry(Some("team-a"))).await.unwrap();
    s.append_audit(&entry(None)).await.unwrap();
    let q = AuditQuery { project: Some("team-a".into()), ..Default::default() };
    let mine = s.audit_entries(&q, 10).await.unwrap();
    assert_eq!(mine.iter().map(|e| e.project.as_deref()).collect::<Vec<_>>(), [Some("team-a")]);
    assert_eq!(s.audit_entries(&AuditQuery::default(), 10).await.unwrap().len(), 2);

    let key = s.create_api_key("a", "cmb_projkey1", "hash-proj", &[Scope::PromptsRead], Some("team-a")).await.unwrap();
    assert_eq!(s.api_key_by_hash("hash-proj").await.unwrap().unwrap().project.as_deref(), Some("team-a"));
    assert_eq!(key.reach(), combee::domain::access::Reach::Project("team-a".into()));
}

/// The outbox commits with its change (a failed CAS writes no event), fans out
/// only to matching subscriptions, and deliveries are leased and fenced.
async fn outbox_events_commit_with_their_change_and_deliveries_are_leased(b: Backend) {
    use combee::{
        domain::event::EventType,
        store::{AttemptRecord, DeliveryOutcome},
    };
    use std::time::Duration;
    let ts = test_store(b).await;
    let s = ts.store.clone();
    let mut rx = s.changes();
    // A wake-up is only announced once the Postgres listener is LISTENing:
    // wait for that, with writes that make no delivery (no subscription exists yet).
    write_until_announced(&s, &mut rx).await;
    let sub = subscribe(&s, EventType::LabelMoved).await;
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
    assert!(s.list_webhooks(None).await.unwrap().is_empty());
}

fn reflection(insight: &str) -> combee::domain::Reflection {
    serde_json::from_value(json!({"error": "", "root_cause": "", "correct_approach": "", "key_insight": insight,
                                  "bullet_tags": []}))
    .unwrap()
}

async fn open_and_claim(s: &DynStore, prompt: &str) -> combee::store::ClaimedRound {
    let req = OpenRound { seed: 1, ..open_req(prompt) };
    s.open_round(&req).await.unwrap().expect("a round opens");
    s.claim_round("w", std::time::Duration::from_secs(60)).await.unwrap().expect("a round to claim")
}

/// Only a trace's own failure costs it an attempt; a trace without a reflection is
/// never consumed; a re-run over the same base version adopts earlier reflections.
async fn rounds_charge_traces_only_for_their_own_failures(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "acct").await;
    let ids = s.insert_traces(&[trace("acct", None), trace("acct", None), trace("acct", None)]).await.unwrap();
    let (t1, t2, t3) = (ids[0], ids[1], ids[2]);

    // Round A: t1 and t2 reflected, t3's reflection rejected; the round fails elsewhere.
    let a = open_and_claim(&s, "acct").await;
    for t in [t1, t2] {
        s.save_reflection(a.round.id, t, &reflection(&format!("lesson {t}")), false).await.unwrap();
    }
    let charges = TraceCharges {
        faults: vec![TraceFault { trace_id: t3, reason: "reflection failed: too long".into() }],
        max_trace_attempts: 2,
    };
    s.fail_round(a.round.id, a.round.attempt, "group 2 failed", RoundFailure::GiveUp { charges }).await.unwrap();
    for (t, attempts) in [(t1, 0), (t2, 0), (t3, 1)] {
        let got = s.get_trace(t).await.unwrap().unwrap();
        assert_eq!((got.status, got.attempts, got.round_id), (TraceStatus::Pending, attempts, None), "{t}");
    }
    assert_eq!(s.get_trace(t3).await.unwrap().unwrap().failure_reason.as_deref(), Some("reflection failed: too long"));

    // Round B, same base: t1 and t2 are adopted; t3 must be reflected again.
    let b_round = open_and_claim(&s, "acct").await;
    assert_eq!(b_round.round.base_version, a.round.base_version);
    assert_eq!(s.adopt_reflections(b_round.round.id).await.unwrap(), 2);
    assert_eq!(s.adopt_reflections(b_round.round.id).await.unwrap(), 0, "adopting twice copies nothing");
    let mut adopted: Vec<_> = s.round_reflections(b_round.round.id).await.unwrap().into_iter().map(|r| r.0).collect();
    adopted.sort();
    let mut want = vec![t1, t2];
    want.sort();
    assert_eq!(adopted, want);

    // B publishes with t3 failing its reflection again: t1, t2 consumed; t3 spent its budget.
    let charges = TraceCharges {
        faults: vec![TraceFault { trace_id: t3, reason: "reflection failed: again".into() }],
        max_trace_attempts: 2,
    };
    let mut v = version("learned");
    v.source = VersionSource::Learned;
    v.parent = Some(1);
    s.finish_round(&RoundEnd { charges, ..published(&b_round, v, LabelName::production()) }).await.unwrap();
    for (t, status, attempts) in
        [(t1, TraceStatus::Consumed, 0), (t2, TraceStatus::Consumed, 0), (t3, TraceStatus::Failed, 2)]
    {
        let got = s.get_trace(t).await.unwrap().unwrap();
        assert_eq!((got.status, got.attempts), (status, attempts), "{t}");
    }

    // A trace with no reflection and no fault is not consumed either: it returns to the backlog.
    let t4 = s.insert_traces(&[trace("acct", None)]).await.unwrap()[0];
    let c = open_and_claim(&s, "acct").await;
    assert_ne!(c.round.base_version, a.round.base_version, "production moved to the learned version");
    assert_eq!(s.adopt_reflections(c.round.id).await.unwrap(), 0);
    s.finish_round(&published(&c, version("again"), LabelName::production())).await.unwrap();
    let got = s.get_trace(t4).await.unwrap().unwrap();
    assert_eq!((got.status, got.attempts, got.round_id), (TraceStatus::Pending, 0, None));
}

async fn quarantined_traces_are_never_reserved_and_delete_keeps_provenance(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let mut ids = Vec::new();
    for _ in 0..4 {
        // One at a time, so each has its own arrival time for the bulk window below.
        ids.push(s.insert_traces(&[trace("p", Some(1))]).await.unwrap()[0]);
    }
    // One quarantined by id (twice: idempotent), the oldest two in bulk by time window.
    let TraceAction::Done(t) = s.quarantine_trace(ids[3], "looks hostile").await.unwrap() else { panic!() };
    assert_eq!((t.status, t.quarantine_reason.as_deref()), (TraceStatus::Quarantined, Some("looks hostile")));
    let first_at = t.quarantined_at.unwrap();
    let TraceAction::Done(t) = s.quarantine_trace(ids[3], "again").await.unwrap() else { panic!() };
    assert_eq!((t.quarantined_at, t.quarantine_reason.as_deref()), (Some(first_at), Some("looks hostile")));
    let t2 = s.get_trace(ids[2]).await.unwrap().unwrap();
    let window = TraceFilter { prompt: Some(name("p")), until: Some(t2.created_at), ..Default::default() };
    let n = s.quarantine_traces(&window, "bulk").await.unwrap();
    assert_eq!(n, 2, "the traces received before the third one");
    let quarantined = TraceFilter { status: Some(TraceStatus::Quarantined), ..Default::default() };
    let listed = s.list_traces(&quarantined, 10).await.unwrap();
    assert_eq!(listed.len() as u64, n + 1);
    assert!(listed.iter().all(|t| t.status == TraceStatus::Quarantined));
    let pending = TraceFilter { status: Some(TraceStatus::Pending), ..Default::default() };
    assert_eq!(s.list_traces(&pending, 10).await.unwrap().len() as u64, 3 - n);
    // Quarantine everything left, then add one more: a round reserves only the new one.
    s.quarantine_traces(&TraceFilter { prompt: Some(name("p")), ..Default::default() }, "all").await.unwrap();
    let backlog = s.backlogs().await.unwrap();
    assert_eq!(backlog.iter().find(|b| b.prompt.name.as_str() == "p").map(|b| b.pending), Some(0));
    let fresh = s.insert_traces(&[trace("p", Some(1))]).await.unwrap()[0];
    let open = OpenRound { seed: 1, ..open_req("p") };
    let round = s.open_round(&open).await.unwrap().expect("a round over the fresh trace");
    assert_eq!(s.round_trace_ids(round.id).await.unwrap(), vec![fresh]);
    // The reserved trace can be neither quarantined nor deleted while the round is in flight.
    assert!(
        matches!(s.quarantine_trace(fresh, "x").await.unwrap(), TraceAction::Refused(why) if why.contains("in flight"))
    );
    assert!(matches!(s.delete_trace(fresh).await.unwrap(), TraceAction::Refused(_)));
    // A released trace is pending again and counts in the backlog; releasing
    // twice (or a trace never quarantined) changes nothing.
    let TraceAction::Done(t) = s.release_trace(ids[0]).await.unwrap() else { panic!() };
    assert_eq!((t.status, t.quarantined_at, t.quarantine_reason), (TraceStatus::Pending, None, None));
    assert!(matches!(s.release_trace(ids[0]).await.unwrap(), TraceAction::Done(t) if t.status == TraceStatus::Pending));
    let backlog = s.backlogs().await.unwrap();
    assert_eq!(backlog.iter().find(|b| b.prompt.name.as_str() == "p").map(|b| b.pending), Some(1));
    assert_eq!(s.release_trace(uuid::Uuid::now_v7()).await.unwrap(), TraceAction::NotFound);
    // A quarantined trace is deleted for good; a missing one is NotFound.
    assert!(matches!(s.delete_trace(ids[3]).await.unwrap(), TraceAction::Done(t) if t.id == ids[3]));
    assert!(s.get_trace(ids[3]).await.unwrap().is_none());
    assert_eq!(s.delete_trace(ids[3]).await.unwrap(), TraceAction::NotFound);
    assert_eq!(s.quarantine_trace(uuid::Uuid::now_v7(), "x").await.unwrap(), TraceAction::NotFound);
}

async fn prompt_settings_change_by_compare_and_set(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let before = s.get_prompt(&name("p")).await.unwrap().unwrap().settings;
    assert_eq!(before.agent_reflections, AgentReflections::Ignore, "new prompts ignore agent reflections");
    let mut after = before.clone();
    after.agent_reflections = AgentReflections::Use;
    after.pinned_bullets = vec!["b-0001".into()];
    let p = s.update_prompt_settings(&name("p"), &before, &after).await.unwrap().unwrap();
    assert_eq!(p.settings, after);
    assert_eq!(s.get_prompt(&name("p")).await.unwrap().unwrap().settings, after);
    // A writer that read the old settings loses.
    assert!(matches!(s.update_prompt_settings(&name("p"), &before, &before).await, Err(StoreError::Conflict)));
    assert!(s.update_prompt_settings(&name("nope"), &before, &after).await.unwrap().is_none());
}

/// Migration 0007: prompts that existed before it keep using agents' reflections
/// (today's behaviour); prompts created after it ignore them by default.
async fn migration_0007_keeps_existing_prompts_on_agent_reflections(b: Backend) {
    use sqlx::Connection;
    let ts = test_store(b).await;
    make_prompt(&ts.store, "old").await;
    // Back to the state before 0007: its schema changes undone, the prompt's settings as 0005 stored them.
    let undo = |json_remove: &'static str| {
        [
            "DROP INDEX traces_quarantined",
            // 0033's backlog index names the column (SQLite refuses to drop it under an index).
            "DROP INDEX traces_backlog",
            "ALTER TABLE traces DROP COLUMN quarantined_at",
            "ALTER TABLE traces DROP COLUMN quarantine_reason",
            "DELETE FROM _sqlx_migrations WHERE version = 7",
            json_remove,
        ]
    };
    match b {
        Backend::Postgres => {
            let mut c = sqlx::PgConnection::connect(&ts.url).await.unwrap();
            for sql in undo(
                "UPDATE prompts SET settings = settings - 'agent_reflections' - 'pinned_bullets' - 'max_removal_share'",
            ) {
                sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
            }
        }
        Backend::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(&ts.url).await.unwrap();
            for sql in undo(
                "UPDATE prompts SET settings = json_remove(settings, '$.agent_reflections', '$.pinned_bullets', '$.max_removal_share')",
            ) {
                sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
            }
        }
    }
    let again = combee::store::connect(&ts.url, 4, std::time::Duration::from_secs(10)).await.expect("migrate again");
    let old = again.get_prompt(&name("old")).await.unwrap().unwrap();
    assert_eq!(old.settings.agent_reflections, AgentReflections::Use);
    make_prompt(&again, "new").await;
    assert_eq!(
        again.get_prompt(&name("new")).await.unwrap().unwrap().settings.agent_reflections,
        AgentReflections::Ignore
    );
    // And the columns are back: quarantine works.
    let id = again.insert_traces(&[trace("old", Some(1))]).await.unwrap()[0];
    assert!(matches!(again.quarantine_trace(id, "x").await.unwrap(), TraceAction::Done(_)));
}

async fn migration_0030_keeps_replaying_keys_remembered_with_their_answer(b: Backend) {
    use sqlx::Connection;
    let ts = test_store(b).await;
    make_prompt(&ts.store, "p").await;
    let owner = uuid::Uuid::now_v7();
    let (a, c) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    let answer = json!({"ids": [a, c], "count": 2}).to_string();
    // Back to the state before 0030: keys kept the HTTP status and body of their answer.
    let (undo, add_old): ([&str; 4], String) = match b {
        Backend::Postgres => (
            [
                "ALTER TABLE idempotency_keys DROP COLUMN trace_ids",
                "ALTER TABLE idempotency_keys ADD COLUMN status_code integer",
                "ALTER TABLE idempotency_keys ADD COLUMN body bytea",
                "DELETE FROM _sqlx_migrations WHERE version = 30",
            ],
            format!(
                "INSERT INTO idempotency_keys (owner, key, request_hash, status_code, body) VALUES
                 ('{owner}', 'answered', 'h', 201, convert_to('{answer}', 'UTF8')),
                 ('{owner}', 'in-flight', 'h', NULL, NULL)"
            ),
        ),
        Backend::Sqlite => (
            [
                "ALTER TABLE idempotency_keys DROP COLUMN trace_ids",
                "ALTER TABLE idempotency_keys ADD COLUMN status_code INTEGER",
                "ALTER TABLE idempotency_keys ADD COLUMN body BLOB",
                "DELETE FROM _sqlx_migrations WHERE version = 30",
            ],
            format!(
                "INSERT INTO idempotency_keys (owner, key, request_hash, status_code, body, created_at) VALUES
                 ('{owner}', 'answered', 'h', 201, CAST('{answer}' AS BLOB), 0),
                 ('{owner}', 'in-flight', 'h', NULL, NULL, 0)"
            ),
        ),
    };
    match b {
        Backend::Postgres => {
            let mut conn = sqlx::PgConnection::connect(&ts.url).await.unwrap();
            for sql in undo.iter().copied().chain([add_old.as_str()]) {
                sqlx::raw_sql(sql).execute(&mut conn).await.unwrap();
            }
        }
        Backend::Sqlite => {
            let mut conn = sqlx::SqliteConnection::connect(&ts.url).await.unwrap();
            for sql in undo.iter().copied().chain([add_old.as_str()]) {
                sqlx::raw_sql(sql).execute(&mut conn).await.unwrap();
            }
        }
    }
    let again = combee::store::connect(&ts.url, 4, std::time::Duration::from_secs(10)).await.expect("migrate again");
    let batch = [trace("p", None)];
    assert_eq!(
        again.insert_traces_idempotent(idem(owner, "answered", "h"), &batch).await.unwrap(),
        IdempotentIngest::Replay { ids: vec![a, c] },
        "a key answered before the upgrade replays the ids of its answer"
    );
    let taken_over = again.insert_traces_idempotent(idem(owner, "in-flight", "h"), &batch).await.unwrap();
    assert!(matches!(taken_over, IdempotentIngest::Stored { ref ids } if ids.len() == 1), "{taken_over:?}");
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
    t.validate(TraceLimits { max_field_bytes: 1024, max_trace_bytes: 4096 }, "default").unwrap()
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
    let mut got = s.version_outcomes(&name("p"), from, until, 3600, None).await.unwrap();
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
    let got = s.version_outcomes(&name("p"), from, until, 3600, None).await.unwrap();
    let v2 = got.iter().find(|b| b.version == Some(2)).unwrap();
    assert_eq!((v2.with_feedback, v2.successes, v2.score.count, v2.score.sum), (1, 1, 1, 0.5));

    // A quarantined trace's reward is not trusted: it leaves the aggregates (until released).
    s.quarantine_trace(ids[4], "suspect").await.unwrap();
    let got = s.version_outcomes(&name("p"), from, until, 3600, None).await.unwrap();
    assert!(got.iter().all(|b| b.version.is_some()), "{got:?}");
    s.release_trace(ids[4]).await.unwrap();
    assert_eq!(s.version_outcomes(&name("p"), from, until, 3600, None).await.unwrap().len(), 3);

    // Only the versions asked for are read (0: traces that named none), from
    // the rollups and from the trace rows at the window's edges alike.
    let versions =
        |got: Vec<combee::evaluate::outcomes::OutcomeBucket>| got.iter().map(|b| b.version).collect::<Vec<_>>();
    let p = name("p");
    let only = |v: &'static [i64]| s.version_outcomes(&p, from, until, 3600, Some(v));
    assert_eq!(versions(only(&[2]).await.unwrap()), vec![Some(2)]);
    let mut got = only(&[0, 1, 7]).await.unwrap();
    got.sort_by_key(|b| b.version);
    assert_eq!(versions(got.clone()), vec![None, Some(1)]);
    assert_eq!((got[1].traces, got[1].successes, got[0].traces), (3, 1, 1), "the same sums as unfiltered");
    assert!(only(&[]).await.unwrap().is_empty());
    let edge = s.version_outcomes(&p, from, chrono::Utc::now(), 60, Some(&[1])).await.unwrap();
    assert_eq!(edge.iter().map(|b| b.traces).sum::<u64>(), 3, "{edge:?}");

    // The window is half-open and per prompt.
    assert!(
        s.version_outcomes(&name("p"), until, until + chrono::Duration::hours(1), 60, None).await.unwrap().is_empty()
    );
    assert!(s.version_outcomes(&name("nope"), from, until, 60, None).await.unwrap().is_empty());
}

/// Every kind of label change lands in the label history in the same
/// transaction, newest first, with its actor; a refused or empty move records nothing.
async fn label_history_records_every_move_in_order(b: Backend) {
    use combee::domain::{LabelMoveKind, MoveCause, event::EventType};
    let ts = test_store(b).await;
    let s = ts.store.clone();
    subscribe(&s, EventType::PromptRolledBack).await;
    make_prompt(&s, "p").await;
    make_prompt(&s, "other").await;
    let prod = LabelName::production();
    let to_new = |expected| LabelMove {
        label: prod.clone(),
        to_version: 0,
        expected_current: expected,
        check_current: true,
        by: "key:op1".into(),
    };
    s.create_version(&name("p"), version("two"), &[to_new(Some(1))]).await.unwrap();
    let mut back = version("one again");
    back.source = VersionSource::Rollback;
    back.message = "rollback to v1".into();
    s.create_version(&name("p"), back, &[to_new(Some(2))]).await.unwrap();
    // A refused CAS writes no history.
    assert!(matches!(s.create_version(&name("p"), version("x"), &[to_new(Some(1))]).await, Err(StoreError::Conflict)));
    let guard = LabelMove {
        label: prod.clone(),
        to_version: 2,
        expected_current: Some(3),
        check_current: true,
        by: "guard".into(),
    };
    let cause = MoveCause::new(LabelMoveKind::GuardRollback, "success fell").with_evidence(json!({"p_value": 0.001}));
    s.move_label_because(&name("p"), &guard, &cause).await.unwrap();
    // Moving to where it already points changes nothing and records nothing.
    s.move_label_because(&name("p"), &LabelMove { expected_current: Some(2), ..guard.clone() }, &cause).await.unwrap();
    let cand = LabelMove {
        label: LabelName::candidate(),
        to_version: 3,
        expected_current: None,
        check_current: true,
        by: "key:op2".into(),
    };
    s.move_label(&name("p"), &cand).await.unwrap();
    assert!(s.delete_label(&name("p"), &LabelName::candidate(), "key:op3").await.unwrap());
    s.insert_traces(&[trace("p", Some(2))]).await.unwrap();
    let round = open_and_claim(&s, "p").await;
    let mut learned = version("learned");
    learned.source = VersionSource::Learned;
    learned.created_by = "worker:w".into();
    s.finish_round(&published(&round, learned, prod.clone())).await.unwrap();

    let all = s.label_history(&name("p"), None, None, 100).await.unwrap();
    let got: Vec<_> =
        all.iter().map(|m| (m.label.as_str(), m.kind, m.from_version, m.to_version, m.actor.as_str())).collect();
    assert_eq!(
        got,
        vec![
            ("production", LabelMoveKind::AutoPublish, Some(2), Some(4), "worker:w"),
            ("candidate", LabelMoveKind::Delete, Some(3), None, "key:op3"),
            ("candidate", LabelMoveKind::Promote, None, Some(3), "key:op2"),
            ("production", LabelMoveKind::GuardRollback, Some(3), Some(2), "guard"),
            ("production", LabelMoveKind::Rollback, Some(2), Some(3), "key:op1"),
            ("production", LabelMoveKind::Promote, Some(1), Some(2), "key:op1"),
            ("production", LabelMoveKind::Create, None, Some(1), "test"),
        ]
    );
    assert!(all.windows(2).all(|w| w[0].id > w[1].id && w[0].at >= w[1].at), "newest first");
    assert_eq!(all[3].evidence, Some(json!({"p_value": 0.001})));
    assert_eq!(all[3].reason, "success fell");
    assert_eq!(all[4].reason, "rollback to v1");
    assert_eq!(all[0].evidence.as_ref().unwrap()["round_id"], json!(round.round.id));
    assert!(all[6].evidence.is_none());

    // Filtered by label, and paged by id.
    let cands = s.label_history(&name("p"), Some(&LabelName::candidate()), None, 100).await.unwrap();
    assert_eq!(cands.iter().map(|m| m.kind).collect::<Vec<_>>(), vec![LabelMoveKind::Delete, LabelMoveKind::Promote]);
    let page1 = s.label_history(&name("p"), None, None, 3).await.unwrap();
    let page2 = s.label_history(&name("p"), None, Some(page1[2].id), 3).await.unwrap();
    assert_eq!(page2.iter().map(|m| m.id).collect::<Vec<_>>(), all[3..6].iter().map(|m| m.id).collect::<Vec<_>>());
    // Per prompt.
    let other = s.label_history(&name("other"), None, None, 100).await.unwrap();
    assert_eq!(other.iter().map(|m| m.kind).collect::<Vec<_>>(), vec![LabelMoveKind::Create]);
    assert!(s.label_history(&name("nope"), None, None, 100).await.unwrap().is_empty());
    // By kind, and by the versions moved between (what the regression guard asks).
    let guard_moves = combee::store::LabelMoveQuery {
        label: Some(prod.clone()),
        kind: Some(LabelMoveKind::GuardRollback),
        ..Default::default()
    };
    let found = s.label_moves(&name("p"), &guard_moves, 10).await.unwrap();
    assert_eq!(found.iter().map(|m| m.id).collect::<Vec<_>>(), vec![all[3].id]);
    let same = combee::store::LabelMoveQuery { from_version: Some(3), to_version: Some(2), ..guard_moves.clone() };
    assert_eq!(s.label_moves(&name("p"), &same, 1).await.unwrap().len(), 1);
    let other_way = combee::store::LabelMoveQuery { from_version: Some(2), to_version: Some(3), ..guard_moves.clone() };
    assert!(s.label_moves(&name("p"), &other_way, 1).await.unwrap().is_empty());
    let earlier = combee::store::LabelMoveQuery { before: Some(all[3].id), ..guard_moves };
    assert!(s.label_moves(&name("p"), &earlier, 1).await.unwrap().is_empty());

    // The operator's rollback and the guard's each announced `prompt.rolled_back`.
    let claimed = s.claim_deliveries("a", std::time::Duration::from_secs(60), 10).await.unwrap();
    let mut rolled: Vec<_> = claimed
        .iter()
        .map(|d| {
            assert_eq!(d.event_type, "prompt.rolled_back");
            let body: serde_json::Value = serde_json::from_str(&d.body).unwrap();
            (body["data"]["kind"].as_str().unwrap().to_owned(), body["data"]["version"].as_i64().unwrap())
        })
        .collect();
    rolled.sort();
    assert_eq!(rolled, vec![("guard-rollback".to_owned(), 2), ("rollback".to_owned(), 3)]);

    // Append-only: the database itself refuses to change or remove an entry.
    use sqlx::Connection;
    for sql in ["UPDATE label_moves SET actor = 'someone else'", "DELETE FROM label_moves"] {
        let refused = match b {
            Backend::Postgres => {
                let mut c = sqlx::PgConnection::connect(&ts.url).await.unwrap();
                sqlx::raw_sql(sql).execute(&mut c).await.map(|_| ())
            }
            Backend::Sqlite => {
                let mut c = sqlx::SqliteConnection::connect(&ts.url).await.unwrap();
                sqlx::raw_sql(sql).execute(&mut c).await.map(|_| ())
            }
        };
        let err = refused.expect_err(sql).to_string();
        assert!(err.contains("append-only"), "{sql}: {err}");
    }
    assert_eq!(s.label_history(&name("p"), None, None, 100).await.unwrap(), all);
}

// ---- Round leases: claim, heartbeat, lease loss and fencing, failure ----

const MINUTE: std::time::Duration = std::time::Duration::from_secs(60);

fn open_req(prompt: &str) -> OpenRound {
    OpenRound {
        prompt: name(prompt),
        trigger: RoundTrigger::Api,
        method: Method::Combee,
        batch: 100,
        min_traces: 1,
        seed: 42,
        inbound_webhook_id: None,
        judge_wait: None,
        base_version: None,
    }
}

/// Claims until a round comes back, for up to 5 s: a lease that ended "now"
/// is claimable once the store's clock has moved past it.
async fn claim_within_deadline(s: &DynStore, owner: &str) -> combee::store::ClaimedRound {
    eventually("a claimable round", std::time::Duration::from_secs(5), async || {
        s.claim_round(owner, MINUTE).await.unwrap().ok_or_else(|| "none yet".into())
    })
    .await
}

fn llm_call(model: &str) -> combee::llm::LlmCall {
    combee::llm::LlmCall {
        role: combee::llm::LlmRole::Reflector,
        model: model.into(),
        prompt_tokens: 10,
        completion_tokens: 5,
        cost_usd: 0.001,
        latency_ms: 7,
        retries: 0,
        error: None,
        read: None,
        refused_answer: None,
        output_format: None,
        concurrency_limit: None,
    }
}

/// What a reserved, uncharged trace looks like: pending, no attempts spent, held by `round`.
async fn assert_reserved(s: &DynStore, trace: uuid::Uuid, round: uuid::Uuid) {
    let t = s.get_trace(trace).await.unwrap().unwrap();
    assert_eq!(
        (t.status, t.attempts, t.round_id, t.failure_reason),
        (TraceStatus::Pending, 0, Some(round), None),
        "trace {trace} is still reserved by round {round}, uncharged"
    );
}

async fn a_live_lease_makes_a_round_claimable_exactly_once(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    assert!(s.claim_round("a", MINUTE).await.unwrap().is_none(), "nothing queued, nothing to claim");
    make_prompt(&s, "p").await;
    let ids = s.insert_traces(&[trace("p", None), trace("p", Some(1))]).await.unwrap();
    let opened = s.open_round(&open_req("p")).await.unwrap().expect("a round opens");
    assert_eq!((opened.status, opened.attempt), (combee::domain::round::RoundStatus::Queued, 0));

    let c = s.claim_round("a", MINUTE).await.unwrap().expect("the queued round is claimable");
    assert_eq!(
        (c.round.id, c.round.attempt, c.round.status),
        (opened.id, 1, combee::domain::round::RoundStatus::Running)
    );
    assert_eq!(c.traces.iter().map(|t| t.id).collect::<Vec<_>>(), ids, "the reserved traces, in batch order");
    assert_eq!((c.prompt.name.as_str(), c.base.number, c.round.seed), ("p", 1, 42));
    assert!(c.round.started_at.is_some());

    // While the lease lives nobody else gets it, however often they ask.
    for owner in ["b", "c", "a"] {
        assert!(s.claim_round(owner, MINUTE).await.unwrap().is_none(), "{owner} must not get a leased round");
    }
    let now = s.get_round(opened.id).await.unwrap().unwrap();
    assert_eq!((now.status, now.attempt), (combee::domain::round::RoundStatus::Running, 1));
}

async fn concurrent_claimers_take_each_round_once(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    let mut opened = Vec::new();
    for p in ["p0", "p1", "p2"] {
        make_prompt(&s, p).await;
        s.insert_traces(&[trace(p, None)]).await.unwrap();
        opened.push(s.open_round(&open_req(p)).await.unwrap().expect("a round opens").id);
    }
    let claimers: Vec<_> = (0..8)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move { s.claim_round(&format!("w{i}"), MINUTE).await.unwrap() })
        })
        .collect();
    let mut claimed = Vec::new();
    for c in claimers {
        if let Some(c) = c.await.unwrap() {
            assert_eq!(c.round.attempt, 1, "a first claim is attempt 1");
            claimed.push(c.round.id);
        }
    }
    claimed.sort();
    opened.sort();
    assert_eq!(claimed, opened, "each of the three rounds went to exactly one of the eight claimers");
    assert!(s.claim_round("late", MINUTE).await.unwrap().is_none());

    // One lease lapses: of eight workers reclaiming at once, exactly one gets it, with attempt 2.
    let lapsed = opened[1];
    assert!(s.heartbeat_round(lapsed, 1, std::time::Duration::ZERO).await.unwrap());
    let reclaimed = eventually("the lapsed lease's reclaim", std::time::Duration::from_secs(5), async || {
        let claimers: Vec<_> = (0..8)
            .map(|i| {
                let s = s.clone();
                tokio::spawn(async move { s.claim_round(&format!("r{i}"), MINUTE).await.unwrap() })
            })
            .collect();
        let mut got = Vec::new();
        for c in claimers {
            got.extend(c.await.unwrap().map(|c| (c.round.id, c.round.attempt)));
        }
        assert!(got.len() <= 1, "a lapsed lease was reclaimed twice: {got:?}");
        got.pop().ok_or_else(|| "not reclaimed yet".into())
    })
    .await;
    assert_eq!(reclaimed, (lapsed, 2));
    assert!(s.claim_round("late", MINUTE).await.unwrap().is_none());
}

/// A heartbeat extends the lease; once it lapses another worker claims the
/// round with a higher attempt, and every write of the old attempt is refused
/// and changes nothing.
async fn a_lost_lease_fences_the_old_attempt(b: Backend) {
    use combee::domain::round::RoundStatus;
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    let ids = s.insert_traces(&[trace("p", None), trace("p", None)]).await.unwrap();
    let (t0, t1) = (ids[0], ids[1]);
    let round = s.open_round(&open_req("p")).await.unwrap().unwrap().id;

    // Worker A's zero lease ends at once, but its heartbeat extends it: B gets nothing.
    let a = s.claim_round("a", std::time::Duration::ZERO).await.unwrap().unwrap();
    assert!(s.heartbeat_round(round, a.round.attempt, MINUTE).await.unwrap());
    assert!(s.claim_round("b", MINUTE).await.unwrap().is_none(), "the heartbeat extended A's lease");
    assert!(s.update_round(round, a.round.attempt, Some(1), &json!({"by": "a"})).await.unwrap());

    // A's lease lapses (a heartbeat with a zero lease ends it now): B claims with attempt 2.
    assert!(s.heartbeat_round(round, a.round.attempt, std::time::Duration::ZERO).await.unwrap());
    let bc = claim_within_deadline(&s, "b").await;
    assert_eq!((bc.round.id, bc.round.attempt), (round, 2));
    assert_eq!(bc.traces.iter().map(|t| t.id).collect::<Vec<_>>(), ids, "the same traces");
    assert_eq!((bc.round.seed, bc.round.base_version), (a.round.seed, a.round.base_version), "the same seed and base");
    assert_eq!((bc.round.k, &bc.round.detail), (Some(1), &json!({"by": "a"})), "A's saved progress is B's to resume");

    // A is fenced: its heartbeat, progress, publish and failure are all refused...
    assert!(!s.heartbeat_round(round, 1, MINUTE).await.unwrap(), "A no longer holds the lease");
    assert!(!s.update_round(round, 1, Some(9), &json!({"by": "stale a"})).await.unwrap());
    let mut learned = version("learned by a");
    learned.source = VersionSource::Learned;
    learned.parent = Some(1);
    let stale_publish = s
        .finish_round(&RoundEnd {
            round,
            attempt: 1,
            version: Some((learned.clone(), LabelName::production())),
            detail: json!({}),
            k: None,
            sample_secs: Some(1.0),
            charges: TraceCharges::default(),
        })
        .await;
    assert!(matches!(stale_publish, Err(StoreError::Conflict)), "{stale_publish:?}");
    let charge_t0 =
        TraceCharges { faults: vec![TraceFault { trace_id: t0, reason: "stale".into() }], max_trace_attempts: 1 };
    let stale_give_up = s.fail_round(round, 1, "a gave up", RoundFailure::GiveUp { charges: charge_t0.clone() }).await;
    assert!(matches!(stale_give_up, Err(StoreError::Conflict)), "{stale_give_up:?}");
    let stale_retry =
        s.fail_round(round, 1, "a retries", RoundFailure::Retry { after: std::time::Duration::ZERO }).await;
    assert!(matches!(stale_retry, Err(StoreError::Conflict)), "{stale_retry:?}");

    // ...and changed nothing: no version, label unmoved, traces reserved and
    // uncharged, the round B's and still leased to B, no controller sample.
    let latest = s.resolve(&name("p"), &Selector::Latest).await.unwrap().unwrap();
    assert_eq!((latest.version.number, latest.labels.clone()), (1, vec![LabelName::production()]));
    for t in [t0, t1] {
        assert_reserved(&s, t, round).await;
    }
    let r = s.get_round(round).await.unwrap().unwrap();
    assert_eq!((r.status, r.attempt, r.k, r.error.as_deref()), (RoundStatus::Running, 2, Some(1), None));
    assert_eq!(r.detail, json!({"by": "a"}));
    assert!(s.claim_round("c", MINUTE).await.unwrap().is_none(), "A's refused writes did not free B's lease");
    assert!(s.controller_samples(&name("p"), 10).await.unwrap().is_empty());

    // A's LLM calls are kept under A's attempt (they were paid for), apart from B's.
    s.record_llm_call(round, 1, &llm_call("model-a")).await.unwrap();
    s.record_llm_call(round, 2, &llm_call("model-b")).await.unwrap();
    let calls: Vec<_> = s.round_calls(round).await.unwrap().into_iter().map(|c| (c.attempt, c.call.model)).collect();
    assert_eq!(calls, vec![(1, "model-a".to_string()), (2, "model-b".to_string())]);

    // B's writes go through; a reflection is stored once, so A's late one for
    // the same trace does not replace B's.
    assert!(s.heartbeat_round(round, 2, MINUTE).await.unwrap());
    assert!(s.update_round(round, 2, Some(2), &json!({"by": "b"})).await.unwrap());
    s.save_reflection(round, t0, &reflection("b's lesson"), false).await.unwrap();
    s.save_reflection(round, t0, &reflection("a's late lesson"), true).await.unwrap();
    let stored = s.round_reflections(round).await.unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!((stored[0].0, stored[0].1.key_insight.as_str(), stored[0].2), (t0, "b's lesson", false));
    let v = s
        .finish_round(&RoundEnd {
            round,
            attempt: 2,
            version: Some((learned, LabelName::production())),
            detail: json!({"by": "b"}),
            k: None,
            sample_secs: Some(2.5),
            charges: TraceCharges::default(),
        })
        .await
        .unwrap()
        .expect("a version");
    assert_eq!(v.number, 2);
    let r = s.get_round(round).await.unwrap().unwrap();
    assert_eq!((r.status, r.result_version, r.attempt), (RoundStatus::Succeeded, Some(2), 2));
    let samples = s.controller_samples(&name("p"), 10).await.unwrap();
    assert_eq!(samples.iter().map(|c| (c.round_id, c.round_secs)).collect::<Vec<_>>(), vec![(round, 2.5)]);
    let got = s.get_trace(t0).await.unwrap().unwrap();
    assert_eq!((got.status, got.round_id), (TraceStatus::Consumed, Some(round)));
    let got = s.get_trace(t1).await.unwrap().unwrap();
    assert_eq!((got.status, got.attempts, got.round_id), (TraceStatus::Pending, 0, None), "unreflected: back, free");

    // A finished round fences every attempt, B's too, and is never claimed again.
    assert!(!s.heartbeat_round(round, 2, MINUTE).await.unwrap());
    assert!(!s.update_round(round, 2, None, &json!({})).await.unwrap());
    assert!(matches!(
        s.fail_round(round, 2, "late", RoundFailure::GiveUp { charges: charge_t0 }).await,
        Err(StoreError::Conflict)
    ));
    assert!(s.claim_round("c", MINUTE).await.unwrap().is_none());
    let unknown = s.fail_round(uuid::Uuid::now_v7(), 1, "x", RoundFailure::Retry { after: MINUTE }).await;
    assert!(matches!(unknown, Err(StoreError::NotFound)), "{unknown:?}");
    assert!(!s.heartbeat_round(uuid::Uuid::now_v7(), 1, MINUTE).await.unwrap());
}

/// `Retry` re-queues the round with its traces after a delay; `GiveUp` ends
/// it and returns its traces to pending, charging only those in `charges`.
async fn failed_rounds_retry_later_or_give_their_traces_back(b: Backend) {
    use combee::domain::round::RoundStatus;
    let ts = test_store(b).await;
    let s = ts.store.clone();

    // Retry after an hour: queued again, traces kept and uncharged, not claimable yet.
    make_prompt(&s, "later").await;
    let held = s.insert_traces(&[trace("later", None)]).await.unwrap()[0];
    let later = s.open_round(&open_req("later")).await.unwrap().unwrap().id;
    let c = s.claim_round("a", MINUTE).await.unwrap().unwrap();
    let hour = std::time::Duration::from_secs(3600);
    s.fail_round(later, c.round.attempt, "llm down", RoundFailure::Retry { after: hour }).await.unwrap();
    let r = s.get_round(later).await.unwrap().unwrap();
    assert_eq!(
        (r.status, r.attempt, r.error.as_deref(), r.finished_at),
        (RoundStatus::Queued, 1, Some("llm down"), None)
    );
    assert_reserved(&s, held, later).await;
    assert!(s.claim_round("b", MINUTE).await.unwrap().is_none(), "not due for an hour");
    assert!(matches!(s.open_round(&open_req("later")).await, Err(StoreError::AlreadyExists)), "still in flight");
    let backlog = s.backlogs().await.unwrap().into_iter().find(|b| b.prompt.name.as_str() == "later").unwrap();
    assert_eq!((backlog.pending, backlog.active_round), (0, true));
    assert!(
        matches!(s.fail_round(later, 1, "again", RoundFailure::Retry { after: hour }).await, Err(StoreError::Conflict)),
        "a queued round has no attempt running to fail"
    );

    // Retry at once: claimed again with the next attempt, the same traces and seed.
    make_prompt(&s, "p").await;
    let ids = s.insert_traces(&[trace("p", None), trace("p", None), trace("p", None)]).await.unwrap();
    let (ta, tb, tc) = (ids[0], ids[1], ids[2]);
    let round = s.open_round(&open_req("p")).await.unwrap().unwrap().id;
    let first = s.claim_round("a", MINUTE).await.unwrap().unwrap();
    assert_eq!(first.round.id, round);
    s.fail_round(round, 1, "timeout", RoundFailure::Retry { after: std::time::Duration::ZERO }).await.unwrap();
    let second = claim_within_deadline(&s, "b").await;
    assert_eq!((second.round.id, second.round.attempt, second.round.seed), (round, 2, 42));
    assert_eq!(second.traces.iter().map(|t| t.id).collect::<Vec<_>>(), ids);
    for t in ids.iter().copied() {
        assert_reserved(&s, t, round).await;
    }
    assert!(matches!(
        s.fail_round(round, 1, "stale", RoundFailure::Retry { after: std::time::Duration::ZERO }).await,
        Err(StoreError::Conflict)
    ));

    // Give up, charging ta, and naming a trace of another round (ignored: not this round's to charge).
    let charges = TraceCharges {
        faults: vec![
            TraceFault { trace_id: ta, reason: "reflection failed: too long".into() },
            TraceFault { trace_id: held, reason: "not mine".into() },
        ],
        max_trace_attempts: 2,
    };
    s.fail_round(round, 2, "group 1 failed", RoundFailure::GiveUp { charges: charges.clone() }).await.unwrap();
    let r = s.get_round(round).await.unwrap().unwrap();
    assert_eq!((r.status, r.error.as_deref()), (RoundStatus::Failed, Some("group 1 failed")));
    assert!(r.finished_at.is_some());
    let got = s.get_trace(ta).await.unwrap().unwrap();
    assert_eq!(
        (got.status, got.attempts, got.round_id, got.failure_reason.as_deref()),
        (TraceStatus::Pending, 1, None, Some("reflection failed: too long"))
    );
    for t in [tb, tc] {
        let got = s.get_trace(t).await.unwrap().unwrap();
        assert_eq!((got.status, got.attempts, got.round_id, got.failure_reason), (TraceStatus::Pending, 0, None, None));
    }
    assert_reserved(&s, held, later).await;
    assert!(s.claim_round("c", MINUTE).await.unwrap().is_none(), "a failed round is not claimed again");
    assert!(matches!(
        s.fail_round(round, 2, "twice", RoundFailure::GiveUp { charges: charges.clone() }).await,
        Err(StoreError::Conflict)
    ));

    // The traces are learnable again; a second charge spends ta's budget: failed, out of the backlog.
    let again = s.open_round(&open_req("p")).await.unwrap().expect("the returned traces open a new round");
    assert_eq!(s.round_trace_ids(again.id).await.unwrap(), ids);
    let c = s.claim_round("d", MINUTE).await.unwrap().unwrap();
    assert_eq!((c.round.id, c.round.attempt), (again.id, 1));
    s.fail_round(again.id, 1, "again", RoundFailure::GiveUp { charges }).await.unwrap();
    let got = s.get_trace(ta).await.unwrap().unwrap();
    assert_eq!((got.status, got.attempts, got.round_id), (TraceStatus::Failed, 2, None));
    let backlog = s.backlogs().await.unwrap().into_iter().find(|b| b.prompt.name.as_str() == "p").unwrap();
    assert_eq!((backlog.pending, backlog.active_round), (2, false));
}

/// A call's answer is kept as read: how, in which output format, under which
/// concurrency limit, and a refused answer's text, bounded however long it was.
async fn llm_calls_keep_how_their_answer_was_read(b: Backend) {
    use combee::llm::{AnswerRead, OutputFormat, REFUSED_ANSWER_CHARS};
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    s.insert_traces(&[trace("p", None)]).await.unwrap();
    let c = open_and_claim(&s, "p").await;
    let long: String = "<script>é</script>".chars().cycle().take(REFUSED_ANSWER_CHARS + 500).collect();
    let refused = combee::llm::LlmCall {
        read: Some(AnswerRead::Refused),
        refused_answer: Some(long.clone()),
        output_format: Some(OutputFormat::JsonObjectSchema),
        concurrency_limit: Some(1),
        error: Some("the reflector's answer is not JSON".into()),
        ..llm_call("small")
    };
    let read = combee::llm::LlmCall {
        read: Some(AnswerRead::Repaired),
        output_format: Some(OutputFormat::Plain),
        concurrency_limit: Some(64),
        ..llm_call("small")
    };
    for call in [&refused, &read, &llm_call("older")] {
        s.record_llm_call(c.round.id, c.round.attempt, call).await.unwrap();
    }
    let calls: Vec<_> = s.round_calls(c.round.id).await.unwrap().into_iter().map(|c| c.call).collect();
    let kept: String = long.chars().take(REFUSED_ANSWER_CHARS).collect();
    assert_eq!(calls[0], combee::llm::LlmCall { refused_answer: Some(kept), ..refused });
    assert_eq!(calls[1], read);
    assert_eq!(calls[2], llm_call("older"), "a call that says nothing of its answer reads back as such");
}

/// A round whose learning left the content as its base had it succeeds without
/// a version: its reflected traces are consumed, the others go back, no label
/// moves, the failure streak ends, and `round.completed` says `unchanged`.
async fn a_round_that_changed_nothing_succeeds_without_a_version(b: Backend) {
    use combee::domain::{event::EventType, round::RoundStatus};
    let ts = test_store(b).await;
    let s = ts.store.clone();
    subscribe(&s, EventType::RoundCompleted).await;
    make_prompt(&s, "u").await;
    let ids = s.insert_traces(&[trace("u", None), trace("u", None)]).await.unwrap();
    let failed = open_and_claim(&s, "u").await;
    let give_up = RoundFailure::GiveUp { charges: TraceCharges::default() };
    s.fail_round(failed.round.id, failed.round.attempt, "first", give_up).await.unwrap();
    assert_eq!(s.failure_streak(&name("u")).await.unwrap().unwrap().failures, 1);

    let c = open_and_claim(&s, "u").await;
    s.save_reflection(c.round.id, ids[0], &reflection("nothing new"), false).await.unwrap();
    s.finish_round(&RoundEnd {
        version: None,
        detail: json!({"outcome": {"n": 2}}),
        sample_secs: Some(1.5),
        ..published(&c, version("unused"), LabelName::candidate())
    })
    .await
    .unwrap();
    let round = s.get_round(c.round.id).await.unwrap().unwrap();
    assert_eq!((round.status, round.result_version, round.error), (RoundStatus::Succeeded, None, None));
    assert_eq!(round.detail["outcome"]["n"], 2);
    let (reflected, other) = (s.get_trace(ids[0]).await.unwrap().unwrap(), s.get_trace(ids[1]).await.unwrap().unwrap());
    assert_eq!((reflected.status, other.status, other.round_id), (TraceStatus::Consumed, TraceStatus::Pending, None));
    let versions = s.list_versions(&name("u"), None, 10).await.unwrap();
    assert_eq!(versions.iter().map(|v| v.number).collect::<Vec<_>>(), vec![1], "no version written");
    let prod = s.resolve(&name("u"), &Selector::Label(LabelName::production())).await.unwrap().unwrap();
    assert_eq!(prod.version.number, 1);
    assert_eq!(s.failure_streak(&name("u")).await.unwrap().unwrap(), Default::default(), "a success ends the streak");
    let told = s.claim_deliveries("d", std::time::Duration::from_secs(60), 10).await.unwrap();
    assert_eq!(told.len(), 1, "{told:?}");
    let body: serde_json::Value = serde_json::from_str(&told[0].body).unwrap();
    assert_eq!(
        (&body["data"]["version"], &body["data"]["label"], &body["data"]["unchanged"]),
        (&json!(null), &json!(null), &json!(true))
    );
    // Fenced like a publication: the attempt that lost its lease writes nothing.
    let stale =
        RoundEnd { version: None, attempt: c.round.attempt + 1, ..published(&c, version("-"), LabelName::candidate()) };
    let again = s.finish_round(&stale).await;
    assert!(matches!(again, Err(StoreError::Conflict)), "{again:?}");
}

/// A prompt's failed rounds make a streak: counted in the round's own
/// transaction, `round.failed` told once per streak, ended by a round that
/// publishes or by an operator (a clear, or a round an operator triggers).
async fn a_failing_prompt_keeps_its_streak_until_a_success_or_an_operator(b: Backend) {
    use combee::domain::event::EventType;
    let ts = test_store(b).await;
    let s = ts.store.clone();
    subscribe(&s, EventType::RoundFailed).await;
    make_prompt(&s, "f").await;
    s.insert_traces(&[trace("f", None), trace("f", None)]).await.unwrap();
    let by_scheduler = OpenRound { trigger: RoundTrigger::Backlog, ..open_req("f") };
    let fail = |error: &'static str| {
        let (s, by_scheduler) = (s.clone(), by_scheduler.clone());
        async move {
            let r = s.open_round(&by_scheduler).await.unwrap().expect("a round opens");
            let c = s.claim_round("w", MINUTE).await.unwrap().expect("a round to claim");
            assert_eq!(c.round.id, r.id);
            let how = RoundFailure::GiveUp { charges: TraceCharges::default() };
            s.fail_round(r.id, c.round.attempt, error, how).await.unwrap();
        }
    };
    let streak = || async { s.failure_streak(&name("f")).await.unwrap().unwrap() };
    assert_eq!(streak().await, Default::default());
    let before = chrono::Utc::now() - chrono::Duration::seconds(1);
    fail("the model's answer is not JSON").await;
    fail("again not JSON").await;
    let st = streak().await;
    assert_eq!((st.failures, st.last_failure.as_deref()), (2, Some("again not JSON")));
    assert!(st.last_failed_at.is_some_and(|t| t > before), "{st:?}");
    let backlog = s.backlogs().await.unwrap().into_iter().find(|b| b.prompt.name.as_str() == "f").unwrap();
    assert_eq!((backlog.failures.failures, backlog.failures.last_failed_at), (2, st.last_failed_at));
    assert_eq!(s.failing_prompts(10).await.unwrap(), vec![(name("f"), st)]);
    let told = s.claim_deliveries("d", MINUTE, 10).await.unwrap();
    assert_eq!(told.len(), 1, "round.failed once per streak: {told:?}");
    let body: serde_json::Value = serde_json::from_str(&told[0].body).unwrap();
    assert_eq!(body["data"]["error"], "the model's answer is not JSON");

    // An operator's clear ends the streak; the next failure starts a new one, told again.
    assert!(s.clear_failure_streak(&name("f")).await.unwrap());
    assert!(!s.clear_failure_streak(&name("nope")).await.unwrap());
    assert_eq!(streak().await, Default::default());
    assert!(s.failing_prompts(10).await.unwrap().is_empty());
    fail("third").await;
    assert_eq!(streak().await.failures, 1);
    assert_eq!(s.claim_deliveries("d", MINUTE, 10).await.unwrap().len(), 1, "a new streak is told");

    // A round an operator triggers ends it as it opens; a round that publishes too.
    let r = s.open_round(&open_req("f")).await.unwrap().unwrap();
    assert_eq!(streak().await, Default::default());
    let c = s.claim_round("w", MINUTE).await.unwrap().unwrap();
    s.fail_round(r.id, c.round.attempt, "fourth", RoundFailure::GiveUp { charges: TraceCharges::default() })
        .await
        .unwrap();
    fail("fifth").await;
    assert_eq!(streak().await.failures, 2);
    s.open_round(&by_scheduler).await.unwrap().unwrap();
    let c = s.claim_round("w", MINUTE).await.unwrap().unwrap();
    let mut v = version("learned");
    v.source = VersionSource::Learned;
    s.finish_round(&published(&c, v, LabelName::production())).await.unwrap();
    assert_eq!(streak().await, Default::default(), "a success ends the streak");
    assert!(s.failure_streak(&name("nope")).await.unwrap().is_none());
}

/// The overload meter sums each round's counts once per bucket, per prompt.
async fn meter_counts_sum_rounds_once_per_prompt(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "metered").await;
    make_prompt(&s, "other").await;
    assert!(s.meter_counts(&name("metered")).await.unwrap().is_empty());
    let counts = |size_min, marked, recaptured| MeterCounts { size_min, marked, recaptured, rounds: 1 };

    s.insert_traces(&[trace("metered", None)]).await.unwrap();
    let a = open_and_claim(&s, "metered").await;
    s.record_meter_counts(&name("metered"), a.round.id, &[counts(4, 10, 8), counts(16, 20, 11)]).await.unwrap();
    // A worker recording the same round again (a retried publish) changes nothing.
    s.record_meter_counts(&name("metered"), a.round.id, &[counts(4, 10, 8)]).await.unwrap();
    let charges = TraceCharges { faults: vec![], max_trace_attempts: 2 };
    s.fail_round(a.round.id, a.round.attempt, "done", RoundFailure::GiveUp { charges }).await.unwrap();

    let b_round = open_and_claim(&s, "metered").await;
    s.record_meter_counts(&name("metered"), b_round.round.id, &[counts(4, 6, 3)]).await.unwrap();

    let got = s.meter_counts(&name("metered")).await.unwrap();
    assert_eq!(
        got,
        vec![
            MeterCounts { size_min: 4, marked: 16, recaptured: 11, rounds: 2 },
            MeterCounts { size_min: 16, marked: 20, recaptured: 11, rounds: 1 },
        ]
    );
    assert!(s.meter_counts(&name("other")).await.unwrap().is_empty(), "meters are per prompt");
}

/// What an LLM backend earned is kept per base URL and model; the last kept wins.
async fn llm_limits_are_kept_per_backend_and_model(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    assert_eq!(s.llm_limit("http://llm:8080/v1", "small").await.unwrap(), None, "never seen");
    s.keep_llm_limit("http://llm:8080/v1", "small", 48).await.unwrap();
    s.keep_llm_limit("http://llm:8080/v1", "large", 3).await.unwrap();
    s.keep_llm_limit("http://llm:8080/v1", "small", 12).await.unwrap();
    assert_eq!(s.llm_limit("http://llm:8080/v1", "small").await.unwrap(), Some(12));
    assert_eq!(s.llm_limit("http://llm:8080/v1", "large").await.unwrap(), Some(3));
    assert_eq!(s.llm_limit("http://other:8080/v1", "small").await.unwrap(), None);
}

/// Rewards per (version, task key) for comparing arms on matched work.
async fn task_rewards_group_by_version_and_task_key(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p").await;
    s.create_version(&name("p"), version("v2"), &[]).await.unwrap();
    let ids = s
        .insert_traces(&[
            rewarded_trace("p", Some(1), json!({"success": true}), json!({"task_key": "a"})),
            rewarded_trace("p", Some(1), json!({"success": false, "score": 0.9}), json!({"task_key": "a"})),
            rewarded_trace("p", Some(1), json!({"score": 0.25}), json!({"task_key": "b"})),
            rewarded_trace("p", Some(2), json!({"success": true}), json!({"task_key": "a"})),
            // Left out: no reward, a task key that is not a string, no task key, no version.
            rewarded_trace("p", Some(2), json!({}), json!({"task_key": "a"})),
            rewarded_trace("p", Some(2), json!({"success": true}), json!({"task_key": 7})),
            rewarded_trace("p", Some(2), json!({"success": true}), json!({})),
            rewarded_trace("p", None, json!({"success": true}), json!({"task_key": "a"})),
            rewarded_trace("p", Some(2), json!({"success": false}), json!({"task_key": "b"})),
        ])
        .await
        .unwrap();
    let from = chrono::Utc::now() - chrono::Duration::hours(1);
    let until = chrono::Utc::now() + chrono::Duration::minutes(1);
    let got: Vec<_> = s
        .task_rewards(&name("p"), from, until)
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.version, t.task_key, t.traces, t.reward_sum))
        .collect();
    assert_eq!(
        got,
        vec![
            (1, "a".to_owned(), 2, 1.0),
            (1, "b".to_owned(), 1, 0.25),
            (2, "a".to_owned(), 1, 1.0),
            (2, "b".to_owned(), 1, 0.0),
        ]
    );
    // Quarantined traces are not trusted; the window is half-open.
    s.quarantine_trace(ids[0], "suspect").await.unwrap();
    let a1 = s.task_rewards(&name("p"), from, until).await.unwrap();
    assert_eq!((a1[0].traces, a1[0].reward_sum), (1, 0.0));
    assert!(s.task_rewards(&name("p"), until, until + chrono::Duration::hours(1)).await.unwrap().is_empty());
}

/// The bookkeeping of combee's own migrator before `sqlx::migrate!`, for a
/// database at migration 12: every file up to 12 with its SHA-256 (hex), as
/// the old migrator recorded them, and optionally one of them edited.
fn old_bookkeeping(b: Backend, tampered: Option<i64>) -> Vec<String> {
    use sha2::Digest;
    let dir = match b {
        Backend::Postgres => "migrations/postgres",
        Backend::Sqlite => "migrations/sqlite",
    };
    let mut sql = vec![
        match b {
            Backend::Postgres => {
                "CREATE TABLE schema_migrations (version bigint PRIMARY KEY, name text NOT NULL,
             checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            }
            Backend::Sqlite => {
                "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL,
             checksum TEXT NOT NULL, applied_at INTEGER NOT NULL DEFAULT 0)"
            }
        }
        .to_owned(),
    ];
    let mut files: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    for path in files {
        let stem = path.file_stem().unwrap().to_str().unwrap().to_owned();
        let (number, file_name) = stem.split_once('_').unwrap();
        let version: i64 = number.parse().unwrap();
        if version > 12 {
            continue;
        }
        let mut sum = hex::encode(sha2::Sha256::digest(std::fs::read(&path).unwrap()));
        if tampered == Some(version) {
            sum = "0".repeat(64);
        }
        sql.push(format!(
            "INSERT INTO schema_migrations (version, name, checksum) VALUES ({version}, '{file_name}', '{sum}')"
        ));
    }
    sql
}

async fn run_raw(b: Backend, url: &str, statements: &[String]) {
    use sqlx::Connection;
    match b {
        Backend::Postgres => {
            let mut c = sqlx::PgConnection::connect(url).await.unwrap();
            for sql in statements {
                sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
            }
        }
        Backend::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(url).await.unwrap();
            for sql in statements {
                sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
            }
        }
    }
}

/// A database a newer release migrated — a migration this binary does not
/// have, which only adds (a table, a nullable column, a column with a default,
/// an index), as during a rolling upgrade — still opens, and this binary reads
/// and writes on it.
async fn a_database_migrated_by_a_newer_release_opens_and_serves(b: Backend) {
    let ts = test_store(b).await;
    make_prompt(&ts.store, "before").await;
    let checksum = if b == Backend::Postgres { "'\\x00'::bytea" } else { "X'00'" };
    let newer = [
        "CREATE TABLE from_a_newer_release (id integer PRIMARY KEY, note text)".to_owned(),
        "ALTER TABLE traces ADD COLUMN added_later text".to_owned(),
        "ALTER TABLE prompts ADD COLUMN added_with_default integer NOT NULL DEFAULT 7".to_owned(),
        "CREATE INDEX traces_added_later ON traces (added_later)".to_owned(),
        format!(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (99999, 'from a newer release', TRUE, {checksum}, 0)"
        ),
    ];
    run_raw(b, &ts.url, &newer).await;
    drop(ts.store);
    let again = combee::store::connect(&ts.url, 4, std::time::Duration::from_secs(10))
        .await
        .expect("a database with a newer migration opens");
    make_prompt(&again, "after").await;
    assert_eq!(again.list_prompts(None, None, 10).await.unwrap().len(), 2);
    let ids = again.insert_traces(&[trace("before", Some(1)), trace("after", Some(1))]).await.unwrap();
    for id in ids {
        assert!(again.get_trace(id).await.unwrap().is_some(), "trace {id} is read back");
    }
    // The newer migration is still recorded, its table still there.
    let (recorded, rows): (i64, i64) = {
        use sqlx::Connection;
        const COUNT: &str = "SELECT (SELECT count(*) FROM _sqlx_migrations WHERE version = 99999),
                                    (SELECT count(*) FROM from_a_newer_release)";
        match b {
            Backend::Postgres => {
                let mut c = sqlx::PgConnection::connect(&ts.url).await.unwrap();
                sqlx::query_as(COUNT).fetch_one(&mut c).await.unwrap()
            }
            Backend::Sqlite => {
                let mut c = sqlx::SqliteConnection::connect(&ts.url).await.unwrap();
                sqlx::query_as(COUNT).fetch_one(&mut c).await.unwrap()
            }
        }
    };
    assert_eq!((recorded, rows), (1, 0));
}

/// A database the hand-written migrator made (its `schema_migrations`, no
/// `_sqlx_migrations`) opens: the applied migrations are adopted, not run
/// again, the missing one runs, and the data is all there. One whose applied
/// file has changed since is refused, as before.
async fn a_database_from_the_old_migrator_upgrades_in_place(b: Backend) {
    let ts = test_store(b).await;
    make_prompt(&ts.store, "old").await;
    // Back to migration 12 as the old migrator left it (0013 needs the prompts un-evaluated to re-run;
    // 0030 the idempotency keys as they were).
    let mut undo: Vec<String> =
        ["UPDATE prompts SET promotion = 'manual'", "DROP TABLE population_arms", "DROP TABLE _sqlx_migrations"]
            .map(String::from)
            .into();
    let blob = if b == Backend::Postgres { "bytea" } else { "BLOB" };
    undo.extend([
        "ALTER TABLE idempotency_keys DROP COLUMN trace_ids".to_owned(),
        "ALTER TABLE idempotency_keys ADD COLUMN status_code integer".to_owned(),
        format!("ALTER TABLE idempotency_keys ADD COLUMN body {blob}"),
    ]);
    // 0015 and 0016 run again too (0016's `rounds_by_finish` is gone: 0031 replaced it).
    undo.extend(
        [
            "DROP TABLE outcome_rollups",
            "DROP TABLE task_rollups",
            "DROP TABLE round_summaries",
            "DROP INDEX round_traces_by_trace",
            "DROP INDEX webhook_events_by_age",
            "DROP INDEX webhook_deliveries_by_event",
            "DROP INDEX webhook_attempts_by_delivery",
            "DROP INDEX inbound_webhooks_by_age",
        ]
        .map(String::from),
    );
    // 0031 too (it dropped 0016's `rounds_by_finish`; its index on population_arms went with the table).
    undo.extend(
        [
            "DROP INDEX label_moves_by_label",
            "DROP INDEX label_moves_by_kind",
            "DROP INDEX rounds_by_prompt_id",
            "DROP INDEX rounds_detail_to_compact",
            "ALTER TABLE rounds DROP COLUMN detail_compacted_at",
            "DROP TABLE meter_totals",
        ]
        .map(String::from),
    );
    // 0033 too.
    undo.extend(
        [
            "DROP INDEX traces_backlog",
            "DROP INDEX traces_reserved",
            "CREATE INDEX traces_pending_unreserved ON traces (prompt_id, id) WHERE status = 'pending' AND round_id IS NULL",
        ]
        .map(String::from),
    );
    // 0035 and 0036 too.
    undo.extend(
        ["read_as", "refused_answer", "output_format", "concurrency_limit"]
            .map(|c| format!("ALTER TABLE llm_calls DROP COLUMN {c}")),
    );
    undo.extend(
        ["failure_streak", "last_failed_at", "last_failure"].map(|c| format!("ALTER TABLE prompts DROP COLUMN {c}")),
    );
    // 0044 too.
    undo.push("ALTER TABLE traces DROP COLUMN judge_claimed_until".to_owned());
    // 0049 too (0016's `traces_by_prompt_time` is gone already: it dropped it).
    undo.extend(
        [
            "DROP INDEX traces_by_prompt",
            "DROP INDEX traces_settled_by_prompt",
            "CREATE INDEX traces_by_prompt_status ON traces (prompt_id, status, id)",
        ]
        .map(String::from),
    );
    // 0048 too (the rollups' references to prompts went with their tables above).
    undo.extend(
        [
            "DROP TABLE llm_limits",
            "DROP INDEX traces_by_status",
            "CREATE INDEX traces_by_status ON traces (status, id)",
        ]
        .map(String::from),
    );
    // 0047 too: names unique across the server again (its members index goes with the table below).
    undo.extend(["DROP INDEX prompts_by_project_name", "DROP INDEX prompts_by_name"].map(String::from));
    if b == Backend::Postgres {
        undo.push("ALTER TABLE prompts ADD CONSTRAINT prompts_name_key UNIQUE (name)".to_owned());
    }
    // 0042 too (the audit log's column goes with its table below).
    undo.extend(
        [
            "ALTER TABLE prompts DROP COLUMN project",
            "ALTER TABLE api_keys DROP COLUMN project",
            "ALTER TABLE webhook_subscriptions DROP COLUMN project",
            "DROP TABLE projects",
        ]
        .map(String::from),
    );
    // 0041 too (its indexes and triggers go with the tables).
    undo.push("DROP TABLE audit_log".to_owned());
    undo.push(match b {
        Backend::Postgres => "DROP FUNCTION audit_log_append_only()".to_owned(),
        Backend::Sqlite => "DROP TABLE audit_prune_permits".to_owned(),
    });
    // 0038 too (its rollup column went with the table above).
    undo.extend(["DROP INDEX traces_unjudged".to_owned(), "DROP TABLE prompt_evaluators".to_owned()]);
    undo.extend(
        ["judged_at", "judgements", "feedback_source", "judged_by"]
            .map(|c| format!("ALTER TABLE traces DROP COLUMN {c}")),
    );
    // 0039 too (its indexes go with the tables; the runs and gates name the cases).
    undo.extend(
        ["version_gates", "regression_runs", "regression_cases", "regression_gate_settings"]
            .map(|t| format!("DROP TABLE {t}")),
    );
    // 0040 too.
    undo.extend(
        ["llm_spend_holds", "llm_spend_rounds", "llm_spend_days", "prompt_budgets", "budget_reached"]
            .map(|t| format!("DROP TABLE {t}")),
    );
    undo.push("ALTER TABLE rounds DROP COLUMN budget_wait".to_owned());
    // 0043 too (its indexes go with the tables).
    undo.extend(["person_sessions", "members", "oidc_logins"].map(|t| format!("DROP TABLE {t}")));
    undo.extend(old_bookkeeping(b, None));
    run_raw(b, &ts.url, &undo).await;
    let again = combee::store::connect(&ts.url, 4, std::time::Duration::from_secs(10)).await.expect("upgrade");
    assert_eq!(again.get_prompt(&name("old")).await.unwrap().unwrap().promotion, Promotion::Manual);
    assert!(again.population_page(&name("old"), None, 1000).await.unwrap().is_empty(), "0013 ran: its table is back");
    make_prompt(&again, "new").await;
    drop(again);
    // Opening again changes nothing (the adoption happens once).
    let third = combee::store::connect(&ts.url, 4, std::time::Duration::from_secs(10)).await.expect("reopen");
    assert_eq!(third.list_prompts(None, None, 10).await.unwrap().len(), 2);
    drop(third);

    let edited = test_store(b).await;
    let mut undo: Vec<String> = vec!["DROP TABLE _sqlx_migrations".into()];
    undo.extend(old_bookkeeping(b, Some(3)));
    run_raw(b, &edited.url, &undo).await;
    match combee::store::connect(&edited.url, 4, std::time::Duration::from_secs(10)).await {
        Err(StoreError::Migration(why)) => assert!(why.contains("changed after it was applied"), "{why}"),
        Err(e) => panic!("expected a migration error, got {e}"),
        Ok(_) => panic!("an edited migration was adopted"),
    }
}

on_both_stores!(
    a_database_from_the_old_migrator_upgrades_in_place,
    a_database_migrated_by_a_newer_release_opens_and_serves,
    meter_counts_sum_rounds_once_per_prompt,
    llm_limits_are_kept_per_backend_and_model,
    task_rewards_group_by_version_and_task_key,
    label_history_records_every_move_in_order,
    a_live_lease_makes_a_round_claimable_exactly_once,
    concurrent_claimers_take_each_round_once,
    a_lost_lease_fences_the_old_attempt,
    llm_calls_keep_how_their_answer_was_read,
    a_failing_prompt_keeps_its_streak_until_a_success_or_an_operator,
    a_round_that_changed_nothing_succeeds_without_a_version,
    failed_rounds_retry_later_or_give_their_traces_back,
    rounds_charge_traces_only_for_their_own_failures,
    migration_0007_keeps_existing_prompts_on_agent_reflections,
    migration_0030_keeps_replaying_keys_remembered_with_their_answer,
    quarantined_traces_are_never_reserved_and_delete_keeps_provenance,
    prompt_settings_change_by_compare_and_set,
    outbox_events_commit_with_their_change_and_deliveries_are_leased,
    prompts_start_at_version_one_labelled_production,
    concurrent_writers_get_gapless_numbers,
    label_moves_are_compare_and_set,
    traces_are_all_or_nothing,
    trace_filters_and_cursor,
    late_feedback_merges,
    grouped_writes_fail_alone_and_count_once,
    idempotent_ingest_commits_traces_and_key_together,
    concurrent_idempotent_ingests_store_once,
    api_keys_are_stored_hashed_and_revocable,
    key_generation_grows_with_every_revocation,
    failed_traces_can_be_requeued,
    two_processes_write_one_store_and_none_is_refused,
    ui_sessions_expire_and_show_their_key,
    writes_announce_changes,
    list_prompts_pages_by_name_with_summaries,
    projects_scope_lookups_lists_and_event_fan_out,
    two_projects_prompts_of_one_name_keep_apart,
    otlp_spans_merge_into_one_pending_trace,
    concurrent_otlp_parts_make_one_trace,
    version_outcomes_aggregate_rewards_usage_and_late_feedback,
);
