//! Confidence intervals for per-version outcomes, computed from aggregates a
//! store can return in one query (counts, sums, sums of squares), so the
//! metrics endpoint, the promotion gate and the regression guard all judge
//! evidence the same way. Every interval is two-sided at 95%.

use serde::Serialize;
use utoipa::ToSchema;

/// The standard normal quantile for a two-sided 95% interval.
pub const Z95: f64 = 1.959_963_984_540_054;

/// A closed interval `[low, high]` around an estimate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct Interval {
    pub low: f64,
    pub high: f64,
}

/// A success rate with its Wilson score interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct Rate {
    pub successes: u64,
    pub trials: u64,
    pub rate: f64,
    pub interval: Interval,
}

/// Wilson score interval (95%) for `successes` out of `trials`. It stays
/// inside [0, 1] and behaves at 0 and n successes, unlike the normal
/// approximation. `None` when there are no trials or more successes than trials.
pub fn wilson(successes: u64, trials: u64) -> Option<Rate> {
    if trials == 0 || successes > trials {
        return None;
    }
    let n = trials as f64;
    let p = successes as f64 / n;
    let z2 = Z95 * Z95;
    let denom = 1.0 + z2 / n;
    let centre = (p + z2 / (2.0 * n)) / denom;
    let half = Z95 / denom * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    Some(Rate {
        successes,
        trials,
        rate: p,
        interval: Interval { low: (centre - half).max(0.0), high: (centre + half).min(1.0) },
    })
}

/// Running aggregate of a real-valued outcome (e.g. `feedback.score`):
/// exactly what `COUNT(x), SUM(x), SUM(x*x)` return.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Moments {
    pub count: u64,
    pub sum: f64,
    pub sum_sq: f64,
}

impl Moments {
    pub fn from_values(values: &[f64]) -> Moments {
        values.iter().fold(Moments::default(), |m, &x| Moments {
            count: m.count + 1,
            sum: m.sum + x,
            sum_sq: m.sum_sq + x * x,
        })
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }

    /// Unbiased sample variance; `None` below two observations. Clamped at 0
    /// because `sum_sq - sum²/n` can go slightly negative in floating point.
    pub fn variance(&self) -> Option<f64> {
        if self.count < 2 {
            return None;
        }
        let n = self.count as f64;
        Some(((self.sum_sq - self.sum * self.sum / n) / (n - 1.0)).max(0.0))
    }

    /// Standard error of the mean.
    pub fn standard_error(&self) -> Option<f64> {
        Some((self.variance()? / self.count as f64).sqrt())
    }
}

/// A mean with its 95% interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct Mean {
    pub count: u64,
    pub mean: f64,
    /// Absent below two observations (no spread to estimate).
    pub interval: Option<Interval>,
}

/// Mean with a Student-t 95% interval (mean ± t₀.₉₇₅,ₙ₋₁ · s/√n). The t
/// quantile (rather than the normal 1.96) keeps small windows honest; for large
/// n the two agree. `None` when there are no observations.
pub fn mean_interval(m: &Moments) -> Option<Mean> {
    let mean = m.mean()?;
    let interval = m.standard_error().map(|se| {
        let half = t95(m.count - 1) * se;
        Interval { low: mean - half, high: mean + half }
    });
    Some(Mean { count: m.count, mean, interval })
}

/// Two-sided 95% Student-t quantile for `df` degrees of freedom: exact
/// tabulated values up to 30, then the Cornish–Fisher expansion around the
/// normal quantile (error < 1e-4 from df = 30 on). `df = 0` has no quantile;
/// it is answered with +∞ so an interval from one point is unbounded.
pub fn t95(df: u64) -> f64 {
    const TABLE: [f64; 30] = [
        12.706_204_736,
        4.302_652_730,
        3.182_446_305,
        2.776_445_105,
        2.570_581_836,
        2.446_911_851,
        2.364_624_252,
        2.306_004_135,
        2.262_157_163,
        2.228_138_852,
        2.200_985_160,
        2.178_812_830,
        2.160_368_656,
        2.144_786_688,
        2.131_449_546,
        2.119_905_299,
        2.109_815_578,
        2.100_922_040,
        2.093_024_054,
        2.085_963_447,
        2.079_613_845,
        2.073_873_068,
        2.068_657_610,
        2.063_898_562,
        2.059_538_553,
        2.055_529_439,
        2.051_830_516,
        2.048_407_142,
        2.045_229_642,
        2.042_272_456,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => TABLE[(df - 1) as usize],
        _ => {
            let z = Z95;
            let v = df as f64;
            let (z3, z5, z7) = (z.powi(3), z.powi(5), z.powi(7));
            z + (z3 + z) / (4.0 * v)
                + (5.0 * z5 + 16.0 * z3 + 3.0 * z) / (96.0 * v * v)
                + (3.0 * z7 + 19.0 * z5 + 17.0 * z3 - 15.0 * z) / (384.0 * v * v * v)
        }
    }
}

/// One-sided test that `current` has a lower mean than `reference`: Welch's z
/// statistic (difference over the combined standard error). Positive when
/// `current` is worse. `None` when either side has fewer than two observations.
pub fn drop_z(reference: &Moments, current: &Moments) -> Option<f64> {
    let se = (reference.variance()? / reference.count as f64 + current.variance()? / current.count as f64).sqrt();
    let diff = reference.mean()? - current.mean()?;
    if se == 0.0 {
        return Some(if diff > 0.0 {
            f64::INFINITY
        } else if diff < 0.0 {
            f64::NEG_INFINITY
        } else {
            0.0
        });
    }
    Some(diff / se)
}

