//! A production lifetime on both stores: the outcome rollups answer exactly
//! what a scan of the trace rows says, through random streams of writes and
//! compactions; retention deletes what expired (per prompt), archives it
//! first, compacts old rounds and events, and never touches the label history
//! or the outcomes; `combee prune --dry-run` says what would go.

use std::{collections::BTreeMap, io::Read as _};

use chrono::{DateTime, Utc};
use combee::{
    domain::{
        Feedback, LabelName, NewTrace, Promotion, PromptName, PromptSettings, RetentionOverride, Strategy, Trace,
        VersionContent, VersionSource,
        prompt::{NewPrompt, NewVersion},
        span::{OtlpRemap, OtlpSpan},
        trace::{TraceFilter, TraceLimits, ValidTrace},
    },
    evaluate::outcomes::OutcomeBucket,
    store::{DynStore, OpenRound},
    worker::retention::Pruner,
};
use rand::{Rng, SeedableRng, seq::SliceRandom};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::{Backend, test_store};

fn name(s: &str) -> PromptName {
    PromptName::written(s, "default").unwrap()
}

fn manual(base: &str) -> NewVersion {
    NewVersion {
        parent: None,
        source: VersionSource::Manual,
        round_id: None,
        content: VersionContent { base: base.into(), playbook: None },
        message: "m".into(),
        created_by: "test".into(),
    }
}

async fn make_prompt(s: &DynStore, n: &str, settings: PromptSettings) {
    let p = NewPrompt {
        name: name(n),
        strategy: Strategy::Playbook,
        promotion: Promotion::Auto,
        settings,
        created_by: "test".into(),
    };
    s.create_prompt(p, manual("v1")).await.unwrap();
    s.create_version(&name(n), manual("v2"), &[]).await.unwrap();
}

fn valid(v: Value) -> ValidTrace {
    let t: NewTrace = serde_json::from_value(v).unwrap();
    t.validate(TraceLimits { max_field_bytes: 4096, max_trace_bytes: 16384 }, "default").unwrap()
}

