//! Reading a model's answer to a map or reduce call tolerantly but safely. Real
//! models wrap the JSON they were asked for in code fences, put prose or a
//! `<think>…</think>` block before it, add keys nobody asked for and sometimes
//! cite ids that do not exist. This module finds the one JSON object in such an
//! answer and lets decoders set aside what they do not know, *counting*
//! everything set aside ([`AnswerNotes`]) so a round record can show what was
//! ignored or dropped and why. It never loosens what is accepted: the object
//! found still goes through the strict types and the size and id checks of
//! [`super::decode`] and [`super::checks`].

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Most `{` positions tried when looking for an object in prose, so a hostile or
/// degenerate answer cannot make the search quadratic in its length.
const MAX_CANDIDATES: usize = 64;
/// Most reasons kept per answer; the counts stay exact beyond it.
const MAX_REASONS: usize = 50;

/// An item of an answer that was left out, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DroppedItem {
    /// Where in the answer, e.g. `operations[3]` or `bullet_tags[0]`.
    pub item: String,
    pub reason: String,
}

/// What reading one answer ignored or dropped. Empty for an answer that was
/// exactly the requested JSON.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnswerNotes {
    /// Keys the answer carried that the format does not have (path-qualified), ignored.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unknown_keys: Vec<String>,
    /// Items (operations, bullet tags, sources) left out, with the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<DroppedItem>,
    /// How many items were dropped (exact, also past the kept reasons).
    #[serde(default)]
    pub dropped_count: usize,
    /// What surrounded the JSON object (`code fence`, `think block`, `prose`), if anything.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub wrapping: Vec<String>,
}

impl AnswerNotes {
    pub fn is_empty(&self) -> bool {
        self.unknown_keys.is_empty() && self.dropped_count == 0 && self.wrapping.is_empty()
    }

    pub fn drop_item(&mut self, item: impl Into<String>, reason: impl Into<String>) {
        self.dropped_count += 1;
        if self.dropped.len() < MAX_REASONS {
            self.dropped.push(DroppedItem { item: item.into(), reason: reason.into() });
        }
    }

    fn unknown_key(&mut self, path: String) {
        if self.unknown_keys.len() < MAX_REASONS {
            self.unknown_keys.push(path);
        }
    }
}

/// The JSON object of an answer: the whole text if it is one; else the first
/// ```` ``` ```` / ```` ```json ```` fenced block that is one; else the first
/// balanced `{…}` in the text that parses as one. Unless the whole text is an
/// object, `<think>…</think>` blocks are removed first. `notes.wrapping` says
/// what was around the object.
pub fn extract_object(text: &str, notes: &mut AnswerNotes) -> Result<Map<String, Value>, String> {
    // An exact answer is taken as it is, even if a string in it mentions `<think>`.
    if let Ok(Value::Object(m)) = serde_json::from_str::<Value>(text.trim()) {
        return Ok(m);
    }
    let without_think = strip_think(text);
    if without_think.len() != text.len() {
        notes.wrapping.push("think block".into());
    }
    let t = without_think.trim();
    if let Ok(Value::Object(m)) = serde_json::from_str::<Value>(t) {
        return Ok(m);
    }
    for block in fenced_blocks(t) {
        if let Ok(Value::Object(m)) = serde_json::from_str::<Value>(block.trim()) {
            notes.wrapping.push("code fence".into());
            return Ok(m);
        }
    }
    let b = t.as_bytes();
    let mut tried = 0;
    let mut from = 0;
    while let Some(pos) = t[from..].find('{').map(|p| from + p) {
        tried += 1;
        if tried > MAX_CANDIDATES {
            break;
        }
        if let Some(end) = balanced_end(b, pos)
            && let Ok(Value::Object(m)) = serde_json::from_str::<Value>(&t[pos..=end])
        {
            notes.wrapping.push("prose".into());
            return Ok(m);
        }
        from = pos + 1;
    }
    match serde_json::from_str::<Value>(t) {
        Ok(_) => Err("the answer is JSON but not an object".into()),
        Err(e) if e.to_string().contains("control character") => {
            // A raw line break or tab inside a string (small models under a grammar write
            // them): escaped, the text is the object it meant to be.
            let escaped = escape_controls_in_strings(t);
            match serde_json::from_str::<Value>(&escaped) {
                Ok(Value::Object(m)) => {
                    notes.wrapping.push("control characters in strings".into());
                    Ok(m)
                }
                _ => Err(format!("no JSON object found in the answer: {e}")),
            }
        }
        Err(e) => Err(format!("no JSON object found in the answer: {e}")),
    }
}

/// `text` with every control character inside a JSON string escaped.
fn escape_controls_in_strings(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 16);
    let (mut in_string, mut escaped) = (false, false);
    for c in text.chars() {
        if in_string && !escaped && c.is_control() {
            match c {
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                other => out.push_str(&format!("\\u{:04x}", u32::from(other))),
            }
            continue;
        }
        out.push(c);
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        }
    }
    out
}

/// The text with every `<think>…</think>` block removed; an unclosed `<think>`
/// hides the rest of the text.
fn strip_think(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("<think>") {
        out.push_str(&rest[..start]);
        match rest[start..].find("</think>") {
            Some(end) => rest = &rest[start + end + "</think>".len()..],
            None => return out,
        }
    }
    out.push_str(rest);
    out
}

