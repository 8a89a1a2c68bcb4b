//! Group commit for trace writes: concurrent requests are gathered and
//! committed together, one transaction and one flush to disk for the group,
//! and each request is answered only after its group is durable.
//!
//! A write is a job sent to a *lane*, a task that owns the commits of its
//! groups. A lane takes the first job waiting, then every job already queued
//! behind it (up to a bound), and commits them as one group. Nothing waits on
//! a timer: an idle store commits a lone request at once, and a busy one
//! gathers what arrived while the previous group was committing, so groups
//! grow exactly as fast as the store falls behind. The lanes are tasks of
//! their own, so a request whose client goes away never strands the others
//! of its group. What a job does inside the group, and how one failing job
//! is kept from failing its neighbours, is the backend's (see `sqlite.rs`,
//! `postgres.rs`).

use std::{future::Future, sync::Arc};

use tokio::sync::{Mutex, mpsc, oneshot};

use super::{StoreError, StoreResult};

/// How many jobs may wait for a lane before a sender waits too (back pressure).
const QUEUE: usize = 8192;

/// The sending side of the lanes; the lanes stop when it is dropped.
pub struct GroupCommit<J> {
    jobs: mpsc::Sender<J>,
}

/// Something a lane can weigh, so a group stays within its bound.
pub trait Weighed {
    /// How many rows this job writes.
    fn weight(&self) -> usize;
}

impl<J: Weighed + Send + 'static> GroupCommit<J> {
    /// Starts `lanes` lanes, each committing groups of at most `max_weight`
    /// rows (a single job heavier than that is a group of its own) with
    /// `commit`, which must answer every job of the group it is given.
    pub(super) fn start<F, Fut>(lanes: usize, max_weight: usize, commit: F) -> Self
    where
        F: Fn(Vec<J>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (jobs, queue) = mpsc::channel::<J>(QUEUE);
        let queue = Arc::new(Mutex::new(queue));
        let commit = Arc::new(commit);
        for _ in 0..lanes.max(1) {
            let (queue, commit) = (queue.clone(), commit.clone());
            tokio::spawn(async move {
                // A job that did not fit the last group opens the next one.
                let mut carried: Option<J> = None;
                loop {
                    let (group, weight) = {
                        let mut queue = queue.lock().await;
                        let first = match carried.take() {
                            Some(job) => job,
                            None => match queue.recv().await {
                                Some(job) => job,
                                None => return,
                            },
                        };
                        let mut weight = first.weight();
                        let mut group = vec![first];
                        while weight < max_weight {
                            let Ok(job) = queue.try_recv() else { break };
                            if weight + job.weight() > max_weight {
                                carried = Some(job);
                                break;
                            }
                            weight += job.weight();
                            group.push(job);
                        }
                        (group, weight)
                    };
                    let started = std::time::Instant::now();
                    commit(group).await;
                    // Where the write path's time goes: how full groups are and how long each holds its lane.
                    metrics::histogram!("combee_store_write_group_rows").record(weight as f64);
                    metrics::histogram!("combee_store_write_group_seconds").record(started.elapsed().as_secs_f64());
                }
            });
        }
        Self { jobs }
    }

    /// Queues a job; its answer comes on the receiver the job carries.
    pub(super) async fn submit(&self, job: J) -> StoreResult<()> {
        self.jobs.send(job).await.map_err(|_| StoreError::Unavailable(sqlx::Error::PoolClosed))
    }
}

/// Waits for a job's answer; a lane that ended without answering (the store
/// closing) reads as the store being unavailable.
pub(super) async fn answer<T>(reply: oneshot::Receiver<StoreResult<T>>) -> StoreResult<T> {
    reply.await.unwrap_or(Err(StoreError::Unavailable(sqlx::Error::PoolClosed)))
}

/// The error each job of a group gets when the group's commit failed: the
/// one error cannot be cloned, so the others get an equivalent of its kind
/// (an outage stays an outage: the caller answers 503 and the client retries).
pub(super) fn shared_failure(error: &StoreError) -> StoreError {
    match error {
        StoreError::Unavailable(_) => StoreError::Unavailable(sqlx::Error::PoolTimedOut),
        StoreError::Invalid(why) => StoreError::Invalid(why.clone()),
        StoreError::Conflict => StoreError::Conflict,
        other => StoreError::Database(sqlx::Error::Protocol(format!("group commit failed: {other}"))),
    }
}
