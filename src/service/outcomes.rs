//! How each version of a prompt is doing on live traffic, summarised once for
//! every reader: the metrics route, the Prometheus gauges and the web UI's
//! reward chart (in buckets fitted to where the data is). Each version's
//! outcomes carry the labels pointing at it.

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
    for prompt in st.store.prompts_page(None, max_prompts).await? {
        let name = prompt.name;
        let outcomes = version_outcomes(st, &name, from, until, window_secs).await?;
        let labelled: Vec<VersionOutcomes> =
            outcomes.into_iter().filter(|v| v.version.is_some() && !v.labels.is_empty()).collect();
        if !labelled.is_empty() {
            out.push((name, labelled));
        }
    }
    Ok(out)
}

/// Bucket widths a chart may use, finest first.
const CHART_BUCKETS: [i64; 6] = [60, 300, 900, 3_600, 21_600, 86_400];

/// The finest bucket that cuts `span_secs` into at most `max_points`.
pub fn chart_bucket(span_secs: i64, max_points: i64) -> i64 {
    CHART_BUCKETS.into_iter().find(|b| span_secs / b <= max_points).unwrap_or(86_400)
}

/// Per-version outcomes in `[from, until)` for a chart of at most about
/// `max_points` points per line, zoomed to the data: read hourly first, then
/// again over just the hours that have data, in the finest bucket that keeps
/// the points within `max_points` (so a run of minutes is drawn by the minute).
/// The outcomes and their bucket width.
pub async fn chart_outcomes(
    st: &AppState,
    prompt: &PromptName,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
    max_points: i64,
) -> ServiceResult<(Vec<VersionOutcomes>, i64)> {
    const HOUR: i64 = 3_600;
    let hourly = version_outcomes(st, prompt, from, until, HOUR).await?;
    let starts = hourly.iter().flat_map(|v| v.series.iter().map(|p| p.start));
    let Some((first, last)) = starts.fold(None, |span: Option<(DateTime<Utc>, DateTime<Utc>)>, t| {
        Some(span.map_or((t, t), |(a, b)| (a.min(t), b.max(t))))
    }) else {
        return Ok((hourly, HOUR));
    };
    let (first, last) = (first.max(from), (last + chrono::Duration::seconds(HOUR)).min(until));
    let bucket = chart_bucket((last - first).num_seconds(), max_points);
    if bucket >= HOUR {
        return Ok((hourly, HOUR));
    }
    Ok((version_outcomes(st, prompt, first, last, bucket).await?, bucket))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_bucket_is_the_finest_that_keeps_the_points_few() {
        assert_eq!(chart_bucket(20 * 60, 120), 60, "a run of minutes, by the minute");
        assert_eq!(chart_bucket(3 * 3_600, 120), 300);
        assert_eq!(chart_bucket(26 * 3_600, 120), 900);
        assert_eq!(chart_bucket(7 * 86_400, 120), 3_600 * 6);
        assert_eq!(chart_bucket(7 * 86_400, 200), 3_600);
        assert_eq!(chart_bucket(10_000 * 86_400, 120), 86_400);
    }
}
