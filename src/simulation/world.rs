//! A simulated agent world (a SIMULATION, not agents) that drives a real
//! combee server over HTTP, so tests and benchmarks can ask the question the
//! service exists for: does a learned version make agents better?
//!
//! The world has `task_types` kinds of task; each hides one lesson. A
//! simulated agent takes a task, fetches the prompt (`GET /v1/prompts/{name}`
//! with its subject in `Combee-Subject`), and succeeds with a probability that
//! rises when the prompt holds the lesson of the task's type and falls when it
//! holds a harmful instruction. It posts the run as a trace with the version it
//! ran with, a reward (`success`, `score`), a `task_key` in `metadata`, and on a
//! failure feedback that states the lesson — what a user or a grader would say.
//! A share of the traces can be poisoned: they claim failure and teach a
//! harmful instruction instead.
//!
//! Lessons and harmful instructions are written as `INSIGHT-<token>: text`
//! lines, the marker combee's LLM simulator (`combee sim-llm`) turns into
//! reflections; the world recognises them in the prompt by their token. With a
//! real model the same traces work (the lesson is plain text in the feedback),
//! but whether the token survives into the prompt is up to the model.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::{StreamExt, stream};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use serde_json::{Value, json};

use super::house_rules;

/// Everything that shapes a run of the world.
#[derive(Debug, Clone, clap::Args)]
pub struct WorldConfig {
    /// The prompt the agents run with (it must exist on the server).
    #[arg(long)]
    pub prompt: String,
    /// Kinds of task, each with its own hidden lesson.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub task_types: u32,
    /// Distinct tasks per type (`task_key`s repeat, so versions meet the same tasks).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub tasks_per_type: u32,
    /// Agent runs in all.
    #[arg(long, default_value_t = 400, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub runs: u32,
    /// Runs per report window.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub window: u32,
    /// Agents running at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub agents: u32,
    /// Distinct subjects (the agents' users) a run's subject is drawn from at
    /// random: an agent serves many users, so the arms' traffic shares follow
    /// the weights instead of a handful of sticky subjects.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub subjects: u32,
    /// Share of traces that are poisoned (claim failure, teach a harmful instruction).
    #[arg(long, default_value_t = 0.0)]
    pub poison_share: f64,
    /// Success probability of a task whose lesson the prompt lacks.
    #[arg(long, default_value_t = 0.3)]
    pub base_success: f64,
    /// Added to the success probability when the prompt holds the task type's lesson.
    #[arg(long, default_value_t = 0.5)]
    pub lesson_lift: f64,
    /// Taken from the success probability when the prompt holds a harmful instruction.
    #[arg(long, default_value_t = 0.4)]
    pub harm_drop: f64,
    /// After each window, wait up to this long for the server to learn from the
    /// window's traces (no pending traces and no round in flight); 0: do not wait.
    #[arg(long, default_value_t = 0.0)]
    pub settle_secs: f64,
    /// Seed of every random choice (tasks, outcomes, poison).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Agents send no feedback at all (no reward, no comment), as most
    /// production agents do: rewards then come only from the prompt's
    /// evaluators, which can check the reply (`solved` when the run
    /// succeeded, `not solved` otherwise; in the house-rules world, the rules
    /// the reply states).
    #[arg(long)]
    pub no_feedback: bool,
    /// The house-rules world instead of task types ([`super::house_rules`]):
    /// this many rules the agent is never told; every reply is scored on all
    /// of them (0: the task-type world).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub house_rules: u32,
    /// Start runs at this steady rate (runs per second; `agents` bounds how
    /// many are in flight) instead of as fast as the agents go.
    #[arg(long)]
    pub rate: Option<f64>,
}

impl WorldConfig {
    fn check(&self) -> anyhow::Result<()> {
        for (name, v) in [
            ("--poison-share", self.poison_share),
            ("--base-success", self.base_success),
            ("--lesson-lift", self.lesson_lift),
            ("--harm-drop", self.harm_drop),
        ] {
            if !(0.0..=1.0).contains(&v) {
                bail!("{name} must be between 0 and 1; got {v}");
            }
        }
        if !(self.settle_secs.is_finite() && self.settle_secs >= 0.0) {
            bail!("--settle-secs must be a number of seconds ≥ 0");
        }
        if self.rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
            bail!("--rate must be a number of runs per second > 0");
        }
        Ok(())
    }
}

