//! Evaluators on both stores: a prompt's list stored, validated at the edge
//! and shown; unscored traces judged by code checks (the agent's own reward
//! wins, its late feedback replaces a judged one, rounds wait for judgement);
//! judged rewards reaching the rollups and the rater, which rates, promotes
//! the better version and never the worse one when agents send no feedback
//! at all; the LLM judge through the simulator; calibration; an operator's
//! label from the web UI.

use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{Backend, eventually, expect_problem, spawn_app, spawn_app_with, test_store};
use crate::population::{arm, evaluated_prompt, name};
use combee::{
    config::PopulationSettings,
    domain::{
        Feedback, LabelMoveKind, LabelName, Method,
        label::Selector,
        round::RoundTrigger,
        trace::{FeedbackSource, NewTrace, TraceLimits, ValidTrace},
    },
    evaluate::evaluators::Evaluator,
    service::arms::add_challenger,
    simulation::world::{World, WorldConfig, harmful, lesson},
    store::{DynStore, OpenRound},
    worker::{
        judge::TraceJudge,
        rater::{PopulationRater, RatingOutcome},
    },
};

fn solved_check() -> Vec<Evaluator> {
    serde_json::from_value(json!([
        {"kind": "checks", "name": "solved", "checks": [{"type": "regex", "pattern": "^solved$"}]}
    ]))
    .unwrap()
}

/// A trace of version `v` as an agent that reports nothing sends it.
fn unscored(prompt: &str, v: i64, solved: bool, task: usize) -> ValidTrace {
    let t: NewTrace = serde_json::from_value(json!({
        "prompt": prompt, "prompt_version": v, "input": {"q": task},
        "output": if solved { "solved" } else { "not solved" }, "metadata": {"task_key": format!("t{task}")}
    }))
    .unwrap();
    t.validate(TraceLimits { max_field_bytes: 1024, max_trace_bytes: 4096 }, "default").unwrap()
}

/// `n` unscored traces of version `v`, `rate` of them solved.
fn batch(prompt: &str, v: i64, n: usize, rate: f64) -> Vec<ValidTrace> {
    (0..n).map(|i| unscored(prompt, v, ((i + 1) as f64 * rate).floor() > (i as f64 * rate).floor(), i)).collect()
}

async fn judge_all(judge: &TraceJudge) -> usize {
    let mut total = 0;
    loop {
        let n = judge.judge_pending().await.unwrap();
        total += n;
        if n == 0 {
            return total;
        }
    }
}

async fn production(s: &DynStore, p: &str) -> i64 {
    s.resolve(&name(p), &Selector::Label(LabelName::production())).await.unwrap().unwrap().version.number
}

