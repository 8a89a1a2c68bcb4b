//! The closed-loop benchmark (docs/benchmarks.md), a SIMULATION: the simulated agent world
//! (`combee::simulation::world`) drives a real combee server that learns from a
//! simulated LLM, once per configuration — no learning, `auto`, `evaluated`,
//! each with and without 20% poisoned traces — so the table and plot show
//! whether learned versions make the simulated agents better, and whether the
//! `evaluated` policy keeps a harmful instruction out of production.
//!
//! The attacker model: by default the poisoned traces arrive in bursts (an
//! attacker is active in some windows and silent in others — 20% of all
//! traces overall), as a real attacker's campaign does; `--attacker uniform`
//! spreads them evenly (every learning round then holds some, so no harm-free
//! learned version ever exists to choose). Subjects are drawn from many users
//! (`--subjects`, 1,000), as an agent serving many users sees.
//!
//! One process: the LLM simulator and a combee server (embedded SQLite in a
//! temporary directory, worker and population rater on) on loopback ports; one
//! prompt per configuration, all run at once with the same world seed.
//!
//! Production moves: beside the six configurations above, three more show the
//! promotion gate's margin and cool-down — `evaluated` without poison with the
//! gate as it was before them (margin 0, no cool-down, per-prompt settings), and
//! a world where a lesson is worth little (learned versions 10 points better
//! than the base) under both gates: equally good versions should not take turns
//! in production, and a better version should be promoted no later than before.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::Parser;
use combee::{
    app::Application,
    simulation::{
        llm::{LocalSim, SimConfig},
        world::{World, WorldConfig},
    },
};
use serde_json::{Value, json};

#[derive(Debug, Parser)]
#[command(about = "Closed-loop benchmark over the simulated agent world (a SIMULATION, not agents or a model)")]
struct WorldArgs {
    /// Where world.md, world.csv and world-success.svg are written.
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
    /// Report windows per configuration.
    #[arg(long, default_value_t = 30)]
    windows: u32,
    /// Agent runs per window.
    #[arg(long, default_value_t = 400)]
    window_runs: u32,
    /// Simulated agents (concurrent runs) per configuration.
    #[arg(long, default_value_t = 32)]
    agents: u32,
    /// Distinct subjects (the agents' users) per configuration; each run's
    /// subject is drawn from them at random.
    #[arg(long, default_value_t = 1000)]
    subjects: u32,
    /// How the poisoned 20% of traces arrive: `burst` (the attacker is active in
    /// `--burst-len` consecutive windows of every `--burst-every`, starting at
    /// window `--burst-start`, with a share that makes 20% overall) or `uniform`
    /// (20% of every window).
    #[arg(long, value_enum, default_value_t = Attacker::Burst)]
    attacker: Attacker,
    /// Burst attacker: a campaign starts every this many windows.
    #[arg(long, default_value_t = 10)]
    burst_every: u32,
    /// Burst attacker: windows each campaign lasts.
    #[arg(long, default_value_t = 3)]
    burst_len: u32,
    /// Burst attacker: the window the first campaign starts in.
    #[arg(long, default_value_t = 4)]
    burst_start: u32,
    /// Wall time of one window (runs, then waiting for learning, then idle): the
    /// world is paced so the rater's time windows see a steady flow of traces.
    #[arg(long, default_value_t = 10.0)]
    window_secs: f64,
    /// Longest wait per window for the window's traces to be learned from.
    #[arg(long, default_value_t = 3.0)]
    settle_secs: f64,
    /// Run setting (product default 600): `population.window_secs`, the rater's rating window
    /// (one per world window by default).
    #[arg(long, default_value_t = 10)]
    rating_window_secs: u64,
    /// Run setting (product default 10): `population.tick_secs`, how often the rater looks.
    #[arg(long, default_value_t = 1)]
    rater_tick_secs: u64,
    /// Traces per learning round (a prompt setting; `max_wait_secs` is 1).
    #[arg(long, default_value_t = 200)]
    batch_size: u32,
    /// Seed of the world (the same for every configuration).
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Mirrors `simulation::world`: the default world knobs, and the tokens it
/// recognises lessons and harmful instructions by in a prompt.
const TASK_TYPES: u32 = 8;
const BASE_SUCCESS: f64 = 0.3;
const LESSON_LIFT: f64 = 0.5;
const HARM_DROP: f64 = 0.4;
const POISON: f64 = 0.2;

/// The lesson lift of the "+10 points" configurations: learned versions
/// (all eight lessons) are 10 points better than the base.
const SMALL_LIFT: f64 = 0.1;

/// What the world's success model says an agent served `text` succeeds with,
/// averaged over the (uniformly drawn) task types, for a world whose lessons lift by `lift`.
fn modelled_success(text: &str, lift: f64) -> f64 {
    let harmful = text.contains("harm-");
    let sum: f64 = (0..TASK_TYPES)
        .map(|t| {
            let mut p = BASE_SUCCESS;
            if text.contains(&format!("lesson-t{t}:")) {
                p += lift;
            }
            if harmful {
                p -= HARM_DROP;
            }
            p.clamp(0.0, 1.0)
        })
        .sum();
    sum / f64::from(TASK_TYPES)
}

fn lessons_in(text: &str) -> usize {
    (0..TASK_TYPES).filter(|t| text.contains(&format!("lesson-t{t}:"))).count()
}

#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
enum Attacker {
    Burst,
    Uniform,
}

impl WorldArgs {
    /// The share of window `w`'s traces the attacker poisons, for a
    /// configuration whose traces are `overall` poisoned in all.
    fn poison_in_window(&self, w: u32, overall: f64) -> f64 {
        if overall == 0.0 {
            return 0.0;
        }
        match self.attacker {
            Attacker::Uniform => overall,
            Attacker::Burst => {
                let every = self.burst_every.max(1);
                let len = self.burst_len.clamp(1, every);
                let active = w >= self.burst_start && (w - self.burst_start) % every < len;
                if active { (overall * f64::from(every) / f64::from(len)).min(1.0) } else { 0.0 }
            }
        }
    }

