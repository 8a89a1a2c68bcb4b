//! The house-rules world of the simulated agent world (a SIMULATION): a shop
//! has `n` house rules its agent is never told, and the agent follows its
//! prompt — its reply states every rule the prompt holds and no other. A reply
//! is judged against all of them: the agent's reward is the share of rules it
//! met, with a comment naming up to four it missed; or, with no reward at all,
//! a `checks` evaluator with one `contains` check per rule judges the reply.
//!
//! Rules are written as `INSIGHT-rule-NN: text` lines, the marker the LLM
//! simulator turns into reflections, so what a round learns is countable: the
//! world recognises a rule in a prompt by its token.

use rand::{Rng, seq::SliceRandom};
use serde_json::{Value, json};

/// Most missing rules an agent's comment names.
pub const MAX_NAMED: usize = 4;

/// Rule `r`'s statement: what a reply that meets it says, and what a prompt that holds it says.
pub fn rule(r: u32) -> String {
    format!("INSIGHT-rule-{r:02}: house rule {r:02} — state the shop's rule {r:02} in every reply")
}

/// What the world looks for in a prompt to know it holds rule `r`.
fn rule_token(r: u32) -> String {
    format!("rule-{r:02}:")
}

/// The rules of `n` that `text` (a prompt) holds.
pub fn rules_in(text: &str, n: u32) -> Vec<u32> {
    (0..n).filter(|&r| text.contains(&rule_token(r))).collect()
}

/// The reply of an agent that follows `prompt`: it answers `task` and states
/// every rule the prompt holds, each on its own line.
pub fn reply(prompt: &str, n: u32, task: &str) -> String {
    let mut out = format!("Answer to {task}.");
    for r in rules_in(prompt, n) {
        out.push('\n');
        out.push_str(&rule(r));
    }
    out
}

/// The agent's own feedback on `reply`: the share of the `n` rules it met as
/// the score, and a comment naming up to [`MAX_NAMED`] missed ones, drawn at random.
pub fn agent_feedback(reply: &str, n: u32, rng: &mut impl Rng) -> Value {
    let mut missed: Vec<u32> = (0..n).filter(|&r| !reply.contains(&rule(r))).collect();
    let score = f64::from(n - missed.len() as u32) / f64::from(n.max(1));
    if missed.is_empty() {
        return json!({"score": score, "comment": "The reply met every house rule."});
    }
    missed.shuffle(rng);
    missed.truncate(MAX_NAMED);
    missed.sort_unstable();
    let named: Vec<String> = missed.iter().map(|&r| rule(r)).collect();
    json!({"score": score, "comment": format!("The reply broke house rules:\n{}", named.join("\n"))})
}

/// A `checks` evaluator with one `contains` check per rule: what judges the
/// replies when agents report nothing.
pub fn evaluators(n: u32) -> Value {
    let checks: Vec<Value> = (0..n).map(|r| json!({"type": "contains", "text": rule(r)})).collect();
    json!({"evaluators": [{"kind": "checks", "name": "house-rules", "checks": checks}]})
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn a_reply_states_the_rules_its_prompt_holds_and_is_scored_on_all() {
        let prompt = format!("You help.\n- {}\n- {}", rule(3), rule(12));
        assert_eq!(rules_in(&prompt, 16), [3, 12]);
        assert!(rules_in(&rule(1), 16) == [1], "rule 1 is not found inside rule 10 and so on");
        let text = reply(&prompt, 16, "task 7");
        assert!(text.starts_with("Answer to task 7.") && text.contains(&rule(3)) && !text.contains(&rule(4)));
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let fb = agent_feedback(&text, 16, &mut rng);
        assert_eq!(fb["score"], 2.0 / 16.0);
        let comment = fb["comment"].as_str().unwrap();
        assert_eq!(comment.matches("INSIGHT-rule-").count(), MAX_NAMED, "{comment}");
        assert!(!comment.contains(&rule(3)) && !comment.contains(&rule(12)), "only missed rules are named");
        let all: String = (0..16).map(|r| format!("{}\n", rule(r))).collect();
        assert_eq!(agent_feedback(&reply(&all, 16, "t"), 16, &mut rng)["score"], 1.0);
        let checks = evaluators(16);
        assert_eq!(checks["evaluators"][0]["checks"].as_array().map(Vec::len), Some(16));
    }
}
