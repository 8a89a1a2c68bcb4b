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

/// Which versions an answer about outcomes lists. A prompt that learns all
/// day makes thousands of versions a week, so by default an answer lists the
/// newest and the labelled ones, and what it leaves out costs nothing to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listed {
    /// The `n` newest versions (by number), every labelled one, and the
    /// traces that named no version.
    Newest(u32),
    /// The labelled versions only.
    Labelled,
}

/// How many of the newest versions an answer lists unless asked otherwise.
pub const DEFAULT_NEWEST: u32 = 50;

/// Per-version outcomes, as listed, and what was left out.
#[derive(Debug, Clone)]
pub struct Listing {
    /// Newest version first, traces that named no version last.
    pub versions: Vec<VersionOutcomes>,
    /// Versions numbered below this were not read, except the labelled
    /// ones; `None` when no version was left out.
    pub omitted_before: Option<i64>,
}

/// Per-version outcomes of the prompt's traces received in `[from, until)`,
/// in buckets `bucket_secs` wide, of the versions `listed`; newest version
/// first, traces that named no version last. Each version carries its
/// labels, by name.
pub async fn version_outcomes(
    st: &AppState,
    prompt: &PromptName,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
    bucket_secs: i64,
    listed: Listed,
) -> ServiceResult<Listing> {
    let labels = st.store.list_labels(prompt).await?;
    let mut wanted: Vec<i64> = labels.iter().map(|l| l.version).collect();
    wanted.sort_unstable();
    wanted.dedup();
    let mut omitted_before = None;
    match listed {
        Listed::Newest(n) => {
            let latest = st.store.list_versions(prompt, None, 1).await?.first().map_or(0, |v| v.number);
            let oldest = (latest - i64::from(n) + 1).max(1);
            // Left out: the versions below `oldest` that no label points at.
            let labelled_below = wanted.iter().filter(|v| **v < oldest).count() as i64;
            omitted_before = (labelled_below < oldest - 1).then_some(oldest);
            wanted.extend(oldest..=latest);
            wanted.push(0); // traces that named no version
        }
        Listed::Labelled if wanted.is_empty() => return Ok(Listing { versions: Vec::new(), omitted_before: None }),
        Listed::Labelled => {}
    }
    let buckets = st.store.version_outcomes(prompt, from, until, bucket_secs, Some(&wanted)).await?;
    let versions = summarize(&buckets, |v| {
        let mut names: Vec<String> =
            labels.iter().filter(|l| l.version == v).map(|l| l.name.as_str().to_owned()).collect();
        names.sort();
        names
    });
    Ok(Listing { versions, omitted_before })
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
        let labelled = version_outcomes(st, &name, from, until, window_secs, Listed::Labelled).await?.versions;
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
/// The versions listed by default ([`DEFAULT_NEWEST`] and the labelled ones).
/// The outcomes and their bucket width.
pub async fn chart_outcomes(
    st: &AppState,
    prompt: &PromptName,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
    max_points: i64,
) -> ServiceResult<(Vec<VersionOutcomes>, i64)> {
    const HOUR: i64 = 3_600;
    let listed = Listed::Newest(DEFAULT_NEWEST);
    let hourly = version_outcomes(st, prompt, from, until, HOUR, listed).await?.versions;
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
    Ok((version_outcomes(st, prompt, first, last, bucket, listed).await?.versions, bucket))
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
