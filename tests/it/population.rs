//! The `evaluated` policy's population on both stores: arms stored and read
//! back, learned children joining as challengers (mutation), sticky traffic
//! shares that follow the stored weights, and the rater's promotion gate,
//! which waits for evidence and then promotes a clearly better challenger.

use crate::common;

use combee::{
    config::PopulationSettings,
    domain::{
        Bullet, LabelMoveKind, LabelName, Playbook, Promotion, PromptName, PromptSettings, Section, Strategy,
        VersionContent, VersionSource,
        label::Selector,
        population::{ArmState, PopulationArm},
        prompt::{NewPrompt, NewVersion},
        trace::{NewTrace, TraceLimits, ValidTrace},
    },
    evaluate::{assign::sticky_arm, population::GateDecision, rater::Basis, trueskill::Rating},
    learn::denylist::ContentDenylist,
    llm::{LlmBackend, client::OpenAiClient, config::LlmConfig},
    service::arms::add_challenger,
    store::{DynStore, StoreError},
    worker::{
        breeder::CrossoverOutcome,
        rater::{PopulationRater, RatingOutcome},
    },
};
use common::{Backend, test_store};
use serde_json::json;
use std::sync::Arc;

pub(crate) fn name(s: &str) -> PromptName {
    PromptName::written(s, "default").unwrap()
}

fn version(base: &str, parent: Option<i64>) -> NewVersion {
    NewVersion {
        parent,
        source: VersionSource::Learned,
        round_id: None,
        content: VersionContent { base: base.into(), playbook: None },
        message: "m".into(),
        created_by: "test".into(),
    }
}

pub(crate) async fn evaluated_prompt(store: &DynStore, n: &str, versions: i64) {
    let p = NewPrompt {
        name: name(n),
        strategy: Strategy::Playbook,
        promotion: Promotion::Evaluated,
        settings: PromptSettings::default(),
        created_by: "test".into(),
    };
    store.create_prompt(p, version("v1", None)).await.unwrap();
    for v in 2..=versions {
        store.create_version(&name(n), version(&format!("v{v}"), Some(1)), &[]).await.unwrap();
    }
}

pub(crate) fn arm(arms: &[PopulationArm], version: i64) -> &PopulationArm {
    arms.iter().find(|a| a.version == version).unwrap_or_else(|| panic!("no arm v{version} in {arms:?}"))
}

/// The whole population of `prompt`, read page by page (`page` arms a call).
async fn whole_population(s: &DynStore, prompt: &str, page: u32) -> Vec<PopulationArm> {
    let (mut all, mut after) = (Vec::new(), None);
    loop {
        let got = s.population_page(&name(prompt), after, page).await.unwrap();
        after = got.last().map(|a| a.version);
        let done = got.len() < page as usize;
        all.extend(got);
        if done {
            return all;
        }
    }
}

fn live_weights(arms: &[PopulationArm]) -> Vec<(i64, f64)> {
    arms.iter().filter(|a| a.state != ArmState::Retired).map(|a| (a.version, a.weight)).collect()
}

async fn children_join_as_challengers_and_the_weakest_is_retired(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "p", 4).await;
    assert_eq!(s.get_prompt(&name("p")).await.unwrap().unwrap().promotion, Promotion::Evaluated);
    assert!(s.population_page(&name("p"), None, 1000).await.unwrap().is_empty());
    let policy = PopulationSettings { max_arms: 2, ..Default::default() }.policy();
    add_challenger(&s, &name("p"), 2, Some(1), &policy).await.unwrap();
    let arms = s.population_page(&name("p"), None, 1000).await.unwrap();
    assert_eq!(arms.len(), 2);
    assert_eq!((arm(&arms, 1).state, arm(&arms, 1).rating), (ArmState::Champion, Rating::default()));
    let child = arm(&arms, 2);
    assert_eq!((child.state, child.created_from), (ArmState::Challenger, Some(1)));
    // Mutation: the parent's μ, σ = √(σ_parent² + 1).
    assert_eq!(child.rating.mu, 25.0);
    assert!((child.rating.sigma - ((25.0f64 / 3.0).powi(2) + 1.0).sqrt()).abs() < 1e-9);
    assert!((arm(&arms, 1).weight - 0.8).abs() < 1e-9 && (child.weight - 0.2).abs() < 1e-9);
    // Production did not move: the child is only measured.
    let prod = s.resolve(&name("p"), &Selector::Label(LabelName::production())).await.unwrap().unwrap();
    assert_eq!(prod.version.number, 1);

    // v3 is a child of v2, whose rating is now worse than the prior: it inherits it.
    let mut weaker = arms.clone();
    let v2 = weaker.iter_mut().find(|a| a.version == 2).unwrap();
    (v2.rating, v2.scored_traces) = (Rating { mu: 20.0, sigma: 2.0 }, 60);
    s.save_population(&name("p"), &weaker).await.unwrap();
    add_challenger(&s, &name("p"), 3, Some(2), &policy).await.unwrap();
    let arms = s.population_page(&name("p"), None, 1000).await.unwrap();
    assert_eq!(arm(&arms, 3).rating.mu, 20.0);
    assert!((arm(&arms, 3).rating.sigma - 5f64.sqrt()).abs() < 1e-9);
    // v3 measures well (μ−2σ = 28), v2 badly (16); a third challenger with
    // max_arms = 2 retires the weakest, v2; the newest stays.
    let mut measured = arms.clone();
    let v3 = measured.iter_mut().find(|a| a.version == 3).unwrap();
    (v3.rating, v3.scored_traces) = (Rating { mu: 30.0, sigma: 1.0 }, 60);
    s.save_population(&name("p"), &measured).await.unwrap();
    add_challenger(&s, &name("p"), 4, Some(1), &policy).await.unwrap();
    let arms = s.population_page(&name("p"), None, 1000).await.unwrap();
    assert_eq!(arm(&arms, 2).state, ArmState::Retired);
    assert_eq!(arm(&arms, 2).weight, 0.0);
    assert_eq!((arm(&arms, 3).state, arm(&arms, 4).state), (ArmState::Challenger, ArmState::Challenger));
    let total: f64 = live_weights(&arms).iter().map(|(_, w)| w).sum();
    assert!((total - 1.0).abs() < 1e-9, "{arms:?}");

    // Bad input is refused, not stored.
    let mut ghost = arms[0].clone();
    ghost.version = 99;
    assert!(matches!(s.save_population(&name("p"), &[ghost.clone()]).await, Err(StoreError::Invalid(_))));
    assert!(matches!(s.save_population(&name("nope"), &[ghost]).await, Err(StoreError::NotFound)));
    assert_eq!(s.population_page(&name("p"), None, 1000).await.unwrap().len(), 4);
}

