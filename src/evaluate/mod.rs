//! Evaluation of prompt versions on live traffic: confidence intervals over
//! their outcomes, TrueSkill ratings, sticky assignment of agents to arms,
//! the population's traffic weights and promotion gate, the rater's judgement
//! of a window, and the regression guard's test.
//! Everything here is pure (plain functions over plain data); the store and
//! HTTP layers feed it numbers.

pub mod assign;
pub mod checks;
pub mod evaluators;
pub mod guard;
pub mod outcomes;
pub mod population;
pub mod rater;
pub mod stats;
pub mod trueskill;
