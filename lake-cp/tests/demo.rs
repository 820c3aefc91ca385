//! The README's main job, small: the embedded pool under the multi-turn
//! workload must serve most prompt blocks from the pool, every one of
//! them byte-exact, and must have moved blocks both ways between L1 and
//! L2 to do it.

use lake_cp::demo::{DemoConfig, run};

#[test]
fn the_embedded_pool_serves_conversations_across_tiers_byte_exact() {
    let config = DemoConfig {
        dir: std::env::temp_dir().join(format!("lake-demo-test-{}", std::process::id())),
        engines: 2,
        sessions: 8,
        turns: 5,
        system_blocks: 16,
        message_blocks: 3,
        reply_blocks: 3,
        l1_slots: 64,
        l2_slots_per_file: 256,
        seed: 3,
        hold_s: 0,
    };
    let mut progress = Vec::new();
    let report = run(&config, &mut progress).expect("the demo runs");
    let progress = String::from_utf8(progress).unwrap();
    assert!(progress.contains("turns 40/40"), "the last progress line: {progress}");
    assert_eq!(report.turns, 40);
    assert_eq!(report.mismatches, 0);
    // Turn 1 of each conversation misses all but the shared prompt; every
    // later turn finds its whole history.
    assert!(report.hit_rate() > 0.6, "{report:?}");
    assert!(report.moves.0 > 0, "L1 overflowed into L2: {report:?}");
    assert!(report.served_l2 > 0 && report.data_plane.pool.promotions >= report.served_l2, "{report:?}");
    assert_eq!(report.data_plane.pool.commits_corrupt, 0);
    assert!(report.metrics_lines > 50);
    assert!(!config.dir.exists(), "the demo cleans up after itself");
}
