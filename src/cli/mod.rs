//! The `combee` command line: `serve`, `migrate`, and key administration on
//! the store; and the operator client (`prompts`, `traces`, `rounds`) that
//! talks to a running server over its API. Parsing lives here so `main`
//! stays a few lines.

pub mod audit;
pub mod client;
pub mod evaluators;
pub mod export;
pub mod members;
pub mod projects;
pub mod prompts;
pub mod prune;
pub mod regression;
pub mod rounds;
pub mod traces;

use std::{net::SocketAddr, path::PathBuf};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::{
    app::{self, Application},
    config::{ProcessRole, Settings},
    domain::{
        access::{ApiKey, Reach, Scope},
        audit::{NewAuditEntry, RequestOrigin},
    },
    service::{self, ServiceError},
    telemetry,
};

/// The exit codes of the client commands, shown in `--help`.
pub const EXIT_CODES: &str = "\
Exit codes (prompts, traces, rounds, audit):
  0  ok
  1  usage or local error (bad arguments, unreadable file)
  2  not found (HTTP 404)
  3  authentication: no key, or HTTP 401/403
  4  conflict or precondition failed (HTTP 409/412)
  5  invalid input (other HTTP 4xx), or import lines that failed
  6  server or network error (HTTP 5xx, unreachable)

Client commands take the server from --url or $COMBEE_URL and the API key from
$COMBEE_API_KEY or --api-key-file PATH (never from a flag value; never printed).";

