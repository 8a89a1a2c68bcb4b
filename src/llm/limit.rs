//! How many calls one LLM backend gets at once, learned from what it shows.
//!
//! A cloud API serves dozens of calls in parallel at the same speed; a local
//! llama.cpp server has one slot and makes every extra call wait behind the
//! others. A fixed limit is wrong for one of them, so the client adapts it per
//! backend, in the manner of TCP Vegas and Netflix's concurrency-limits:
//!
//! - each answered call's latency per unit of work is compared with the best
//!   seen of its role and of about its size (prompt and completion tokens each
//!   in bands of a factor of two), because a backend's latency is part fixed,
//!   part per prompt token, part per completion token, in proportions nobody
//!   configures, so one rate fits calls of a size only; that best rate is the
//!   *baseline* (it drifts up slowly so a backend that got slower for good is
//!   relearnt);
//! - the first call of a size has no baseline of its own: it is compared with
//!   the best rate of any size of its role, loosely, because that rate may not
//!   fit it; a call far beyond that waited in the backend's queue, so it
//!   shrinks the limit and does not become its size's baseline (a baseline
//!   taken from a queued call made later queued calls look unqueued);
//! - a call close to the baseline while the limit was in use grows the limit:
//!   by one per call at first (doubling per round trip, TCP's slow start), by
//!   one per limit's worth of calls once the backend has queued a call; a call
//!   far above the baseline (it waited in the backend's queue) shrinks the
//!   limit twice as fast as unqueued calls grow it, so the limit settles where
//!   about one call in three waits; a 429, a 503 or a timeout halves it;
//! - an answer saying the server's shared context (KV cache) is full means the
//!   calls in flight together did not fit it: the limit is capped below them,
//!   once per filling however many calls it failed, and never grows past that
//!   cap again; a server that says how many slots it has caps the limit there
//!   too ([`AdaptiveLimit::cap_at`]).
//!
//! `llm.max_concurrency` stays the ceiling. Waiting here for a slot is not part
//! of any attempt's time limit. The same baselines give each attempt a time
//! limit that fits what it asks for ([`AdaptiveLimit::attempt_timeout`]).
//!
//! A backend seen before starts from the limit it earned then
//! ([`AdaptiveLimit::resume`], kept in the store by `super::remember`) instead
//! of 2, on probation: until a limit's worth of calls came back unqueued, a
//! call that waited far beyond its baseline shows the backend is smaller than
//! it was, and the limit falls at once to what the backend was seen to serve
//! (see [`Resumed`]), not by the slow steps of a settled limit.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;

use super::LlmRole;

/// Where the limit starts: low, so a one-slot server is not flooded before the first answers.
pub const INITIAL_LIMIT: f64 = 2.0;
/// A call within this factor of the baseline counts as unqueued.
const GROW_BELOW: f64 = 1.5;
/// A call beyond this factor of the baseline shows the backend queueing calls.
const SHRINK_ABOVE: f64 = 1.8;
/// How much the baseline may rise per sample (so a lasting slowdown is relearnt).
const BASELINE_DRIFT: f64 = 1.005;
/// Work units of a call's fixed overhead (connection, scheduling, the first token).
const OVERHEAD_UNITS: f64 = 8.0;
/// How many times the expected duration an attempt gets before it times out.
const TIMEOUT_HEADROOM: f64 = 4.0;
/// Calls whose prompt and completion sizes each differ by less than this factor share a baseline.
const BAND_WIDTH: f64 = 2.0;
/// The first call of a size, beyond this factor of its role's best rate of any
/// size, waited in the backend's queue (loose: that rate was of other sizes).
const NEW_SIZE_QUEUED_ABOVE: f64 = 3.0;

/// The work of a call in units comparable across sizes.
pub fn work_units(prompt_tokens: u64, completion_tokens: u64) -> f64 {
    completion_tokens as f64 + prompt_tokens as f64 / 16.0 + OVERHEAD_UNITS
}

