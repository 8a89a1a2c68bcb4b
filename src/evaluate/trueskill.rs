//! TrueSkill ratings of prompt versions (E-SPL's selection signal): a belief
//! N(μ, σ²) about each version's skill, updated from head-to-head outcomes of
//! their rewards. The promotion gate ranks by the conservative score μ − 2σ,
//! exploration by the optimistic μ + 2σ. Pure math; the expected numbers in
//! the tests come from the reference Python package (see
//! `scripts/reference/trueskill_reference.py`).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::stats::{normal_cdf, normal_pdf, normal_ppf};

/// Default prior mean μ₀.
pub const MU0: f64 = 25.0;
/// Default prior deviation σ₀ = μ₀/3.
pub const SIGMA0: f64 = MU0 / 3.0;

/// The environment: how noisy a single outcome is and how fast skill drifts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrueSkill {
    /// Performance noise β (default σ₀/2 = 25/6).
    pub beta: f64,
    /// Dynamics τ added to σ before each update so ratings never freeze (default σ₀/100).
    pub tau: f64,
    /// Probability that two equal versions draw (default 0.10).
    pub draw_probability: f64,
}

impl Default for TrueSkill {
    fn default() -> Self {
        TrueSkill { beta: SIGMA0 / 2.0, tau: SIGMA0 / 100.0, draw_probability: 0.10 }
    }
}

/// A version's skill belief.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Rating {
    pub mu: f64,
    pub sigma: f64,
}

impl Default for Rating {
    fn default() -> Self {
        Rating { mu: MU0, sigma: SIGMA0 }
    }
}

impl Rating {
    /// μ − 2σ: what the gate trusts (a version must be good *and* well measured).
    pub fn conservative(&self) -> f64 {
        self.mu - 2.0 * self.sigma
    }

    /// μ + 2σ: what exploration chases (a version that might be best).
    pub fn optimistic(&self) -> f64 {
        self.mu + 2.0 * self.sigma
    }

    /// Prior of a mutated child (a learning round's output): the parent's
    /// mean, with extra uncertainty: σ = √(σ_parent² + 1).
    pub fn mutated_child(&self) -> Rating {
        Rating { mu: self.mu, sigma: (self.sigma * self.sigma + 1.0).sqrt() }
    }

    /// Prior of a crossover child: the precision-weighted mean of the
    /// parents, σ = √(1/Σσᵢ⁻² + 1). `None` without parents or with a
    /// non-positive σ.
    pub fn crossover_child(parents: &[Rating]) -> Option<Rating> {
        if parents.is_empty() || parents.iter().any(|p| p.sigma.is_nan() || p.sigma <= 0.0) {
            return None;
        }
        let precision: f64 = parents.iter().map(|p| 1.0 / (p.sigma * p.sigma)).sum();
        let mu = parents.iter().map(|p| p.mu / (p.sigma * p.sigma)).sum::<f64>() / precision;
        Some(Rating { mu, sigma: (1.0 / precision + 1.0).sqrt() })
    }
}

/// The outcome of one comparison between `a` and `b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    AWins,
    BWins,
    Draw,
}

impl TrueSkill {
    /// Draw margin ε for a 1-vs-1 comparison: Φ⁻¹((p_draw + 1)/2) · √2 · β.
    pub fn draw_margin(&self) -> f64 {
        normal_ppf((self.draw_probability + 1.0) / 2.0) * std::f64::consts::SQRT_2 * self.beta
    }

