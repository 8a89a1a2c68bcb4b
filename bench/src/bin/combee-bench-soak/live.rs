//! The live phase: simulated agents and a dashboard load the server on
//! product defaults while each period's figures are taken.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};

use crate::history::table_sizes;
use crate::period::{Live, Period, Recorder, Upkeep, counter, labelled_sum, record, summary};
use crate::processes::{CpuSecs, Server, rss_kb};
use crate::{SoakArgs, insight, log, prompt_name};

pub(crate) async fn live(args: &SoakArgs, server: &Server, sim_pid: u32, key: &str, url: &str) -> anyhow::Result<Live> {
    let base = format!("http://{}", server.addr);
    let http = reqwest::Client::builder().pool_max_idle_per_host(256).timeout(Duration::from_secs(30)).build()?;
    let recorder: Recorder = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let runs = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    // Agents: one run every 1/rate seconds, each in its own task (open loop).
    {
        let (http, base, key, recorder, stop, runs) =
            (http.clone(), base.clone(), key.to_owned(), recorder.clone(), stop.clone(), runs.clone());
        let args = args.clone();
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut n: u64 = 0;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                n += 1;
                runs.fetch_add(1, Ordering::Relaxed);
                let (http, base, key, recorder, args) =
                    (http.clone(), base.clone(), key.clone(), recorder.clone(), args.clone());
                tokio::spawn(async move { agent_run(n, &http, &base, &key, &recorder, &args).await });
            }
        });
    }
    // A dashboard.
    {
        let (http, base, key, recorder, stop) =
            (http.clone(), base.clone(), key.to_owned(), recorder.clone(), stop.clone());
        let (every, prompts) = (Duration::from_secs_f64(1.0 / args.metrics_rate), args.prompts);
        tasks.spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            let mut tick = tokio::time::interval(every);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let t0 = Instant::now();
                let name = prompt_name(rng.gen_range(0..prompts));
                let res = http.get(format!("{base}/v1/prompts/{name}/metrics")).bearer_auth(&key).send().await;
                record(&recorder, "GET metrics", t0, res.map(|r| r.status().as_u16()).map_err(|e| e.to_string()), 200);
            }
        });
    }
    let mut db = PgConnection::connect(url).await?;
    let period = Duration::from_secs(args.live_secs / u64::from(args.periods.max(1)));
    let mut lengths: Vec<(bool, Duration)> = vec![(false, period); args.periods.max(1) as usize];
    if args.warmup_secs > 0 {
        lengths.insert(0, (true, Duration::from_secs(args.warmup_secs)));
    }
    let mut periods = Vec::new();
    let mut last_scrape = String::new();
    let mut last_upkeep = Upkeep::read(&mut db).await?;
    let mut last_cpu = CpuSecs::read(server.pid, sim_pid);
    let statements = insight::Statements::enable(&mut db).await;
    let sampler = insight::Sampler::start(url).await?;
    for (p, (warmup, length)) in lengths.into_iter().enumerate() {
        let from = chrono::Utc::now();
        statements.reset(&mut db).await;
        sampler.take();
        tokio::time::sleep(length).await;
        let inside = sampler.take();
        let period_statements = statements.read(&mut db).await;
        let now_cpu = CpuSecs::read(server.pid, sim_pid);
        let cpu = now_cpu.since(&last_cpu);
        last_cpu = now_cpu;
        let samples = std::mem::take(&mut *recorder.lock().unwrap_or_else(|e| e.into_inner()));
        let scrape = http.get(format!("{base}/metrics")).send().await?.text().await?;
        let (rs, rc) = summary(&scrape, "combee_rater_tick_seconds");
        let (ls, lc) = summary(&last_scrape, "combee_rater_tick_seconds");
        let phase = |s: &str, phase: &str| labelled_sum(s, "combee_rater_phase_seconds", &format!("phase=\"{phase}\""));
        let since = |phase_name: &str| phase(&scrape, phase_name) - phase(&last_scrape, phase_name);
        let rater_llm = since("crossover_llm");
        let windows_work = since("read") + since("save");
        let rater_read_save = (since("read"), since("save"));
        let windows =
            counter(&scrape, "combee_rater_windows_total") - counter(&last_scrape, "combee_rater_windows_total");
        let deleted = counter(&scrape, "combee_retention_deleted_total{what=\"traces\"}")
            - counter(&last_scrape, "combee_retention_deleted_total{what=\"traces\"}");
        last_scrape = scrape;
        let rounds: Vec<f64> = sqlx::query_scalar(
            "SELECT extract(epoch FROM finished_at - started_at)::float8 FROM rounds
             WHERE status = 'succeeded' AND finished_at >= $1 AND started_at IS NOT NULL",
        )
        .bind(from)
        .fetch_all(&mut db)
        .await?;
        let traces: i64 = sqlx::query_scalar("SELECT count(*) FROM traces").fetch_one(&mut db).await?;
        let live_arms: f64 = sqlx::query_scalar(
            "SELECT coalesce(count(*)::float8 / nullif(count(DISTINCT prompt_id), 0), 0) FROM population_arms
             WHERE state <> 'retired'",
        )
        .fetch_one(&mut db)
        .await?;
        let now_upkeep = Upkeep::read(&mut db).await?;
        let upkeep = now_upkeep.since(&last_upkeep);
        last_upkeep = now_upkeep;
        let period = Period {
            warmup,
            rater_llm,
            rater_windows: (windows_work, windows),
            rater_read_save,
            live_arms,
            upkeep,
            cpu,
            inside,
            statements: period_statements,
            secs: length.as_secs_f64(),
            samples,
            sizes: table_sizes(&mut db).await?,
            rss_kb: rss_kb(server.pid),
            rater: (rs - ls, rc - lc),
            rounds,
            deleted,
            traces,
        };
        let get = period.samples.get("GET prompt").map_or(f64::NAN, |s| s.quantile_ms(0.99));
        let name =
            if warmup { "warm-up".to_owned() } else { format!("period {}", p + usize::from(args.warmup_secs == 0)) };
        log(format!("{name}: GET p99 {get:.2} ms, {traces} traces stored, {deleted:.0} deleted"));
        periods.push(period);
    }
    stop.store(true, Ordering::Relaxed);
    tasks.shutdown().await;
    Ok(Live { periods, runs: runs.load(Ordering::Relaxed) })
}

