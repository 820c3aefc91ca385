//! P→D over RDMA through the C ABI: the engine's pushes offer RDMA on the
//! compute network (`LAKE_RDMA_DEVICE`), the decode pool (`rdma` on its
//! transport) READs each block from the prefill engine's pinned L1 slot,
//! checks it and publishes it; TCP carries only the links' frames. Then
//! the fabric is cut and the next pushes go over TCP, unseen by the
//! engine: every block lands, once.
//!
//! The verbs are the in-process ones (`loopback`: no RDMA device here or
//! in CI), so both pools run in this process; everything above the verbs
//! — negotiation over the TCP link, offers, READs into the decode node's
//! slots, the checks, the fallback — is what runs over a device. Its own
//! test binary: the device is chosen by an environment variable.

mod common;

use common::pools::{BLOCK, attach, free_address, keys, load, namespace, push, rails, save, slot_space, start};

use lake::pool::{lake_detach, lake_namespace_free};
use lake::status::LakeStatus;
use lake_dp::runner::RdmaDevice;

const BLOCKS: usize = 8;

#[test]
fn pushes_go_over_rdma_where_both_ends_have_it_and_over_tcp_once_it_is_cut() {
    // SAFETY: set before any thread of this binary's only test reads the
    // environment (no pool or agent is running yet).
    unsafe { std::env::set_var("LAKE_RDMA_DEVICE", "loopback") };
    let decode_address = free_address();
    let prefill = start("rdma-prefill", None, None);
    let decode = start("rdma-decode", Some(decode_address), Some(RdmaDevice::parse("loopback").unwrap()));
    let space = namespace(5);
    // A warm-up prompt of single blocks, then two prompts of BLOCKS.
    const WARM: usize = 4;
    let all = keys(space, WARM + 2 * BLOCKS, |i| i * 13 + 3);
    let (warm, rest) = all.split_at(WARM);
    let (first, second) = rest.split_at(BLOCKS);
    let mut strings = Vec::new();
    let p = attach(&prefill, space, &mut strings);
    let d = attach(&decode, space, &mut strings);
    let mut kv: Vec<u8> =
        (0..all.len() * BLOCK).map(|i| (i.wrapping_mul(2_654_435_761) >> 11).to_le_bytes()[0]).collect();
    let table = save(p, &all, &mut kv);
    let (table_warm, table_rest) = table.split_at(WARM);
    let (table_first, table_second) = table_rest.split_at(BLOCKS);
    let to = slot_space(d);
    let address = decode_address.to_string();
    let tcp_bytes = || -> u64 { rails(p).iter().map(|r| r.bytes).sum() };

    // The first push opens the TCP link; RDMA is offered over it once it
    // carries frames. Single blocks until one goes over RDMA (its payload
    // not on the TCP rail).
    let mut warmed = 0;
    loop {
        assert!(warmed < WARM, "none of {WARM} pushes went over RDMA");
        let before = tcp_bytes();
        let pushed = push(p, &address, &warm[warmed..=warmed], &table_warm[warmed..=warmed], to);
        assert_eq!(pushed, vec![LakeStatus::LakeOk], "warm-up push {warmed}");
        warmed += 1;
        if tcp_bytes() - before < BLOCK as u64 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }

    println!("RDMA carried warm-up push {warmed} of {WARM}");

    // A prompt, under a trace id: every block READ by the decode node, none
    // on TCP, each with the decode node's time on it.
    let _ = common::spans(p);
    let before = tcp_bytes();
    lake::trace::lake_set_trace(0x0d1e_c7ed);
    assert_eq!(push(p, &address, first, table_first, to), vec![LakeStatus::LakeOk; BLOCKS]);
    lake::trace::lake_set_trace(0);
    let on_tcp = tcp_bytes() - before;
    assert!(on_tcp < BLOCK as u64, "{on_tcp} bytes of {BLOCKS} blocks went on TCP");
    let spans = common::spans(p);
    assert_eq!(spans.len(), BLOCKS, "{spans:?}");
    assert!(spans.iter().all(|s| s.trace == 0x0d1e_c7ed && s.op == 1 && s.data_plane_us >= 1), "{spans:?}");

    // The decode engine loads them byte for byte.
    let mut into = Vec::new();
    assert_eq!(load(d, first, &mut into), vec![LakeStatus::LakeOk; BLOCKS]);
    assert!(into == kv[WARM * BLOCK..(WARM + BLOCKS) * BLOCK], "the decode engine loaded other bytes");

    // The fabric cut (a dead NIC): the next blocks go over TCP, each once,
    // and the engine sees every one land.
    lake_dp::transport::rdma::loopback::Fabric::process().cut_all("the test cut the fabric");
    let before = tcp_bytes();
    assert_eq!(push(p, &address, second, table_second, to), vec![LakeStatus::LakeOk; BLOCKS]);
    let on_tcp = tcp_bytes() - before;
    assert!(on_tcp >= (BLOCKS * BLOCK) as u64, "{on_tcp} bytes of {BLOCKS} blocks went on TCP after the cut");
    assert_eq!(load(d, second, &mut into), vec![LakeStatus::LakeOk; BLOCKS]);
    assert!(into == kv[(WARM + BLOCKS) * BLOCK..], "the decode engine loaded other bytes after the cut");

    // SAFETY: attached above, detached once; then the namespace.
    unsafe { lake_detach(p) };
    // SAFETY: as above.
    unsafe { lake_detach(d) };
    // SAFETY: from lake_namespace_new, freed once.
    unsafe { lake_namespace_free(space) };
    let (stats, _) = decode.stop().unwrap();
    // Every block landed once; the decode node READ the last warm-up
    // block and the first prompt over RDMA, and nothing after the cut.
    assert_eq!(stats.pool.remote_landed, (warmed + 2 * BLOCKS) as u64, "{stats:?}");
    assert_eq!(stats.rdma_landed, 1 + BLOCKS as u64, "{stats:?}");
    assert!(stats.rdma_read_bytes > (BLOCKS * BLOCK) as u64, "{stats:?}");
    drop(prefill.stop());
}