#[derive(Debug, Parser)]
#[command(name = "combee", version, about = "Learns better system prompts for deployed LLM agents from their traces", after_help = EXIT_CODES)]
pub struct Cli {
    /// Directory holding default.toml and <COMBEE_ENV>.toml.
    #[arg(long, env = "COMBEE_CONFIG_DIR", default_value = "config", global = true)]
    pub config_dir: PathBuf,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the service: the HTTP API and web UI, and the background workers (learning rounds, webhook
    /// deliveries, the regression guard, the population rater); `--role` picks which parts run.
    Serve(ServeArgs),
    /// Apply database migrations and exit.
    Migrate,
    /// Print the effective configuration after all layers (secrets redacted).
    Config,
    /// Exit 0 when the server at URL answers /readyz (for container health checks).
    Health {
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
    },
    /// Manage API keys directly in the store.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Manage people's explicit web UI grants (single sign-on) directly in the store.
    #[command(subcommand)]
    Members(members::MembersCommand),
    /// Delete what expired under `[retention]` and the prompts' own retention, once, directly in
    /// the store (worker processes do this every `retention.interval_secs`); `--dry-run` only says
    /// what would go.
    Prune(prune::PruneArgs),
    /// Run the OpenAI-compatible LLM simulator used by tests and benchmarks (a simulation, not a model).
    SimLlm(crate::simulation::llm::SimArgs),
    /// Run the simulated agent world against a running server (a simulation, not agents): agents fetch
    /// the prompt, succeed more often when it holds their task's lesson, and post traces with rewards;
    /// prints the success rate per window.
    #[command(after_help = EXIT_CODES)]
    SimWorld {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(flatten)]
        world: crate::simulation::world::WorldConfig,
    },
    /// Prompts on a running server: list, show, history, label history, diff, promote, rollback, settings, pin, unpin.
    #[command(after_help = EXIT_CODES)]
    Prompts {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(subcommand)]
        command: prompts::PromptsCommand,
    },
    /// Traces on a running server: import a JSON Lines file, requeue failed traces, quarantine, release, delete, export a dataset.
    #[command(after_help = EXIT_CODES)]
    Traces {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(subcommand)]
        command: traces::TracesCommand,
    },
    /// The audit log of a running server (admin key): who changed what, when, from where; newest first.
    #[command(after_help = EXIT_CODES)]
    Audit {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(flatten)]
        args: audit::AuditArgs,
    },
    /// Regression sets on a running server: import cases (JSON Lines, OpenAI Evals samples, trace exports), list, delete, show a version's gate.
    #[command(after_help = EXIT_CODES)]
    Regression {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(subcommand)]
        command: regression::RegressionCommand,
    },
    /// A prompt's evaluators on a running server: get, set, calibrate.
    #[command(after_help = EXIT_CODES)]
    Evaluators {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(subcommand)]
        command: evaluators::EvaluatorsCommand,
    },
    /// Projects on a running server: list, create, show, set settings.
    #[command(after_help = EXIT_CODES)]
    Projects {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(subcommand)]
        command: projects::ProjectsCommand,
    },
    /// Learning rounds on a running server: trigger, list, show.
    #[command(after_help = EXIT_CODES)]
    Rounds {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(subcommand)]
        command: rounds::RoundsCommand,
    },
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on [default: server.bind, 127.0.0.1:8080].
    #[arg(long)]
    pub bind: Option<SocketAddr>,
    /// Which parts to run in this process [default: server.role, all].
    #[arg(long, value_enum)]
    pub role: Option<ProcessRole>,
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a key and print it (once).
    Create {
        /// A name to recognise the key by.
        #[arg(long, default_value = "cli")]
        name: String,
        /// Comma-separated scopes: traces:write, prompts:read, prompts:write, prompts:promote, rounds:trigger, admin.
        #[arg(long, value_delimiter = ',', required = true)]
        scopes: Vec<String>,
        /// The project the key acts in (it sees only that project's prompts);
        /// without it the key is server-wide.
        #[arg(long)]
        project: Option<String>,
    },
    /// List keys (never their secrets).
    List,
    /// Revoke a key by id or visible prefix.
    Revoke { id: String },
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    // The client commands need no server configuration, only a URL and a key.
    let command = match cli.command {
        Command::Prompts { client, command } => {
            let api = client::ApiClient::new(&client)?;
            return Ok(prompts::run(&api, client.json, command).await?);
        }
        Command::Traces { client, command } => {
            let api = client::ApiClient::new(&client)?;
            return Ok(traces::run(&api, client.json, command).await?);
        }
        Command::Regression { client, command } => {
            let api = client::ApiClient::new(&client)?;
            return Ok(regression::run(&api, client.json, command).await?);
        }
        Command::Rounds { client, command } => {
            let api = client::ApiClient::new(&client)?;
            return Ok(rounds::run(&api, client.json, command).await?);
        }
        Command::Audit { client, args } => {
            let api = client::ApiClient::new(&client)?;
            return Ok(audit::run(&api, client.json, args).await?);
        }
        Command::Evaluators { client, command } => {
            let api = client::ApiClient::new(&client)?;
            return Ok(evaluators::run(&api, client.json, command).await?);
        }
        Command::Projects { client, command } => {
            let api = client::ApiClient::new(&client)?;
            return Ok(projects::run(&api, client.json, command).await?);
        }
        Command::SimWorld { client, world } => return sim_world(&client, world).await,
        other => other,
    };
    let mut settings = Settings::load(&cli.config_dir)?;
    match command {
        Command::Serve(args) => {
            if let Some(bind) = args.bind {
                settings.server.bind = bind;
            }
            if let Some(role) = args.role {
                settings.server.role = role;
            }
            telemetry::init_logging(&settings.log);
            Application::build(settings).await?.run_until_stopped().await
        }
        Command::Migrate => {
            telemetry::init_logging(&settings.log);
            app::open_store(&settings).await?;
            println!("migrations are up to date");
            Ok(())
        }
        Command::Keys(cmd) => keys(settings, cmd).await,
        Command::Members(cmd) => members::run(settings, cmd).await,
        Command::Prune(args) => prune::run(settings, args).await,
        Command::Health { url } => {
            let res = reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs(3))
                .build()?
                .get(format!("{}/readyz", url.trim_end_matches('/')))
                .send()
                .await
                .context("server unreachable")?;
            anyhow::ensure!(res.status().is_success(), "not ready: HTTP {}", res.status());
            println!("ready");
            Ok(())
        }
        Command::Config => {
            println!("{settings:#?}");
            println!(
                "store: {}",
                if settings.database.url.is_empty() { "sqlite (embedded)" } else { "from database.url" }
            );
            Ok(())
        }
        Command::SimLlm(args) => {
            telemetry::init_logging(&settings.log);
            let listener = tokio::net::TcpListener::bind(&args.bind)
                .await
                .with_context(|| format!("cannot listen on {}", args.bind))?;
            eprintln!("combee sim-llm (simulated LLM) listening on {}", listener.local_addr()?);
            let shutdown = async {
                let _ = tokio::signal::ctrl_c().await;
            };
            crate::simulation::llm::serve_simulator(listener, args.sim, shutdown).await?;
            Ok(())
        }
        Command::Prompts { .. }
        | Command::Traces { .. }
        | Command::Rounds { .. }
        | Command::Audit { .. }
        | Command::Regression { .. }
        | Command::Evaluators { .. }
        | Command::Projects { .. }
        | Command::SimWorld { .. } => {
            unreachable!("client commands return above")
        }
    }
}