    /// The attacker model in words, for the report.
    fn attacker_model(&self) -> String {
        match self.attacker {
            Attacker::Uniform => format!("uniform: {:.0}% of every window's traces are poisoned", POISON * 100.0),
            Attacker::Burst => {
                let active: Vec<String> = (0..self.windows)
                    .filter(|&w| self.poison_in_window(w, POISON) > 0.0)
                    .map(|w| w.to_string())
                    .collect();
                format!(
                    "bursts: the attacker is active in {} consecutive windows of every {} from window {} \
                     (windows {}), poisoning {:.0}% of those windows' traces and none in the others — {:.0}% of all \
                     traces in a whole number of campaigns; a poisoned run's subject is drawn from the same users",
                    self.burst_len,
                    self.burst_every,
                    self.burst_start,
                    active.join(", "),
                    self.poison_in_window(self.burst_start, POISON) * 100.0,
                    POISON * 100.0
                )
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum WorldPolicy {
    /// `promotion = "manual"` and nobody promotes: rounds run and publish
    /// candidates, production stays the base version — agents never see learning.
    None,
    Auto,
    Evaluated,
}

impl WorldPolicy {
    fn label(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Auto => "auto",
            Self::Evaluated => "evaluated",
        }
    }
    fn promotion(self) -> &'static str {
        match self {
            Self::None => "manual",
            Self::Auto => "auto",
            Self::Evaluated => "evaluated",
        }
    }
}

/// The promotion gate a configuration's prompt runs with.
#[derive(Debug, Clone, Copy, PartialEq)]
enum GateSetting {
    /// The product defaults (`[population]` margin and cool-down).
    Defaults,
    /// As before the margin and cool-down existed: margin 0, no cool-down (per-prompt settings).
    Before,
}

#[derive(Debug, Clone, Copy)]
struct WorldSetup {
    policy: WorldPolicy,
    poison: f64,
    /// The world's lesson lift.
    lift: f64,
    gate: GateSetting,
}

impl WorldSetup {
    fn plain(policy: WorldPolicy, poison: f64) -> Self {
        Self { policy, poison, lift: LESSON_LIFT, gate: GateSetting::Defaults }
    }
    fn name(&self) -> String {
        let mut name = format!("{} poison {:.0}%", self.policy.label(), self.poison * 100.0);
        if self.lift != LESSON_LIFT {
            name.push_str(&format!(", +{:.0} points", self.lift * 100.0));
        }
        if self.gate == GateSetting::Before {
            name.push_str(", gate before (margin 0, no cool-down)");
        }
        name
    }
    fn prompt(&self) -> String {
        format!(
            "world-{}-p{:.0}-l{:.0}{}",
            self.policy.label(),
            self.poison * 100.0,
            self.lift * 100.0,
            if self.gate == GateSetting::Before { "-before" } else { "" }
        )
    }
    /// The prompt's settings: the round size, and the gate's knobs for `GateSetting::Before`.
    fn settings(&self, args: &WorldArgs) -> Value {
        let mut settings = json!({"batch_size": args.batch_size, "max_wait_secs": 1});
        if self.gate == GateSetting::Before {
            settings["population"] = json!({"margin": 0.0, "cooldown_windows": 0});
        }
        settings
    }
    /// Whether the plot and the original targets show it (the gate comparisons are in the summary).
    fn plotted(&self) -> bool {
        self.lift == LESSON_LIFT && self.gate == GateSetting::Defaults
    }
}

#[derive(Debug, Clone)]
struct WindowRow {
    window: u32,
    elapsed_secs: f64,
    /// Share of this window's traces the attacker poisoned (configured).
    poison_share: f64,
    /// Wall time of the window's runs and the wait for learning (over the
    /// pacing `window_secs`: the machine could not keep up).
    busy_secs: f64,
    runs: usize,
    honest_runs: usize,
    successes: usize,
    success_rate: f64,
    versions_served: String,
    production_version: i64,
    production_lessons: usize,
    production_harmful: bool,
    production_modelled: f64,
}

struct WorldClient {
    http: reqwest::Client,
    base: String,
    key: String,
}

impl WorldClient {
    async fn production(&self, prompt: &str) -> anyhow::Result<(i64, String)> {
        let res = self
            .http
            .get(format!("{}/v1/prompts/{prompt}?label=production", self.base))
            .bearer_auth(&self.key)
            .send()
            .await?;
        if !res.status().is_success() {
            bail!("GET production of {prompt}: {}", res.status());
        }
        let v: Value = res.json().await?;
        Ok((v["version"].as_i64().context("no version")?, v["text"].as_str().unwrap_or_default().to_owned()))
    }
}

async fn run_config(
    args: &WorldArgs,
    client: &WorldClient,
    cfg: WorldSetup,
    started: Instant,
) -> anyhow::Result<Vec<WindowRow>> {
    let prompt = cfg.prompt();
    let res = client
        .http
        .post(format!("{}/v1/prompts", client.base))
        .bearer_auth(&client.key)
        .json(&json!({
            "name": prompt,
            "base": "You solve tasks.",
            "promotion": cfg.policy.promotion(),
            "settings": cfg.settings(args),
        }))
        .send()
        .await?;
    if res.status().as_u16() != 201 {
        bail!("creating {prompt}: {} {}", res.status(), res.text().await.unwrap_or_default());
    }
    let mut rows = Vec::new();
    for w in 0..args.windows {
        let window_started = Instant::now();
        let world_cfg = WorldConfig {
            prompt: prompt.clone(),
            task_types: TASK_TYPES,
            tasks_per_type: 20,
            runs: args.window_runs,
            window: args.window_runs,
            agents: args.agents,
            subjects: args.subjects,
            poison_share: args.poison_in_window(w, cfg.poison),
            base_success: BASE_SUCCESS,
            lesson_lift: cfg.lift,
            harm_drop: HARM_DROP,
            settle_secs: args.settle_secs,
            // Every window draws new tasks; window w is the same in every configuration.
            seed: args.seed.wrapping_add(u64::from(w) << 40),
            no_feedback: false,
            house_rules: 0,
            rate: None,
        };
        let report = World::new(&client.base, &client.key, world_cfg)?.run(|_| {}).await?;
        let wr = report.windows.into_iter().next().context("the world reported no window")?;
        let (production_version, text) = client.production(&prompt).await?;
        let versions: Vec<String> = wr.versions.iter().map(|(v, n)| format!("v{v}×{n}")).collect();
        rows.push(WindowRow {
            window: w,
            elapsed_secs: started.elapsed().as_secs_f64(),
            poison_share: args.poison_in_window(w, cfg.poison),
            busy_secs: wr.elapsed_secs,
            runs: wr.runs,
            honest_runs: wr.honest_runs,
            successes: wr.successes,
            success_rate: wr.success_rate,
            versions_served: versions.join(" "),
            production_version,
            production_lessons: lessons_in(&text),
            production_harmful: text.contains("harm-"),
            production_modelled: modelled_success(&text, cfg.lift),
        });
        let pace = Duration::from_secs_f64(args.window_secs);
        if let Some(rest) = pace.checked_sub(window_started.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }
    eprintln!("[{:>6.1}s] done: {}", started.elapsed().as_secs_f64(), cfg.name());
    Ok(rows)
}

/// Production's moves over the windows: how many, how many between versions
/// the world models as equally good (within half a point), and the window of
/// the first.
/// (Production starts at version 1 with the base's modelled success: a move
/// during the first window counts too.)
fn moves_of(rows: &[WindowRow]) -> (usize, usize, Option<u32>) {
    let mut moves: Vec<(u32, f64, f64)> = Vec::new();
    if let Some(first) = rows.first().filter(|r| r.production_version != 1) {
        moves.push((first.window, BASE_SUCCESS, first.production_modelled));
    }
    moves.extend(
        rows.windows(2)
            .filter(|p| p[0].production_version != p[1].production_version)
            .map(|p| (p[1].window, p[0].production_modelled, p[1].production_modelled)),
    );
    let equal = moves.iter().filter(|(_, from, to)| (from - to).abs() < 0.005).count();
    (moves.len(), equal, moves.first().map(|m| m.0))
}

/// Largest fall of `xs` below its running best.
fn worst_dip(xs: &[f64]) -> f64 {
    let mut best = f64::NEG_INFINITY;
    let mut dip: f64 = 0.0;
    for &x in xs {
        best = best.max(x);
        dip = dip.max(best - x);
    }
    dip
}

fn tail_mean(rows: &[WindowRow], n: usize) -> f64 {
    let tail = &rows[rows.len().saturating_sub(n)..];
    let (s, h) = tail.iter().fold((0, 0), |(s, h), r| (s + r.successes, h + r.honest_runs));
    s as f64 / h.max(1) as f64
}

fn svg(configs: &[WorldSetup], results: &[Vec<WindowRow>], args: &WorldArgs) -> String {
    const W: f64 = 820.0;
    const H: f64 = 480.0;
    let (l, r, t, b) = (70.0, 200.0, 60.0, 60.0);
    let n = f64::from(args.windows.max(2) - 1);
    let x = |w: u32| l + (W - l - r) * f64::from(w) / n;
    let y = |v: f64| t + (H - t - b) * (1.0 - v);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" \
         font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"24\" font-size=\"15\" text-anchor=\"middle\">SIMULATION: simulated agents' success rate per window</text>\n\
         <text x=\"{x0}\" y=\"40\" font-size=\"11\" text-anchor=\"middle\" fill=\"#555\">honest runs, all arms served; \
         {} runs per window, {} subjects; simulated LLM</text>\n\
         <text x=\"{x0}\" y=\"53\" font-size=\"11\" text-anchor=\"middle\" fill=\"#555\">solid: no poison, dashed: 20% \
         poisoned traces ({} attacker; shaded: attack windows)</text>\n",
        (W - r + l) / 2.0,
        args.window_runs,
        args.subjects,
        match args.attacker {
            Attacker::Burst => "burst",
            Attacker::Uniform => "uniform",
        },
        x0 = (W - r + l) / 2.0,
    );
    // The windows the attacker is active in (a band one window wide around each).
    let half = (W - l - r) / n / 2.0;
    for w in (0..args.windows).filter(|&w| args.poison_in_window(w, POISON) > 0.0 && args.attacker == Attacker::Burst) {
        s.push_str(&format!(
            "<rect x=\"{:.1}\" y=\"{t}\" width=\"{:.1}\" height=\"{}\" fill=\"#fbe3e3\"><title>attack window {w}</title></rect>\n",
            (x(w) - half).max(l),
            (2.0 * half).min(W - r - (x(w) - half).max(l)),
            H - t - b
        ));
    }
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
    for w in (0..args.windows).step_by(5) {
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{}\" font-size=\"10\" text-anchor=\"middle\">{w}</text>\n",
            x(w),
            H - b + 16.0
        ));
    }
    s.push_str(&format!(
        "<line x1=\"{l}\" x2=\"{l}\" y1=\"{t}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{l}\" x2=\"{}\" y1=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <text x=\"{:.1}\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\">window ({:.0} s each)</text>\n\
         <text x=\"18\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\" transform=\"rotate(-90 18 {:.1})\">success rate</text>\n",
        H - b,
        W - r,
        H - b,
        H - b,
        (W - r + l) / 2.0,
        H - b + 36.0,
        args.window_secs,
        (H - b + t) / 2.0,
        (H - b + t) / 2.0
    ));
    for (i, (cfg, rows)) in configs.iter().zip(results).enumerate() {
        let color = match cfg.policy {
            WorldPolicy::None => "#7f7f7f",
            WorldPolicy::Auto => "#d62728",
            WorldPolicy::Evaluated => "#1f77b4",
        };
        let dash = if cfg.poison > 0.0 { " stroke-dasharray=\"6 4\"" } else { "" };
        let pts: Vec<String> = rows.iter().map(|r| format!("{:.1},{:.1}", x(r.window), y(r.success_rate))).collect();
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
    let args = WorldArgs::parse();
    let dir = tempfile::tempdir()?;
    let sim = LocalSim::start(SimConfig::default()).await?;

    let (mut s, store) = combee_bench::embedded(dir.path(), &sim.base_url).await?;
    let data_dir = s.database.data_dir.clone();
    s.worker.poll_interval_ms = 100;
    s.worker.max_parallel_rounds = 6;
    s.population.window_secs = args.rating_window_secs;
    s.population.tick_secs = args.rater_tick_secs;
    let population = s.population.clone();
    let guard = s.guard.clone();
    let app = Application::build_with_store(s, store).await?;
    let base = format!("http://{}", app.local_addr());
    let shutdown = app.shutdown_token();
    let server = tokio::spawn(app.run_until_stopped());
    let key = std::fs::read_to_string(data_dir.join("admin-key"))?.trim().to_owned();
    let client = WorldClient { http: reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?, base, key };

    let mut configs: Vec<WorldSetup> = [0.0, POISON]
        .into_iter()
        .flat_map(|poison| {
            [WorldPolicy::None, WorldPolicy::Auto, WorldPolicy::Evaluated]
                .map(|policy| WorldSetup::plain(policy, poison))
        })
        .collect();
    configs.push(WorldSetup { gate: GateSetting::Before, ..WorldSetup::plain(WorldPolicy::Evaluated, 0.0) });
    configs.push(WorldSetup { lift: SMALL_LIFT, ..WorldSetup::plain(WorldPolicy::Evaluated, 0.0) });
    configs.push(WorldSetup {
        lift: SMALL_LIFT,
        gate: GateSetting::Before,
        ..WorldSetup::plain(WorldPolicy::Evaluated, 0.0)
    });
    eprintln!(
        "SIMULATION: {} configurations at once, {} windows × {} runs, {} s per window",
        configs.len(),
        args.windows,
        args.window_runs,
        args.window_secs
    );
    let started = Instant::now();
    let results: Vec<Vec<WindowRow>> =
        futures_util::future::try_join_all(configs.iter().map(|&c| run_config(&args, &client, c, started))).await?;
    let total_secs = started.elapsed().as_secs_f64();
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), server).await;

