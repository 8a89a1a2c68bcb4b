//! combee: a long-running service that learns better system prompts for
//! deployed LLM agents from the traces of their runs (Combee map–shuffle–reduce).

pub mod app;
pub mod auth;
pub mod cache;
pub mod cli;
pub mod config;
pub mod delivery;
pub mod domain;
pub mod evaluate;
pub mod http;
pub mod learn;
pub mod llm;
pub mod oidc;
pub mod otlp;
pub mod retry_after;
pub mod secret;
pub mod service;
pub mod simulation;
pub mod store;
pub mod telemetry;
pub mod ui;
pub mod webhooks;
pub mod worker;
