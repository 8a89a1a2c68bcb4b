//! `GET /v1/prompts/{name}/metrics`: how each version of a prompt is doing on
//! live traffic (trace counts, success rate and mean score with intervals,
//! usage), over a time window, with a bucketed series for charts. The numbers
//! are what the `evaluated` policy will judge versions by.

use axum::{Json, extract::State};
use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiQuery, Authorized, scope},
};
use crate::service::projects::PathPrompt;
use crate::{
    evaluate::outcomes::{VersionOutcomes, rollup_window},
    service::{ServiceResult, outcomes, prompts::existing_prompt},
};

/// Longest window one request may cover.
const MAX_RANGE_SECS: i64 = 366 * 86_400;
/// Most buckets one request may ask for.
const MAX_BUCKETS: i64 = 2_000;
/// Most versions one request may list (besides the labelled ones).
const MAX_NEWEST: u32 = 1_000;
/// Bucket widths chosen automatically: the smallest giving at most ~200 points.
const AUTO_BUCKETS: [i64; 7] = [60, 300, 900, 3_600, 21_600, 86_400, 604_800];
const AUTO_TARGET: i64 = 200;

#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct MetricsQuery {
    /// Length of the window: a number and a unit `m`, `h` or `d` (`1h`, `24h`, `7d`).
    /// Without `since`, the window ends now; with it, the window starts at `since`.
    /// Default `7d` when neither is given. A window longer than 366 days is cut to
    /// its most recent 366 days; one that starts in the future is empty (the
    /// answer's `from` and `until` say what was read).
    #[param(pattern = "^[1-9][0-9]{0,5}[mhd]$")]
    pub window: Option<String>,
    /// Start of the window (RFC 3339). Without `window`, the window runs until now.
    #[serde(default, deserialize_with = "crate::http::extract::bounded_time")]
    pub since: Option<DateTime<Utc>>,
    /// Width of a series bucket, same grammar as `window` (default: chosen for ~200 points at most).
    /// Widened when it would make more than 2000 buckets (the answer's `bucket_seconds`).
    #[param(pattern = "^[1-9][0-9]{0,5}[mhd]$")]
    pub bucket: Option<String>,
    /// How many of the newest versions (by number) to list, 1 to 1000 (default 50).
    /// Labelled versions and traces that named no version are listed as well.
    #[param(minimum = 1, maximum = 1000)]
    pub newest: Option<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PromptMetrics {
    pub prompt: String,
    /// The window is `[from, until)`.
    pub from: DateTime<Utc>,
    pub until: DateTime<Utc>,
    pub bucket_seconds: i64,
    /// Newest version first; traces that named no version last (`version: null`).
    /// Versions without traces in the window are absent.
    pub versions: Vec<VersionOutcomes>,
    /// Unlabelled versions numbered below this are not listed (ask for more
    /// with `newest`); null when every version was.
    pub omitted_before: Option<i64>,
}

/// `30m`, `24h`, `7d` → seconds.
fn parse_span(what: &str, s: &str) -> ApiResult<i64> {
    let bad = || {
        ApiError::bad_request(format!("`{what}` must be a number and a unit m, h or d (e.g. 1h, 24h, 7d); got {s:?}"))
    };
    if !s.is_ascii() {
        return Err(bad());
    }
    let (digits, unit) = s.split_at(s.len().saturating_sub(1));
    let n: i64 = if digits.is_empty() || digits.len() > 6 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    } else {
        digits.parse().map_err(|_| bad())?
    };
    let secs = match unit {
        "m" => n * 60,
        "h" => n * 3_600,
        "d" => n * 86_400,
        _ => return Err(bad()),
    };
    if secs == 0 {
        return Err(ApiError::bad_request(format!("`{what}` must be longer than zero")));
    }
    Ok(secs)
}