/// A random trace: any version, any mix of rewards (absurd scores too) and usage.
fn random_trace(rng: &mut impl Rng, prompt: &str) -> Value {
    let mut feedback = serde_json::Map::new();
    if rng.gen_bool(0.6) {
        feedback.insert("success".into(), rng.gen_bool(0.5).into());
    }
    match rng.gen_range(0..5) {
        0 | 1 => {
            feedback.insert("score".into(), json!((rng.gen_range(0..=8) as f64) / 8.0));
        }
        2 => {
            feedback.insert("score".into(), json!(1e300));
        }
        _ => {}
    }
    let mut metadata = serde_json::Map::new();
    if rng.gen_bool(0.5) {
        metadata.insert("tokens".into(), json!(rng.gen_range(1..500)));
    }
    if rng.gen_bool(0.3) {
        metadata.insert("cost_usd".into(), json!(rng.gen_range(1..100) as f64 / 1000.0));
    }
    if rng.gen_bool(0.3) {
        metadata.insert("latency_ms".into(), json!("slow"));
    }
    if rng.gen_bool(0.6) {
        metadata.insert("task_key".into(), json!(["a", "b", "c"][rng.gen_range(0..3)]));
    } else if rng.gen_bool(0.2) {
        metadata.insert("task_key".into(), json!(7));
    }
    let version = [Value::Null, json!(1), json!(2)][rng.gen_range(0..3)].clone();
    json!({"prompt": prompt, "prompt_version": version, "input": {"q": rng.r#gen::<u32>()},
           "feedback": feedback, "metadata": metadata})
}

fn random_feedback(rng: &mut impl Rng) -> Feedback {
    Feedback {
        success: rng.gen_bool(0.5).then(|| rng.gen_bool(0.5)),
        score: rng.gen_bool(0.5).then(|| rng.gen_range(0..=4) as f64 / 4.0),
        comment: rng.gen_bool(0.3).then(|| "late".into()),
        ..Default::default()
    }
}

/// Every trace of the prompt, as stored.
async fn all_traces(s: &DynStore, prompt: &str) -> Vec<Trace> {
    let mut out: Vec<Trace> = Vec::new();
    loop {
        let f = TraceFilter { prompt: Some(name(prompt)), before_id: out.last().map(|t| t.id), ..Default::default() };
        let page = s.list_traces(&f, 200).await.unwrap();
        let done = page.len() < 200;
        out.extend(page);
        if done {
            return out;
        }
    }
}

/// The totals per version a scan of the rows gives, as `(traces, with_feedback,
/// success_trials, successes, [score, tokens, cost, latency] × (n, sum, sum of squares))`.
type Totals = (u64, u64, u64, u64, [(u64, f64, f64); 4]);

fn usable(v: Option<f64>) -> Option<f64> {
    v.filter(|x| x.abs() <= 1e12)
}

fn scan(traces: &[Trace]) -> BTreeMap<Option<i64>, Totals> {
    let mut out: BTreeMap<Option<i64>, Totals> = BTreeMap::new();
    for t in traces.iter().filter(|t| t.quarantined_at.is_none()) {
        let e = out.entry(t.prompt_version).or_insert((0, 0, 0, 0, [(0, 0.0, 0.0); 4]));
        let score = usable(t.feedback.score);
        e.0 += 1;
        e.1 += u64::from(t.feedback.success.is_some() || t.feedback.score.is_some());
        e.2 += u64::from(t.feedback.success.is_some());
        e.3 += u64::from(t.feedback.success == Some(true));
        let num = |k: &str| usable(t.metadata.get(k).and_then(Value::as_f64));
        for (m, v) in e.4.iter_mut().zip([score, num("tokens"), num("cost_usd"), num("latency_ms")]) {
            if let Some(v) = v {
                *m = (m.0 + 1, m.1 + v, m.2 + v * v);
            }
        }
    }
    out
}

fn totals(buckets: &[OutcomeBucket]) -> BTreeMap<Option<i64>, Totals> {
    let mut out: BTreeMap<Option<i64>, Totals> = BTreeMap::new();
    for b in buckets {
        let e = out.entry(b.version).or_insert((0, 0, 0, 0, [(0, 0.0, 0.0); 4]));
        e.0 += b.traces;
        e.1 += b.with_feedback;
        e.2 += b.success_trials;
        e.3 += b.successes;
        for (m, x) in e.4.iter_mut().zip([b.score, b.tokens, b.cost_usd, b.latency_ms]) {
            *m = (m.0 + x.count, m.1 + x.sum, m.2 + x.sum_sq);
        }
    }
    out
}

fn same(a: &BTreeMap<Option<i64>, Totals>, b: &BTreeMap<Option<i64>, Totals>) -> bool {
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * (1.0 + x.abs().max(y.abs()));
    a.len() == b.len()
        && a.iter().zip(b).all(|((va, ta), (vb, tb))| {
            va == vb
                && (ta.0, ta.1, ta.2, ta.3) == (tb.0, tb.1, tb.2, tb.3)
                && ta.4.iter().zip(&tb.4).all(|(x, y)| x.0 == y.0 && close(x.1, y.1) && close(x.2, y.2))
        })
}

/// Per (version, task key): rewarded traces and the reward sum, by a scan.
fn scan_tasks(traces: &[Trace]) -> BTreeMap<(i64, String), (u64, f64)> {
    let mut out: BTreeMap<(i64, String), (u64, f64)> = BTreeMap::new();
    for t in traces.iter().filter(|t| t.quarantined_at.is_none()) {
        let (Some(v), Some(key)) = (t.prompt_version, t.metadata.get("task_key").and_then(Value::as_str)) else {
            continue;
        };
        let reward = match t.feedback.success {
            Some(s) => Some(if s { 1.0 } else { 0.0 }),
            None => usable(t.feedback.score),
        };
        if let Some(r) = reward {
            let e = out.entry((v, key.to_owned())).or_default();
            *e = (e.0 + 1, e.1 + r);
        }
    }
    out
}

async fn check(s: &DynStore, prompt: &str, step: &str) {
    let traces = all_traces(s, prompt).await;
    let want = scan(&traces);
    let now = chrono::Utc::now();
    for bucket in [60, 3_600, 86_400] {
        let got = s
            .version_outcomes(
                &name(prompt),
                now - chrono::Duration::days(2),
                now + chrono::Duration::minutes(2),
                bucket,
                None,
            )
            .await
            .unwrap();
        let got = totals(&got);
        assert!(same(&got, &want), "{step}: bucket {bucket}:\n rollups {got:?}\n scan    {want:?}");
    }
    let tasks = s
        .task_rewards(&name(prompt), now - chrono::Duration::hours(1), now + chrono::Duration::minutes(2))
        .await
        .unwrap();
    let got: BTreeMap<(i64, String), (u64, f64)> =
        tasks.into_iter().map(|t| ((t.version, t.task_key), (t.traces, t.reward_sum))).collect();
    let want = scan_tasks(&traces);
    let ok = got.len() == want.len()
        && got.iter().zip(&want).all(|((ka, a), (kb, b))| ka == kb && a.0 == b.0 && (a.1 - b.1).abs() < 1e-9);
    assert!(ok, "{step}: task rewards\n rollups {got:?}\n scan    {want:?}");
}

/// Random streams of trace batches, late feedback, quarantines (one and by
/// prompt), releases, deletions and OTLP re-maps, with compactions in between:
/// after every step the rollups answer what a scan of the rows does.
async fn rollups_equal_a_scan_of_the_rows(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    for p in ["p", "q"] {
        make_prompt(&s, p, PromptSettings::default()).await;
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(20_251_201);
    let mut ids: Vec<uuid::Uuid> = Vec::new();
    let mut otel = 0u32;
    for step in 0..60 {
        let prompt = ["p", "q"][rng.gen_range(0..2)];
        let what = rng.gen_range(0..9);
        match what {
            0..=2 => {
                let batch: Vec<ValidTrace> =
                    (0..rng.gen_range(1..12)).map(|_| valid(random_trace(&mut rng, prompt))).collect();
                ids.extend(s.insert_traces(&batch).await.unwrap());
            }
            3 | 4 if !ids.is_empty() => {
                let id = *ids.choose(&mut rng).unwrap();
                s.add_feedback(id, random_feedback(&mut rng)).await.unwrap();
            }
            5 if !ids.is_empty() => {
                let id = *ids.choose(&mut rng).unwrap();
                if rng.gen_bool(0.5) {
                    s.quarantine_trace(id, "suspect").await.unwrap();
                } else {
                    s.release_trace(id).await.unwrap();
                }
            }
            6 => {
                let f = TraceFilter { prompt: Some(name(prompt)), ..Default::default() };
                if rng.gen_bool(0.3) {
                    s.quarantine_traces(&f, "burst").await.unwrap();
                } else if let Some(id) = ids.choose(&mut rng).copied() {
                    s.delete_trace(id).await.unwrap();
                }
            }
            7 => {
                // An OTLP trace id: made, then re-mapped with other feedback.
                otel += 1;
                let trace_id = format!("{otel:032x}");
                let t1 = random_trace(&mut rng, prompt);
                let t2 = random_trace(&mut rng, prompt);
                for (span, t) in [("a", &t1), ("b", &t2)] {
                    let body = serde_json::to_vec(t).unwrap();
                    let span = OtlpSpan { span_id: format!("{:016x}", span.as_bytes()[0]), body };
                    let remap = |bodies: &[&[u8]]| {
                        let last: Value = serde_json::from_slice(bodies[bodies.len() - 1]).unwrap();
                        OtlpRemap::Mapped(Box::new(valid(last)))
                    };
                    s.merge_otlp_spans(&trace_id, &[span], &remap).await.unwrap();
                }
            }
            _ => {
                s.compact_rollups(rng.gen_range(1..50)).await.unwrap();
            }
        }
        if step % 6 == 5 {
            check(&s, prompt, &format!("step {step}")).await;
        }
    }
    for p in ["p", "q"] {
        check(&s, p, "end").await;
    }
    tiers_agree(b, &ts.url).await;
    // Compacted to one row per key, the answers are the same.
    while s.compact_rollups(1_000).await.unwrap() > 0 {}
    for p in ["p", "q"] {
        check(&s, p, "compacted").await;
    }
}

/// Every tier of both rollup tables holds the same number of traces, each
/// row at a start its width divides: the reads above answer recent windows
/// from second rows alone, so this is what holds the minute, hour and day
/// rows to the same deltas.
async fn tiers_agree(b: Backend, url: &str) {
    use sqlx::Connection;
    for table in ["outcome_rollups", "task_rollups"] {
        let text = format!(
            "SELECT CAST(width AS bigint) AS width, CAST(sum(traces) AS bigint) AS traces,
                    CAST(sum(CASE WHEN start_secs % width = 0 THEN 0 ELSE 1 END) AS bigint) AS misaligned
             FROM {table} GROUP BY width ORDER BY width"
        );
        let rows: Vec<(i64, i64, i64)> = match b {
            Backend::Postgres => {
                sqlx::query_as(&text).fetch_all(&mut sqlx::PgConnection::connect(url).await.unwrap()).await
            }
            Backend::Sqlite => {
                sqlx::query_as(&text).fetch_all(&mut sqlx::SqliteConnection::connect(url).await.unwrap()).await
            }
        }
        .unwrap();
        let widths: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let want: &[i64] = if table == "outcome_rollups" { &[1, 60, 3600, 86400] } else { &[1, 60] };
        assert_eq!(widths, want, "{table}: {rows:?}");
        assert!(rows.iter().all(|r| r.1 == rows[0].1 && r.2 == 0), "{table}: {rows:?}");
    }
}

/// The totals of `traces` in `[from, until)` by a scan, and what the rollups
/// answer for the same window (series buckets of a minute and of an hour,
/// and the per-task rewards) are the same.
async fn window_is_exact(s: &DynStore, traces: &[Trace], from: DateTime<Utc>, until: DateTime<Utc>, what: &str) {
    let inside: Vec<Trace> = traces.iter().filter(|t| t.created_at >= from && t.created_at < until).cloned().collect();
    let want = scan(&inside);
    for bucket in [60, 3_600] {
        let got = totals(&s.version_outcomes(&name("p"), from, until, bucket, None).await.unwrap());
        assert!(same(&got, &want), "{what}, bucket {bucket}:\n rollups {got:?}\n scan    {want:?}");
    }
    let got: BTreeMap<(i64, String), (u64, f64)> = s
        .task_rewards(&name("p"), from, until)
        .await
        .unwrap()
        .into_iter()
        .map(|t| ((t.version, t.task_key), (t.traces, t.reward_sum)))
        .collect();
    let want = scan_tasks(&inside);
    let ok = got.len() == want.len()
        && got.iter().zip(&want).all(|((ka, a), (kb, b))| ka == kb && a.0 == b.0 && (a.1 - b.1).abs() < 1e-9);
    assert!(ok, "{what}: task rewards\n rollups {got:?}\n scan    {want:?}");
}

/// A burst of the last few seconds is counted exactly from rollup rows alone
/// (no partial minute is read from the traces): 2,000 random traces in
/// batches on both sides of a window edge at a whole second, late feedback
/// on some, quarantines on others and one released. Before and after
/// compaction, the whole burst, its part before the edge, its part from the
/// edge and a window ending now each answer what a scan of the rows says.
async fn a_burst_of_the_last_seconds_is_counted_exactly(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    make_prompt(&s, "p", PromptSettings::default()).await;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(20_261_127);
    let started = chrono::Utc::now();
    let mut ids: Vec<uuid::Uuid> = Vec::new();
    let mut burst = async |rng: &mut rand_chacha::ChaCha8Rng| {
        for _ in 0..10 {
            let batch: Vec<ValidTrace> = (0..100).map(|_| valid(random_trace(rng, "p"))).collect();
            ids.extend(s.insert_traces(&batch).await.unwrap());
        }
    };
    burst(&mut rng).await;
    // The edge: the next whole second.
    let now = chrono::Utc::now();
    let edge = DateTime::from_timestamp(now.timestamp() + 1, 0).unwrap();
    tokio::time::sleep((edge - now).to_std().unwrap() + std::time::Duration::from_millis(5)).await;
    burst(&mut rng).await;
    let (late, quarantined): (Vec<_>, Vec<_>) = {
        let picked: Vec<uuid::Uuid> = ids.choose_multiple(&mut rng, 250).copied().collect();
        (picked[..200].to_vec(), picked[200..].to_vec())
    };
    for id in &late {
        s.add_feedback(*id, random_feedback(&mut rng)).await.unwrap();
    }
    for id in &quarantined {
        s.quarantine_trace(*id, "suspect").await.unwrap();
    }
    s.release_trace(quarantined[0]).await.unwrap();
    let traces = all_traces(&s, "p").await;
    assert_eq!(traces.len(), 2_000);
    assert!(traces.iter().any(|t| t.created_at < edge) && traces.iter().any(|t| t.created_at >= edge));
    for step in ["delta rows", "compacted"] {
        if step == "compacted" {
            while s.compact_rollups(1_000).await.unwrap() > 0 {}
        }
        let hour_ago = started - chrono::Duration::hours(1);
        window_is_exact(&s, &traces, hour_ago, chrono::Utc::now(), &format!("{step}: ending now")).await;
        window_is_exact(&s, &traces, hour_ago, edge, &format!("{step}: before the edge")).await;
        let later = edge + chrono::Duration::minutes(5);
        window_is_exact(&s, &traces, edge, later, &format!("{step}: from the edge")).await;
        window_is_exact(&s, &traces, edge - chrono::Duration::seconds(1), edge, &format!("{step}: the second before"))
            .await;
    }
}

/// A round of the prompt taking its whole backlog.
fn whole_backlog(prompt: &str) -> OpenRound {
    OpenRound {
        prompt: name(prompt),
        trigger: combee::domain::round::RoundTrigger::Api,
        method: combee::domain::Method::Combee,
        batch: 1_000,
        min_traces: 1,
        seed: 1,
        inbound_webhook_id: None,
        judge_wait: None,
        base_version: None,
    }
}

/// Consumes every pending trace of the prompt through a round.
async fn consume(s: &DynStore, prompt: &str) -> uuid::Uuid {
    let req = whole_backlog(prompt);
    s.open_round(&req).await.unwrap().expect("a round opens");
    let c = s.claim_round("w", std::time::Duration::from_secs(60)).await.unwrap().expect("a round to claim");
    let reflection: combee::domain::Reflection = serde_json::from_value(json!({"key_insight": "x"})).unwrap();
    for t in &c.traces {
        s.save_reflection(c.round.id, t.id, &reflection, false).await.unwrap();
    }
    let call = combee::llm::LlmCall {
        role: combee::llm::LlmRole::Reflector,
        model: "m".into(),
        prompt_tokens: 10,
        completion_tokens: 5,
        cost_usd: 0.5,
        latency_ms: 3,
        retries: 1,
        error: None,
        read: None,
        refused_answer: None,
        output_format: None,
        concurrency_limit: None,
    };
    s.record_llm_call(c.round.id, c.round.attempt, &call).await.unwrap();
    let mut v = manual("learned");
    v.source = VersionSource::Learned;
    let detail = json!({"group_outputs": [{"group": 0, "traces": [], "output": {"operations": []}}], "phases": {}});
    let end = combee::store::RoundEnd {
        detail,
        sample_secs: Some(1.5),
        ..crate::common::published(&c, v, LabelName::candidate())
    };
    s.finish_round(&end).await.unwrap();
    c.round.id
}

/// Retention on both stores: expired consumed traces go (archived first, with
/// their reflections and spans), a prompt's own longer retention keeps its
/// traces, quarantined ones wait for their own horizon, old rounds keep only
/// their summary, events and idempotency keys go; the label history and the
/// per-version outcomes stay, and the dry run said exactly what went.
async fn retention_deletes_what_expired_and_keeps_the_rest(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    let metrics = combee::telemetry::metrics_handle();
    make_prompt(&s, "p", PromptSettings::default()).await;
    let keep = RetentionOverride { consumed_days: Some(365), ..Default::default() };
    make_prompt(&s, "q", PromptSettings { retention: keep, ..Default::default() }).await;
    let batch = |p: &str, n: usize| -> Vec<ValidTrace> {
        (0..n)
            .map(|i| {
                valid(json!({"prompt": p, "prompt_version": 1, "input": {"i": i}, "feedback": {"success": i % 2 == 0}}))
            })
            .collect()
    };
    let mut p_ids = s.insert_traces(&batch("p", 7)).await.unwrap();
    // An OTLP trace of p, with its spans.
    let remap = |bodies: &[&[u8]]| OtlpRemap::Mapped(Box::new(valid(serde_json::from_slice(bodies[0]).unwrap())));
    let body = serde_json::to_vec(&json!({"prompt": "p", "prompt_version": 2, "input": {"otel": 1}})).unwrap();
    let merged =
        s.merge_otlp_spans(&"a".repeat(32), &[OtlpSpan { span_id: "1".repeat(16), body }], &remap).await.unwrap();
    let combee::domain::span::OtlpMerge::Created { trace: otel_trace, .. } = merged else { panic!("{merged:?}") };
    p_ids.push(otel_trace);
    let q_ids = s.insert_traces(&batch("q", 3)).await.unwrap();
    let round = consume(&s, "p").await;
    // The round's overload-meter record, and 600 more controller samples of it
    // (as a busy prompt gathers them): 601 of p's, q's one to come.
    let counts = combee::store::MeterCounts { size_min: 4, marked: 6, recaptured: 2, rounds: 1 };
    s.record_meter_counts(&name("p"), round, &[counts]).await.unwrap();
    exec_raw(
        b,
        &ts.url,
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 600)
         INSERT INTO controller_samples (prompt_id, round_id, batch_size, round_secs, created_at)
         SELECT s.prompt_id, s.round_id, 8, 2.0, s.created_at FROM controller_samples s, n",
    )
    .await;
    consume(&s, "q").await;
    // Pending (never deleted) and quarantined ones of p.
    let pending = s.insert_traces(&batch("p", 2)).await.unwrap();
    s.quarantine_trace(pending[1], "suspect").await.unwrap();
    let key = combee::domain::trace::IdempotencyKey { owner: uuid::Uuid::nil(), key: "k", request_hash: "h" };
    s.insert_traces_idempotent(key, &batch("p", 1)).await.unwrap();

    let history = |p: &'static str| {
        let s = s.clone();
        async move { s.label_history(&name(p), None, None, 100).await.unwrap().len() }
    };
    let history_before = (history("p").await, history("q").await);
    let now = chrono::Utc::now();
    // Whole hours, read from the hour rows (minute rows are pruned after days, and this test travels in time).
    let hour =
        |t: chrono::DateTime<chrono::Utc>| chrono::DateTime::from_timestamp(t.timestamp() / 3_600 * 3_600, 0).unwrap();
    let (from, until) = (hour(now) - chrono::Duration::hours(1), hour(now) + chrono::Duration::hours(2));
    let outcomes = |p: &'static str| {
        let s = s.clone();
        async move { totals(&s.version_outcomes(&name(p), from, until, 3_600, None).await.unwrap()) }
    };
    let outcomes_before = (outcomes("p").await, outcomes("q").await);

    let archive = tempfile::tempdir().unwrap();
    let mut settings = combee::config::RetentionSettings { batch_size: 3, batch_pause_ms: 0, ..Default::default() };
    settings.archive_dir = archive.path().display().to_string();
    let pruner = Pruner::new(s.clone(), settings, 24);
    // A month and a day later: p's consumed traces expired, q's (a year) did not.
    let later = now + chrono::Duration::days(31);
    let plan = pruner.dry_run(later).await.unwrap();
    assert_eq!(plan.traces["p"]["consumed"], 8, "{plan:?}");
    assert_eq!((plan.traces["q"]["consumed"], plan.traces["p"]["quarantined"]), (0, 0), "{plan:?}");
    assert_eq!((plan.other["round_details"], plan.other["idempotency_keys"]), (2, 1), "{plan:?}");
    assert!(plan.other["webhook_events"] > 0, "{plan:?}");
    assert_eq!(s.list_traces(&TraceFilter::default(), 100).await.unwrap().len(), 14, "the dry run deleted nothing");

    let done = pruner.pass(later, &CancellationToken::new()).await.unwrap();
    assert_eq!(done.traces.get("p").map(|k| k["consumed"]), Some(8), "{done:?}");
    assert_eq!(done.total_traces(), 8, "{done:?}");
    assert_eq!((done.reflections, done.round_links, done.otlp_spans, done.archived), (8, 8, 1, 8), "{done:?}");
    assert_eq!(done.other["round_details"], plan.other["round_details"]);
    assert_eq!(done.other["webhook_events"], plan.other["webhook_events"]);
    for id in &p_ids {
        assert!(s.get_trace(*id).await.unwrap().is_none(), "consumed and expired: deleted");
    }
    for id in q_ids.iter().chain(&pending) {
        assert!(s.get_trace(*id).await.unwrap().is_some(), "kept: a year's retention, pending, or quarantined");
    }
    // The archive holds exactly the deleted traces, as the API shows them.
    let mut archived = Vec::new();
    for entry in std::fs::read_dir(archive.path().join("p")).unwrap() {
        let mut text = String::new();
        flate2::read::MultiGzDecoder::new(std::fs::File::open(entry.unwrap().path()).unwrap())
            .read_to_string(&mut text)
            .unwrap();
        archived.extend(text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()));
    }
    let mut got: Vec<uuid::Uuid> = archived.iter().map(|t| t["id"].as_str().unwrap().parse().unwrap()).collect();
    got.sort();
    p_ids.sort();
    assert_eq!(got, p_ids);
    assert!(archived.iter().all(|t| t["prompt"] == "p" && t["status"] == "consumed" && t["input"].is_object()));
    // Rounds keep their summary; the label history and the outcomes are untouched.
    let summary = s.round_summary(round).await.unwrap().expect("a compacted round keeps its usage");
    assert_eq!((summary.calls, summary.prompt_tokens, summary.retries, summary.cost_usd), (1, 10, 1, 0.5));
    assert!(s.round_calls(round).await.unwrap().is_empty());
    let detail = s.get_round(round).await.unwrap().unwrap().detail;
    assert!(detail.get("group_outputs").is_none() && detail.get("phases").is_some(), "{detail}");
    assert_eq!((history("p").await, history("q").await), history_before);
    assert_eq!((outcomes("p").await, outcomes("q").await), outcomes_before, "outcomes outlive their traces");
    // The compacted rounds' meter records went, the meter's sums did not; of
    // their controller samples, each prompt keeps its newest 500.
    assert_eq!(count_raw(b, &ts.url, "SELECT count(*) FROM meter_counts").await, 0);
    assert_eq!(s.meter_counts(&name("p")).await.unwrap(), [counts]);
    assert_eq!(s.controller_samples(&name("p"), 1_000).await.unwrap().len(), 500);
    assert_eq!(s.controller_samples(&name("q"), 1_000).await.unwrap().len(), 1, "a quiet prompt keeps its profile");
    // A second pass finds nothing; a quarter later the quarantined trace goes too.
    assert_eq!(pruner.pass(later, &CancellationToken::new()).await.unwrap().total_traces(), 0);
    let quarter = pruner.pass(now + chrono::Duration::days(91), &CancellationToken::new()).await.unwrap();
    assert_eq!(quarter.traces["p"]["quarantined"], 1, "{quarter:?}");
    assert!(s.get_trace(pending[0]).await.unwrap().is_some(), "pending traces are never deleted");
    let text = metrics.render();
    assert!(text.contains("combee_retention_deleted_total{what=\"traces\"}"), "counted in /metrics");
}

