//! How the SIMULATED LLM answers combee's own prompts, by rule (see the
//! [`super::llm`] module doc for the model: insight markers, the capacity models,
//! answer shapes): finding markers, the capacity draws, and one answer per task.
//! Pure functions of the request and the configuration, so a benchmark can
//! replay the simulator in process ([`super::llm::simulated_answer`]).

use std::collections::{BTreeMap, HashSet};

use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::model::{CapacityModel, SimConfig, expected_kept};
use crate::domain::{BulletTag, BulletTagKind, DeltaOp, Reflection};
use crate::learn::merge::level2::{Action, Decision, DecisionsAnswer};
use crate::learn::prompts::{checks::InstructionAnswer, task::Task};

#[derive(Deserialize)]
pub(super) struct SimRequest {
    #[serde(default)]
    pub(super) model: String,
    pub(super) messages: Vec<SimMessage>,
    #[serde(default)]
    pub(super) seed: Option<u64>,
}

#[derive(Deserialize)]
pub(super) struct SimMessage {
    pub(super) role: String,
    pub(super) content: String,
}

pub(super) fn hash(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().into()
}

pub(super) fn hash_u64(parts: &[&[u8]]) -> u64 {
    let h = hash(parts);
    u64::from_be_bytes([h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]])
}

/// A uniform draw in [0, 1).
pub(super) fn unit(parts: &[&[u8]]) -> f64 {
    (hash_u64(parts) >> 11) as f64 / (1u64 << 53) as f64
}

/// One insight marker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Insight {
    pub(super) token: String,
    pub(super) text: String,
}

impl Insight {
    pub(super) fn marker(&self) -> String {
        format!("INSIGHT-{}: {}", self.token, self.text)
    }
}

pub(super) fn is_token_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'-'
}

/// Distinct insight markers in order of first appearance.
pub(super) fn insights(text: &str) -> Vec<Insight> {
    let mut out: Vec<Insight> = Vec::new();
    let b = text.as_bytes();
    for (i, _) in text.match_indices("INSIGHT-") {
        // A marker starts a word; `\n`-style escapes count as a break (markers inside JSON strings).
        let escaped = i >= 2 && b[i - 2] == b'\\' && matches!(b[i - 1], b'n' | b'r' | b't');
        if i > 0 && is_token_byte(b[i - 1]) && !escaped {
            continue;
        }
        let start = i + "INSIGHT-".len();
        let len = b[start..].iter().take_while(|c| is_token_byte(**c)).count();
        if len == 0 || b.get(start + len) != Some(&b':') {
            continue;
        }
        let token = &text[start..start + len];
        let rest = &text[start + len + 1..];
        let end = rest.find(['\n', '\r', '"', '\\']).unwrap_or(rest.len());
        let body = rest[..end].trim();
        if body.is_empty() || out.iter().any(|x| x.token == token) {
            continue;
        }
        out.push(Insight { token: token.to_owned(), text: body.to_owned() });
    }
    out
}

/// The attributes and body of the first `<tag …>…</tag>` fence.
fn fenced<'a>(text: &'a str, tag: &str) -> Option<(&'a str, &'a str)> {
    let open = format!("<{tag}");
    let mut from = 0;
    loop {
        let start = from + text[from..].find(&open)?;
        let after = &text[start + open.len()..];
        if after.starts_with(['>', ' ']) {
            let gt = after.find('>')?;
            let body = &after[gt + 1..];
            let end = body.find(&format!("</{tag}>")).unwrap_or(body.len());
            return Some((&after[..gt], &body[..end]));
        }
        from = start + open.len();
    }
}

pub(super) fn count_attr(attrs: &str) -> Option<usize> {
    let rest = attrs.split_once("count=\"")?.1;
    rest.split_once('"')?.0.parse().ok()
}

