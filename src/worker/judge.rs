//! The judging worker: scores pending traces of prompts that have
//! evaluators, after they arrive and before a round reserves them (rounds
//! wait for it up to `worker.judge_wait_secs`). Code checks run here; an LLM
//! judge asks the configured model. Their combined verdict becomes the
//! trace's feedback only when the agent sent no reward (the agent's score
//! wins, and its late feedback replaces a judged one); every verdict is kept
//! on the trace as calibration data. A judge that fails leaves no score.

use std::{sync::Arc, time::Duration};

use futures_util::{StreamExt, stream};
use tokio_util::sync::CancellationToken;

use crate::{
    evaluate::{
        checks::reply_text,
        evaluators::{self, CompiledEvaluator, Judgement},
    },
    learn::judge,
    llm::{
        LlmBackend, LlmCall,
        config::LlmConfig,
        meter::{CallTag, Tagged},
    },
    store::{DynStore, JudgedFeedback, JudgedTrace, StoreResult, Unjudged},
};

/// Traces read per pass.
const BATCH: u32 = 64;
/// Traces judged at once (LLM judges wait on the model; the client's own
/// concurrency limit still applies).
const PARALLEL: usize = 8;

/// Judges pending traces, on its own loop beside the learning worker.
#[derive(Clone)]
pub struct TraceJudge {
    store: DynStore,
    /// The LLM the `judge` evaluators ask; without one they fail (unjudged).
    llm: Option<(Arc<dyn LlmBackend>, Arc<LlmConfig>)>,
    poll: Duration,
    /// How long a claimed batch is this process's to judge.
    lease: Duration,
}

impl TraceJudge {
    pub fn new(
        store: DynStore,
        llm: Option<(Arc<dyn LlmBackend>, LlmConfig)>,
        poll: Duration,
        lease: Duration,
    ) -> Self {
        Self { store, llm: llm.map(|(b, c)| (b, Arc::new(c))), poll, lease }
    }

    /// Judges until `shutdown`: a full batch is followed at once by the next.
    pub async fn run(self, shutdown: CancellationToken) {
        loop {
            let judged = match self.judge_pending().await {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e, "judging traces failed");
                    0
                }
            };
            if judged as u32 >= BATCH {
                continue;
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(self.poll) => {}
            }
        }
    }

    /// One pass: claims up to a batch of unjudged pending traces (other
    /// processes judge other batches) and judges them; how many were judged
    /// (each recorded once, even when a claim ran out and another process
    /// judged beside it).
    pub async fn judge_pending(&self) -> StoreResult<usize> {
        let traces = self.store.claim_unjudged(self.lease, BATCH).await?;
        let n = traces.len();
        let judged: Vec<JudgedTrace> =
            stream::iter(traces).map(|t| self.judge_one(t)).buffer_unordered(PARALLEL).collect().await;
        self.store.save_judgements(&judged).await?;
        Ok(n)
    }

    async fn judge_one(&self, t: Unjudged) -> JudgedTrace {
        let judgements = match evaluators::compile(&t.evaluators) {
            Ok(list) => {
                let mut out = Vec::with_capacity(list.len());
                for e in &list {
                    out.push(self.run_one(e, &t).await);
                }
                out
            }
            Err(why) => vec![Judgement::failed("evaluators", format!("the evaluators do not compile: {why}"))],
        };
        for j in &judgements {
            let outcome = if j.score.is_some() { "scored" } else { "failed" };
            metrics::counter!("combee_judgements_total", "outcome" => outcome).increment(1);
        }
        let feedback =
            evaluators::combine(&judgements).map(|(score, critique, by)| JudgedFeedback { score, critique, by });
        JudgedTrace { id: t.id, judgements, feedback }
    }

    async fn run_one(&self, e: &CompiledEvaluator, t: &Unjudged) -> Judgement {
        if let Some(j) = evaluators::run_checks(e, &t.output, &t.metadata) {
            return j;
        }
        let CompiledEvaluator::Judge { name, rubric } = e else {
            return Judgement::failed(e.name(), "unknown evaluator kind");
        };
        let Some((backend, cfg)) = &self.llm else {
            return Judgement::failed(name, "no LLM is configured for the judge");
        };
        let mut calls: Vec<LlmCall> = Vec::new();
        let reply = reply_text(&t.output);
        // The judge's calls count in the prompt's learning budget.
        let tagged = Tagged::new(backend.clone(), CallTag::prompt(&t.prompt.qualified(), "judge"));
        let j = judge::judge(&tagged, cfg, name, rubric, &t.input, &reply, &mut calls).await;
        for call in &calls {
            let outcome = if call.error.is_some() { "failed" } else { "ok" };
            metrics::counter!("combee_judge_llm_calls_total", "outcome" => outcome).increment(1);
            metrics::counter!("combee_judge_llm_tokens_total").increment(call.prompt_tokens + call.completion_tokens);
        }
        if let Some(why) = &j.error {
            tracing::warn!(trace = %t.id, prompt = %t.prompt, evaluator = %name, error = %why, "judge failed");
        }
        j
    }
}
