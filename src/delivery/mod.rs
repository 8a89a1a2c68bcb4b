//! The webhook delivery worker: drains the transactional outbox. It claims due
//! deliveries under a lease (`FOR UPDATE SKIP LOCKED` on Postgres), POSTs each
//! event's stored body signed with Standard Webhooks headers (the same
//! `webhook-id` on every attempt), records every attempt in the delivery log,
//! and reschedules failures on a backoff schedule with jitter, honouring
//! `Retry-After`. A 410 Gone disables the subscription. It wakes on
//! `Change::OutboxEvent` and polls as a fallback; a process that dies
//! mid-attempt leaves the delivery to be re-claimed when its lease expires.

pub mod target;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use chrono::Utc;
use rand::Rng;
use reqwest::{StatusCode, Url};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::{
    config::WebhookSettings,
    retry_after::parse_retry_after,
    store::{AttemptRecord, ClaimedDelivery, DeliveryOutcome, DynStore},
    webhooks,
};

/// Longest `Retry-After` honoured; beyond it the schedule's own delay applies.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// The delay after failed attempt number `attempt` (1-based): the schedule's
/// entry (the last one repeats) scaled by `jitter`, a factor in [0.9, 1.1].
pub fn retry_delay(schedule: &[u64], attempt: u32, jitter: f64) -> Duration {
    let idx = (attempt.max(1) as usize - 1).min(schedule.len().saturating_sub(1));
    let base = schedule.get(idx).copied().unwrap_or(0) as f64;
    Duration::from_secs_f64((base * jitter.clamp(0.9, 1.1)).max(0.0))
}

/// What to do after a failed attempt: retry (at the server's `Retry-After`
/// when it gave a sane one, else on the schedule) or give up.
pub fn after_failure(
    s: &WebhookSettings,
    attempt: u32,
    retry_after: Option<Duration>,
    jitter: f64,
) -> Option<Duration> {
    if attempt >= s.max_attempts {
        return None;
    }
    Some(match retry_after.filter(|d| *d <= MAX_RETRY_AFTER) {
        Some(d) => d,
        None => retry_delay(&s.retry_schedule_secs, attempt, jitter),
    })
}

#[derive(Clone)]
pub struct Deliverer {
    store: DynStore,
    settings: Arc<WebhookSettings>,
    client: reqwest::Client,
    owner: String,
}

