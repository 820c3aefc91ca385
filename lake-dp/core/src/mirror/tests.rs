use super::*;

/// A mirror path under /dev/shm, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let path = PathBuf::from(format!("/dev/shm/lake-test-mirror-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        Self(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn key(i: u64) -> BlockKey {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&crate::rng::SimRng::new(i).next_u64().to_le_bytes());
    k[8..].copy_from_slice(&i.to_le_bytes());
    BlockKey(k)
}

fn entry(i: u32) -> MirrorEntry {
    MirrorEntry {
        kind: ObjectKind::KvBlock,
        tier: Tier::L1Dram,
        tiers: 0b0110,
        region: RegionId(7),
        epoch_tag: 3,
        slot: i,
        generation: i.wrapping_mul(2_654_435_761) | 1,
    }
}

fn config(scratch: &Scratch, entries: u64) -> MirrorConfig {
    MirrorConfig::for_entries(MirrorBacking::Shm(scratch.0.clone()), entries)
}

#[test]
fn entries_published_by_the_writer_are_read_by_a_reader() {
    let scratch = Scratch::new("basic");
    let mut writer = MirrorWriter::create(&config(&scratch, 1000)).unwrap();
    let reader = MirrorReader::attach(&scratch.0).unwrap();
    assert!(reader.is_ready());
    assert_eq!(reader.term(), 1);
    for i in 0..500 {
        writer.upsert(&key(i), &entry(i as u32)).unwrap();
    }
    assert_eq!(writer.live(), 500);
    assert_eq!(reader.live(), 500);
    for i in 0..500 {
        assert_eq!(reader.get(&key(i)), Lookup::Hit(entry(i as u32)));
    }
    assert_eq!(reader.get(&key(9999)), Lookup::Miss);
    // Replace in place, remove, insert again.
    writer.upsert(&key(3), &entry(33)).unwrap();
    assert_eq!(reader.get(&key(3)), Lookup::Hit(entry(33)));
    assert!(writer.remove(&key(4)));
    assert!(!writer.remove(&key(4)));
    assert_eq!(reader.get(&key(4)), Lookup::Miss);
    assert_eq!(writer.live(), 499);
    writer.upsert(&key(4), &entry(44)).unwrap();
    assert_eq!(reader.get(&key(4)), Lookup::Hit(entry(44)));
    assert_eq!(writer.get(&key(4)), Some(entry(44)));
    // Regions.
    let record = RegionRecord { tier: Tier::L2Nvme, epoch: 12, epoch_tag: 3, node: NodeId(2) };
    writer.set_region(RegionId(7), &record).unwrap();
    assert_eq!(reader.region(RegionId(7)), Some(record));
    writer.clear_region(RegionId(7)).unwrap();
    assert_eq!(reader.region(RegionId(7)), None);
    assert!(writer.set_region(RegionId(1024), &record).is_err());
    assert!(reader.writer_alive());
    writer.retire();
    assert!(!reader.is_ready());
    assert!(matches!(MirrorReader::attach(&scratch.0), Err(MirrorError::Retired)));
}

#[test]
fn entries_that_cannot_be_stored_are_refused_by_name() {
    let scratch = Scratch::new("refuse");
    let mut writer = MirrorWriter::create(&config(&scratch, 100)).unwrap();
    let bad_region = MirrorEntry { region: RegionId(1024), ..entry(1) };
    assert_eq!(writer.upsert(&key(1), &bad_region), Err(MirrorError::Entry("region: at most 1023 in a mirror")));
    let bad_tiers = MirrorEntry { tiers: 0x10, ..entry(1) };
    assert_eq!(writer.upsert(&key(1), &bad_tiers), Err(MirrorError::Entry("tiers: one bit per tier, four tiers")));
    assert!(writer.upsert(&BlockKey::NONE, &entry(1)).is_err());
    assert_eq!(writer.live(), 0);
}

#[test]
fn a_full_table_refuses_new_keys_and_reuses_markers() {
    let scratch = Scratch::new("full");
    let mut writer = MirrorWriter::create(&MirrorConfig {
        buckets: 64,
        ..MirrorConfig::for_entries(MirrorBacking::Shm(scratch.0.clone()), 0)
    })
    .unwrap();
    let buckets = writer.header().buckets;
    let mut stored = 0u64;
    let mut i = 0;
    loop {
        match writer.upsert(&key(i), &entry(i as u32)) {
            Ok(()) => stored += 1,
            Err(MirrorError::Full) => break,
            Err(e) => panic!("{e}"),
        }
        i += 1;
    }
    assert_eq!(stored, buckets * 9 / 10, "{buckets} buckets");
    // Every key stored is still found; a marker makes room for one more.
    let reader = MirrorReader::attach(&scratch.0).unwrap();
    for k in 0..i {
        assert_eq!(reader.get(&key(k)), Lookup::Hit(entry(k as u32)), "key {k}");
    }
    // A removal frees a bucket for one more key.
    assert!(writer.remove(&key(0)));
    assert_eq!(reader.get(&key(0)), Lookup::Miss);
    writer.upsert(&key(i), &entry(1)).unwrap();
    assert_eq!(reader.get(&key(i)), Lookup::Hit(entry(1)));
    assert_eq!(writer.upsert(&key(i + 1), &entry(1)), Err(MirrorError::Full));
    for k in 1..=i {
        assert!(matches!(reader.get(&key(k)), Lookup::Hit(_)), "key {k}");
    }
}

