//! A simulated device for tests.
//!
//! It keeps two images: *durable* (what survives a power cut) and *live*
//! (what reads see). Writes land in live at once and queue as pending until
//! a flush makes them durable. A crash image is built from durable plus any
//! subset of the pending writes, applied in any order, each possibly torn at
//! 512-byte granularity. Faults: fail the Nth I/O (once or from then on),
//! misdirect the next write, flip bits. All randomness comes from the caller's
//! seed, so every run reproduces.

use std::sync::{Arc, Mutex, MutexGuard};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{check_range, ClaimDecision, Device, DeviceError, DeviceResult, OriginClaim};

pub const SECTOR_BYTES: usize = 512;

/// Flushes that may overlap (see [`Device::flush_lanes`]).
const SIM_FLUSH_LANES: usize = 4;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingWrite {
    pub offset: u64,
    pub data: Vec<u8>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimCounters {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Every operation, the index fault injection counts against.
    pub ops: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultMode {
    /// Only the chosen operation fails.
    Once,
    /// The chosen operation and every later one fail (the device died).
    Sticky,
}

/// Which kinds of operation a [`RangeFault`] fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpKinds {
    /// `read_at` and friends.
    pub reads: bool,
    /// `write_at`, vectored writes, `write_zeroes` and `discard`.
    pub writes: bool,
    /// `flush` (a barrier has no range: it matches whatever the range).
    pub flushes: bool,
}

impl OpKinds {
    pub const WRITES: OpKinds = OpKinds {
        reads: false,
        writes: true,
        flushes: false,
    };
    pub const READS: OpKinds = OpKinds {
        reads: true,
        writes: false,
        flushes: false,
    };
    pub const ALL: OpKinds = OpKinds {
        reads: true,
        writes: true,
        flushes: true,
    };
}

/// Fail operations of some kinds that touch a byte range: a bad region of
/// the medium (a worn-out area of an SSD), rather than the Nth I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeFault {
    pub kinds: OpKinds,
    /// Bytes `[start, end)`; an operation overlapping it matches.
    pub start: u64,
    pub end: u64,
    /// `Once`: the first matching operation fails, then the fault is gone.
    /// `Sticky`: every matching operation fails from now on.
    pub mode: FaultMode,
}

impl RangeFault {
    fn matches(&self, op: &'static str, range: Option<(u64, u64)>) -> bool {
        let kind = match op {
            "read" => self.kinds.reads,
            "flush" => self.kinds.flushes,
            _ => self.kinds.writes,
        };
        kind && match range {
            Some((offset, len)) => offset < self.end && offset + len.max(1) > self.start,
            None => true,
        }
    }
}

/// How to build one crash image from the pending writes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CrashPlan {
    /// Lose every unflushed write.
    DropAll,
    /// Keep every unflushed write, in order.
    KeepAll,
    /// Keep each write with probability `keep`, apply the kept ones in a
    /// shuffled order, and tear each kept write with probability `tear`.
    Random { keep: f64, tear: f64 },
    /// Tear every unflushed write: only its first sector lands. The worst
    /// case for a structure written twice without a barrier between (two
    /// copies of it both lost), which random tearing finds only sometimes.
    TearAll,
}

struct SimState {
    name: String,
    durable: Vec<u8>,
    live: Vec<u8>,
    pending: Vec<PendingWrite>,
    counters: SimCounters,
    fail_at_op: Option<(u64, FaultMode)>,
    range_fault: Option<RangeFault>,
    /// Operations failed by injection so far.
    injected_failures: u64,
    misdirect_next_write_to: Option<u64>,
    discard_zeroes: bool,
    journal: Option<(Journal, u8)>,
    /// `None`: claims are accepted and not kept (as a file origin does);
    /// `Some(stored)`: the device keeps a claim as an RBD image does.
    claims: Option<Option<String>>,
    /// Set by [`SimDevice::fence`]: every operation fails, for good, and
    /// [`Device::fenced`] says why (as a blocklisted RBD client).
    fenced: Option<String>,
}

