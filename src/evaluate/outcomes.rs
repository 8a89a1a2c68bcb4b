//! Per-version outcomes of a prompt from its traces: what the store
//! aggregates per (version, time bucket) in one query, and how those buckets
//! add up to the per-version summaries `GET /v1/prompts/{name}/metrics` shows
//! (success rate with a Wilson interval, mean score with a t interval, usage
//! means, and a bucketed series for charts). The store keeps the buckets as
//! rollups maintained with every trace write (late feedback replaces its old
//! contribution at once); [`rollup_window`] and [`rollup_reads`] say which
//! rollup rows answer a window: only rollup rows are read, never the traces,
//! so a read costs the same however many traces arrived in its window.

use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

use super::stats::{Mean, Moments, Rate, mean_interval, wilson};

/// Metadata keys an agent may put in a trace's `metadata` to have usage
/// reported per version (numbers; anything else is ignored).
pub const TOKENS_KEY: &str = "tokens";
pub const COST_KEY: &str = "cost_usd";
pub const LATENCY_KEY: &str = "latency_ms";

/// Values beyond this magnitude are left out of the aggregates, so a single
/// absurd number cannot overflow a sum of squares (and Postgres float8 errors on overflow).
pub const MAX_ABS_VALUE: f64 = 1e12;

/// Minute rollups are kept this many days; a window edge older than that is
/// read at hour resolution (see [`rollup_window`]).
pub const MINUTE_ROLLUP_DAYS: i64 = 8;

/// Second rollups are kept this many hours; a window edge within them is read
/// to the second, an older one to the minute (see [`rollup_window`]).
pub const SECOND_ROLLUP_HOURS: i64 = 2;

/// Widths of the rollup tiers in seconds, coarsest first.
pub const ROLLUP_TIERS: [i64; 4] = [86_400, 3_600, 60, 1];

/// The window and bucket width read for a request of `[from, until)` with
/// series buckets `bucket_secs` wide, at `now`: each edge rounded up to the
/// second when it is within the last [`SECOND_ROLLUP_HOURS`], to the minute
/// when within the last [`MINUTE_ROLLUP_DAYS`], else to the hour (the finest
/// rollup rows kept that long); the bucket width rounded up to whole minutes
/// (whole hours when the window starts before the minute horizon). Every
/// edge then falls on a rollup bucket, so the window is read from rollup rows
/// alone: a window ending now holds the current second's rows, and no trace
/// is newer than now. Applying it twice changes nothing, so the HTTP layer
/// reports exactly what the store reads.
pub fn rollup_window(
    from: DateTime<Utc>,
    until: DateTime<Utc>,
    bucket_secs: i64,
    now: DateTime<Utc>,
) -> (DateTime<Utc>, DateTime<Utc>, i64) {
    let seconds = now.timestamp() - SECOND_ROLLUP_HOURS * 3_600;
    let minutes = now.timestamp() - MINUTE_ROLLUP_DAYS * 86_400;
    let edge = |t: DateTime<Utc>| {
        let s = t.timestamp() + i64::from(t.timestamp_subsec_nanos() > 0);
        let step = if s >= seconds {
            1
        } else if s >= minutes {
            60
        } else {
            3_600
        };
        DateTime::from_timestamp(ceil_to(s, step), 0).unwrap_or(t)
    };
    let until = edge(until);
    let from = edge(from).min(until);
    let bucket = ceil_to(bucket_secs.max(60), if from.timestamp() < minutes { 3_600 } else { 60 });
    (from, until, bucket)
}

/// `t` rounded up to a multiple of `step`.
pub fn ceil_to(t: i64, step: i64) -> i64 {
    t.div_euclid(step) * step + if t.rem_euclid(step) == 0 { 0 } else { step }
}

/// The rollup rows to read for `[from, until)` (Unix seconds, as
/// [`rollup_window`] returned them): `(tier width, start, end)` ranges, each
/// from the coarsest tier that fits inside the window without crossing a
/// series bucket's edge (a tier qualifies when it divides `bucket_secs`).
pub fn rollup_reads(from: i64, until: i64, bucket_secs: i64) -> Vec<(i64, i64, i64)> {
    let tiers: Vec<i64> = ROLLUP_TIERS.into_iter().filter(|w| bucket_secs % w == 0).collect();
    let mut out = Vec::new();
    split(from, until, &tiers, &mut out);
    out
}

