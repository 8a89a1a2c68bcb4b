//! A prompt's evaluators: how combee scores a trace no one scored. Each is
//! named and of one kind: `checks` (code checks, [`super::checks`]: the share
//! passed, the failed ones' critiques) or `judge` (an LLM with the operator's
//! rubric). The list is the operator's (validated here, at the edge); the
//! judgement of one trace, and how several evaluators' judgements make one
//! reward, are pure functions the judging worker calls.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::checks::{self, Check, CompiledCheck};

/// Most evaluators one prompt may have.
pub const MAX_EVALUATORS: usize = 8;
/// Most checks one `checks` evaluator may hold.
pub const MAX_CHECKS: usize = 32;
/// Longest judge rubric, in bytes.
pub const MAX_RUBRIC_BYTES: usize = 8_192;
/// Largest evaluator list, as encoded JSON, in bytes.
pub const MAX_EVALUATORS_BYTES: usize = 262_144;
/// Longest critique kept from one evaluator, in characters.
pub const MAX_CRITIQUE_CHARS: usize = 2_000;

/// One evaluator, as the operator writes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Evaluator {
    /// Code checks: score = the share of applicable checks passed; critique =
    /// the failed checks' critiques.
    Checks {
        /// `[a-z0-9][a-z0-9._-]{0,63}`, unique within the prompt.
        #[schema(pattern = r"^[a-z0-9][a-z0-9._-]{0,63}$")]
        name: String,
        #[schema(min_items = 1, max_items = 32)]
        checks: Vec<Check>,
    },
    /// An LLM judge: the configured model reads the rubric, the input and the
    /// reply and answers a score in [0, 1] and a critique.
    Judge {
        /// `[a-z0-9][a-z0-9._-]{0,63}`, unique within the prompt.
        #[schema(pattern = r"^[a-z0-9][a-z0-9._-]{0,63}$")]
        name: String,
        /// What a good reply is, in the operator's words (at most 8,192 bytes).
        #[schema(min_length = 1, max_length = 8192, pattern = r"\S")]
        rubric: String,
    },
}

impl Evaluator {
    pub fn name(&self) -> &str {
        match self {
            Self::Checks { name, .. } | Self::Judge { name, .. } => name,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Self::Checks { .. } => "checks",
            Self::Judge { .. } => "judge",
        }
    }
}

/// An evaluator whose checks compiled, ready to judge many traces.
#[derive(Debug)]
pub enum CompiledEvaluator {
    Checks { name: String, checks: Vec<CompiledCheck> },
    Judge { name: String, rubric: String },
}

impl CompiledEvaluator {
    pub fn name(&self) -> &str {
        match self {
            Self::Checks { name, .. } | Self::Judge { name, .. } => name,
        }
    }
}

fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'.' | b'_' | b'-'))
}

