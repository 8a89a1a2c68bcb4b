//! `combee projects …`: list the projects a key sees, create one (a
//! server-wide admin key), show one, and set its settings from a JSON file.

use std::path::PathBuf;

use clap::Subcommand;
use reqwest::Method;
use serde_json::{Value, json};

use super::client::{ApiClient, CliError, CliResult, cell, encode, print_json, print_table};

#[derive(Debug, Subcommand)]
pub enum ProjectsCommand {
    /// The projects the key sees (a project's key: its own).
    List,
    /// Create a project (a server-wide admin key).
    Create { name: String },
    /// Show a project and its settings.
    Show { name: String },
    /// Replace a project's settings with those in FILE (`-` reads stdin), e.g.
    /// `{"prompt_defaults": {"max_wait_secs": 600}}`.
    Set { name: String, file: PathBuf },
}

pub async fn run(api: &ApiClient, json_out: bool, cmd: ProjectsCommand) -> CliResult<()> {
    match cmd {
        ProjectsCommand::List => {
            let body = api.get("/v1/projects").await?.body;
            if json_out {
                print_json(&body);
                return Ok(());
            }
            let rows: Vec<Vec<String>> = body["projects"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| vec![cell(&p["name"]), cell(&p["created_at"])])
                .collect();
            print_table(&["NAME", "CREATED"], &rows);
            Ok(())
        }
        ProjectsCommand::Create { name } => {
            let created = api.send_json(Method::POST, "/v1/projects", &json!({ "name": name })).await?.body;
            if json_out {
                print_json(&created);
            } else {
                println!("created project {}", cell(&created["name"]));
            }
            Ok(())
        }
        ProjectsCommand::Show { name } => {
            print_json(&api.get(&format!("/v1/projects/{}", encode(&name))).await?.body);
            Ok(())
        }
        ProjectsCommand::Set { name, file } => {
            let text = if file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin())
            } else {
                std::fs::read_to_string(&file)
            }
            .map_err(|e| CliError::local(format!("cannot read {}: {e}", file.display())))?;
            let settings: Value = serde_json::from_str(&text)
                .map_err(|e| CliError::local(format!("{} is not JSON: {e}", file.display())))?;
            let path = format!("/v1/projects/{}", encode(&name));
            let saved = api.send_json(Method::PATCH, &path, &json!({ "settings": settings })).await?.body;
            if json_out {
                print_json(&saved);
            } else {
                println!("{name}: settings saved");
            }
            Ok(())
        }
    }
}
