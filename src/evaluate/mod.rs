//! Evaluation of prompt versions on live traffic: confidence intervals over
//! their outcomes, TrueSkill ratings, sticky assignment of agents to arms,
//! and the population's traffic weights, promotion gate and regression guard.
//! Everything here is pure (plain functions over plain data); the store and
//! HTTP layers feed it numbers.

pub mod assign;
pub mod guard;
pub mod outcomes;
pub mod population;
pub mod stats;
pub mod trueskill;
