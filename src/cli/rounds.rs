//! `combee rounds …`: start a learning round now (optionally waiting for it
//! to finish), list a prompt's rounds, and show one round.

use std::time::Duration;

use clap::{Subcommand, ValueEnum};
use reqwest::Method;
use serde_json::{Value, json};

use super::client::{ApiClient, CliError, CliResult, Failure, cell, encode, print_json, print_table, when};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum RoundMethod {
    Combee,
    Naive,
    Sequential,
}

impl RoundMethod {
    fn as_str(self) -> &'static str {
        match self {
            Self::Combee => "combee",
            Self::Naive => "naive",
            Self::Sequential => "sequential",
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum RoundsCommand {
    /// Start a round over the prompt's oldest pending traces.
    ///
    /// With --wait, follows it until it ends; exits 6 if it failed.
    Trigger {
        name: String,
        /// Most traces to take (default: the prompt's batch size).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        batch_size: Option<u32>,
        #[arg(long, value_enum)]
        method: Option<RoundMethod>,
        /// Wait until the round has succeeded or failed, printing its progress on stderr.
        #[arg(long)]
        wait: bool,
    },
    /// List a prompt's rounds, newest first.
    List { name: String },
    /// Show one round: status, sizes, timings, usage, result or error.
    Show { id: String },
}

pub async fn run(api: &ApiClient, json_out: bool, cmd: RoundsCommand) -> CliResult<()> {
    match cmd {
        RoundsCommand::Trigger { name, batch_size, method, wait } => {
            trigger(api, json_out, &name, batch_size, method, wait).await
        }
        RoundsCommand::List { name } => list(api, json_out, &name).await,
        RoundsCommand::Show { id } => {
            let round = api.get(&format!("/v1/rounds/{}", encode(&id))).await?.body;
            if json_out {
                print_json(&round);
            } else {
                print_round(&round);
            }
            Ok(())
        }
    }
}

async fn trigger(
    api: &ApiClient,
    json_out: bool,
    name: &str,
    batch_size: Option<u32>,
    method: Option<RoundMethod>,
    wait: bool,
) -> CliResult<()> {
    let mut body = json!({});
    if let Some(n) = batch_size {
        body["batch_size"] = json!(n);
    }
    if let Some(m) = method {
        body["method"] = json!(m.as_str());
    }
    let round = api.send_json(Method::POST, &format!("/v1/prompts/{}/rounds", encode(name)), &body).await?.body;
    let id = round["id"].as_str().unwrap_or_default().to_owned();
    if !wait {
        if json_out {
            print_json(&round);
        } else {
            println!(
                "round {id} {} for {name}: {} traces, method {}",
                cell(&round["status"]),
                cell(&round["n"]),
                cell(&round["method"])
            );
        }
        return Ok(());
    }
    eprintln!("round {id} queued for {name}: {} traces", cell(&round["n"]));
    let mut status = cell(&round["status"]);
    let finished = loop {
        let now = api.get(&format!("/v1/rounds/{}", encode(&id))).await?.body;
        let s = cell(&now["status"]);
        if s != status {
            eprintln!("round {id}: {s}");
            status = s;
        }
        if matches!(status.as_str(), "succeeded" | "failed") {
            break now;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    if json_out {
        print_json(&finished);
    } else {
        print_round(&finished);
    }
    if status == "failed" {
        return Err(CliError::new(Failure::Server, format!("round {id} failed: {}", cell(&finished["error"]))));
    }
    Ok(())
}

async fn list(api: &ApiClient, json_out: bool, name: &str) -> CliResult<()> {
    let rounds = api.get_all(&format!("/v1/prompts/{}/rounds", encode(name)), "rounds").await?;
    if json_out {
        print_json(&json!({ "rounds": rounds }));
        return Ok(());
    }
    let rows: Vec<Vec<String>> = rounds
        .iter()
        .map(|r| {
            vec![
                cell(&r["id"]),
                cell(&r["status"]),
                cell(&r["trigger"]),
                cell(&r["method"]),
                cell(&r["n"]),
                cell(&r["k"]),
                format!("v{}", cell(&r["base_version"])),
                result_of(r),
                when(&r["created_at"]),
            ]
        })
        .collect();
    print_table(&["ID", "STATUS", "TRIGGER", "METHOD", "N", "K", "BASE", "RESULT", "CREATED"], &rows);
    Ok(())
}

/// The version a round published, `unchanged` for a round that succeeded without one.
fn result_of(r: &Value) -> String {
    match r["result_version"].as_i64() {
        Some(v) => format!("v{v}"),
        None if r["status"] == "succeeded" => "unchanged".to_owned(),
        None => "-".to_owned(),
    }
}

fn print_round(r: &Value) {
    let field = |label: &str, v: String| println!("{label:<10} {v}");
    field("round:", cell(&r["id"]));
    field("prompt:", cell(&r["prompt"]));
    field("status:", cell(&r["status"]));
    field("trigger:", cell(&r["trigger"]));
    field("method:", format!("{} ({})", cell(&r["method"]), cell(&r["strategy"])));
    field(
        "size:",
        format!("n={} k={} p={} seed={}", cell(&r["n"]), cell(&r["k"]), cell(&r["duplication"]), cell(&r["seed"])),
    );
    let result = result_of(r);
    field("versions:", format!("v{} -> {result}", cell(&r["base_version"])));
    field("attempt:", cell(&r["attempt"]));
    field("created:", when(&r["created_at"]));
    field("started:", when(&r["started_at"]));
    field("finished:", when(&r["finished_at"]));
    if let Some(u) = r.get("usage") {
        field(
            "usage:",
            format!(
                "{} LLM calls, {} prompt + {} completion tokens, ${:.4}, {} retries",
                cell(&u["calls"]),
                cell(&u["prompt_tokens"]),
                cell(&u["completion_tokens"]),
                u["cost_usd"].as_f64().unwrap_or(0.0),
                cell(&u["retries"])
            ),
        );
    }
    let count = |k: &str| r.get(k).and_then(Value::as_array).map_or(0, Vec::len);
    field("traces:", count("trace_ids").to_string());
    field("reflected:", count("reflections").to_string());
    if !r["error"].is_null() {
        field("error:", cell(&r["error"]));
    }
}
