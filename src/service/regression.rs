//! A prompt's regression set, as both front ends edit it: cases added by
//! hand, pinned from a trace, imported from JSON Lines (combee's own trace
//! export, the OpenAI Evals `{"input", "ideal"}` shape, or cases as this API
//! lists them), listed and deleted. A case holds code checks or a judge's
//! rubric. Every case is checked here, at the edge, before the store sees it.

use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;
use uuid::Uuid;

use super::{AppState, ServiceError, ServiceResult, prompts::existing_prompt, traces::get_trace};
use crate::{
    domain::{
        PromptName,
        regression::{CaseJudge, CaseSource, NewCase, RegressionCase},
    },
    evaluate::checks::{Check, MAX_CHECK_TEXT, reply_text},
};

/// Most lines one import may hold (each a case; the set's own limit applies too).
pub const MAX_IMPORT_LINES: usize = 1_000;

/// A case as an operator writes it (`POST …/regression-cases`, one line of an import).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CaseRequest {
    #[serde(default)]
    pub name: Option<String>,
    /// A string, chat messages `[{role, content}]`, or any JSON object.
    #[schema(value_type = Object)]
    pub input: Value,
    /// What must hold of the reply: every check must pass. Give `checks` or `judge`.
    #[serde(default)]
    pub checks: Vec<Check>,
    /// A judge-rubric case: an LLM judge (role `judge`) scores the reply
    /// against the rubric; the case passes when the score is at least `pass_score`.
    #[serde(default)]
    pub judge: Option<CaseJudge>,
}

/// How an imported OpenAI Evals `ideal` becomes a check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum IdealStyle {
    /// The reply equals the ideal (trimmed); a list of ideals: equals any of them.
    #[default]
    Match,
    /// The reply contains the ideal (case-insensitive); a list: contains any of them.
    Includes,
}

/// Pinning a trace: its input becomes a case; its checks are the caller's, or
/// (default) built from the trace's output when the trace succeeded.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PinRequest {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub checks: Option<Vec<Check>>,
    /// A rubric the reply is judged by instead of checks.
    #[serde(default)]
    pub judge: Option<CaseJudge>,
}

fn new_case(st: &AppState, req: CaseRequest, source: CaseSource, trace_id: Option<Uuid>) -> Result<NewCase, String> {
    let case = NewCase { name: req.name, input: req.input, checks: req.checks, judge: req.judge, source, trace_id };
    case.validate(st.settings.regression.max_case_input_bytes)?;
    Ok(case)
}

async fn add(st: &AppState, prompt: &PromptName, cases: Vec<NewCase>, by: &str) -> ServiceResult<Vec<RegressionCase>> {
    Ok(st.store.add_cases(prompt, &cases, by, st.settings.regression.max_cases).await?)
}

/// Adds one case written by hand.
pub async fn add_case(st: &AppState, name: &PromptName, req: CaseRequest, by: &str) -> ServiceResult<RegressionCase> {
    let prompt = existing_prompt(st, name).await?;
    let case = new_case(st, req, CaseSource::Manual, None).map_err(ServiceError::Unprocessable)?;
    let mut added = add(st, &prompt.name, vec![case], by).await?;
    added.pop().ok_or_else(|| ServiceError::Internal(anyhow::anyhow!("the store added no case")))
}

pub async fn list_cases(st: &AppState, name: &PromptName) -> ServiceResult<Vec<RegressionCase>> {
    let prompt = existing_prompt(st, name).await?;
    Ok(st.store.regression_cases(&prompt.name).await?)
}

/// One case of the prompt's set (404 when the prompt has no such case).
pub async fn get_case(st: &AppState, name: &PromptName, id: Uuid) -> ServiceResult<RegressionCase> {
    let prompt = existing_prompt(st, name).await?;
    st.store.get_case(&prompt.name, id).await?.ok_or_else(|| ServiceError::not_found(format!("case {id}")))
}

pub async fn delete_case(st: &AppState, name: &PromptName, id: Uuid) -> ServiceResult<()> {
    let prompt = existing_prompt(st, name).await?;
    if st.store.delete_case(&prompt.name, id).await? {
        Ok(())
    } else {
        Err(ServiceError::not_found(format!("case {id}")))
    }
}

