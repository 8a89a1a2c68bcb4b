//! Server-rendered HTML: one `escape` every interpolated value goes through
//! (trace content is untrusted), the page layout, and small formatting helpers.

use std::fmt::Write;

use axum::response::Html;
use chrono::{DateTime, Utc};

/// Escapes text for HTML element content and quoted attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + s.len() / 8);
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Percent-encodes a query-string component (then `escape` it into an attribute).
pub fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

pub fn time(t: DateTime<Utc>) -> String {
    escape(&t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
}

pub fn opt_time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "—".to_owned(), time)
}

/// A duration for people: `850 ms`, `12.3 s`, `4 min 05 s`.
pub fn duration_ms(ms: f64) -> String {
    if !ms.is_finite() || ms < 0.0 {
        "—".to_owned()
    } else if ms < 1000.0 {
        format!("{ms:.0} ms")
    } else if ms < 60_000.0 {
        format!("{:.2} s", ms / 1000.0)
    } else {
        let secs = (ms / 1000.0).round() as u64;
        format!("{} min {:02} s", secs / 60, secs % 60)
    }
}

/// The first `max` characters, with an ellipsis when cut (escaped).
pub fn clip(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", escape(&s[..end])),
        None => escape(s),
    }
}

/// A status word as a coloured badge (the class is from a fixed set).
pub fn badge(word: &str) -> String {
    let class = match word {
        "succeeded" | "consumed" | "production" => "ok",
        "failed" | "refused" | "backing_off" | "budget_reached" => "bad",
        "running" | "queued" | "pending" | "candidate" => "busy",
        _ => "plain",
    };
    format!(r#"<span class="badge {class}">{}</span>"#, escape(word))
}

/// The signed-in operator, as the page header shows them.
pub struct Who<'a> {
    /// The key's or the person's name.
    pub name: &'a str,
    /// The key's visible prefix, or the person's role and where it holds.
    pub detail: String,
    /// What `detail` is, as a tooltip.
    pub title: &'static str,
    pub csrf: &'a str,
    /// An admin key or person: the navigation links the audit log and the members.
    pub admin: bool,
    /// A person with several grants: a link to switch.
    pub switch: bool,
}

/// Which top-level section is current.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum NavSection {
    Prompts,
    Traces,
    Audit,
    Members,
    None,
}

/// A whole page: `title` is escaped here, `body` is already-built HTML.
pub fn page(title: &str, who: Option<&Who<'_>>, section: NavSection, body: &str) -> Html<String> {
    let mut nav = String::new();
    if let Some(w) = who {
        let cur = |s: NavSection| if s == section { r#" class="current""# } else { "" };
        let _ = write!(
            nav,
            r#"<nav><a href="/ui/prompts"{}>Prompts</a><a href="/ui/traces"{}>Traces</a>{}</nav>
<div class="who"><span title="{}" id="who">{} <code id="who-detail">{}</code></span>{}
<form method="post" action="/ui/logout" class="inline"><input type="hidden" name="csrf" value="{}"><button type="submit" class="link" id="sign-out">Sign out</button></form></div>"#,
            cur(NavSection::Prompts),
            cur(NavSection::Traces),
            if w.admin {
                format!(
                    r#"<a href="/ui/audit" id="nav-audit"{}>Audit</a><a href="/ui/members" id="nav-members"{}>Members</a>"#,
                    cur(NavSection::Audit),
                    cur(NavSection::Members)
                )
            } else {
                String::new()
            },
            w.title,
            escape(w.name),
            escape(&w.detail),
            if w.switch { r#" <a href="/ui/pick" id="switch-grant">switch</a>"# } else { "" },
            escape(w.csrf),
        );
    }
    Html(format!(
        r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{} · combee</title>
<link rel="stylesheet" href="/ui/static/style.css">
</head>
<body>
<header class="top"><a class="brand" href="/ui/prompts">combee</a>{nav}</header>
<main>
{body}
</main>
</body>
</html>
"#,
        escape(title)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_neutralises_markup_and_attribute_breakouts() {
        assert_eq!(escape(r#"<script>alert("x")</script>"#), "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;");
        assert_eq!(escape("a' onmouseover='b & c"), "a&#39; onmouseover=&#39;b &amp; c");
        assert_eq!(escape("plain"), "plain");
    }

    #[test]
    fn clip_cuts_on_characters_and_escapes() {
        assert_eq!(clip("<ééé>", 3), "&lt;éé…");
        assert_eq!(clip("ab", 3), "ab");
    }

    #[test]
    fn url_encode_keeps_only_unreserved_bytes() {
        assert_eq!(url_encode("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(duration_ms(850.0), "850 ms");
        assert_eq!(duration_ms(12_340.0), "12.34 s");
        assert_eq!(duration_ms(245_000.0), "4 min 05 s");
    }
}
