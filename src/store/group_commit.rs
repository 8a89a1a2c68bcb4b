//! Group commit for trace writes: concurrent requests are gathered and
//! committed together, one transaction and one flush to disk for the group,
//! and each request is answered only after its group is durable.
//!
//! A write is a job sent to a *lane*, a task that owns the commits of its
//! groups. A lane takes the first job waiting, then every job already queued
//! behind it (up to a bound), and commits them as one group. Nothing waits on
//! a timer: an idle store commits a lone request at once, and a busy one
//! gathers what arrived while the previous group was committing, so groups
//! grow exactly as fast as the store falls behind. Where there are several
//! lanes, a second one starts a group beside a committing one only once
//! enough rows wait to be worth a commit of their own. The lanes are tasks of
//! their own, so a request whose client goes away never strands the others
//! of its group. What a job does inside the group, and how one failing job
//! is kept from failing its neighbours, is the backend's (see
//! `sqlite/trace_writes.rs`, `postgres/trace_writes.rs`).

use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio::sync::{Mutex, Notify, mpsc, oneshot};

use super::{StoreError, StoreResult};

/// How many jobs may wait for a lane before a sender waits too (back pressure).
const QUEUE: usize = 8192;

/// The sending side of the lanes; the lanes stop when it is dropped.
pub struct GroupCommit<J> {
    jobs: mpsc::Sender<J>,
}

/// How many lanes are committing, and a signal each time one finishes.
#[derive(Default)]
struct Committing {
    lanes: AtomicUsize,
    done: Notify,
}

impl Committing {
    /// Counts a lane as committing until the guard is dropped (unwinding
    /// too: a lane that panicked must not keep the others gathering).
    fn begin(&self) -> CommitGuard<'_> {
        self.lanes.fetch_add(1, Ordering::SeqCst);
        CommitGuard(self)
    }
}

struct CommitGuard<'a>(&'a Committing);

impl Drop for CommitGuard<'_> {
    fn drop(&mut self) {
        self.0.lanes.fetch_sub(1, Ordering::SeqCst);
        self.0.done.notify_waiters();
    }
}

/// The jobs a lane is gathering, and their weight.
struct Group<J> {
    jobs: Vec<J>,
    weight: usize,
    max_weight: usize,
}