/// The checks a successful trace's output stands for: the reply must equal
/// it (its text, trimmed, when it has one; else the JSON value).
pub fn checks_from_output(output: &Value) -> Option<Vec<Check>> {
    if output.is_null() {
        return None;
    }
    let text = reply_text(output);
    // `reply_text` falls back to the JSON itself for a value without a text member: keep the value then.
    let fallback = output.to_string();
    let has_text = output.is_string() || text != fallback;
    let value = if has_text && !text.trim().is_empty() { Value::String(text) } else { output.clone() };
    Some(vec![Check::Equals { value }])
}

/// Pins a trace into its prompt's set.
pub async fn pin_trace(st: &AppState, id: Uuid, req: PinRequest, by: &str) -> ServiceResult<RegressionCase> {
    let trace = get_trace(st, id).await?;
    let checks = match req.checks {
        Some(checks) => checks,
        None if req.judge.is_some() => Vec::new(),
        None if trace.feedback.success == Some(true) => checks_from_output(&trace.output).ok_or_else(|| {
            ServiceError::Unprocessable("the trace has no output to build checks from; give `checks`".into())
        })?,
        None => {
            return Err(ServiceError::Unprocessable(
                "the trace did not succeed (feedback.success is not true), so its output is no example to keep; \
                 give the `checks` the reply must pass"
                    .into(),
            ));
        }
    };
    let name = req.name.or_else(|| Some(format!("trace {}", trace.id)));
    let case = new_case(
        st,
        CaseRequest { name, input: trace.input.clone(), checks, judge: req.judge },
        CaseSource::Trace,
        Some(trace.id),
    )
    .map_err(ServiceError::Unprocessable)?;
    let mut added = add(st, &trace.prompt, vec![case], by).await?;
    added.pop().ok_or_else(|| ServiceError::Internal(anyhow::anyhow!("the store added no case")))
}

/// An OpenAI Evals `ideal` as one check (see [`IdealStyle`]).
fn ideal_check(ideal: &Value, style: IdealStyle) -> Result<Check, String> {
    let ideals: Vec<&str> = match ideal {
        Value::String(s) => vec![s.as_str()],
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(|v| v.as_str().ok_or_else(|| "`ideal` must be a string or a list of strings".to_owned()))
            .collect::<Result<_, _>>()?,
        _ => return Err("`ideal` must be a string or a non-empty list of strings".into()),
    };
    if ideals.iter().any(|s| s.trim().is_empty()) {
        return Err("`ideal` must not be empty".into());
    }
    let check = match (style, ideals.as_slice()) {
        (IdealStyle::Match, [one]) => Check::Equals { value: Value::String((*one).to_owned()) },
        (IdealStyle::Includes, [one]) => Check::Contains { text: (*one).to_owned(), case_sensitive: false },
        (style, many) => {
            let any = many.iter().map(|s| regex::escape(s.trim())).collect::<Vec<_>>().join("|");
            let pattern = match style {
                IdealStyle::Match => format!(r"^\s*(?:{any})\s*$"),
                IdealStyle::Includes => format!("(?i)(?:{any})"),
            };
            if pattern.len() > MAX_CHECK_TEXT {
                return Err(format!("the ideals together are too long for one check (limit {MAX_CHECK_TEXT} bytes)"));
            }
            Check::Regex { pattern }
        }
    };
    Ok(check)
}