/// One simulated agent run: fetch the prompt for a subject, run (simulated),
/// report the trace with its reward, sometimes feedback later.
async fn agent_run(n: u64, http: &reqwest::Client, base: &str, key: &str, recorder: &Recorder, args: &SoakArgs) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(n);
    let name = prompt_name(rng.gen_range(0..args.prompts));
    let subject = format!("user-{}", rng.gen_range(0..args.subjects));
    let t0 = Instant::now();
    let res =
        http.get(format!("{base}/v1/prompts/{name}")).bearer_auth(key).header("combee-subject", &subject).send().await;
    let version = match res {
        Ok(r) => {
            let status = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            record(recorder, "GET prompt", t0, Ok(status), 200);
            body["version"].as_i64()
        }
        Err(e) => {
            record(recorder, "GET prompt", t0, Err(e.to_string()), 200);
            None
        }
    };
    let success = rng.gen_bool(0.6);
    let score = f64::from(rng.gen_range(0..=10)) / 10.0;
    let task = format!("task-{}", rng.gen_range(0..40));
    if rng.gen_bool(args.otlp_share) {
        let now_ns = chrono::Utc::now().timestamp_nanos_opt().unwrap_or(0);
        let body = json!({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "soak-agent"}}]},
        "scopeSpans": [{"spans": [{
            "traceId": format!("{:032x}", rng.r#gen::<u128>()), "spanId": format!("{:016x}", rng.r#gen::<u64>()),
            "name": format!("invoke_agent {name}"), "kind": 3,
            "startTimeUnixNano": (now_ns - 900_000_000).to_string(), "endTimeUnixNano": now_ns.to_string(),
            "attributes": [
                {"key": "gen_ai.prompt.name", "value": {"stringValue": name}},
                {"key": "gen_ai.prompt.version", "value": {"intValue": version.unwrap_or(1).to_string()}},
                {"key": "gen_ai.prompt", "value": {"stringValue": format!("How do I reset the password of {subject}?")}},
                {"key": "gen_ai.completion", "value": {"stringValue": "Settings, Security, Reset."}},
                {"key": "combee.feedback.success", "value": {"boolValue": success}},
                {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "240"}}
            ]}]}]}]});
        let t0 = Instant::now();
        let res = http.post(format!("{base}/v1/otlp/v1/traces")).bearer_auth(key).json(&body).send().await;
        record(recorder, "OTLP export", t0, res.map(|r| r.status().as_u16()).map_err(|e| e.to_string()), 200);
        return;
    }
    let trace = json!({
        "prompt": name, "prompt_version": version,
        "input": {"question": format!("How do I reset the password of {subject}?")},
        "trajectory": [{"role": "assistant", "content": "Looking up the account"}, {"role": "tool", "name": "lookup", "content": "found"}],
        "output": "Go to Settings, then Security, then Reset.",
        "feedback": {"success": success, "score": score},
        "metadata": {"task_key": task, "tokens": rng.gen_range(200..500)},
    });
    let t0 = Instant::now();
    let res = http.post(format!("{base}/v1/traces")).bearer_auth(key).json(&trace).send().await;
    let id = match res {
        Ok(r) => {
            let status = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            record(recorder, "POST trace", t0, Ok(status), 201);
            body["ids"][0].as_str().or(body["id"].as_str()).map(str::to_owned)
        }
        Err(e) => {
            record(recorder, "POST trace", t0, Err(e.to_string()), 201);
            None
        }
    };
    if let Some(id) = id.filter(|_| rng.gen_bool(args.late_feedback)) {
        tokio::time::sleep(Duration::from_secs(rng.gen_range(1..10))).await;
        let t0 = Instant::now();
        let res = http
            .post(format!("{base}/v1/traces/{id}/feedback"))
            .bearer_auth(key)
            .json(&json!({"score": 1.0, "comment": "the user confirmed it worked"}))
            .send()
            .await;
        record(recorder, "late feedback", t0, res.map(|r| r.status().as_u16()).map_err(|e| e.to_string()), 200);
    }
}
