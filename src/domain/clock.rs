//! The time the learning worker and the budget read: the system clock, moved
//! by an offset a test or a benchmark sets, so a simulated day can end without
//! waiting for it (the store's own timestamps — leases, `created_at` — keep
//! the real clock).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use chrono::{DateTime, Utc};

/// A cheap handle; clones share the offset.
#[derive(Debug, Clone, Default)]
pub struct Clock {
    offset_ms: Arc<AtomicI64>,
}

impl Clock {
    /// Now, as this clock reads it.
    pub fn now(&self) -> DateTime<Utc> {
        let offset = chrono::Duration::milliseconds(self.offset_ms.load(Ordering::Relaxed));
        Utc::now().checked_add_signed(offset).unwrap_or_else(Utc::now)
    }

    /// Moves this clock (and every clone) `by` forward.
    pub fn advance(&self, by: chrono::Duration) {
        self.offset_ms.fetch_add(by.num_milliseconds(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_advanced_clock_reads_later_in_every_clone() {
        let clock = Clock::default();
        let other = clock.clone();
        clock.advance(chrono::Duration::days(1));
        let ahead = other.now() - Utc::now();
        assert!(ahead > chrono::Duration::hours(23) && ahead <= chrono::Duration::days(1), "{ahead}");
    }
}