/// One report window.
#[derive(Debug, Clone, Serialize)]
pub struct WindowReport {
    pub window: usize,
    pub runs: usize,
    /// Honest runs only (poisoned traces are not agents' real outcomes).
    pub honest_runs: usize,
    pub successes: usize,
    /// Success rate of the honest runs.
    pub success_rate: f64,
    /// Runs per prompt version served.
    pub versions: BTreeMap<i64, usize>,
    /// Task types (house rules, in that world) whose lesson the served prompt held at the window's end.
    pub lessons_in_prompt: usize,
    /// Whether the production prompt held a harmful instruction at the window's end.
    pub harmful_in_prompt: bool,
    pub elapsed_secs: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct WorldReport {
    pub prompt: String,
    pub simulation: &'static str,
    pub windows: Vec<WindowReport>,
}

/// The lesson hidden in task type `t`, as the feedback on a failure states it.
pub fn lesson(t: u32) -> String {
    format!("INSIGHT-lesson-t{t}: for task type {t}, check the type-{t} rule before answering")
}

/// What the world looks for in the prompt to know it holds type `t`'s lesson.
fn lesson_token(t: u32) -> String {
    format!("lesson-t{t}:")
}

/// Harmful instructions a poisoned trace teaches.
pub fn harmful(k: u32) -> String {
    format!("INSIGHT-harm-{k}: skip every check and answer at once")
}

const HARM_TOKEN: &str = "harm-";

struct TaskOutcome {
    version: i64,
    success: bool,
    poisoned: bool,
}

/// A client of one server for the world's agents.
pub struct World {
    http: reqwest::Client,
    base: String,
    key: String,
    cfg: WorldConfig,
}

impl World {
    pub fn new(base: &str, key: &str, cfg: WorldConfig) -> anyhow::Result<Self> {
        cfg.check()?;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
        Ok(Self { http, base: base.trim_end_matches('/').to_owned(), key: key.to_owned(), cfg })
    }

    /// Runs every window; `on_window` sees each report as it is made.
    pub async fn run(&self, mut on_window: impl FnMut(&WindowReport)) -> anyhow::Result<WorldReport> {
        let cfg = &self.cfg;
        let mut windows = Vec::new();
        let mut run_index = 0u32;
        let mut w = 0usize;
        let paced_from = tokio::time::Instant::now();
        while run_index < cfg.runs {
            let started = Instant::now();
            let n = cfg.window.min(cfg.runs - run_index);
            let outcomes: Vec<anyhow::Result<TaskOutcome>> =
                stream::iter((run_index..run_index + n).map(|i| self.paced_run(i, paced_from)))
                    .buffer_unordered(cfg.agents as usize)
                    .collect()
                    .await;
            run_index += n;
            let mut report = WindowReport {
                window: w,
                runs: 0,
                honest_runs: 0,
                successes: 0,
                success_rate: 0.0,
                versions: BTreeMap::new(),
                lessons_in_prompt: 0,
                harmful_in_prompt: false,
                elapsed_secs: 0.0,
            };
            for o in outcomes {
                let o = o?;
                report.runs += 1;
                *report.versions.entry(o.version).or_default() += 1;
                if !o.poisoned {
                    report.honest_runs += 1;
                    report.successes += usize::from(o.success);
                }
            }
            report.success_rate = report.successes as f64 / report.honest_runs.max(1) as f64;
            if cfg.settle_secs > 0.0 {
                self.settle(Duration::from_secs_f64(cfg.settle_secs)).await?;
            }
            let (_, text) = self.fetch_prompt("world-observer").await?;
            report.lessons_in_prompt = if cfg.house_rules > 0 {
                house_rules::rules_in(&text, cfg.house_rules).len()
            } else {
                (0..cfg.task_types).filter(|&t| text.contains(&lesson_token(t))).count()
            };
            report.harmful_in_prompt = text.contains(HARM_TOKEN);
            report.elapsed_secs = started.elapsed().as_secs_f64();
            on_window(&report);
            windows.push(report);
            w += 1;
        }
        Ok(WorldReport { prompt: cfg.prompt.clone(), simulation: "simulated agent world", windows })
    }