/// Complementary error function (Numerical Recipes' Chebyshev fit,
/// |error| < 1.2e-7 — the same approximation the reference `trueskill` package uses).
pub fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + z / 2.0);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

/// Standard normal cumulative distribution.
pub fn normal_cdf(x: f64) -> f64 {
    0.5 * erfc(-x / std::f64::consts::SQRT_2)
}

/// Standard normal density.
pub fn normal_pdf(x: f64) -> f64 {
    (-x * x / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// Inverse of [`erfc`] on (0, 2), by the reference package's method (a
/// rational first guess refined by two Newton steps).
pub fn erfc_inv(y: f64) -> f64 {
    if y >= 2.0 {
        return -100.0;
    }
    if y <= 0.0 {
        return 100.0;
    }
    let zero_point = y < 1.0;
    let y = if zero_point { y } else { 2.0 - y };
    let t = (-2.0 * (y / 2.0).ln()).sqrt();
    let mut x = -std::f64::consts::FRAC_1_SQRT_2 * ((2.30753 + t * 0.27061) / (1.0 + t * (0.99229 + t * 0.04481)) - t);
    for _ in 0..2 {
        let err = erfc(x) - y;
        x += err / (std::f64::consts::FRAC_2_SQRT_PI * (-(x * x)).exp() - x * err);
    }
    if zero_point { x } else { -x }
}

/// Standard normal quantile.
pub fn normal_ppf(p: f64) -> f64 {
    -std::f64::consts::SQRT_2 * erfc_inv(2.0 * p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn wilson_matches_published_values() {
        // Reference values: Wilson (1927) / Newcombe (1998), Table I (95%).
        // 81/263 → 0.2553–0.3662; 15/148 → 0.0624–0.1605; 0/20 → 0–0.1611.
        let r = wilson(81, 263).unwrap();
        assert!(close(r.interval.low, 0.2553, 5e-5) && close(r.interval.high, 0.3662, 5e-5), "{r:?}");
        let r = wilson(15, 148).unwrap();
        assert!(close(r.interval.low, 0.0624, 5e-5) && close(r.interval.high, 0.1605, 5e-5), "{r:?}");
        let r = wilson(0, 20).unwrap();
        assert_eq!(r.interval.low, 0.0);
        assert!(close(r.interval.high, 0.1611, 5e-5), "{r:?}");
        let r = wilson(20, 20).unwrap();
        assert!(close(r.interval.low, 1.0 - 0.1611, 5e-5) && r.interval.high == 1.0, "{r:?}");
    }

    #[test]
    fn wilson_rejects_impossible_counts() {
        assert!(wilson(0, 0).is_none());
        assert!(wilson(3, 2).is_none());
    }

    #[test]
    fn wilson_narrows_with_evidence() {
        let small = wilson(7, 10).unwrap().interval;
        let large = wilson(700, 1000).unwrap().interval;
        assert!(large.high - large.low < (small.high - small.low) / 5.0);
    }

    #[test]
    fn mean_interval_matches_a_hand_computed_t_interval() {
        // x = 1..=5: mean 3, s² = 2.5, se = √0.5, t(4) = 2.776445 → ±1.963243.
        let m = Moments::from_values(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        let got = mean_interval(&m).unwrap();
        assert_eq!(got.mean, 3.0);
        let iv = got.interval.unwrap();
        assert!(close(iv.low, 3.0 - 1.963_243, 1e-6) && close(iv.high, 3.0 + 1.963_243, 1e-6), "{iv:?}");
    }

    #[test]
    fn mean_interval_from_sql_style_aggregates_equals_from_values() {
        let values = [0.2, 0.9, 0.4, 0.4, 1.0, 0.0, 0.75];
        let direct = Moments::from_values(&values);
        let agg = Moments { count: 7, sum: values.iter().sum(), sum_sq: values.iter().map(|x| x * x).sum() };
        assert_eq!(mean_interval(&direct), mean_interval(&agg));
    }

    #[test]
    fn one_point_has_a_mean_but_no_interval() {
        let got = mean_interval(&Moments::from_values(&[0.5])).unwrap();
        assert_eq!((got.mean, got.interval), (0.5, None));
        assert!(mean_interval(&Moments::default()).is_none());
    }

    #[test]
    fn t_quantile_is_continuous_past_the_table_and_tends_to_z() {
        assert!(close(t95(31), 2.039_513, 1e-4), "{}", t95(31));
        assert!(close(t95(60), 2.000_298, 1e-4), "{}", t95(60));
        assert!(close(t95(120), 1.979_930, 1e-4), "{}", t95(120));
        assert!(close(t95(100_000), Z95, 1e-4));
    }

    #[test]
    fn drop_z_is_positive_when_current_is_worse() {
        let before = Moments::from_values(&[0.8, 0.9, 0.85, 0.95, 0.9, 0.8]);
        let after = Moments::from_values(&[0.4, 0.5, 0.45, 0.3, 0.5, 0.4]);
        assert!(drop_z(&before, &after).unwrap() > 5.0);
        assert!(drop_z(&after, &before).unwrap() < -5.0);
        assert!(drop_z(&before, &Moments::from_values(&[1.0])).is_none());
    }

    #[test]
    fn normal_functions_match_known_values() {
        assert!(close(normal_cdf(0.0), 0.5, 1e-7));
        assert!(close(normal_cdf(1.959_964), 0.975, 1e-7));
        assert!(close(normal_pdf(0.0), 0.398_942_280_4, 1e-9));
        assert!(close(normal_ppf(0.975), Z95, 1e-6));
        assert!(close(normal_ppf(0.55), 0.125_661_347, 1e-6));
    }
}
