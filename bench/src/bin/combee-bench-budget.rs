//! The learning budget under caps set below the natural spend, against the
//! OpenAI-compatible simulator (a SIMULATED LLM, not a model; characters / 4
//! as its tokenizer, one answer in five a 500 so calls are retried): the real
//! server with its worker on a SQLite store, in this process so the bench can
//! end a simulated UTC day by moving the worker's clock.
//!
//! Three runs, each printing the cap, what was spent, the overshoot past the
//! cap beside the largest single call (an overshoot is at most one call), and
//! the traces pending / consumed / failed / lost (none may fail or be lost):
//! a daily cap, lifted by the simulated day rolling over until every trace is
//! learned from; a daily cap lifted by raising it through the API; a round
//! cap (every pass of the round together), lifted by raising it.
//!
//!     cargo run -p combee-bench --bin combee-bench-budget      # figures on stdout

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use combee::{
    app::Application,
    simulation::llm::{LocalSim, SimConfig},
};
use serde_json::{Value, json};

#[derive(Parser)]
struct BudgetArgs {
    /// Traces each run learns from.
    #[arg(long, default_value_t = 24)]
    traces: usize,
    /// The daily cap of the first two runs, in tokens (learning the traces costs far more).
    #[arg(long, default_value_t = 6_000)]
    daily_cap: u64,
    /// The round cap of the third run, in tokens (one round of every trace costs far more).
    #[arg(long, default_value_t = 8_000)]
    round_cap: u64,
    /// The simulator's seed.
    #[arg(long, default_value_t = 11)]
    seed: u64,
}

struct Api {
    http: reqwest::Client,
    base: String,
    key: String,
}

impl Api {
    async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        let mut req = self.http.request(method.clone(), format!("{}{path}", self.base)).bearer_auth(&self.key);
        if let Some(b) = body {
            let merge = method == reqwest::Method::PATCH;
            let kind = if merge { "application/merge-patch+json" } else { "application/json" };
            req = req.header("content-type", kind).body(b.to_string());
        }
        let res = req.send().await?;
        let status = res.status();
        let text = res.text().await?;
        if !status.is_success() {
            bail!("{method} {path}: {status} {text}");
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    async fn get(&self, path: &str) -> anyhow::Result<Value> {
        self.send(reqwest::Method::GET, path, None).await
    }

    async fn traces(&self, name: &str, status: &str) -> anyhow::Result<usize> {
        let page = self.get(&format!("/v1/traces?prompt={name}&status={status}&page_size=200")).await?;
        Ok(page["traces"].as_array().map_or(0, Vec::len))
    }

    async fn rounds(&self, name: &str) -> anyhow::Result<Vec<Value>> {
        let page = self.get(&format!("/v1/prompts/{name}/rounds?page_size=100")).await?;
        Ok(page["rounds"].as_array().cloned().unwrap_or_default())
    }

    /// Tokens spent per UTC day (newest first) and in all.
    async fn spend(&self, name: &str) -> anyhow::Result<(Vec<u64>, u64)> {
        let s = self.get(&format!("/v1/prompts/{name}/spend?days=60")).await?;
        let days: Vec<u64> =
            s["days"].as_array().into_iter().flatten().map(|d| d["tokens"].as_u64().unwrap_or(0)).collect();
        let total = days.iter().sum();
        Ok((days, total))
    }

    /// The most tokens one attempt of the prompt's rounds used.
    async fn largest_call(&self, name: &str) -> anyhow::Result<u64> {
        let mut most = 0;
        for r in self.rounds(name).await? {
            let view = self.get(&format!("/v1/rounds/{}", r["id"].as_str().unwrap_or_default())).await?;
            for c in view["llm_calls"].as_array().into_iter().flatten() {
                let t = c["prompt_tokens"].as_u64().unwrap_or(0) + c["completion_tokens"].as_u64().unwrap_or(0);
                most = most.max(t);
            }
        }
        Ok(most)
    }

    /// Waits until the prompt's spend stops moving with no round running (learning waits), or it is done.
    async fn settled(&self, name: &str, total: usize) -> anyhow::Result<u64> {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let before = self.spend(name).await?.1;
            tokio::time::sleep(Duration::from_secs(3)).await;
            let after = self.spend(name).await?.1;
            let running = self.rounds(name).await?.iter().any(|r| r["status"] == "running");
            if (before == after && !running) || self.traces(name, "consumed").await? == total {
                return Ok(after);
            }
            if Instant::now() > deadline {
                bail!("{name}: the spend did not settle in 180 s");
            }
        }
    }

    /// Pending, consumed and failed traces, and failed rounds.
    async fn tally(&self, name: &str, total: usize) -> anyhow::Result<String> {
        let pending = self.traces(name, "pending").await?;
        let consumed = self.traces(name, "consumed").await?;
        let failed = self.traces(name, "failed").await?;
        let lost = total.saturating_sub(pending + consumed + failed);
        let rounds_failed = self.rounds(name).await?.iter().filter(|r| r["status"] == "failed").count();
        Ok(format!(
            "traces pending {pending}, consumed {consumed}, failed {failed}, lost {lost}; rounds failed {rounds_failed}"
        ))
    }