/// The labelled part of a rendered trace between `--- name ---` and the next label.
fn trace_part<'a>(trace: &'a str, name: &str) -> &'a str {
    let label = format!("--- {name} ---\n");
    let Some((_, rest)) = trace.split_once(&label) else { return "" };
    match rest.find("\n--- ") {
        Some(end) => &rest[..end],
        None => rest,
    }
}

/// How many new insights a call with `items` inputs keeps: K, or max(1, floor(K·D/n)) when n > D.
pub fn capacity(cfg: &SimConfig, items: usize) -> usize {
    if items <= cfg.digest_reflections {
        cfg.capacity_k
    } else {
        (cfg.capacity_k.saturating_mul(cfg.digest_reflections) / items).max(1).min(cfg.capacity_k.max(1))
    }
}

/// How many new insights a combining call (merge, consolidate) over `items` level-1
/// updates keeps: K per item up to D items, max(1, floor(K·D·D/n)) when n > D.
pub fn combine_capacity(cfg: &SimConfig, items: usize) -> usize {
    let (k, d) = (cfg.capacity_k, cfg.digest_reflections);
    if items <= d { k.saturating_mul(items.max(1)) } else { (k.saturating_mul(d).saturating_mul(d) / items).max(1) }
}

/// Keeps the `capacity` best-ranked candidates (seeded hash rank), in their original order.
pub(super) fn keep(seed: u64, digest: &[u8; 32], candidates: Vec<Insight>, capacity: usize) -> Vec<Insight> {
    let mut ranked: Vec<(u64, usize)> = candidates
        .iter()
        .enumerate()
        .map(|(i, c)| (hash_u64(&[b"keep", &seed.to_le_bytes(), digest, c.token.as_bytes()]), i))
        .collect();
    ranked.sort();
    let chosen: HashSet<usize> = ranked.into_iter().take(capacity).map(|(_, i)| i).collect();
    candidates.into_iter().enumerate().filter(|(i, _)| chosen.contains(i)).map(|(_, c)| c).collect()
}

/// The soft model: each of the m candidates (the new insights the call must write)
/// is kept independently with probability E(m)/m, drawn from a seeded hash.
pub(super) fn keep_soft(seed: u64, digest: &[u8; 32], candidates: Vec<Insight>, k: usize) -> Vec<Insight> {
    let m = candidates.len();
    if m == 0 {
        return candidates;
    }
    let p = expected_kept(k, m) / m as f64;
    candidates
        .into_iter()
        .filter(|c| unit(&[b"keep-soft", &seed.to_le_bytes(), digest, c.token.as_bytes()]) < p)
        .collect()
}

/// The `combee-task:` name of the crossover template (not one of the round's [`Task`]s).
pub(super) const CROSSOVER_TASK: &str = "crossover";

pub(super) fn is_crossover(req: &SimRequest) -> bool {
    req.messages
        .iter()
        .filter(|m| m.role == "system")
        .flat_map(|m| m.content.lines())
        .any(|l| l.strip_prefix("combee-task:").is_some_and(|t| t.trim() == CROSSOVER_TASK))
}

/// The `combee-task:` name of the judge template (not one of the round's [`Task`]s).
pub(super) const JUDGE_TASK: &str = "judge";

pub(super) fn is_judge(req: &SimRequest) -> bool {
    req.messages
        .iter()
        .filter(|m| m.role == "system")
        .flat_map(|m| m.content.lines())
        .any(|l| l.strip_prefix("combee-task:").is_some_and(|t| t.trim() == JUDGE_TASK))
}