/// Sticky assignment over the weights the store holds: the same subject
/// always gets the same arm, and over 10,000 subjects every arm's share is
/// within 3 points of its weight.
async fn sticky_shares_follow_the_stored_weights(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "p", 3).await;
    let policy = PopulationSettings::default().policy();
    add_challenger(&s, &name("p"), 2, Some(1), &policy).await.unwrap();
    add_challenger(&s, &name("p"), 3, Some(1), &policy).await.unwrap();
    let weights = live_weights(&s.population_page(&name("p"), None, 1000).await.unwrap());
    assert_eq!(weights.len(), 3);
    // v1 champion 0.8; the challenger with the highest μ+2σ gets the bonus, the other the floor.
    assert!((weights[0].1 - 0.8).abs() < 1e-9, "{weights:?}");
    assert!(weights[1..].iter().any(|(_, w)| (w - 0.02).abs() < 1e-9), "{weights:?}");
    let mut counts = [0usize; 3];
    for i in 0..10_000 {
        let subject = format!("agent-{i}");
        let first = sticky_arm(&subject, "p", &weights).unwrap();
        // Read again from the store: the same answer.
        if i % 1000 == 0 {
            let again = live_weights(&s.population_page(&name("p"), None, 1000).await.unwrap());
            assert_eq!(sticky_arm(&subject, "p", &again), Some(first));
        }
        counts[first] += 1;
    }
    for ((v, w), c) in weights.iter().zip(counts) {
        let share = c as f64 / 10_000.0;
        assert!((share - w).abs() < 0.03, "v{v}: share {share} vs weight {w}");
    }
}

pub(crate) fn rewarded(prompt: &str, v: i64, success: bool, task: usize) -> ValidTrace {
    let t: NewTrace = serde_json::from_value(json!({
        "prompt": prompt, "prompt_version": v, "input": {"q": "x"},
        "feedback": {"success": success}, "metadata": {"task_key": format!("t{task}")}
    }))
    .unwrap();
    t.validate(TraceLimits { max_field_bytes: 1024, max_trace_bytes: 4096 }, "default").unwrap()
}

/// `n` traces of version `v` with `rate` of them successful.
pub(crate) fn batch(prompt: &str, v: i64, n: usize, rate: f64) -> Vec<ValidTrace> {
    (0..n).map(|i| rewarded(prompt, v, ((i + 1) as f64 * rate).floor() > (i as f64 * rate).floor(), i)).collect()
}

async fn the_gate_waits_for_evidence_then_promotes_a_clearly_better_challenger(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "p", 3).await;
    let settings = PopulationSettings { window_secs: 30, min_window_traces: 10, min_traces: 50, ..Default::default() };
    add_challenger(&s, &name("p"), 2, Some(1), &settings.policy()).await.unwrap();
    add_challenger(&s, &name("p"), 3, Some(1), &settings.policy()).await.unwrap();
    let rater = PopulationRater::new(s.clone(), settings);

    // Window 1: v2 is clearly better, v3 worse, but nobody has 50 scored traces yet.
    let mut first = batch("p", 1, 30, 0.5);
    first.extend(batch("p", 2, 30, 0.9));
    first.extend(batch("p", 3, 12, 0.2));
    s.insert_traces(&first).await.unwrap();
    let t1 = chrono::Utc::now();
    let out = rater.rate(&name("p"), t1).await.unwrap();
    let RatingOutcome::Rated { ranked, gate, basis, .. } = out else { panic!("{out:?}") };
    assert_eq!(ranked.len(), 3);
    // The three arms ran tasks t0..t11 in common: they are compared on those.
    assert_eq!(basis, Basis::SharedTasks);
    assert!(matches!(gate, GateDecision::ChampionUnderSampled { traces: 30, needed: 50 }), "{gate:?}");
    let arms = s.population_page(&name("p"), None, 1000).await.unwrap();
    assert!(arm(&arms, 2).rating.mu > 25.0 && arm(&arms, 1).rating.mu < arm(&arms, 2).rating.mu, "{arms:?}");
    assert!(arm(&arms, 3).rating.mu < arm(&arms, 1).rating.mu, "{arms:?}");
    assert_eq!(arm(&arms, 2).scored_traces, 30);
    let prod = || async {
        s.resolve(&name("p"), &Selector::Label(LabelName::production())).await.unwrap().unwrap().version.number
    };
    assert_eq!(prod().await, 1, "nothing is promoted before the gate's evidence");
    // The same window is not rated twice.
    assert_eq!(rater.rate(&name("p"), t1).await.unwrap(), RatingOutcome::WindowOpen);
    assert_eq!(arm(&s.population_page(&name("p"), None, 1000).await.unwrap(), 2).scored_traces, 30);

    // Window 2: 30 more each: both now have 60 scored traces; v2 is promoted.
    // Windows are read to the second (their ends rounded up to one): the
    // window from t1 holds what arrives from t1's next second on.
    let next_second = chrono::DateTime::from_timestamp(t1.timestamp() + 1, 0).unwrap();
    tokio::time::sleep((next_second - chrono::Utc::now()).to_std().unwrap_or_default()).await;
    let mut second = batch("p", 1, 30, 0.5);
    second.extend(batch("p", 2, 30, 0.9));
    s.insert_traces(&second).await.unwrap();
    let t2 = t1 + chrono::Duration::seconds(30);
    let out = rater.rate(&name("p"), t2).await.unwrap();
    assert_eq!(out, RatingOutcome::Promoted { from: 1, to: 2 });
    assert_eq!(prod().await, 2);
    let arms = s.population_page(&name("p"), None, 1000).await.unwrap();
    assert_eq!((arm(&arms, 2).state, arm(&arms, 1).state), (ArmState::Champion, ArmState::Challenger));
    assert!((arm(&arms, 2).weight - 0.8).abs() < 1e-9, "{arms:?}");
    assert_eq!((arm(&arms, 1).scored_traces, arm(&arms, 2).scored_traces), (60, 60));

    // The label history says why, with the numbers.
    let history = s.label_history(&name("p"), Some(&LabelName::production()), None, 10).await.unwrap();
    let last = &history[0];
    assert_eq!((last.kind, last.from_version, last.to_version), (LabelMoveKind::GatePromote, Some(1), Some(2)));
    assert_eq!(last.actor, "gate");
    assert!(last.reason.contains("μ−2σ"), "{}", last.reason);
    let ev = last.evidence.as_ref().unwrap();
    assert_eq!(ev["challenger"]["scored_traces"], 60);
    let margin = ev["margin"].as_f64().unwrap();
    assert!(ev["challenger"]["lower"].as_f64().unwrap() > ev["champion"]["lower"].as_f64().unwrap() + margin);

    // Window 3: the former champion does far better now, but production just
    // moved: moving back needs the same evidence, after the same cool-down.
    let mut third = batch("p", 1, 60, 1.0);
    third.extend(batch("p", 2, 60, 0.1));
    s.insert_traces(&third).await.unwrap();
    let out = rater.rate(&name("p"), t2 + chrono::Duration::seconds(30)).await.unwrap();
    let RatingOutcome::Rated { gate, .. } = out else { panic!("{out:?}") };
    assert!(matches!(gate, GateDecision::CoolingDown { windows_since_move: 1, cooldown_windows: 10 }), "{gate:?}");
    assert_eq!(prod().await, 2);
}