    async fn create(&self, name: &str, batch: usize, budget: Value, traces: usize) -> anyhow::Result<()> {
        let body = json!({"name": name, "base": "You answer support questions.", "promotion": "auto",
            "settings": {"batch_size": batch}});
        self.send(reqwest::Method::POST, "/v1/prompts", Some(body)).await?;
        self.send(reqwest::Method::PATCH, &format!("/v1/prompts/{name}/settings"), Some(json!({"budget": budget})))
            .await?;
        let all: Vec<Value> = (0..traces)
            .map(|i| {
                json!({"prompt": name, "input": {"task": format!("task {i}")},
                    "trajectory": [{"role": "assistant", "content": format!("worked on task {i}")}],
                    "output": format!("answer {i}"),
                    "feedback": {"success": !i.is_multiple_of(3), "comment": format!("INSIGHT-b{i:03}: check field {i} first")}})
            })
            .collect();
        for chunk in all.chunks(50) {
            self.send(reqwest::Method::POST, "/v1/traces", Some(json!({"traces": chunk}))).await?;
        }
        Ok(())
    }

    async fn until_consumed(&self, name: &str, total: usize, within: Duration) -> anyhow::Result<Duration> {
        let started = Instant::now();
        while self.traces(name, "consumed").await? < total {
            if started.elapsed() > within {
                bail!("{name}: not every trace was learned from in {} s", within.as_secs());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(started.elapsed())
    }
}

fn overshoot(cap: u64, spent: u64, call: u64) -> String {
    let over = spent.saturating_sub(cap);
    format!(
        "overshoot {over} tokens (largest call {call}: {})",
        if over <= call { "within one call" } else { "MORE THAN ONE CALL" }
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = BudgetArgs::parse();
    let dir = tempfile::tempdir()?;
    let sim = LocalSim::start(SimConfig { seed: args.seed, rate_5xx: 0.2, ..SimConfig::default() }).await?;
    let (mut s, store) = combee_bench::embedded(dir.path(), &sim.base_url).await?;
    let data_dir = s.database.data_dir.clone();
    s.llm.max_retries = 6;
    s.llm.backoff_base_ms = 5;
    s.llm.backoff_max_ms = 50;
    s.worker.poll_interval_ms = 50;
    s.worker.retry_delay_secs = 0;
    s.budget.recheck_secs = 1;
    let app = Application::build_with_store(s, store).await?;
    let base = format!("http://{}", app.local_addr());
    let clock = app.state().clock.clone();
    let shutdown = app.shutdown_token();
    let server = tokio::spawn(app.run_until_stopped());
    let key = std::fs::read_to_string(data_dir.join("admin-key")).context("the admin key")?.trim().to_owned();
    let api = Api { http: reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?, base, key };
    let n = args.traces;
    println!("SIMULATION (simulated LLM, not a model; one answer in five a 500, retried): {n} traces per run, SQLite");

    // 1. A daily cap, lifted by the simulated day rolling over.
    let cap = args.daily_cap;
    api.create("daily", 6, json!({"tokens_per_day": cap}), n).await?;
    let spent = api.settled("daily", n).await?;
    let state = api.get("/v1/prompts/daily/learning").await?;
    let call = api.largest_call("daily").await?;
    println!(
        "daily cap {cap} tokens/day: day 1 spent {spent}, {}; state {}",
        overshoot(cap, spent, call),
        state["state"]
    );
    println!("  at the cap: {}", api.tally("daily", n).await?);
    let mut days = 1;
    while api.traces("daily", "consumed").await? < n {
        if days >= 60 {
            bail!("daily: learning did not finish in 60 simulated days");
        }
        clock.advance(chrono::Duration::days(1));
        days += 1;
        api.settled("daily", n).await?;
    }
    let (per_day, total) = api.spend("daily").await?;
    let call = api.largest_call("daily").await?;
    let worst = per_day.iter().copied().max().unwrap_or(0);
    println!(
        "  resumed each simulated day: every trace learned from after {days} days; per day (newest first) {per_day:?}, \
         total {total}; worst day {}",
        overshoot(cap, worst, call)
    );
    println!("  at the end: {}", api.tally("daily", n).await?);

    // 2. A daily cap, lifted by raising it.
    let cap = args.daily_cap * 2 / 3;
    api.create("raised", 6, json!({"tokens_per_day": cap}), n).await?;
    let spent = api.settled("raised", n).await?;
    let call = api.largest_call("raised").await?;
    println!("daily cap {cap} tokens/day, then raised: spent {spent} at the cap, {}", overshoot(cap, spent, call));
    println!("  at the cap: {}", api.tally("raised", n).await?);
    api.send(reqwest::Method::PATCH, "/v1/prompts/raised/settings", Some(json!({"budget": {"tokens_per_day": null}})))
        .await?;
    let took = api.until_consumed("raised", n, Duration::from_secs(180)).await?;
    println!(
        "  resumed on the raise: every trace learned from {:.1} s after it; {}",
        took.as_secs_f64(),
        api.tally("raised", n).await?
    );

    // 3. A round cap: one round of every trace, over its cap; it waits (no call) until the cap is raised.
    let cap = args.round_cap;
    api.create("per-round", n, json!({"tokens_per_round": cap}), n).await?;
    let spent = api.settled("per-round", n).await?;
    let call = api.largest_call("per-round").await?;
    let rounds = api.rounds("per-round").await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let later = api.spend("per-round").await?.1;
    println!(
        "round cap {cap} tokens: the round spent {spent} over its passes, {}; {} more token(s) in the 4 s after (it waits \
         without calling); rounds {}",
        overshoot(cap, spent, call),
        later - spent,
        rounds.len()
    );
    println!("  at the cap: {}", api.tally("per-round", n).await?);
    api.send(
        reqwest::Method::PATCH,
        "/v1/prompts/per-round/settings",
        Some(json!({"budget": {"tokens_per_round": null}})),
    )
    .await?;
    let took = api.until_consumed("per-round", n, Duration::from_secs(180)).await?;
    println!(
        "  resumed on the raise: every trace learned from {:.1} s after it; {}",
        took.as_secs_f64(),
        api.tally("per-round", n).await?
    );

    shutdown.cancel();
    let _ = server.await;
    Ok(())
}
