//! The `Retry-After` answer header, read one way by every outbound HTTP
//! client of the service: the LLM client and the webhook deliverer.

use std::time::Duration;

use reqwest::header::{HeaderMap, RETRY_AFTER};

/// `Retry-After` as delay-seconds or an HTTP date; also the `retry-after-ms`
/// header some providers (OpenAI, Azure) send.
pub fn parse_retry_after(headers: &HeaderMap, now: chrono::DateTime<chrono::Utc>) -> Option<Duration> {
    if let Some(ms) =
        headers.get("retry-after-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    let delta = at.with_timezone(&chrono::Utc) - now;
    Some(delta.to_std().unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_forms() {
        let now = chrono::DateTime::parse_from_rfc3339("2015-10-21T07:28:00Z").unwrap().with_timezone(&chrono::Utc);
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, "7".parse().unwrap());
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(7)));
        h.insert(RETRY_AFTER, "Wed, 21 Oct 2015 07:28:30 GMT".parse().unwrap());
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(30)));
        h.insert(RETRY_AFTER, "Wed, 21 Oct 2015 07:00:00 GMT".parse().unwrap());
        assert_eq!(parse_retry_after(&h, now), Some(Duration::ZERO));
        h.insert(RETRY_AFTER, "soon".parse().unwrap());
        assert_eq!(parse_retry_after(&h, now), None);
        h.insert("retry-after-ms", "250".parse().unwrap());
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_millis(250)));
    }
}