/// The simulated judge's answer (see `SimConfig::judge_accuracy`): the
/// reply is the text after "The agent's reply:" in the fenced trace; the
/// right verdict is whether it equals one of the rubric's quoted texts; the
/// verdict given is right with probability `judge_accuracy`, drawn from the
/// request's content.
pub(super) fn judge_answer(cfg: &SimConfig, system: &str, user: &str) -> serde_json::Value {
    let rubric = fenced(system, "rubric").map_or("", |(_, body)| body);
    let wanted: Vec<&str> = rubric.split('"').skip(1).step_by(2).filter(|q| !q.is_empty()).collect();
    let body = fenced(user, "untrusted-trace-data").map_or("", |(_, body)| body);
    let reply = body.split_once("The agent's reply:").map_or("", |(_, r)| r).trim();
    let right = wanted.contains(&reply);
    let correct = unit(&[b"judge", &cfg.seed.to_le_bytes(), user.as_bytes()]) < cfg.judge_accuracy;
    let pass = right == correct;
    let critique = if pass {
        String::new()
    } else {
        format!("simulated judge: the reply should have been {}", wanted.first().map_or("different", |w| w))
    };
    serde_json::json!({"score": if pass { 1.0 } else { 0.0 }, "critique": critique})
}

/// The crossover answer: import each winner bullet whose insight the champion
/// lacks (the first bullet per insight), drop nothing.
pub(super) fn crossover_selection(user: &str, present: &HashSet<String>) -> serde_json::Value {
    let body = fenced(user, "untrusted-arms").map_or("", |(_, body)| body);
    let mut seen: HashSet<String> = HashSet::new();
    let mut import = Vec::new();
    for line in body.lines() {
        let mut parts = line.splitn(4, " | ");
        let (Some(id), Some(_section), Some(_counters), Some(content)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if !id.starts_with('v') || !id.contains(":b-") {
            continue;
        }
        let fresh: Vec<String> = insights(content)
            .into_iter()
            .map(|i| i.token)
            .filter(|t| !present.contains(t) && !seen.contains(t))
            .collect();
        if !fresh.is_empty() {
            seen.extend(fresh);
            import.push(id.to_owned());
        }
    }
    json!({"drop": [], "import": import, "reason": "simulated: import every winner lesson the champion lacks"})
}

pub(super) fn task_of(req: &SimRequest) -> Option<Task> {
    req.messages
        .iter()
        .filter(|m| m.role == "system")
        .flat_map(|m| m.content.lines())
        .find_map(|l| l.strip_prefix("combee-task:"))
        .and_then(|t| Task::parse(t.trim()))
}

/// The latency model: `fixed_ms + per_input_token_ms·prompt_tokens + per_output_token_ms·completion_tokens`
/// (faults aside). Public so a benchmark can predict a round's time from token counts alone.
pub fn latency_ms(cfg: &SimConfig, prompt_tokens: u64, completion_tokens: u64) -> f64 {
    cfg.fixed_ms + cfg.per_input_token_ms * prompt_tokens as f64 + cfg.per_output_token_ms * completion_tokens as f64
}

/// What the simulator answers to `messages` (no latency, no faults, no request seed):
/// the recognised task and the answer text. Public so a benchmark can replay the
/// simulator in process and model its latency without waiting for it.
pub fn simulated_answer(cfg: &SimConfig, messages: &[crate::llm::ChatMessage]) -> (Option<Task>, String) {
    let messages = messages
        .iter()
        .map(|m| SimMessage {
            role: match m.role {
                crate::llm::ChatRole::System => "system",
                crate::llm::ChatRole::User => "user",
                crate::llm::ChatRole::Assistant => "assistant",
            }
            .to_owned(),
            content: m.content.clone(),
        })
        .collect();
    answer(cfg, &SimRequest { model: String::new(), messages, seed: None })
}

/// Reshapes a well-formed answer the way real models do, each shape drawn
/// independently per request against its rate; returns the text and the shapes applied.
pub(super) fn shape_answer(cfg: &SimConfig, n: u64, task: Task, answer: String) -> (String, Vec<&'static str>) {
    let drawn = |name: &'static str, rate: f64| {
        (rate > 0.0 && unit(&[b"shape", name.as_bytes(), &cfg.seed.to_le_bytes(), &n.to_le_bytes()]) < rate)
            .then_some(name)
    };
    let shapes: Vec<&'static str> = [
        drawn("unknown_ids", cfg.rate_unknown_ids),
        drawn("extra_keys", cfg.rate_extra_keys),
        drawn("think", cfg.rate_think),
        drawn("fence", cfg.rate_fence),
        drawn("preamble", cfg.rate_preamble),
    ]
    .into_iter()
    .flatten()
    .collect();
    if shapes.is_empty() {
        return (answer, shapes);
    }
    let Ok(serde_json::Value::Object(mut obj)) = serde_json::from_str::<serde_json::Value>(&answer) else {
        return (answer, Vec::new());
    };
    if shapes.contains(&"unknown_ids") {
        match task {
            Task::Reflect => {
                if let Some(serde_json::Value::Array(tags)) = obj.get_mut("bullet_tags") {
                    tags.push(json!({"id": "b-9999", "tag": "helpful"}));
                }
            }
            Task::AggregatePlaybook => {
                if let Some(serde_json::Value::Array(ops)) = obj.get_mut("operations") {
                    if let Some(serde_json::Value::Object(first)) = ops.first_mut()
                        && let Some(serde_json::Value::Array(sources)) = first.get_mut("sources")
                    {
                        sources.push(json!(999));
                    }
                    ops.push(json!({"op": "UPDATE", "id": "b-9999", "content": "Simulated edit of a bullet that does not exist",
                                    "reason": "simulated unknown id", "sources": [1]}));
                }
            }
            _ => {}
        }
    }
    if shapes.contains(&"extra_keys") {
        obj.insert("confidence".into(), json!(0.87));
        obj.insert("notes".into(), json!("simulated extra key"));
        for list in ["operations", "decisions", "bullet_tags"] {
            if let Some(serde_json::Value::Array(items)) = obj.get_mut(list) {
                for item in items.iter_mut().filter_map(serde_json::Value::as_object_mut) {
                    item.insert("priority".into(), json!("high"));
                }
            }
        }
    }
    let mut text = serde_json::to_string(&obj).unwrap_or_default();
    if shapes.contains(&"fence") {
        text = format!("```json\n{}\n```", serde_json::to_string_pretty(&obj).unwrap_or_default());
    }
    if shapes.contains(&"preamble") {
        text = format!("Here is my answer, based on the data above:\n\n{text}\n\nLet me know if anything is unclear.");
    }
    if shapes.contains(&"think") {
        text = format!(
            "<think>\nThe user wants JSON. A first draft: {{\"draft\": true}}. Let me check it again.\n</think>\n{text}"
        );
    }
    (text, shapes)
}