/// The adaptive limit of one backend. Shared by every clone of its client.
#[derive(Debug)]
pub struct AdaptiveLimit {
    state: Mutex<State>,
    freed: Notify,
}

#[derive(Debug, Clone)]
struct State {
    limit: f64,
    /// Most calls the backend holds, as it said (its slots) or showed (a full
    /// cache); the limit never grows past it. Starts at the ceiling.
    cap: f64,
    /// Counts the cap's changes: a full cache seen by a call sent before the
    /// last change was part of the filling already counted.
    cap_changes: u64,
    /// Until the backend first shows a queue, every unqueued call grows the limit by one.
    slow_start: bool,
    in_flight: usize,
    /// The best latency per work unit seen (ms) per role and band of prompt and completion tokens.
    baseline: HashMap<(usize, i32, i32), f64>,
    /// A limit resumed from an earlier process, not yet confirmed by this one.
    resumed: Option<Resumed>,
}

/// A resumed limit's probation. A call far beyond its baseline (more than
/// [`NEW_SIZE_QUEUED_ABOVE`] times: it waited behind two or more calls'
/// worth of work) ends it with the limit cut to the most calls the backend
/// was seen to serve at once: the calls that came back unqueued, or the
/// unqueued time of every answer since the first call was sent over the time
/// since (Little's law: a one-slot server's answers come one service time
/// apart, so that share is one). A limit's worth of unqueued calls confirms it.
#[derive(Debug, Clone)]
struct Resumed {
    /// When the first call under the resumed limit was sent.
    since: Option<std::time::Instant>,
    /// The answers' latencies as their baselines say they would be unqueued, summed (ms).
    served_ms: f64,
    /// Answers within [`SHRINK_ABOVE`] of their baseline.
    unqueued: usize,
}

/// A resumed limit's probation learns from one answer, `ratio` times its
/// baseline: true when it settled the limit (see [`Resumed`]).
fn probation(s: &mut State, latency: Duration, ratio: f64, now: std::time::Instant) -> bool {
    let Some(r) = s.resumed.as_mut() else { return false };
    r.served_ms += latency.as_secs_f64() * 1000.0 / ratio.max(1.0);
    if ratio <= SHRINK_ABOVE {
        r.unqueued += 1;
        if r.unqueued as f64 >= s.limit {
            s.resumed = None;
        }
        return false;
    }
    if ratio <= NEW_SIZE_QUEUED_ABOVE {
        return false;
    }
    let elapsed_ms = r.since.map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64() * 1000.0);
    let served_at_once = if elapsed_ms > 0.0 { r.served_ms / elapsed_ms } else { 1.0 };
    let seen = (r.unqueued as f64).max(served_at_once.round()).max(1.0);
    s.limit = s.limit.min(seen);
    s.slow_start = false;
    s.resumed = None;
    true
}

/// The band a token count falls in.
fn band(tokens: u64) -> i32 {
    ((tokens.max(1) as f64).ln() / BAND_WIDTH.ln()).floor() as i32
}

/// Where a role's baselines are kept.
fn role_index(role: LlmRole) -> usize {
    match role {
        LlmRole::Reflector => 0,
        LlmRole::Aggregator => 1,
        LlmRole::Gate => 2,
        LlmRole::Judge => 2,
    }
}

/// What one attempt showed about the backend.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttemptSignal {
    /// Answered (successfully or with an error that is no sign of overload) in `latency`.
    Answered { role: LlmRole, latency: Duration, prompt_tokens: u64, completion_tokens: u64 },
    /// 429, 503 or a timeout: the backend is overloaded.
    Overloaded,
    /// The server's shared context (KV cache) filled with the calls in flight.
    CacheFull,
    /// A failure that says nothing about load (a rejected request, a broken connection).
    Neutral,
}