/// Migration 0013 on a database with data (SQLite rebuilds `prompts` under
/// the foreign keys of versions, labels, traces, label history): run it again
/// over existing rows and everything is still there and still enforced.
async fn migration_0013_keeps_existing_prompts_and_their_references(b: Backend) {
    use sqlx::Connection;
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "old", 2).await;
    s.insert_traces(&batch("old", 2, 3, 0.5)).await.unwrap();
    add_challenger(&s, &name("old"), 2, Some(1), &PopulationSettings::default().policy()).await.unwrap();
    // 0014 (crossover) alters population_arms and, on SQLite, rebuilds versions: it runs again too.
    let undo = ["DROP TABLE population_arms", "DELETE FROM _sqlx_migrations WHERE version IN (13, 14)"];
    match b {
        Backend::Postgres => {
            let mut c = sqlx::PgConnection::connect(&ts.url).await.unwrap();
            sqlx::raw_sql("UPDATE prompts SET promotion = 'manual'").execute(&mut c).await.unwrap();
            for sql in undo {
                sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
            }
        }
        Backend::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(&ts.url).await.unwrap();
            sqlx::raw_sql("UPDATE prompts SET promotion = 'manual'").execute(&mut c).await.unwrap();
            for sql in undo {
                sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
            }
            // 0013 rebuilds `prompts` with the columns of its time: the later
            // migrations that add columns to it (0036, 0042) run again after it.
            let later = [
                "DROP INDEX audit_log_by_project",
                "ALTER TABLE audit_log DROP COLUMN project",
                "ALTER TABLE webhook_subscriptions DROP COLUMN project",
                "ALTER TABLE api_keys DROP COLUMN project",
                "DROP TABLE projects",
                "DELETE FROM _sqlx_migrations WHERE version IN (36, 42)",
            ];
            for sql in later {
                sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
            }
        }
    }
    let again = combee::store::connect(&ts.url, 4, std::time::Duration::from_secs(10)).await.expect("migrate again");
    let old = again.get_prompt(&name("old")).await.unwrap().unwrap();
    assert_eq!(old.promotion, Promotion::Manual);
    assert_eq!(again.list_versions(&name("old"), None, 10).await.unwrap().len(), 2);
    assert_eq!(again.label_history(&name("old"), None, None, 10).await.unwrap().len(), 1);
    let until = chrono::Utc::now() + chrono::Duration::minutes(1);
    let rewards = again.task_rewards(&name("old"), until - chrono::Duration::hours(1), until).await.unwrap();
    assert_eq!(rewards.len(), 3);
    assert!(again.population_page(&name("old"), None, 1000).await.unwrap().is_empty());
    // `evaluated` is accepted now.
    evaluated_prompt(&again, "new", 1).await;
    if b == Backend::Sqlite {
        // Every reference to the rebuilt table still resolves, and new ones are checked.
        let mut c = sqlx::SqliteConnection::connect(&ts.url).await.unwrap();
        let broken = sqlx::query("PRAGMA foreign_key_check").fetch_all(&mut c).await.unwrap();
        assert!(broken.is_empty(), "{} dangling references", broken.len());
        sqlx::raw_sql("PRAGMA foreign_keys = ON").execute(&mut c).await.unwrap();
        let orphan = sqlx::raw_sql(
            "INSERT INTO label_moves (prompt_id, label, kind, actor, reason, at) VALUES ('nope', 'x', 'create', 't', '', 0)",
        )
        .execute(&mut c)
        .await;
        assert!(orphan.is_err(), "a label move for no prompt was accepted");
    }
}

fn playbook_version(lessons: &[&str], parent: Option<i64>) -> NewVersion {
    let bullets = lessons
        .iter()
        .enumerate()
        .map(|(i, l)| Bullet { id: format!("b-{:04}", i + 1), content: (*l).into(), helpful: 0, harmful: 0 })
        .collect();
    NewVersion {
        content: VersionContent {
            base: "You are an agent.".into(),
            playbook: Some(Playbook { sections: vec![Section { name: "insights".into(), bullets }], next_id: 0 }),
        },
        ..version("", parent)
    }
}