impl<J: Weighed> Group<J> {
    /// Adds `job` if the group stays within its bound; gives it back if not.
    fn add(&mut self, job: J) -> Result<(), J> {
        if self.weight + job.weight() > self.max_weight {
            return Err(job);
        }
        self.weight += job.weight();
        self.jobs.push(job);
        Ok(())
    }
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
    ///
    /// A lane commits at once when no other lane is committing; while one is,
    /// another lane starts a group beside it only once `join_weight` rows
    /// are waiting, and until then gathers what arrives (the committing lane,
    /// when done, finds them gathered). Every commit has a cost of its own
    /// (a statement, a flush), so splitting a short queue between lanes
    /// makes more, smaller groups and costs the store more for the same rows;
    /// lanes run side by side when the queue is deep enough to fill them.
    pub(super) fn start<F, Fut>(lanes: usize, max_weight: usize, join_weight: usize, commit: F) -> Self
    where
        F: Fn(Vec<J>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (jobs, queue) = mpsc::channel::<J>(QUEUE);
        let queue = Arc::new(Mutex::new(queue));
        let commit = Arc::new(commit);
        let committing = Arc::new(Committing::default());
        for _ in 0..lanes.max(1) {
            let (queue, commit, committing) = (queue.clone(), commit.clone(), committing.clone());
            tokio::spawn(async move {
                // A job that did not fit the last group opens the next one.
                let mut carried: Option<J> = None;
                loop {
                    let group = {
                        let mut queue = queue.lock().await;
                        let first = match carried.take() {
                            Some(job) => job,
                            None => match queue.recv().await {
                                Some(job) => job,
                                None => return,
                            },
                        };
                        let mut group = Group { weight: first.weight(), jobs: vec![first], max_weight };
                        // Beside a committing lane: gather until the group is worth a commit of its own.
                        while group.weight < join_weight.min(max_weight) {
                            let idle = committing.done.notified();
                            tokio::pin!(idle);
                            idle.as_mut().enable();
                            if committing.lanes.load(Ordering::SeqCst) == 0 {
                                break;
                            }
                            let job = tokio::select! {
                                job = queue.recv() => job,
                                _ = &mut idle => continue,
                            };
                            let Some(job) = job else { break };
                            if let Err(job) = group.add(job) {
                                carried = Some(job);
                                break;
                            }
                        }
                        while group.weight < max_weight && carried.is_none() {
                            let Ok(job) = queue.try_recv() else { break };
                            if let Err(job) = group.add(job) {
                                carried = Some(job);
                            }
                        }
                        group
                    };
                    let started = std::time::Instant::now();
                    let busy = committing.begin();
                    let weight = group.weight;
                    commit(group.jobs).await;
                    drop(busy);
                    record_group(weight, started);
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

/// Where the write path's time goes: how full a group was and how long its
/// commit took (a lane's groups, and a request committed alone beside them).
pub(super) fn record_group(rows: usize, started: std::time::Instant) {
    metrics::histogram!("combee_store_write_group_rows").record(rows as f64);
    metrics::histogram!("combee_store_write_group_seconds").record(started.elapsed().as_secs_f64());
}

/// Times the phases of a group's commit into `combee_store_write_phase_seconds`.
pub(super) struct PhaseClock(std::time::Instant);

impl PhaseClock {
    pub(super) fn start() -> Self {
        Self(std::time::Instant::now())
    }

    pub(super) fn lap(&mut self, phase: &'static str) {
        let now = std::time::Instant::now();
        metrics::histogram!("combee_store_write_phase_seconds", "phase" => phase)
            .record(now.duration_since(self.0).as_secs_f64());
        self.0 = now;
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

#[cfg(test)]
mod tests {
    use std::{sync::Mutex as StdMutex, time::Duration};

    use tokio::sync::Semaphore;

    use super::*;

    struct UnitRow;

    impl Weighed for UnitRow {
        fn weight(&self) -> usize {
            1
        }
    }

    /// What the lanes' commits saw: the size of each group in the order its
    /// commit started, a signal at each start, and the permits that let a
    /// commit end (none until the test gives them): no clock in the test.
    struct Commits {
        sizes: StdMutex<Vec<usize>>,
        started: Notify,
        finish: Semaphore,
    }

    impl Commits {
        fn new() -> Self {
            Self { sizes: StdMutex::default(), started: Notify::new(), finish: Semaphore::new(0) }
        }

        /// Waits until the commits started are `expected`.
        async fn started_are(&self, expected: &[usize]) {
            let wait = async {
                loop {
                    let next = self.started.notified();
                    if *self.sizes.lock().unwrap() == expected {
                        return;
                    }
                    next.await;
                }
            };
            let seen = self.sizes.lock().unwrap().clone();
            tokio::time::timeout(Duration::from_secs(10), wait)
                .await
                .unwrap_or_else(|_| panic!("commits {expected:?} never started (first seen: {seen:?})"));
        }
    }

    /// Four lanes whose commits each wait for a permit from the test.
    fn lanes(join_weight: usize) -> (GroupCommit<UnitRow>, Arc<Commits>) {
        let commits = Arc::new(Commits::new());
        let seen = commits.clone();
        let lanes = GroupCommit::start(4, 1024, join_weight, move |group: Vec<UnitRow>| {
            seen.sizes.lock().unwrap().push(group.len());
            seen.started.notify_waiters();
            let seen = seen.clone();
            async move { seen.finish.acquire().await.expect("the semaphore stays open").forget() }
        });
        (lanes, commits)
    }

    /// Lets the lanes run until every queued job was taken by one of them.
    async fn queue_taken(lanes: &GroupCommit<UnitRow>) {
        while lanes.jobs.capacity() < lanes.jobs.max_capacity() {
            tokio::task::yield_now().await;
        }
        // One more turn: a lane that took the last job adds it to its group.
        tokio::task::yield_now().await;
    }

    /// A lone write is committed at once; what arrives while it commits is
    /// gathered into one group, not split between the idle lanes.
    #[tokio::test]
    async fn a_short_queue_waits_for_the_committing_lane_instead_of_splitting() {
        let (lanes, commits) = lanes(32);
        lanes.submit(UnitRow).await.unwrap();
        commits.started_are(&[1]).await;
        for _ in 0..10 {
            lanes.submit(UnitRow).await.unwrap();
            tokio::task::yield_now().await;
        }
        queue_taken(&lanes).await;
        assert_eq!(*commits.sizes.lock().unwrap(), [1], "nothing committed beside the first");
        commits.finish.add_permits(1);
        commits.started_are(&[1, 10]).await;
        commits.finish.add_permits(1);
    }

    /// Once a group's worth of rows is waiting, another lane commits it
    /// beside the busy one (rows arriving 4, 4 and 2 at a time).
    #[tokio::test]
    async fn a_deep_queue_runs_lanes_side_by_side() {
        let (lanes, commits) = lanes(4);
        lanes.submit(UnitRow).await.unwrap();
        commits.started_are(&[1]).await;
        for (arriving, then) in [(4, &[1, 4][..]), (4, &[1, 4, 4][..])] {
            for _ in 0..arriving {
                lanes.submit(UnitRow).await.unwrap();
            }
            commits.started_are(then).await;
        }
        lanes.submit(UnitRow).await.unwrap();
        lanes.submit(UnitRow).await.unwrap();
        queue_taken(&lanes).await;
        assert_eq!(*commits.sizes.lock().unwrap(), [1, 4, 4], "two rows wait for a lane to be done");
        commits.finish.add_permits(3);
        commits.started_are(&[1, 4, 4, 2]).await;
        commits.finish.add_permits(1);
    }
}
