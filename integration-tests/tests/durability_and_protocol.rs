//! Issue 16 (hardening), through a real daemon: crash consistency of acknowledged-durable
//! stores, the per-session lease cap, empty hits read by a TP group, and the protocol points a
//! client written from docs/protocol.md alone tripped over.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tierkv_client::payload::{chunk_id, fill, holds};
use tierkv_client::proto::{
    ChunkBlocks, ChunkId, ErrorCode, Hello, ReplyBody, Request, RequestBody, encode,
};
use tierkv_client::{Client, ClientError, SharedBuffer};
use tierkv_integration_tests::{Daemon, small_config};

const CHUNK: u64 = 65536;
const BATCH: u64 = 8;

fn code(result: Result<impl std::fmt::Debug, ClientError>) -> ErrorCode {
    match result {
        Err(e) => e.code().unwrap_or_else(|| panic!("not a daemon error: {e}")),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

/// A worker session with one registered buffer of `BATCH` blocks.
fn worker(daemon: &Daemon, hello: Hello) -> (Client, SharedBuffer) {
    let mut client = Client::connect_unix(&daemon.socket, hello).unwrap();
    let buffer = SharedBuffer::new(CHUNK, BATCH).unwrap();
    assert_eq!(client.register_buffer(&buffer).unwrap(), 0);
    (client, buffer)
}

/// The hello of rank `rank` of a TP group of `tp_size` that shares one copy of its KV (MLA).
fn mla_hello(rank: u16, tp_size: u16) -> Hello {
    Hello { mla: true, rank, tp_size, world_size: None, ..Client::worker_hello("m", CHUNK) }
}

fn chain(prompt: u64) -> Vec<ChunkId> {
    (0..BATCH).map(|i| chunk_id(prompt, i)).collect()
}

/// Writes prompt `prompt`'s chunks into the buffer's first blocks, one a block; their ids.
fn fill_batch(buffer: &mut SharedBuffer, prompt: u64) -> Vec<ChunkId> {
    let ids = chain(prompt);
    for (i, id) in ids.iter().enumerate() {
        fill(buffer.block_mut(i as u64).unwrap(), *id, 0);
    }
    ids
}

/// A daemon of `small_config` whose sessions may hold `kib` KiB of leases each.
fn daemon_with_lease_cap(kib: u64) -> Daemon {
    Daemon::start_with(|dir| {
        small_config(dir, None, "")
            .replace("[server]\n", &format!("[server]\nmax_leased_per_session = \"{kib}KiB\"\n"))
    })
}

fn blocks(ids: &[ChunkId]) -> Vec<ChunkBlocks> {
    ids.iter().enumerate().map(|(i, id)| ChunkBlocks::one(*id, i as u64)).collect()
}

/// Looks `ids` up, retrieves the whole hit and checks every byte of it. Returns the hit.
fn read_back(client: &mut Client, buffer: &mut SharedBuffer, ids: &[ChunkId]) -> u32 {
    let lookup = client.lookup(0, ids.to_vec()).unwrap();
    let outcome = client.wait(lookup.id, Duration::from_secs(30)).unwrap();
    let hit = outcome.hit_chunks as usize;
    client.retrieve(lookup.id, 0, blocks(&ids[..hit])).unwrap();
    for (i, id) in ids[..hit].iter().enumerate() {
        let block = buffer.block_mut(i as u64).unwrap();
        assert!(holds(block, *id, 0), "chunk {i} of a hit was served with wrong bytes");
        block.fill(0);
    }
    outcome.hit_chunks
}

#[test]
fn h16_02_every_chunk_acknowledged_durable_survives_kill_9_byte_exact() {
    // Write-through: the store policy under which a flush acknowledges chunks durable (under
    // the cascade, the default, a chunk reaches disk only when L2 lets it go or at a clean stop).
    let write_through = "\n[storage]\nstore_policy = \"write_through\"\n";
    let mut daemon = Daemon::start_with(|dir| small_config(dir, None, write_through));
    let hello = || Client::worker_hello("crash", CHUNK);
    // Every batch a writer stored, and the ones a flush counted durable, over every round.
    let durable: Arc<Mutex<Vec<u64>>> = Arc::default();
    let attempted: Arc<Mutex<Vec<u64>>> = Arc::default();
    let mut next_prompt = 1u64;
    for round in 0..4 {
        let socket_daemon = &daemon;
        let stop = Arc::new(AtomicBool::new(false));
        let (mut client, mut buffer) = worker(socket_daemon, hello());
        let writer = {
            let (durable, attempted, stop) =
                (Arc::clone(&durable), Arc::clone(&attempted), Arc::clone(&stop));
            let first = next_prompt;
            std::thread::spawn(move || {
                let mut prompt = first;
                while !stop.load(Ordering::Acquire) {
                    let ids = fill_batch(&mut buffer, prompt);
                    attempted.lock().unwrap().push(prompt);
                    let Ok(stored) = client.store(0, 0, blocks(&ids)) else { break };
                    let Ok((ok, _)) = client.flush(Duration::from_secs(30)) else { break };
                    if stored.stored == BATCH as u32 && ok == BATCH as u32 {
                        durable.lock().unwrap().push(prompt);
                    }
                    prompt += 1;
                }
            })
        };
        // Kill the daemon under load, once a few batches of this round are durable.
        let target = 3 * (round + 1);
        while durable.lock().unwrap().len() < target {
            assert!(!writer.is_finished(), "the writer stopped before the crash");
            std::thread::yield_now();
        }
        daemon.kill();
        stop.store(true, Ordering::Release);
        writer.join().unwrap();
        next_prompt = attempted.lock().unwrap().iter().max().copied().unwrap_or(0) + 1;
        daemon.restart();
        let (mut reader, mut buffer) = worker(&daemon, hello());
        for prompt in durable.lock().unwrap().iter() {
            assert_eq!(
                read_back(&mut reader, &mut buffer, &chain(*prompt)),
                BATCH as u32,
                "round {round}: batch {prompt} was acknowledged durable and is lost"
            );
        }
        // Batches never acknowledged durable may be there in part or not at all, never wrong.
        for prompt in attempted.lock().unwrap().iter() {
            read_back(&mut reader, &mut buffer, &chain(*prompt));
        }
        reader.end().unwrap();
    }
    assert!(durable.lock().unwrap().len() >= 12);
}

#[test]
fn h16_08_one_session_cannot_fill_l1_with_leases() {
    let daemon = daemon_with_lease_cap(2 * BATCH * 64);
    let (mut hog, mut buffer) = worker(&daemon, Client::worker_hello("m", CHUNK));
    for prompt in 1..=3 {
        let ids = fill_batch(&mut buffer, prompt);
        assert_eq!(hog.store(0, 0, blocks(&ids)).unwrap().stored, BATCH as u32);
    }
    // Two unreleased lookups of 8 chunks reach the cap of 16 chunks; the third is refused.
    let first = hog.lookup(0, chain(1)).unwrap();
    hog.lookup(0, chain(2)).unwrap();
    assert_eq!(code(hog.lookup(0, chain(3))), ErrorCode::LeaseLimit);
    // Another session is not held back by it.
    let (mut other, _b) = worker(&daemon, Client::worker_hello("m", CHUNK));
    assert_eq!(other.lookup(0, chain(3)).unwrap().outcome.unwrap().hit_chunks, BATCH as u32);
    // Returning one lookup's shares makes room again.
    hog.release(first.id).unwrap();
    assert_eq!(hog.lookup(0, chain(3)).unwrap().outcome.unwrap().hit_chunks, BATCH as u32);
}

#[test]
fn h16_08_misses_a_session_never_returns_are_bounded_too() {
    // A miss holds no lease, but its record is kept until its deadline: a client that never
    // returns its lookups is refused past 4,096 open ones, and only it.
    let daemon = daemon_with_lease_cap(2 * BATCH * 64);
    let (mut hog, _buffer) = worker(&daemon, Client::worker_hello("m", CHUNK));
    let mut last = None;
    for n in 0..4096u64 {
        let id = hog.lookup(0, vec![ChunkId(u128::from(n) + 1)]).unwrap().id;
        assert_eq!(hog.wait(id, Duration::from_secs(10)).unwrap().hit_chunks, 0);
        last = Some(id);
    }
    assert_eq!(code(hog.lookup(0, vec![ChunkId(1)])), ErrorCode::LeaseLimit);
    let (mut other, _b) = worker(&daemon, Client::worker_hello("m", CHUNK));
    other.lookup(0, vec![ChunkId(1)]).unwrap();
    hog.release(last.unwrap()).unwrap();
    hog.lookup(0, vec![ChunkId(1)]).unwrap();
}

/// On a daemon whose sessions may lease 4 slots of its 64 (`daemon_with_lease_cap(4 * 64)`): a
/// session of `chunk_bytes` chunks stores three L1s' worth of them (the first batches pass down
/// to L2 and the disk), looks up 32 of them, all below L1, and reads them back. The hit is whole,
/// but only 4 chunks of it are loaded into L1 for the session; the rest is read from the tiers at
/// the retrieve. Returns the session.
fn load_past_the_allowance(daemon: &Daemon, chunk_bytes: u64) -> Client {
    let mut client =
        Client::connect_unix(&daemon.socket, Client::worker_hello("m", chunk_bytes)).unwrap();
    let mut buffer = SharedBuffer::new(chunk_bytes, 4 * BATCH).unwrap();
    assert_eq!(client.register_buffer(&buffer).unwrap(), 0);
    for prompt in 1..=24 {
        let ids = fill_batch(&mut buffer, prompt);
        assert_eq!(client.store(0, 0, blocks(&ids)).unwrap().stored, BATCH as u32);
    }
    daemon.settled();
    let ids: Vec<ChunkId> = (1..=4).flat_map(chain).collect();
    let lookup = client.lookup(0, ids.clone()).unwrap();
    let outcome = client.wait(lookup.id, Duration::from_secs(30)).unwrap();
    assert_eq!(outcome.hit_chunks, ids.len() as u32);
    assert_eq!(daemon.status().l1_leased_chunks, 4, "L1 slots this lookup holds");
    client.retrieve(lookup.id, 0, blocks(&ids)).unwrap();
    for (i, id) in ids.iter().enumerate() {
        assert!(holds(buffer.block_mut(i as u64).unwrap(), *id, 0), "chunk {i}");
    }
    assert_eq!(daemon.settled().open_lookups, 0);
    client
}

#[test]
fn h16_08_one_lookup_loads_no_more_of_its_hit_into_l1_than_its_sessions_allowance() {
    // L1 of 64 slots; a session may hold leases on 4 chunks.
    load_past_the_allowance(&daemon_with_lease_cap(4 * 64), CHUNK);
}

#[test]
fn h16_08_a_chunk_smaller_than_a_slot_counts_a_whole_slot_of_the_allowance() {
    // L1 of 64 slots of 64 KiB; a session may hold leases on 4 slots. Its chunks are an eighth of
    // a slot, and each takes a whole slot all the same: 4 chunks are its allowance, not 32.
    let daemon = daemon_with_lease_cap(4 * 64);
    let mut client = load_past_the_allowance(&daemon, CHUNK / 8);
    // A lookup of 8 chunks holds at least the 4 slots of the allowance (8 eighths of a slot are
    // only a quarter of it in bytes): the next lookup is refused until it is returned.
    let held = client.lookup(0, chain(24)).unwrap();
    assert_eq!(code(client.lookup(0, chain(23))), ErrorCode::LeaseLimit);
    client.release(held.id).unwrap();
    client.lookup(0, chain(23)).unwrap();
}

#[test]
fn h16_10_every_reader_of_an_empty_mla_hit_returns_its_share_without_an_error() {
    let daemon = Daemon::start();
    let mla = |rank: u16| mla_hello(rank, 3);
    let mut ranks: Vec<(Client, SharedBuffer)> = (0..3).map(|r| worker(&daemon, mla(r))).collect();
    let lookup = ranks[0].0.lookup(0, chain(99)).unwrap();
    let outcome = ranks[0].0.wait(lookup.id, Duration::from_secs(10)).unwrap();
    assert_eq!((outcome.hit_chunks, outcome.readers), (0, 3));
    for (client, _) in &mut ranks {
        client.retrieve(lookup.id, 0, Vec::new()).unwrap();
    }
    assert_eq!(code(ranks[2].0.retrieve(lookup.id, 0, Vec::new())), ErrorCode::ShareReturned);
    // The owner's release after the last reader is not an error: nothing is left to return.
    ranks[0].0.release(lookup.id).unwrap();
    assert_eq!(daemon.settled().open_lookups, 0);
}

#[test]
fn h16_protocol_per_tier_is_always_l1_l2_disk_and_adds_up_to_the_hit() {
    let daemon = Daemon::start();
    let (mut client, mut buffer) = worker(&daemon, Client::worker_hello("m", CHUNK));
    let ids = fill_batch(&mut buffer, 5);
    client.store(0, 0, blocks(&ids)).unwrap();
    let outcome = client.lookup(0, ids.clone()).unwrap().outcome.unwrap();
    assert_eq!(outcome.per_tier, vec![BATCH as u32, 0, 0, 0], "an all-L1 hit");
    let miss = client.lookup(0, chain(6)).unwrap();
    let miss = client.wait(miss.id, Duration::from_secs(10)).unwrap();
    assert_eq!(miss.per_tier, vec![0, 0, 0, 0], "a miss");
}

#[test]
fn h16_protocol_a_second_hello_closes_the_connection_and_world_size_defaults_to_tp_size() {
    let daemon = Daemon::start();
    let hello = Hello { tp_size: 2, rank: 1, world_size: None, ..Client::worker_hello("m", CHUNK) };
    let mut client = Client::connect_unix(&daemon.socket, hello.clone()).unwrap();
    assert_eq!(code(client.call(RequestBody::Hello(hello))), ErrorCode::NoSession);
    assert!(client.call(RequestBody::Status).is_err(), "the connection stays open");
}

#[test]
fn h16_protocol_past_max_connections_the_refusal_has_its_own_code() {
    let port = tierkv_integration_tests::free_port();
    let daemon = Daemon::start_with(|dir| {
        small_config(dir, Some(port), "").replace("[server]\n", "[server]\nmax_connections = 1\n")
    });
    // The start-up probe's connection may still hold the one slot for a moment.
    let _first = (0..1000)
        .find_map(|_| Client::connect_unix(&daemon.socket, Client::worker_hello("m", CHUNK)).ok())
        .expect("the one connection");
    // Read the refusal before sending anything: a hello the daemon never reads would make its
    // close a reset, which may overtake the reply.
    let mut second = std::os::unix::net::UnixStream::connect(&daemon.socket).unwrap();
    let body = tierkv_client::proto::read_frame(&mut second, 1 << 20).unwrap().unwrap();
    let reply: tierkv_client::proto::Reply = tierkv_client::proto::decode(&body).unwrap();
    match reply.body {
        ReplyBody::Error { code, .. } => assert_eq!(code, ErrorCode::TooManyConnections),
        other => panic!("{other:?}"),
    }
    assert_eq!(reply.id, 0);
    // A client that says hello first (as every client does) gets the refusal too, never a reset:
    // the daemon reads and drops what it sent before closing.
    for _ in 0..20 {
        let refused = Client::connect_unix(&daemon.socket, Client::worker_hello("m", CHUNK));
        match refused {
            Err(e) => assert_eq!(e.code(), Some(ErrorCode::TooManyConnections), "{e}"),
            Ok(_) => panic!("a second connection was served"),
        }
    }
    // Each refusal is counted, as every error reply is.
    let (_, metrics) = tierkv_integration_tests::http_get(port, "/metrics").unwrap();
    let refusals = metrics
        .lines()
        .find(|l| l.starts_with("tierkv_protocol_errors_total{reason=\"too_many_connections\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse::<f64>().ok());
    assert!(refusals.is_some_and(|n| n >= 21.0), "refusals counted: {refusals:?}");
}

#[test]
fn h16_protocol_silent_tcp_connections_cannot_take_the_unix_sockets_places() {
    // Anyone who reaches the TCP port may connect before showing the token. TCP holds a
    // quarter of the places at most (one of four here), so the node's workers still connect.
    let tcp = tierkv_integration_tests::free_port();
    let daemon = Daemon::start_with(|dir| {
        small_config(dir, None, "").replace(
            "[server]\n",
            &format!(
                "[server]\nmax_connections = 4\ntcp = \"127.0.0.1:{tcp}\"\n\
                 token = \"a-token-of-sixteen-chars\"\n"
            ),
        )
    });
    let _silent = std::net::TcpStream::connect(("127.0.0.1", tcp)).unwrap();
    let mut second = std::net::TcpStream::connect(("127.0.0.1", tcp)).unwrap();
    // Refused at once, not after the hello's deadline (10 s) as a served connection would be.
    second.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let body = tierkv_client::proto::read_frame(&mut second, 1 << 20).unwrap().unwrap();
    let reply: tierkv_client::proto::Reply = tierkv_client::proto::decode(&body).unwrap();
    match reply.body {
        ReplyBody::Error { code, .. } => assert_eq!(code, ErrorCode::TooManyConnections),
        other => panic!("a second TCP connection was served: {other:?}"),
    }
    // The three other places are the Unix socket's (the start-up probe's connection may still
    // hold one for a moment).
    let workers: Vec<Client> = (0..3)
        .map(|_| {
            (0..1000)
                .find_map(|_| {
                    Client::connect_unix(&daemon.socket, Client::worker_hello("m", CHUNK)).ok()
                })
                .expect("a worker connects beside a silent TCP connection")
        })
        .collect();
    assert_eq!(workers.len(), 3);
}

#[test]
fn h16_protocol_trailing_bytes_make_a_bad_frame() {
    let daemon = Daemon::start();
    let mut client =
        Client::connect_unix(&daemon.socket, Client::worker_hello("m", CHUNK)).unwrap();
    // Trailing bytes: the frame is garbage, the connection closes.
    let mut frame = Vec::new();
    encode(&Request { id: 3, body: RequestBody::Status }, &mut frame).unwrap();
    frame.push(0xc0);
    let len = (frame.len() - 4) as u32;
    frame[..4].copy_from_slice(&len.to_le_bytes());
    client.send_raw(&frame, &[]).unwrap();
    match client.read_reply().unwrap().body {
        ReplyBody::Error { code, .. } => assert_eq!(code, ErrorCode::BadFrame),
        other => panic!("{other:?}"),
    }
}

/// Issue 13: a client keeps several requests in flight on one connection and collects each
/// reply by its request, in any order: stores go without waiting, a refused one fails alone,
/// and every byte stored is the byte retrieved.
#[test]
fn pipelined_stores_each_get_their_own_reply_and_store_exact_bytes() {
    use tierkv_client::proto::{ChunkBlocks, ChunkId, ErrorCode};
    use tierkv_client::{Client, SharedBuffer};

    const CHUNK: u64 = 64 << 10;
    let daemon = tierkv_integration_tests::Daemon::start();
    let mut client =
        Client::connect_unix(&daemon.socket, Client::worker_hello("model", CHUNK)).unwrap();
    // Past the in-flight limit, and within the small L1 (64 chunks), so nothing is evicted.
    let requests = Client::MAX_IN_FLIGHT as u64 + 4;
    let mut buffer = SharedBuffer::new(CHUNK, 2 * requests).unwrap();
    for b in 0..2 * requests {
        let block = buffer.block_mut(b).unwrap();
        block.iter_mut().enumerate().for_each(|(i, x)| *x = (b as usize * 31 + i) as u8);
    }
    let id = client.register_buffer(&buffer).unwrap();
    let chunk = |b: u64| ChunkId(0x1313_0000 + u128::from(b));
    // Request 7 names a buffer that does not exist: refused alone.
    let pending: Vec<_> = (0..requests)
        .map(|r| {
            let target = if r == 7 { id + 100 } else { id };
            let chunks = (2 * r..2 * r + 2).map(|b| ChunkBlocks::one(chunk(b), b)).collect();
            client.submit_store(0, target, chunks).unwrap()
        })
        .collect();
    assert!(client.pending() as u64 == requests);
    // Collected newest first: the replies of older requests wait for their collectors.
    for (r, p) in pending.into_iter().enumerate().rev() {
        match client.finish_store(p) {
            Ok(stored) if r != 7 => assert_eq!(stored.stored, 2, "request {r}: {stored:?}"),
            Err(e) if r == 7 => assert_eq!(e.code(), Some(ErrorCode::BadBuffer), "{e}"),
            other => panic!("request {r}: {other:?}"),
        }
    }
    assert_eq!(client.pending(), 0);
    // A blocking call after pipelined ones, then every stored chunk back, byte for byte.
    let kept: Vec<u64> = (0..2 * requests).filter(|b| b / 2 != 7).collect();
    let lookup = client.lookup(0, kept.iter().map(|b| chunk(*b)).collect()).unwrap();
    assert_eq!(lookup.l1_hit_chunks as usize, kept.len(), "every stored chunk is in L1");
    let n = kept.len() as u64;
    let mut out = SharedBuffer::new(CHUNK, n).unwrap();
    let out_id = client.register_buffer(&out).unwrap();
    let refs: Vec<ChunkBlocks> =
        kept.iter().enumerate().map(|(j, b)| ChunkBlocks::one(chunk(*b), j as u64)).collect();
    client.retrieve(lookup.id, out_id, refs).unwrap();
    for (j, b) in kept.iter().enumerate() {
        assert_eq!(out.block_mut(j as u64).unwrap(), buffer.block_mut(*b).unwrap(), "chunk {b}");
    }
    client.release(lookup.id).ok();
    client.end().unwrap();
}

#[test]
fn an_mla_reader_that_retrieves_twice_answers_for_no_share_after_the_first() {
    let daemon = Daemon::start();
    let (mut owner, _owners) = worker(&daemon, mla_hello(0, 2));
    let (mut other, _others) = worker(&daemon, mla_hello(1, 2));
    let joined = || daemon.status().sessions.iter().find(|s| s.rank == 1).unwrap().joined_lookups;
    let open = owner.lookup(0, vec![chunk_id(7, 0)]).unwrap();
    owner.wait(open.id, Duration::from_secs(10)).unwrap();
    other.retrieve(open.id, 0, Vec::new()).unwrap();
    assert_eq!(joined(), 0, "rank 1 returned its share");
    // The lookup is still open (rank 0's share): a second retrieve is refused, and rank 1 still
    // answers for nothing.
    let again = other.retrieve(open.id, 0, Vec::new()).unwrap_err();
    assert_eq!(again.code(), Some(ErrorCode::ShareReturned), "{again}");
    assert_eq!(joined(), 0, "a share returned already is owed no more");
    owner.retrieve(open.id, 0, Vec::new()).unwrap();
    daemon.eventually("the lookup ends with its last share", |s| s.open_lookups == 0);
}

#[test]
fn an_mla_reader_that_asked_about_many_ended_lookups_answers_only_for_the_open_ones() {
    let daemon = Daemon::start();
    let mla = |rank: u16| mla_hello(rank, 2);
    let (mut owner, _owners) = worker(&daemon, mla(0));
    let (mut other, _others) = worker(&daemon, mla(1));
    let joined = || daemon.status().sessions.iter().find(|s| s.rank == 1).unwrap().joined_lookups;
    // Rank 1 asks about each of rank 0's lookups, which rank 0 then releases: each ends, and
    // rank 1 owes it nothing. Past the per-session limit of open lookups, those are forgotten.
    // (Pipelined, ten lookups in flight at a time: the test daemon lets a session's open
    // lookups name 1 MiB, 16 of these chunks.)
    for batch in 0..420u64 {
        let lookups: Vec<_> = (0..10)
            .map(|i| {
                let chunks = vec![chunk_id(batch * 10 + i, 0)];
                owner
                    .submit(RequestBody::Lookup { namespace: 0, chunks, defer_prefetch: false })
                    .unwrap()
            })
            .collect();
        let ids: Vec<u64> = lookups
            .into_iter()
            .map(|pending| match owner.collect(pending).unwrap() {
                ReplyBody::LookupStarted { lookup, .. } => lookup,
                other => panic!("a lookup answered {other:?}"),
            })
            .collect();
        let queries: Vec<_> = ids
            .iter()
            .map(|&lookup| other.submit(RequestBody::Query { lookup }).unwrap())
            .collect();
        for pending in queries {
            other.collect(pending).unwrap();
        }
        let releases: Vec<_> = ids
            .iter()
            .map(|&lookup| owner.submit(RequestBody::Release { lookup }).unwrap())
            .collect();
        for pending in releases {
            assert_eq!(owner.collect(pending).unwrap(), ReplyBody::Released);
        }
    }
    let after = joined();
    assert!((1..4_096).contains(&after), "rank 1 answers for {after} lookups, all of them ended");
    // One still open is answered for, and its share goes back when rank 1 leaves.
    let open = owner.lookup(0, vec![chunk_id(9_999, 0)]).unwrap();
    owner.wait(open.id, Duration::from_secs(10)).unwrap();
    other.query(open.id).unwrap();
    drop(other);
    owner.retrieve(open.id, 0, Vec::new()).unwrap();
    daemon.eventually("rank 1's share comes back as it leaves", |s| s.open_lookups == 0);
}