/// `n` traces of version `v` on task key `key`, all succeeding or all failing.
fn on_task(prompt: &str, v: i64, key: &str, n: usize, success: bool) -> Vec<ValidTrace> {
    (0..n)
        .map(|_| {
            let t: NewTrace = serde_json::from_value(json!({
                "prompt": prompt, "prompt_version": v, "input": {"q": key},
                "feedback": {"success": success}, "metadata": {"task_key": key}
            }))
            .unwrap();
            t.validate(TraceLimits { max_field_bytes: 1024, max_trace_bytes: 4096 }, "default").unwrap()
        })
        .collect()
}

/// Crossover: the champion v1 wins tasks a0..a5, the challenger v2
/// wins b0..b5; after the window is rated, one crossover call (the simulated
/// LLM) breeds v3 = v1's bullets + v2's lesson, source `crossover`, parents
/// v1 and v2, prior μ/σ from the parents' ratings, label `candidate` with the
/// evidence. With crossover_prob 0 nothing is bred.
async fn crossover_makes_a_child_from_two_arms_that_won_different_tasks(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    let p = NewPrompt {
        name: name("x"),
        strategy: Strategy::Playbook,
        promotion: Promotion::Evaluated,
        settings: PromptSettings::default(),
        created_by: "test".into(),
    };
    s.create_prompt(p, playbook_version(&["INSIGHT-units: convert to SI first"], None)).await.unwrap();
    s.create_version(&name("x"), playbook_version(&["INSIGHT-dates: use ISO 8601 dates"], Some(1)), &[]).await.unwrap();
    let settings =
        PopulationSettings { window_secs: 60, min_window_traces: 10, crossover_prob: 1.0, ..Default::default() };
    add_challenger(&s, &name("x"), 2, Some(1), &settings.policy()).await.unwrap();
    let mut traces = Vec::new();
    for k in 0..6 {
        traces.extend(on_task("x", 1, &format!("a{k}"), 2, true));
        traces.extend(on_task("x", 2, &format!("a{k}"), 2, false));
        traces.extend(on_task("x", 1, &format!("b{k}"), 2, false));
        traces.extend(on_task("x", 2, &format!("b{k}"), 2, true));
    }
    s.insert_traces(&traces).await.unwrap();

    let sim = crate::common::spawn_sim(combee::simulation::llm::SimConfig::default()).await;
    let llm = LlmConfig { base_url: sim.url.clone(), backoff_base_ms: 1, ..Default::default() };
    let backend: Arc<dyn LlmBackend> = Arc::new(OpenAiClient::new(llm.clone()).unwrap());
    let denylist = Arc::new(ContentDenylist::default());
    let never = PopulationRater::new(s.clone(), PopulationSettings { crossover_prob: 0.0, ..settings.clone() })
        .with_crossover(backend.clone(), llm.clone(), denylist.clone());
    let rater = PopulationRater::new(s.clone(), settings.clone()).with_crossover(backend, llm, denylist);
    let now = chrono::Utc::now() + chrono::Duration::seconds(1);
    let from = now - chrono::Duration::seconds(60);
    assert_eq!(never.cross(&name("x"), from, now).await.unwrap(), CrossoverOutcome::NotDrawn);
    assert_eq!(sim.calls("crossover").await, 0);

    // The rater's tick rates the window (both arms are ranked), then crosses.
    let out = rater.rate(&name("x"), now).await.unwrap();
    assert!(matches!(out, RatingOutcome::Rated { ref ranked, .. } if ranked.len() == 2), "{out:?}");
    assert_eq!(sim.calls("crossover").await, 1);
    let child = s.resolve(&name("x"), &Selector::Version(3)).await.unwrap().expect("a crossover child, v3").version;
    assert_eq!(
        (child.source, child.parent, child.created_by.as_str()),
        (VersionSource::Crossover, Some(1), "crossover")
    );
    let lessons: Vec<&str> =
        child.content.playbook.as_ref().unwrap().bullets().map(|(_, b)| b.content.as_str()).collect();
    assert_eq!(lessons, ["INSIGHT-units: convert to SI first", "INSIGHT-dates: use ISO 8601 dates"]);
    assert!(child.message.contains("v1, v2"), "{}", child.message);

    let arms = s.population_page(&name("x"), None, 1000).await.unwrap();
    let c = arm(&arms, 3);
    assert_eq!((c.state, c.created_from, c.parents.as_slice()), (ArmState::Challenger, Some(1), [1, 2].as_slice()));
    // μ = precision-weighted mean of the parents' μ (after this window's update), σ = √(1/Σσᵢ⁻² + 1).
    let (r1, r2) = (arm(&arms, 1).rating, arm(&arms, 2).rating);
    let precision = r1.sigma.powi(-2) + r2.sigma.powi(-2);
    let mu = (r1.mu * r1.sigma.powi(-2) + r2.mu * r2.sigma.powi(-2)) / precision;
    assert!((c.rating.mu - mu).abs() < 1e-9, "{:?} vs μ {mu}", c.rating);
    assert!((c.rating.sigma - (1.0 / precision + 1.0).sqrt()).abs() < 1e-9, "{:?}", c.rating);
    assert!(c.weight > 0.0, "the child gets traffic");
    let total: f64 = live_weights(&arms).iter().map(|(_, w)| w).sum();
    assert!((total - 1.0).abs() < 1e-9, "{arms:?}");

    // Labelled candidate; the label history holds the evidence.
    let cand = s.resolve(&name("x"), &Selector::Label(LabelName::candidate())).await.unwrap().unwrap();
    assert_eq!(cand.version.number, 3);
    let history = s.label_history(&name("x"), Some(&LabelName::candidate()), None, 5).await.unwrap();
    assert_eq!((history[0].kind, history[0].actor.as_str()), (LabelMoveKind::Crossover, "crossover"));
    let ev = history[0].evidence.as_ref().unwrap();
    let won: Vec<(i64, usize)> = ev["won"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["version"].as_i64().unwrap(), w["tasks"].as_array().unwrap().len()))
        .collect();
    assert_eq!(won, [(1, 6), (2, 6)]);
    assert_eq!(ev["selection"]["import"][0]["from_version"], 2);
    assert_eq!(ev["template"], "crossover v1");
    // Production did not move: the child is only measured.
    let prod = s.resolve(&name("x"), &Selector::Label(LabelName::production())).await.unwrap().unwrap();
    assert_eq!(prod.version.number, 1);
    // The same window is not rated or crossed twice.
    assert_eq!(rater.rate(&name("x"), now).await.unwrap(), RatingOutcome::WindowOpen);
    assert_eq!(sim.calls("crossover").await, 1);
    // Crossing the same winners again would repeat v3: no new version.
    assert_eq!(rater.cross(&name("x"), from, now).await.unwrap(), CrossoverOutcome::SameAsArm { version: 3 });
    assert_eq!(s.list_versions(&name("x"), None, 10).await.unwrap().len(), 3);
}