/// Resolves the query into `[from, until)` and a bucket width.
fn window(q: &MetricsQuery, now: DateTime<Utc>) -> ApiResult<(DateTime<Utc>, DateTime<Utc>, i64)> {
    let span = q.window.as_deref().map(|w| parse_span("window", w)).transpose()?;
    let (from, until) = match (q.since, span) {
        (Some(since), Some(secs)) => (since, since.checked_add_signed(Duration::seconds(secs)).unwrap_or(since)),
        (Some(since), None) => (since, now),
        (None, secs) => (now - Duration::seconds(secs.unwrap_or(7 * 86_400)), now),
    };
    // A window that starts in the future is empty; a longer one than a request
    // may cover keeps its most recent part. The answer's `from`, `until` and
    // `bucket_seconds` say what was read.
    // The cut lands on a whole hour (the rollups read edges that old by the hour).
    let earliest = until - Duration::seconds(MAX_RANGE_SECS);
    let earliest = DateTime::from_timestamp(earliest.timestamp().div_euclid(3_600) * 3_600, 0).unwrap_or(earliest);
    let from = from.min(until).max(earliest);
    let range = (until - from).num_seconds();
    let bucket = match q.bucket.as_deref() {
        // Widened when it would make too many buckets.
        Some(b) => parse_span("bucket", b)?.max((range + MAX_BUCKETS - 1) / MAX_BUCKETS),
        None => AUTO_BUCKETS.into_iter().find(|b| range / b <= AUTO_TARGET).unwrap_or(604_800),
    };
    // What the rollups answer exactly: ends to the second (the minute, the hour,
    // past those horizons), buckets of whole minutes. The answer says what was read.
    Ok(rollup_window(from, until, bucket, now))
}

#[utoipa::path(get, path = "/v1/prompts/{name}/metrics", tag = "prompts",
    params(("name" = String, Path), MetricsQuery),
    responses(
        (status = 200, body = PromptMetrics),
        (status = 400, description = "`window` or `bucket` is not a number and a unit m, h or d, or `newest` is out of range", body = super::error::Problem),
        (status = 401, body = super::error::Problem),
        (status = 403, body = super::error::Problem),
        (status = 404, description = "No such prompt", body = super::error::Problem),
    ),
    security(("bearer" = ["prompts:read"])))]
pub async fn prompt_metrics(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiQuery(q): ApiQuery<MetricsQuery>,
) -> ApiResult<Json<PromptMetrics>> {
    let prompt = existing_prompt(&st, &name).await?;
    let (from, until, bucket_seconds) = window(&q, Utc::now())?;
    let newest = match q.newest {
        None => outcomes::DEFAULT_NEWEST,
        Some(n @ 1..=MAX_NEWEST) => n,
        Some(n) => return Err(ApiError::bad_request(format!("`newest` must be 1 to {MAX_NEWEST}; got {n}"))),
    };
    let listed = outcomes::Listed::Newest(newest);
    let listing = outcomes::version_outcomes(&st, &prompt.name, from, until, bucket_seconds, listed).await?;
    Ok(Json(PromptMetrics {
        prompt: prompt.name.to_string(),
        from,
        until,
        bucket_seconds,
        versions: listing.versions,
        omitted_before: listing.omitted_before,
    }))
}

/// Gauges are computed over this trailing window.
const GAUGE_WINDOW_SECS: i64 = 86_400;
/// At most this many prompts (by name) get gauges, so a scrape stays cheap.
const GAUGE_MAX_PROMPTS: u32 = 100;
/// A scrape never waits longer than this for the gauges; it answers without them.
const GAUGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Prometheus text for per-version outcome gauges of *labelled* versions only
/// (so the series count is bounded by the labels, not by history), over the
/// last 24 hours: `combee_version_success_rate`, `combee_version_mean_score`
/// and `combee_version_rewarded_traces`, labelled `prompt`, `project`, `version`, `labels`.
/// Rendered at scrape time from the store, so a moved label shows at once and
/// a version that lost its labels disappears.
pub async fn outcome_gauges(st: &AppState) -> String {
    match tokio::time::timeout(GAUGE_TIMEOUT, render_gauges(st)).await {
        Ok(Ok(text)) => text,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "per-version gauges left out of this scrape");
            String::new()
        }
        Err(_) => {
            tracing::warn!("per-version gauges took too long; left out of this scrape");
            String::new()
        }
    }
}