/// `combee prune --dry-run` lists what would go, per prompt; `combee prune` deletes it.
#[test]
fn prune_dry_run_says_what_would_go_then_prune_deletes_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("combee.db").display());
    let rt = tokio::runtime::Runtime::new().unwrap();
    std::fs::write(dir.path().join("default.toml"), "").unwrap();
    rt.block_on(async {
        let s = combee::store::connect(&url, 2, std::time::Duration::from_secs(10)).await.unwrap();
        make_prompt(&s, "old", PromptSettings::default()).await;
    });
    // Two traces consumed forty days ago (time-ordered ids of that day, as the server makes them).
    let at = chrono::Utc::now() - chrono::Duration::days(40);
    let ids: Vec<uuid::Uuid> = (0..2)
        .map(|i| {
            let ts = uuid::Timestamp::from_unix(uuid::NoContext, at.timestamp() as u64 + i, 0);
            uuid::Uuid::new_v7(ts)
        })
        .collect();
    rt.block_on(async {
        use sqlx::Connection;
        let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
        for id in &ids {
            sqlx::query(
                "INSERT INTO traces (id, prompt_id, prompt_version, status, input, trajectory, output, feedback, metadata,
                                     created_at, updated_at)
                 SELECT ?1, id, 1, 'consumed', '{}', 'null', 'null', '{}', '{}', ?2, ?2 FROM prompts WHERE name = 'old'",
            )
            .bind(id.to_string())
            .bind(at.timestamp_micros())
            .execute(&mut c)
            .await
            .unwrap();
        }
    });
    let combee = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_combee"))
            .args(args)
            .env("COMBEE_CONFIG_DIR", dir.path())
            .env("DATABASE_URL", &url)
            .env_remove("COMBEE_ENV")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let plan = combee(&["prune", "--dry-run"]);
    assert!(plan.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["old", "2", "0", "0"]), "{plan}");
    assert!(plan.contains("traces: would delete 2"), "{plan}");
    let json: Value = serde_json::from_str(&combee(&["prune", "--dry-run", "--json"])).unwrap();
    assert_eq!(json["report"]["traces"]["old"]["consumed"], 2);
    let done = combee(&["prune"]);
    assert!(done.contains("traces: deleted 2"), "{done}");
    rt.block_on(async {
        let s = combee::store::connect(&url, 2, std::time::Duration::from_secs(10)).await.unwrap();
        for id in ids {
            assert!(s.get_trace(id).await.unwrap().is_none());
        }
    });
}