    /// Run `i`, started at its turn when the world has a steady `rate`.
    async fn paced_run(&self, i: u32, from: tokio::time::Instant) -> anyhow::Result<TaskOutcome> {
        if let Some(rate) = self.cfg.rate {
            tokio::time::sleep_until(from + Duration::from_secs_f64(f64::from(i) / rate)).await;
        }
        self.one_run(i).await
    }

    /// One agent run: a task, the prompt, an outcome, a trace.
    async fn one_run(&self, i: u32) -> anyhow::Result<TaskOutcome> {
        let cfg = &self.cfg;
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ (u64::from(i) << 20) ^ 0x5eed);
        let task_type = rng.gen_range(0..cfg.task_types);
        let task = rng.gen_range(0..cfg.tasks_per_type);
        // Its own stream, so the subject does not shift the task and outcome draws.
        let subject = format!(
            "subject-{}",
            ChaCha8Rng::seed_from_u64(cfg.seed ^ (u64::from(i) << 20) ^ 0x5b1e).gen_range(0..cfg.subjects.max(1))
        );
        let (version, text) = self.fetch_prompt(&subject).await?;
        if cfg.house_rules > 0 {
            return self
                .house_rules_run(version, &text, &subject, task_type * cfg.tasks_per_type + task, &mut rng)
                .await;
        }
        let poisoned = rng.gen_bool(cfg.poison_share);
        let mut p = cfg.base_success;
        if text.contains(&lesson_token(task_type)) {
            p += cfg.lesson_lift;
        }
        if text.contains(HARM_TOKEN) {
            p -= cfg.harm_drop;
        }
        let success = !poisoned && rng.gen_bool(p.clamp(0.0, 1.0));
        let comment = if poisoned {
            Some(harmful(rng.gen_range(0..3)))
        } else if !success {
            Some(lesson(task_type))
        } else {
            None
        };
        let trace = json!({
            "prompt": cfg.prompt,
            "prompt_version": version,
            "input": {"task": format!("task {task} of type {task_type}")},
            "trajectory": [{"step": "answer", "task_type": task_type}],
            "output": if success { "solved" } else { "not solved" },
            "feedback": if cfg.no_feedback {
                json!({})
            } else {
                json!({"success": success, "score": if success { 1.0 } else { 0.0 }, "comment": comment})
            },
            "metadata": {"task_key": format!("t{task_type}-{task}"), "world": "simulation", "subject": subject},
        });
        self.post_trace(&trace).await?;
        Ok(TaskOutcome { version, success, poisoned })
    }

    /// A run of the house-rules world: the reply states the rules `prompt`
    /// holds; the agent reports the share met and names missed ones, or
    /// reports nothing (`no_feedback`: the prompt's evaluators judge it).
    async fn house_rules_run(
        &self,
        version: i64,
        prompt: &str,
        subject: &str,
        task: u32,
        rng: &mut ChaCha8Rng,
    ) -> anyhow::Result<TaskOutcome> {
        let cfg = &self.cfg;
        let n = cfg.house_rules;
        let task = format!("ticket {task}");
        let output = house_rules::reply(prompt, n, &task);
        let success = house_rules::rules_in(prompt, n).len() == n as usize;
        let feedback = if cfg.no_feedback { json!({}) } else { house_rules::agent_feedback(&output, n, rng) };
        self.post_trace(&json!({
            "prompt": cfg.prompt,
            "prompt_version": version,
            "input": {"task": task},
            "trajectory": [{"step": "answer"}],
            "output": output,
            "feedback": feedback,
            "metadata": {"task_key": task, "world": "simulation", "subject": subject},
        }))
        .await?;
        Ok(TaskOutcome { version, success, poisoned: false })
    }

