//! The token bill of learning: the prompt and completion tokens of every LLM
//! call a configuration made, summed from what combee recorded of its calls
//! (each round's journal: the `usage` the backend reported), split by role so
//! the report can say where the tokens went — and checked against what the
//! simulator itself counted as served.

use std::fmt::Write as _;

use combee::llm::{LlmCall, LlmRole};

use crate::report::pass;
use crate::runs::{Family, RunRow};

/// Calls and their tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Tokens {
    pub(crate) calls: u64,
    pub(crate) prompt: u64,
    pub(crate) completion: u64,
}

impl Tokens {
    fn add(&mut self, c: &LlmCall) {
        self.calls += 1;
        self.prompt += c.prompt_tokens;
        self.completion += c.completion_tokens;
    }

    fn plus(self, o: Self) -> Self {
        Self { calls: self.calls + o.calls, prompt: self.prompt + o.prompt, completion: self.completion + o.completion }
    }

    /// Mean prompt tokens per call.
    fn prompt_per_call(self) -> f64 {
        self.prompt as f64 / self.calls.max(1) as f64
    }
}

/// The tokens of one configuration's calls over the whole backlog, by role.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Bill {
    pub(crate) reflector: Tokens,
    pub(crate) aggregator: Tokens,
}

impl Bill {
    /// Adds the calls one round recorded.
    pub(crate) fn add(&mut self, calls: &[LlmCall]) {
        for c in calls {
            match c.role {
                LlmRole::Reflector => self.reflector.add(c),
                // Rounds make no gate or judge calls (a regression gate runs after publication, a judge
                // before a round; either would be billed as the aggregator model's).
                LlmRole::Aggregator | LlmRole::Gate | LlmRole::Judge => self.aggregator.add(c),
            }
        }
    }

    pub(crate) fn total(&self) -> Tokens {
        self.reflector.plus(self.aggregator)
    }
}

/// Prompt and completion tokens the simulator at `base_url` (…/v1) has served so far, by its own count.
pub(crate) async fn served(base_url: &str) -> anyhow::Result<(u64, u64)> {
    let stats: combee::simulation::llm::SimStats =
        reqwest::get(format!("{base_url}/sim/stats")).await?.error_for_status()?.json().await?;
    Ok((stats.prompt_tokens, stats.completion_tokens))
}