/// One device event, as recorded in a [`Journal`].
#[derive(Debug, Clone)]
pub enum JournalEvent {
    Write {
        device: u8,
        offset: u64,
        data: Vec<u8>,
    },
    Flush {
        device: u8,
    },
}

/// A shared, ordered log of the writes and flushes of one or more simulated
/// devices. The crash harness replays it to rebuild the durable image and
/// the unflushed writes at every single event: a cut point after each one.
#[derive(Clone, Default)]
pub struct Journal {
    events: Arc<Mutex<Vec<JournalEvent>>>,
}

impl Journal {
    pub fn len(&self) -> usize {
        self.events.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Events from index `from` on.
    pub fn since(&self, from: usize) -> Vec<JournalEvent> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())[from..].to_vec()
    }

    fn push(&self, e: JournalEvent) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(e);
    }
}

/// A cloneable handle: the engine owns one clone, the test keeps another to
/// crash, corrupt or inspect the device.
#[derive(Clone)]
pub struct SimDevice {
    state: Arc<Mutex<SimState>>,
    name: String,
    size_bytes: u64,
}

impl SimDevice {
    pub fn new(name: &str, size_bytes: u64) -> SimDevice {
        Self::from_image(name, vec![0u8; size_bytes as usize])
    }

    /// A device whose durable and live contents are `image`.
    pub fn from_image(name: &str, image: Vec<u8>) -> SimDevice {
        let size_bytes = image.len() as u64;
        SimDevice {
            state: Arc::new(Mutex::new(SimState {
                name: name.to_string(),
                durable: image.clone(),
                live: image,
                pending: Vec::new(),
                counters: SimCounters::default(),
                fail_at_op: None,
                range_fault: None,
                injected_failures: 0,
                misdirect_next_write_to: None,
                discard_zeroes: true,
                journal: None,
                claims: None,
                fenced: None,
            })),
            name: name.to_string(),
            size_bytes,
        }
    }

    /// Keep claims from now on (see [`Device::claim`]), starting with none.
    pub fn keep_claims(&self) {
        self.lock().claims = Some(None);
    }

    /// The claim kept (with [`SimDevice::keep_claims`]), as stored.
    pub fn stored_claim(&self) -> Option<String> {
        self.lock().claims.clone().flatten()
    }

    /// Replace the kept claim, as an operator or another cache would.
    pub fn set_stored_claim(&self, value: Option<String>) {
        self.lock().claims = Some(value);
    }

