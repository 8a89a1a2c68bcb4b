//! What a run is and what it produced: the configurations compared, each
//! run's rounds, retention and token bill, a row of the report. The runs
//! (`runs.rs` and the sections that drive it) fill them in; the report
//! (`report.rs`, `bill.rs`, `figure.rs`) reads them; neither imports the other.

use combee::{
    domain::{Method, VersionContent},
    learn::capacity::batch_size::ControllerConfig,
    llm::{LlmCall, LlmRole},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    Sequential,
    SequentialOneRound,
    Naive,
    Combee,
    CombeeTuned,
    CombeeAuto,
    /// Combee-auto again, right after combee-auto in the same process: the LLM
    /// client's concurrency limit is where the first large round left it, as in
    /// a service that has been running (the first pays the limit's ramp).
    CombeeAutoWarm,
    /// Combee-auto through a new client (a new process's) whose concurrency
    /// limit resumed from what the first client kept in the store: a backend
    /// seen before, the new process's first large round.
    CombeeAutoResumed,
    /// Combee-auto at p = 1: a tuned setting (one copy of each reflection, half the aggregator calls).
    CombeeAutoTuned,
}

impl Family {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Sequential => "sequential",
            Self::SequentialOneRound => "sequential, one round",
            Self::Naive => "naive",
            Self::Combee => "combee",
            Self::CombeeTuned => "combee p=1 (tuned)",
            Self::CombeeAuto => "combee-auto",
            Self::CombeeAutoWarm => "combee-auto, warm client",
            Self::CombeeAutoResumed => "combee-auto, new process, backend seen before",
            Self::CombeeAutoTuned => "combee-auto p=1 (tuned)",
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) enum Sizing {
    Fixed(usize),
    Auto(ControllerConfig),
}

#[derive(Debug, Clone)]
pub(crate) struct Setup {
    pub(crate) family: Family,
    pub(crate) method: Method,
    pub(crate) p: u32,
    pub(crate) sizing: Sizing,
}

impl Setup {
    pub(crate) fn label(&self) -> String {
        match (&self.sizing, self.family) {
            (Sizing::Fixed(bs), Family::Sequential) => format!("sequential (rounds of {bs})"),
            (Sizing::Fixed(bs), Family::Naive | Family::Combee | Family::CombeeTuned) => {
                format!("{} bs={bs}", self.family.name())
            }
            _ => self.family.name().to_owned(),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct RoundLog {
    pub(crate) bs: usize,
    pub(crate) secs: f64,
    pub(crate) reason: Option<String>,
}

#[derive(Debug, Clone)]
pub(crate) struct RunResult {
    pub(crate) rounds: Vec<RoundLog>,
    pub(crate) total_secs: f64,
    pub(crate) kept: usize,
    pub(crate) calls: usize,
    /// Combee-auto: the largest batch it took.
    pub(crate) largest: Option<u32>,
    /// Bytes of the largest round's record (outcome and group outputs, as JSON).
    pub(crate) largest_record: usize,
    /// Tokens of every call, as combee recorded them in the rounds' journals.
    pub(crate) bill: Bill,
    /// The prompt the last round published.
    pub(crate) content: VersionContent,
}

pub(crate) struct RunRow {
    pub(crate) setup: Setup,
    pub(crate) measured: Option<RunResult>,
    pub(crate) modelled: RunResult,
    /// Prompt and completion tokens the simulator counted as served during the measured run.
    pub(crate) served: Option<(u64, u64)>,
}

impl RunRow {
    pub(crate) fn result(&self) -> &RunResult {
        self.measured.as_ref().unwrap_or(&self.modelled)
    }
}

/// Calls and their tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Tokens {
    pub(crate) calls: u64,
    pub(crate) prompt: u64,
    pub(crate) completion: u64,
}

impl Tokens {
    pub(crate) fn add(&mut self, c: &LlmCall) {
        self.calls += 1;
        self.prompt += c.prompt_tokens;
        self.completion += c.completion_tokens;
    }

    pub(crate) fn plus(self, o: Self) -> Self {
        Self { calls: self.calls + o.calls, prompt: self.prompt + o.prompt, completion: self.completion + o.completion }
    }

    /// Mean prompt tokens per call.
    pub(crate) fn prompt_per_call(self) -> f64 {
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
