//! Learning-speed benchmark: how long it takes to learn from a backlog of N
//! traces, and how much of what the traces teach survives, for the sequential
//! baseline, naive batching, Combee at fixed batch sizes and Combee with the
//! dynamic batch-size controller — the paper's quality-vs-delay comparison,
//! against the OpenAI-compatible simulator (a SIMULATED LLM, not a model).
//!
//! Learning from a backlog means rounds one after another, each starting from
//! the version the previous round published, until all N traces are consumed.
//! Every trace carries one distinct `INSIGHT-<token>` marker; retention is the
//! share of the N markers present in the final rendered prompt.
//!
//! Every configuration is run twice: once against the simulator over HTTP and
//! timed with a wall clock (measured), and once against an in-process replay of
//! the simulator's answers that returns at once, where a round's time is the
//! simulator's latency formula applied to the token counts of the calls on its
//! critical path (modelled: no timing, no overhead). The controller sees
//! measured round times in the first and modelled ones in the second.
//!
//!     scripts/bench-learn            # builds --release, writes bench/results/learn.* and growth.md
//!     scripts/bench-learn --growth-only   # only the growing-playbook section (growth.rs)
//!     scripts/bench-learn --first-rounds-only   # only a process's first large round (first.rs)

mod bill;
mod figure;
mod first;
mod growth;
mod level2;
mod llama;
mod overload_meter;
mod report;
mod results;
mod runs;
mod second;
mod svg;
mod sweep;
mod text;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use combee::simulation::llm::{CapacityModel, SimConfig};

use crate::level2::level2_section;
use crate::report::model_name;
use crate::sweep::{max_batch_section, one_model};

#[derive(Parser)]
struct LearnArgs {
    /// Traces in the backlog, N.
    #[arg(long, default_value_t = 300)]
    n: usize,
    /// Fixed batch sizes for naive and Combee.
    #[arg(long, value_delimiter = ',', default_value = "10,25,50,100,150,300")]
    sizes: Vec<usize>,
    /// Simulator latency: fixed part of every call, in ms.
    #[arg(long, default_value_t = 250.0)]
    fixed_ms: f64,
    /// Simulator latency per prompt token, in ms.
    #[arg(long, default_value_t = 0.015)]
    per_input_token_ms: f64,
    /// Simulator latency per completion token, in ms.
    #[arg(long, default_value_t = 0.15)]
    per_output_token_ms: f64,
    /// Simulator capacity K: distinct new insights one aggregating call keeps.
    #[arg(long, default_value_t = 12)]
    capacity_k: usize,
    /// Simulator digest D: reflections a call digests fully (hard capacity model only).
    #[arg(long, default_value_t = 12)]
    digest: usize,
    /// Simulator capacity models, each a full sweep: `hard` (at most K per call, fewer beyond D)
    /// and/or `soft` (each of the m new insights a call writes kept with probability E(m)/m).
    /// The level-2 section always uses `soft`.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "hard,soft")]
    capacity_models: Vec<CapacityModel>,
    /// Level-2 section: traces in its one round (n) — union, `reduce = "llm"` and rewrite at p = 2.
    #[arg(long, default_value_t = 100)]
    level2_n: usize,
    /// Level-2 section: round seeds to average over.
    #[arg(long, default_value_t = 5)]
    level2_seeds: u64,
    /// Only run the level-2 section (a few seconds).
    #[arg(long)]
    level2_only: bool,
    /// The client's LLM concurrency limit (at least 2·N, so a map and a level 1 are one wave each).
    #[arg(long, default_value_t = 1024)]
    concurrency: usize,
    /// Tuned rows, labelled as such: Combee at p = 1 (the paper's ⌊√n⌋ groups) at these sizes (empty: none).
    #[arg(long, value_delimiter = ',', default_value = "100")]
    tuned_sizes: Vec<usize>,
    /// Also run Method::Sequential over all N in one round (map in parallel, then N/3 batches in order).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    with_one_round_sequential: bool,
    /// Overload-meter section: traces per round.
    #[arg(long, default_value_t = 100)]
    meter_n: usize,
    /// Overload-meter section: round seeds per group size.
    #[arg(long, default_value_t = 3)]
    meter_seeds: u64,
    /// Also run a model that never cites its sources right (the soft capacity model;
    /// each aggregator answer cites nothing or cites the wrong reflections, see the
    /// two rates below): sequential, combee-auto and the meter's text reading.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    non_citing: bool,
    /// The non-citing model: share of aggregator answers without `sources`.
    #[arg(long, default_value_t = 0.5)]
    non_citing_absent: f64,
    /// The non-citing model: share of aggregator answers whose `sources` are wrong (the rest).
    #[arg(long, default_value_t = 0.5)]
    non_citing_wrong: f64,
    /// The max_batch section: backlog N for it (modelled only, soft capacity model).
    #[arg(long, default_value_t = 2048)]
    max_batch_n: usize,
    /// The max_batch section: the ceilings compared.
    #[arg(long, value_delimiter = ',', default_value = "64,128,256,512,1024,2048")]
    max_batches: Vec<u32>,
    /// The max_batch section: client concurrency limits compared (64 is `llm.max_concurrency`'s default).
    #[arg(long, value_delimiter = ',', default_value = "64,1024")]
    max_batch_concurrency: Vec<usize>,
    /// Also learn a second backlog of N new traces on top of the playbook combee-auto
    /// learned from the first (citing models): sequential, combee-auto and
    /// combee-auto at p = 1 (tuned), with their token bill.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    second_backlog: bool,
    /// Only compute the modelled figures (no waiting, no files).
    #[arg(long)]
    model_only: bool,
    /// Growing-playbook section: consecutive rounds on one prompt.
    #[arg(long, default_value_t = 10)]
    growth_rounds: usize,
    /// Growing-playbook section: traces per round.
    #[arg(long, default_value_t = 300)]
    growth_n: usize,
    /// Only run the growing-playbook section, written to growth.md.
    #[arg(long)]
    growth_only: bool,
    /// Only time a process's first large round (backend never seen, warm, and a new process on a
    /// backend seen before) against sequential, for each capacity model; printed, no files written.
    #[arg(long)]
    first_rounds_only: bool,
    /// Only run one round on a REAL MODEL's llama.cpp server at this URL (…/v1), by a client whose
    /// store remembers the backend at `--llama-remembered` calls at once; printed, no files written.
    #[arg(long)]
    llama_url: Option<String>,
    /// The model name the llama.cpp server serves.
    #[arg(long, default_value = "smollm2")]
    llama_model: String,
    /// Traces in the real-model round.
    #[arg(long, default_value_t = 8)]
    llama_traces: usize,
    /// The concurrency limit the store remembers for the llama.cpp server before the round.
    #[arg(long, default_value_t = 64)]
    llama_remembered: u32,
    /// Where learn.md, learn.csv, growth.md and the SVGs go.
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
}

