//! What a seed's run reached.

/// Counts a seed's run reached, so a test can see the run did something.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tally {
    /// Saves committed.
    pub saves: u64,
    /// Damaged saves refused at commit.
    pub refused_damaged: u64,
    /// Loads answered `Ok`, their bytes checked.
    pub loads_ok: u64,
    /// Loads refused, failed, or taken before their pin.
    pub loads_failed: u64,
    /// L1 blocks read as hits, their bytes checked.
    pub hits_checked: u64,
    /// The simulation's demotions that ended well.
    pub demotions: u64,
    /// The simulation's evictions that ended well.
    pub evictions: u64,
    /// The simulation's write-backs that ended well.
    pub write_backs: u64,
    /// The simulation's promotions (L2 to L1) that ended well.
    pub cp_promotions: u64,
    /// The control's commands that ended well.
    pub controlled: u64,
    /// Marked blocks a save or a load took.
    pub victims: u64,
    /// Published commits the check found damaged afterwards.
    pub corrupt_late: u64,
    /// Crashes and restarts.
    pub restarts: u64,
    /// L2 blocks re-adopted after them.
    pub readopted: u64,
    /// The simulation's writes to L3 that ended well.
    pub l3_writes: u64,
    /// The simulation's promotions from L3 that ended well.
    pub l3_promotions: u64,
    /// Loads from L3 answered `Ok`, their bytes checked.
    pub l3_loads_ok: u64,
    /// L3 objects the store lost or damaged that a read found (each a
    /// clean miss, reported evicted).
    pub l3_lost: u64,
    /// L3 blocks found again by the catalog scan after a restart.
    pub l3_readopted: u64,
    /// L1 blocks read where the control plane published them (its
    /// mirror), their bytes checked.
    pub published_hits: u64,
    /// Copies to the peer that ended well.
    pub peer_copies: u64,
    /// Copies to the peer taken back before the peer answered.
    pub peer_cancelled: u64,
    /// Blocks the peer got from the node, their bytes checked.
    pub peer_received: u64,
    /// Blocks from the peer landed in the node's L1 and published.
    pub peer_landed: u64,
    /// Blocks from the peer damaged on the way, refused.
    pub peer_refused_damaged: u64,
}

impl Tally {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &Tally) {
        let Tally {
            saves,
            refused_damaged,
            loads_ok,
            loads_failed,
            hits_checked,
            demotions,
            evictions,
            write_backs,
            cp_promotions,
            controlled,
            victims,
            corrupt_late,
            restarts,
            readopted,
            l3_writes,
            l3_promotions,
            l3_loads_ok,
            l3_lost,
            l3_readopted,
            published_hits,
            peer_copies,
            peer_cancelled,
            peer_received,
            peer_landed,
            peer_refused_damaged,
        } = *other;
        self.saves += saves;
        self.refused_damaged += refused_damaged;
        self.loads_ok += loads_ok;
        self.loads_failed += loads_failed;
        self.hits_checked += hits_checked;
        self.demotions += demotions;
        self.evictions += evictions;
        self.write_backs += write_backs;
        self.cp_promotions += cp_promotions;
        self.controlled += controlled;
        self.victims += victims;
        self.corrupt_late += corrupt_late;
        self.restarts += restarts;
        self.readopted += readopted;
        self.l3_writes += l3_writes;
        self.l3_promotions += l3_promotions;
        self.l3_loads_ok += l3_loads_ok;
        self.l3_lost += l3_lost;
        self.l3_readopted += l3_readopted;
        self.published_hits += published_hits;
        self.peer_copies += peer_copies;
        self.peer_cancelled += peer_cancelled;
        self.peer_received += peer_received;
        self.peer_landed += peer_landed;
        self.peer_refused_damaged += peer_refused_damaged;
    }
}