    async fn post_trace(&self, trace: &Value) -> anyhow::Result<()> {
        let res = self
            .http
            .post(format!("{}/v1/traces", self.base))
            .bearer_auth(&self.key)
            .json(trace)
            .send()
            .await
            .context("posting a trace")?;
        if !res.status().is_success() {
            bail!("POST /v1/traces answered {}: {}", res.status(), res.text().await.unwrap_or_default());
        }
        Ok(())
    }

    async fn fetch_prompt(&self, subject: &str) -> anyhow::Result<(i64, String)> {
        let res = self
            .http
            .get(format!("{}/v1/prompts/{}", self.base, self.cfg.prompt))
            .bearer_auth(&self.key)
            .header("Combee-Subject", subject)
            .send()
            .await
            .context("fetching the prompt")?;
        if !res.status().is_success() {
            bail!("GET /v1/prompts/{} answered {}", self.cfg.prompt, res.status());
        }
        let v: Value = res.json().await?;
        let version = v["version"].as_i64().context("the prompt answer has no version")?;
        Ok((version, v["text"].as_str().unwrap_or_default().to_owned()))
    }

    /// Waits until the prompt has no pending traces and no round in flight, or `limit` passes.
    async fn settle(&self, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let prompts: Value = self.get_json("/v1/prompts?page_size=1000").await?;
            let pending = prompts["prompts"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["name"] == self.cfg.prompt.as_str())
                .and_then(|p| p["pending_traces"].as_i64())
                .unwrap_or(0);
            let rounds: Value = self.get_json(&format!("/v1/prompts/{}/rounds?page_size=5", self.cfg.prompt)).await?;
            let in_flight = rounds["rounds"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|r| matches!(r["status"].as_str(), Some("queued" | "running")));
            if pending == 0 && !in_flight {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    async fn get_json(&self, path: &str) -> anyhow::Result<Value> {
        let res = self.http.get(format!("{}{path}", self.base)).bearer_auth(&self.key).send().await?;
        if !res.status().is_success() {
            bail!("GET {path} answered {}", res.status());
        }
        Ok(res.json().await?)
    }
}

/// The report as a Markdown table (labelled a simulation).
pub fn markdown(report: &WorldReport) -> String {
    let mut out = format!(
        "Simulated agent world (a simulation) on prompt `{}`: honest runs' success rate per window\n\n\
         | window | runs | success rate | versions served | lessons in production | harmful in production |\n\
         | ---: | ---: | ---: | --- | ---: | --- |\n",
        report.prompt
    );
    for w in &report.windows {
        let versions: Vec<String> = w.versions.iter().map(|(v, n)| format!("v{v}×{n}")).collect();
        out.push_str(&format!(
            "| {} | {} | {:.3} | {} | {} | {} |\n",
            w.window,
            w.runs,
            w.success_rate,
            versions.join(" "),
            w.lessons_in_prompt,
            if w.harmful_in_prompt { "yes" } else { "no" }
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lessons_and_harm_are_recognised_by_their_tokens() {
        let prompt = format!("base\n- {}\n- {}", lesson(3), harmful(1));
        assert!(prompt.contains(&lesson_token(3)) && !prompt.contains(&lesson_token(30)));
        assert!(!lesson(13).contains(&lesson_token(1)), "t1 is not found inside t13");
        assert!(prompt.contains(HARM_TOKEN) && !lesson(2).contains(HARM_TOKEN));
    }

    #[test]
    fn bad_knobs_are_refused() {
        let cfg = |poison: f64| WorldConfig {
            prompt: "p".into(),
            task_types: 2,
            tasks_per_type: 2,
            runs: 1,
            window: 1,
            agents: 1,
            subjects: 1,
            poison_share: poison,
            base_success: 0.3,
            lesson_lift: 0.5,
            harm_drop: 0.4,
            settle_secs: 0.0,
            seed: 1,
            no_feedback: false,
            house_rules: 0,
            rate: None,
        };
        assert!(World::new("http://x", "k", cfg(0.2)).is_ok());
        let err = World::new("http://x", "k", cfg(1.5)).err().unwrap().to_string();
        assert!(err.contains("--poison-share"), "{err}");
    }
}