#[test]
fn churn_keeps_probes_short_and_every_key_found() {
    let scratch = Scratch::new("churn");
    let mut writer = MirrorWriter::create(&config(&scratch, 700)).unwrap();
    let reader = MirrorReader::attach(&scratch.0).unwrap();
    // 600 live keys; every step inserts a new key and removes the oldest.
    let live = 600u64;
    for i in 0..live {
        writer.upsert(&key(i), &entry(i as u32)).unwrap();
    }
    for i in live..200_000 {
        writer.upsert(&key(i), &entry(i as u32)).unwrap();
        assert!(writer.remove(&key(i - live)));
        if i % 10_000 == 0 {
            for k in i + 1 - live..=i {
                assert_eq!(reader.get(&key(k)), Lookup::Hit(entry(k as u32)), "key {k} at step {i}");
            }
        }
    }
    assert_eq!(writer.live(), live);
    assert_eq!(reader.get(&key(0)), Lookup::Miss);
    // The bound is the longest displacement ever needed: a tail, not a mean.
    assert!(writer.max_probe() < 128, "probe bound {}", writer.max_probe());
}

fn chain(from: u64, len: u64) -> Vec<BlockKey> {
    (from..from + len).map(key).collect()
}

#[test]
fn lookup_finds_the_longest_prefix_and_stops_at_a_hole() {
    let scratch = Scratch::new("prefix");
    let mut writer = MirrorWriter::create(&config(&scratch, 10_000)).unwrap();
    let reader = MirrorReader::attach(&scratch.0).unwrap();
    let prompt = chain(100, 300);
    for (i, k) in prompt.iter().enumerate().take(200) {
        writer.upsert(k, &entry(i as u32)).unwrap();
    }
    let mut table = Vec::new();
    for n in [0, 1, 2, 199, 200, 201, 300] {
        assert_eq!(reader.longest_prefix(&prompt[..n]), n.min(200), "{n} keys");
        assert_eq!(reader.lookup(&prompt[..n], &mut table), n.min(200));
        assert!(table.iter().enumerate().all(|(i, e)| e.slot == i as u32));
    }
    // Not prefix-closed: a hole at 50. The binary search may pass over
    // it; the block table never does.
    writer.remove(&prompt[50]);
    assert_eq!(reader.lookup(&prompt, &mut table), 50);
    assert_eq!(reader.block_table(&prompt, &mut table), 50);
    // A key of another chain in the middle breaks it the same way.
    let mut mixed = prompt.clone();
    writer.upsert(&prompt[50], &entry(50)).unwrap();
    mixed[20] = key(99_999);
    assert_eq!(reader.lookup(&mixed, &mut table), 20);
}

#[test]
fn a_hybrid_resumes_from_the_deepest_checkpoint_at_or_below_its_kv_hit() {
    let scratch = Scratch::new("state");
    let mut writer = MirrorWriter::create(&config(&scratch, 10_000)).unwrap();
    let reader = MirrorReader::attach(&scratch.0).unwrap();
    let prompt = chain(500, 40);
    for (i, k) in prompt.iter().enumerate().take(30) {
        writer.upsert(k, &entry(i as u32)).unwrap();
    }
    let state = |i: u32| MirrorEntry { kind: ObjectKind::RecurrentState, ..entry(1000 + i) };
    let mut table = Vec::new();
    // No checkpoint: the KV hit alone.
    assert_eq!(reader.lookup_with_state(&prompt, &mut table), (30, 0, None));
    assert_eq!(table.len(), 30);
    // Checkpoints after blocks 8 and 16 (positions 8, 16), and one after
    // block 35, past the KV hit: never a resume point.
    for position in [8u32, 16, 36] {
        writer.upsert(&prompt[position as usize - 1].state_key(), &state(position)).unwrap();
    }
    assert_eq!(reader.lookup_with_state(&prompt, &mut table), (30, 16, Some(state(16))));
    assert_eq!(reader.lookup_with_state(&prompt[..15], &mut table), (15, 8, Some(state(8))));
    assert_eq!(reader.lookup_with_state(&prompt[..7], &mut table), (7, 0, None));
    // A KV block published under a checkpoint's name is not a checkpoint.
    writer.upsert(&prompt[19].state_key(), &entry(77)).unwrap();
    assert_eq!(reader.lookup_with_state(&prompt, &mut table).1, 16);
    // The checkpoint goes (evicted leaf first): the one before it serves.
    writer.remove(&prompt[15].state_key());
    assert_eq!(reader.lookup_with_state(&prompt, &mut table), (30, 8, Some(state(8))));
}

