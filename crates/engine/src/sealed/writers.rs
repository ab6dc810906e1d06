//! Threads that write sealed records for reactor tasks.
//!
//! A task on a connection's event loop that sealed records hands their
//! writes to these threads and waits for them as a task, so its loop keeps
//! reading and serving other requests meanwhile (one connection's 64 KiB
//! writes at QD8 were otherwise written one record at a time by the loop
//! itself). They never take the engine lock and need no reactor to finish,
//! so anyone may wait for their records synchronously, holding the engine
//! lock or not, on any thread: a barrier, the sealed-queue bound, the
//! switch to degraded mode. Each record is written exactly once.
//!
//! Callers without a reactor (the simulation tests, write-back, offline
//! commands) write their records themselves, as before: their order of
//! device events stays deterministic.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;

use cairn_device::Device;

use super::record::SealedRecord;
use super::record_io::RecordIo;
use crate::retry_policy::RetryPolicy;
use crate::stats::Counters;

/// Writer threads: on 2 cores, enough to keep several record writes in
/// flight on the device while the loops go on; more only add switches.
const RECORD_WRITER_THREADS: usize = 4;

/// One record to write, with everything the write needs.
pub(crate) struct RecordJob {
    pub(crate) record: Arc<SealedRecord>,
    pub(crate) cache: Arc<dyn Device>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) record_io: Arc<RecordIo>,
    pub(crate) policy: RetryPolicy,
}

impl RecordJob {
    fn run(self) {
        let claimed = std::slice::from_ref(&self.record);
        let _claimed = super::ClaimGuard::new(claimed, &self.record_io);
        let record = &self.record;
        let bufs = record.bufs();
        let c = &self.counters;
        let result = self.policy.run(
            &c.cache_write_errors,
            &c.cache_write_retries,
            "sealing a log record",
            || self.cache.write_vectored_at(record.at_bytes, &bufs),
        );
        record.publish_to(&self.record_io, result.map_err(|e| e.to_string()));
    }
}

/// The jobs waiting for a writer; no bound of its own, since every job is
/// a record the sealed queue holds until it is written (`SEALED_RECORDS_MAX`
/// and the records calls have claimed). Each submit wakes one idle writer: with
/// the receiver of a channel behind a mutex (as before), the writer that
/// took a job woke the next one to wait in its place, a second thread
/// switch per record.
struct JobQueue<T> {
    state: Mutex<QueueState<T>>,
    ready: Condvar,
}

struct QueueState<T> {
    jobs: VecDeque<T>,
    /// No more jobs come: writers finish the queue and exit.
    closed: bool,
}

