//! The check every learned bullet, section name and rewritten instruction
//! passes before it may enter a version. It is written once here and used by
//! every path that writes learned content: a round's reduce (the level-1
//! groups' operations, level-2 consolidations, the sequential baseline, rewrite
//! instructions and their merge) and crossover. Manual edits keep their own
//! rules (`domain::playbook`): an operator writes what they mean.
//!
//! A weak model that echoes the protocol instead of writing a lesson — a
//! number, an ellipsis, the playbook's own line format, a section named after
//! the container — would otherwise have that served to agents as guidance. The
//! rules hold for any model and any language (see `docs/learning.md`, *What
//! may become a version*):
//!
//! - **A bullet carries a statement**: at least [`MIN_WORDS`] words, a word
//!   being a run of letters or digits that holds a letter (each character of a
//!   script written without spaces, such as Chinese, counts as a word).
//! - **It reproduces none of the protocol's markup**: a bullet id in brackets
//!   (`[b-0001]`), a `helpful=` / `harmful=` counter, a section header
//!   (`### …`, `## PLAYBOOK`), a template's slot (`{{reflections}}`), fence
//!   (`<untrusted-…>`) or answer placeholder, a reflection's label
//!   (`[reflection 2]`).
//! - **It does not repeat the base text**: its words are not a passage of the
//!   prompt's base, nor the same insight as one of the base's sentences (the
//!   near-duplicate rule of level 2).
//! - **A section name is a few words naming a topic**: at most
//!   [`MAX_SECTION_WORDS`] words (`-`, `_`, `/` and `&` separate words too),
//!   more letters than digits (words, not an id: not `1234567890ABCD`), no markup characters, and not beginning with the
//!   playbook's own nouns (section, bullet, playbook), which name the container
//!   rather than what its bullets are about (`Section 1`, `bullet-tag…`).
//! - **A rewritten instruction** is not empty, echoes none of the templates'
//!   markup that the base does not hold itself, carries a statement, and keeps
//!   at least [`MIN_INSTRUCTION_SHARE`] of the base's length — of the prompt's
//!   `max_chars` instead, when that budget asks for a shorter text.

use std::fmt;
use std::sync::LazyLock;

use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::domain::DeltaOp;
use crate::learn::merge::same_insight::same_insight;

/// Fewest words a bullet (or an instruction) must hold to state anything.
pub const MIN_WORDS: usize = 2;
/// Most words a section name may have.
pub const MAX_SECTION_WORDS: usize = 6;
/// Least share of the base's length a rewritten instruction keeps.
pub const MIN_INSTRUCTION_SHARE: f64 = 0.5;
/// Longest excerpt of refused text quoted in a reason.
const EXCERPT_CHARS: usize = 80;

/// Which rule refused a text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// Too few words (a number, punctuation, one word).
    NoStatement,
    /// The protocol's own markup (bullet ids, counters, headers, template slots).
    ProtocolMarkup,
    /// The prompt's base text again.
    RepeatsBase,
    /// A section name that is not a few words naming a topic.
    SectionName,
    /// A rewritten instruction with no text.
    EmptyInstruction,
    /// A rewritten instruction much shorter than the base, unasked.
    TooShort,
}

impl Rule {
    pub const ALL: [Rule; 6] = [
        Self::NoStatement,
        Self::ProtocolMarkup,
        Self::RepeatsBase,
        Self::SectionName,
        Self::EmptyInstruction,
        Self::TooShort,
    ];

    /// The name used in the round record and as the `/metrics` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoStatement => "no_statement",
            Self::ProtocolMarkup => "protocol_markup",
            Self::RepeatsBase => "repeats_base",
            Self::SectionName => "section_name",
            Self::EmptyInstruction => "empty_instruction",
            Self::TooShort => "too_short",
        }
    }
}

/// Why a text may not enter a version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub rule: Rule,
    /// Says what was found, quoting it (bounded).
    pub reason: String,
}