/// Validates an operator's evaluator list as a whole; the error says what is
/// wrong (and where) in words fit for a 422.
pub fn compile(list: &[Evaluator]) -> Result<Vec<CompiledEvaluator>, String> {
    if list.len() > MAX_EVALUATORS {
        return Err(format!("{} evaluators; a prompt may have at most {MAX_EVALUATORS}", list.len()));
    }
    let bytes = serde_json::to_vec(list).map(|v| v.len()).unwrap_or(usize::MAX);
    if bytes > MAX_EVALUATORS_BYTES {
        return Err(format!("the evaluators are {bytes} bytes; the limit is {MAX_EVALUATORS_BYTES}"));
    }
    let mut out: Vec<CompiledEvaluator> = Vec::with_capacity(list.len());
    for (i, e) in list.iter().enumerate() {
        let name = e.name();
        if !valid_name(name) {
            return Err(format!("`evaluators[{i}].name` {name:?} must match [a-z0-9][a-z0-9._-]{{0,63}}"));
        }
        if out.iter().any(|o| o.name() == name) {
            return Err(format!("`evaluators[{i}].name` {name:?} is used twice"));
        }
        out.push(match e {
            Evaluator::Checks { checks, .. } => {
                if checks.is_empty() || checks.len() > MAX_CHECKS {
                    return Err(format!(
                        "`evaluators[{i}].checks` must hold 1 to {MAX_CHECKS} checks (it has {})",
                        checks.len()
                    ));
                }
                let compiled = checks
                    .iter()
                    .enumerate()
                    .map(|(j, c)| c.clone().compile().map_err(|e| format!("`evaluators[{i}].checks[{j}]`: {e}")))
                    .collect::<Result<Vec<_>, _>>()?;
                CompiledEvaluator::Checks { name: name.to_string(), checks: compiled }
            }
            Evaluator::Judge { rubric, .. } => {
                if rubric.trim().is_empty() {
                    return Err(format!("`evaluators[{i}].rubric` must not be empty"));
                }
                if rubric.len() > MAX_RUBRIC_BYTES {
                    return Err(format!(
                        "`evaluators[{i}].rubric` is {} bytes; the limit is {MAX_RUBRIC_BYTES}",
                        rubric.len()
                    ));
                }
                CompiledEvaluator::Judge { name: name.to_string(), rubric: rubric.clone() }
            }
        });
    }
    Ok(out)
}

/// One evaluator's verdict on one trace: a score in [0, 1] and what went
/// wrong, or why it could not judge (never a made-up score).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Judgement {
    pub evaluator: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub critique: Option<String>,
    /// Why there is no score: the judge failed, refused, or no check applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Judgement {
    pub fn failed(evaluator: &str, why: impl Into<String>) -> Self {
        Self { evaluator: evaluator.to_string(), score: None, critique: None, error: Some(why.into()) }
    }

    /// A score, clamped into [0, 1], with its critique (cut to
    /// [`MAX_CRITIQUE_CHARS`]); a score that is not a number is a failure.
    pub fn scored(evaluator: &str, score: f64, critique: &str) -> Self {
        if !score.is_finite() {
            return Self::failed(evaluator, "the score is not a finite number");
        }
        let critique: String = critique.trim().chars().take(MAX_CRITIQUE_CHARS).collect();
        Self {
            evaluator: evaluator.to_string(),
            score: Some(score.clamp(0.0, 1.0)),
            critique: (!critique.is_empty()).then_some(critique),
            error: None,
        }
    }
}

/// Runs a `checks` evaluator on a trace's output; `None` for a judge (it needs
/// the model).
pub fn run_checks(e: &CompiledEvaluator, output: &Value, metadata: &Value) -> Option<Judgement> {
    let CompiledEvaluator::Checks { name, checks } = e else { return None };
    let reply = checks::reply_text(output);
    Some(match checks::score(checks, &reply, metadata) {
        None => Judgement::failed(name, "no check applied to this trace"),
        Some(s) => Judgement::scored(name, s.score, &s.critiques.join("; ")),
    })
}

/// What a trace's judgements make as one reward: the mean score of the
/// evaluators that scored it, the critiques (`name: critique`, one a line)
/// and the names of the evaluators behind it. `None` when none scored.
pub fn combine(judgements: &[Judgement]) -> Option<(f64, String, String)> {
    let scored: Vec<&Judgement> = judgements.iter().filter(|j| j.score.is_some()).collect();
    if scored.is_empty() {
        return None;
    }
    let mean = scored.iter().filter_map(|j| j.score).sum::<f64>() / scored.len() as f64;
    let critique = scored
        .iter()
        .filter_map(|j| j.critique.as_ref().map(|c| format!("{}: {c}", j.evaluator)))
        .collect::<Vec<_>>()
        .join("\n");
    let by = scored.iter().map(|j| j.evaluator.as_str()).collect::<Vec<_>>().join(",");
    Some((mean, critique, by))
}