async fn the_list_is_validated_at_the_edge_stored_and_shown(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    let get = async || -> Value {
        let got: Value = app.get("/v1/prompts/p/evaluators").send().await.unwrap().json().await.unwrap();
        got["evaluators"].clone()
    };
    assert_eq!(get().await, json!([]));
    let list = json!([
        {"kind": "checks", "name": "format", "checks": [
            {"type": "regex", "pattern": "^ANSWER: "}, {"type": "length", "max": 200}]},
        {"kind": "judge", "name": "helpful", "rubric": "The answer is correct and polite."}
    ]);
    let res = app.put("/v1/prompts/p/evaluators", json!({"evaluators": list})).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let got = get().await;
    assert_eq!(got[0]["name"], "format");
    assert_eq!(got[1], list[1]);
    for (bad, why) in [
        (json!([{"kind": "checks", "name": "f", "checks": [{"type": "regex", "pattern": "(unclosed"}]}]), "regular"),
        (
            json!([{"kind": "checks", "name": "s", "checks": [{"type": "json_schema", "schema": {"type": 12}}]}]),
            "Schema",
        ),
        (json!([{"kind": "judge", "name": "j", "rubric": " "}]), "rubric"),
        (
            json!([{"kind": "judge", "name": "j", "rubric": "x"}, {"kind": "judge", "name": "j", "rubric": "y"}]),
            "twice",
        ),
        (
            json!((0..9).map(|i| json!({"kind": "judge", "name": format!("j{i}"), "rubric": "x"})).collect::<Vec<_>>()),
            "at most",
        ),
    ] {
        let body = json!({"evaluators": bad});
        let problem = expect_problem(app.put("/v1/prompts/p/evaluators", body).send().await.unwrap(), 422).await;
        assert!(problem["detail"].as_str().unwrap().contains(why), "{problem}");
    }
    // Unknown kinds and fields are refused too; the stored list is unchanged.
    let bad = json!({"evaluators": [{"kind": "oracle", "name": "o"}]});
    assert_eq!(app.put("/v1/prompts/p/evaluators", bad).send().await.unwrap().status(), 422);
    assert_eq!(get().await.as_array().unwrap().len(), 2);
    expect_problem(app.get("/v1/prompts/nope/evaluators").send().await.unwrap(), 404).await;
    let none = json!({"evaluators": []});
    expect_problem(app.put("/v1/prompts/nope/evaluators", none.clone()).send().await.unwrap(), 404).await;
    // A key that may only read prompts cannot change them.
    let reader = app.key_with(&["prompts:read"]).await;
    let res = app.http.put(app.url("/v1/prompts/p/evaluators")).bearer_auth(&reader).json(&none).send().await;
    assert_eq!(res.unwrap().status(), 403);
    // An empty list removes them.
    assert_eq!(app.put("/v1/prompts/p/evaluators", none).send().await.unwrap().status(), 200);
    assert_eq!(get().await, json!([]));
}

/// Judged feedback fills only what no one scored; the agent's reward wins,
/// its late feedback replaces a judged one, and the rollups follow each step.
async fn judged_feedback_never_overrides_the_agent_and_late_feedback_replaces_it(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "p", 1).await;
    s.set_evaluators(&name("p"), &solved_check()).await.unwrap();
    let mut reported = unscored("p", 1, true, 0);
    reported.feedback = Feedback { success: Some(false), ..Default::default() };
    let ids = s.insert_traces(&[unscored("p", 1, false, 1), reported, unscored("p", 1, true, 2)]).await.unwrap();
    let judge = TraceJudge::new(s.clone(), None, Duration::from_millis(10), Duration::from_secs(60));
    assert_eq!(judge_all(&judge).await, 3);

    let t = s.get_trace(ids[0]).await.unwrap().unwrap();
    assert_eq!((t.feedback.score, t.feedback_source), (Some(0.0), Some(FeedbackSource::Judge)));
    assert!(t.feedback.comment.as_deref().unwrap().contains("solved: the reply must match"), "{:?}", t.feedback);
    assert_eq!(t.judged.as_ref().unwrap().by.as_deref(), Some("solved"));
    // The agent said it failed; the check says it passed: the agent wins, the
    // judgement is kept beside it (calibration data).
    let t = s.get_trace(ids[1]).await.unwrap().unwrap();
    assert_eq!((t.feedback.success, t.feedback.score, t.feedback_source), (Some(false), None, None));
    assert_eq!(t.judged.as_ref().unwrap().judgements[0].score, Some(1.0));
    // Judged once: a second pass has nothing to do.
    assert_eq!(judge.judge_pending().await.unwrap(), 0);

    let outcomes = |s: DynStore| async move {
        let now = chrono::Utc::now();
        let b = s.version_outcomes(&name("p"), now - chrono::Duration::hours(1), now, 7200, None).await.unwrap();
        b.iter().fold((0, 0, 0.0), |(w, j, sum), b| (w + b.with_feedback, j + b.judged, sum + b.score.sum))
    };
    assert_eq!(outcomes(s.clone()).await, (3, 2, 1.0), "three rewarded, two by the judge (scores 0 and 1)");
    // Late agent feedback replaces the judged reward whole.
    let t = s.add_feedback(ids[0], Feedback { score: Some(0.75), ..Default::default() }).await.unwrap().unwrap();
    assert_eq!((t.feedback.score, t.feedback.comment.as_deref(), t.feedback_source), (Some(0.75), None, None));
    assert_eq!(outcomes(s.clone()).await, (3, 1, 1.75));
    // A comment alone changes no reward and leaves the judged one.
    let t = s.add_feedback(ids[2], Feedback { comment: Some("ok".into()), ..Default::default() }).await.unwrap();
    assert_eq!(t.unwrap().feedback_source, Some(FeedbackSource::Judge));
    // An operator's label wins over the judge and is marked as theirs.
    let t = s
        .add_feedback_from(ids[2], Feedback { score: Some(0.0), ..Default::default() }, FeedbackSource::Human)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((t.feedback.score, t.feedback_source), (Some(0.0), Some(FeedbackSource::Human)));
    assert_eq!(outcomes(s.clone()).await, (3, 0, 0.75));
}

