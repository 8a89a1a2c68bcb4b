//! `combee evaluators …`: show a prompt's evaluators, replace them from a
//! JSON file (the server checks the list and says what is wrong), and show
//! how well each agrees with the rewards agents and operators gave.

use std::path::PathBuf;

use clap::Subcommand;
use reqwest::Method;
use serde_json::Value;

use super::client::{ApiClient, CliError, CliResult, cell, encode, print_json, print_table};

#[derive(Debug, Subcommand)]
pub enum EvaluatorsCommand {
    /// Show the prompt's evaluators (as JSON: the body `set` takes).
    Get { name: String },
    /// Replace the prompt's evaluators with those in FILE (`-` reads stdin):
    /// `{"evaluators": [...]}` or the bare list. An empty list removes them.
    Set { name: String, file: PathBuf },
    /// Each evaluator's agreement with the traces agents or operators scored:
    /// n, accuracy and Cohen's kappa.
    Calibrate { name: String },
}

pub async fn run(api: &ApiClient, json_out: bool, cmd: EvaluatorsCommand) -> CliResult<()> {
    match cmd {
        EvaluatorsCommand::Get { name } => {
            let body = api.get(&format!("/v1/prompts/{}/evaluators", encode(&name))).await?.body;
            print_json(&body);
            Ok(())
        }
        EvaluatorsCommand::Set { name, file } => {
            let text = if file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin())
            } else {
                std::fs::read_to_string(&file)
            }
            .map_err(|e| CliError::local(format!("cannot read {}: {e}", file.display())))?;
            let parsed: Value = serde_json::from_str(&text)
                .map_err(|e| CliError::local(format!("{} is not JSON: {e}", file.display())))?;
            let body = match parsed {
                Value::Array(list) => serde_json::json!({ "evaluators": list }),
                other => other,
            };
            let path = format!("/v1/prompts/{}/evaluators", encode(&name));
            let saved = api.send_json(Method::PUT, &path, &body).await?.body;
            if json_out {
                print_json(&saved);
            } else {
                let n = saved["evaluators"].as_array().map_or(0, Vec::len);
                println!("{name}: {n} evaluator(s) saved");
            }
            Ok(())
        }
        EvaluatorsCommand::Calibrate { name } => {
            let cal = api.get(&format!("/v1/prompts/{}/evaluators/calibration", encode(&name))).await?.body;
            if json_out {
                print_json(&cal);
                return Ok(());
            }
            println!("{name}: {} scored traces judged", cell(&cal["traces"]));
            let num = |v: &Value| v.as_f64().map_or("-".to_owned(), |x| format!("{x:.3}"));
            let rows: Vec<Vec<String>> = cal["evaluators"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| vec![cell(&e["evaluator"]), cell(&e["n"]), num(&e["accuracy"]), num(&e["kappa"])])
                .collect();
            print_table(&["EVALUATOR", "N", "ACCURACY", "KAPPA"], &rows);
            Ok(())
        }
    }
}