impl Deliverer {
    pub fn new(store: DynStore, settings: WebhookSettings) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(settings.request_timeout_secs))
            .connect_timeout(Duration::from_secs(settings.request_timeout_secs.min(10)))
            // A redirect could lead anywhere, including a literal private address.
            .redirect(reqwest::redirect::Policy::none())
            // Connect directly, to the checked address, never through an environment proxy.
            .no_proxy()
            .dns_resolver(target::resolver(settings.allow_private_targets))
            .user_agent(concat!("combee-webhooks/", env!("CARGO_PKG_VERSION")))
            .build()?;
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "combee".into());
        let tag: u32 = rand::thread_rng().r#gen();
        let owner = format!("{host}:{}:{tag:08x}", std::process::id());
        Ok(Self { store, settings: Arc::new(settings), client, owner })
    }

    fn lease(&self) -> Duration {
        Duration::from_secs(self.settings.request_timeout_secs + 30)
    }

    /// Runs until `shutdown`. Attempts in flight are abandoned to their lease.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut changes = self.store.changes();
        let mut inflight: JoinSet<()> = JoinSet::new();
        let poll = Duration::from_millis(self.settings.poll_interval_ms);
        let max = self.settings.max_concurrency as usize;
        tracing::info!(owner = %self.owner, "webhook delivery worker started");
        loop {
            let room = max.saturating_sub(inflight.len());
            if room > 0 {
                match self.store.claim_deliveries(&self.owner, self.lease(), room as u32).await {
                    Ok(claimed) => {
                        for d in claimed {
                            let me = self.clone();
                            inflight.spawn(async move { me.deliver(d).await });
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "claiming webhook deliveries failed"),
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(poll) => {}
                Some(_) = inflight.join_next(), if !inflight.is_empty() => {}
                c = changes.recv() => {
                    if matches!(c, Err(tokio::sync::broadcast::error::RecvError::Closed)) {
                        changes = self.store.changes();
                    }
                }
            }
        }
        inflight.abort_all();
        tracing::info!("webhook delivery worker stopped");
    }

    /// One attempt, recorded with its outcome.
    pub async fn deliver(&self, d: ClaimedDelivery) {
        let started = Instant::now();
        let sent = self.send(&d).await;
        let latency_ms = started.elapsed().as_millis().min(u64::MAX as u128) as u64;
        let attempt = d.attempt.max(1) as u32;
        let jitter = rand::thread_rng().gen_range(0.9..=1.1);
        let retry = |retry_after| match after_failure(&self.settings, attempt, retry_after, jitter) {
            Some(delay) => DeliveryOutcome::Retry {
                at: Utc::now() + chrono::Duration::from_std(delay).unwrap_or(chrono::Duration::zero()),
            },
            None => DeliveryOutcome::GiveUp,
        };
        let record = match sent {
            Ok((status, _)) if status.is_success() => AttemptRecord {
                status_code: Some(status.as_u16()),
                error: None,
                latency_ms,
                outcome: DeliveryOutcome::Succeeded,
            },
            Ok((StatusCode::GONE, _)) => AttemptRecord {
                status_code: Some(410),
                error: Some("410 Gone: the subscription is disabled".into()),
                latency_ms,
                outcome: DeliveryOutcome::Gone,
            },
            Ok((status, retry_after)) => AttemptRecord {
                status_code: Some(status.as_u16()),
                error: Some(format!("the receiver answered {status}")),
                latency_ms,
                outcome: retry(retry_after),
            },
            Err(error) => AttemptRecord { status_code: None, error: Some(error), latency_ms, outcome: retry(None) },
        };
        let span = tracing::info_span!("webhook", event = %d.event_id, r#type = %d.event_type,
            subscription = %d.subscription_id, attempt = d.attempt);
        let _enter = span.enter();
        match &record.outcome {
            DeliveryOutcome::Succeeded => tracing::info!(status = ?record.status_code, latency_ms, "webhook delivered"),
            DeliveryOutcome::Retry { at } => {
                tracing::warn!(status = ?record.status_code, error = ?record.error, next_attempt_at = %at, "webhook delivery failed; will retry")
            }
            DeliveryOutcome::GiveUp => {
                tracing::warn!(status = ?record.status_code, error = ?record.error, "webhook delivery failed for the last time")
            }
            DeliveryOutcome::Gone => tracing::warn!("the receiver answered 410 Gone; subscription disabled"),
        }
        match self.store.finish_delivery(&d, &record).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!("the delivery's lease was lost; its result is dropped"),
            Err(e) => tracing::warn!(error = %e, "recording a webhook attempt failed; it will be retried"),
        }
    }

    /// POSTs the signed event; the status and any `Retry-After`, or why nothing was answered.
    async fn send(&self, d: &ClaimedDelivery) -> Result<(StatusCode, Option<Duration>), String> {
        let url = Url::parse(&d.url).map_err(|_| "the subscription's URL does not parse".to_owned())?;
        target::check_literal(&url, self.settings.allow_private_targets).map_err(|e| format!("refused: {e}"))?;
        let key =
            webhooks::decode_secret(&d.secret).ok_or_else(|| "the subscription's secret is unusable".to_owned())?;
        let timestamp = Utc::now().timestamp();
        let signature = webhooks::sign(&key, &d.event_id, timestamp, d.body.as_bytes());
        let res = self
            .client
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header("webhook-id", &d.event_id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(d.body.clone())
            .send()
            .await
            .map_err(describe)?;
        let retry_after = parse_retry_after(res.headers(), Utc::now());
        Ok((res.status(), retry_after))
    }
}

/// A transport error as one line with its causes, without the URL (which may
/// carry a token in its path or query).
fn describe(e: reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else {
        "request failed"
    };
    let mut msg = kind.to_owned();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(schedule: &[u64], max_attempts: u32) -> WebhookSettings {
        let mut s = crate::config::Settings::default().webhooks;
        s.retry_schedule_secs = schedule.to_vec();
        s.max_attempts = max_attempts;
        s
    }

    #[test]
    fn the_default_schedule_backs_off_then_repeats_its_last_step() {
        let s = crate::config::Settings::default().webhooks;
        let delays: Vec<u64> = (1..=7).map(|a| retry_delay(&s.retry_schedule_secs, a, 1.0).as_secs()).collect();
        assert_eq!(delays, [5, 300, 1800, 7200, 18000, 36000, 36000]);
        assert_eq!(after_failure(&s, 7, None, 1.0), Some(Duration::from_secs(36000)));
        assert_eq!(after_failure(&s, 8, None, 1.0), None, "8 attempts in all");
    }

    #[test]
    fn jitter_stays_within_ten_percent() {
        assert_eq!(retry_delay(&[100], 1, 0.9), Duration::from_secs(90));
        assert_eq!(retry_delay(&[100], 1, 1.1), Duration::from_secs(110));
        assert_eq!(retry_delay(&[100], 1, 5.0), Duration::from_secs(110));
        assert_eq!(retry_delay(&[0], 3, 1.1), Duration::ZERO);
    }

    #[test]
    fn retry_after_wins_unless_absurd() {
        let s = settings(&[5, 300], 5);
        assert_eq!(after_failure(&s, 1, Some(Duration::from_secs(42)), 1.0), Some(Duration::from_secs(42)));
        assert_eq!(after_failure(&s, 1, Some(Duration::from_secs(10 * 24 * 3600)), 1.0), Some(Duration::from_secs(5)));
        assert_eq!(after_failure(&s, 5, Some(Duration::from_secs(1)), 1.0), None);
    }
}