async fn sim_world(client: &client::ClientArgs, cfg: crate::simulation::world::WorldConfig) -> anyhow::Result<()> {
    use crate::simulation::world::{World, markdown};
    let (base, key) = client::url_and_key(client)?;
    let world = World::new(&base, key.expose(), cfg)?;
    let json = client.json;
    let report = world
        .run(|w| {
            if !json {
                eprintln!(
                    "window {}: {} runs, success rate {:.3}, lessons in production {}{}",
                    w.window,
                    w.runs,
                    w.success_rate,
                    w.lessons_in_prompt,
                    if w.harmful_in_prompt { ", harmful instruction in production" } else { "" }
                );
            }
        })
        .await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", markdown(&report));
    }
    Ok(())
}

async fn keys(settings: Settings, cmd: KeysCommand) -> anyhow::Result<()> {
    let st = service::AppState::build(app::open_store(&settings).await?, settings);
    match cmd {
        KeysCommand::Create { name, scopes, project } => {
            let scopes = scopes
                .iter()
                .map(|s| Scope::parse(s.trim()).with_context(|| format!("unknown scope {s:?}")))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let (key, secret) = service::keys::create(&st, &Reach::Server, &name, &scopes, project.as_deref()).await?;
            let entry = audit_entry("key.create", key.id, None, Some(&key)).in_project(key.project.clone());
            service::audit::record(&st.store, &entry).await;
            let reach = key.project.as_deref().map_or("server-wide".to_owned(), |p| format!("project {p}"));
            eprintln!("created key {} ({}) with scopes {:?}, {reach}", key.prefix, key.id, scopes_str(&key.scopes));
            println!("{secret}");
        }
        KeysCommand::List => {
            println!("{:<38} {:<14} {:<8} {:<20} {:<16} SCOPES", "ID", "PREFIX", "STATE", "NAME", "PROJECT");
            for k in service::keys::list(&st, &Reach::Server).await? {
                let state = if k.revoked_at.is_some() { "revoked" } else { "active" };
                let project = k.project.as_deref().unwrap_or("(server-wide)");
                println!(
                    "{:<38} {:<14} {:<8} {:<20} {:<16} {}",
                    k.id,
                    k.prefix,
                    state,
                    k.name,
                    project,
                    scopes_str(&k.scopes)
                );
            }
        }
        KeysCommand::Revoke { id } => {
            let key = match service::keys::revoke(&st, &Reach::Server, &id).await {
                Err(ServiceError::NotFound(_)) => anyhow::bail!("no active key with id or prefix {id:?}"),
                other => other?,
            };
            let entry = audit_entry("key.revoke", key.id, Some(&key), None).in_project(key.project.clone());
            service::audit::record(&st.store, &entry).await;
            println!("revoked {id}");
        }
    }
    Ok(())
}

/// The audit entry of a key change made on the command line, by its OS user.
fn audit_entry(action: &str, key: uuid::Uuid, before: Option<&ApiKey>, after: Option<&ApiKey>) -> NewAuditEntry {
    let value = |k: Option<&ApiKey>| k.and_then(|k| serde_json::to_value(k).ok());
    NewAuditEntry::new(
        service::audit::cli_actor(),
        RequestOrigin::default(),
        action,
        Some("key".into()),
        Some(key.to_string()),
        value(before),
        value(after),
    )
}

fn scopes_str(scopes: &[Scope]) -> String {
    scopes.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(",")
}
