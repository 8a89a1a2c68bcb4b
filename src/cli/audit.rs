//! `combee audit`: the server's audit log, newest first, with the API's
//! filters (actor, action, resource, time), as a table or JSON; it follows
//! the pages up to `--limit` entries and says how to go on from there.

use clap::Args;
use serde_json::{Value, json};

use super::client::{ApiClient, CliResult, cell, encode, print_json, print_table, when};

#[derive(Debug, Args)]
pub struct AuditArgs {
    /// An API key's id, or an actor's name (a key's name, `retention`, an OS user).
    #[arg(long)]
    pub actor: Option<String>,
    /// e.g. key.create, label.move, retention.run.
    #[arg(long)]
    pub action: Option<String>,
    /// e.g. prompt, label, version, key, webhook, trace, round.
    #[arg(long)]
    pub resource_type: Option<String>,
    #[arg(long)]
    pub resource_id: Option<String>,
    /// RFC 3339: entries at or after it.
    #[arg(long)]
    pub since: Option<String>,
    /// RFC 3339: entries before it.
    #[arg(long)]
    pub until: Option<String>,
    /// Most entries to print.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub limit: u32,
    /// Go on from a `next_page_token` an earlier run printed.
    #[arg(long)]
    pub page_token: Option<String>,
}

pub async fn run(api: &ApiClient, json_out: bool, args: AuditArgs) -> CliResult<()> {
    let mut query = String::new();
    for (name, value) in [
        ("actor", &args.actor),
        ("action", &args.action),
        ("resource_type", &args.resource_type),
        ("resource_id", &args.resource_id),
        ("since", &args.since),
        ("until", &args.until),
    ] {
        if let Some(v) = value {
            query.push_str(&format!("&{name}={}", encode(v)));
        }
    }
    let mut entries: Vec<Value> = Vec::new();
    let mut token = args.page_token.clone();
    let limit = args.limit as usize;
    loop {
        let size = (limit - entries.len()).min(200);
        let mut url = format!("/v1/audit?page_size={size}{query}");
        if let Some(t) = &token {
            url.push_str(&format!("&page_token={}", encode(t)));
        }
        let mut page = api.get(&url).await?.body;
        if let Some(Value::Array(more)) = page.get_mut("entries").map(Value::take) {
            entries.extend(more);
        }
        token = page.get("next_page_token").and_then(Value::as_str).map(str::to_owned);
        if token.is_none() || entries.len() >= limit {
            break;
        }
    }
    if json_out {
        print_json(&json!({ "entries": entries, "next_page_token": token }));
        return Ok(());
    }
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            let resource = match (e["resource_type"].as_str(), e["resource_id"].as_str()) {
                (Some(t), Some(id)) => format!("{t} {id}"),
                (Some(t), None) => t.to_owned(),
                _ => "-".to_owned(),
            };
            let route = match (e["method"].as_str(), e["route"].as_str()) {
                (Some(m), Some(r)) => format!("{m} {r}"),
                _ => "-".to_owned(),
            };
            vec![
                cell(&e["id"]),
                when(&e["at"]),
                format!("{}:{}", cell(&e["actor_type"]), cell(&e["actor_name"])),
                cell(&e["action"]),
                resource,
                route,
                cell(&e["client_addr"]),
            ]
        })
        .collect();
    print_table(&["ID", "AT", "ACTOR", "ACTION", "RESOURCE", "ROUTE", "FROM"], &rows);
    if let Some(t) = token {
        eprintln!("more entries: --page-token {t}");
    }
    Ok(())
}