/// One evaluator's agreement with the rewards agents and operators gave,
/// over the traces both scored (pass = score ≥ 0.5, or success).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Agreement {
    pub evaluator: String,
    /// Traces both the evaluator and an agent or operator scored.
    pub n: u64,
    /// Share of them where both said pass, or both fail; absent when `n` is 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f64>,
    /// Cohen's kappa: agreement beyond what chance gives with the same pass
    /// rates (1 perfect, 0 chance, below 0 worse than chance); absent when
    /// chance alone would agree always (both sides said one thing only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kappa: Option<f64>,
}

/// Whether a reward passes: `success` when given, else score ≥ 0.5.
pub fn passes(success: Option<bool>, score: Option<f64>) -> Option<bool> {
    success.or(score.map(|s| s >= 0.5))
}

/// Cohen's kappa of paired binary verdicts `(truth, evaluator)`, with the
/// share of agreements: `(accuracy, kappa)`.
pub fn cohen_kappa(pairs: &[(bool, bool)]) -> (Option<f64>, Option<f64>) {
    if pairs.is_empty() {
        return (None, None);
    }
    let n = pairs.len() as f64;
    let agree = pairs.iter().filter(|(a, b)| a == b).count() as f64 / n;
    let truth_yes = pairs.iter().filter(|(a, _)| *a).count() as f64 / n;
    let eval_yes = pairs.iter().filter(|(_, b)| *b).count() as f64 / n;
    let chance = truth_yes * eval_yes + (1.0 - truth_yes) * (1.0 - eval_yes);
    let kappa = (chance < 1.0 - 1e-12).then(|| (agree - chance) / (1.0 - chance));
    (Some(agree), kappa)
}

