//! The default loop under steady traffic (docs/benchmarks.md), a SIMULATION:
//! what a user of the product's defaults sees. Prompts created with no
//! settings but their promotion policy — `evaluated` (the default) beside
//! `auto` — serve an agent that follows its prompt in the house-rules world
//! (`combee::simulation::house_rules`: rules the agent is never told, every
//! reply scored on all of them), which fetches the prompt with a subject and
//! posts traces at a steady rate: once with the agent's own rewards (the share
//! of rules met, a comment naming up to four missed), once with no reward and
//! a `checks` evaluator judging the replies. An observer reads production
//! every few seconds; the report gives production's quality over time (the
//! share of the rules production holds), the time to its first promotion,
//! versions published per hour, arms rated and retired unrated, every move of
//! production (and whether one went to a version with less), and what became
//! of every trace posted.
//!
//! One process: the LLM simulator and a combee server on product defaults
//! (embedded SQLite in a temporary directory, every role on) on loopback ports;
//! every configuration runs at once on it, the same world seed for each.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::Parser;
use combee::{
    app::Application,
    simulation::{
        house_rules,
        llm::{LocalSim, SimConfig},
        world::{World, WorldConfig},
    },
};
use serde_json::{Value, json};
use sqlx::Row as _;

#[derive(Debug, Parser)]
#[command(about = "The default loop under steady traffic (a SIMULATION, not agents or a model)")]
struct LoopArgs {
    /// Where loop-<name>.md, .csv and .svg are written.
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
    /// Names the report files (`loop-<name>.*`); default `<rate>tps-<minutes>min`.
    #[arg(long)]
    name: Option<String>,
    /// A line saying what build this is (e.g. "main, before the change"), printed in the report.
    #[arg(long, default_value = "")]
    build: String,
    /// Traces per second each configuration's agent posts.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// How long the agents post, in minutes.
    #[arg(long, default_value_t = 5.0)]
    minutes: f64,
    /// The minute by which `evaluated` must hold 90 % of what `auto` reaches (default: the end of the run).
    #[arg(long)]
    deadline_minutes: Option<f64>,
    /// House rules the agent is never told.
    #[arg(long, default_value_t = 16)]
    rules: u32,
    /// Distinct subjects (the agent's users).
    #[arg(long, default_value_t = 400)]
    subjects: u32,
    /// Rewards: `agent` (the agent reports them) and/or `judged` (a checks evaluator judges replies).
    #[arg(long, value_delimiter = ',', default_value = "agent,judged")]
    rewards: Vec<Rewards>,
    /// Promotion policies to run side by side.
    #[arg(long, value_delimiter = ',', default_value = "evaluated,auto")]
    policies: Vec<LoopPolicy>,
    /// How often the observer reads production (seconds).
    #[arg(long, default_value_t = 5.0)]
    sample_secs: f64,
    /// Seed of the world (the same for every configuration).
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
enum Rewards {
    Agent,
    Judged,
}

#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
enum LoopPolicy {
    Evaluated,
    Auto,
}

impl Rewards {
    fn label(self) -> &'static str {
        match self {
            Self::Agent => "agent rewards",
            Self::Judged => "judged rewards only",
        }
    }
    fn short(self) -> &'static str {
        match self {
            Self::Agent => "agent",
            Self::Judged => "judged",
        }
    }
}