/// Migration 0014: arms written before it (no `parents`) read their one
/// parent from `created_from`; a `crossover` version is accepted, and on
/// SQLite the rebuilt `versions` keeps every label's reference.
async fn migration_0014_reads_old_arms_parents_and_accepts_crossover_versions(b: Backend) {
    use sqlx::Connection;
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "old", 2).await;
    add_challenger(&s, &name("old"), 2, Some(1), &PopulationSettings::default().policy()).await.unwrap();
    let sql = "UPDATE population_arms SET parents = NULL";
    match b {
        Backend::Postgres => {
            let mut c = sqlx::PgConnection::connect(&ts.url).await.unwrap();
            sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
        }
        Backend::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(&ts.url).await.unwrap();
            sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
        }
    }
    let arms = s.population_page(&name("old"), None, 1000).await.unwrap();
    assert_eq!((arm(&arms, 1).parents.clone(), arm(&arms, 2).parents.clone()), (vec![], vec![1]));
    let crossed = NewVersion { source: VersionSource::Crossover, ..version("v3", Some(1)) };
    let mv = combee::domain::label::LabelMove {
        label: LabelName::candidate(),
        to_version: 0,
        expected_current: None,
        check_current: false,
        by: "t".into(),
    };
    let v = s.create_version(&name("old"), crossed, &[mv]).await.unwrap();
    assert_eq!((v.number, v.source), (3, VersionSource::Crossover));
    let listed = s.list_versions(&name("old"), None, 10).await.unwrap();
    assert_eq!(listed[0].source, VersionSource::Crossover);
    let history = s.label_history(&name("old"), Some(&LabelName::candidate()), None, 1).await.unwrap();
    assert_eq!(history[0].kind, LabelMoveKind::Crossover);
}

/// Retired arms stay in the store as history but off the hot path: the live
/// arms (what the rater, the served arms and a new arm's prior read) are the
/// champion and the challengers, plus any version asked for by name; the
/// whole population reads page by page; production moved back to a retired
/// arm brings it back with the rating it had.
async fn retired_arms_stay_as_history_off_the_hot_path(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "p", 12).await;
    // Every arm counts as measured (no scored traces needed): this is about where retired arms go.
    let policy = PopulationSettings { max_arms: 2, min_traces: 0, ..Default::default() }.policy();
    for v in 2..=12 {
        add_challenger(&s, &name("p"), v, Some(1), &policy).await.unwrap();
    }
    let live = s.live_arms(&name("p"), &[]).await.unwrap();
    assert_eq!(live.len(), 3, "the champion and max_arms challengers: {live:?}");
    assert!(live.iter().all(|a| a.state != ArmState::Retired), "{live:?}");
    assert!(live.iter().any(|a| a.version == 12), "the newest stays: {live:?}");
    // The whole population, page by page, by version: every arm once.
    let all = whole_population(&s, "p", 5).await;
    assert_eq!(all.iter().map(|a| a.version).collect::<Vec<_>>(), (1..=12).collect::<Vec<_>>());
    let retired: Vec<i64> = all.iter().filter(|a| a.state == ArmState::Retired).map(|a| a.version).collect();
    assert_eq!(retired.len(), 9);
    // A retired arm asked for by name comes with the live ones.
    let with_retired = s.live_arms(&name("p"), &[retired[0], 404]).await.unwrap();
    assert_eq!(with_retired.len(), 4, "{with_retired:?}");
    assert_eq!(arm(&with_retired, retired[0]).state, ArmState::Retired);
    // It measured well once; production goes back to it: it is the champion again, with its rating.
    let mut old = arm(&with_retired, retired[0]).clone();
    old.rating = Rating { mu: 31.0, sigma: 1.5 };
    s.save_population(&name("p"), &[old.clone()]).await.unwrap();
    let mv = combee::domain::label::LabelMove {
        label: LabelName::production(),
        to_version: old.version,
        expected_current: Some(1),
        check_current: true,
        by: "t".into(),
    };
    let cause = combee::domain::MoveCause::new(LabelMoveKind::Promote, "t".to_owned());
    combee::service::production::Mover::background(&s, policy).move_production(&name("p"), &mv, &cause).await.unwrap();
    let live = s.live_arms(&name("p"), &[]).await.unwrap();
    let back = arm(&live, old.version);
    assert_eq!((back.state, back.rating), (ArmState::Champion, Rating { mu: 31.0, sigma: 1.5 }));
    assert_eq!(arm(&live, 1).state, ArmState::Challenger, "the old champion competes on");
}

