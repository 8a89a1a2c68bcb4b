//! `combee prune`: one retention pass run by hand, directly on the store, or
//! with `--dry-run` a report of what a pass would delete now (per prompt and
//! kind of trace, and the other expiring rows), without deleting anything.

use clap::Args;
use tokio_util::sync::CancellationToken;

use crate::{
    app,
    config::Settings,
    worker::retention::{PruneReport, Pruner},
};

#[derive(Debug, Args)]
pub struct PruneArgs {
    /// Only count what would be deleted.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(settings: Settings, args: PruneArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        settings.retention.enabled || args.dry_run,
        "retention.enabled is false: nothing is deleted (use --dry-run to see what would be)"
    );
    let store = app::open_store(&settings).await?;
    let pruner = Pruner::new(store, settings.retention.clone(), settings.limits.idempotency_ttl_hours);
    let now = chrono::Utc::now();
    let report = if args.dry_run {
        pruner.dry_run(now).await?
    } else {
        let report = pruner.pass(now, &CancellationToken::new()).await?;
        // Run by hand, a pass is an operator's act: recorded even when it deleted nothing.
        pruner.record(crate::service::audit::cli_actor(), &report).await;
        report
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({"dry_run": args.dry_run, "report": report}))?);
    } else {
        print!("{}", render(&report, args.dry_run));
    }
    Ok(())
}

/// The report as a table for people.
pub fn render(r: &PruneReport, dry_run: bool) -> String {
    use std::fmt::Write as _;
    let verb = if dry_run { "would delete" } else { "deleted" };
    let mut out = format!("{:<40} {:>12} {:>12} {:>12}\n", "PROMPT", "CONSUMED", "FAILED", "QUARANTINED");
    for (prompt, kinds) in &r.traces {
        let n = |k: &str| kinds.get(k).copied().unwrap_or(0);
        let _ = writeln!(out, "{prompt:<40} {:>12} {:>12} {:>12}", n("consumed"), n("failed"), n("quarantined"));
    }
    let _ = writeln!(out, "traces: {verb} {}", r.total_traces());
    if !dry_run {
        let _ = writeln!(
            out,
            "with them: {} reflections, {} OTLP spans, {} round links; archived first: {}",
            r.reflections, r.otlp_spans, r.round_links, r.archived
        );
    }
    for (what, n) in &r.other {
        let _ = writeln!(out, "{what}: {verb} {n}");
    }
    out.push_str("the label history is never deleted; per-version outcomes (hourly and daily rollups) stay\n");
    out
}