fn split(from: i64, until: i64, tiers: &[i64], out: &mut Vec<(i64, i64, i64)>) {
    if from >= until {
        return;
    }
    let Some((&w, finer)) = tiers.split_first() else { return };
    if finer.is_empty() {
        out.push((w, from, until));
        return;
    }
    let (a, b) = (ceil_to(from, w), until.div_euclid(w) * w);
    if a >= b {
        return split(from, until, finer, out);
    }
    split(from, a, finer, out);
    out.push((w, a, b));
    split(b, until, finer, out);
}

/// One (version, bucket) cell as the store aggregates it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OutcomeBucket {
    /// `None` for traces that did not say which version they ran with.
    pub version: Option<i64>,
    /// Start of the bucket (aligned to multiples of the bucket width since the Unix epoch).
    pub start: i64,
    pub traces: u64,
    /// Traces with a reward: `feedback.success` or `feedback.score` set.
    pub with_feedback: u64,
    /// Traces with `feedback.success` set, and how many of them are `true`.
    pub success_trials: u64,
    pub successes: u64,
    /// Of `with_feedback`, the traces whose reward the prompt's evaluators
    /// gave (no reward reported by the agent or an operator).
    pub judged: u64,
    pub score: Moments,
    pub tokens: Moments,
    pub cost_usd: Moments,
    pub latency_ms: Moments,
}

impl Moments {
    /// Sum of two aggregates over disjoint sets.
    pub fn combined(&self, other: &Moments) -> Moments {
        Moments { count: self.count + other.count, sum: self.sum + other.sum, sum_sq: self.sum_sq + other.sum_sq }
    }
}

/// Which rewards a decision was made on: those agents and operators
/// reported, those the prompt's evaluators judged, or both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
pub struct RewardSources {
    pub reported: u64,
    pub judged: u64,
}

impl RewardSources {
    /// The rewarded traces of `versions` (all, when `None`) in `buckets`.
    pub fn of(buckets: &[OutcomeBucket], versions: Option<&[i64]>) -> Self {
        let mine = buckets.iter().filter(|b| versions.is_none_or(|v| b.version.is_some_and(|x| v.contains(&x))));
        let (rewarded, judged) = mine.fold((0, 0), |(r, j), b| (r + b.with_feedback, j + b.judged));
        Self { reported: rewarded.saturating_sub(judged), judged }
    }

    /// `reported`, `judged`, `both` or `none`.
    pub fn used(&self) -> &'static str {
        match (self.reported > 0, self.judged > 0) {
            (true, true) => "both",
            (true, false) => "reported",
            (false, true) => "judged",
            (false, false) => "none",
        }
    }

    /// As label-history evidence shows it.
    pub fn evidence(&self) -> serde_json::Value {
        serde_json::json!({"used": self.used(), "reported": self.reported, "judged": self.judged})
    }
}

/// One point of a version's time series.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct SeriesPoint {
    pub start: DateTime<Utc>,
    pub traces: u64,
    /// Absent when no trace in the bucket carries `feedback.success`.
    pub success_rate: Option<f64>,
    /// Absent when no trace in the bucket carries `feedback.score`.
    pub mean_score: Option<f64>,
}

/// Everything measured about one version in the window.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct VersionOutcomes {
    /// `null` groups traces that did not name the version they ran with.
    pub version: Option<i64>,
    /// Labels pointing at this version now.
    pub labels: Vec<String>,
    pub traces: u64,
    pub with_feedback: u64,
    /// Of `with_feedback`, rewards the prompt's evaluators gave (judged).
    pub judged: u64,
    /// Share of `feedback.success == true` with a 95% Wilson interval.
    pub success: Option<Rate>,
    /// Mean `feedback.score` with a 95% Student-t interval.
    pub score: Option<Mean>,
    /// Means of `metadata.tokens`, `metadata.cost_usd`, `metadata.latency_ms` where present.
    pub tokens: Option<Mean>,
    pub cost_usd: Option<Mean>,
    pub latency_ms: Option<Mean>,
    /// Oldest bucket first; buckets without traces are omitted.
    pub series: Vec<SeriesPoint>,
}

