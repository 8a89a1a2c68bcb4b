//! Learning in step with evaluation, on both stores: under the `evaluated`
//! policy a round builds on the challenger being measured and waits for its
//! evidence; a version that only repeats one the prompt has is not written;
//! an arm is not retired before it had its chance to be rated; and under
//! steady traffic from an agent that follows its prompt, production moves to
//! the clearly better version with few versions written, while equally good
//! versions do not take turns in production.

use std::time::Duration;

use crate::common::{self, Backend, eventually, learning, spawn_app_with, spawn_sim, test_store};
use crate::population::{arm, evaluated_prompt, name};

use combee::{
    config::PopulationSettings,
    domain::{
        Bullet, LabelName, Playbook, Section, VersionContent, VersionSource, label::Selector, population::ArmState,
        prompt::NewVersion,
    },
    evaluate::trueskill::Rating,
    service::{
        arms::{add_challenger, add_crossover_child},
        population::{RoundBase, next_round_base},
    },
    simulation::{
        house_rules,
        llm::SimConfig,
        world::{World, WorldConfig},
    },
    store::{DynStore, OpenRound},
    worker::rater::{PopulationRater, RatingOutcome},
};
use serde_json::{Value, json};

/// A learned version of `p` from `parent` whose playbook holds `lessons`.
fn learned(lessons: &[&str], parent: i64) -> NewVersion {
    let bullets =
        lessons.iter().map(|l| Bullet { id: String::new(), content: (*l).into(), helpful: 0, harmful: 0 }).collect();
    NewVersion {
        parent: Some(parent),
        source: VersionSource::Learned,
        round_id: None,
        content: VersionContent {
            base: "v1".into(),
            playbook: Some(
                Playbook { sections: vec![Section { name: "insights".into(), bullets }], next_id: 0 }
                    .normalized()
                    .unwrap(),
            ),
        },
        message: "m".into(),
        created_by: "test".into(),
    }
}

async fn production(s: &DynStore, p: &str) -> i64 {
    s.resolve(&name(p), &Selector::Label(LabelName::production())).await.unwrap().unwrap().version.number
}

/// Where the next round starts, read as the worker's scheduler reads it: it
/// waits while a challenger has not had its chance to be rated, then builds on
/// the newest challenger built on production; the round opened from there
/// learns on that version. An arm that has not had its chance is never retired
/// to make room, whatever its rating.
async fn rounds_wait_for_the_challengers_evidence_and_build_on_it(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "p", 1).await;
    let policy = PopulationSettings { max_arms: 1, min_traces: 20, ..Default::default() }.policy();
    let base = async || next_round_base(&s, &name("p"), &policy, chrono::Utc::now()).await.unwrap();
    assert_eq!(base().await, RoundBase::From(1), "production alone: learn from it");
    s.create_version(&name("p"), learned(&["INSIGHT-a: one"], 1), &[]).await.unwrap();
    add_challenger(&s, &name("p"), 2, Some(1), &policy).await.unwrap();
    assert_eq!(base().await, RoundBase::Wait(2), "v2 has no evidence yet");
    // A bred child joins too (max_arms 1): v2 is not retired before it had its chance.
    s.create_version(&name("p"), learned(&["INSIGHT-b: two"], 1), &[]).await.unwrap();
    add_crossover_child(&s, &name("p"), 3, &[1, 2], &policy).await.unwrap();
    let arms = s.live_arms(&name("p"), &[]).await.unwrap();
    assert_eq!(
        arms.iter().map(|a| (a.version, a.state)).collect::<Vec<_>>(),
        [(1, ArmState::Champion), (2, ArmState::Challenger), (3, ArmState::Challenger)]
    );
    assert_eq!(base().await, RoundBase::Wait(3), "the newest unmeasured arm");
    // Both measured: v3 worse than production, v2 not. Learning goes on from v2.
    let mut measured = arms.clone();
    for a in &mut measured {
        a.scored_traces = 20;
        if a.version == 3 {
            a.rating = Rating { mu: 20.0, sigma: 3.0 };
        }
    }
    s.save_population(&name("p"), &measured).await.unwrap();
    assert_eq!(base().await, RoundBase::From(2));
    // Now there is room to make: the weakest measured arm (v3) goes, not the newest.
    s.create_version(&name("p"), learned(&["INSIGHT-a: one", "INSIGHT-c: three"], 2), &[]).await.unwrap();
    add_challenger(&s, &name("p"), 4, Some(2), &policy).await.unwrap();
    let all = s.population_page(&name("p"), None, 100).await.unwrap();
    assert_eq!(arm(&all, 3).state, ArmState::Retired);
    assert_eq!((arm(&all, 2).state, arm(&all, 4).state), (ArmState::Retired, ArmState::Challenger), "{all:?}");
    assert_eq!(base().await, RoundBase::Wait(4));

    // The round opened from there learns on that version; a base the prompt does not have means production.
    s.insert_traces(&[crate::population::rewarded("p", 1, false, 0)]).await.unwrap();
    let open = |base_version| OpenRound {
        prompt: name("p"),
        trigger: combee::domain::round::RoundTrigger::Backlog,
        method: combee::domain::Method::Combee,
        batch: 10,
        min_traces: 1,
        seed: 1,
        inbound_webhook_id: None,
        judge_wait: None,
        base_version,
    };
    let round = s.open_round(&open(Some(4))).await.unwrap().expect("a round");
    assert_eq!(round.base_version, 4);
    let claimed = s.claim_round("w", Duration::from_secs(60)).await.unwrap().expect("claimed");
    assert_eq!(claimed.base.number, 4);
    s.fail_round(
        round.id,
        claimed.round.attempt,
        "t",
        combee::store::RoundFailure::GiveUp { charges: Default::default() },
    )
    .await
    .unwrap();
    let round = s.open_round(&open(Some(99))).await.unwrap().expect("a round");
    assert_eq!(round.base_version, production(&s, "p").await);
}