impl Refusal {
    fn new(rule: Rule, reason: impl Into<String>) -> Self {
        Self { rule, reason: reason.into() }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

/// Whether a character belongs to a script written without spaces between
/// words (Han, kana, Thai, Lao, Khmer, Myanmar): each counts as a word.
fn unspaced_script(c: char) -> bool {
    matches!(u32::from(c),
        0x3040..=0x30FF      // Hiragana, Katakana
        | 0x3400..=0x4DBF    // CJK extension A
        | 0x4E00..=0x9FFF    // CJK unified ideographs
        | 0xF900..=0xFAFF    // CJK compatibility ideographs
        | 0x20000..=0x2FA1F  // CJK extensions B and later
        | 0x0E00..=0x0EFF    // Thai, Lao
        | 0x1000..=0x109F    // Myanmar
        | 0x1780..=0x17FF) // Khmer
}

/// The text's words, lower-cased: runs of letters and digits (a character of
/// an unspaced script is a word of its own).
fn words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for c in text.chars() {
        if unspaced_script(c) {
            if !current.is_empty() {
                out.push(std::mem::take(&mut current));
            }
            out.push(c.to_string());
        } else if c.is_alphanumeric() {
            current.extend(c.to_lowercase());
        } else if !current.is_empty() {
            out.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// Words that hold a letter (a bare number states nothing).
fn statement_words(text: &str) -> usize {
    words(text).iter().filter(|w| w.chars().any(char::is_alphabetic)).count()
}

fn excerpt(text: &str) -> String {
    let mut s: String = text.chars().take(EXCERPT_CHARS).collect();
    if text.chars().count() > EXCERPT_CHARS {
        s.push('…');
    }
    s
}

/// The protocol's markup: the pattern, what it is called in a reason, and
/// whether an instruction may not hold it either (a rewritten system prompt
/// may well use Markdown headers of its own; a bullet is one line of a section).
static MARKUP: LazyLock<Vec<(Regex, &'static str, bool)>> = LazyLock::new(|| {
    [
        (r"(?i)\[\s*b-\d+\s*\]", "a bullet id", true),
        (r"(?i)\b(helpful|harmful)\s*=", "a helpful/harmful counter", true),
        (r"(?i)##\s*playbook", "the playbook's header", true),
        (r"^#+\s|#{3,}\s", "a section header", false),
        (r"\{\{\s*[A-Za-z_]+\s*\}\}", "a template slot", true),
        (r"(?i)</?untrusted-[a-z-]*", "a fence of the templates", true),
        (r"(?i)\[reflection \d+\]", "a reflection's label", true),
        (r"(?i)<the (complete new instruction|merged passage)>", "the answer format's placeholder", true),
        (r"(?im)^combee-(template|task):", "a template's header", true),
    ]
    .into_iter()
    .map(|(re, what, both)| (Regex::new(re).expect("a valid pattern"), what, both))
    .collect()
});

/// The first piece of markup `text` holds that `allowed` does not (the base
/// text, for an instruction: what the operator wrote is theirs); an
/// instruction is held only to the markup marked for it.
fn markup_in(text: &str, allowed: &str, instruction: bool) -> Option<Refusal> {
    MARKUP.iter().filter(|(_, _, both)| *both || !instruction).find_map(|(re, what, _)| {
        let found = re.find_iter(text).map(|m| m.as_str()).find(|m| !allowed.contains(m))?;
        Some(Refusal::new(Rule::ProtocolMarkup, format!("reproduces {what} of the protocol ({:?})", excerpt(found))))
    })
}

/// Whether `needle` occurs as a contiguous run in `haystack`.
fn contains_run(haystack: &[String], needle: &[String]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// The base's sentences (lines, cut after `.`, `!`, `?`).
fn sentences(base: &str) -> impl Iterator<Item = &str> {
    base.lines().flat_map(|line| line.split_inclusive(['.', '!', '?'])).map(str::trim).filter(|s| !s.is_empty())
}

/// Checks a bullet's content against the rules (module doc); `base` is the prompt's base text.
pub fn check_bullet(content: &str, base: &str) -> Result<(), Refusal> {
    let content = content.trim();
    if let Some(r) = markup_in(content, "", false) {
        return Err(r);
    }
    let n = statement_words(content);
    if n < MIN_WORDS {
        return Err(Refusal::new(
            Rule::NoStatement,
            format!("{:?} states nothing: {n} words with letters, at least {MIN_WORDS} needed", excerpt(content)),
        ));
    }
    let own = words(content);
    if contains_run(&words(base), &own) {
        return Err(Refusal::new(Rule::RepeatsBase, "repeats a passage of the prompt's base text"));
    }
    if let Some(s) = sentences(base).filter(|s| statement_words(s) >= MIN_WORDS).find(|s| same_insight(content, s)) {
        return Err(Refusal::new(
            Rule::RepeatsBase,
            format!("the same insight as the base text's sentence {:?}", excerpt(s)),
        ));
    }
    Ok(())
}

/// The playbook's own nouns: a section name beginning with one names the container.
const CONTAINER_NOUNS: [&str; 3] = ["section", "bullet", "playbook"];

/// Characters of markup, never part of a topic's name.
const MARKUP_CHARS: [char; 10] = ['[', ']', '{', '}', '<', '>', '=', '|', '*', '`'];

/// Checks a section name an ADD names (an empty name is the default section's).
pub fn check_section(name: &str) -> Result<(), Refusal> {
    let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
    if name.is_empty() {
        return Ok(());
    }
    let refuse = |why: String| Err(Refusal::new(Rule::SectionName, format!("section {:?} {why}", excerpt(&name))));
    if name.starts_with('#') {
        return refuse("is a header marker, not a name".into());
    }
    if let Some(c) = name.chars().find(|c| MARKUP_CHARS.contains(c)) {
        return refuse(format!("holds the markup character {c:?}"));
    }
    let parts: Vec<&str> = name
        .split(|c: char| c.is_whitespace() || matches!(c, '-' | '_' | '/' | '&'))
        .filter(|p| p.chars().any(char::is_alphanumeric))
        .collect();
    // Words, not an id: more letters than digits (`B2B orders` and `Top 10 mistakes` name topics,
    // `1234567890ABCD` and `BIGGER_123456789…` do not).
    let letters = name.chars().filter(|c| c.is_alphabetic()).count();
    if letters == 0 || letters <= name.chars().filter(char::is_ascii_digit).count() {
        return refuse("has no word".into());
    }
    if parts.len() > MAX_SECTION_WORDS {
        return refuse(format!("is {} words; a name has at most {MAX_SECTION_WORDS}", parts.len()));
    }
    let first = parts[0].to_lowercase();
    let noun = first.strip_suffix('s').unwrap_or(&first);
    if CONTAINER_NOUNS.contains(&noun) {
        return refuse(format!("begins with {:?}, the playbook's own word, not a topic", parts[0]));
    }
    Ok(())
}

/// Checks what a playbook operation would put into a version: an ADD's section
/// and content, an UPDATE's content (a REMOVE writes nothing).
pub fn check_op(op: &DeltaOp, base: &str) -> Result<(), Refusal> {
    match op {
        DeltaOp::Add { section, content, .. } => {
            check_section(section)?;
            check_bullet(content, base)
        }
        DeltaOp::Update { content, .. } => check_bullet(content, base),
        DeltaOp::Remove { .. } => Ok(()),
    }
}

/// Checks a rewritten instruction against the base it replaces; `max_chars` is
/// the prompt's size budget, which may ask for a text shorter than the base.
pub fn check_instruction(new: &str, base: &str, max_chars: Option<usize>) -> Result<(), Refusal> {
    let text = new.trim();
    if text.is_empty() {
        return Err(Refusal::new(Rule::EmptyInstruction, "the instruction is empty"));
    }
    if let Some(r) = markup_in(text, base, true) {
        return Err(r);
    }
    let n = statement_words(text);
    if n < MIN_WORDS {
        return Err(Refusal::new(
            Rule::NoStatement,
            format!("{:?} states nothing: {n} words with letters", excerpt(text)),
        ));
    }
    let base_chars = base.trim().chars().count();
    let asked = max_chars.unwrap_or(usize::MAX).min(base_chars);
    let floor = (asked as f64 * MIN_INSTRUCTION_SHARE).floor() as usize;
    let chars = text.chars().count();
    if chars < floor {
        return Err(Refusal::new(
            Rule::TooShort,
            format!(
                "{chars} characters, less than {:.0}% of the {asked} the base has{}",
                MIN_INSTRUCTION_SHARE * 100.0,
                if asked < base_chars { " within the prompt's max_chars" } else { "" }
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
#[path = "lesson_check_tests.rs"]
mod tests;
