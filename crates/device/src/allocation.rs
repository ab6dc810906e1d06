//! Which parts of a device hold data: what block status reports for the
//! origin, so copies of a sparse volume skip its holes.

use std::fs::File;
use std::os::fd::AsRawFd;

/// A run of bytes that is either allocated (holds data, or may) or a hole
/// (reads as zeroes and takes no space).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocationRun {
    pub length_bytes: u64,
    pub allocated: bool,
}

impl AllocationRun {
    /// The whole of `len` bytes as one allocated run: the answer when a
    /// backend cannot tell (a hole claimed over data would make a copy
    /// skip it).
    pub fn all_data(len: u64) -> Vec<AllocationRun> {
        vec![AllocationRun {
            length_bytes: len,
            allocated: true,
        }]
    }
}

/// Append a run, merged into the last one when their kinds match; empty
/// runs are dropped.
pub(crate) fn push_run(runs: &mut Vec<AllocationRun>, length_bytes: u64, allocated: bool) {
    if length_bytes == 0 {
        return;
    }
    match runs.last_mut() {
        Some(last) if last.allocated == allocated => last.length_bytes += length_bytes,
        _ => runs.push(AllocationRun {
            length_bytes,
            allocated,
        }),
    }
}

/// Runs found per call at most: a file with more extents than this in the
/// range is reported allocated after them (the caller asks again).
const RUNS_MAX: usize = 4096;

/// The runs of `[offset, offset + len)` of a regular file, from
/// `SEEK_DATA`/`SEEK_HOLE`. Anything the kernel cannot tell (a block
/// device, a file system without the seeks, an error) is allocated: a hole
/// reported where there is data would make a copy skip it.
pub(crate) fn file_allocation(
    file: &File,
    is_block_device: bool,
    offset: u64,
    len: u64,
) -> Vec<AllocationRun> {
    let end = offset.saturating_add(len);
    if is_block_device || len == 0 {
        return AllocationRun::all_data(len);
    }
    let mut runs: Vec<AllocationRun> = Vec::new();
    let push = push_run;
    let mut at = offset;
    while at < end && runs.len() < RUNS_MAX {
        let data = match seek(file, at, libc::SEEK_DATA) {
            Ok(data) => data,
            // ENXIO: no data at or after `at`, the rest is a hole.
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
                push(&mut runs, end - at, false);
                at = end;
                break;
            }
            Err(_) => break,
        };
        if data > at {
            let hole_end = data.min(end);
            push(&mut runs, hole_end - at, false);
            at = hole_end;
            if at >= end {
                break;
            }
        }
        let hole = match seek(file, at, libc::SEEK_HOLE) {
            Ok(hole) if hole > at => hole,
            _ => break,
        };
        let data_end = hole.min(end);
        push(&mut runs, data_end - at, true);
        at = data_end;
    }
    if at < end {
        push(&mut runs, end - at, true);
    }
    debug_assert_eq!(runs.iter().map(|r| r.length_bytes).sum::<u64>(), len);
    runs
}

/// `lseek(2)`. The file offset it moves is not used by anything else: every
/// read and write names its offset (pread, pwrite, io_uring).
fn seek(file: &File, at: u64, whence: libc::c_int) -> std::io::Result<u64> {
    // SAFETY: lseek on a descriptor the File owns; no memory is passed.
    let rc = unsafe { libc::lseek(file.as_raw_fd(), at as libc::off_t, whence) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    #[test]
    fn a_sparse_file_shows_its_holes_and_data() {
        let path = std::env::temp_dir().join(format!("cairn-alloc-{}", std::process::id()));
        let mut f = File::create(&path).unwrap();
        f.set_len(16 << 20).unwrap();
        f.seek(SeekFrom::Start(4 << 20)).unwrap();
        f.write_all(&vec![7u8; 1 << 20]).unwrap();
        f.sync_all().unwrap();
        let runs = file_allocation(&f, false, 0, 16 << 20);
        let _ = std::fs::remove_file(&path);
        assert_eq!(runs.iter().map(|r| r.length_bytes).sum::<u64>(), 16 << 20);
        // Data covers the written MiB; holes (if the file system makes them)
        // are only where nothing was written.
        let mut at = 0u64;
        for r in &runs {
            if !r.allocated {
                assert!(at + r.length_bytes <= 4 << 20 || at >= 5 << 20, "{runs:?}");
            }
            at += r.length_bytes;
        }
        assert!(
            runs.iter().any(|r| !r.allocated),
            "tmp makes holes: {runs:?}"
        );
        // Asked from inside, and past the end of the data.
        let tail = file_allocation(&f, false, 6 << 20, 1 << 20);
        assert_eq!(
            tail,
            vec![AllocationRun {
                length_bytes: 1 << 20,
                allocated: false
            }]
        );
    }

    #[test]
    fn a_block_device_is_all_allocated() {
        let f = File::open("/dev/null").unwrap();
        assert_eq!(
            file_allocation(&f, true, 0, 4096),
            vec![AllocationRun {
                length_bytes: 4096,
                allocated: true
            }]
        );
    }
}