/// Settings for a short rating clock: windows of 1 to 6 s, looked at every second.
fn quick_population(s: &mut combee::config::Settings) {
    s.population.tick_secs = 1;
    s.population.window_secs = 6;
    s.population.min_window_secs = 1;
    s.population.min_window_traces = 5;
}

/// The house-rules world at a steady rate on prompt `p`, with agent rewards.
fn house_rules_world(prompt: &str, rules: u32, rate: f64, runs: u32, seed: u64) -> WorldConfig {
    WorldConfig {
        prompt: prompt.into(),
        task_types: 1,
        tasks_per_type: 50,
        runs,
        window: runs,
        agents: 16,
        subjects: 400,
        poison_share: 0.0,
        base_success: 0.0,
        lesson_lift: 0.0,
        harm_drop: 0.0,
        settle_secs: 0.0,
        seed,
        no_feedback: false,
        house_rules: rules,
        rate: Some(rate),
    }
}

/// Every item of a paged list route.
async fn all(app: &common::TestApp, path: &str, field: &str) -> Vec<Value> {
    let (mut out, mut token) = (Vec::new(), None::<String>);
    loop {
        let page = match &token {
            Some(t) => format!("{path}&page_token={t}"),
            None => path.to_owned(),
        };
        let v: Value = app.get(&page).send().await.unwrap().json().await.unwrap();
        out.extend(v[field].as_array().cloned().unwrap_or_default());
        match v["next_page_token"].as_str() {
            Some(t) => token = Some(t.to_owned()),
            None => return out,
        }
    }
}

