//! combee's integration tests, as ONE test binary: each binary links the whole
//! crate and its dependencies, so one binary instead of one per file saves
//! most of a test build's link time. Each file is a module; nextest still runs
//! every test in its own process. Shared fixtures are in `common`.

#[macro_use]
mod common;

mod api;
mod audit;
mod authorization;
mod budget;
mod cli;
mod cli_client;
mod durability;
mod evaluators;
mod export;
mod key_revocation;
mod langfuse;
mod learning;
mod lifecycle;
mod llm_limits;
mod otlp;
mod otlp_logs;
mod poisoning;
mod pooler;
mod population;
mod postgres_outage;
mod postgres_processes;
mod projects;
mod prompt_names;
mod real_model;
mod regression;
mod request_rules;
mod sso;
mod steady_traffic;
mod store_contract;
mod ui_browser;
mod upgrade;
mod webhooks;
mod world;