    /// Fence this process out, as a Ceph cluster blocklists a client whose
    /// lock another one broke: every later operation fails, and
    /// [`Device::fenced`] gives `why`. Not undone (a restart would be).
    pub fn fence(&self, why: &str) {
        self.lock().fenced = Some(why.to_string());
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        // A panic while holding the lock poisons it; the state is still
        // coherent (every mutation is a single step), so keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record every later write and flush of this device in `journal`.
    pub fn attach_journal(&self, journal: &Journal, device: u8) {
        self.lock().journal = Some((journal.clone(), device));
    }

    pub fn counters(&self) -> SimCounters {
        self.lock().counters
    }

    pub fn reset_counters(&self) {
        self.lock().counters = SimCounters::default();
    }

    /// Fail operation number `op_index` (0-based, counted from now on).
    pub fn fail_at(&self, op_index: u64, mode: FaultMode) {
        let mut s = self.lock();
        let at = s.counters.ops + op_index;
        s.fail_at_op = Some((at, mode));
    }

    /// Fail the operations `fault` describes (replacing any earlier range
    /// fault).
    pub fn fail_range(&self, fault: RangeFault) {
        assert!(fault.start < fault.end, "empty fault range");
        self.lock().range_fault = Some(fault);
    }

    /// How many operations injected faults have failed so far.
    pub fn injected_failures(&self) -> u64 {
        self.lock().injected_failures
    }

    pub fn clear_faults(&self) {
        let mut s = self.lock();
        s.fail_at_op = None;
        s.range_fault = None;
        s.misdirect_next_write_to = None;
    }

    /// The next write lands at `to_offset` instead of where it was aimed.
    pub fn misdirect_next_write(&self, to_offset: u64) {
        self.lock().misdirect_next_write_to = Some(to_offset);
    }

    /// XOR `mask` into the byte at `offset`, in both durable and live images
    /// (silent media corruption).
    pub fn flip(&self, offset: u64, mask: u8) {
        let mut s = self.lock();
        s.durable[offset as usize] ^= mask;
        s.live[offset as usize] ^= mask;
    }

    pub fn durable_image(&self) -> Vec<u8> {
        self.lock().durable.clone()
    }

    pub fn live_image(&self) -> Vec<u8> {
        self.lock().live.clone()
    }

    pub fn pending_writes(&self) -> Vec<PendingWrite> {
        self.lock().pending.clone()
    }

    pub fn pending_count(&self) -> usize {
        self.lock().pending.len()
    }

    /// Build the image a power cut would leave now, without changing this
    /// device.
    pub fn crash_image(&self, plan: CrashPlan, rng: &mut ChaCha8Rng) -> Vec<u8> {
        let s = self.lock();
        build_crash_image(&s.durable, &s.pending, plan, rng)
    }

    /// A fresh device holding the crash image (what the next boot sees).
    pub fn crashed(&self, plan: CrashPlan, seed: u64) -> SimDevice {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let image = self.crash_image(plan, &mut rng);
        SimDevice::from_image(&self.name, image)
    }

    /// Count one operation and decide whether an injected fault fails it.
    /// `range` is `(offset, len)`, `None` for a flush.
    fn account(
        &self,
        s: &mut SimState,
        op: &'static str,
        range: Option<(u64, u64)>,
    ) -> DeviceResult<()> {
        let index = s.counters.ops;
        s.counters.ops += 1;
        let mut hit = false;
        if let Some((at, mode)) = s.fail_at_op {
            hit = match mode {
                FaultMode::Once => index == at,
                FaultMode::Sticky => index >= at,
            };
        }
        if let Some(fault) = &s.range_fault {
            if fault.matches(op, range) {
                hit = true;
                if fault.mode == FaultMode::Once {
                    s.range_fault = None;
                }
            }
        }
        if s.fenced.is_some() {
            s.injected_failures += 1;
            // As a blocklisted RBD client sees it: librbd's EBLOCKLISTED
            // is ESHUTDOWN, an error no retry can cure.
            return Err(DeviceError::Io {
                device: s.name.clone(),
                offset: range.map_or(0, |(offset, _)| offset),
                len: range.map_or(0, |(_, len)| len),
                source: std::io::Error::from_raw_os_error(libc::ESHUTDOWN),
            });
        }
        if hit {
            s.injected_failures += 1;
            return Err(DeviceError::Injected {
                device: s.name.clone(),
                op,
                op_index: index,
            });
        }
        Ok(())
    }
}

/// Apply durable + a chosen subset of pending writes.
pub fn build_crash_image(
    durable: &[u8],
    pending: &[PendingWrite],
    plan: CrashPlan,
    rng: &mut ChaCha8Rng,
) -> Vec<u8> {
    let mut image = durable.to_vec();
    match plan {
        CrashPlan::DropAll => {}
        CrashPlan::KeepAll => {
            for w in pending {
                image[w.offset as usize..w.offset as usize + w.data.len()].copy_from_slice(&w.data);
            }
        }
        CrashPlan::TearAll => {
            for w in pending {
                let first = w.data.len().min(SECTOR_BYTES);
                let at = w.offset as usize;
                image[at..at + first].copy_from_slice(&w.data[..first]);
            }
        }
        CrashPlan::Random { keep, tear } => {
            let mut order: Vec<usize> = (0..pending.len()).filter(|_| rng.gen_bool(keep)).collect();
            // Fisher-Yates: the device may complete unflushed writes in any order.
            for i in (1..order.len()).rev() {
                let j = rng.gen_range(0..=i);
                order.swap(i, j);
            }
            for i in order {
                let w = &pending[i];
                let torn = rng.gen_bool(tear);
                for (k, sector) in w.data.chunks(SECTOR_BYTES).enumerate() {
                    if torn && rng.gen_bool(0.5) {
                        continue;
                    }
                    let at = w.offset as usize + k * SECTOR_BYTES;
                    image[at..at + sector.len()].copy_from_slice(sector);
                }
            }
        }
    }
    image
}

impl Device for SimDevice {
    fn backend(&self) -> &'static str {
        "sim"
    }