on_both_stores!(
    rollups_equal_a_scan_of_the_rows,
    a_burst_of_the_last_seconds_is_counted_exactly,
    retention_deletes_what_expired_and_keeps_the_rest
);

/// The rollup tables churn by design (delta rows folded every few seconds), so
/// Postgres vacuums them at 1 % of their rows, not the default 20 %: the dead
/// rows every windowed read walks stay a few thousand, not hundreds of thousands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_vacuums_the_churning_rollup_tables_early() {
    use sqlx::Connection;
    let ts = test_store(Backend::Postgres).await;
    let mut c = sqlx::PgConnection::connect(&ts.url).await.unwrap();
    for table in ["outcome_rollups", "task_rollups", "traces"] {
        let options: Option<Vec<String>> = sqlx::query_scalar("SELECT reloptions FROM pg_class WHERE relname = $1")
            .bind(table)
            .fetch_one(&mut c)
            .await
            .unwrap();
        let options = options.unwrap_or_default();
        if table == "traces" {
            // Retention deletes its oldest rows, far from what the windowed reads touch: the defaults.
            assert!(options.is_empty(), "{table}: {options:?}");
        } else {
            assert_eq!(options, ["autovacuum_vacuum_scale_factor=0.01", "autovacuum_vacuum_threshold=1000"], "{table}");
        }
    }
}