/// Judges in several processes take disjoint batches (no trace judged, or
/// paid for, twice), and a batch whose judge died is claimed again once its
/// lease runs out.
async fn judges_claim_disjoint_batches_and_a_dead_judges_batch_returns(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "p", 1).await;
    s.set_evaluators(&name("p"), &solved_check()).await.unwrap();
    s.insert_traces(&batch("p", 1, 40, 0.5)).await.unwrap();
    let lease = Duration::from_secs(60);
    let claims = futures_util::future::join_all((0..4).map(|_| s.claim_unjudged(lease, 12))).await;
    let mut ids: Vec<uuid::Uuid> = claims.into_iter().flat_map(|c| c.unwrap()).map(|t| t.id).collect();
    let claimed = ids.len();
    ids.sort();
    ids.dedup();
    assert_eq!((claimed, ids.len()), (40, 40), "every trace claimed once by four concurrent judges");
    assert!(s.claim_unjudged(lease, 12).await.unwrap().is_empty(), "all are held");

    // A judge that claimed and died: its lease runs out, the batch returns.
    evaluated_prompt(&s, "q", 1).await;
    s.set_evaluators(&name("q"), &solved_check()).await.unwrap();
    s.insert_traces(&batch("q", 1, 3, 0.5)).await.unwrap();
    assert_eq!(s.claim_unjudged(Duration::from_millis(1), 12).await.unwrap().len(), 3);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let again = s.claim_unjudged(lease, 12).await.unwrap();
    assert_eq!(again.len(), 3, "the dead judge's batch is claimed again");
    assert!(again.iter().all(|t| t.prompt.as_str() == "q"));
}

/// A claim reads only prompts with evaluators, and one prompt's backlog does
/// not crowd out another's traces: each gets a share of the batch, its
/// oldest first, and a share another prompt left unused goes to the backlog.
async fn a_claim_shares_the_batch_between_prompts(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    for p in ["busy", "quiet", "unjudged"] {
        evaluated_prompt(&s, p, 1).await;
    }
    s.set_evaluators(&name("busy"), &solved_check()).await.unwrap();
    s.set_evaluators(&name("quiet"), &solved_check()).await.unwrap();
    let busy = s.insert_traces(&batch("busy", 1, 40, 0.5)).await.unwrap();
    s.insert_traces(&batch("unjudged", 1, 40, 0.5)).await.unwrap();
    let quiet = s.insert_traces(&batch("quiet", 1, 2, 0.5)).await.unwrap();
    let lease = Duration::from_secs(60);
    let claimed = s.claim_unjudged(lease, 12).await.unwrap();
    let of = |p: &str| claimed.iter().filter(|t| t.prompt.as_str() == p).map(|t| t.id).collect::<Vec<_>>();
    assert_eq!(claimed.len(), 12, "the batch is filled");
    assert_eq!(of("quiet"), quiet, "the quiet prompt's traces are not crowded out");
    assert_eq!(of("busy"), busy[..10].to_vec(), "the rest of the batch: the busy prompt's oldest");
    assert!(of("unjudged").is_empty(), "a prompt without evaluators is never claimed");
    let next = s.claim_unjudged(lease, 12).await.unwrap();
    assert_eq!(next.iter().map(|t| t.id).collect::<Vec<_>>(), busy[10..22].to_vec());
}