    /// Updates two ratings after one comparison (the exact 2-player TrueSkill
    /// update; the reference package's factor graph reduces to it for two
    /// single-player teams).
    pub fn rate_1vs1(&self, a: Rating, b: Rating, outcome: Outcome) -> (Rating, Rating) {
        let (winner, loser, drawn, swapped) = match outcome {
            Outcome::AWins => (a, b, false, false),
            Outcome::BWins => (b, a, false, true),
            Outcome::Draw => (a, b, true, false),
        };
        let tau2 = self.tau * self.tau;
        let var_w = winner.sigma * winner.sigma + tau2;
        let var_l = loser.sigma * loser.sigma + tau2;
        let c2 = 2.0 * self.beta * self.beta + var_w + var_l;
        let c = c2.sqrt();
        let t = (winner.mu - loser.mu) / c;
        let e = self.draw_margin() / c;
        let (v, w) = if drawn { v_w_draw(t, e) } else { v_w_win(t, e) };
        let winner2 = Rating { mu: winner.mu + var_w / c * v, sigma: (var_w * (1.0 - var_w / c2 * w)).sqrt() };
        let loser2 = Rating { mu: loser.mu - var_l / c * v, sigma: (var_l * (1.0 - var_l / c2 * w)).sqrt() };
        if swapped { (loser2, winner2) } else { (winner2, loser2) }
    }
}

/// A Gaussian in natural parameters (precision π = 1/σ², precision-mean τ = μ/σ²);
/// π = 0 is the uniform "no information" message.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Gaussian {
    pi: f64,
    tau: f64,
}

impl Gaussian {
    const UNIFORM: Gaussian = Gaussian { pi: 0.0, tau: 0.0 };
    fn from_mu_var(mu: f64, var: f64) -> Gaussian {
        Gaussian { pi: 1.0 / var, tau: mu / var }
    }
    fn mu(self) -> f64 {
        if self.pi == 0.0 { 0.0 } else { self.tau / self.pi }
    }
    fn var(self) -> f64 {
        if self.pi == 0.0 { f64::INFINITY } else { 1.0 / self.pi }
    }
    fn mul(self, o: Gaussian) -> Gaussian {
        Gaussian { pi: self.pi + o.pi, tau: self.tau + o.tau }
    }
    fn div(self, o: Gaussian) -> Gaussian {
        Gaussian { pi: self.pi - o.pi, tau: self.tau - o.tau }
    }
    /// The message for `a ± b` of two independent Gaussians (`sign` = ±1).
    fn sum(a: Gaussian, b: Gaussian, sign: f64) -> Gaussian {
        if a.pi == 0.0 || b.pi == 0.0 {
            return Gaussian::UNIFORM;
        }
        Gaussian::from_mu_var(a.mu() + sign * b.mu(), a.var() + b.var())
    }
    /// How far `self` moved from `old` (the reference package's convergence measure).
    fn delta(self, old: Gaussian) -> f64 {
        let pi_delta = (self.pi - old.pi).abs();
        if pi_delta.is_infinite() { 0.0 } else { (self.tau - old.tau).abs().max(pi_delta.sqrt()) }
    }
}

