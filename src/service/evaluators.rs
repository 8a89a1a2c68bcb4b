//! A prompt's evaluators (read, replaced whole after validation) and their
//! calibration against the rewards agents and operators gave.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{AppState, ServiceError, ServiceResult};
use crate::{
    domain::PromptName,
    evaluate::evaluators::{self, Agreement, Evaluator, passes},
    store::StoreError,
};

/// Most scored traces a calibration reads (the newest).
pub const CALIBRATION_TRACES: u32 = 5_000;
/// Most scored traces the prompt's web page reads for its agreement figures
/// (the newest): the page is viewed often, the API's full calibration is asked for.
pub const PAGE_CALIBRATION_TRACES: u32 = 500;

fn not_found(name: &PromptName) -> impl FnOnce(StoreError) -> ServiceError + '_ {
    move |e| match e {
        StoreError::NotFound => ServiceError::not_found(format_args!("prompt {name:?}")),
        e => e.into(),
    }
}

/// A prompt's evaluators, in order, as the API reads and writes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EvaluatorList {
    pub evaluators: Vec<Evaluator>,
}

/// The prompt's evaluators (empty when it has none).
pub async fn get(st: &AppState, name: &PromptName) -> ServiceResult<EvaluatorList> {
    let prompt = name;
    Ok(EvaluatorList { evaluators: st.store.evaluators(prompt).await.map_err(not_found(name))? })
}

/// Replaces the prompt's evaluators after checking the list as a whole (a
/// bad pattern, schema or rubric, a repeated name, too many: 422 saying which).
pub async fn set(st: &AppState, name: &PromptName, list: EvaluatorList) -> ServiceResult<EvaluatorList> {
    let prompt = name;
    evaluators::compile(&list.evaluators).map_err(ServiceError::Unprocessable)?;
    st.store.set_evaluators(prompt, &list.evaluators).await.map_err(not_found(name))?;
    Ok(list)
}

/// Each evaluator's agreement with the rewards agents and operators gave.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Calibration {
    pub prompt: String,
    /// Scored traces (by an agent or an operator) the evaluators judged, read
    /// newest first up to a limit.
    pub traces: u64,
    pub evaluators: Vec<Agreement>,
}

/// [`Calibration`] of the prompt's current evaluators.
pub async fn calibration(st: &AppState, name: &PromptName) -> ServiceResult<Calibration> {
    calibration_over(st, name, CALIBRATION_TRACES).await
}

/// [`Calibration`] over at most `limit` of the newest scored traces.
pub async fn calibration_over(st: &AppState, name: &PromptName, limit: u32) -> ServiceResult<Calibration> {
    let prompt = name;
    let list = st.store.evaluators(prompt).await.map_err(not_found(name))?;
    let data = st.store.calibration_data(prompt, limit).await.map_err(not_found(name))?;
    let pairs: Vec<_> =
        data.into_iter().filter_map(|t| Some((passes(t.feedback.success, t.feedback.score)?, t.judgements))).collect();
    let names: Vec<&str> = list.iter().map(Evaluator::name).collect();
    Ok(Calibration {
        prompt: prompt.as_str().to_string(),
        traces: pairs.len() as u64,
        evaluators: evaluators::calibrate(&names, &pairs),
    })
}