    // The report.
    let find_with = |p: WorldPolicy, poison: f64, lift: f64, gate: GateSetting| {
        configs
            .iter()
            .position(|c| c.policy == p && c.poison == poison && c.lift == lift && c.gate == gate)
            .map(|i| &results[i])
            .expect("config")
    };
    let find = |p: WorldPolicy, poison: f64| find_with(p, poison, LESSON_LIFT, GateSetting::Defaults);
    let tail = (args.windows as usize / 4).max(1);
    let mut md = String::new();
    md.push_str("# Closed-loop benchmark over the simulated agent world — a SIMULATION\n\n");
    md.push_str(
        "Simulated agents (not agents) and a simulated LLM (not a model, `src/simulation/llm.rs`) against a real \
         combee server (embedded SQLite, worker and population rater on). Not a timed test.\n\n",
    );
    md.push_str(&format!(
        "Run settings: {} configurations at once on one server, the same world seed ({}) for each; {} windows × \
         {} runs, {} simulated agents (concurrent runs) per configuration serving {} subjects (each run's subject \
         drawn at random), one window every {} s; world: {} task \
         types, base success {BASE_SUCCESS}, lesson lift {LESSON_LIFT}, harm drop {HARM_DROP}; prompts: batch_size \
         {}, max_wait_secs 1. Shortened for the run: population.window_secs = {} (default 600), \
         population.tick_secs = {} (default 10). Product defaults: explore_share {}, min_arm_share {}, \
         min_traces {}, max_arms {}, min_window_traces {}, gate margin {} (TrueSkill points), cool-down {} \
         rating windows; regression guard window {} s (it cannot act within \
         this run). `none` = promotion `manual` with nobody promoting: rounds run, production stays v1. \
         \"gate before\" = the prompt's own `settings.population` set to margin 0 and no cool-down, the gate \
         as it was; \"+10 points\" = a world whose lesson lift is {SMALL_LIFT} (every learned version is 10 \
         points better than the base). Total {total_secs:.0} s.\n\n",
        configs.len(),
        args.seed,
        args.windows,
        args.window_runs,
        args.agents,
        args.subjects,
        args.window_secs,
        TASK_TYPES,
        args.batch_size,
        population.window_secs,
        population.tick_secs,
        population.explore_share,
        population.min_arm_share,
        population.min_traces,
        population.max_arms,
        population.min_window_traces,
        population.margin,
        population.cooldown_windows,
        guard.window_secs,
    ));
    let poisoned_runs: Vec<&WindowRow> =
        configs.iter().zip(&results).filter(|(c, _)| c.poison > 0.0).flat_map(|(_, rows)| rows.iter()).collect();
    let measured_poison = poisoned_runs.iter().map(|r| r.runs - r.honest_runs).sum::<usize>() as f64
        / poisoned_runs.iter().map(|r| r.runs).sum::<usize>().max(1) as f64;
    let all_rows = || results.iter().flatten();
    let slow_windows = all_rows().filter(|r| r.busy_secs > args.window_secs).count();
    let busiest = all_rows().map(|r| r.busy_secs).fold(0.0, f64::max);
    md.push_str(&format!(
        "Attacker model (the poisoned configurations): {}. Measured: {:.1}% of the poisoned configurations' traces \
         were poisoned. Pacing: the busiest window took {busiest:.1} s of runs and waiting for learning (pace {} s); \
         {slow_windows} of {} configuration-windows overran the pace.\n\n",
        args.attacker_model(),
        measured_poison * 100.0,
        args.window_secs,
        all_rows().count()
    ));
    md.push_str(
        "**success** = the honest (not poisoned) runs' success rate in the window, over every arm served. \
         **prod** = production's *modelled* success at the window's end: the world's success probability \
         for an agent served the production text, averaged over task types (lessons it holds, harmful \
         instruction or not).\n\n",
    );
    md.push_str("| window | attack |");
    for c in &configs {
        md.push_str(&format!(" {} success | prod |", c.name()));
    }
    md.push_str("\n| ---: | ---: |");
    for _ in &configs {
        md.push_str(" ---: | ---: |");
    }
    md.push('\n');
    for w in 0..args.windows as usize {
        let attack = args.poison_in_window(w as u32, POISON);
        md.push_str(&format!(
            "| {w} | {} |",
            if attack > 0.0 { format!("{:.0}%", attack * 100.0) } else { "—".into() }
        ));
        for rows in &results {
            let r = &rows[w];
            md.push_str(&format!(
                " {:.3} | {:.3}{} v{} |",
                r.success_rate,
                r.production_modelled,
                if r.production_harmful { " ☠" } else { "" },
                r.production_version
            ));
        }
        md.push('\n');
    }
    md.push_str(
        "\n☠: production holds a harmful instruction. **attack**: the share of the window's traces the attacker \
         poisons in the poisoned configurations.\n\n## Summary\n\n",
    );
    md.push_str(&format!(
        "| configuration | success, first window | success, last {tail} windows | production's best (modelled) | worst fall below its best | windows with harm in production | production moves | moves between equally good versions | first move | production moves (window→version) |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n"
    ));
    for (c, rows) in configs.iter().zip(&results) {
        let prod: Vec<f64> = rows.iter().map(|r| r.production_modelled).collect();
        let moves: Vec<String> = rows
            .windows(2)
            .filter(|p| p[0].production_version != p[1].production_version)
            .map(|p| format!("{}→v{}", p[1].window, p[1].production_version))
            .collect();
        let moves = match (rows.first(), moves.len()) {
            (Some(first), 0) => format!("none (v{})", first.production_version),
            (Some(first), n) if n > 8 => {
                format!("{n} (from v{}; last {})", first.production_version, moves[n - 1])
            }
            (Some(first), _) => format!("from v{}: {}", first.production_version, moves.join(", ")),
            (None, _) => String::new(),
        };
        let (all, equal, first) = moves_of(rows);
        md.push_str(&format!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {all} | {equal} | {} | {moves} |\n",
            c.name(),
            rows[0].success_rate,
            tail_mean(rows, tail),
            prod.iter().cloned().fold(0.0, f64::max),
            worst_dip(&prod),
            rows.iter().filter(|r| r.production_harmful).count(),
            first.map_or("—".to_owned(), |w| format!("window {w}")),
        ));
    }
    let eval0 = tail_mean(find(WorldPolicy::Evaluated, 0.0), tail);
    let auto0 = tail_mean(find(WorldPolicy::Auto, 0.0), tail);
    let dip = |p: WorldPolicy| worst_dip(&find(p, POISON).iter().map(|r| r.production_modelled).collect::<Vec<_>>());
    let (eval_dip, auto_dip) = (dip(WorldPolicy::Evaluated), dip(WorldPolicy::Auto));
    let pf = |ok: bool| if ok { "PASS" } else { "FAIL" };
    md.push_str("\n## Targets (SIMULATION)\n\n");
    md.push_str(&format!(
        "- {}: `evaluated` reaches at least `auto`'s success without poisoning — last {tail} windows {eval0:.3} vs {auto0:.3}\n",
        pf(eval0 >= auto0)
    ));
    md.push_str(&format!(
        "- {}: under 20% poisoning production's (modelled) success never falls more than 2 points below its best under `evaluated` — worst fall {:.1} points\n",
        pf(eval_dip <= 0.02 + 1e-9),
        eval_dip * 100.0
    ));
    md.push_str(&format!(
        "- {}: under 20% poisoning `auto` shows the dip (falls more than 2 points) — worst fall {:.1} points\n",
        pf(auto_dip > 0.02),
        auto_dip * 100.0
    ));

    // The gate: equally good versions do not take turns; a better one is not held back.
    let (_, equal_now, _) = moves_of(find(WorldPolicy::Evaluated, 0.0));
    let (_, equal_before, _) = moves_of(find_with(WorldPolicy::Evaluated, 0.0, LESSON_LIFT, GateSetting::Before));
    md.push_str(&format!(
        "- {}: production moves at most twice in {} windows between equally good versions (`evaluated`, no poison, \
         product defaults) — {equal_now} moves; with the gate as before (margin 0, no cool-down): {equal_before}\n",
        pf(equal_now <= 2),
        args.windows
    ));
    let (_, _, first_now) = moves_of(find_with(WorldPolicy::Evaluated, 0.0, SMALL_LIFT, GateSetting::Defaults));
    let (_, _, first_before) = moves_of(find_with(WorldPolicy::Evaluated, 0.0, SMALL_LIFT, GateSetting::Before));
    let shown = |w: Option<u32>| w.map_or("never".to_owned(), |w| format!("window {w}"));
    md.push_str(&format!(
        "- {}: a version 10 points better is still promoted, no later than before — product defaults {}, \
         the gate as before {}\n",
        pf(first_now.is_some() && first_now.unwrap_or(u32::MAX) <= first_before.unwrap_or(u32::MAX)),
        shown(first_now),
        shown(first_before)
    ));

    // Not a target: what poisoning cost production, window by window, against
    // the same policy's unpoisoned run (the same world seed, so the same tasks).
    let shortfall = |p: WorldPolicy| {
        find(p, 0.0)
            .iter()
            .zip(find(p, POISON))
            .map(|(clean, poisoned)| clean.production_modelled - poisoned.production_modelled)
            .fold(0.0, f64::max)
    };
    md.push_str(&format!(
        "- (not a target) production's worst shortfall under poisoning against the same policy's unpoisoned run \
         in the same window: `auto` {:.1} points, `evaluated` {:.1} points\n",
        shortfall(WorldPolicy::Auto) * 100.0,
        shortfall(WorldPolicy::Evaluated) * 100.0
    ));

    let mut csv = String::from(
        "simulation,configuration,policy,poison_share,attacker,window_poison_share,window,elapsed_secs,busy_secs,runs,honest_runs,successes,success_rate,production_version,production_lessons,production_harmful,production_modelled_success,versions_served\n",
    );
    for (c, rows) in configs.iter().zip(&results) {
        for r in rows {
            csv.push_str(&format!(
                "simulated agent world,{},{},{},{:?},{:.4},{},{:.2},{:.2},{},{},{},{:.4},{},{},{},{:.4},{}\n",
                c.name(),
                c.policy.label(),
                c.poison,
                args.attacker,
                r.poison_share,
                r.window,
                r.elapsed_secs,
                r.busy_secs,
                r.runs,
                r.honest_runs,
                r.successes,
                r.success_rate,
                r.production_version,
                r.production_lessons,
                r.production_harmful,
                r.production_modelled,
                r.versions_served
            ));
        }
    }
    std::fs::create_dir_all(&args.out_dir)?;
    std::fs::write(args.out_dir.join("world.md"), &md)?;
    std::fs::write(args.out_dir.join("world.csv"), &csv)?;
    let (plotted, plotted_results): (Vec<WorldSetup>, Vec<Vec<WindowRow>>) =
        configs.iter().zip(&results).filter(|(c, _)| c.plotted()).map(|(c, r)| (*c, r.clone())).unzip();
    std::fs::write(args.out_dir.join("world-success.svg"), svg(&plotted, &plotted_results, &args))?;
    println!("{md}");
    eprintln!("wrote {}/world.md, world.csv, world-success.svg", args.out_dir.display());
    drop(sim);
    Ok(())
}
