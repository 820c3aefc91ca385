//! Leadership, membership and the checkpoint pointer against a real etcd
//! the test starts (`common/etcd.rs`).

use std::time::{Duration, Instant};

use lake_cp::etcd::Etcd;
use lake_cp::ha::{CheckpointPointer, Cluster, Role};

#[path = "common/etcd.rs"]
mod etcd_server;
use etcd_server::EtcdServer;

fn cluster(server: &EtcdServer) -> Cluster {
    Cluster::new(Etcd::new(&[&server.endpoint()], Duration::from_secs(2)).unwrap(), "test").unwrap()
}

#[test]
fn a_standby_takes_over_within_the_lease_and_the_old_leader_is_fenced() {
    let Some(server) = EtcdServer::start("failover") else { return };
    let cluster = cluster(&server);
    assert_eq!(cluster.leader().unwrap(), None);
    let mut a = cluster.candidate("cp-a", 2).unwrap();
    let mut b = cluster.candidate("cp-b", 2).unwrap();
    let Role::Leader { term: first } = a.campaign().unwrap() else { panic!("the first candidate leads") };
    assert_eq!(a.campaign().unwrap(), Role::Leader { term: first }, "campaigning again keeps the term");
    assert_eq!(b.campaign().unwrap(), Role::Standby { leader: "cp-a".into(), term: first });
    assert_eq!(cluster.leader().unwrap(), Some(("cp-a".into(), first)));
    assert!(a.publish_checkpoint("l3://lake/checkpoints/1").unwrap());
    assert!(!b.publish_checkpoint("l3://lake/checkpoints/b").unwrap(), "a standby moves nothing");
    assert_eq!(
        cluster.checkpoint().unwrap(),
        Some(CheckpointPointer { term: first, location: "l3://lake/checkpoints/1".into() })
    );

    // The leader dies (renews no more); the standby campaigns until it leads.
    assert!(a.keep_alive().unwrap());
    let died = Instant::now();
    let second =
        b.campaign_until(Duration::from_millis(100), died + Duration::from_secs(10)).expect("the standby leads");
    let failover = died.elapsed();
    println!("failover: {} ms (lease ttl 2 s, campaign every 100 ms)", failover.as_millis());
    assert!(failover < Duration::from_secs(4), "{failover:?}");
    assert!(second > first, "terms only grow: {first} then {second}");
    assert_eq!(cluster.leader().unwrap(), Some(("cp-b".into(), second)));
    // The old leader, still believing it leads, cannot move the pointer.
    assert_eq!(a.term(), Some(first));
    assert!(!a.publish_checkpoint("l3://lake/checkpoints/stale").unwrap(), "fenced by etcd");
    assert!(!a.keep_alive().unwrap(), "its lease is gone");
    assert_eq!(a.term(), None);
    assert_eq!(a.campaign().unwrap(), Role::Standby { leader: "cp-b".into(), term: second });
    assert!(b.publish_checkpoint("l3://lake/checkpoints/2").unwrap());
    assert_eq!(cluster.checkpoint().unwrap().unwrap().term, second);

    // A leader that resigns hands over at once.
    b.resign().unwrap();
    let handed = Instant::now();
    let third = a.campaign_until(Duration::from_millis(20), handed + Duration::from_secs(2)).expect("leads at once");
    assert!(third > second && handed.elapsed() < Duration::from_secs(1), "{:?}", handed.elapsed());
}

#[test]
fn memberships_expire_and_an_etcd_restart_keeps_every_acknowledged_key() {
    let Some(mut server) = EtcdServer::start("restart") else { return };
    let cluster = cluster(&server);
    let one = cluster.join(1, "10.0.0.1:7000", 2).unwrap();
    let two = cluster.join(2, "10.0.0.2:7000", 2).unwrap();
    assert_eq!(cluster.members().unwrap(), vec![(1, "10.0.0.1:7000".into()), (2, "10.0.0.2:7000".into())]);
    let mut leader = cluster.candidate("cp-1", 4).unwrap();
    let Role::Leader { term } = leader.campaign().unwrap() else { panic!("leads") };
    assert!(leader.publish_checkpoint("/var/lib/lake/l2/checkpoint-7").unwrap());

    // Node 2 stops renewing; node 1 renews: node 2 leaves within its lease.
    let started = Instant::now();
    while cluster.members().unwrap().len() == 2 {
        assert!(one.keep_alive().unwrap());
        assert!(started.elapsed() < Duration::from_secs(6), "node 2's lease never expired");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(cluster.members().unwrap(), vec![(1, "10.0.0.1:7000".into())]);
    assert!(!two.keep_alive().unwrap(), "node 2 learns it has left");

    // etcd killed and started again on its directory: every acknowledged
    // key is there, the leases held go on, the leader still leads.
    server.kill();
    assert!(cluster.leader().is_err(), "etcd down is an error, not an answer");
    let restart = server.run();
    println!("etcd restart to healthy: {} ms", restart.as_millis());
    assert!(one.keep_alive().unwrap() && leader.keep_alive().unwrap(), "leases outlive the restart");
    assert_eq!(leader.campaign().unwrap(), Role::Leader { term });
    assert_eq!(cluster.members().unwrap(), vec![(1, "10.0.0.1:7000".into())]);
    assert_eq!(
        cluster.checkpoint().unwrap(),
        Some(CheckpointPointer { term, location: "/var/lib/lake/l2/checkpoint-7".into() })
    );
    one.leave().unwrap();
    assert!(cluster.members().unwrap().is_empty());
}