impl TrueSkill {
    /// Updates the ratings of several versions from one ranking of them (a
    /// free-for-all: `ranks[i]` is version i's place, lower is better, equal
    /// ranks are draws), by expectation propagation on the TrueSkill factor
    /// graph with the reference package's schedule (sweeps along the chain of
    /// adjacent differences until no message moves by more than 1e-4, at most
    /// 10 sweeps). With two players it equals [`TrueSkill::rate_1vs1`].
    /// Returns the ratings in the input order; `None` with fewer than two
    /// players, a length mismatch, or a non-positive σ.
    pub fn rate_ranking(&self, ratings: &[Rating], ranks: &[u32]) -> Option<Vec<Rating>> {
        let n = ratings.len();
        if n < 2 || ranks.len() != n || ratings.iter().any(|r| r.sigma.is_nan() || r.sigma <= 0.0) {
            return None;
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| ranks[i]);
        let tau2 = self.tau * self.tau;
        let beta2 = self.beta * self.beta;
        // Skill priors (with dynamics) and the performance messages they imply.
        let skill_prior: Vec<Gaussian> = order
            .iter()
            .map(|&i| Gaussian::from_mu_var(ratings[i].mu, ratings[i].sigma * ratings[i].sigma + tau2))
            .collect();
        let perf_prior: Vec<Gaussian> =
            skill_prior.iter().map(|g| Gaussian::from_mu_var(g.mu(), g.var() + beta2)).collect();
        let margin = self.draw_margin();
        let drawn: Vec<bool> = (0..n - 1).map(|k| ranks[order[k]] == ranks[order[k + 1]]).collect();
        let m = n - 1;
        let (mut to_diff, mut trunc) = (vec![Gaussian::UNIFORM; m], vec![Gaussian::UNIFORM; m]);
        let (mut to_left, mut to_right) = (vec![Gaussian::UNIFORM; m], vec![Gaussian::UNIFORM; m]);
        // Performance i without diff factor k's message.
        let left_cavity = |k: usize, to_right: &[Gaussian]| {
            if k > 0 { perf_prior[k].mul(to_right[k - 1]) } else { perf_prior[k] }
        };
        let right_cavity = |k: usize, to_left: &[Gaussian]| {
            if k + 1 < m { perf_prior[k + 1].mul(to_left[k + 1]) } else { perf_prior[k + 1] }
        };
        let truncate = |k: usize, cavity: Gaussian, old: Gaussian| -> (Gaussian, f64) {
            let sqrt_pi = cavity.pi.sqrt();
            let (t, e) = (cavity.tau / sqrt_pi, margin * sqrt_pi);
            let (v, w) = if drawn[k] { v_w_draw(t, e) } else { v_w_win(t, e) };
            let denom = 1.0 - w;
            let marginal = Gaussian { pi: cavity.pi / denom, tau: (cavity.tau + sqrt_pi * v) / denom };
            (marginal.div(cavity), marginal.delta(old.mul(cavity)))
        };
        let step = |k: usize,
                    to_diff: &mut Vec<Gaussian>,
                    trunc: &mut Vec<Gaussian>,
                    to_left: &[Gaussian],
                    to_right: &[Gaussian]|
         -> f64 {
            to_diff[k] = Gaussian::sum(left_cavity(k, to_right), right_cavity(k, to_left), -1.0);
            let (msg, delta) = truncate(k, to_diff[k], trunc[k]);
            trunc[k] = msg;
            delta
        };
        for _ in 0..10 {
            let mut delta: f64 = 0.0;
            if m == 1 {
                delta = step(0, &mut to_diff, &mut trunc, &to_left, &to_right);
            } else {
                for k in 0..m - 1 {
                    delta = delta.max(step(k, &mut to_diff, &mut trunc, &to_left, &to_right));
                    // Up to the right performance: p_{k+1} = p_k − d_k.
                    to_right[k] = Gaussian::sum(left_cavity(k, &to_right), trunc[k], -1.0);
                }
                for k in (1..m).rev() {
                    delta = delta.max(step(k, &mut to_diff, &mut trunc, &to_left, &to_right));
                    // Up to the left performance: p_k = d_k + p_{k+1}.
                    to_left[k] = Gaussian::sum(trunc[k], right_cavity(k, &to_left), 1.0);
                }
            }
            if delta <= 1e-4 {
                break;
            }
        }
        to_left[0] = Gaussian::sum(trunc[0], right_cavity(0, &to_left), 1.0);
        to_right[m - 1] = Gaussian::sum(left_cavity(m - 1, &to_right), trunc[m - 1], -1.0);
        let mut out = vec![Rating::default(); n];
        for (pos, &i) in order.iter().enumerate() {
            let mut from_diffs = Gaussian::UNIFORM;
            if pos < m {
                from_diffs = from_diffs.mul(to_left[pos]);
            }
            if pos > 0 {
                from_diffs = from_diffs.mul(to_right[pos - 1]);
            }
            // Performance → skill: add β² to the variance.
            let a = 1.0 / (1.0 + beta2 * from_diffs.pi);
            let skill = skill_prior[pos].mul(Gaussian { pi: a * from_diffs.pi, tau: a * from_diffs.tau });
            out[i] = Rating { mu: skill.mu(), sigma: skill.var().sqrt() };
        }
        Some(out)
    }
}