async fn many_arms_save_at_once_and_the_schedule_names_each_populations_last_window(b: Backend) {
    let ts = test_store(b).await;
    let s = ts.store.clone();
    evaluated_prompt(&s, "b", 130).await;
    evaluated_prompt(&s, "a", 2).await;
    evaluated_prompt(&s, "never", 1).await;
    let auto = NewPrompt {
        name: name("auto"),
        strategy: Strategy::Playbook,
        promotion: Promotion::Auto,
        settings: PromptSettings::default(),
        created_by: "test".into(),
    };
    s.create_prompt(auto, version("v1", None)).await.unwrap();
    let t0 = chrono::DateTime::parse_from_rfc3339("2026-11-20T10:00:00Z").unwrap().with_timezone(&chrono::Utc);
    // More arms than one statement writes, each with its own values: every one reads back as saved.
    let arms: Vec<PopulationArm> = (1..=130)
        .map(|v| PopulationArm {
            version: v,
            state: match v {
                1 => ArmState::Champion,
                v if v % 2 == 0 => ArmState::Challenger,
                _ => ArmState::Retired,
            },
            rating: Rating { mu: 20.0 + v as f64 / 10.0, sigma: 1.0 + v as f64 / 100.0 },
            weight: if v % 2 == 0 { 0.001 * v as f64 } else { 0.0 },
            scored_traces: 3 * v as u64,
            created_from: (v > 1).then_some(v - 1),
            parents: if v > 2 { vec![v - 1, v - 2] } else { Vec::new() },
            // A retired arm was rated last: the schedule counts live arms only.
            rated_until: Some(t0 + chrono::Duration::seconds(if v == 1 || v % 2 == 0 { v } else { 1000 + v })),
            joined_at: None,
        })
        .collect();
    s.save_population(&name("b"), &arms).await.unwrap();
    let back = whole_population(&s, "b", 50).await;
    // The store says when each arm joined, and keeps it through later saves.
    let joined: Vec<_> = back.iter().map(|a| a.joined_at.expect("a stored arm says when it joined")).collect();
    let unjoined =
        |arms: Vec<PopulationArm>| arms.into_iter().map(|a| PopulationArm { joined_at: None, ..a }).collect::<Vec<_>>();
    assert_eq!(unjoined(back), arms);
    // All or nothing: one unknown version refuses the whole save, naming it.
    let mut changed = arms[..3].to_vec();
    changed[0].rating.mu = 40.0;
    changed.push(PopulationArm { version: 404, ..arms[1].clone() });
    match s.save_population(&name("b"), &changed).await {
        Err(StoreError::Invalid(why)) => assert!(why.contains("404"), "{why}"),
        other => panic!("expected Invalid, got {other:?}"),
    }
    assert_eq!(arm(&s.live_arms(&name("b"), &[]).await.unwrap(), 1).rating, arms[0].rating);
    // The rater's saves (a commit that need not wait for the disk) store the same, by the same rules.
    let mut rated = arms.clone();
    for a in &mut rated {
        a.rating.mu += 1.0;
        a.rated_until = a.rated_until.map(|t| t + chrono::Duration::seconds(600));
    }
    s.save_ratings(&name("b"), &rated).await.unwrap();
    let back = whole_population(&s, "b", 50).await;
    assert_eq!(back.iter().map(|a| a.joined_at.unwrap()).collect::<Vec<_>>(), joined);
    assert_eq!(unjoined(back), rated);
    match s.save_ratings(&name("b"), &changed).await {
        Err(StoreError::Invalid(why)) => assert!(why.contains("404"), "{why}"),
        other => panic!("expected Invalid, got {other:?}"),
    }
    assert!(matches!(s.save_ratings(&name("nope"), &rated[..1]).await, Err(StoreError::NotFound)));
    s.save_population(&name("b"), &arms).await.unwrap();
    assert_eq!(unjoined(whole_population(&s, "b", 50).await), arms);
    s.save_population(&name("a"), &[PopulationArm { rated_until: None, ..arms[0].clone() }]).await.unwrap();
    // Evaluated prompts only, by name, paged; each with its live arms' last window.
    let page = s.rating_schedule(None, 2).await.unwrap();
    let slots: Vec<(String, Option<chrono::DateTime<chrono::Utc>>)> =
        page.iter().map(|r| (r.prompt.to_string(), r.rated_until)).collect();
    assert_eq!(slots, [("a".to_owned(), None), ("b".to_owned(), Some(t0 + chrono::Duration::seconds(130)))]);
    let rest = s.rating_schedule(Some(&name("b")), 2).await.unwrap();
    assert_eq!(
        rest.iter().map(|r| (r.prompt.to_string(), r.rated_until)).collect::<Vec<_>>(),
        [("never".to_owned(), None)]
    );
}

on_both_stores!(
    many_arms_save_at_once_and_the_schedule_names_each_populations_last_window,
    retired_arms_stay_as_history_off_the_hot_path,
    crossover_makes_a_child_from_two_arms_that_won_different_tasks,
    migration_0014_reads_old_arms_parents_and_accepts_crossover_versions,
    migration_0013_keeps_existing_prompts_and_their_references,
    children_join_as_challengers_and_the_weakest_is_retired,
    sticky_shares_follow_the_stored_weights,
    the_gate_waits_for_evidence_then_promotes_a_clearly_better_challenger,
);

mod http {
    //! Serving an `evaluated` prompt over HTTP: sticky arms by subject,
    //! the arm named in the answer, ETag/304, `Vary`, the population route.

    use super::*;
    use crate::common::{eventually, expect_problem, spawn_app};
    use serde_json::Value;
    use std::time::Duration;