/// A round of a prompt with evaluators leaves unjudged traces out until they
/// are judged, or older than the wait.
async fn rounds_wait_for_judgement_within_a_limit(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "p", 1).await;
    s.set_evaluators(&name("p"), &solved_check()).await.unwrap();
    s.insert_traces(&batch("p", 1, 4, 0.5)).await.unwrap();
    let open = |wait: u64| OpenRound {
        prompt: name("p"),
        trigger: RoundTrigger::Backlog,
        method: Method::Combee,
        batch: 10,
        min_traces: 1,
        seed: 1,
        inbound_webhook_id: None,
        judge_wait: Some(Duration::from_secs(wait)),
        base_version: None,
    };
    assert!(s.open_round(&open(3600)).await.unwrap().is_none(), "nothing judged yet");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // A broken judge delays learning by the wait, never stops it; here the
    // wait (0 s) has passed.
    let round = s.open_round(&open(0)).await.unwrap().expect("older than the wait");
    assert_eq!(round.n, 4);
    // Judged traces go at once.
    evaluated_prompt(&s, "q", 1).await;
    s.set_evaluators(&name("q"), &solved_check()).await.unwrap();
    s.insert_traces(&batch("q", 1, 3, 0.5)).await.unwrap();
    judge_all(&TraceJudge::new(s.clone(), None, Duration::from_millis(10), Duration::from_secs(60))).await;
    let round = s.open_round(&OpenRound { prompt: name("q"), ..open(3600) }).await.unwrap().expect("judged");
    assert_eq!(round.n, 3);
}

/// No agent reports anything; the code check judges the replies, and the
/// rater ranks on those judged rewards: the better challenger is promoted,
/// the worse one never, and the evidence says the rewards were judged.
async fn with_no_feedback_at_all_judged_rewards_rate_and_promote(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "p", 3).await;
    s.set_evaluators(&name("p"), &solved_check()).await.unwrap();
    let settings = PopulationSettings { window_secs: 30, min_window_traces: 10, min_traces: 50, ..Default::default() };
    add_challenger(&s, &name("p"), 2, Some(1), &settings.policy()).await.unwrap();
    add_challenger(&s, &name("p"), 3, Some(1), &settings.policy()).await.unwrap();
    let rater = PopulationRater::new(s.clone(), settings);
    let judge = TraceJudge::new(s.clone(), None, Duration::from_millis(10), Duration::from_secs(60));

    let window = |_: ()| {
        let mut w = batch("p", 1, 30, 0.5);
        w.extend(batch("p", 2, 30, 0.9));
        w.extend(batch("p", 3, 30, 0.2));
        w
    };
    s.insert_traces(&window(())).await.unwrap();
    // Unjudged, the traces carry no reward: nothing could be ranked.
    assert_eq!(judge_all(&judge).await, 90);
    let t1 = chrono::Utc::now();
    let out = rater.rate(&name("p"), t1).await.unwrap();
    let RatingOutcome::Rated { ranked, rewards, .. } = out else { panic!("{out:?}") };
    assert_eq!(ranked.len(), 3, "every arm is rated on judged rewards");
    assert_eq!((rewards.used(), rewards.judged, rewards.reported), ("judged", 90, 0));
    let arms = s.population_page(&name("p"), None, 1000).await.unwrap();
    assert!(arm(&arms, 2).rating.mu > arm(&arms, 1).rating.mu, "{arms:?}");
    assert!(arm(&arms, 3).rating.mu < arm(&arms, 1).rating.mu, "{arms:?}");

    let next_second = chrono::DateTime::from_timestamp(t1.timestamp() + 1, 0).unwrap();
    tokio::time::sleep((next_second - chrono::Utc::now()).to_std().unwrap_or_default()).await;
    s.insert_traces(&window(())).await.unwrap();
    judge_all(&judge).await;
    let t2 = t1 + chrono::Duration::seconds(30);
    assert_eq!(rater.rate(&name("p"), t2).await.unwrap(), RatingOutcome::Promoted { from: 1, to: 2 });
    assert_eq!(production(&s, "p").await, 2);
    let history = s.label_history(&name("p"), Some(&LabelName::production()), None, 10).await.unwrap();
    assert_eq!(history[0].kind, LabelMoveKind::GatePromote);
    let used = &history[0].evidence.as_ref().unwrap()["window"]["rewards_used"];
    assert_eq!((used["used"].as_str(), used["judged"].as_u64()), (Some("judged"), Some(90)), "{used}");
    assert!(history.iter().all(|h| h.to_version != Some(3)), "the worse version is never promoted");
}