/// The default policy under steady traffic: an agent that follows its prompt
/// posts a trace every 40 ms, scored on 8 house rules it is never told.
/// Production moves to the version that holds them, and only forward; few
/// versions are written (a round builds on the version being measured, so it
/// learns nothing twice); no arm is retired unrated; every trace is learned
/// from once or still waits. Rating is shortened (windows of 1–6 s, `min_traces` 10; the
/// default cool-down of 10 windows does not hold back a version built on production):
/// how long it takes on product defaults is the benchmark's (`scripts/bench-loop`).
async fn under_steady_traffic_production_gets_the_better_version_once(b: Backend) {
    let sim = spawn_sim(SimConfig::default()).await;
    let app = spawn_app_with(b, |s| {
        learning(s, &sim.url);
        quick_population(s);
        s.population.min_traces = 10;
    })
    .await;
    // No promotion named: `evaluated`, the default.
    let res =
        app.post("/v1/prompts", json!({"name": "p", "base": "You answer the shop's customers."})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let rules = 8;
    // Traffic goes on for longer than the wait below (the agents stop when production holds every
    // rule): a challenger learned late, on a busy machine, still gets the traces it is rated on.
    let world = World::new(&app.base, &app.admin_key, house_rules_world("p", rules, 25.0, 25 * 300, 7)).unwrap();
    let agents = tokio::spawn(async move { world.run(|_| {}).await.map(|_| ()).map_err(|e| e.to_string()) });
    let promoted = eventually("production holding every house rule", Duration::from_secs(180), async || {
        let v: Value = app.get("/v1/prompts/p?label=production").send().await.unwrap().json().await.unwrap();
        let held = house_rules::rules_in(v["text"].as_str().unwrap_or_default(), rules).len();
        if held == rules as usize { Ok(v["version"].as_i64().unwrap()) } else { Err(format!("{held} rules: {v}")) }
    })
    .await;
    agents.abort();
    assert!(promoted > 1);
    let versions = all(&app, "/v1/prompts/p/versions?page_size=100", "versions").await;
    assert!(versions.len() <= 6, "a round learns nothing twice: {} versions", versions.len());
    // No two versions teach the same.
    let text = |v: &Value| {
        house_rules::rules_in(&v["text"].as_str().map(str::to_owned).unwrap_or_else(|| v.to_string()), rules)
    };
    let taught: Vec<Vec<u32>> = versions.iter().map(text).collect();
    for (i, t) in taught.iter().enumerate() {
        assert!(!taught[..i].contains(t), "two versions hold the same rules {t:?}: {taught:?}");
    }
    let arms = all(&app, "/v1/prompts/p/population?page_size=100", "arms").await;
    let unrated_retired: Vec<&Value> =
        arms.iter().filter(|a| a["state"] == "retired" && a["scored_traces"].as_u64() == Some(0)).collect();
    assert!(unrated_retired.is_empty(), "retired before rated: {unrated_retired:?}");
    // Production only moved forward, each time to a version holding more rules.
    let history = all(&app, "/v1/prompts/p/labels/history?label=production&page_size=100", "moves").await;
    let held = |n: i64| text(versions.iter().find(|v| v["number"] == n).unwrap()).len();
    for m in history.iter().filter(|m| !m["from_version"].is_null()) {
        let (from, to) = (m["from_version"].as_i64().unwrap(), m["to_version"].as_i64().unwrap());
        assert!(held(to) > held(from), "a move to a version with no more: v{from} → v{to}");
    }
    // Every trace is consumed by one round or still waits; none failed.
    eventually("the rounds in flight to end", Duration::from_secs(20), async || {
        let rounds = all(&app, "/v1/prompts/p/rounds?page_size=100", "rounds").await;
        if rounds.iter().any(|r| matches!(r["status"].as_str(), Some("queued" | "running"))) {
            Err("busy".into())
        } else {
            Ok(())
        }
    })
    .await;
    let traces = all(&app, "/v1/traces?prompt=p&page_size=200", "traces").await;
    let mut learned_by = std::collections::HashSet::new();
    for t in &traces {
        match t["status"].as_str() {
            Some("consumed") => assert!(learned_by.insert(t["id"].clone()) && t["round_id"].is_string(), "{t}"),
            Some("pending") => {}
            other => panic!("a trace {other:?}: {t}"),
        }
    }
    assert!(!learned_by.is_empty());
    let rounds = all(&app, "/v1/prompts/p/rounds?page_size=100", "rounds").await;
    let failed: Vec<&Value> = rounds.iter().filter(|r| r["status"] == "failed").collect();
    assert!(failed.is_empty(), "rounds failed: {failed:?}");
}

/// Two equally good versions rated window after window as traffic comes in:
/// the rater closes short windows early, and production does not take turns.
async fn equally_good_versions_do_not_take_turns_in_short_windows(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "p", 2).await;
    let settings = PopulationSettings {
        window_secs: 600,
        min_window_secs: 1,
        min_window_traces: 10,
        min_traces: 20,
        ..Default::default()
    };
    add_challenger(&s, &name("p"), 2, Some(1), &settings.policy()).await.unwrap();
    let rater = PopulationRater::new(s.clone(), settings);
    // Window after window each side wins one by a little (as noise has it), on the same tasks.
    let mut moves = Vec::new();
    let mut rated = 0;
    for w in 0..8u32 {
        // Windows are read to the second: this window's traces arrive after the last one's second.
        let now = chrono::Utc::now();
        let next_second = chrono::DateTime::from_timestamp(now.timestamp() + 1, 0).unwrap();
        tokio::time::sleep((next_second - now).to_std().unwrap_or_default()).await;
        let ahead = if w % 2 == 0 { 1 } else { 2 };
        let mut traces = crate::population::batch("p", ahead, 20, 0.8);
        traces.extend(crate::population::batch("p", 3 - ahead, 20, 0.7));
        s.insert_traces(&traces).await.unwrap();
        // A window closes early once it is a second old and both sides have their traces.
        let before = production(&s, "p").await;
        let out = eventually("the window to close early", Duration::from_secs(5), async || {
            match rater.rate(&name("p"), chrono::Utc::now()).await.unwrap() {
                RatingOutcome::WindowOpen => Err("open".to_owned()),
                done => Ok(done),
            }
        })
        .await;
        rated += 1;
        let after = production(&s, "p").await;
        if after != before {
            moves.push((w, after));
        }
        assert!(!matches!(out, RatingOutcome::Raced), "{out:?}");
    }
    assert_eq!(rated, 8, "every window closed early");
    // The first windows' evidence may move production once (the margin is over
    // the rating's uncertainty); the cool-down, in windows as long as these, keeps it from going back.
    assert!(moves.len() <= 1, "equally good versions took turns in production: {moves:?}");
    let arms = s.live_arms(&name("p"), &[]).await.unwrap();
    assert_eq!((arm(&arms, 1).scored_traces, arm(&arms, 2).scored_traces), (160, 160));
}

on_both_stores!(
    rounds_wait_for_the_challengers_evidence_and_build_on_it,
    under_steady_traffic_production_gets_the_better_version_once,
    equally_good_versions_do_not_take_turns_in_short_windows,
);