/// The scheduler reads every prompt's backlog on each pass, and a round that
/// gives up returns its reserved traces: both cost what waits or is reserved,
/// never the history. Here 1,990 older traces (1,970 consumed, 20
/// quarantined, which stay pending until retention deletes them) sit beside a
/// backlog of 10; the rows Postgres's own statistics say five backlog reads, a
/// round's opening, claim and give-up read from `traces` and its indexes stay
/// a few hundred (a walk through the history reads about 2,000 each time).
/// Each trace carries a 1 KB answer, as an agent's do: Postgres weighs a walk
/// by the table's pages, and a table of tiny rows is one a walk suits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backlog_reads_cost_the_backlog_not_the_history() {
    use combee::store::{RoundFailure, TraceCharges};
    use sqlx::Connection;
    let crate::common::TestStore { store, url, dir: _dir } = test_store(Backend::Postgres).await;
    make_prompt(&store, "p", PromptSettings::default()).await;
    let answer = "an answer of an agent ".repeat(48);
    for b in 0..40 {
        let batch: Vec<ValidTrace> = (0..50)
            .map(|i| valid(json!({"prompt": "p", "input": {"q": b * 50 + i}, "output": {"answer": answer}})))
            .collect();
        store.insert_traces(&batch).await.unwrap();
    }
    drop(store);
    let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "WITH o AS (SELECT id, row_number() OVER (ORDER BY id) AS n FROM traces)
         UPDATE traces t SET created_at = t.created_at - interval '30 days',
                status = CASE WHEN o.n <= 1970 THEN 'consumed' ELSE t.status END,
                quarantined_at = CASE WHEN o.n > 1970 THEN now() END
         FROM o WHERE o.id = t.id AND o.n <= 1990",
    )
    .execute(&mut c)
    .await
    .unwrap();
    sqlx::raw_sql("VACUUM ANALYZE traces").execute(&mut c).await.unwrap();
    // The set-up's own reads are counted when its backend exits, before the
    // first reading below, however late it would have flushed them otherwise.
    c.close().await.unwrap();
    let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
    let before = reads_of(&mut c, "traces").await;
    let store = combee::store::connect(&url, 4, std::time::Duration::from_secs(10)).await.unwrap();
    for _ in 0..3 {
        let backlog = store.backlogs().await.unwrap();
        let p = backlog.iter().find(|b| b.prompt.name.as_str() == "p").unwrap();
        assert_eq!(p.pending, 10, "the quarantined and consumed traces are not the backlog");
        assert!(p.oldest.is_some_and(|t| t > chrono::Utc::now() - chrono::Duration::days(1)), "{:?}", p.oldest);
    }
    store.open_round(&whole_backlog("p")).await.unwrap().expect("a round opens");
    let claimed = store.claim_round("test", std::time::Duration::from_secs(30)).await.unwrap().unwrap();
    assert_eq!(claimed.traces.len(), 10);
    let give_up = RoundFailure::GiveUp { charges: TraceCharges::default() };
    store.fail_round(claimed.round.id, claimed.round.attempt, "test", give_up).await.unwrap();
    assert_eq!(store.backlogs().await.unwrap()[0].pending, 10, "the round's traces are back");
    drop(store);
    let reads = reads_of(&mut c, "traces").await.since(before);
    assert!(
        reads.rows() <= 400,
        "the backlog reads read {} rows of traces and their indexes for a backlog of 10: {reads:?}",
        reads.rows()
    );
}

