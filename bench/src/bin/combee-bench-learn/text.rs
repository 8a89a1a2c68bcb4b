//! How the report writes its figures: PASS or FAIL, counts with thousands
//! separators, tokens per trace.

/// A target's verdict.
pub(crate) fn pass(ok: bool) -> &'static str {
    if ok { "PASS" } else { "FAIL" }
}

/// A count with thousands separators.
pub(crate) fn thousands(v: u64) -> String {
    let s = v.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Tokens per trace of the backlog, with the total: `1,234 (370,200)`.
pub(crate) fn per_trace(total: u64, n: usize) -> String {
    format!("{} ({})", thousands((total as f64 / n.max(1) as f64).round() as u64), thousands(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_groups_digits_by_three() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_371_558), "1,371,558");
        assert_eq!(per_trace(1_000, 3), "333 (1,000)");
    }
}
