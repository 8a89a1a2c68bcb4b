//! `--llama-url`: one round on a REAL MODEL's one-slot llama.cpp server, on
//! the product defaults, by a client whose store remembers this backend at a
//! concurrency limit far above what one slot serves (as if a larger server had
//! run at the same address and model): the round's first calls go out at
//! that limit, so this shows whether the limit comes down before any call
//! times out. Reported: every call's limit when it was sent, the attempts
//! retried (time-outs among them) and the limit kept afterwards.

use std::fmt::Write as _;
use std::time::Instant;

use combee::{
    domain::{Method, ReduceMode, Strategy, VersionContent},
    learn::{
        capacity::sizing::GroupSize,
        merge::budget::Budget,
        round::journal::MemoryJournal,
        round::{RoundSpec, run_round},
    },
    llm::{
        client::OpenAiClient,
        config::LlmConfig,
        remember::{BackendKey, LimitMemory},
    },
    service::llm_limits::StoreLimits,
    store,
};
use uuid::Uuid;

use crate::LearnArgs;
use crate::runs::traces;

pub(crate) async fn llama_round_section(args: &LearnArgs, url: &str) -> anyhow::Result<String> {
    let model = args.llama_model.clone();
    // The product defaults, but for where the backend is and what it serves.
    let llm = LlmConfig {
        base_url: url.to_owned(),
        reflector_model: model.clone(),
        aggregator_model: model.clone(),
        ..LlmConfig::default()
    }
    .with_env_fallbacks();
    let dir = tempfile::tempdir()?;
    let store = store::connect(
        &format!("sqlite://{}", dir.path().join("limits.db").display()),
        2,
        std::time::Duration::from_secs(10),
    )
    .await?;
    let limits = StoreLimits::new(store.clone());
    let key = BackendKey::of(&llm);
    limits.keep(&key, args.llama_remembered).await;
    let client = OpenAiClient::new(llm.clone())?.with_limit_memory(limits.clone());
    let (traces, _) = traces(args.llama_traces)?;
    let spec = RoundSpec {
        round_id: Uuid::now_v7(),
        seed: 1,
        method: Method::Combee,
        strategy: Strategy::Playbook,
        duplication: 2,
        reduce: ReduceMode::Union,
        budget: Budget::default(),
        agent_reflections: combee::domain::AgentReflections::Use,
        denylist: Default::default(),
        group_size: GroupSize::default(),
    };
    let base = VersionContent { base: "You are a support agent. Answer the task.".into(), playbook: None };
    let journal = MemoryJournal::new();
    eprintln!(
        "  REAL MODEL round: {} traces on {url} ({model}), the backend remembered at {} calls at once …",
        traces.len(),
        args.llama_remembered
    );
    let started = Instant::now();
    let outcome = run_round(&client, &llm, &spec, &base, &traces, &journal).await;
    let secs = started.elapsed().as_secs_f64();
    client.keep_limit_now().await;
    let kept = limits.recall(&key).await;
    let calls = journal.snapshot().calls;
    let retried = calls.iter().filter(|c| c.retries > 0).count();
    let timed_out = calls.iter().filter(|c| c.error.as_deref().is_some_and(|e| e.contains("timeout"))).count();
    let sent: Vec<String> = calls.iter().map(|c| c.concurrency_limit.map_or("-".into(), |l| l.to_string())).collect();
    let mut out = format!(
        "## A REAL MODEL's one-slot server, remembered larger (llama.cpp, {model})\n\n\
         One combee round of {} traces on the product defaults (`llm.request_timeout_secs` {}, `llm.max_retries` {}), \
         through a client whose store remembered this base URL and model at {} calls at once.\n\n",
        traces.len(),
        llm.request_timeout_secs,
        llm.max_retries,
        args.llama_remembered
    );
    let _ = writeln!(
        out,
        "| round | wall time | LLM calls | calls with a retried attempt | calls that failed on a time-out | limit at each call, in order | limit kept after |\n\
         | --- | --- | --- | --- | --- | --- | --- |\n\
         | {} | {secs:.0} s | {} | {retried} | {timed_out} | {} | {} |",
        match &outcome {
            Ok(_) => "succeeded".to_owned(),
            Err(e) => format!("failed: {e}"),
        },
        calls.len(),
        sent.join(", "),
        kept.map_or("-".into(), |k| k.to_string()),
    );
    Ok(out)
}