/// `[reflection N]` sections of a reflections fence: (N, section text).
pub(super) fn reflection_sections(body: &str) -> Vec<(usize, &str)> {
    let starts: Vec<(usize, usize)> = body
        .match_indices("[reflection ")
        .filter(|(i, _)| *i == 0 || body.as_bytes()[i - 1] == b'\n')
        .filter_map(|(i, m)| {
            let rest = &body[i + m.len()..];
            let close = rest.find(']')?;
            Some((i, rest[..close].parse().ok()?))
        })
        .collect();
    starts
        .iter()
        .enumerate()
        .map(|(j, &(at, n))| (n, &body[at..starts.get(j + 1).map_or(body.len(), |next| next.0)]))
        .collect()
}

/// The recognised task and the answer text (before any fault).
pub(super) fn answer(cfg: &SimConfig, req: &SimRequest) -> (Option<Task>, String) {
    let user = req.messages.iter().find(|m| m.role == "user").map_or("", |m| m.content.as_str());
    let seed = cfg.seed ^ req.seed.unwrap_or(0).rotate_left(17);
    let digest = hash(&[user.as_bytes()]);
    let current = fenced(user, "current-prompt").map_or("", |(_, body)| body.trim());
    let present: HashSet<String> = insights(current).into_iter().map(|i| i.token).collect();
    // New insights of an input fence, capped by the capacity model.
    let kept = |tag: &str| -> Vec<Insight> {
        let Some((attrs, body)) = fenced(user, tag) else { return vec![] };
        let items = count_attr(attrs).unwrap_or(1);
        let candidates: Vec<Insight> = insights(body).into_iter().filter(|i| !present.contains(&i.token)).collect();
        match cfg.capacity_model {
            CapacityModel::Soft => keep_soft(seed, &digest, candidates, cfg.capacity_k),
            CapacityModel::Hard => {
                let cap =
                    if tag == "untrusted-reflections" { capacity(cfg, items) } else { combine_capacity(cfg, items) };
                keep(seed, &digest, candidates, cap)
            }
        }
    };
    let with_bullets = |kept: Vec<Insight>| -> String {
        let mut text = if current.is_empty() { "You are a helpful agent.".to_owned() } else { current.to_owned() };
        if !kept.is_empty() {
            text.push_str("\n\nLessons learned:\n");
            text.push_str(&kept.iter().map(|i| format!("- {}", i.marker())).collect::<Vec<_>>().join("\n"));
        }
        text
    };
    let adds = |kept: Vec<Insight>| -> Vec<DeltaOp> {
        kept.into_iter()
            .map(|i| DeltaOp::Add {
                section: "insights".into(),
                content: i.marker(),
                reason: "simulated: kept by the capacity model".into(),
            })
            .collect()
    };
    let task = task_of(req);
    if task.is_none() && is_crossover(req) {
        return (None, crossover_selection(user, &present).to_string());
    }
    if task.is_none() && is_judge(req) {
        let system = req.messages.iter().find(|m| m.role == "system").map_or("", |m| m.content.as_str());
        return (None, judge_answer(cfg, system, user).to_string());
    }
    // Citation and level-2 faults of a model that does not follow every instruction,
    // drawn from the request's content (a corrective retry draws the same).
    let draw = |what: &[u8]| unit(&[what, &cfg.seed.to_le_bytes(), &digest]);
    let citing = draw(b"citing");
    let cites = if citing < cfg.rate_no_sources {
        Citing::Nothing
    } else if citing < cfg.rate_no_sources + cfg.rate_wrong_sources {
        Citing::Wrong
    } else {
        Citing::Right
    };
    let unreadable_level2 = draw(b"unreadable-level2") < cfg.rate_unreadable_level2;
    let unreadable_level1 = draw(b"unreadable-level1") < cfg.rate_unreadable_level1;
    let text = match task {
        Some(Task::AggregatePlaybook | Task::AggregateRewrite) if unreadable_level1 => {
            Ok("These reflections point in many directions; the agent should be more careful next time.".into())
        }
        Some(Task::Reflect) => serde_json::to_string(&reflect(user, current)),
        Some(Task::ConsolidatePlaybook) if unreadable_level2 => {
            // The older operations shape: a list of ops instead of decisions by op id.
            let body = fenced(user, "untrusted-operations").map_or("", |(_, body)| body);
            let ops: Vec<DeltaOp> = adds(insights(body).into_iter().filter(|i| !present.contains(&i.token)).collect());
            serde_json::to_string(&json!({ "operations": ops }))
        }
        Some(Task::MergeRewrite) if unreadable_level2 => {
            Ok("I merged the versions into one passage: keep every lesson of both and prefer the specific ones.".into())
        }
        Some(Task::AggregatePlaybook) => {
            // Each op cites the reflections its insight came from, numbered as in the prompt.
            let sections = fenced(user, "untrusted-reflections").map_or_else(Vec::new, |(_, b)| reflection_sections(b));
            let ops: Vec<serde_json::Value> = adds(kept("untrusted-reflections"))
                .into_iter()
                .map(|op| {
                    let mut v = serde_json::to_value(&op).unwrap_or_default();
                    let token = match &op {
                        DeltaOp::Add { content, .. } => insights(content).first().map(|i| i.token.clone()),
                        _ => None,
                    };
                    let sources: Vec<usize> = token.map_or_else(Vec::new, |t| {
                        let needle = format!("INSIGHT-{t}:");
                        let at = sections.iter().enumerate().filter(|(_, (_, text))| text.contains(&needle));
                        match cites {
                            // The next reflection of the group instead of the right one.
                            Citing::Wrong => at.map(|(i, _)| sections[(i + 1) % sections.len()].0).collect(),
                            _ => at.map(|(_, (n, _))| *n).collect(),
                        }
                    });
                    if let Some(o) = v.as_object_mut()
                        && cites != Citing::Nothing
                    {
                        o.insert("sources".into(), json!(sources));
                    }
                    v
                })
                .collect();
            serde_json::to_string(&json!({ "operations": ops }))
        }
        Some(Task::ConsolidatePlaybook) => {
            let body = fenced(user, "untrusted-operations").map_or("", |(_, body)| body);
            serde_json::to_string(&consolidation_decisions(cfg, seed, &digest, body, &present))
        }
        Some(Task::AggregateRewrite) => {
            serde_json::to_string(&InstructionAnswer { instruction: with_bullets(kept("untrusted-reflections")) })
        }
        Some(Task::MergeRewrite) => {
            serde_json::to_string(&InstructionAnswer { instruction: with_bullets(kept("untrusted-proposals")) })
        }
        None if req.messages.iter().any(|m| m.role == "system") => Ok(agent_reply(cfg, req)),
        None => Ok(r#"{"simulated": true, "note": "not a combee prompt"}"#.to_owned()),
    };
    (task, text.unwrap_or_default())
}

/// The simulated agent's reply: it applies each `INSIGHT-` lesson of its
/// system prompt and names it (`applying <token>`), overlooking a share
/// `agent_lapse_rate` of them (drawn per lesson and conversation), so what a
/// regression case sees depends on the system prompt as a real agent's
/// reply would. A harmful instruction (`INSIGHT-harm-…`) is applied like any.
fn agent_reply(cfg: &SimConfig, req: &SimRequest) -> String {
    let system: String =
        req.messages.iter().filter(|m| m.role == "system").map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n");
    let conversation: String =
        req.messages.iter().filter(|m| m.role != "system").map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n");
    let applied: Vec<String> = insights(&system)
        .into_iter()
        .filter(|i| {
            unit(&[b"lapse", i.token.as_bytes(), conversation.as_bytes(), &cfg.seed.to_le_bytes()])
                >= cfg.agent_lapse_rate
        })
        .map(|i| format!("applying {}", i.token))
        .collect();
    if applied.is_empty() {
        "A simulated agent: I answer as instructed.".to_owned()
    } else {
        format!("A simulated agent: I answer as instructed, {}.", applied.join(", "))
    }
}

/// How an aggregate-playbook answer cites its reflections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Citing {
    Right,
    Wrong,
    Nothing,
}