async fn render_gauges(st: &AppState) -> ServiceResult<String> {
    use std::fmt::Write;
    let (mut rate, mut score, mut rewarded) = (String::new(), String::new(), String::new());
    for (name, versions) in outcomes::labelled_outcomes(st, Utc::now(), GAUGE_WINDOW_SECS, GAUGE_MAX_PROMPTS).await? {
        for v in versions {
            let Some(version) = v.version else { continue };
            let series = format!(
                "{{prompt=\"{}\",project=\"{}\",version=\"{version}\",labels=\"{}\"}}",
                escape(name.as_str()),
                escape(name.project()),
                escape(&v.labels.join(","))
            );
            let _ = writeln!(rewarded, "combee_version_rewarded_traces{series} {}", v.with_feedback);
            if let Some(r) = v.success {
                let _ = writeln!(rate, "combee_version_success_rate{series} {}", r.rate);
            }
            if let Some(m) = v.score {
                let _ = writeln!(score, "combee_version_mean_score{series} {}", m.mean);
            }
        }
    }
    Ok(format!(
        "# HELP combee_version_success_rate Share of successful traces of a labelled version over the last 24h.\n\
         # TYPE combee_version_success_rate gauge\n{rate}\
         # HELP combee_version_mean_score Mean feedback score of a labelled version over the last 24h.\n\
         # TYPE combee_version_mean_score gauge\n{score}\
         # HELP combee_version_rewarded_traces Traces with a reward of a labelled version over the last 24h.\n\
         # TYPE combee_version_rewarded_traces gauge\n{rewarded}"
    ))
}

/// Prometheus label-value escaping.
pub(super) fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::ServiceError;

    fn q(window: Option<&str>, since: Option<DateTime<Utc>>, bucket: Option<&str>) -> MetricsQuery {
        MetricsQuery { window: window.map(Into::into), since, bucket: bucket.map(Into::into), newest: None }
    }

    #[test]
    fn windows_resolve_to_half_open_ranges_with_sensible_buckets() {
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let (from, until, b) = window(&q(Some("24h"), None, None), now).unwrap();
        assert_eq!(((until - from).num_hours(), until, b), (24, now, 900));
        let (_, _, b) = window(&q(None, None, None), now).unwrap();
        assert_eq!(b, 3_600);
        let since = now - Duration::days(3);
        let (from, until, _) = window(&q(Some("1d"), Some(since), Some("1h")), now).unwrap();
        assert_eq!((from, until), (since, since + Duration::days(1)));
    }

    #[test]
    fn bad_windows_are_explained() {
        let now = Utc::now();
        for bad in ["", "h", "10", "1w", "-1h", "0h", "1.5h", "9999999d", "1é", "é"] {
            assert!(
                matches!(window(&q(Some(bad), None, None), now), Err(ApiError::Service(ServiceError::BadRequest(_)))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn windows_beyond_the_limits_are_cut_and_said_so() {
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        // Longer than 366 days: its most recent 366 days.
        let (from, until, _) = window(&q(Some("400d"), None, None), now).unwrap();
        assert_eq!((until, (until - from).num_days()), (now, 366));
        // A bucket that would make more than 2000 buckets is widened.
        let (from, until, b) = window(&q(Some("7d"), None, Some("1m")), now).unwrap();
        assert!((until - from).num_seconds() / b <= MAX_BUCKETS && b > 60, "{b}");
        // A window starting in the future is empty.
        let since = now + Duration::hours(1);
        let (from, until, _) = window(&q(None, Some(since), None), now).unwrap();
        assert_eq!((from, until), (now, now));
    }
}