/// One line of an import as a case: a case as this API writes it (`checks`),
/// an OpenAI Evals sample (`ideal`), or one of combee's exported trace records
/// (`output` and `feedback`: a successful trace, its output the example).
fn import_line(st: &AppState, line: &str, style: IdealStyle) -> Result<NewCase, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let Value::Object(obj) = &value else { return Err("each line must be a JSON object".into()) };
    if obj.contains_key("checks") || obj.contains_key("judge") {
        let req: CaseRequest =
            serde_json::from_value(value.clone()).map_err(|e| super::plain_serde_error(&e.to_string()))?;
        return new_case(st, req, CaseSource::Import, None);
    }
    let input = obj.get("input").cloned().ok_or("a line needs `input`")?;
    if let Some(ideal) = obj.get("ideal") {
        let check = ideal_check(ideal, style)?;
        let name = obj.get("name").and_then(Value::as_str).map(str::to_owned);
        return new_case(st, CaseRequest { name, input, checks: vec![check], judge: None }, CaseSource::Import, None);
    }
    if obj.contains_key("output") && obj.contains_key("feedback") {
        let succeeded = obj.get("feedback").and_then(|f| f.get("success")).and_then(Value::as_bool) == Some(true);
        if !succeeded {
            return Err("the trace record did not succeed (feedback.success is not true): no example to keep".into());
        }
        let checks = checks_from_output(&obj["output"]).ok_or("the trace record has no output")?;
        let trace_id = obj.get("id").and_then(Value::as_str).and_then(|s| Uuid::parse_str(s).ok());
        let name = trace_id.map(|id| format!("trace {id}"));
        return new_case(st, CaseRequest { name, input, checks, judge: None }, CaseSource::Import, trace_id);
    }
    Err("a line needs `checks` or `judge` (a case), `ideal` (an OpenAI Evals sample) or `output` and \
         `feedback` (a combee trace record)"
        .into())
}

/// Imports JSON Lines into the prompt's set: all lines or none; the first
/// bad line is named by its number (422).
pub async fn import(
    st: &AppState,
    name: &PromptName,
    body: &str,
    style: IdealStyle,
    by: &str,
) -> ServiceResult<Vec<RegressionCase>> {
    let prompt = existing_prompt(st, name).await?;
    let mut cases = Vec::new();
    for (i, line) in body.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if cases.len() == MAX_IMPORT_LINES {
            return Err(ServiceError::PayloadTooLarge(format!(
                "an import holds at most {MAX_IMPORT_LINES} cases; split the file"
            )));
        }
        let case =
            import_line(st, line, style).map_err(|e| ServiceError::Unprocessable(format!("line {}: {e}", i + 1)))?;
        cases.push(case);
    }
    if cases.is_empty() {
        return Err(ServiceError::Unprocessable("the file holds no case (one JSON object per line)".into()));
    }
    add(st, &prompt.name, cases, by).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ideals_become_equals_contains_or_an_any_of_pattern() {
        assert_eq!(ideal_check(&json!("Paris"), IdealStyle::Match).unwrap(), Check::Equals { value: json!("Paris") });
        assert_eq!(
            ideal_check(&json!("Paris"), IdealStyle::Includes).unwrap(),
            Check::Contains { text: "Paris".into(), case_sensitive: false }
        );
        let any = ideal_check(&json!(["4", "four (4)"]), IdealStyle::Match).unwrap().compile().unwrap();
        let meta = Value::Null;
        assert_eq!(any.run(" four (4) ", &meta), crate::evaluate::checks::Verdict::Passed);
        assert_ne!(any.run("44", &meta), crate::evaluate::checks::Verdict::Passed);
        let inc = ideal_check(&json!(["Paris", "Lyon"]), IdealStyle::Includes).unwrap().compile().unwrap();
        assert_eq!(inc.run("it is LYON.", &meta), crate::evaluate::checks::Verdict::Passed);
        assert!(ideal_check(&json!([1]), IdealStyle::Match).is_err());
        assert!(ideal_check(&json!(""), IdealStyle::Match).is_err());
    }

    #[test]
    fn a_successful_outputs_text_or_value_is_the_example() {
        assert_eq!(checks_from_output(&json!("ok")).unwrap(), vec![Check::Equals { value: json!("ok") }]);
        assert_eq!(checks_from_output(&json!({"content": "hi"})).unwrap(), vec![Check::Equals { value: json!("hi") }]);
        assert_eq!(checks_from_output(&json!({"n": 1})).unwrap(), vec![Check::Equals { value: json!({"n": 1}) }]);
        assert!(checks_from_output(&Value::Null).is_none());
    }
}
