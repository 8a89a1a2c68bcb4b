//! How each version of a prompt is doing on live traffic, summarised once for
//! every reader: the metrics route, the Prometheus gauges and the web UI's
//! reward chart. Each version's outcomes carry the labels pointing at it.

use chrono::{DateTime, Utc};

use super::{AppState, ServiceResult};
use crate::{
    domain::PromptName,
    evaluate::outcomes::{VersionOutcomes, summarize},
};

/// Per-version outcomes of the prompt's traces received in `[from, until)`,
/// in buckets `bucket_secs` wide; newest version first, traces that named no
/// version last. Each version carries its labels, by name.
pub async fn version_outcomes(
    st: &AppState,
    prompt: &PromptName,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
    bucket_secs: i64,
) -> ServiceResult<Vec<VersionOutcomes>> {
    let buckets = st.store.version_outcomes(prompt, from, until, bucket_secs).await?;
    let labels = st.store.list_labels(prompt).await?;
    Ok(summarize(&buckets, |v| {
        let mut names: Vec<String> =
            labels.iter().filter(|l| l.version == v).map(|l| l.name.as_str().to_owned()).collect();
        names.sort();
        names
    }))
}

/// The outcomes over `[until − window, until)`, in one bucket, of the
/// labelled versions of at most `max_prompts` prompts (by name); prompts
/// without labels are left out.
pub async fn labelled_outcomes(
    st: &AppState,
    until: DateTime<Utc>,
    window_secs: i64,
    max_prompts: u32,
) -> ServiceResult<Vec<(PromptName, Vec<VersionOutcomes>)>> {
    let from = until - chrono::Duration::seconds(window_secs);
    let mut out = Vec::new();
    for summary in st.store.list_prompts(None, max_prompts).await? {
        let name = summary.prompt.name;
        let outcomes = version_outcomes(st, &name, from, until, window_secs).await?;
        let labelled: Vec<VersionOutcomes> =
            outcomes.into_iter().filter(|v| v.version.is_some() && !v.labels.is_empty()).collect();
        if !labelled.is_empty() {
            out.push((name, labelled));
        }
    }
    Ok(out)
}