/// Ranks (0 = best) for arms by their rewards, higher reward better, with
/// E-SPL's tie rule: a reward within `tie` (0.01 in the paper) of the best
/// reward of the current rank shares that rank. Non-finite rewards rank last.
pub fn ranks_from_rewards(rewards: &[f64], tie: f64) -> Vec<u32> {
    let key = |x: f64| if x.is_finite() { x } else { f64::NEG_INFINITY };
    let mut order: Vec<usize> = (0..rewards.len()).collect();
    order.sort_by(|&a, &b| key(rewards[b]).total_cmp(&key(rewards[a])));
    let mut ranks = vec![0; rewards.len()];
    let (mut rank, mut top) = (0u32, f64::NAN);
    for (pos, &i) in order.iter().enumerate() {
        let r = key(rewards[i]);
        if pos > 0 && top - r > tie {
            rank += 1;
        }
        if pos == 0 || rank != ranks[order[pos - 1]] {
            top = r;
        }
        ranks[i] = rank;
    }
    ranks
}

/// Additive and multiplicative corrections for a win by margin `t` with draw margin `e`.
fn v_w_win(t: f64, e: f64) -> (f64, f64) {
    let x = t - e;
    let denom = normal_cdf(x);
    // Far in the tail Φ underflows; the limit of pdf/cdf there is -x.
    let v = if denom > 0.0 { normal_pdf(x) / denom } else { -x };
    (v, (v * (v + x)).clamp(0.0, 1.0))
}