#[test]
fn a_writer_that_takes_over_can_withdraw_its_predecessors_view() {
    let scratch = Scratch::new("clear");
    let mut writer = MirrorWriter::create(&config(&scratch, 1000)).unwrap();
    let reader = MirrorReader::attach(&scratch.0).unwrap();
    for i in 0..700 {
        writer.upsert(&key(i), &entry(i as u32)).unwrap();
    }
    drop(writer);
    let (mut next, _) = MirrorWriter::take_over(&scratch.0, 7).unwrap();
    assert_eq!(next.clear(), 700);
    assert_eq!((next.live(), reader.live(), reader.term()), (0, 0, 7));
    assert!((0..700).all(|i| reader.get(&key(i)) == Lookup::Miss));
    // The table works on after it: the reader that stayed sees the new view.
    next.upsert(&key(5), &entry(55)).unwrap();
    assert_eq!(reader.get(&key(5)), Lookup::Hit(entry(55)));
    assert_eq!(next.clear(), 1);
}

#[test]
fn a_writer_that_died_mid_update_is_repaired_by_the_next() {
    let scratch = Scratch::new("repair");
    let mut writer = MirrorWriter::create(&config(&scratch, 1000)).unwrap();
    for i in 0..100 {
        writer.upsert(&key(i), &entry(i as u32)).unwrap();
    }
    writer.remove(&key(5));
    let reader = MirrorReader::attach(&scratch.0).unwrap();
    // Killed inside a write of key 7.
    assert!(writer.abandon_update_of(&key(7)));
    assert_eq!(reader.get(&key(7)), Lookup::Unreadable);
    // A second writer cannot take over while the first holds the lock.
    assert!(matches!(MirrorWriter::take_over(&scratch.0, 2), Err(MirrorError::InUse { .. })));
    assert!(matches!(MirrorWriter::create(&config(&scratch, 10)), Err(MirrorError::InUse { .. })));
    drop(writer);
    assert!(!reader.writer_alive());
    assert_eq!(MirrorWriter::take_over(&scratch.0, 1).err(), Some(MirrorError::StaleTerm { current: 1, offered: 1 }));
    let (mut next, repaired) = MirrorWriter::take_over(&scratch.0, 2).unwrap();
    assert_eq!(repaired, 1);
    // Key 7's bucket was voided and its cluster rebuilt without it.
    assert_eq!(next.live(), 98);
    assert_eq!(reader.term(), 2);
    assert_eq!(reader.repaired(), 1);
    assert_eq!(reader.get(&key(7)), Lookup::Miss);
    assert_eq!(reader.get(&key(8)), Lookup::Hit(entry(8)));
    // The new writer re-publishes what its index holds.
    next.upsert(&key(7), &entry(77)).unwrap();
    assert_eq!(reader.get(&key(7)), Lookup::Hit(entry(77)));
    assert!(reader.writer_alive());
}

#[test]
fn files_that_are_not_mirrors_are_refused_by_name() {
    let scratch = Scratch::new("bad");
    std::fs::write(&scratch.0, vec![0u8; 8192]).unwrap();
    assert_eq!(MirrorReader::attach(&scratch.0).err(), Some(MirrorError::Header("magic: not a Lake mirror")));
    std::fs::write(&scratch.0, b"LAKE").unwrap();
    assert!(matches!(MirrorReader::attach(&scratch.0), Err(MirrorError::Io { .. })));
    drop(std::fs::remove_file(&scratch.0));
    let writer = MirrorWriter::create(&config(&scratch, 100)).unwrap();
    drop(writer);
    let file = OpenOptions::new().write(true).open(&scratch.0).unwrap();
    let size = file.metadata().unwrap().len();
    file.set_len(size - 32).unwrap();
    assert_eq!(
        MirrorReader::attach(&scratch.0).err(),
        Some(MirrorError::Header("total_bytes differs from the file's size"))
    );
    // A disk file is no place for a mirror.
    let disk = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/lake-test-not-a-tmpfs-mirror"));
    // The build may have put its target directory elsewhere.
    std::fs::create_dir_all(disk.parent().unwrap()).unwrap();
    assert_eq!(
        MirrorWriter::create(&MirrorConfig { backing: MirrorBacking::Shm(disk.clone()), ..config(&scratch, 10) }).err(),
        Some(MirrorError::Config("backing: the path is not on a tmpfs"))
    );
    assert!(!disk.exists());
}

