//! `combee regression …`: a prompt's regression set on a running server —
//! import a JSON Lines file (cases, OpenAI Evals samples, or combee's own
//! trace export), list the cases, delete one, and show a version's gate.

use std::path::PathBuf;

use clap::Subcommand;
use reqwest::Method;

use super::client::{ApiClient, CliError, CliResult, cell, encode, print_json, print_table};

#[derive(Debug, Subcommand)]
pub enum RegressionCommand {
    /// Import cases from a JSON Lines file, all or none (a bad line is named by its number).
    ///
    /// A line is a case (`{"name", "input", "checks"}`, or `"judge": {"rubric",
    /// "pass_score"}` instead of checks), an OpenAI Evals sample
    /// (`{"input", "ideal"}`: the reply must equal the ideal, or contain it with
    /// --includes; a list of ideals: any of them), or a record of combee's trace
    /// export (a successful trace: the reply must equal its output).
    Import {
        prompt: String,
        file: PathBuf,
        /// An Evals `ideal` is matched as contained in the reply (ignoring case) instead of equal to it.
        #[arg(long)]
        includes: bool,
    },
    /// List a prompt's regression cases.
    List { prompt: String },
    /// Delete one case by id.
    Delete { prompt: String, id: String },
    /// Show a version's regression gate: status, reason and each case.
    Gate { prompt: String, version: i64 },
}

pub async fn run(api: &ApiClient, json_out: bool, command: RegressionCommand) -> CliResult<()> {
    match command {
        RegressionCommand::Import { prompt, file, includes } => {
            let body = std::fs::read(&file).map_err(|e| CliError::local(format!("reading {}: {e}", file.display())))?;
            let style = if includes { "includes" } else { "match" };
            let path = format!("/v1/prompts/{}/regression-cases/import?ideal={style}", encode(&prompt));
            let req = api.request(Method::POST, &path).header("content-type", "application/x-ndjson").body(body);
            let answer = api.send(req).await?;
            if json_out {
                print_json(&answer.body);
            } else {
                let n = answer.body["cases"].as_array().map_or(0, Vec::len);
                println!("imported {n} cases into {prompt}'s regression set");
            }
            Ok(())
        }
        RegressionCommand::List { prompt } => {
            let answer = api.get(&format!("/v1/prompts/{}/regression-cases", encode(&prompt))).await?;
            if json_out {
                print_json(&answer.body);
                return Ok(());
            }
            let rows: Vec<Vec<String>> = answer.body["cases"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| {
                    // A judge-rubric case shows its rubric and pass score where a checks case shows its checks.
                    let holds = match c.get("judge") {
                        Some(j) => format!("judge ≥ {}: {}", cell(&j["pass_score"]), cell(&j["rubric"])),
                        None => c["checks"].to_string(),
                    };
                    vec![cell(&c["id"]), cell(&c["name"]), cell(&c["kind"]), cell(&c["source"]), holds]
                })
                .collect();
            print_table(&["ID", "NAME", "KIND", "SOURCE", "MUST HOLD"], &rows);
            Ok(())
        }
        RegressionCommand::Delete { prompt, id } => {
            let path = format!("/v1/prompts/{}/regression-cases/{}", encode(&prompt), encode(&id));
            api.send(api.request(Method::DELETE, &path)).await?;
            if !json_out {
                println!("deleted case {id}");
            }
            Ok(())
        }
        RegressionCommand::Gate { prompt, version } => {
            let answer = api.get(&format!("/v1/prompts/{}/versions/{version}/gate", encode(&prompt))).await?;
            if json_out {
                print_json(&answer.body);
                return Ok(());
            }
            let g = &answer.body;
            println!("v{version}: {} ({}) — {}", cell(&g["status"]), cell(&g["mode"]), cell(&g["reason"]));
            let rows: Vec<Vec<String>> = g["cases"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| {
                    vec![
                        cell(&c["name"]),
                        cell(&c["candidate"]["score"]),
                        cell(&c["production"]["score"]),
                        cell(&c["regressed"]),
                    ]
                })
                .collect();
            print_table(&["CASE", "SCORE", "PRODUCTION", "REGRESSED"], &rows);
            Ok(())
        }
    }
}