impl LoopPolicy {
    fn label(self) -> &'static str {
        match self {
            Self::Evaluated => "evaluated",
            Self::Auto => "auto",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct LoopConfig {
    policy: LoopPolicy,
    rewards: Rewards,
}

impl LoopConfig {
    fn prompt(&self) -> String {
        format!("loop-{}-{}", self.policy.label(), self.rewards.short())
    }
    fn name(&self) -> String {
        format!("{}, {}", self.policy.label(), self.rewards.label())
    }
}

/// What the observer saw at one moment.
#[derive(Debug, Clone)]
struct Observation {
    secs: f64,
    production: i64,
    /// Share of the rules production holds.
    quality: f64,
    /// Versions written since the prompt's first.
    published: i64,
}

/// What the store says at the end.
#[derive(Debug, Clone, Default)]
struct Ending {
    /// Every arm the population ever had, rated (ranked in a window) or not, and retired unrated.
    arms: usize,
    arms_rated: usize,
    retired_unrated: usize,
    /// Production's moves: (seconds after the first trace, from, to, quality from, quality to, kind).
    moves: Vec<(f64, i64, i64, f64, f64, String)>,
    /// Traces by status; traces consumed by more than one succeeded round.
    statuses: BTreeMap<String, i64>,
    learned_twice: i64,
    rounds_succeeded: i64,
    rounds_unchanged: i64,
    rounds_failed: i64,
}

struct LoopClient {
    http: reqwest::Client,
    base: String,
    key: String,
}

impl LoopClient {
    async fn get(&self, path: &str) -> anyhow::Result<Value> {
        let res = self.http.get(format!("{}{path}", self.base)).bearer_auth(&self.key).send().await?;
        if !res.status().is_success() {
            bail!("GET {path}: {}", res.status());
        }
        Ok(res.json().await?)
    }

    async fn send(&self, req: reqwest::RequestBuilder, what: &str) -> anyhow::Result<()> {
        let res = req.bearer_auth(&self.key).send().await?;
        if !res.status().is_success() {
            bail!("{what}: {} {}", res.status(), res.text().await.unwrap_or_default());
        }
        Ok(())
    }

    /// Production's version and its text.
    async fn production(&self, prompt: &str) -> anyhow::Result<(i64, String)> {
        let v = self.get(&format!("/v1/prompts/{prompt}?label=production")).await?;
        Ok((v["version"].as_i64().context("no version")?, v["text"].as_str().unwrap_or_default().to_owned()))
    }

    async fn text_of(&self, prompt: &str, version: i64) -> anyhow::Result<String> {
        let v = self.get(&format!("/v1/prompts/{prompt}?version={version}")).await?;
        Ok(v["text"].as_str().unwrap_or_default().to_owned())
    }

    async fn newest_version(&self, prompt: &str) -> anyhow::Result<i64> {
        let v = self.get(&format!("/v1/prompts/{prompt}/versions?page_size=1")).await?;
        v["versions"][0]["number"].as_i64().context("no versions")
    }

    /// Every item of a paged list route, following `next_page_token`.
    async fn all(&self, path: &str, field: &str) -> anyhow::Result<Vec<Value>> {
        let (mut out, mut token) = (Vec::new(), None::<String>);
        loop {
            let sep = if path.contains('?') { '&' } else { '?' };
            let page = match &token {
                Some(t) => format!("{path}{sep}page_size=200&page_token={t}"),
                None => format!("{path}{sep}page_size=200"),
            };
            let v = self.get(&page).await?;
            out.extend(v[field].as_array().cloned().unwrap_or_default());
            match v["next_page_token"].as_str() {
                Some(t) => token = Some(t.to_owned()),
                None => return Ok(out),
            }
        }
    }
}

/// Creates the configuration's prompt on product defaults (only its policy named) and its evaluators.
async fn create(client: &LoopClient, cfg: LoopConfig, rules: u32) -> anyhow::Result<()> {
    let prompt = cfg.prompt();
    let mut body = json!({"name": prompt, "base": "You answer the shop's customers."});
    if cfg.policy == LoopPolicy::Auto {
        body["promotion"] = json!("auto");
    }
    let req = client.http.post(format!("{}/v1/prompts", client.base)).json(&body);
    client.send(req, &format!("creating {prompt}")).await?;
    if cfg.rewards == Rewards::Judged {
        let req = client
            .http
            .put(format!("{}/v1/prompts/{prompt}/evaluators", client.base))
            .json(&house_rules::evaluators(rules));
        client.send(req, &format!("setting the evaluators of {prompt}")).await?;
    }
    Ok(())
}

/// Reads production of every configuration every `sample_secs` until `stop`.
async fn observe(
    client: &LoopClient,
    configs: &[LoopConfig],
    args: &LoopArgs,
    started: Instant,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Vec<Vec<Observation>>> {
    let mut out = vec![Vec::new(); configs.len()];
    let every = Duration::from_secs_f64(args.sample_secs);
    let mut next = tokio::time::Instant::now();
    loop {
        for (cfg, samples) in configs.iter().zip(out.iter_mut()) {
            let prompt = cfg.prompt();
            let (production, text) = client.production(&prompt).await?;
            samples.push(Observation {
                secs: started.elapsed().as_secs_f64(),
                production,
                quality: house_rules::rules_in(&text, args.rules).len() as f64 / f64::from(args.rules),
                published: client.newest_version(&prompt).await? - 1,
            });
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(out);
        }
        next += every;
        tokio::time::sleep_until(next).await;
    }
}

/// What the API and the store say about a configuration once the run is over.
async fn ending(
    client: &LoopClient,
    db: &sqlx::SqlitePool,
    cfg: LoopConfig,
    rules: u32,
    first_trace: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<Ending> {
    let prompt = cfg.prompt();
    let mut e = Ending::default();
    if cfg.policy == LoopPolicy::Evaluated {
        let arms = client.all(&format!("/v1/prompts/{prompt}/population"), "arms").await?;
        e.arms = arms.len();
        e.arms_rated = arms.iter().filter(|a| a["scored_traces"].as_u64().unwrap_or(0) > 0).count();
        e.retired_unrated =
            arms.iter().filter(|a| a["state"] == "retired" && a["scored_traces"].as_u64().unwrap_or(0) == 0).count();
    }
    let mut history = client.all(&format!("/v1/prompts/{prompt}/labels/history?label=production"), "moves").await?;
    history.reverse();
    let mut quality: BTreeMap<i64, f64> = BTreeMap::new();
    for m in history.iter().filter(|m| !m["from_version"].is_null()) {
        let (from, to) = (m["from_version"].as_i64().unwrap_or(0), m["to_version"].as_i64().unwrap_or(0));
        for v in [from, to] {
            if let std::collections::btree_map::Entry::Vacant(slot) = quality.entry(v) {
                let text = client.text_of(&prompt, v).await?;
                slot.insert(house_rules::rules_in(&text, rules).len() as f64 / f64::from(rules));
            }
        }
        let at: chrono::DateTime<chrono::Utc> = m["at"].as_str().unwrap_or_default().parse()?;
        let secs = (at - first_trace).num_milliseconds() as f64 / 1000.0;
        let kind = m["kind"].as_str().unwrap_or_default().to_owned();
        e.moves.push((secs, from, to, quality[&from], quality[&to], kind));
    }
    let rows = sqlx::query(
        "SELECT t.status, count(*) AS n FROM traces t JOIN prompts p ON p.id = t.prompt_id WHERE p.name = ?
         GROUP BY t.status",
    )
    .bind(&prompt)
    .fetch_all(db)
    .await?;
    for r in rows {
        e.statuses.insert(r.get("status"), r.get("n"));
    }
    e.learned_twice = sqlx::query(
        "SELECT count(*) AS n FROM (SELECT rt.trace_id FROM round_traces rt JOIN rounds r ON r.id = rt.round_id
           JOIN prompts p ON p.id = r.prompt_id JOIN reflections f ON f.round_id = r.id AND f.trace_id = rt.trace_id
         WHERE p.name = ? AND r.status = 'succeeded' GROUP BY rt.trace_id HAVING count(DISTINCT r.id) > 1)",
    )
    .bind(&prompt)
    .fetch_one(db)
    .await?
    .get("n");
    let row = sqlx::query(
        "SELECT sum(r.status = 'succeeded') AS ok, sum(r.status = 'succeeded' AND r.result_version IS NULL) AS same,
                sum(r.status = 'failed') AS failed
         FROM rounds r JOIN prompts p ON p.id = r.prompt_id WHERE p.name = ?",
    )
    .bind(&prompt)
    .fetch_one(db)
    .await?;
    e.rounds_succeeded = row.get::<Option<i64>, _>("ok").unwrap_or(0);
    e.rounds_unchanged = row.get::<Option<i64>, _>("same").unwrap_or(0);
    e.rounds_failed = row.get::<Option<i64>, _>("failed").unwrap_or(0);
    Ok(e)
}

/// Production's quality at `secs` (the last sample at or before it).
fn quality_at(samples: &[Observation], secs: f64) -> f64 {
    samples.iter().take_while(|s| s.secs <= secs + 1e-9).last().map_or(0.0, |s| s.quality)
}

fn svg(configs: &[LoopConfig], results: &[Vec<Observation>], args: &LoopArgs) -> String {
    const W: f64 = 860.0;
    const H: f64 = 460.0;
    let (l, r, t, b) = (70.0, 240.0, 60.0, 60.0);
    let end = results.iter().flatten().map(|s| s.secs).fold(1.0, f64::max) / 60.0;
    let x = |mins: f64| l + (W - l - r) * mins / end;
    let y = |v: f64| t + (H - t - b) * (1.0 - v);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" \
         font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{x0}\" y=\"24\" font-size=\"15\" text-anchor=\"middle\">SIMULATION: production's quality under steady traffic</text>\n\
         <text x=\"{x0}\" y=\"42\" font-size=\"11\" text-anchor=\"middle\" fill=\"#555\">share of the {} house rules production \
         holds; {} traces/s per prompt, {} subjects, product defaults, simulated LLM</text>\n",
        args.rules,
        args.rate,
        args.subjects,
        x0 = (W - r + l) / 2.0,
    );
    for i in 0..=10 {
        let v = f64::from(i) / 10.0;
        s.push_str(&format!(
            "<line x1=\"{l}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#eee\"/>\
             <text x=\"{}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"end\">{v:.1}</text>\n",
            W - r,
            l - 6.0,
            y(v) + 3.0,
            y = y(v)
        ));
    }
    let step = (end / 10.0).max(0.5).ceil();
    let mut m = 0.0;
    while m <= end + 1e-9 {
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{}\" font-size=\"10\" text-anchor=\"middle\">{m:.0}</text>\n",
            x(m),
            H - b + 16.0
        ));
        m += step;
    }
    s.push_str(&format!(
        "<line x1=\"{l}\" x2=\"{l}\" y1=\"{t}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{l}\" x2=\"{}\" y1=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <text x=\"{:.1}\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\">minutes after the first trace</text>\n\
         <text x=\"18\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\" transform=\"rotate(-90 18 {:.1})\">production's share of the rules</text>\n",
        H - b,
        W - r,
        H - b,
        H - b,
        (W - r + l) / 2.0,
        H - b + 36.0,
        (H - b + t) / 2.0,
        (H - b + t) / 2.0
    ));
    for (i, (cfg, samples)) in configs.iter().zip(results).enumerate() {
        let color = match cfg.policy {
            LoopPolicy::Evaluated => "#1f77b4",
            LoopPolicy::Auto => "#d62728",
        };
        let dash = if cfg.rewards == Rewards::Judged { " stroke-dasharray=\"6 4\"" } else { "" };
        // A step plot: production holds its quality until the next sample.
        let mut pts = Vec::new();
        let mut last: Option<f64> = None;
        for smp in samples {
            if let Some(q) = last {
                pts.push(format!("{:.1},{:.1}", x(smp.secs / 60.0), y(q)));
            }
            pts.push(format!("{:.1},{:.1}", x(smp.secs / 60.0), y(smp.quality)));
            last = Some(smp.quality);
        }
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"{dash} points=\"{}\"/>\n",
            pts.join(" ")
        ));
        let ly = t + 20.0 * i as f64;
        s.push_str(&format!(
            "<line x1=\"{}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"2\"{dash}/>\
             <text x=\"{}\" y=\"{}\" font-size=\"11\">{}</text>\n",
            W - r + 12.0,
            W - r + 42.0,
            W - r + 48.0,
            ly + 4.0,
            cfg.name()
        ));
    }
    s.push_str("</svg>\n");
    s
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = LoopArgs::parse();
    if !(args.rate > 0.0 && args.minutes > 0.0 && args.sample_secs > 0.0 && args.rules > 0) {
        bail!("--rate, --minutes, --sample-secs and --rules must be > 0");
    }
    let name = args.name.clone().unwrap_or_else(|| format!("{}tps-{}min", args.rate, args.minutes));
    let dir = tempfile::tempdir()?;
    let sim = LocalSim::start(SimConfig::default()).await?;
    // Product defaults: nothing but where to listen, the store and the LLM is set.
    let (s, store) = combee_bench::embedded(dir.path(), &sim.base_url).await?;
    let data_dir = s.database.data_dir.clone();
    let db_url = format!("sqlite://{}", dir.path().join("combee.db").display());
    let population = s.population.clone();
    let app = Application::build_with_store(s, store).await?;
    let base = format!("http://{}", app.local_addr());
    let shutdown = app.shutdown_token();
    let server = tokio::spawn(app.run_until_stopped());
    let key = std::fs::read_to_string(data_dir.join("admin-key"))?.trim().to_owned();
    let client = LoopClient { http: reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?, base, key };

    let configs: Vec<LoopConfig> = args
        .rewards
        .iter()
        .flat_map(|&rewards| args.policies.iter().map(move |&policy| LoopConfig { policy, rewards }))
        .collect();
    for &cfg in &configs {
        create(&client, cfg, args.rules).await?;
    }
    let runs = (args.rate * args.minutes * 60.0).round().max(1.0) as u32;
    eprintln!(
        "SIMULATION: {} configurations at once, {runs} traces each at {} traces/s ({} min)",
        configs.len(),
        args.rate,
        args.minutes
    );
    let first_trace = chrono::Utc::now();
    let started = Instant::now();
    // Set when the agents are done: the observer takes one last sample and ends.
    let stop = Arc::new(AtomicBool::new(false));
    let agents = configs.iter().map(|&cfg| {
        let world = WorldConfig {
            prompt: cfg.prompt(),
            task_types: 1,
            tasks_per_type: 100,
            runs,
            window: (args.rate * 5.0).ceil().max(1.0) as u32,
            agents: 64,
            subjects: args.subjects,
            poison_share: 0.0,
            base_success: 0.0,
            lesson_lift: 0.0,
            harm_drop: 0.0,
            settle_secs: 0.0,
            seed: args.seed,
            no_feedback: cfg.rewards == Rewards::Judged,
            house_rules: args.rules,
            rate: Some(args.rate),
        };
        let (base, key) = (client.base.clone(), client.key.clone());
        async move { World::new(&base, &key, world)?.run(|_| {}).await.map(|_| ()) }
    });
    let posting = {
        let stop = stop.clone();
        async move {
            let done = futures_util::future::try_join_all(agents).await;
            stop.store(true, Ordering::Relaxed);
            done
        }
    };
    let (posted, samples) = tokio::join!(posting, observe(&client, &configs, &args, started, stop.clone()));
    posted?;
    let samples = samples?;
    let total_secs = started.elapsed().as_secs_f64();
    eprintln!("[{total_secs:>6.1}s] the agents are done; reading what became of it");
    // Let rounds in flight finish, then read what became of everything.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let db = sqlx::SqlitePool::connect(&db_url).await?;
    let mut endings = Vec::new();
    for &cfg in &configs {
        endings.push(ending(&client, &db, cfg, args.rules, first_trace).await?);
    }
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(20), server).await;

    let md = report(&args, &configs, &samples, &endings, &population, total_secs);
    std::fs::create_dir_all(&args.out_dir)?;
    std::fs::write(args.out_dir.join(format!("loop-{name}.md")), &md)?;
    std::fs::write(args.out_dir.join(format!("loop-{name}.csv")), csv(&configs, &samples))?;
    std::fs::write(args.out_dir.join(format!("loop-{name}.svg")), svg(&configs, &samples, &args))?;
    println!("{md}");
    eprintln!("wrote {}/loop-{name}.md, .csv, .svg", args.out_dir.display());
    drop(sim);
    Ok(())
}

