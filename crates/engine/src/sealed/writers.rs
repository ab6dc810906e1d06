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

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
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

struct Pool {
    /// `None` once the pool shuts down.
    jobs: Mutex<Option<Sender<RecordJob>>>,
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
            Ok(pool) => {
                let jobs = pool.jobs.lock().unwrap_or_else(|p| p.into_inner());
                match jobs.as_ref() {
                    Some(tx) => match tx.send(job) {
                        Ok(()) => return,
                        Err(returned) => returned.0,
                    },
                    None => job,
                }
            }
            Err(_) => job,
        };
        job.run();
    }
}

fn start_pool() -> Result<Pool, String> {
    let (tx, rx) = channel::<RecordJob>();
    let rx = Arc::new(Mutex::new(rx));
    let mut threads = Vec::with_capacity(RECORD_WRITER_THREADS);
    for i in 0..RECORD_WRITER_THREADS {
        let rx = rx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("record-writer-{i}"))
            .spawn(move || writer_loop(&rx));
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
        jobs: Mutex::new(Some(tx)),
        threads: Mutex::new(threads),
    })
}

/// Take jobs until the pool's sender is dropped.
fn writer_loop(rx: &Mutex<Receiver<RecordJob>>) {
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
            rx.recv()
        };
        match job {
            Ok(job) => job.run(),
            Err(_) => return,
        }
    }
}

impl Drop for RecordWriters {
    /// Finish the queued writes, then stop the threads.
    fn drop(&mut self) {
        let Some(Ok(pool)) = self.pool.get_mut() else {
            return;
        };
        drop(
            pool.jobs
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        let threads = std::mem::take(pool.threads.get_mut().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}