    async fn served(app: &crate::common::TestApp, subject: &str) -> (i64, String, String) {
        let res = app.get("/v1/prompts/p").header("Combee-Subject", subject).send().await.unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["vary"], "Combee-Subject");
        let etag = res.headers()["etag"].to_str().unwrap().to_owned();
        let arm_header = res.headers()["combee-arm"].to_str().unwrap().to_owned();
        let body: Value = res.json().await.unwrap();
        assert_eq!(body["arm"], arm_header.as_str());
        (body["version"].as_i64().unwrap(), arm_header, etag)
    }

    async fn subjects_get_sticky_arms_and_the_population_is_visible(b: Backend) {
        let app = spawn_app(b).await;
        let res = app
            .post("/v1/prompts", json!({"name": "p", "base": "You are an agent.", "promotion": "evaluated"}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        let res = app.post("/v1/prompts/p/versions", json!({"base": "You are a careful agent."})).send().await.unwrap();
        assert_eq!(res.status(), 201);
        let policy = PopulationSettings { explore_share: 0.5, min_arm_share: 0.5, ..Default::default() }.policy();
        add_challenger(&app.store, &name("p"), 2, Some(1), &policy).await.unwrap();

        // Each subject keeps its arm; both arms are served to someone.
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..40 {
            let subject = format!("agent-{i}");
            let (v, arm, etag) = served(&app, &subject).await;
            assert_eq!(served(&app, &subject).await.0, v, "{subject} flipped");
            assert_eq!(arm, if v == 1 { "champion" } else { "challenger" });
            seen.insert(v);
            // ETag/304 still work on the served arm.
            let res = app
                .get(&format!("/v1/prompts/p?subject={subject}"))
                .header("if-none-match", &etag)
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), 304);
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![1, 2]);
        // Explicit selectors are unchanged: production is still v1.
        let res = app.get("/v1/prompts/p?label=production").header("Combee-Subject", "agent-1").send().await.unwrap();
        assert!(res.headers().get("combee-arm").is_none());
        assert_eq!(res.json::<Value>().await.unwrap()["version"], 1);
        // Without a subject an arm is drawn per request.
        let res = app.get("/v1/prompts/p").send().await.unwrap();
        assert!(res.headers().get("combee-arm").is_some());
        // A bad subject is a 400 with an explanation.
        let long = "x".repeat(300);
        expect_problem(app.get(&format!("/v1/prompts/p?subject={long}")).send().await.unwrap(), 400).await;

        let pop: Value = app.get("/v1/prompts/p/population").send().await.unwrap().json().await.unwrap();
        assert_eq!(pop["promotion"], "evaluated");
        let arms = pop["arms"].as_array().unwrap();
        assert_eq!(arms.len(), 2);
        assert_eq!((arms[0]["version"].as_i64(), arms[0]["state"].as_str()), (Some(1), Some("champion")));
        assert_eq!(arms[1]["state"], "challenger");
        assert_eq!(arms[1]["created_from"], 1);
        assert!((arms[0]["weight"].as_f64().unwrap() - 0.5).abs() < 1e-9);
        assert!(arms[1]["rating"]["sigma"].as_f64().unwrap() > 25.0 / 3.0);
        assert!(pop["next_page_token"].is_null(), "{pop}");
        expect_problem(app.get("/v1/prompts/nope/population").send().await.unwrap(), 404).await;
        // Page by page, by version.
        let page: Value = app.get("/v1/prompts/p/population?page_size=1").send().await.unwrap().json().await.unwrap();
        assert_eq!((page["arms"][0]["version"].as_i64(), page["next_page_token"].as_str()), (Some(1), Some("1")));
        let page: Value =
            app.get("/v1/prompts/p/population?page_size=1&page_token=1").send().await.unwrap().json().await.unwrap();
        assert_eq!(page["arms"][0]["version"], 2, "{page}");
        expect_problem(app.get("/v1/prompts/p/population?page_token=x").send().await.unwrap(), 400).await;

        // A weight change in the store reaches the serving cache: v1 retired, v2 gets everything.
        let mut arms = app.store.population_page(&name("p"), None, 1000).await.unwrap();
        for a in &mut arms {
            (a.state, a.weight) = if a.version == 2 { (ArmState::Champion, 1.0) } else { (ArmState::Retired, 0.0) };
        }
        app.store.save_population(&name("p"), &arms).await.unwrap();
        eventually("the served arms following the stored weights", Duration::from_secs(5), async || {
            let mut served_versions = Vec::new();
            for i in 0..10 {
                served_versions.push(served(&app, &format!("agent-{i}")).await.0);
            }
            if served_versions.iter().all(|v| *v == 2) { Ok(()) } else { Err(format!("served {served_versions:?}")) }
        })
        .await;
    }

    /// New prompts are `evaluated` by default, and their population exists
    /// from the first moment: on an API-only server (no worker, no rater)
    /// the first GET names the champion arm. An operator's promote is served
    /// at once, before any rater reconciles the stored population.
    async fn a_new_prompt_is_evaluated_and_names_its_arm_from_the_first_get(b: Backend) {
        // `spawn_app` runs the API role only: no worker, no rater.
        let app = spawn_app(b).await;
        let res = app.post("/v1/prompts", json!({"name": "p", "base": "You are an agent."})).send().await.unwrap();
        assert_eq!(res.status(), 201);
        assert_eq!(res.json::<Value>().await.unwrap()["promotion"], "evaluated");
        let (v, arm, _) = served(&app, "agent-1").await;
        assert_eq!((v, arm.as_str()), (1, "champion"));
        let res = app.get("/v1/prompts/p").send().await.unwrap();
        assert_eq!(res.headers()["combee-arm"], "champion", "without a subject too");
        let pop: Value = app.get("/v1/prompts/p/population").send().await.unwrap().json().await.unwrap();
        let arms = pop["arms"].as_array().unwrap();
        assert_eq!(arms.len(), 1);
        assert_eq!((arms[0]["version"].as_i64(), arms[0]["state"].as_str()), (Some(1), Some("champion")));
        assert_eq!((arms[0]["weight"].as_f64(), arms[0]["rating"]["mu"].as_f64()), (Some(1.0), Some(25.0)));

        // An operator makes v2 production: at once it is the champion (most of
        // the traffic) and v1 competes on as a challenger.
        let res = app
            .post("/v1/prompts/p/versions", json!({"base": "You are a careful agent.", "labels": ["production"]}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        let pop: Value = app.get("/v1/prompts/p/population").send().await.unwrap().json().await.unwrap();
        let states: Vec<(i64, &str)> = pop["arms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| (a["version"].as_i64().unwrap(), a["state"].as_str().unwrap()))
            .collect();
        assert_eq!(states, [(1, "challenger"), (2, "champion")]);
        let mut on_v2 = 0;
        for i in 0..50 {
            let (v, arm, _) = served(&app, &format!("agent-{i}")).await;
            assert_eq!(arm, if v == 2 { "champion" } else { "challenger" }, "agent-{i} got v{v}");
            on_v2 += usize::from(v == 2);
        }
        assert!(on_v2 >= 30, "the new production serves most subjects: {on_v2}/50");

        // `auto` and `manual` stay available and have no population.
        for policy in ["auto", "manual"] {
            let n = format!("p-{policy}");
            let res =
                app.post("/v1/prompts", json!({"name": n, "base": "b", "promotion": policy})).send().await.unwrap();
            assert_eq!(res.json::<Value>().await.unwrap()["promotion"], policy);
            let res = app.get(&format!("/v1/prompts/{n}?subject=a")).send().await.unwrap();
            assert!(res.headers().get("combee-arm").is_none(), "{policy}");
        }
    }

    /// The wiring: a server with a worker (the simulated LLM) crosses on its
    /// own rater ticks. Agents post traces over HTTP with task keys on which
    /// v1 and v2 win different tasks; a `crossover` version appears, served to
    /// some subjects, and the simulator saw the crossover call.
    async fn the_worker_crosses_winners_on_its_own_ticks(b: Backend) {
        let sim = crate::common::spawn_sim(combee::simulation::llm::SimConfig::default()).await;
        let app = crate::common::spawn_app_with(b, |s| {
            crate::common::learning(s, &sim.url);
            s.population.tick_secs = 1;
            s.population.window_secs = 2;
            s.population.crossover_prob = 1.0;
        })
        .await;
        let playbook = |lesson: &str| json!({"sections": [{"name": "insights", "bullets": [{"content": lesson}]}]});
        let res = app
            .post(
                "/v1/prompts",
                json!({"name": "p", "base": "You are an agent.", "playbook": playbook("INSIGHT-units: convert to SI first"),
                       "settings": {"batch_size": 1000}}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        let res = app
            .post(
                "/v1/prompts/p/versions",
                json!({"base": "You are an agent.", "playbook": playbook("INSIGHT-dates: use ISO 8601 dates")}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
        add_challenger(&app.store, &name("p"), 2, Some(1), &PopulationSettings::default().policy()).await.unwrap();

        let trace = |v: i64, key: &str, success: bool| {
            json!({"prompt": "p", "prompt_version": v, "input": key, "feedback": {"success": success},
                   "metadata": {"task_key": key}})
        };
        let arm = eventually("a crossover child", Duration::from_secs(30), async || {
            // Traces keep arriving, so every rating window holds some.
            let mut batch = Vec::new();
            for k in 0..6 {
                for _ in 0..2 {
                    batch.push(trace(1, &format!("a{k}"), true));
                    batch.push(trace(2, &format!("a{k}"), false));
                    batch.push(trace(1, &format!("b{k}"), false));
                    batch.push(trace(2, &format!("b{k}"), true));
                }
            }
            assert_eq!(app.post("/v1/traces", json!({"traces": batch})).send().await.unwrap().status(), 201);
            // The child's version is written first, then it joins the population: wait for the arm.
            let pop: Value = app.get("/v1/prompts/p/population").send().await.unwrap().json().await.unwrap();
            let crossed = pop["arms"]
                .as_array()
                .unwrap()
                .iter()
                .find(|a| a["parents"].as_array().is_some_and(|p| p.len() == 2))
                .cloned();
            // A batch every 300 ms or so.
            tokio::time::sleep(Duration::from_millis(250)).await;
            crossed.ok_or_else(|| pop.to_string())
        })
        .await;
        assert_eq!(arm["parents"], json!([1, 2]), "{arm}");
        assert!(sim.calls("crossover").await >= 1);
        let n = arm["version"].as_i64().unwrap();
        let versions: Value = app.get("/v1/prompts/p/versions").send().await.unwrap().json().await.unwrap();
        let child = versions["versions"].as_array().unwrap().iter().find(|v| v["number"] == n).cloned().unwrap();
        assert_eq!((child["source"].as_str(), child["parent"].as_i64()), (Some("crossover"), Some(1)), "{child}");
        assert!(arm["weight"].as_f64().unwrap() > 0.0, "{arm}");
        let shown: Value = app.get(&format!("/v1/prompts/p?version={n}")).send().await.unwrap().json().await.unwrap();
        let shown = shown["text"].as_str().unwrap();
        assert!(shown.contains("INSIGHT-units") && shown.contains("INSIGHT-dates"), "{shown}");
    }

    /// A prompt's own population knobs: set with the settings PATCH, checked,
    /// shown with the prompt, and used for its population (here its traffic split).
    async fn a_prompts_own_population_knobs_are_patched_checked_and_used(b: Backend) {
        let app = spawn_app(b).await;
        let res = app.post("/v1/prompts", json!({"name": "p", "base": "You are an agent."})).send().await.unwrap();
        assert_eq!(res.status(), 201);
        let patch = |body: Value| {
            app.http
                .patch(app.url("/v1/prompts/p/settings"))
                .bearer_auth(&app.admin_key)
                .header("content-type", "application/merge-patch+json")
                .body(body.to_string())
                .send()
        };
        let res =
            patch(json!({"population": {"explore_share": 0.5, "margin": 0.5, "cooldown_windows": 2}})).await.unwrap();
        assert_eq!(res.status(), 200);
        let prompt: Value = res.json().await.unwrap();
        assert_eq!(
            prompt["settings"]["population"],
            json!({"explore_share": 0.5, "margin": 0.5, "cooldown_windows": 2})
        );
        // One member at a time, merged; `null` resets one to the server's default.
        let prompt: Value =
            patch(json!({"population": {"margin": null, "max_arms": 2}})).await.unwrap().json().await.unwrap();
        assert_eq!(
            prompt["settings"]["population"],
            json!({"explore_share": 0.5, "max_arms": 2, "cooldown_windows": 2})
        );
        for (bad, word) in [
            (json!({"population": {"explore_share": 1.5}}), "explore_share"),
            (json!({"population": {"crossover_prob": -0.1}}), "crossover_prob"),
            (json!({"population": {"margins": 1}}), "margins"),
        ] {
            let problem = expect_problem(patch(bad).await.unwrap(), 422).await;
            assert!(problem["detail"].as_str().unwrap().contains(word), "{problem}");
        }
        // A child joins with the prompt's exploration share, not the server's 0.2.
        let res = app.post("/v1/prompts/p/versions", json!({"base": "You are a careful agent."})).send().await.unwrap();
        assert_eq!(res.status(), 201);
        add_challenger(&app.store, &name("p"), 2, Some(1), &PopulationSettings::default().policy()).await.unwrap();
        let arms = app.store.population_page(&name("p"), None, 1000).await.unwrap();
        assert!((arm(&arms, 1).weight - 0.5).abs() < 1e-9, "{arms:?}");
    }

    on_both_stores!(
        a_prompts_own_population_knobs_are_patched_checked_and_used,
        subjects_get_sticky_arms_and_the_population_is_visible,
        a_new_prompt_is_evaluated_and_names_its_arm_from_the_first_get,
        the_worker_crosses_winners_on_its_own_ticks,
    );
}