fn csv(configs: &[LoopConfig], samples: &[Vec<Observation>]) -> String {
    let mut out = String::from("simulation,configuration,policy,rewards,secs,production_version,quality,published\n");
    for (c, rows) in configs.iter().zip(samples) {
        for s in rows {
            out.push_str(&format!(
                "house-rules world,{},{},{},{:.1},{},{:.4},{}\n",
                c.name(),
                c.policy.label(),
                c.rewards.short(),
                s.secs,
                s.production,
                s.quality,
                s.published
            ));
        }
    }
    out
}

fn report(
    args: &LoopArgs,
    configs: &[LoopConfig],
    samples: &[Vec<Observation>],
    endings: &[Ending],
    population: &combee::config::PopulationSettings,
    total_secs: f64,
) -> String {
    let deadline = args.deadline_minutes.unwrap_or(args.minutes) * 60.0;
    let mut md = String::from("# The default loop under steady traffic — a SIMULATION\n\n");
    md.push_str(
        "An agent that follows its prompt (a simulation, not an agent) and a simulated LLM (not a model) against a \
         real combee server on product defaults (embedded SQLite, every role on). Not a timed test.\n\n",
    );
    if !args.build.is_empty() {
        md.push_str(&format!("Build: {}.\n\n", args.build));
    }
    md.push_str(&format!(
        "World: {} house rules the agent is never told; a reply states the rules its prompt holds and is scored on \
         all of them. {} traces/s per configuration for {} min ({} subjects, all configurations at once on one \
         server, world seed {}). Agent rewards: score = share of the rules met, a comment naming up to {} missed; \
         judged: no reward, one `checks` evaluator with a `contains` check per rule. Prompts created with no \
         settings but `\"promotion\": \"auto\"` for `auto`. Population defaults: window_secs {}, tick_secs {}, \
         min_traces {}, min_window_traces {}, max_arms {}, margin {}, cooldown_windows {}. Total {total_secs:.0} s.\n\n",
        args.rules,
        args.rate,
        args.minutes,
        args.subjects,
        args.seed,
        house_rules::MAX_NAMED,
        population.window_secs,
        population.tick_secs,
        population.min_traces,
        population.min_window_traces,
        population.max_arms,
        population.margin,
        population.cooldown_windows,
    ));
    md.push_str("**quality** = the share of the rules production holds.\n\n| minute |");
    for c in configs {
        md.push_str(&format!(" {} |", c.name()));
    }
    md.push_str("\n| ---: |");
    md.push_str(&" ---: |".repeat(configs.len()));
    md.push('\n');
    let mut minute = 0.5;
    let end = args.minutes * 60.0;
    while minute * 60.0 <= end + 1e-9 {
        md.push_str(&format!("| {minute} |"));
        for rows in samples {
            let s = rows.iter().take_while(|s| s.secs <= minute * 60.0 + 1e-9).last();
            match s {
                Some(s) => md.push_str(&format!(" {:.3} (v{}, {} published) |", s.quality, s.production, s.published)),
                None => md.push_str(" — |"),
            }
        }
        md.push('\n');
        minute += if args.minutes > 10.0 { (args.minutes / 10.0).round().max(1.0) } else { 0.5 };
    }
    md.push_str(
        "\n## Summary\n\n| configuration | quality at the deadline | final quality | first promotion | versions \
         published | versions per hour | production moves | moves to a version with less | arms | arms rated | \
         retired unrated | rounds (unchanged) | rounds failed | traces by status | learned twice |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |\n",
    );
    for ((c, rows), e) in configs.iter().zip(samples).zip(endings) {
        let published = rows.last().map_or(0, |s| s.published);
        let first = e.moves.first().map_or("never".to_owned(), |m| format!("{:.0} s ({})", m.0, m.5));
        let less = e.moves.iter().filter(|m| m.4 < m.3).count();
        let statuses: Vec<String> = e.statuses.iter().map(|(k, v)| format!("{k} {v}")).collect();
        md.push_str(&format!(
            "| {} | {:.3} | {:.3} | {first} | {published} | {:.0} | {} | {less} | {} | {} | {} | {} ({}) | {} | {} | {} |\n",
            c.name(),
            quality_at(rows, deadline),
            rows.last().map_or(0.0, |s| s.quality),
            published as f64 * 3600.0 / total_secs.max(1.0),
            e.moves.len(),
            e.arms,
            e.arms_rated,
            e.retired_unrated,
            e.rounds_succeeded,
            e.rounds_unchanged,
            e.rounds_failed,
            statuses.join(", "),
            e.learned_twice,
        ));
    }
    md.push_str("\n## Targets (SIMULATION)\n\n");
    let pf = |ok: bool| if ok { "PASS" } else { "FAIL" };
    for rewards in &args.rewards {
        let find = |p: LoopPolicy| configs.iter().position(|c| c.policy == p && c.rewards == *rewards);
        if let (Some(e), Some(a)) = (find(LoopPolicy::Evaluated), find(LoopPolicy::Auto)) {
            let (qe, qa) = (quality_at(&samples[e], deadline), quality_at(&samples[a], deadline));
            md.push_str(&format!(
                "- {}: with {}, `evaluated` production holds ≥ 90 % of what `auto` reaches by minute {:.0}: \
                 {qe:.3} vs {qa:.3}\n",
                pf(qe >= 0.9 * qa - 1e-9),
                rewards.label(),
                deadline / 60.0
            ));
        }
    }
    for (c, e) in configs.iter().zip(endings) {
        let less = e.moves.iter().filter(|m| m.4 < m.3).count();
        md.push_str(&format!(
            "- {}: {} — production never moved to a version with less ({less} such moves)\n",
            pf(less == 0),
            c.name()
        ));
    }
    for (c, rows) in configs.iter().zip(samples).filter(|(c, _)| c.policy == LoopPolicy::Evaluated) {
        // The first hour's versions: counted when the run lasted an hour, else extrapolated (said so).
        let hour = rows.iter().take_while(|s| s.secs <= 3600.0).last().map_or(0, |s| s.published);
        let (n, how) = if total_secs >= 3600.0 {
            (hour as f64, "counted")
        } else {
            (hour as f64 * 3600.0 / total_secs.max(1.0), "extrapolated from this run's length")
        };
        md.push_str(&format!(
            "- {}: {} — versions published in the first hour ≤ 50: {n:.0} ({how})\n",
            pf(n <= 50.0),
            c.name()
        ));
    }
    md.push_str("\n## Production's moves\n\n");
    for (c, e) in configs.iter().zip(endings) {
        let shown: Vec<String> = e
            .moves
            .iter()
            .take(12)
            .map(|m| format!("{:.0} s v{}→v{} ({:.2}→{:.2}, {})", m.0, m.1, m.2, m.3, m.4, m.5))
            .collect();
        let more = e.moves.len().saturating_sub(12);
        md.push_str(&format!(
            "- {}: {}{}\n",
            c.name(),
            if shown.is_empty() { "none".to_owned() } else { shown.join("; ") },
            if more > 0 { format!("; … {more} more") } else { String::new() }
        ));
    }
    md
}