#[test]
fn a_hugetlb_memfd_mirror_is_read_through_its_descriptor() {
    let config = MirrorConfig::for_entries(MirrorBacking::HugetlbMemfd, 1000);
    let mut writer = match MirrorWriter::create(&config) {
        Ok(writer) => writer,
        Err(e) => {
            eprintln!("skipped: no hugetlb memfd here ({e}); CI reserves huge pages in .ci/run");
            return;
        }
    };
    assert_eq!(writer.mapped_bytes() % (2 << 20), 0, "whole huge pages");
    writer.upsert(&key(1), &entry(1)).unwrap();
    let fd = writer.file().try_clone().unwrap();
    let reader = MirrorReader::attach_fd(fd.into()).unwrap();
    assert_eq!(reader.get(&key(1)), Lookup::Hit(entry(1)));
}

#[test]
fn entries_moved_back_by_removals_are_never_missed() {
    let scratch = Scratch::new("moves");
    let mut writer = MirrorWriter::create(&config(&scratch, 1000)).unwrap();
    // Stable keys that stay published while others come and go around
    // them, so removals keep moving them back along their clusters.
    let stable = 300u64;
    for i in 0..stable {
        writer.upsert(&key(i), &entry(i as u32)).unwrap();
    }
    let reader = MirrorReader::attach(&scratch.0).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut next = 1_000_000u64;
            while !stop.load(Ordering::Relaxed) {
                for k in next..next + 300 {
                    writer.upsert(&key(k), &entry(1)).unwrap();
                }
                for k in next..next + 300 {
                    assert!(writer.remove(&key(k)));
                }
                next += 300;
            }
            next - 1_000_000
        })
    };
    let (mut lookups, mut missed, mut untold) = (0u64, 0u64, 0u64);
    let end = std::time::Instant::now() + std::time::Duration::from_millis(700);
    while std::time::Instant::now() < end {
        for i in 0..stable {
            lookups += 1;
            match reader.get(&key(i)) {
                Lookup::Hit(found) => assert_eq!(found, entry(i as u32)),
                Lookup::Miss => missed += 1,
                Lookup::Unreadable => untold += 1,
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let churned = churn.join().unwrap();
    assert!(churned > 10_000, "the writer barely ran: {churned} keys");
    assert_eq!(missed, 0, "{missed} of {lookups} lookups missed a stable key");
    // A writer doing nothing but removals can starve a reader's re-checks;
    // that is reported as such, and stays rare.
    assert!(untold * 100 < lookups, "{untold} of {lookups} lookups could not tell");
}

#[test]
fn a_reader_waiting_for_writes_wakes_when_the_writer_publishes_not_at_its_timeout() {
    use std::time::{Duration, Instant};
    let scratch = Scratch::new("wake");
    let mut writer = MirrorWriter::create(&config(&scratch, 64)).unwrap();
    let reader = MirrorReader::attach(&scratch.0).unwrap();
    // Nothing published: no wake, the wait runs to its timeout.
    let seen = reader.writes();
    writer.wake_readers();
    let start = Instant::now();
    reader.wait_for_writes(seen, Duration::from_millis(50));
    assert!(start.elapsed() >= Duration::from_millis(40), "woken with nothing published");
    // Published while the reader sleeps: it wakes long before its
    // timeout, and finds the entry.
    let waiter = std::thread::spawn(move || {
        let start = Instant::now();
        loop {
            let seen = reader.writes();
            if reader.get(&key(1)) == Lookup::Hit(entry(1)) {
                return start.elapsed();
            }
            reader.wait_for_writes(seen, Duration::from_secs(10));
        }
    });
    std::thread::sleep(Duration::from_millis(100));
    writer.upsert(&key(1), &entry(1)).unwrap();
    writer.wake_readers();
    let waited = waiter.join().unwrap();
    assert!(waited < Duration::from_secs(5), "woken at its timeout, not by the write: {waited:?}");
    // A wait begun after the write it waits for returns at once.
    let reader = MirrorReader::attach(&scratch.0).unwrap();
    let start = Instant::now();
    reader.wait_for_writes(reader.writes().wrapping_sub(1), Duration::from_secs(10));
    assert!(start.elapsed() < Duration::from_secs(1));
}
