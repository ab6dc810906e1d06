//! An origin that fenced this process (a Ceph cluster blocklists a client
//! whose lock another client broke) takes nothing from it again, while
//! another client may write there. The engine stops taking the volume's
//! writes once write-back meets the fence: new writes, zeroes and
//! discards fail (EIO), reads go on, and what was acknowledged before
//! stays dirty in the cache for the restart to write back.

mod common;
use common::*;

use cairn_device::SimDevice;
use cairn_engine::EngineError;

const VOLUME_BLOCKS: u64 = 64;

fn fenced<T: std::fmt::Debug>(result: Result<T, EngineError>, what: &str) {
    match result {
        Err(e @ EngineError::OriginFenced { .. }) => {
            assert_eq!(e.errno(), libc::EIO, "{what}: {e}");
        }
        other => panic!("{what}: not refused as fenced: {other:?}"),
    }
}

#[test]
fn a_fenced_origin_stops_new_writes_keeps_reads_and_the_restart_writes_back() {
    let mut rig = Rig::new(cache_bytes_small(), VOLUME_BLOCKS);
    let e = rig.engine();
    let clean = pattern(1, BS as usize);
    e.write(BS, &clean, true).expect("write 1");
    e.drain().expect("drain");
    let held = pattern(2, BS as usize);
    e.write(0, &held, true).expect("write 0, acknowledged");

    rig.origin.fence("blocklisted by the cluster");
    assert!(
        e.writeback_step().is_err(),
        "the fenced origin takes nothing"
    );
    let st = e.stats();
    assert!(st.origin_fenced, "{st:?}");
    assert_eq!(st.dirty_blocks, 1, "the acknowledged write is kept");
    assert!(e.volumes_status()[0].origin_fenced);

    fenced(e.write(2 * BS, &pattern(3, BS as usize), false), "a write");
    fenced(e.write(0, &pattern(4, BS as usize), true), "an overwrite");
    fenced(e.write_zeroes(3 * BS, BS), "write zeroes");
    fenced(e.discard(BS, BS), "a discard");
    assert_eq!(e.stats().fenced_refusals, 4);

    let mut buf = vec![0u8; BS as usize];
    e.read(0, &mut buf).expect("a dirty block still reads");
    assert!(buf == held, "block 0 is the acknowledged write");
    e.read(BS, &mut buf).expect("a clean copy still reads");
    assert!(
        buf == clean,
        "block 1 is unchanged (the discard was refused)"
    );
    assert!(
        rig.origin.live_image()[..BS as usize] != held[..],
        "nothing reached the origin after the fence"
    );

    // A restart is a new client, which the cluster takes again.
    let engine = rig.engine.take().expect("engine");
    drop(engine);
    let origin = SimDevice::from_image("origin", rig.origin.live_image());
    let engine = open(&rig.cache, &origin).expect("reopen");
    assert!(!engine.stats().origin_fenced);
    engine.drain().expect("drain after the restart");
    let image = origin.live_image();
    assert!(
        image[..BS as usize] == held[..],
        "the held write reached the origin"
    );
    assert!(image[BS as usize..2 * BS as usize] == clean[..]);
    assert!(
        image[2 * BS as usize..4 * BS as usize]
            .iter()
            .all(|&b| b == 0),
        "the refused write and zeroes left no trace"
    );
    let taken = pattern(5, BS as usize);
    engine
        .write(2 * BS, &taken, true)
        .expect("writes are taken again");
    engine.drain().expect("drain the new write");
    assert!(
        origin.live_image()[2 * BS as usize..3 * BS as usize] == taken[..],
        "the write after the restart reached the origin"
    );
}