/// The batch-size controller reads a prompt's newest samples on every
/// scheduling pass: that read walks the prompt's own samples back and stops
/// at its limit, however many samples other prompts hold. Here a quiet
/// prompt's one sample is older than a busy prompt's 20,000; a walk back
/// through every prompt's samples (as Postgres's generic plan for a prepared
/// statement once did) reads them all on each call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_read_costs_its_prompts_samples_not_every_prompts() {
    use sqlx::Connection;
    let crate::common::TestStore { store, url, dir: _dir } = test_store(Backend::Postgres).await;
    for p in ["quiet", "busy"] {
        make_prompt(&store, p, PromptSettings::default()).await;
        store.insert_traces(&[valid(json!({"prompt": p, "input": {"q": 1}}))]).await.unwrap();
        consume(&store, p).await;
    }
    drop(store);
    let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO controller_samples (prompt_id, round_id, batch_size, round_secs, created_at)
         SELECT s.prompt_id, s.round_id, 8, 2.0, s.created_at FROM controller_samples s, generate_series(1, 20000)
         WHERE s.prompt_id = (SELECT id FROM prompts WHERE name = 'busy')",
    )
    .execute(&mut c)
    .await
    .unwrap();
    sqlx::raw_sql("VACUUM ANALYZE controller_samples").execute(&mut c).await.unwrap();
    let ((), rows) = rows_read_by(&mut c, &url, "controller_samples", async |store| {
        for _ in 0..12 {
            assert_eq!(store.controller_samples(&name("quiet"), 500).await.unwrap().len(), 1);
        }
        assert_eq!(store.controller_samples(&name("busy"), 500).await.unwrap().len(), 500);
    })
    .await;
    assert!(rows <= 12 * 5 + 600, "13 reads of at most 500 samples read {rows} rows of samples and their indexes");
}