/// Groups buckets by version (newest version first, unknown version last)
/// and sums them into summaries. `labels_of` names the labels on a version.
pub fn summarize(buckets: &[OutcomeBucket], labels_of: impl Fn(i64) -> Vec<String>) -> Vec<VersionOutcomes> {
    let mut versions: Vec<Option<i64>> = buckets.iter().map(|b| b.version).collect();
    versions.sort_by(|a, b| b.cmp(a));
    versions.dedup();
    versions
        .into_iter()
        .map(|version| {
            let mut mine: Vec<&OutcomeBucket> = buckets.iter().filter(|b| b.version == version).collect();
            mine.sort_by_key(|b| b.start);
            let total = mine.iter().fold(OutcomeBucket { version, ..Default::default() }, |acc, b| OutcomeBucket {
                version,
                start: 0,
                traces: acc.traces + b.traces,
                with_feedback: acc.with_feedback + b.with_feedback,
                success_trials: acc.success_trials + b.success_trials,
                successes: acc.successes + b.successes,
                judged: acc.judged + b.judged,
                score: acc.score.combined(&b.score),
                tokens: acc.tokens.combined(&b.tokens),
                cost_usd: acc.cost_usd.combined(&b.cost_usd),
                latency_ms: acc.latency_ms.combined(&b.latency_ms),
            });
            VersionOutcomes {
                version,
                labels: version.map(&labels_of).unwrap_or_default(),
                traces: total.traces,
                with_feedback: total.with_feedback,
                judged: total.judged,
                success: wilson(total.successes, total.success_trials),
                score: mean_interval(&total.score),
                tokens: mean_interval(&total.tokens),
                cost_usd: mean_interval(&total.cost_usd),
                latency_ms: mean_interval(&total.latency_ms),
                series: mine
                    .iter()
                    .filter_map(|b| {
                        Some(SeriesPoint {
                            start: DateTime::from_timestamp(b.start, 0)?,
                            traces: b.traces,
                            success_rate: (b.success_trials > 0).then(|| b.successes as f64 / b.success_trials as f64),
                            mean_score: b.score.mean(),
                        })
                    })
                    .collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(version: Option<i64>, start: i64, successes: u64, trials: u64, scores: &[f64]) -> OutcomeBucket {
        OutcomeBucket {
            version,
            start,
            traces: trials.max(scores.len() as u64) + 1,
            with_feedback: trials.max(scores.len() as u64),
            success_trials: trials,
            successes,
            score: Moments::from_values(scores),
            ..Default::default()
        }
    }

    #[test]
    fn buckets_add_up_to_the_same_summary_as_one_bucket() {
        let split = [bucket(Some(2), 3600, 3, 4, &[0.5, 1.0]), bucket(Some(2), 0, 5, 6, &[0.0, 0.25, 0.75])];
        let whole = [OutcomeBucket {
            version: Some(2),
            start: 0,
            traces: 12,
            with_feedback: 10,
            success_trials: 10,
            successes: 8,
            score: Moments::from_values(&[0.5, 1.0, 0.0, 0.25, 0.75]),
            ..Default::default()
        }];
        let a = &summarize(&split, |_| vec![])[0];
        let b = &summarize(&whole, |_| vec![])[0];
        assert_eq!((a.traces, a.with_feedback, a.success, a.score), (b.traces, b.with_feedback, b.success, b.score));
        assert_eq!(a.series.iter().map(|p| p.start.timestamp()).collect::<Vec<_>>(), vec![0, 3600]);
        assert_eq!(a.series[0].success_rate, Some(5.0 / 6.0));
        assert!((a.score.unwrap().mean - 0.5).abs() < 1e-12);
    }

    #[test]
    fn versions_are_newest_first_with_unknown_last_and_labelled() {
        let out = summarize(
            &[bucket(None, 0, 1, 1, &[]), bucket(Some(1), 0, 0, 1, &[]), bucket(Some(3), 0, 1, 1, &[])],
            |v| if v == 3 { vec!["production".into()] } else { vec![] },
        );
        assert_eq!(out.iter().map(|v| v.version).collect::<Vec<_>>(), vec![Some(3), Some(1), None]);
        assert_eq!(out[0].labels, vec!["production".to_string()]);
        assert!(out[2].labels.is_empty());
    }

    #[test]
    fn rollup_windows_round_edges_up_to_the_rows_kept_and_are_stable() {
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let at = |s: i64| DateTime::from_timestamp(s, 0).unwrap();
        let us = |s: i64, us: i64| DateTime::from_timestamp_micros(s * 1_000_000 + us).unwrap();
        // Within the second horizon: a fraction of a second rounds up, a whole second stays.
        let (f, u, b) = rollup_window(us(1_799_996_401, 300_000), us(1_800_000_000, 1), 90, now);
        assert_eq!((f, u, b), (at(1_799_996_402), at(1_800_000_001), 120));
        assert_eq!(rollup_window(f, u, b, now), (f, u, b), "stable");
        assert_eq!(rollup_window(at(1_799_996_401), now, 60, now), (at(1_799_996_401), now, 60));
        // Past it, to the minute: there are no second rows to read there.
        let early = 1_800_000_000 - SECOND_ROLLUP_HOURS * 3_600 - 61;
        let (f, u, b) = rollup_window(us(early, 5), now, 60, now);
        assert_eq!((f, u, b), (at(ceil_to(early, 60)), now, 60));
        assert_eq!(rollup_window(f, u, b, now), (f, u, b), "stable");
        // A window starting before the minute horizon: that edge and the bucket go to hours.
        let old = now - chrono::Duration::days(MINUTE_ROLLUP_DAYS + 2);
        let (f, u, b) = rollup_window(old + chrono::Duration::seconds(61), now, 900, now);
        assert_eq!((f.timestamp() % 3_600, u, b), (0, now, 3_600));
        assert_eq!(rollup_window(f, u, b, now), (f, u, b));
        // An empty window stays empty.
        let (f, u, _) = rollup_window(us(1_799_999_000, 10), us(1_799_999_000, 20), 60, now);
        assert_eq!((f, u), (at(1_799_999_001), at(1_799_999_001)));
    }

    #[test]
    fn rollup_reads_cover_the_window_once_from_the_coarsest_rows() {
        for (from, until, bucket) in [
            (60, 200_000 * 60, 3_600),
            (86_400 * 3 + 120, 86_400 * 9 + 3_660, 86_400),
            (0, 60, 60),
            (86_400 * 3 + 17, 86_400 * 9 + 3_661, 3_600),
            (59, 61, 60),
        ] {
            let reads = rollup_reads(from, until, bucket);
            let mut at = from;
            for (w, a, b) in &reads {
                assert_eq!(*a, at, "contiguous: {reads:?}");
                assert!(a % w == 0 && b % w == 0 && bucket % w == 0, "{reads:?}");
                at = *b;
            }
            assert_eq!(at, until, "{reads:?}");
            assert!(reads.len() <= 7, "{reads:?}");
        }
        // 900-second buckets cannot use hour rows; second rows only for partial minutes.
        assert!(rollup_reads(0, 86_400, 900).iter().all(|(w, _, _)| *w == 60));
        assert_eq!(rollup_reads(30, 150, 60), vec![(1, 30, 60), (60, 60, 120), (1, 120, 150)]);
    }

    #[test]
    fn a_version_without_rewards_has_no_rates() {
        let out = summarize(&[OutcomeBucket { version: Some(1), traces: 3, ..Default::default() }], |_| vec![]);
        assert_eq!((out[0].traces, out[0].success, out[0].score), (3, None, None));
        assert_eq!(out[0].series[0].success_rate, None);
    }
}