impl<T> Default for JobQueue<T> {
    fn default() -> Self {
        JobQueue {
            state: Mutex::new(QueueState {
                jobs: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }
}

impl<T> JobQueue<T> {
    fn lock(&self) -> MutexGuard<'_, QueueState<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue `job`, or hand it back if the queue is closed.
    fn push(&self, job: T) -> Result<(), T> {
        let mut state = self.lock();
        if state.closed {
            return Err(job);
        }
        state.jobs.push_back(job);
        drop(state);
        self.ready.notify_one();
        Ok(())
    }

    /// The next job; `None` once the queue is closed and empty.
    fn pop(&self) -> Option<T> {
        let mut state = self.lock();
        loop {
            if let Some(job) = state.jobs.pop_front() {
                return Some(job);
            }
            if state.closed {
                return None;
            }
            state = self.ready.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }
}

struct Pool {
    jobs: Arc<JobQueue<RecordJob>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// Started at the first hand-off, so engines that never run on a reactor
/// never start a thread.
#[derive(Default)]
pub(crate) struct RecordWriters {
    pool: OnceLock<Result<Pool, String>>,
}

impl RecordWriters {
    /// Queue `job`; if no writer thread can run (they could not be
    /// started), it is written here, on the calling thread.
    pub(crate) fn submit(&self, job: RecordJob) {
        let pool = self.pool.get_or_init(start_pool);
        let job = match pool {
            Ok(pool) => match pool.jobs.push(job) {
                Ok(()) => return,
                Err(returned) => returned,
            },
            Err(_) => job,
        };
        job.run();
    }
}

fn start_pool() -> Result<Pool, String> {
    let jobs = Arc::new(JobQueue::default());
    let mut threads = Vec::with_capacity(RECORD_WRITER_THREADS);
    for i in 0..RECORD_WRITER_THREADS {
        let queue = jobs.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("record-writer-{i}"))
            .spawn(move || writer_loop(&queue));
        match spawned {
            Ok(handle) => threads.push(handle),
            Err(e) if threads.is_empty() => {
                tracing::warn!("cannot start record writer threads ({e}); records are written by the calling thread");
                return Err(e.to_string());
            }
            Err(e) => {
                tracing::warn!("started {i} of {RECORD_WRITER_THREADS} record writer threads: {e}");
                break;
            }
        }
    }
    Ok(Pool {
        jobs,
        threads: Mutex::new(threads),
    })
}

/// Take jobs until the queue is closed and empty. A job that panics has
/// its record published as failed (its guard) and the thread goes on: a
/// pool whose threads had all died would leave every later record queued
/// and never written.
fn writer_loop(queue: &JobQueue<RecordJob>) {
    take_jobs(queue, |job| job.record.sequence, RecordJob::run);
}

/// Run `run` on each job until the queue is closed and empty; a job that
/// panics is logged (with `label`) and the loop goes on.
fn take_jobs<T>(queue: &JobQueue<T>, label: impl Fn(&T) -> u64, run: impl Fn(T)) {
    while let Some(job) = queue.pop() {
        let sequence = label(&job);
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(job))).is_err() {
            tracing::error!(
                sequence,
                "a record writer panicked; its record was marked failed"
            );
        }
    }
}

impl Drop for RecordWriters {
    /// Finish the queued writes, then stop the threads.
    fn drop(&mut self) {
        let Some(Ok(pool)) = self.pool.get_mut() else {
            return;
        };
        pool.jobs.close();
        let threads = std::mem::take(pool.threads.get_mut().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{take_jobs, JobQueue};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn each_job_is_taken_once_and_a_closed_queue_drains_then_ends() {
        let queue = Arc::new(JobQueue::<u32>::default());
        let takers: Vec<_> = (0..3)
            .map(|_| {
                let queue = queue.clone();
                std::thread::spawn(move || {
                    let mut taken = Vec::new();
                    while let Some(job) = queue.pop() {
                        taken.push(job);
                    }
                    taken
                })
            })
            .collect();
        // The takers are asleep on an empty queue before the first push.
        std::thread::sleep(Duration::from_millis(50));
        for job in 0..1000 {
            assert!(queue.push(job).is_ok());
        }
        // Taken while the queue is open: a push wakes a waiting taker.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !queue.lock().jobs.is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "no taker woke for the jobs"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        queue.close();
        assert_eq!(queue.push(7), Err(7), "a closed queue hands the job back");
        let mut all: Vec<u32> = takers
            .into_iter()
            .flat_map(|t| t.join().expect("taker"))
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<_>>(), "every job exactly once");
        assert!(queue.pop().is_none());
    }

    /// Writers outlive jobs that panic: two takers, ten panicking jobs
    /// (more than there are takers), then ten that must all still run.
    #[test]
    fn a_job_that_panics_does_not_stop_its_taker() {
        let queue = Arc::new(JobQueue::<u32>::default());
        let ran = Arc::new(std::sync::Mutex::new(Vec::new()));
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let takers: Vec<_> = (0..2)
            .map(|_| {
                let (queue, ran) = (queue.clone(), ran.clone());
                std::thread::spawn(move || {
                    take_jobs(
                        &queue,
                        |job| *job as u64,
                        |job| {
                            if job < 10 {
                                panic!("job {job} panics");
                            }
                            ran.lock().unwrap().push(job);
                        },
                    )
                })
            })
            .collect();
        for job in 0..20 {
            assert!(queue.push(job).is_ok());
        }
        queue.close();
        for t in takers {
            t.join().expect("a taker survives its jobs' panics");
        }
        std::panic::set_hook(default);
        let mut ran = ran.lock().unwrap().clone();
        ran.sort_unstable();
        assert_eq!(ran, (10..20).collect::<Vec<_>>());
    }
}