impl LearnArgs {
    /// The simulator as the flags set it, with capacity model `model` (sources always cited).
    fn sim_config(&self, model: CapacityModel) -> SimConfig {
        SimConfig {
            capacity_model: model,
            capacity_k: self.capacity_k,
            digest_reflections: self.digest,
            fixed_ms: self.fixed_ms,
            per_input_token_ms: self.per_input_token_ms,
            per_output_token_ms: self.per_output_token_ms,
            ..SimConfig::default()
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = LearnArgs::parse();
    anyhow::ensure!(args.n >= 3, "--n must be at least 3");
    anyhow::ensure!(args.level2_n >= 4, "--level2-n must be at least 4");
    if args.growth_only {
        return growth(&args).await;
    }
    if let Some(url) = &args.llama_url {
        print!("{}", llama::llama_round_section(&args, url).await?);
        return Ok(());
    }
    if args.first_rounds_only {
        print!("{}", first::first_rounds_section(&args).await?);
        return Ok(());
    }
    eprintln!("  level 2 under the soft capacity model …");
    let (level2, _) = level2_section(&args).await?;
    if args.level2_only {
        print!("{level2}");
        return Ok(());
    }
    let total = Instant::now();
    let mut md = String::new();
    let mut csv = String::new();
    let mut svgs = Vec::new();
    let mut runs: Vec<(CapacityModel, bool)> = args.capacity_models.iter().map(|&m| (m, true)).collect();
    if args.non_citing {
        runs.push((CapacityModel::Soft, false));
    }
    for (model, citing) in runs {
        let (report_md, report_csv, svg) = one_model(&args, model, citing).await?;
        md.push_str(&report_md);
        md.push('\n');
        if csv.is_empty() {
            csv.push_str(&report_csv);
        } else {
            csv.extend(report_csv.lines().skip(1).map(|l| format!("{l}\n")));
        }
        if citing {
            svgs.push((model, svg));
        }
    }
    eprintln!("  max_batch, modelled …");
    md.push_str(&max_batch_section(&args).await?);
    md.push('\n');
    md.push_str(&level2);
    let _ = writeln!(md, "\nWhole benchmark: {:.0} s on {} cores.", total.elapsed().as_secs_f64(), cores());
    print!("{md}");
    if !args.model_only {
        std::fs::create_dir_all(&args.out_dir)?;
        std::fs::write(args.out_dir.join("learn.md"), &md)?;
        std::fs::write(args.out_dir.join("learn.csv"), csv)?;
        for (model, svg) in svgs {
            std::fs::write(args.out_dir.join(format!("learn-quality-delay-{}.svg", model_name(model))), svg)?;
        }
        eprintln!("wrote {}/learn.{{md,csv}}, learn-quality-delay-{{hard,soft}}.svg", args.out_dir.display());
    }
    growth(&args).await
}

/// The growing-playbook section ([`growth`]), printed and written to growth.md.
async fn growth(args: &LearnArgs) -> anyhow::Result<()> {
    let md = growth::growth_section(args).await?;
    print!("{md}");
    if !args.model_only {
        std::fs::create_dir_all(&args.out_dir)?;
        std::fs::write(args.out_dir.join("growth.md"), &md)?;
        eprintln!("wrote {}/growth.md", args.out_dir.display());
    }
    Ok(())
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(0, |n| n.get())
}