/// A held slot; dropping it frees the slot.
#[derive(Debug)]
pub struct Slot<'a> {
    owner: &'a AdaptiveLimit,
    /// The limit when the slot was granted, for the call record.
    pub limit_at_send: u32,
    /// Calls in flight when this one was sent, itself included.
    pub in_flight_at_send: usize,
    /// The cap's changes when the slot was granted.
    cap_changes_at_send: u64,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Ok(mut s) = self.owner.state.lock() {
            s.in_flight = s.in_flight.saturating_sub(1);
        }
        self.owner.freed.notify_waiters();
        self.owner.publish();
    }
}

impl AdaptiveLimit {
    pub fn new(ceiling: usize) -> Self {
        let ceiling = ceiling.max(1);
        Self {
            state: Mutex::new(State {
                limit: INITIAL_LIMIT.min(ceiling as f64),
                cap: ceiling as f64,
                cap_changes: 0,
                slow_start: true,
                in_flight: 0,
                baseline: HashMap::new(),
                resumed: None,
            }),
            freed: Notify::new(),
        }
    }

    /// Starts from `remembered`, the limit this backend earned in an earlier
    /// process (within the ceiling, never below where a new backend starts),
    /// on probation; a limit that already learned from calls is left alone.
    pub fn resume(&self, remembered: u32) {
        let Ok(mut s) = self.state.lock() else { return };
        if !s.baseline.is_empty() || s.in_flight > 0 {
            return;
        }
        // Within the cap: the ceiling, or less where the server said it holds less (its slots, a full context).
        let start = INITIAL_LIMIT.min(s.cap);
        let limit = f64::from(remembered).clamp(start, s.cap);
        if limit > s.limit {
            s.limit = limit;
            s.resumed = Some(Resumed { since: None, served_ms: 0.0, unqueued: 0 });
        }
    }

    /// The current limit, as a whole number of calls.
    pub fn limit(&self) -> u32 {
        self.state.lock().map_or(1, |s| s.limit.floor().max(1.0) as u32)
    }