/// The consolidation answer: decisions only, by op id. Ops whose insights are all
/// in the current prompt already are dropped; ops that share an insight are
/// merged, and the merged text — the only new text the call writes — goes
/// through the capacity model (m = the distinct new insights of all merge texts).
/// Every other op is not mentioned, so it passes through unchanged.
pub(super) fn consolidation_decisions(
    cfg: &SimConfig,
    seed: u64,
    digest: &[u8; 32],
    body: &str,
    present: &HashSet<String>,
) -> DecisionsAnswer {
    // `o3 | ADD | section | content` lines.
    let ops: Vec<(String, String, Vec<Insight>)> = body
        .lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, " | ");
            let (label, kind) = (parts.next()?.trim(), parts.next()?.trim());
            label.starts_with('o').then(|| (label.to_owned(), kind.to_owned(), insights(l)))
        })
        .collect();
    let mut decisions = Vec::new();
    let mut clusters: Vec<Vec<usize>> = Vec::new();
    let mut cluster_of: BTreeMap<String, usize> = BTreeMap::new();
    for (i, (label, kind, found)) in ops.iter().enumerate() {
        if !found.is_empty() && found.iter().all(|x| present.contains(&x.token)) {
            decisions.push(Decision {
                action: Action::Drop,
                ops: vec![label.clone()],
                content: None,
                reason: "simulated: already in the playbook".into(),
            });
            continue;
        }
        if kind != "ADD" {
            continue;
        }
        let c = found.iter().find_map(|x| cluster_of.get(&x.token).copied()).unwrap_or_else(|| {
            clusters.push(Vec::new());
            clusters.len() - 1
        });
        clusters[c].push(i);
        for x in found {
            cluster_of.entry(x.token.clone()).or_insert(c);
        }
    }
    let merges: Vec<&Vec<usize>> = clusters.iter().filter(|c| c.len() >= 2).collect();
    let mut to_write: Vec<Insight> = Vec::new();
    for &i in merges.iter().flat_map(|c| c.iter()) {
        for x in &ops[i].2 {
            if !present.contains(&x.token) && !to_write.iter().any(|w| w.token == x.token) {
                to_write.push(x.clone());
            }
        }
    }
    let kept: HashSet<String> = match cfg.capacity_model {
        CapacityModel::Soft => keep_soft(seed, digest, to_write, cfg.capacity_k),
        CapacityModel::Hard => keep(seed, digest, to_write, cfg.capacity_k),
    }
    .into_iter()
    .map(|x| x.token)
    .collect();
    for c in merges {
        let mut markers: Vec<String> = Vec::new();
        for &i in c {
            for x in ops[i].2.iter().filter(|x| kept.contains(&x.token)) {
                if !markers.contains(&x.marker()) {
                    markers.push(x.marker());
                }
            }
        }
        let content = if markers.is_empty() {
            "Simulated merged lesson (its specific insights were lost).".to_owned()
        } else {
            markers.join("; ")
        };
        decisions.push(Decision {
            action: Action::Merge,
            ops: c.iter().map(|&i| ops[i].0.clone()).collect(),
            content: Some(content),
            reason: "simulated: the same insight".into(),
        });
    }
    DecisionsAnswer { decisions }
}

