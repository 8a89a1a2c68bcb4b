//! combee: a long-running service that learns better system prompts for
//! deployed LLM agents from the traces of their runs (Combee map–shuffle–reduce).

pub mod domain;
pub mod llm;