/// Bodies of Markdown code fences (```` ``` ```` with an optional info string).
fn fenced_blocks(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find("```") {
        let after = &rest[open + 3..];
        // The info string (`json`) runs to the end of the opening line.
        let Some(nl) = after.find('\n') else { break };
        let body = &after[nl + 1..];
        let Some(close) = body.find("```") else { break };
        out.push(&body[..close]);
        rest = &body[close + 3..];
    }
    out
}

/// The index of the `}` closing the object opened at `start`, skipping string contents.
fn balanced_end(b: &[u8], start: usize) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (i, &c) in b.iter().enumerate().skip(start) {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            b'"' => in_string = true,
            b'{' => depth += 1,
            b'}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// Removes (and notes) the keys of `obj` that are not in `known`; `at` prefixes
/// the noted paths. Known keys whose value is `null` are removed too, so a
/// field's default applies.
pub fn keep_known(obj: &mut Map<String, Value>, known: &[&str], at: &str, notes: &mut AnswerNotes) {
    let unknown: Vec<String> = obj.keys().filter(|k| !known.contains(&k.as_str())).cloned().collect();
    for k in unknown {
        obj.remove(&k);
        let key: String = k.chars().take(40).collect();
        notes.unknown_key(if at.is_empty() { key } else { format!("{at}.{key}") });
    }
    obj.retain(|_, v| !v.is_null());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_line_breaks_inside_strings_are_escaped_and_noted() {
        let mut notes = AnswerNotes::default();
        let text = "{ \"operations\": [ { \"op\": \"ADD\", \"content\": \"line one\nline\ttwo\" } ] }";
        let m = extract_object(text, &mut notes).unwrap();
        assert_eq!(m["operations"][0]["content"], "line one\nline\ttwo");
        assert_eq!(notes.wrapping, vec!["control characters in strings".to_owned()]);
        // A line break between tokens is plain JSON and needs no note.
        let mut notes = AnswerNotes::default();
        extract_object("{\n\"a\": 1\n}", &mut notes).unwrap();
        assert!(notes.is_empty());
    }
    use serde_json::json;

    fn obj(text: &str) -> (Value, AnswerNotes) {
        let mut notes = AnswerNotes::default();
        let m = extract_object(text, &mut notes).unwrap();
        (Value::Object(m), notes)
    }

    #[test]
    fn a_bare_object_is_taken_as_it_is() {
        let (v, notes) = obj(" {\"a\": 1}\n");
        assert_eq!(v, json!({"a": 1}));
        assert!(notes.is_empty());
    }

    #[test]
    fn a_code_fence_is_unwrapped() {
        let (v, notes) = obj("```\n{\"a\": 1}\n```");
        assert_eq!(v, json!({"a": 1}));
        assert_eq!(notes.wrapping, ["code fence"]);
    }

    #[test]
    fn a_json_fence_after_prose_is_unwrapped() {
        let (v, notes) = obj("Sure! Here is the answer:\n```json\n{\"a\": \"x } y\"}\n```\nHope it helps {not json}.");
        assert_eq!(v, json!({"a": "x } y"}));
        assert_eq!(notes.wrapping, ["code fence"]);
    }

    #[test]
    fn prose_preamble_and_trailer_are_skipped() {
        let (v, notes) = obj("I looked at {the runs}. Answer: {\"a\": {\"b\": \"}\\\"{\"}} That is all.");
        assert_eq!(v, json!({"a": {"b": "}\"{"}}));
        assert_eq!(notes.wrapping, ["prose"]);
    }

    #[test]
    fn think_blocks_are_removed_even_when_they_hold_json() {
        let (v, notes) = obj("<think>maybe {\"a\": 0}? no.</think>\n{\"a\": 2}");
        assert_eq!(v, json!({"a": 2}));
        assert_eq!(notes.wrapping, ["think block"]);
        let mut n = AnswerNotes::default();
        assert!(extract_object("<think>{\"a\": 1} and never closed", &mut n).is_err());
    }

    #[test]
    fn a_think_tag_inside_a_json_string_is_just_text() {
        let (v, notes) = obj(r#"{"key_insight": "the agent wrote <think> and never closed it"}"#);
        assert_eq!(v["key_insight"], "the agent wrote <think> and never closed it");
        assert!(notes.is_empty());
    }

    #[test]
    fn answers_without_an_object_are_refused() {
        let mut n = AnswerNotes::default();
        assert!(extract_object("no json here", &mut n).unwrap_err().contains("no JSON object"));
        assert!(extract_object("[1, 2]", &mut n).unwrap_err().contains("not an object"));
        assert!(extract_object("{\"a\": 1", &mut n).is_err());
        // Many unbalanced braces: bounded work, still an error.
        assert!(extract_object(&"{".repeat(100_000), &mut n).is_err());
    }

    #[test]
    fn unknown_keys_are_removed_and_counted() {
        let mut m = json!({"a": 1, "confidence": 0.9, "b": null, "note": "hi"}).as_object().unwrap().clone();
        let mut notes = AnswerNotes::default();
        keep_known(&mut m, &["a", "b"], "op[0]", &mut notes);
        assert_eq!(Value::Object(m), json!({"a": 1}));
        assert_eq!(notes.unknown_keys, ["op[0].confidence", "op[0].note"]);
    }
}