pub(super) fn reflect(user: &str, current: &str) -> Reflection {
    let trace = fenced(user, "untrusted-trace-data").map_or("", |(_, body)| body);
    let success = trace_part(trace, "feedback").contains("\"success\": true");
    let found = insights(trace);
    let key_insight = if found.is_empty() {
        "Simulated generic insight: re-read the task requirements before answering.".to_owned()
    } else {
        found.iter().map(Insight::marker).collect::<Vec<_>>().join("\n")
    };
    // Tag the playbook bullets the trajectory mentions as `[b-NNNN]`.
    let trajectory = trace_part(trace, "trajectory");
    let mut bullet_tags: Vec<BulletTag> = Vec::new();
    for (i, _) in trajectory.match_indices("[b-") {
        let digits: String = trajectory[i + 3..].chars().take_while(char::is_ascii_digit).collect();
        let id = format!("b-{digits}");
        if digits.is_empty() || !current.contains(&format!("[{id}]")) || bullet_tags.iter().any(|t| t.id == id) {
            continue;
        }
        let tag = if success { BulletTagKind::Helpful } else { BulletTagKind::Harmful };
        bullet_tags.push(BulletTag { id, tag });
    }
    let sim = "(simulated reflection)";
    Reflection {
        error: if success { String::new() } else { format!("The run did not succeed {sim}.") },
        root_cause: if success { String::new() } else { format!("The agent missed a lesson from its playbook {sim}.") },
        correct_approach: format!("Apply the key insight {sim}."),
        key_insight,
        bullet_tags,
    }
}