/// A prompt that learns all day has thousands of versions in a week's window;
/// a read of a few of them (the newest, the labelled, a rater's live arms)
/// skips the others' rollup rows inside the window index. Here 300 versions
/// have traffic in the last hour: the read of 4 of them reads a few dozen
/// rollup rows, the read of all of them every row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_of_a_few_versions_skips_the_others_rollups() {
    use sqlx::Connection;
    let crate::common::TestStore { store, url, dir: _dir } = test_store(Backend::Postgres).await;
    make_prompt(&store, "p", PromptSettings::default()).await;
    for i in 3..=300 {
        store.create_version(&name("p"), manual(&format!("v{i}")), &[]).await.unwrap();
    }
    let traces: Vec<ValidTrace> = (1..=300)
        .map(|v| valid(json!({"prompt": "p", "prompt_version": v, "input": {"q": v}, "feedback": {"success": true}})))
        .collect();
    store.insert_traces(&traces).await.unwrap();
    make_prompt(&store, "other", PromptSettings::default()).await;
    drop(store);
    let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
    // Other prompts' history around it, as a real table has (so Postgres plans as it would there).
    sqlx::raw_sql(
        "INSERT INTO outcome_rollups (prompt_id, version, width, start_secs, traces, with_feedback, success_trials,
                                      successes, score_n, score_sum, score_sq, tokens_n, tokens_sum, tokens_sq, cost_n,
                                      cost_sum, cost_sq, latency_n, latency_sum, latency_sq)
         SELECT (SELECT id FROM prompts WHERE name = 'other'), version, width, start_secs - n * width, traces,
                with_feedback, success_trials, successes, score_n, score_sum, score_sq, tokens_n, tokens_sum, tokens_sq,
                cost_n, cost_sum, cost_sq, latency_n, latency_sum, latency_sq
         FROM outcome_rollups, generate_series(1, 100) n",
    )
    .execute(&mut c)
    .await
    .unwrap();
    sqlx::raw_sql("VACUUM ANALYZE outcome_rollups").execute(&mut c).await.unwrap();
    // Whole minutes and hours from the rollups; the window's last partial minute from the traces.
    let (until, from) = (chrono::Utc::now(), chrono::Utc::now() - chrono::Duration::days(7));
    let until = until + chrono::Duration::hours(2);
    let traces = |got: Vec<OutcomeBucket>| got.iter().map(|b| b.traces).sum::<u64>();
    let (all, all_rows) = rows_read_by(&mut c, &url, "outcome_rollups", async |store| {
        traces(store.version_outcomes(&name("p"), from, until, 3_600, None).await.unwrap())
    })
    .await;
    let (few, few_rows) = rows_read_by(&mut c, &url, "outcome_rollups", async |store| {
        traces(store.version_outcomes(&name("p"), from, until, 3_600, Some(&[1, 298, 299, 300])).await.unwrap())
    })
    .await;
    assert_eq!((all, few), (300, 4));
    assert!(all_rows >= 300, "every version's rows: {all_rows}");
    assert!(few_rows <= 40, "four versions' rows: {few_rows} rows read of the rollups and their indexes");
}

/// Outcome reads never read the trace rows, however many traces arrived in
/// the minutes at a window's edges: here 5,000 in the last seconds, read by a
/// window ending now (as the metrics answer's and the rater's do), one of a
/// few versions, the per-task rewards, and one starting a fraction of a
/// second into a second. (Partial minutes read from the traces, as before,
/// read each of them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_reads_never_read_the_trace_rows() {
    use sqlx::Connection;
    let crate::common::TestStore { store, url, dir: _dir } = test_store(Backend::Postgres).await;
    make_prompt(&store, "p", PromptSettings::default()).await;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    for _ in 0..50 {
        let batch: Vec<ValidTrace> = (0..100).map(|_| valid(random_trace(&mut rng, "p"))).collect();
        store.insert_traces(&batch).await.unwrap();
    }
    drop(store);
    let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("VACUUM ANALYZE traces").execute(&mut c).await.unwrap();
    let (counted, rows) = rows_read_by(&mut c, &url, "traces", async |store| {
        let (p, now) = (name("p"), chrono::Utc::now());
        let traces = |got: Vec<OutcomeBucket>| got.iter().map(|b| b.traces).sum::<u64>();
        let hour = chrono::Duration::hours(1);
        let all = traces(store.version_outcomes(&p, now - hour, now, 60, None).await.unwrap());
        let some = traces(store.version_outcomes(&p, now - hour, now, 600, Some(&[1, 2])).await.unwrap());
        let tasks: u64 = store.task_rewards(&p, now - hour, now).await.unwrap().iter().map(|t| t.traces).sum();
        let odd = now - chrono::Duration::microseconds(2_500_000);
        let recent = traces(store.version_outcomes(&p, odd, now, 60, None).await.unwrap());
        (all, some, tasks, recent)
    })
    .await;
    assert_eq!(counted.0, 5_000, "{counted:?}");
    assert!(counted.1 > 0 && counted.1 < 5_000 && counted.2 > 0, "{counted:?}");
    assert!(counted.3 <= 5_000, "{counted:?}");
    assert_eq!(rows, 0, "the outcome reads read {rows} rows of traces and their indexes");
}

