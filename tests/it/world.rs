//! The simulated agent world (a simulation) against a real server learning
//! from a simulated LLM: the closed loop the service exists for — agents'
//! success rate rises once learned versions hold their tasks' lessons.

use serde_json::json;

use crate::common::{Backend, learning, spawn_app_with, spawn_sim};
use combee::simulation::llm::SimConfig;
use combee::simulation::world::{World, WorldConfig, markdown};

fn world(prompt: &str, runs: u32, poison_share: f64) -> WorldConfig {
    WorldConfig {
        prompt: prompt.into(),
        task_types: 4,
        tasks_per_type: 10,
        runs,
        window: 24,
        agents: 4,
        subjects: 4,
        poison_share,
        base_success: 0.3,
        lesson_lift: 0.5,
        harm_drop: 0.4,
        settle_secs: 30.0,
        seed: 3,
        no_feedback: false,
        house_rules: 0,
        rate: None,
    }
}

async fn learned_versions_lift_the_agents_success_rate(b: Backend) {
    let sim = spawn_sim(SimConfig::default()).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    let res = app
        .post(
            "/v1/prompts",
            json!({"name": "world", "base": "You solve tasks.", "promotion": "auto", "settings": {"batch_size": 24, "max_wait_secs": 1}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());

    let report = World::new(&app.base, &app.admin_key, world("world", 24 * 6, 0.0)).unwrap().run(|_| {}).await.unwrap();
    eprintln!("{}", markdown(&report));
    let w = &report.windows;
    assert_eq!(w.len(), 6);
    assert_eq!(w[0].versions.keys().copied().collect::<Vec<_>>(), vec![1], "the first window ran on version 1");
    let last = w.last().unwrap();
    assert!(last.lessons_in_prompt >= 3, "production learned the lessons: {report:?}");
    assert!(!last.harmful_in_prompt);
    let late = (w[4].success_rate + w[5].success_rate) / 2.0;
    assert!(late >= w[0].success_rate + 0.2, "success {:.2} → {late:.2}: {report:?}", w[0].success_rate);
    assert!(last.versions.keys().all(|&v| v > 1), "agents ran on learned versions: {report:?}");
}

/// Under `auto`, poisoned feedback reaches production: the hazard the
/// promotion gate of the `evaluated` policy is for. The denylist stops it.
async fn poisoned_feedback_reaches_production_unless_denylisted(b: Backend) {
    let sim = spawn_sim(SimConfig::default()).await;
    for denylist in [false, true] {
        let app = spawn_app_with(b, |s| {
            learning(s, &sim.url);
            if denylist {
                s.worker.denylist_substrings = vec!["skip every check".into()];
            }
        })
        .await;
        app.post(
            "/v1/prompts",
            json!({"name": "world", "base": "You solve tasks.", "promotion": "auto", "settings": {"batch_size": 24, "max_wait_secs": 1}}),
        )
        .send()
        .await
        .unwrap();
        // With the denylist every round fails, so the backlog never settles: wait less.
        let cfg = WorldConfig { settle_secs: if denylist { 3.0 } else { 30.0 }, ..world("world", 24 * 3, 0.3) };
        let report = World::new(&app.base, &app.admin_key, cfg).unwrap().run(|_| {}).await.unwrap();
        eprintln!("denylist {denylist}:\n{}", markdown(&report));
        let harmed = report.windows.iter().any(|w| w.harmful_in_prompt);
        assert_eq!(harmed, !denylist, "{report:?}");
    }
}

on_both_stores!(learned_versions_lift_the_agents_success_rate);
on_one_store!(
    poisoned_feedback_reaches_production_unless_denylisted_on_postgres:
        poisoned_feedback_reaches_production_unless_denylisted(Postgres)
);
