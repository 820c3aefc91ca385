//! L3 against a real S3-compatible server the test starts (moto's
//! `moto_server`, from PyPI: `.ci/run` installs it into
//! `~/.cache/lake-moto`; `LAKE_MOTO_SERVER` names another). Blocks go in
//! through the client's worker threads and come back checked; a changed
//! object is caught; a server that goes away fails requests with a clear
//! error after bounded retries, and one that comes back serves again.
//! Skips, saying why, where no moto_server is installed.

#![allow(clippy::cast_possible_truncation)] // small test sizes and ids

use std::time::{Duration, Instant};

use lake_dp::l3::s3::{S3Config, S3Store};
use lake_dp::l3::{L3Client, L3Completion, L3Config, L3Error, L3Request, ObjectStore, StoreError, object_name};
use lake_dp::{BlockKey, NamespaceId};
use lake_tests::moto::{Server, free_port, moto_server};
use lake_tests::transport::object;

fn wait(client: &mut L3Client, want: usize, within: Duration) -> Vec<L3Completion> {
    let mut done = Vec::new();
    let deadline = Instant::now() + within;
    while done.len() < want {
        assert!(Instant::now() < deadline, "{} of {want} L3 completions", done.len());
        if client.poll(&mut done, 64) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    done
}

#[test]
fn blocks_round_trip_through_a_real_s3_server() {
    let Some(binary) = moto_server() else {
        // CI installs it (.ci/run): there, its absence is a failure.
        assert!(std::env::var_os("CI").is_none(), "CI: .ci/run should have installed moto_server");
        println!(
            "SKIPPED: no moto_server (python3 -m venv ~/.cache/lake-moto && ~/.cache/lake-moto/bin/pip install \
             'moto[server]')"
        );
        return;
    };
    let port = free_port();
    let mut server = Server::start(binary, port);
    let config = S3Config {
        endpoint: format!("http://127.0.0.1:{}", server.port),
        // The client names its region as the bucket's location constraint,
        // which S3 refuses for us-east-1: a bucket there is made beforehand.
        region: "eu-west-1".into(),
        bucket: "lake-l3-test".into(),
        access_key: "lake".into(),
        secret_key: "lake-secret".into(),
    };
    S3Store::create_bucket(&config).unwrap();
    S3Store::create_bucket(&config).expect("a bucket that exists already is fine");
    let store_config = config.clone();
    let l3 = L3Config { workers: 4, attempts: 3, backoff: Duration::from_millis(50), ..L3Config::default() };
    let mut client =
        L3Client::start(l3, "node-1", move || Ok(Box::new(S3Store::open(&store_config)?) as Box<dyn ObjectStore>))
            .unwrap();

    // The shared test objects: block `i`'s key starts with `i`, in namespace 3.
    let namespace = NamespaceId(3);
    let objects: Vec<Vec<u8>> = (0..32u32).map(|i| object(i, 4096 + 40_000 * i as usize, i)).collect();
    let keys: Vec<BlockKey> = (0..32u32)
        .map(|i| {
            let mut key = [0u8; 16];
            key[..4].copy_from_slice(&i.to_le_bytes());
            BlockKey(key)
        })
        .collect();
    for (i, (key, bytes)) in keys.iter().zip(&objects).enumerate() {
        let request = L3Request::Put { key: *key, namespace, source: bytes.as_ptr(), len: bytes.len() as u64 };
        // SAFETY: `objects` outlives the completions (waited for below).
        unsafe { client.submit(i as u64, request) }.unwrap();
    }
    let done = wait(&mut client, keys.len(), Duration::from_secs(60));
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");

    let mut back: Vec<Vec<u8>> = objects.iter().map(|o| vec![0u8; o.len()]).collect();
    for (i, (key, target)) in keys.iter().zip(back.iter_mut()).enumerate() {
        let request =
            L3Request::Get { key: *key, namespace, target: target.as_mut_ptr(), capacity: target.len() as u64 };
        // SAFETY: `back` outlives the completions and nothing else touches it.
        unsafe { client.submit(100 + i as u64, request) }.unwrap();
    }
    for completion in wait(&mut client, keys.len(), Duration::from_secs(60)) {
        let i = (completion.id - 100) as usize;
        assert_eq!(completion.result, Ok(objects[i].len() as u64), "object {i}");
        assert!(back[i] == objects[i], "object {i} read back differs");
    }

    // Listed by prefix; a changed object in the bucket is caught on read.
    let mut store = S3Store::open(&config).unwrap();
    let listed = store.list("node-1/").unwrap();
    assert_eq!(listed.len(), keys.len());
    let name = object_name("node-1", namespace, &keys[3]);
    let mut changed = store.get(&name).unwrap().unwrap();
    changed[4096 + 7] ^= 0x10;
    store.put(&name, &changed).unwrap();
    let mut target = vec![0u8; objects[3].len()];
    let request =
        L3Request::Get { key: keys[3], namespace, target: target.as_mut_ptr(), capacity: target.len() as u64 };
    // SAFETY: `target` outlives the completion.
    unsafe { client.submit(200, request) }.unwrap();
    assert!(matches!(wait(&mut client, 1, Duration::from_secs(30))[0].result, Err(L3Error::Corrupt(_))));
    assert_eq!(store.get("node-1/nothing/here").unwrap(), None);
    // One multi-object delete takes several (one not there, which is fine).
    let batch =
        [(namespace, keys[20]), (namespace, keys[21]), (namespace, BlockKey([0xee; 16])), (namespace, keys[22])];
    // SAFETY: `batch` outlives the completion.
    unsafe { client.submit(250, L3Request::DeleteMany { blocks: batch.as_ptr(), count: batch.len() }) }.unwrap();
    assert_eq!(wait(&mut client, 1, Duration::from_secs(30))[0].result, Ok(4));
    assert_eq!(store.list("node-1/").unwrap().len(), keys.len() - 3);
    assert_eq!(store.get(&object_name("node-1", namespace, &keys[21])).unwrap(), None);

    // The server goes away: requests fail by name after their retries,
    // within a bounded time; back again, it serves.
    server.stop();
    let started = Instant::now();
    let request =
        L3Request::Get { key: keys[4], namespace, target: target.as_mut_ptr(), capacity: target.len() as u64 };
    // SAFETY: `target` outlives the completion.
    unsafe { client.submit(300, request) }.unwrap();
    let failed = wait(&mut client, 1, Duration::from_secs(60)).remove(0);
    assert!(matches!(failed.result, Err(L3Error::Store(StoreError::Transient(_)))), "{failed:?}");
    println!("server gone: failed after {:?} ({})", started.elapsed(), failed.result.unwrap_err());
    // Again where the client looks for it.
    let (binary, port) = (server.binary.clone(), server.port);
    drop(server);
    let mut again = Server::start(binary, port);
    S3Store::create_bucket(&config).unwrap();
    let request = L3Request::Put { key: keys[4], namespace, source: objects[4].as_ptr(), len: objects[4].len() as u64 };
    // SAFETY: `objects` outlives the completion.
    unsafe { client.submit(301, request) }.unwrap();
    assert_eq!(wait(&mut client, 1, Duration::from_secs(30))[0].result, Ok(objects[4].len() as u64));
    drop(client);
    again.stop();
}

/// The pool's L3 tier over the same server: blocks past L1 and L2 are
/// moved into the bucket and read back through, every byte checked.
#[test]
fn the_pool_moves_blocks_past_l2_into_a_real_s3_bucket_and_reads_them_back() {
    use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
    use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
    use lake_cp::tier::TierConfig;
    use lake_dp::runner::config::L3Section;

    let Some(binary) = moto_server() else {
        assert!(std::env::var_os("CI").is_none(), "CI: .ci/run should have installed moto_server");
        println!("SKIPPED: no moto_server (see blocks_round_trip_through_a_real_s3_server)");
        return;
    };
    let port = free_port();
    let server = Server::start(binary, port);
    let endpoint = format!("http://127.0.0.1:{}", server.port);
    let l3 = L3Section {
        endpoint: Some(endpoint.clone()),
        bucket: Some("lake-pool".into()),
        region_name: "eu-west-1".into(),
        access_key: Some("lake".into()),
        secret_key: Some("lake-secret".into()),
        create_bucket: true,
        objects: 1024,
        ..L3Section::none()
    };
    let dir = std::env::temp_dir().join(format!("lake-l3-s3-pool-{}", std::process::id()));
    let mut pool = EmbeddedPool::start(&EmbeddedConfig {
        l1_slots: 48,
        l2_slots_per_file: 16,
        local_agents: 1,
        remote_agents: 1,
        tiers: TierConfig { high_percent: 80, low_percent: 60, ..TierConfig::default() },
        l3: Some(l3),
        ..EmbeddedConfig::new(dir)
    })
    .unwrap();
    let config = AgentConfig {
        arena: &pool.arena,
        mirror: &pool.mirror,
        cp_socket: Some(&pool.cp_socket),
        name: "s3-engine",
        namespace: NamespaceId(3),
        layout_fingerprint: 7,
        segment_bytes: 16 * 1024,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    let mut agent = Agent::attach(&config, pool.local_ports.remove(0)).unwrap();
    let keys: Vec<BlockKey> = (0..112u32)
        .map(|i| {
            let mut k = [0x53; 16];
            k[..4].copy_from_slice(&i.to_le_bytes());
            BlockKey(k)
        })
        .collect();
    let payload = |i: usize| -> Vec<u8> { (0..60 * 1024).map(|b: usize| (b / 3 + i * 7) as u8).collect() };
    let deadline = Instant::now() + Duration::from_secs(120);
    for (i, key) in keys.iter().enumerate() {
        let bytes = payload(i);
        let block = SaveBlock {
            key: *key,
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: i as u32,
            payload: SavePayload::Bytes(&bytes),
        };
        while agent.save(&[block]) == 0 {
            assert!(Instant::now() < deadline, "block {i} not saved");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let mut table = Vec::new();
    loop {
        let hits = agent.lookup(&keys, &mut table);
        let in_l3 = table.iter().filter(|e| e.tier == lake_dp::Tier::L3Object).count();
        if hits == keys.len() && in_l3 >= 32 {
            break;
        }
        assert!(Instant::now() < deadline, "{hits} found, {in_l3} in L3");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut delivered = 0;
    for _ in 0..32 {
        let from = delivered;
        delivered += agent.fetch(&keys[from..], &table[from..], |i, got| {
            assert_eq!(got, &payload(from + i)[..], "block {}", from + i);
        });
        if delivered == keys.len() {
            break;
        }
        assert_eq!(agent.lookup(&keys, &mut table), keys.len());
    }
    assert_eq!(delivered, keys.len(), "{:?} {:?}", agent.stats, agent.last_fetch_failure());
    assert!(agent.stats.l3_loads > 0, "{:?}", agent.stats);
    drop(agent);
    let (stats, _) = pool.stop().unwrap();
    println!("pool over S3: {:?}", stats.l3);
    assert!(stats.l3.writes >= 32 && stats.l3.reads > 0 && stats.l3.lost == 0, "{:?}", stats.l3);
}