/// Corrections for a draw; `t` may be negative (the first player is the weaker).
fn v_w_draw(t: f64, e: f64) -> (f64, f64) {
    let abs_t = t.abs();
    let (a, b) = (e - abs_t, -e - abs_t);
    let denom = normal_cdf(a) - normal_cdf(b);
    let v_abs = if denom > 0.0 { (normal_pdf(b) - normal_pdf(a)) / denom } else { a };
    let w = if denom > 0.0 { v_abs * v_abs + (a * normal_pdf(a) - b * normal_pdf(b)) / denom } else { 1.0 };
    (if t < 0.0 { -v_abs } else { v_abs }, w.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (μa, σa, μb, σb, drawn, μa', σa', μb', σb') from the reference package
    /// `trueskill` 0.4.5 (PyPI) with its default environment, printed by
    /// `target/tsvenv/bin/python scripts/reference/trueskill_reference.py`
    /// (venv: `python3 -m venv target/tsvenv && target/tsvenv/bin/pip install trueskill==0.4.5`).
    /// Player a wins unless drawn.
    #[allow(clippy::type_complexity)]
    const REFERENCE: [(f64, f64, f64, f64, bool, f64, f64, f64, f64); 9] = [
        (
            25.0,
            8.333333333333334,
            25.0,
            8.333333333333334,
            false,
            29.39583201999916,
            7.171475587326195,
            20.604167980000835,
            7.171475587326195,
        ),
        (
            25.0,
            8.333333333333334,
            25.0,
            8.333333333333334,
            true,
            25.000000000000004,
            6.457519662317322,
            25.000000000000004,
            6.457519662317322,
        ),
        (30.0, 4.0, 20.0, 6.0, false, 30.497985183823246, 3.8610860699163525, 18.87980339343881, 5.5178027339804405),
        (20.0, 6.0, 30.0, 4.0, false, 26.376164236115052, 4.876572235266755, 27.16546604353998, 3.6865661489906367),
        (30.0, 4.0, 20.0, 6.0, true, 28.158407036637964, 3.613739154249254, 24.142585472898993, 4.5924643555483655),
        (20.0, 6.0, 30.0, 4.0, true, 24.142585472898993, 4.5924643555483655, 28.158407036637957, 3.6137391542492536),
        (27.5, 1.2, 26.0, 1.5, false, 27.668425054280842, 1.1890165760245766, 25.737290542132495, 1.4751977723583563),
        (
            25.0,
            8.333333333333334,
            35.0,
            1.0,
            false,
            35.58533549037189,
            5.698529751458709,
            34.846527982591354,
            0.9995855859393523,
        ),
        (10.0, 3.0, 40.0, 3.0, false, 15.517151409033254, 2.7448859850423992, 34.482848590966746, 2.7448859850423992),
    ];

    #[test]
    fn one_vs_one_matches_the_reference_package() {
        let env = TrueSkill::default();
        for (mu_a, s_a, mu_b, s_b, drawn, want_mu_a, want_s_a, want_mu_b, want_s_b) in REFERENCE {
            let outcome = if drawn { Outcome::Draw } else { Outcome::AWins };
            let (a, b) = env.rate_1vs1(Rating { mu: mu_a, sigma: s_a }, Rating { mu: mu_b, sigma: s_b }, outcome);
            for (got, want, what) in
                [(a.mu, want_mu_a, "μa"), (a.sigma, want_s_a, "σa"), (b.mu, want_mu_b, "μb"), (b.sigma, want_s_b, "σb")]
            {
                assert!(
                    (got - want).abs() < 1e-6,
                    "{what}: got {got}, want {want} for ({mu_a}, {s_a}) vs ({mu_b}, {s_b}) drawn={drawn}"
                );
            }
        }
    }

    #[test]
    fn b_wins_is_a_wins_mirrored() {
        let env = TrueSkill::default();
        let (x, y) = (Rating { mu: 28.0, sigma: 3.0 }, Rating { mu: 22.0, sigma: 5.0 });
        let (a1, b1) = env.rate_1vs1(x, y, Outcome::BWins);
        let (b2, a2) = env.rate_1vs1(y, x, Outcome::AWins);
        assert_eq!((a1, b1), (a2, b2));
        assert!(b1.mu > y.mu && a1.mu < x.mu);
    }

    #[test]
    fn repeated_wins_raise_the_conservative_score_above_the_loser() {
        let env = TrueSkill::default();
        let (mut good, mut bad) = (Rating::default(), Rating::default());
        for _ in 0..20 {
            (good, bad) = env.rate_1vs1(good, bad, Outcome::AWins);
        }
        assert!(good.conservative() > bad.optimistic(), "{good:?} vs {bad:?}");
        assert!(good.sigma < SIGMA0 && bad.sigma < SIGMA0);
    }

    #[test]
    fn defaults_are_the_e_spl_parameters() {
        let env = TrueSkill::default();
        assert!((env.beta - 25.0 / 6.0).abs() < 1e-12 && (env.tau - 25.0 / 300.0).abs() < 1e-12);
        assert_eq!(env.draw_probability, 0.10);
        let r = Rating::default();
        assert!((r.conservative() - (25.0 - 50.0 / 3.0)).abs() < 1e-12);
    }

    #[test]
    fn child_priors_follow_the_issue() {
        let parent = Rating { mu: 30.0, sigma: 2.0 };
        let child = parent.mutated_child();
        assert_eq!(child.mu, 30.0);
        assert!((child.sigma - 5f64.sqrt()).abs() < 1e-12);

        // Precisions 1/4 and 1/1: μ = (30/4 + 20/1)/(1.25) = 22, σ = √(1/1.25 + 1).
        let x = Rating::crossover_child(&[parent, Rating { mu: 20.0, sigma: 1.0 }]).unwrap();
        assert!((x.mu - 22.0).abs() < 1e-12);
        assert!((x.sigma - (0.8f64 + 1.0).sqrt()).abs() < 1e-12);
        assert!(Rating::crossover_child(&[]).is_none());
    }

    /// Rankings from the same script (second block of its output): (ratings, ranks, reference result).
    #[allow(clippy::type_complexity)]
    const RANKINGS: [(&[(f64, f64)], &[u32], &[(f64, f64)]); 5] = [
        (
            &[(25.0, 8.333333333333334), (25.0, 8.333333333333334), (25.0, 8.333333333333334)],
            &[0, 1, 2],
            &[
                (31.675352419171958, 6.655985377620712),
                (25.00000000000392, 6.207896641224336),
                (18.32464758082412, 6.65598537762185),
            ],
        ),
        (
            &[
                (25.0, 8.333333333333334),
                (25.0, 8.333333333333334),
                (25.0, 8.333333333333334),
                (25.0, 8.333333333333334),
            ],
            &[0, 1, 2, 3],
            &[
                (33.20668096563102, 6.348109169807742),
                (27.40145469384325, 5.7871629348447815),
                (22.598545306188456, 5.78716293484137),
                (16.7933190343615, 6.348109169814532),
            ],
        ),
        (
            &[
                (25.0, 8.333333333333334),
                (25.0, 8.333333333333334),
                (25.0, 8.333333333333334),
                (25.0, 8.333333333333334),
            ],
            &[1, 0, 1, 2],
            &[
                (24.99309357445012, 5.559361854854173),
                (31.563972498314694, 6.404703459289884),
                (25.006906425490623, 5.559361854854239),
                (18.436027501744583, 6.404703459346161),
            ],
        ),
        (
            &[(30.0, 2.0), (25.0, 8.333333333333334), (26.0, 1.0), (22.0, 4.0)],
            &[3, 0, 1, 2],
            &[
                (28.513975041390694, 1.8995573128225256),
                (33.51157962019091, 5.686943490550222),
                (26.15436193717077, 0.9897996877467929),
                (23.520828086193294, 3.22737811012328),
            ],
        ),
        (
            &[(27.0, 3.0), (29.0, 5.24), (25.0, 8.0), (25.0, 8.0), (25.0, 8.0)],
            &[0, 0, 1, 2, 2],
            &[
                (28.10644980673181, 2.7257590734600177),
                (29.773006033686745, 3.9318375613105006),
                (24.803900993786314, 4.9886858822101425),
                (20.26054164236318, 5.225225833044236),
                (20.271169404316325, 5.230175087169144),
            ],
        ),
    ];

    #[test]
    fn rankings_match_the_reference_package() {
        let env = TrueSkill::default();
        for (ratings, ranks, want) in RANKINGS {
            let input: Vec<Rating> = ratings.iter().map(|&(mu, sigma)| Rating { mu, sigma }).collect();
            let got = env.rate_ranking(&input, ranks).unwrap();
            for (g, &(mu, sigma)) in got.iter().zip(want) {
                assert!(
                    (g.mu - mu).abs() < 1e-6 && (g.sigma - sigma).abs() < 1e-6,
                    "{got:?} vs {want:?} for {ranks:?}"
                );
            }
        }
    }

    #[test]
    fn a_ranking_of_two_is_the_one_vs_one_update() {
        let env = TrueSkill::default();
        let (a, b) = (Rating { mu: 30.0, sigma: 4.0 }, Rating { mu: 20.0, sigma: 6.0 });
        let got = env.rate_ranking(&[b, a], &[1, 0]).unwrap();
        let (wa, wb) = env.rate_1vs1(a, b, Outcome::AWins);
        assert!((got[1].mu - wa.mu).abs() < 1e-9 && (got[0].sigma - wb.sigma).abs() < 1e-9);
        assert!(env.rate_ranking(&[a], &[0]).is_none());
        assert!(env.rate_ranking(&[a, b], &[0]).is_none());
    }

    #[test]
    fn rewards_within_the_tie_margin_share_a_rank() {
        assert_eq!(ranks_from_rewards(&[0.5, 0.9, 0.895, 0.7], 0.01), vec![2, 0, 0, 1]);
        // Ties do not chain: 0.9 ties 0.895 but 0.888 is more than 0.01 below the best.
        assert_eq!(ranks_from_rewards(&[0.9, 0.895, 0.888], 0.01), vec![0, 0, 1]);
        assert_eq!(ranks_from_rewards(&[f64::NAN, 0.1], 0.01), vec![1, 0]);
        assert!(ranks_from_rewards(&[], 0.01).is_empty());
    }
}
