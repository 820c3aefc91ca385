//! The leader's summary checkpoint, read back by a new leader from L2/L3:
//! arbitrary bytes never panic; whatever reads back writes the same bytes
//! again and reads back to the same summary.

#![no_main]

use lake_cp::summary::Summary;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok((summary, term)) = Summary::restore(data) else { return };
    let again = summary.checkpoint(term);
    let (back, back_term) = Summary::restore(&again).expect("a checkpoint this build wrote reads back");
    assert_eq!(back_term, term);
    for node in summary.nodes() {
        assert_eq!(back.figures(node), summary.figures(node));
    }
    assert_eq!(back.checkpoint(term), again);
});