    fn fenced(&self) -> Option<String> {
        self.lock().fenced.clone()
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn identity(&self) -> String {
        format!("sim:{}", self.name)
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn claim(&self, claim: &OriginClaim) -> DeviceResult<()> {
        let mut st = self.lock();
        let Some(stored) = st.claims.as_mut() else {
            return Ok(());
        };
        let refused = |message: &str| DeviceError::Claimed {
            device: self.name.clone(),
            message: message.to_string(),
        };
        match claim.decide(stored.as_deref()) {
            ClaimDecision::AlreadyOurs => Ok(()),
            ClaimDecision::Record => {
                *stored = Some(claim.stored_value());
                Ok(())
            }
            ClaimDecision::RefuseOther => Err(refused("belongs to another cache")),
            ClaimDecision::RefuseUnclaimed => Err(refused("carries no claim by this cache")),
        }
    }

    fn release_claim(&self, cache_uuid: &str) -> DeviceResult<()> {
        let mut st = self.lock();
        if let Some(stored) = st.claims.as_mut() {
            if stored.as_deref().map(OriginClaim::uuid_of_stored) == Some(cache_uuid) {
                *stored = None;
            }
        }
        Ok(())
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()> {
        check_range(
            &self.name,
            "read",
            offset,
            buf.len() as u64,
            self.size_bytes,
        )?;
        let mut s = self.lock();
        self.account(&mut s, "read", Some((offset, buf.len() as u64)))?;
        s.counters.reads += 1;
        s.counters.bytes_read += buf.len() as u64;
        buf.copy_from_slice(&s.live[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        check_range(
            &self.name,
            "write",
            offset,
            buf.len() as u64,
            self.size_bytes,
        )?;
        let mut s = self.lock();
        self.account(&mut s, "write", Some((offset, buf.len() as u64)))?;
        s.counters.writes += 1;
        s.counters.bytes_written += buf.len() as u64;
        let mut target = offset;
        if let Some(to) = s.misdirect_next_write_to.take() {
            if to + buf.len() as u64 <= self.size_bytes {
                target = to;
            }
        }
        s.live[target as usize..target as usize + buf.len()].copy_from_slice(buf);
        s.pending.push(PendingWrite {
            offset: target,
            data: buf.to_vec(),
        });
        if let Some((j, device)) = &s.journal {
            j.push(JournalEvent::Write {
                device: *device,
                offset: target,
                data: buf.to_vec(),
            });
        }
        Ok(())
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        // One I/O, as pwritev would be: one fault-injection slot, one pending
        // write that a crash may tear anywhere.
        let joined: Vec<u8> = bufs.concat();
        self.write_at(offset, &joined)
    }

    fn flush(&self) -> DeviceResult<()> {
        let mut s = self.lock();
        self.account(&mut s, "flush", None)?;
        s.counters.flushes += 1;
        if let Some((j, device)) = &s.journal {
            j.push(JournalEvent::Flush { device: *device });
        }
        let pending = std::mem::take(&mut s.pending);
        for w in pending {
            let at = w.offset as usize;
            s.durable[at..at + w.data.len()].copy_from_slice(&w.data);
        }
        Ok(())
    }

    /// Its flushes are atomic and each reports its own failure (no page
    /// cache holds an error for someone else), so overlapping ones are
    /// safe: lanes let the engine's concurrent barriers be tested on it.
    fn flush_lanes(&self) -> usize {
        SIM_FLUSH_LANES
    }

    fn discard(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "discard", offset, len, self.size_bytes)?;
        let discard_zeroes = self.lock().discard_zeroes;
        {
            let mut s = self.lock();
            s.counters.discards += 1;
        }
        if discard_zeroes {
            // Modelled as a zero write so crashes may drop or tear it too.
            let zeroes = vec![0u8; len as usize];
            let mut s = self.lock();
            self.account(&mut s, "discard", Some((offset, len)))?;
            s.live[offset as usize..(offset + len) as usize].fill(0);
            if let Some((j, device)) = &s.journal {
                j.push(JournalEvent::Write {
                    device: *device,
                    offset,
                    data: zeroes.clone(),
                });
            }
            s.pending.push(PendingWrite {
                offset,
                data: zeroes,
            });
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "write_zeroes", offset, len, self.size_bytes)?;
        self.write_at(offset, &vec![0u8; len as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_makes_durable_and_crash_forgets() {
        let d = SimDevice::new("t", 8192);
        d.write_at(0, &[1u8; 4096]).unwrap();
        d.flush().unwrap();
        d.write_at(4096, &[2u8; 4096]).unwrap();
        let c = d.crashed(CrashPlan::DropAll, 1);
        let mut buf = vec![0u8; 8192];
        c.read_at(0, &mut buf).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 1));
        assert!(buf[4096..].iter().all(|&b| b == 0));
        let c = d.crashed(CrashPlan::KeepAll, 1);
        c.read_at(0, &mut buf).unwrap();
        assert!(buf[4096..].iter().all(|&b| b == 2));
    }

    #[test]
    fn tearing_is_sector_granular_and_seeded() {
        let d = SimDevice::new("t", 4096);
        d.write_at(0, &[9u8; 4096]).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let a = d.crash_image(
            CrashPlan::Random {
                keep: 1.0,
                tear: 1.0,
            },
            &mut rng,
        );
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let b = d.crash_image(
            CrashPlan::Random {
                keep: 1.0,
                tear: 1.0,
            },
            &mut rng,
        );
        assert_eq!(a, b, "same seed, same image");
        for sector in a.chunks(SECTOR_BYTES) {
            assert!(sector.iter().all(|&x| x == 9) || sector.iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn faults_and_misdirection() {
        let d = SimDevice::new("t", 8192);
        d.fail_at(1, FaultMode::Once);
        d.write_at(0, &[1u8; 512]).unwrap();
        assert!(d.write_at(0, &[1u8; 512]).is_err());
        d.write_at(0, &[1u8; 512]).unwrap();
        d.misdirect_next_write(4096);
        d.write_at(0, &[5u8; 512]).unwrap();
        let img = d.live_image();
        assert_eq!(img[0], 1);
        assert_eq!(img[4096], 5);
        d.fail_at(0, FaultMode::Sticky);
        assert!(d.flush().is_err());
        assert!(d.flush().is_err());
    }

    #[test]
    fn range_faults_fail_only_matching_operations() {
        let d = SimDevice::new("t", 16384);
        d.fail_range(RangeFault {
            kinds: OpKinds::WRITES,
            start: 8192,
            end: 12288,
            mode: FaultMode::Sticky,
        });
        // Outside the range, and reads and flushes inside it, still work.
        d.write_at(0, &[1u8; 4096]).unwrap();
        d.write_at(12288, &[1u8; 4096]).unwrap();
        let mut buf = vec![0u8; 4096];
        d.read_at(8192, &mut buf).unwrap();
        d.flush().unwrap();
        // Any write overlapping it fails, every time; nothing lands.
        assert!(d.write_at(8192, &[2u8; 512]).is_err());
        assert!(d.write_at(4096, &[2u8; 8192]).is_err());
        assert!(d.write_zeroes(11776, 512).is_err());
        assert_eq!(d.live_image()[8192], 0);
        assert_eq!(d.injected_failures(), 3);
        // Once: one failure, then the region works again.
        d.fail_range(RangeFault {
            kinds: OpKinds::ALL,
            start: 0,
            end: 4096,
            mode: FaultMode::Once,
        });
        assert!(d.read_at(0, &mut buf).is_err());
        d.read_at(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 1));
        d.clear_faults();
        d.write_at(8192, &[3u8; 512]).unwrap();
    }
}
