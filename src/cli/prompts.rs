//! `combee prompts …`: list, show, history, label history, diff, and the two label moves
//! operators make by hand — promote and rollback — each guarded by `If-Match`
//! so a move made meanwhile by someone else is refused (412), not overwritten;
//! and the learning settings: show or patch them, pin and unpin bullets.

use clap::Subcommand;
use reqwest::Method;
use serde_json::{Value, json};

use super::client::{Answer, ApiClient, CliError, CliResult, cell, encode, print_json, print_table, when};

#[derive(Debug, Subcommand)]
pub enum PromptsCommand {
    /// List prompts with their production and latest versions and pending traces.
    List,
    /// Show a prompt's rendered text (production unless --label or --version) and its ETag.
    Show {
        name: String,
        /// A label (`latest` is the newest version).
        #[arg(long, conflicts_with = "version")]
        label: Option<String>,
        /// A version number.
        #[arg(long)]
        version: Option<i64>,
    },
    /// List a prompt's versions, newest first, with the labels pointing at them.
    History { name: String },
    /// The label history: every label move, newest first, with who or what moved it and why.
    LabelHistory {
        name: String,
        /// Only the moves of this label.
        #[arg(long)]
        label: Option<String>,
    },
    /// Diff two versions: the rendered texts, and bullets added / removed / changed.
    Diff { name: String, from: i64, to: i64 },
    /// Point a label (default `production`) at VERSION, if it has not moved since it was read.
    Promote {
        name: String,
        version: i64,
        #[arg(long, default_value = "production")]
        label: String,
        /// The ETag you saw (`prompts show`); default: the label's current ETag, fetched just before.
        #[arg(long, value_name = "ETAG")]
        if_match: Option<String>,
        /// Why, for the label history.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Show a prompt's learning settings, or change them with a JSON merge patch.
    Settings {
        name: String,
        /// `use` or `ignore` the reflections agents send with their traces.
        #[arg(long, value_parser = ["use", "ignore"])]
        agent_reflections: Option<String>,
        /// A JSON merge patch of the settings, e.g. '{"max_bullets": 40, "max_wait_secs": null}'.
        #[arg(long, value_name = "JSON")]
        patch: Option<String>,
    },
    /// Protect playbook bullets: learning never updates, removes or evicts a pinned bullet.
    Pin {
        name: String,
        #[arg(required = true, value_name = "BULLET_ID")]
        bullets: Vec<String>,
    },
    /// Let learning change these bullets again.
    Unpin {
        name: String,
        #[arg(required = true, value_name = "BULLET_ID")]
        bullets: Vec<String>,
    },
    /// Make a new version with VERSION's content and point production at it.
    Rollback {
        name: String,
        version: i64,
        #[arg(long)]
        message: Option<String>,
        /// The ETag of production you saw; default: its current ETag, fetched just before.
        #[arg(long, value_name = "ETAG")]
        if_match: Option<String>,
    },
}

pub async fn run(api: &ApiClient, json_out: bool, cmd: PromptsCommand) -> CliResult<()> {
    match cmd {
        PromptsCommand::List => list(api, json_out).await,
        PromptsCommand::Show { name, label, version } => show(api, json_out, &name, label, version).await,
        PromptsCommand::History { name } => history(api, json_out, &name).await,
        PromptsCommand::LabelHistory { name, label } => label_history(api, json_out, &name, label.as_deref()).await,
        PromptsCommand::Diff { name, from, to } => diff(api, json_out, &name, from, to).await,
        PromptsCommand::Promote { name, version, label, if_match, reason } => {
            promote(api, json_out, &name, version, &label, if_match, reason).await
        }
        PromptsCommand::Rollback { name, version, message, if_match } => {
            rollback(api, json_out, &name, version, message, if_match).await
        }
        PromptsCommand::Settings { name, agent_reflections, patch } => {
            let mut body = match patch {
                Some(p) => serde_json::from_str::<Value>(&p)
                    .ok()
                    .filter(Value::is_object)
                    .ok_or_else(|| CliError::local("--patch must be a JSON object"))?,
                None => json!({}),
            };
            if let Some(a) = agent_reflections {
                body["agent_reflections"] = json!(a);
            }
            let answer = patch_settings(api, &name, &body).await?;
            print_settings(json_out, &answer.body);
            Ok(())
        }
        PromptsCommand::Pin { name, bullets } => pins(api, json_out, &name, &bullets, true).await,
        PromptsCommand::Unpin { name, bullets } => pins(api, json_out, &name, &bullets, false).await,
    }
}

async fn patch_settings(api: &ApiClient, name: &str, patch: &Value) -> CliResult<Answer> {
    let req = api
        .request(Method::PATCH, &format!("{}/settings", path(name)))
        .header("content-type", "application/merge-patch+json")
        .body(patch.to_string());
    api.send(req).await
}

fn print_settings(json_out: bool, prompt: &Value) {
    if json_out {
        print_json(&prompt["settings"]);
    } else if let Some(settings) = prompt["settings"].as_object() {
        for (k, v) in settings {
            println!("{k}: {}", if v.is_array() { v.to_string() } else { cell(v) });
        }
    }
}

/// Adds or removes pinned bullet ids (read, change, write back).
async fn pins(api: &ApiClient, json_out: bool, name: &str, bullets: &[String], pin: bool) -> CliResult<()> {
    let current = patch_settings(api, name, &json!({})).await?;
    let mut pinned: Vec<String> = current.body["settings"]["pinned_bullets"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    for b in bullets {
        let b = b.trim().to_owned();
        if pin && !pinned.contains(&b) {
            pinned.push(b);
        } else if !pin {
            pinned.retain(|p| p != &b);
        }
    }
    let answer = patch_settings(api, name, &json!({ "pinned_bullets": pinned })).await?;
    if json_out {
        print_json(&answer.body["settings"]);
    } else {
        println!("pinned: {}", answer.body["settings"]["pinned_bullets"]);
    }
    Ok(())
}

fn path(name: &str) -> String {
    format!("/v1/prompts/{}", encode(name))
}

async fn list(api: &ApiClient, json_out: bool) -> CliResult<()> {
    let prompts = api.get_all("/v1/prompts", "prompts").await?;
    if json_out {
        print_json(&json!({ "prompts": prompts }));
        return Ok(());
    }
    let rows: Vec<Vec<String>> = prompts
        .iter()
        .map(|p| {
            vec![
                cell(&p["name"]),
                cell(&p["project"]),
                cell(&p["strategy"]),
                cell(&p["promotion"]),
                cell(&p["production_version"]),
                cell(&p["latest_version"]),
                cell(&p["pending_traces"]),
                when(&p["created_at"]),
            ]
        })
        .collect();
    print_table(&["NAME", "PROJECT", "STRATEGY", "PROMOTION", "PRODUCTION", "LATEST", "PENDING", "CREATED"], &rows);
    Ok(())
}

async fn show(
    api: &ApiClient,
    json_out: bool,
    name: &str,
    label: Option<String>,
    version: Option<i64>,
) -> CliResult<()> {
    let query = match (label, version) {
        (_, Some(v)) => format!("?version={v}"),
        (Some(l), None) => format!("?label={}", encode(&l)),
        (None, None) => String::new(),
    };
    let answer = api.get(&format!("{}{query}", path(name))).await?;
    if json_out {
        print_json(&answer.body);
        return Ok(());
    }
    let b = &answer.body;
    println!("prompt:  {}", cell(&b["name"]));
    println!("version: {}", cell(&b["version"]));
    println!("labels:  {}", labels(&b["labels"]));
    println!("source:  {}", cell(&b["source"]));
    println!("created: {}", when(&b["created_at"]));
    println!("etag:    {}", answer.header("etag").unwrap_or("-"));
    println!();
    println!("{}", b["text"].as_str().unwrap_or_default());
    Ok(())
}

fn labels(v: &Value) -> String {
    let names: Vec<&str> = v.as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    if names.is_empty() { "-".to_owned() } else { names.join(",") }
}

async fn history(api: &ApiClient, json_out: bool, name: &str) -> CliResult<()> {
    let versions = api.get_all(&format!("{}/versions", path(name)), "versions").await?;
    if json_out {
        print_json(&json!({ "versions": versions }));
        return Ok(());
    }
    let label_list = api.get(&format!("{}/labels", path(name))).await?.body;
    let labels_of = |n: &Value| -> String {
        let names: Vec<&str> = label_list["labels"]
            .as_array()
            .map(|a| a.iter().filter(|l| &l["version"] == n).filter_map(|l| l["name"].as_str()).collect())
            .unwrap_or_default();
        if names.is_empty() { "-".to_owned() } else { names.join(",") }
    };
    let rows: Vec<Vec<String>> = versions
        .iter()
        .map(|v| {
            vec![
                cell(&v["number"]),
                cell(&v["parent"]),
                cell(&v["source"]),
                labels_of(&v["number"]),
                when(&v["created_at"]),
                cell(&v["created_by"]),
                cell(&v["message"]).lines().next().unwrap_or_default().to_owned(),
            ]
        })
        .collect();
    print_table(&["VERSION", "PARENT", "SOURCE", "LABELS", "CREATED", "BY", "MESSAGE"], &rows);
    Ok(())
}

async fn label_history(api: &ApiClient, json_out: bool, name: &str, label: Option<&str>) -> CliResult<()> {
    let filter = label.map(|l| format!("?label={}", encode(l))).unwrap_or_default();
    let moves = api.get_all(&format!("{}/labels/history{filter}", path(name)), "moves").await?;
    if json_out {
        print_json(&json!({ "moves": moves }));
        return Ok(());
    }
    let version = |v: &Value| if v.is_null() { "-".to_owned() } else { format!("v{}", cell(v)) };
    let rows: Vec<Vec<String>> = moves
        .iter()
        .map(|m| {
            vec![
                when(&m["at"]),
                cell(&m["label"]),
                format!("{} -> {}", version(&m["from_version"]), version(&m["to_version"])),
                cell(&m["kind"]),
                cell(&m["actor"]),
                cell(&m["reason"]).lines().next().unwrap_or_default().to_owned(),
            ]
        })
        .collect();
    print_table(&["AT", "LABEL", "MOVE", "KIND", "BY", "REASON"], &rows);
    Ok(())
}

async fn diff(api: &ApiClient, json_out: bool, name: &str, from: i64, to: i64) -> CliResult<()> {
    let b = api.get(&format!("{}/diff?from={from}&to={to}", path(name))).await?.body;
    if json_out {
        print_json(&b);
        return Ok(());
    }
    let unified = b["unified"].as_str().unwrap_or_default();
    if unified.is_empty() {
        println!("v{from} and v{to} render the same text");
    } else {
        print!("{unified}");
        if !unified.ends_with('\n') {
            println!();
        }
    }
    if let Some(pb) = b["playbook"].as_object() {
        let count = |k: &str| pb.get(k).and_then(Value::as_array).map_or(0, Vec::len);
        println!("playbook: {} added, {} removed, {} changed", count("added"), count("removed"), count("changed"));
        for (sign, key) in [("+", "added"), ("-", "removed")] {
            for bullet in pb.get(key).and_then(Value::as_array).into_iter().flatten() {
                println!(
                    "  {sign} [{}] {}: {}",
                    cell(&bullet["id"]),
                    cell(&bullet["section"]),
                    cell(&bullet["content"])
                );
            }
        }
    }
    Ok(())
}

/// The ETag of `GET /v1/prompts/{name}?label=…`, or `None` when the label does not exist yet.
async fn current_etag(api: &ApiClient, name: &str, label: &str) -> CliResult<Option<String>> {
    // The label list tells a missing prompt (404) from a missing label (absent).
    let list = api.get(&format!("{}/labels", path(name))).await?.body;
    let exists = list["labels"].as_array().is_some_and(|a| a.iter().any(|l| l["name"] == label));
    if !exists {
        return Ok(None);
    }
    let answer = api.get(&format!("{}?label={}", path(name), encode(label))).await?;
    Ok(answer.header("etag").map(str::to_owned))
}

/// Turns a 412 into a message that says what to do about it.
fn explain_412(e: CliError, what: &str) -> CliError {
    if e.status.is_some_and(|s| s.as_u16() == 412) {
        CliError { message: format!("{what} moved since it was read; nothing changed: {}", e.message), ..e }
    } else {
        e
    }
}

async fn promote(
    api: &ApiClient,
    json_out: bool,
    name: &str,
    version: i64,
    label: &str,
    if_match: Option<String>,
    reason: Option<String>,
) -> CliResult<()> {
    let etag = match if_match {
        Some(t) => Some(t),
        None => current_etag(api, name, label).await?,
    };
    let mut req = api.request(Method::PUT, &format!("{}/labels/{}", path(name), encode(label)));
    if let Some(t) = &etag {
        req = req.header("if-match", t);
    }
    let mut body = json!({ "version": version });
    if let Some(r) = reason {
        body["reason"] = json!(r);
    }
    let answer: Answer = api.send(req.json(&body)).await.map_err(|e| explain_412(e, &format!("label {label:?}")))?;
    if json_out {
        print_json(&answer.body);
    } else {
        println!("{name}: {label} -> v{}", cell(&answer.body["version"]));
        println!("etag: {}", cell(&answer.body["etag"]));
    }
    Ok(())
}

async fn rollback(
    api: &ApiClient,
    json_out: bool,
    name: &str,
    version: i64,
    message: Option<String>,
    if_match: Option<String>,
) -> CliResult<()> {
    let etag = match if_match {
        Some(t) => Some(t),
        None => current_etag(api, name, "production").await?,
    };
    let mut body = json!({ "to": version });
    if let Some(m) = message {
        body["message"] = Value::String(m);
    }
    let mut req = api.request(Method::POST, &format!("{}/rollback", path(name)));
    if let Some(t) = &etag {
        req = req.header("if-match", t);
    }
    let answer = api.send(req.json(&body)).await.map_err(|e| explain_412(e, "label \"production\""))?;
    if json_out {
        print_json(&answer.body);
    } else {
        println!("{name}: v{} has v{version}'s content and is production now", cell(&answer.body["number"]));
        println!("etag: {}", answer.header("etag").unwrap_or("-"));
    }
    Ok(())
}
