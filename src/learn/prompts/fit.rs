//! Fitting a call of the map or the reduce into the backend's context window:
//! how the characters left are shared between the current prompt and the data,
//! and how the prompt shrinks to its most helpful bullets.

use std::collections::HashSet;

use crate::domain::VersionContent;
use crate::llm::config::LlmConfig;
use crate::llm::{ChatMessage, LlmBackend, LlmRole};

/// How many characters of a call's parts fit the backend's context window:
/// `None` while the window is unknown (everything is sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fit {
    /// For the current prompt (its base text, then its best bullets).
    pub prompt: Option<usize>,
    /// For the data (a trace, or a group's reflections together).
    pub data: Option<usize>,
}

impl Fit {
    /// Everything is sent.
    pub const ALL: Fit = Fit { prompt: None, data: None };

    /// Shares `budget` characters between a prompt part of `prompt` characters
    /// and a data part of `data`, beside `fixed` characters that cannot shrink:
    /// each gets at least half of what is left, and what one does not need
    /// goes to the other.
    pub(super) fn share(budget: Option<usize>, fixed: usize, prompt: usize, data: usize) -> Fit {
        let Some(budget) = budget else { return Fit::ALL };
        if fixed + prompt + data <= budget {
            return Fit::ALL;
        }
        // Headings, fences and bullet labels the parts' own lengths do not count.
        let slack = 256 + budget / 100;
        let avail = budget.saturating_sub(fixed + slack);
        let half = avail / 2;
        let (p, d) = if prompt <= half {
            (prompt, avail - prompt)
        } else if data <= half {
            (avail - data, data)
        } else {
            (half, avail - half)
        };
        Fit { prompt: Some(p), data: Some(d) }
    }
}

/// The current prompt shown within `chars` characters: the base text (cut in
/// the middle if it alone is too long), then as many playbook bullets as fit,
/// the most helpful first (net of harmful), in their sections' order.
pub fn within(current: &VersionContent, chars: Option<usize>) -> VersionContent {
    let Some(chars) = chars else { return current.clone() };
    if current.render().chars().count() <= chars {
        return current.clone();
    }
    let base = cut_middle(&current.base, chars);
    let Some(playbook) = &current.playbook else { return VersionContent { base, playbook: None } };
    let mut ranked: Vec<(&str, i64, usize)> = playbook
        .bullets()
        .map(|(_, b)| (b.id.as_str(), i64::from(b.helpful) - i64::from(b.harmful), b.content.chars().count() + 32))
        .collect();
    ranked.sort_by_key(|b| std::cmp::Reverse(b.1));
    let mut room = chars.saturating_sub(base.chars().count() + 16);
    let mut kept = Vec::new();
    for (id, _, len) in ranked {
        if len > room {
            continue;
        }
        room -= len;
        kept.push(id.to_owned());
    }
    // The estimate above leaves out headings: drop the least helpful until the text fits.
    loop {
        let keep: HashSet<&str> = kept.iter().map(String::as_str).collect();
        let mut shown = playbook.clone();
        for section in &mut shown.sections {
            section.bullets.retain(|b| keep.contains(b.id.as_str()));
        }
        let out = VersionContent { base: base.clone(), playbook: Some(shown) };
        if kept.is_empty() || out.render().chars().count() <= chars {
            return out;
        }
        kept.pop();
    }
}

/// `text` cut to `max` characters by leaving out its middle, with a marker
/// that says how much was left out.
pub fn cut_middle(text: &str, max: usize) -> String {
    let n = text.chars().count();
    if n <= max {
        return text.to_owned();
    }
    let marker = format!("\n[… {} characters left out …]\n", n - max);
    let keep = max.saturating_sub(marker.chars().count());
    let head: String = text.chars().take(keep - keep / 3).collect();
    let tail: String = text.chars().skip(n - keep / 3).collect();
    format!("{head}{marker}{tail}")
}

pub(super) fn chars_of(messages: &[ChatMessage]) -> usize {
    messages.iter().map(|m| m.content.chars().count()).sum()
}

/// How many characters a call of `role` may send: the backend's context window
/// less the role's completion limit and a margin, at three characters a token
/// (small models' tokenizers cut finer than the usual four). `None` while the
/// window is unknown.
pub fn char_budget(backend: &dyn LlmBackend, cfg: &LlmConfig, role: LlmRole) -> Option<usize> {
    let window = backend.context_window()? as usize;
    let answer = (cfg.max_tokens_for(role) as usize).min(window / 2);
    Some(window.saturating_sub(answer + 64) * 3)
}
