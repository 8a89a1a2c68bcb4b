//! Folds the outcome rollups' delta rows: every trace write appends signed
//! rows (see `store::rollups`), and this job, run by worker processes, merges
//! each key's rows into one every few seconds so reads stay O(buckets).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::store::DynStore;

/// Keys folded per statement.
const KEYS_PER_PASS: u32 = 5_000;
/// Pause between passes when nothing is left.
const IDLE: Duration = Duration::from_secs(5);

/// Compacts until `shutdown`.
pub async fn compact_forever(store: DynStore, shutdown: CancellationToken) {
    loop {
        let started = std::time::Instant::now();
        let wait = match store.compact_rollups(KEYS_PER_PASS).await {
            Ok(n) => {
                metrics::counter!("combee_rollup_rows_compacted_total").increment(n);
                // On the embedded store a pass holds the one writer, and trace writes wait behind it.
                metrics::histogram!("combee_rollup_compaction_seconds").record(started.elapsed().as_secs_f64());
                // A full pass: more may be waiting.
                if n >= u64::from(KEYS_PER_PASS) { Duration::from_millis(50) } else { IDLE }
            }
            Err(e) => {
                tracing::warn!(error = %e, "outcome rollup compaction failed");
                IDLE
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