/// The same no-feedback world against a running server: simulated agents
/// send traces without any feedback, a code check judges their replies, and
/// the server's own rater promotes the challenger that holds the lessons —
/// never the one that holds a harmful instruction.
async fn a_world_without_feedback_promotes_the_better_version(b: Backend) {
    world_without_feedback(b, solved_check(), None).await;
}

/// The same with an LLM judge (the simulator's, 90% accurate) instead of the check.
async fn a_simulated_llm_judge_promotes_the_better_version(b: Backend) {
    let judge: Vec<Evaluator> = serde_json::from_value(json!([
        {"kind": "judge", "name": "judge", "rubric": "The task is done when the reply is exactly \"solved\"."}
    ]))
    .unwrap();
    let sim = crate::common::spawn_sim(combee::simulation::llm::SimConfig::default()).await;
    world_without_feedback(b, judge, Some(sim)).await;
}

async fn world_without_feedback(b: Backend, evaluators: Vec<Evaluator>, sim: Option<crate::common::Sim>) {
    let llm = sim.as_ref().map(|s| s.url.clone());
    let app = spawn_app_with(b, |s| {
        s.server.role = combee::config::ProcessRole::All;
        if let Some(url) = &llm {
            crate::common::learning(s, url);
        }
        s.worker.poll_interval_ms = 50;
        s.population.tick_secs = 1;
        s.population.window_secs = 3;
        s.population.crossover_prob = 0.0;
    })
    .await;
    let lessons: Vec<String> = (0..4).map(lesson).collect();
    let body = |base: String| json!({"base": base});
    let res = app
        .post(
            "/v1/prompts",
            json!({"name": "w", "base": "You solve tasks.", "settings": {"batch_size": 10000, "max_wait_secs": 31536000}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let better = format!("You solve tasks.\n{}", lessons.join("\n"));
    let worse = format!("You solve tasks.\n{}", harmful(0));
    for content in [better, worse] {
        assert_eq!(app.post("/v1/prompts/w/versions", body(content)).send().await.unwrap().status(), 201);
    }
    let policy = PopulationSettings::default().policy();
    add_challenger(&app.store, &name("w"), 2, Some(1), &policy).await.unwrap();
    add_challenger(&app.store, &name("w"), 3, Some(1), &policy).await.unwrap();
    let list = json!({"evaluators": evaluators});
    assert_eq!(app.put("/v1/prompts/w/evaluators", list).send().await.unwrap().status(), 200);

    let mut chunk = 0u64;
    let promoted = eventually("the better version promoted", Duration::from_secs(120), async || {
        chunk += 1;
        let cfg = WorldConfig {
            prompt: "w".into(),
            task_types: 4,
            tasks_per_type: 10,
            runs: 200,
            window: 200,
            agents: 4,
            subjects: 1000,
            poison_share: 0.0,
            base_success: 0.3,
            lesson_lift: 0.5,
            harm_drop: 0.25,
            settle_secs: 0.0,
            seed: chunk,
            no_feedback: true,
            house_rules: 0,
            rate: None,
        };
        World::new(&app.base, &app.admin_key, cfg).unwrap().run(|_| {}).await.map_err(|e| e.to_string())?;
        let history: Value =
            app.get("/v1/prompts/w/labels/history?label=production").send().await.unwrap().json().await.unwrap();
        let moves = history["moves"].as_array().cloned().unwrap_or_default();
        assert!(moves.iter().all(|m| m["to_version"] != 3), "the worse version is never promoted: {history}");
        let pop: Value = app.get("/v1/prompts/w/population").send().await.unwrap().json().await.unwrap();
        let metrics: Value = app.get("/v1/prompts/w/metrics").send().await.unwrap().json().await.unwrap();
        moves
            .into_iter()
            .find(|m| m["kind"] == "gate-promote")
            .ok_or_else(|| format!("chunk {chunk}: {history}\npopulation: {pop}\nmetrics: {metrics}"))
    })
    .await;
    assert_eq!(promoted["to_version"], 2, "{promoted}");
    assert_eq!(promoted["evidence"]["window"]["rewards_used"]["used"], "judged", "{promoted}");
    // No agent sent feedback: the rewards the server holds were judged.
    let traces: Value = app.get("/v1/traces?prompt=w&page_size=200").send().await.unwrap().json().await.unwrap();
    let judged = traces["traces"].as_array().unwrap().iter().filter(|t| t["feedback_source"] == "judge").count();
    assert!(judged > 0, "{traces}");
    if let Some(sim) = &sim {
        assert!(sim.calls("judge").await > 0);
    }
    eprintln!("promoted after {chunk} chunks of 200 runs");
}

/// Calibration: each evaluator against the traces agents or operators
/// scored, over the API.
async fn calibration_compares_the_evaluators_with_reported_rewards(b: Backend) {
    let app = spawn_app_with(b, |s| s.server.role = combee::config::ProcessRole::All).await;
    app.create_prompt("c").await;
    let list = json!({"evaluators": [
        {"kind": "checks", "name": "solved", "checks": [{"type": "equals", "value": "solved"}]}]});
    assert_eq!(app.put("/v1/prompts/c/evaluators", list).send().await.unwrap().status(), 200);
    // The agent's verdicts: 3 agree with the check, 1 does not; 1 trace unscored.
    let trace =
        |output: &str, feedback: Value| json!({"prompt": "c", "input": "q", "output": output, "feedback": feedback});
    let traces = json!({"traces": [
        trace("solved", json!({"success": true})), trace("solved", json!({"score": 0.9})),
        trace("not solved", json!({"success": false})), trace("not solved", json!({"success": true})),
        trace("solved", json!({})),
    ]});
    assert_eq!(app.post("/v1/traces", traces).send().await.unwrap().status(), 201);
    let cal = eventually("judged", Duration::from_secs(20), async || {
        let cal: Value = app.get("/v1/prompts/c/evaluators/calibration").send().await.unwrap().json().await.unwrap();
        if cal["traces"] == 4 { Ok(cal) } else { Err(cal.to_string()) }
    })
    .await;
    let e = &cal["evaluators"][0];
    assert_eq!(
        (e["evaluator"].as_str(), e["n"].as_u64(), e["accuracy"].as_f64()),
        (Some("solved"), Some(4), Some(0.75))
    );
    // Truth passes 3/4, the check 2/4: chance = 0.75·0.5 + 0.25·0.5 = 0.5; kappa = (0.75 − 0.5) / 0.5 = 0.5.
    assert!((e["kappa"].as_f64().unwrap() - 0.5).abs() < 1e-9, "{cal}");
    expect_problem(app.get("/v1/prompts/nope/evaluators/calibration").send().await.unwrap(), 404).await;
}

/// An operator labels a judged trace on its web page (a form with the CSRF
/// token): the label replaces the judged reward as human feedback and counts
/// for calibration; the prompt's page shows its evaluators.
async fn an_operator_labels_a_judged_trace_in_the_web_ui(b: Backend) {
    use crate::ui_browser::{hidden, plain_client, set_cookie, sign_in};
    let app = spawn_app_with(b, |s| s.server.role = combee::config::ProcessRole::All).await;
    app.create_prompt("u").await;
    let list = json!({"evaluators": solved_check()});
    assert_eq!(app.put("/v1/prompts/u/evaluators", list).send().await.unwrap().status(), 200);
    let res = app.post("/v1/traces", json!({"prompt": "u", "input": "q", "output": "not solved"})).send().await;
    let id = res.unwrap().json::<Value>().await.unwrap()["ids"][0].as_str().unwrap().to_owned();
    eventually("judged", Duration::from_secs(20), async || {
        let t: Value = app.get(&format!("/v1/traces/{id}")).send().await.unwrap().json().await.unwrap();
        if t["feedback_source"] == "judge" { Ok(()) } else { Err(t.to_string()) }
    })
    .await;
    let session = set_cookie(&sign_in(&app, &app.admin_key).await, "combee_session").unwrap();
    let http = plain_client();
    let cookie = format!("combee_session={session}");
    let page = http.get(app.url(&format!("/ui/traces/{id}"))).header("cookie", &cookie).send().await.unwrap();
    let page = page.text().await.unwrap();
    assert!(
        page.contains("judged by the prompt&#39;s evaluators") || page.contains("judged by the prompt's evaluators")
    );
    assert!(page.contains(r#"id="judgements""#) && page.contains("the reply must match"), "{page}");
    let csrf = hidden(&page, "csrf");
    let label = |fields: Vec<(&'static str, String)>| {
        http.post(app.url(&format!("/ui/traces/{id}/label"))).header("cookie", &cookie).form(&fields).send()
    };
    let fields = vec![("score", "0.8".to_owned()), ("comment", "fine by me".to_owned())];
    assert_eq!(label(fields.clone()).await.unwrap().status(), 403, "no CSRF token, no label");
    let mut bad = vec![("score", "2".to_owned()), ("csrf", csrf.clone())];
    assert_eq!(label(bad.clone()).await.unwrap().status(), 422);
    bad[0].1 = "high".into();
    assert_eq!(label(bad).await.unwrap().status(), 400);
    let mut good = fields;
    good.push(("csrf", csrf));
    let res = label(good).await.unwrap();
    assert_eq!(res.status(), 303);
    assert!(res.headers()["location"].to_str().unwrap().ends_with("notice=labelled"));
    let t: Value = app.get(&format!("/v1/traces/{id}")).send().await.unwrap().json().await.unwrap();
    assert_eq!(t["feedback_source"], "human");
    assert_eq!((t["feedback"]["score"].as_f64(), t["feedback"]["comment"].as_str()), (Some(0.8), Some("fine by me")));
    // The label is calibration data: the operator passed what the check failed.
    let cal: Value = app.get("/v1/prompts/u/evaluators/calibration").send().await.unwrap().json().await.unwrap();
    assert_eq!((cal["traces"].as_u64(), cal["evaluators"][0]["accuracy"].as_f64()), (Some(1), Some(0.0)), "{cal}");
    let page = http.get(app.url("/ui/prompts/u")).header("cookie", &cookie).send().await.unwrap();
    let page = page.text().await.unwrap();
    assert!(page.contains(r#"id="evaluator-solved""#), "{page}");
    // The page's agreement is bounded (the newest 500 scored traces), so a view stays cheap.
    assert!(page.contains("agreement with the 1 traces agents or operators scored (the newest 500 at most"), "{page}");
}

on_both_stores!(
    an_operator_labels_a_judged_trace_in_the_web_ui,
    the_list_is_validated_at_the_edge_stored_and_shown,
    judged_feedback_never_overrides_the_agent_and_late_feedback_replaces_it,
    rounds_wait_for_judgement_within_a_limit,
    judges_claim_disjoint_batches_and_a_dead_judges_batch_returns,
    a_claim_shares_the_batch_between_prompts,
    with_no_feedback_at_all_judged_rewards_rate_and_promote,
    calibration_compares_the_evaluators_with_reported_rewards,
);

on_one_store!(
    world_without_feedback_postgres: a_world_without_feedback_promotes_the_better_version(Postgres),
    simulated_llm_judge_sqlite: a_simulated_llm_judge_promotes_the_better_version(Sqlite),
);