/// A page of a prompt's versions, newest first, walks the prompt's versions
/// back from the newest and stops at the page: the metrics answer reads the
/// newest version on every request, and a prompt that learns all day has
/// thousands. Here 400 versions; a sort of all of them reads each one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_versions_costs_the_page_not_the_history() {
    use sqlx::Connection;
    let crate::common::TestStore { store, url, dir: _dir } = test_store(Backend::Postgres).await;
    for p in ["p", "other"] {
        make_prompt(&store, p, PromptSettings::default()).await;
        for i in 3..=400 {
            store.create_version(&name(p), manual(&format!("v{i}")), &[]).await.unwrap();
        }
    }
    drop(store);
    let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("VACUUM ANALYZE versions").execute(&mut c).await.unwrap();
    let ((), rows) = rows_read_by(&mut c, &url, "versions", async |store| {
        for _ in 0..12 {
            let newest = store.list_versions(&name("p"), None, 1).await.unwrap();
            assert_eq!(newest.iter().map(|v| v.number).collect::<Vec<_>>(), [400]);
        }
        let page = store.list_versions(&name("p"), Some(100), 10).await.unwrap();
        assert_eq!(page.iter().map(|v| v.number).collect::<Vec<_>>(), (90..100).rev().collect::<Vec<_>>());
    })
    .await;
    assert!(rows <= 13 * 12, "13 pages of at most 10 versions read {rows} rows of versions and their indexes");
}

/// What `reads` return, and the rows of `table` and its indexes they read, as
/// Postgres's own statistics count them. The reads run on a store of their
/// own with two connections, one of them its change listener: every read on
/// the other, so a prepared statement repeats there often enough for
/// Postgres to try its generic plan.
async fn rows_read_by<T>(
    c: &mut sqlx::PgConnection,
    url: &str,
    table: &str,
    reads: impl AsyncFnOnce(&DynStore) -> T,
) -> (T, i64) {
    let before = rows_read(c, table).await;
    let store = combee::store::connect(url, 2, std::time::Duration::from_secs(10)).await.unwrap();
    let out = reads(&store).await;
    drop(store);
    (out, rows_read(c, table).await - before)
}

/// Rows read from `table` and its indexes so far, once every other backend of
/// the database has exited (a backend's statistics are flushed when it does).
async fn rows_read(c: &mut sqlx::PgConnection, table: &str) -> i64 {
    reads_of(c, table).await.rows()
}

/// What Postgres's statistics count of the reads of a table and its indexes.
#[derive(Clone, Copy, Debug)]
struct Reads {
    seq_scans: i64,
    seq_rows: i64,
    index_scans: i64,
    index_rows: i64,
}

impl Reads {
    fn rows(self) -> i64 {
        self.seq_rows + self.index_rows
    }

    fn since(self, before: Reads) -> Reads {
        Reads {
            seq_scans: self.seq_scans - before.seq_scans,
            seq_rows: self.seq_rows - before.seq_rows,
            index_scans: self.index_scans - before.index_scans,
            index_rows: self.index_rows - before.index_rows,
        }
    }
}

/// [`rows_read`], by kind of read.
async fn reads_of(c: &mut sqlx::PgConnection, table: &str) -> Reads {
    let others = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()";
    for _ in 0..100 {
        if sqlx::query_scalar::<_, i64>(others).fetch_one(&mut *c).await.unwrap() == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // This connection's own reads (the set-up's) are counted only once it
    // flushes them, which a backend may put off for up to a second after its
    // last flush: force it now, so that none lands in a later reading.
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *c).await.unwrap();
    let (seq_scans, seq_rows, index_scans, index_rows): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT t.seq_scan, t.seq_tup_read,
                (SELECT coalesce(sum(idx_scan), 0) FROM pg_stat_user_indexes WHERE relname = $1)::bigint,
                (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes WHERE relname = $1)::bigint
         FROM pg_stat_user_tables t WHERE t.relname = $1",
    )
    .bind(table)
    .fetch_one(&mut *c)
    .await
    .unwrap();
    Reads { seq_scans, seq_rows, index_scans, index_rows }
}

/// Runs a statement straight on the database (what the store's API has no call for).
async fn exec_raw(b: Backend, url: &str, statement: &str) {
    use sqlx::Connection;
    match b {
        Backend::Postgres => {
            sqlx::raw_sql(statement).execute(&mut sqlx::PgConnection::connect(url).await.unwrap()).await.unwrap();
        }
        Backend::Sqlite => {
            sqlx::raw_sql(statement).execute(&mut sqlx::SqliteConnection::connect(url).await.unwrap()).await.unwrap();
        }
    }
}

/// A count read straight from the database.
async fn count_raw(b: Backend, url: &str, query: &str) -> i64 {
    use sqlx::Connection;
    match b {
        Backend::Postgres => sqlx::query_scalar::<_, i64>(query)
            .fetch_one(&mut sqlx::PgConnection::connect(url).await.unwrap())
            .await
            .unwrap(),
        Backend::Sqlite => sqlx::query_scalar::<_, i64>(query)
            .fetch_one(&mut sqlx::SqliteConnection::connect(url).await.unwrap())
            .await
            .unwrap(),
    }
}