/// A count with thousands separators.
pub(crate) fn thousands(v: u64) -> String {
    let s = v.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Tokens per trace of the backlog, with the total: `1,234 (370,200)`.
pub(crate) fn per_trace(total: u64, n: usize) -> String {
    format!("{} ({})", thousands((total as f64 / n.max(1) as f64).round() as u64), thousands(total))
}

/// A token-bill section: where the tokens of sequential, combee-auto, Combee
/// at fixed sizes and the tuned rows went, and the target on prompt tokens per
/// learned trace (with the ratio). `None` when sequential or combee-auto is missing.
pub(crate) fn bill_section(rows: &[RunRow], n: usize, title: &str) -> Option<(String, f64)> {
    let seq = rows.iter().find(|r| r.setup.family == Family::Sequential)?;
    let auto = rows.iter().find(|r| r.setup.family == Family::CombeeAuto)?;
    let seq_prompt = seq.result().bill.total().prompt as f64;
    let mut out = format!(
        "{title}, SIMULATED LLM\n\n\
         Tokens as the simulated LLM counts them (characters / 4, not a real tokenizer) and reports them in each \
         answer's `usage`, summed from the calls combee recorded in each round's journal; per trace = over the N = \
         {n} traces of the backlog; per kept insight = over the markers the final prompt kept. Both roles carry the \
         current prompt (base and playbook) in every call.\n\n\
         | configuration | reflector calls | prompt tokens per reflector call | aggregator calls | prompt tokens per \
         aggregator call | prompt tokens per trace | per kept insight | prompt tokens per trace vs sequential | \
         completion tokens per trace |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    for row in rows.iter().filter(|r| {
        matches!(
            r.setup.family,
            Family::Sequential | Family::CombeeAuto | Family::CombeeAutoTuned | Family::CombeeTuned | Family::Combee
        )
    }) {
        let r = row.result();
        let (b, t) = (r.bill, r.bill.total());
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {} | {:.0} | {:.0} | {:.0} | {:.2}× | {:.0} |",
            row.setup.label(),
            b.reflector.calls,
            b.reflector.prompt_per_call(),
            b.aggregator.calls,
            b.aggregator.prompt_per_call(),
            t.prompt as f64 / n as f64,
            t.prompt as f64 / r.kept.max(1) as f64,
            t.prompt as f64 / seq_prompt,
            t.completion as f64 / n as f64,
        );
    }
    let ratio = auto.result().bill.total().prompt as f64 / seq_prompt;
    let _ = writeln!(
        out,
        "\n- Combee-auto prompt tokens per learned trace {:.2}× sequential's (≤ 1.5×), at retention {:.1}% vs {:.1}%: {}",
        ratio,
        100.0 * auto.result().kept as f64 / n as f64,
        100.0 * seq.result().kept as f64 / n as f64,
        pass(ratio <= 1.5)
    );
    let served: Vec<_> = rows.iter().filter_map(|r| r.served.map(|s| (r, s))).collect();
    if !served.is_empty() {
        let agree = served.iter().all(|(r, s)| {
            let t = r.result().bill.total();
            *s == (t.prompt, t.completion)
        });
        let _ = writeln!(
            out,
            "- Combee's record of the calls against the simulator's own count of the tokens it served, over {} \
             measured runs: {}",
            served.len(),
            if agree { "equal in every run" } else { "DIFFERENT in at least one run" }
        );
    }
    Some((out, ratio))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use combee::{
        domain::{Method, VersionContent},
        llm::{client::OpenAiClient, config::LlmConfig},
        simulation::llm::{LocalSim, SimConfig},
    };

    use super::*;
    use crate::runs::{Env, Mode, Replay, Setup, Sizing, learn, traces};

    #[test]
    fn thousands_groups_digits_by_three() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_371_558), "1,371,558");
        assert_eq!(per_trace(1_000, 3), "333 (1,000)");
    }

    /// The bill is what combee recorded of its calls, and that is what the
    /// simulator (a real HTTP server on a port) counted as served.
    #[tokio::test]
    async fn the_bill_is_what_the_simulator_served() {
        let sim =
            SimConfig { fixed_ms: 0.0, per_input_token_ms: 0.0, per_output_token_ms: 0.0, ..SimConfig::default() };
        let local = LocalSim::start(sim.clone()).await.unwrap();
        let llm = LlmConfig { base_url: local.base_url.clone(), ..LlmConfig::default() };
        let (traces, _) = traces(12).unwrap();
        let env = Env {
            http: Arc::new(OpenAiClient::new(llm.clone()).unwrap()),
            replay: Arc::new(Replay { sim: sim.clone() }),
            llm,
            sim,
            base: VersionContent { base: "You are a test agent.".into(), playbook: None },
            traces,
        };
        let setups = [
            Setup { family: Family::Sequential, method: Method::Sequential, p: 1, sizing: Sizing::Fixed(3) },
            Setup { family: Family::Combee, method: Method::Combee, p: 2, sizing: Sizing::Fixed(12) },
        ];
        for setup in setups {
            let before = served(&local.base_url).await.unwrap();
            let r = learn(&env, Mode::Measured, &setup).await.unwrap();
            let after = served(&local.base_url).await.unwrap();
            let t = r.bill.total();
            assert_eq!((t.prompt, t.completion), (after.0 - before.0, after.1 - before.1), "{}", setup.label());
            assert_eq!(t.calls as usize, r.calls, "{}", setup.label());
            assert_eq!(r.bill.reflector.calls, 12, "{}: one reflection per trace", setup.label());
            assert!(r.bill.aggregator.calls > 0 && t.prompt > 0 && t.completion > 0, "{}", setup.label());
        }
    }
}