    /// Waits for a free slot under the current limit.
    pub async fn acquire(&self) -> Slot<'_> {
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Ok(mut s) = self.state.lock() {
                let limit = s.limit.floor().max(1.0) as usize;
                if s.in_flight < limit {
                    s.in_flight += 1;
                    if let Some(r) = s.resumed.as_mut() {
                        r.since.get_or_insert_with(std::time::Instant::now);
                    }
                    let slot = Slot {
                        owner: self,
                        limit_at_send: limit as u32,
                        in_flight_at_send: s.in_flight,
                        cap_changes_at_send: s.cap_changes,
                    };
                    drop(s);
                    self.publish();
                    return slot;
                }
            } else {
                // A panic elsewhere poisoned the state: fall back to one call at a time.
                return Slot { owner: self, limit_at_send: 1, in_flight_at_send: 1, cap_changes_at_send: 0 };
            }
            notified.await;
        }
    }

    /// Learns from one attempt made in `slot`.
    pub fn record(&self, slot: &Slot<'_>, sample: AttemptSignal) {
        self.record_at(slot, sample, std::time::Instant::now());
    }

    /// [`AdaptiveLimit::record`], the attempt having ended at `now`.
    fn record_at(&self, slot: &Slot<'_>, sample: AttemptSignal, now: std::time::Instant) {
        let Ok(mut s) = self.state.lock() else { return };
        let before = s.limit;
        match sample {
            AttemptSignal::Overloaded => {
                s.slow_start = false;
                s.resumed = None;
                s.limit = (s.limit / 2.0).max(1.0);
            }
            AttemptSignal::Neutral => {}
            AttemptSignal::CacheFull => {
                s.slow_start = false;
                if slot.cap_changes_at_send == s.cap_changes {
                    // The calls in flight now, this one included, did not fit.
                    let fits = s.in_flight.saturating_sub(1).max(1) as f64;
                    s.cap = s.cap.min(fits);
                    s.cap_changes += 1;
                }
                s.limit = s.limit.min(s.cap);
            }
            AttemptSignal::Answered { role, latency, prompt_tokens, completion_tokens } => {
                let rate = latency.as_secs_f64() * 1000.0 / work_units(prompt_tokens, completion_tokens);
                let role_index = role_index(role);
                let key = (role_index, band(prompt_tokens), band(completion_tokens));
                let ratio = match s.baseline.get(&key) {
                    Some(&b) => {
                        s.baseline.insert(key, rate.min(b * BASELINE_DRIFT));
                        if b > 0.0 { rate / b } else { 1.0 }
                    }
                    None => {
                        let best = s.baseline.iter().filter(|((r, _, _), _)| *r == role_index).map(|(_, b)| *b);
                        match best.reduce(f64::min) {
                            Some(best) if best > 0.0 && rate / best > NEW_SIZE_QUEUED_ABOVE => rate / best,
                            // Unqueued as far as can be told, or the first call of its role: its size's baseline.
                            _ => {
                                s.baseline.insert(key, rate);
                                if let Some(r) = s.resumed.as_mut() {
                                    r.served_ms += latency.as_secs_f64() * 1000.0;
                                    r.unqueued += 1;
                                }
                                return;
                            }
                        }
                    }
                };
                if s.resumed.is_some() && probation(&mut s, latency, ratio, now) {
                    return;
                }
                // Grow only when the limit was in use: an idle limit proves nothing.
                let in_use = slot.in_flight_at_send as f64 >= (s.limit / 2.0).floor().max(1.0);
                if ratio > SHRINK_ABOVE {
                    s.slow_start = false;
                    s.limit = (s.limit - 2.0 / s.limit).max(1.0);
                } else if ratio < GROW_BELOW && in_use {
                    let step = if s.slow_start { 1.0 } else { 1.0 / s.limit };
                    s.limit = (s.limit + step).min(s.cap);
                }
            }
        }
        if s.limit.floor() > before.floor() {
            drop(s);
            self.freed.notify_waiters();
        }
    }

    /// The backend serves at most `calls` at once (the slots it says it has):
    /// more would only wait in its queue.
    pub fn cap_at(&self, calls: usize) {
        let Ok(mut s) = self.state.lock() else { return };
        let cap = calls.max(1) as f64;
        if cap < s.cap {
            s.cap = cap;
            s.cap_changes += 1;
            s.limit = s.limit.min(cap);
        }
    }

    /// The limit a new process may start from: this one's, once it has
    /// learned from calls; `None` before (a resumed limit still on probation
    /// is what was remembered, not what was learned).
    pub fn earned(&self) -> Option<u32> {
        let s = self.state.lock().ok()?;
        (!s.baseline.is_empty() && s.resumed.is_none()).then(|| s.limit.floor().max(1.0) as u32)
    }

    /// The time limit of one attempt of `role` with about `prompt_tokens` in and
    /// at most `max_tokens` out: `TIMEOUT_HEADROOM` times what the backend's
    /// baseline says it takes, times the calls in flight ahead of it (a backend
    /// that queues serves them first), and never less than `floor` (before any
    /// baseline: `floor` per call in flight).
    pub fn attempt_timeout(
        &self,
        role: LlmRole,
        prompt_tokens: u64,
        max_tokens: u64,
        in_flight: usize,
        floor: Duration,
    ) -> Duration {
        // The slowest rate of any band (ms per work unit): generous, as a time limit should be.
        let rate = self.state.lock().ok().and_then(|s| {
            s.baseline.iter().filter(|((r, _, _), _)| *r == role_index(role)).map(|(_, rate)| *rate).reduce(f64::max)
        });
        let Some(rate) = rate else {
            // Nothing measured yet: the floor for each call that may be served before this one.
            return floor * u32::try_from(in_flight.max(1)).unwrap_or(u32::MAX);
        };
        let expected_ms = rate * work_units(prompt_tokens, max_tokens) * in_flight.max(1) as f64;
        let fitted = Duration::try_from_secs_f64(expected_ms * TIMEOUT_HEADROOM / 1000.0).unwrap_or(floor);
        fitted.max(floor)
    }

    /// The gauges `/metrics` shows for this backend.
    fn publish(&self) {
        if let Ok(s) = self.state.lock() {
            metrics::gauge!("combee_llm_concurrency_limit").set(s.limit.floor());
            metrics::gauge!("combee_llm_in_flight").set(s.in_flight as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(ms: u64) -> AttemptSignal {
        AttemptSignal::Answered {
            role: LlmRole::Reflector,
            latency: Duration::from_millis(ms),
            prompt_tokens: 1600,
            completion_tokens: 92,
        }
    }

    /// Drives the limit with a backend that serves `slots` calls at once, each
    /// taking `ms` of its own time: a call waits behind the others beyond the
    /// slots, as a local server's queue makes it.
    async fn settle(limit: &AdaptiveLimit, slots: usize, ms: u64, rounds: usize) -> Vec<u32> {
        let mut seen = Vec::new();
        for _ in 0..rounds {
            let n = limit.limit() as usize;
            let mut held = Vec::new();
            for _ in 0..n {
                held.push(limit.acquire().await);
            }
            // The i-th call waits for the waves of calls ahead of it.
            for (i, slot) in held.iter().enumerate() {
                limit.record(slot, answered(ms * (i / slots + 1) as u64));
            }
            seen.push(limit.limit());
        }
        seen
    }

    #[tokio::test]
    async fn a_one_slot_server_settles_near_one_call_in_flight() {
        let limit = AdaptiveLimit::new(64);
        let seen = settle(&limit, 1, 400, 40).await;
        let tail = &seen[20..];
        assert!(tail.iter().all(|&l| l <= 2), "{seen:?}");
    }

    /// Drives the limit with calls of varied sizes, as a real round's are (the
    /// reflections' answers vary, aggregations read more), on a backend that
    /// serves `slots` calls at once and whose service time is `cost(prompt,
    /// completion)` ms, in proportions the limit does not know.
    async fn settle_varied(
        limit: &AdaptiveLimit,
        slots: usize,
        cost: impl Fn(u64, u64) -> f64,
        rounds: usize,
    ) -> Vec<u32> {
        let mut seen = Vec::new();
        let mut k: u64 = 7;
        for _ in 0..rounds {
            let n = limit.limit() as usize;
            let mut held = Vec::new();
            for _ in 0..n {
                held.push(limit.acquire().await);
            }
            // Each of the backend's slots works through its share of the calls in order.
            let mut slot_busy_ms = vec![0.0; slots.min(n).max(1)];
            for (i, slot) in held.iter().enumerate() {
                k = k.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let prompt = 600 + (k >> 33) % 2400;
                let completion = 40 + (k >> 17) % 600;
                let lane = i % slot_busy_ms.len();
                slot_busy_ms[lane] += cost(prompt, completion);
                let role = if (k >> 40).is_multiple_of(4) { LlmRole::Aggregator } else { LlmRole::Reflector };
                limit.record(
                    slot,
                    AttemptSignal::Answered {
                        role,
                        latency: Duration::from_secs_f64(slot_busy_ms[lane] / 1000.0),
                        prompt_tokens: prompt,
                        completion_tokens: completion,
                    },
                );
            }
            seen.push(limit.limit());
        }
        seen
    }

    /// A CPU server: reading a prompt token costs a sixtieth of writing one.
    fn cpu_cost(prompt: u64, completion: u64) -> f64 {
        150.0 + prompt as f64 * 0.4 + completion as f64 * 25.0
    }

    /// A GPU service: prompt tokens are almost free beside completion tokens.
    fn gpu_cost(prompt: u64, completion: u64) -> f64 {
        50.0 + prompt as f64 * 0.02 + completion as f64 * 10.0
    }

    #[tokio::test]
    async fn a_one_slot_server_settles_near_one_even_when_call_sizes_vary() {
        // The first call of each size seen used to become its size's baseline even
        // when it had waited behind others, so queued calls later looked unqueued.
        let limit = AdaptiveLimit::new(64);
        let seen = settle_varied(&limit, 1, cpu_cost, 80).await;
        let tail = &seen[30..];
        // A call that waited behind a much smaller one looks unqueued: the limit
        // touches three now and then, but stays about two.
        let mean = tail.iter().sum::<u32>() as f64 / tail.len() as f64;
        assert!(tail.iter().all(|&l| l <= 3) && mean <= 2.5, "mean {mean:.2}: {seen:?}");
    }

    #[tokio::test]
    async fn a_parallel_backend_grows_to_the_ceiling_when_call_sizes_vary() {
        for cost in [cpu_cost as fn(u64, u64) -> f64, gpu_cost] {
            let limit = AdaptiveLimit::new(32);
            let seen = settle_varied(&limit, 1000, cost, 60).await;
            assert_eq!(*seen.last().unwrap(), 32, "{seen:?}");
        }
    }

    #[tokio::test]
    async fn a_parallel_backend_grows_to_the_ceiling() {
        let limit = AdaptiveLimit::new(32);
        let seen = settle(&limit, 1000, 400, 40).await;
        assert_eq!(*seen.last().unwrap(), 32, "{seen:?}");
    }

    #[tokio::test]
    async fn a_backend_with_eight_slots_settles_near_eight() {
        let limit = AdaptiveLimit::new(64);
        let seen = settle(&limit, 8, 400, 80).await;
        let tail = &seen[40..];
        assert!(tail.iter().all(|&l| (8..=16).contains(&l)), "{seen:?}");
    }

    #[tokio::test]
    async fn overload_halves_the_limit_and_never_goes_below_one() {
        let limit = AdaptiveLimit::new(64);
        settle(&limit, 1000, 100, 10).await;
        let before = limit.limit();
        let slot = limit.acquire().await;
        limit.record(&slot, AttemptSignal::Overloaded);
        assert_eq!(limit.limit(), before / 2);
        for _ in 0..10 {
            limit.record(&slot, AttemptSignal::Overloaded);
        }
        assert_eq!(limit.limit(), 1);
    }

    /// A limit resumed at `remembered` sends a full wave at once to a backend
    /// of `slots` slots whose calls take 400 ms each; the answers come back in
    /// the order sent, each wave of `slots` 400 ms after the one before (time
    /// is the test's own). The limit after each answer.
    async fn resumed_wave(remembered: u32, slots: usize) -> Vec<u32> {
        let limit = AdaptiveLimit::new(64);
        limit.resume(remembered);
        let mut held = Vec::new();
        for _ in 0..limit.limit() {
            held.push(limit.acquire().await);
        }
        let start = std::time::Instant::now();
        let mut seen = Vec::new();
        for (i, slot) in held.iter().enumerate() {
            let ms = 400 * (i / slots + 1) as u64;
            limit.record_at(slot, answered(ms), start + Duration::from_millis(ms));
            seen.push(limit.limit());
        }
        seen
    }

    #[tokio::test]
    async fn a_resumed_limit_falls_at_once_to_a_one_slot_server() {
        // The backend served 64 at once in an earlier process; now it has one slot.
        let seen = resumed_wave(64, 1).await;
        assert_eq!(seen[0], 64, "{seen:?}");
        assert_eq!(seen[3], 1, "the fourth answer, four service times late, cuts it: {seen:?}");
    }

    #[tokio::test]
    async fn a_resumed_limit_falls_to_about_what_a_smaller_backend_serves() {
        // Eight slots: the fourth wave's first answer, four service times late, cuts it.
        let seen = resumed_wave(64, 8).await;
        assert!(seen[23] > 32, "{seen:?}");
        assert_eq!(seen[24], 8, "{seen:?}");
    }

    #[tokio::test]
    async fn a_resumed_limit_holds_on_a_backend_as_large_as_it_was() {
        let limit = AdaptiveLimit::new(64);
        limit.resume(48);
        assert_eq!(limit.earned(), None, "nothing learned yet");
        let seen = settle(&limit, 1000, 400, 3).await;
        assert!(seen.iter().all(|&l| l >= 48), "{seen:?}");
        assert!(limit.earned().is_some_and(|l| l >= 48), "a limit's worth of unqueued calls confirms it");
    }

    #[tokio::test]
    async fn a_limit_that_learned_is_not_resumed_and_a_remembered_one_stays_within_bounds() {
        let limit = AdaptiveLimit::new(64);
        settle(&limit, 1, 400, 5).await;
        let learned = limit.limit();
        limit.resume(64);
        assert_eq!(limit.limit(), learned, "what this process learned wins");
        let fresh = AdaptiveLimit::new(16);
        fresh.resume(1000);
        assert_eq!(fresh.limit(), 16, "within the ceiling");
        let low = AdaptiveLimit::new(16);
        low.resume(1);
        assert_eq!(low.limit(), 2, "never below where a new backend starts");
    }

    #[tokio::test]
    async fn a_full_cache_caps_the_limit_below_the_calls_that_filled_it_once() {
        let limit = AdaptiveLimit::new(64);
        settle(&limit, 1000, 100, 6).await;
        assert!(limit.limit() >= 8, "grown first: {}", limit.limit());
        // Eight calls in flight fill the cache; every one of them is told so.
        let held: Vec<Slot<'_>> = futures_util::future::join_all((0..8).map(|_| limit.acquire())).await;
        for slot in held {
            limit.record(&slot, AttemptSignal::CacheFull);
            drop(slot);
        }
        assert_eq!(limit.limit(), 7, "one filling, one cap: below the eight that did not fit");
        // Fast answers afterwards never grow it past the cap.
        settle(&limit, 1000, 100, 20).await;
        assert_eq!(limit.limit(), 7);
        // A server that says it has four slots caps it there.
        limit.cap_at(4);
        assert_eq!(limit.limit(), 4);
        settle(&limit, 1000, 100, 20).await;
        assert_eq!(limit.limit(), 4);
        limit.cap_at(16);
        assert_eq!(limit.limit(), 4, "a cap only ever lowers");
    }

    #[tokio::test]
    async fn waiting_calls_get_a_slot_when_one_frees() {
        let limit = std::sync::Arc::new(AdaptiveLimit::new(1));
        let first = limit.acquire().await;
        let l2 = limit.clone();
        let waiter = tokio::spawn(async move {
            let s = l2.acquire().await;
            s.in_flight_at_send
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(first);
        assert_eq!(waiter.await.unwrap(), 1);
    }

    #[tokio::test]
    async fn the_attempt_timeout_fits_the_call_and_the_queue() {
        let limit = AdaptiveLimit::new(4);
        let floor = Duration::from_secs(10);
        assert_eq!(limit.attempt_timeout(LlmRole::Reflector, 2000, 1024, 1, floor), floor, "no baseline yet");
        assert_eq!(limit.attempt_timeout(LlmRole::Reflector, 2000, 1024, 2, floor), floor * 2, "one call ahead");
        let slot = limit.acquire().await;
        // 1 s for 108 units (100 of prompt, 8 of overhead): a 1024-token answer to the same
        // prompt is 1132 units, 10.5 s at that rate, four times that as its limit.
        limit.record(
            &slot,
            AttemptSignal::Answered {
                role: LlmRole::Reflector,
                latency: Duration::from_millis(1000),
                prompt_tokens: 1600,
                completion_tokens: 0,
            },
        );
        drop(slot);
        let one = limit.attempt_timeout(LlmRole::Reflector, 1600, 1024, 1, floor);
        assert!((one.as_secs_f64() - 4.0 * 1132.0 / 108.0).abs() < 0.1, "{one:?}");
        let queued = limit.attempt_timeout(LlmRole::Reflector, 1600, 1024, 3, floor);
        assert!((queued.as_secs_f64() - 3.0 * one.as_secs_f64()).abs() < 0.5, "{queued:?}");
        // The aggregator has no baseline of its own yet.
        assert_eq!(limit.attempt_timeout(LlmRole::Aggregator, 1600, 1024, 1, floor), floor);
    }
}