/// Each named evaluator's [`Agreement`] over `data`: per trace, whether the
/// agent's or operator's reward passes, and the evaluators' judgements.
pub fn calibrate(names: &[&str], data: &[(bool, Vec<Judgement>)]) -> Vec<Agreement> {
    names
        .iter()
        .map(|name| {
            let pairs: Vec<(bool, bool)> = data
                .iter()
                .filter_map(|(truth, js)| {
                    let score = js.iter().find(|j| j.evaluator == *name)?.score?;
                    Some((*truth, score >= 0.5))
                })
                .collect();
            let (accuracy, kappa) = cohen_kappa(&pairs);
            Agreement { evaluator: name.to_string(), n: pairs.len() as u64, accuracy, kappa }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn parse(v: Value) -> Vec<Evaluator> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_valid_list_compiles_and_bad_ones_say_why() {
        let ok = parse(json!([
            {"kind": "checks", "name": "format", "checks": [{"type": "regex", "pattern": "^ANSWER:"}]},
            {"kind": "judge", "name": "helpful", "rubric": "Is the answer correct and polite?"}
        ]));
        assert_eq!(compile(&ok).unwrap().len(), 2);
        let cases = [
            (json!([{"kind": "checks", "name": "f", "checks": [{"type": "regex", "pattern": "("}]}]), "checks[0]"),
            (json!([{"kind": "judge", "name": "j", "rubric": "  "}]), "rubric` must not be empty"),
            (json!([{"kind": "checks", "name": "f", "checks": []}]), "1 to 32"),
            (json!([{"kind": "judge", "name": "Bad Name", "rubric": "x"}]), "must match"),
            (
                json!([{"kind": "judge", "name": "a", "rubric": "x"}, {"kind": "judge", "name": "a", "rubric": "y"}]),
                "used twice",
            ),
            (
                json!([{"kind": "checks", "name": "s", "checks": [{"type": "json_schema", "schema": {"type": 5}}]}]),
                "not a valid JSON Schema",
            ),
        ];
        for (list, why) in cases {
            let err = compile(&parse(list.clone())).unwrap_err();
            assert!(err.contains(why), "{list}: {err}");
        }
        let many: Vec<Evaluator> =
            (0..9).map(|i| Evaluator::Judge { name: format!("j{i}"), rubric: "r".into() }).collect();
        assert!(compile(&many).unwrap_err().contains("at most 8"));
        let long = vec![Evaluator::Judge { name: "j".into(), rubric: "r".repeat(MAX_RUBRIC_BYTES + 1) }];
        assert!(compile(&long).unwrap_err().contains("limit"));
    }

    #[test]
    fn checks_score_the_share_passed_and_combine_averages_the_scored() {
        let list = compile(&parse(json!([{"kind": "checks", "name": "fmt", "checks": [
            {"type": "contains", "text": "ANSWER:"}, {"type": "length", "max": 20}]}])))
        .unwrap();
        let j = run_checks(&list[0], &json!("ANSWER: a reply far too long to pass"), &json!({})).unwrap();
        assert_eq!(j.score, Some(0.5));
        assert!(j.critique.as_deref().unwrap().contains("at most 20"));
        let ok = run_checks(&list[0], &json!("ANSWER: 4"), &json!({})).unwrap();
        assert_eq!((ok.score, ok.critique.as_deref()), (Some(1.0), None));
        let (score, critique, by) = combine(&[j, ok, Judgement::failed("judge", "timeout")]).unwrap();
        assert_eq!(score, 0.75);
        assert!(critique.starts_with("fmt: the reply must be at most 20"));
        assert_eq!(by, "fmt,fmt");
        assert_eq!(combine(&[Judgement::failed("judge", "refused")]), None);
        assert_eq!(Judgement::scored("j", 1.7, "").score, Some(1.0));
        assert!(Judgement::scored("j", f64::NAN, "").score.is_none());
    }

    #[test]
    fn kappa_matches_a_hand_computed_example() {
        // 50 traces: both pass 20, both fail 15, truth pass / judge fail 5,
        // truth fail / judge pass 10. Accuracy = 35/50 = 0.7. Truth passes
        // 25/50 = 0.5, the judge 30/50 = 0.6; chance = 0.5·0.6 + 0.5·0.4 = 0.5;
        // kappa = (0.7 − 0.5) / (1 − 0.5) = 0.4.
        let mut pairs = vec![(true, true); 20];
        pairs.extend(vec![(false, false); 15]);
        pairs.extend(vec![(true, false); 5]);
        pairs.extend(vec![(false, true); 10]);
        let (acc, kappa) = cohen_kappa(&pairs);
        assert!((acc.unwrap() - 0.7).abs() < 1e-12);
        assert!((kappa.unwrap() - 0.4).abs() < 1e-12);
        // Everyone says pass: agreement is perfect, and no better than chance.
        assert_eq!(cohen_kappa(&[(true, true); 4]), (Some(1.0), None));
        assert_eq!(cohen_kappa(&[]), (None, None));
        // Always wrong on a balanced set: kappa −1.
        assert_eq!(cohen_kappa(&[(true, false), (false, true)]).1, Some(-1.0));
    }

    #[test]
    fn calibrate_pairs_each_evaluator_with_the_traces_it_scored() {
        let j = |e: &str, s: Option<f64>| Judgement { evaluator: e.into(), score: s, critique: None, error: None };
        let data = vec![
            (true, vec![j("a", Some(0.9)), j("b", Some(0.1))]),
            (false, vec![j("a", Some(0.2)), j("b", None)]),
            (true, vec![j("a", Some(0.5))]),
        ];
        let out = calibrate(&["a", "b", "c"], &data);
        assert_eq!((out[0].n, out[0].accuracy), (3, Some(1.0)));
        assert_eq!((out[1].n, out[1].accuracy), (1, Some(0.0)));
        assert_eq!((out[2].n, out[2].accuracy, out[2].kappa), (0, None, None));
        assert_eq!(passes(None, Some(0.5)), Some(true));
        assert_eq!(passes(Some(false), Some(0.9)), Some(false));
    }
}
