//! CONFORMANCE F4: whatever a client sends, it gets a clear error (or, for garbage, a closed
//! connection), the daemon keeps serving everyone else, and nothing stored is lost.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};

use proptest::prelude::*;
use tierkv_client::payload::chunk_id;
use tierkv_client::proto::{
    ChunkBlocks, ChunkId, ErrorCode, HEADER_BYTES, Hello, KvLayout, PROTOCOL_VERSION, RegionSource,
    ReplyBody, Request, RequestBody, Segment,
};
use tierkv_client::{Client, ClientError, SharedBuffer, memfd};
use tierkv_integration_tests::{Daemon, Worker, open_fds};

const CHUNK: u64 = 65536;

fn hello() -> Hello {
    Client::worker_hello("model", CHUNK)
}

fn one_block_layout(blocks: u64) -> KvLayout {
    KvLayout {
        blocks,
        block_bytes: CHUNK,
        block_stride: CHUNK,
        blocks_per_chunk: 1,
        segments: vec![Segment { region: 0, offset: 0 }],
    }
}

fn connect(daemon: &Daemon) -> Client {
    Client::connect_unix(&daemon.socket, hello()).unwrap()
}

fn code(result: Result<impl std::fmt::Debug, ClientError>) -> ErrorCode {
    match result {
        Err(e) => e.code().unwrap_or_else(|| panic!("not a daemon error: {e}")),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

/// A worker with stored chunks that must survive everything the test throws at the daemon.
struct Witness(Worker);

impl Witness {
    fn new(daemon: &Daemon) -> Self {
        let mut w = daemon.worker(&["--chunk-bytes", "65536", "--blocks", "16"]);
        w.run("store 42 16");
        Witness(w)
    }

    /// The daemon still serves, and the witness's chunks are intact, byte for byte.
    fn check(&mut self) {
        let id = self.0.run("lookup 42 16")["lookup"].as_u64().unwrap();
        self.0.run(&format!("wait {id}"));
        assert_eq!(self.0.run(&format!("retrieve {id} 42 16"))["verified"], 16);
    }
}

fn raw_frame(body: &[u8]) -> Vec<u8> {
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(body);
    frame
}

#[test]
fn f4_garbage_gets_a_bad_frame_reply_and_only_that_connection_closes() {
    let daemon = Daemon::start();
    let mut witness = Witness::new(&daemon);
    let mut client = connect(&daemon);
    client.send_raw(&raw_frame(&[0xc1, 0xff, 0x00, 0x13]), &[]).unwrap();
    let reply = client.read_reply().unwrap();
    assert!(matches!(reply.body, ReplyBody::Error { code: ErrorCode::BadFrame, .. }), "{reply:?}");
    assert!(matches!(client.read_reply(), Err(ClientError::Closed)), "the connection is closed");
    witness.check();
}

#[test]
fn f4_an_unknown_request_type_is_refused_and_the_session_goes_on() {
    let daemon = Daemon::start();
    let mut client = connect(&daemon);
    // {"id": 77, "body": {"frobnicate": {}}}
    let mut body = vec![0x82, 0xa2, b'i', b'd', 77, 0xa4, b'b', b'o', b'd', b'y', 0x81, 0xaa];
    body.extend_from_slice(b"frobnicate");
    body.push(0x80);
    client.send_raw(&raw_frame(&body), &[]).unwrap();
    let reply = client.read_reply().unwrap();
    assert_eq!(reply.id, 77, "the reply carries the request's id");
    match reply.body {
        ReplyBody::Error { code, message } => {
            assert_eq!(code, ErrorCode::BadRequest);
            assert!(message.contains("frobnicate"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    client.status().expect("the session survives an unknown request");
}

#[test]
fn f4_an_oversized_frame_is_refused_before_it_is_read() {
    let daemon = Daemon::start();
    let mut witness = Witness::new(&daemon);
    let mut client = connect(&daemon);
    client.send_raw(&(1u32 << 30).to_le_bytes(), &[]).unwrap();
    let reply = client.read_reply().unwrap();
    match reply.body {
        ReplyBody::Error { code: ErrorCode::BadFrame, message } => {
            assert!(message.contains("exceeds the limit"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    witness.check();
}

#[test]
fn f4_blocks_outside_the_registered_buffer_are_refused_before_any_copy() {
    let daemon = Daemon::start();
    let mut witness = Witness::new(&daemon);
    let mut client = connect(&daemon);
    let mut buffer = SharedBuffer::new(CHUNK, 4).unwrap();
    let id = client.register_buffer(&buffer).unwrap();
    let chunk = ChunkId(1);
    let outside = vec![ChunkBlocks::one(chunk, 0), ChunkBlocks::one(ChunkId(2), 4)];
    assert_eq!(code(client.store(0, id, outside)), ErrorCode::BlockOutOfRange);
    let huge = vec![ChunkBlocks::one(chunk, u64::MAX)];
    assert_eq!(code(client.store(0, id, huge)), ErrorCode::BlockOutOfRange);
    assert_eq!(
        code(client.store(0, id + 1, vec![ChunkBlocks::one(chunk, 0)])),
        ErrorCode::BadBuffer
    );
    assert_eq!(daemon.status().tiers[0].objects, 16, "the refused store stored nothing");

    tierkv_client::payload::fill(buffer.block_mut(0).unwrap(), chunk, 7);
    client.store(0, id, vec![ChunkBlocks::one(chunk, 0)]).unwrap();
    let lookup = client.lookup(0, vec![chunk]).unwrap();
    // A copy into block 1 the daemon could make, then one out of range: refused whole, before
    // the first is copied.
    let bad = vec![ChunkBlocks::one(chunk, 1), ChunkBlocks::one(chunk, 9)];
    assert_eq!(code(client.retrieve(lookup.id, id, bad)), ErrorCode::BlockOutOfRange);
    assert!(buffer.block(1).unwrap().iter().all(|b| *b == 0), "block 1 was written");
    // The refused retrieve returned nothing: the share is still there to read.
    client.retrieve(lookup.id, id, vec![ChunkBlocks::one(chunk, 1)]).unwrap();
    assert_eq!(buffer.block(1), buffer.block(0), "the chunk, read into block 1 this time");
    // (The store pipeline holds a share of each new chunk while it copies it down.)
    daemon.eventually("no shares left", |s| s.l1_leased_chunks == 0);
    witness.check();
}

#[test]
fn f4_cuda_events_for_a_buffer_in_host_memory_are_refused_before_any_copy() {
    let daemon = Daemon::start();
    let mut witness = Witness::new(&daemon);
    let mut client = connect(&daemon);
    let mut buffer = SharedBuffer::new(CHUNK, 4).unwrap();
    buffer.block_mut(0).unwrap().fill(0xAB);
    let id = client.register_buffer(&buffer).unwrap();
    // A CUDA event orders copies out of GPU memory; a memfd buffer has none, whatever the handle.
    for handle in [vec![7u8; 64], vec![7u8; 3]] {
        let store = client.call(RequestBody::Store {
            namespace: 0,
            buffer: id,
            chunks: vec![ChunkBlocks::one(ChunkId(1), 0)],
            ready_event: Some(handle),
        });
        let err = store.unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::BadBuffer), "{err}");
        assert!(
            err.to_string().contains("ready_event: a CUDA event needs a registration in GPU"),
            "{err}"
        );
    }
    assert_eq!(daemon.status().tiers[0].objects, 16, "the refused stores stored nothing");
    // The session goes on: the same store without the event is fine.
    client.store(0, id, vec![ChunkBlocks::one(ChunkId(1), 0)]).unwrap();
    // A retrieve's done_event is refused before the hit is read: the share stays to be used.
    let lookup = client.lookup(0, vec![ChunkId(1)]).unwrap();
    let retrieve = client.call(RequestBody::Retrieve {
        lookup: lookup.id,
        buffer: id,
        chunks: vec![ChunkBlocks::one(ChunkId(1), 1)],
        done_event: Some(vec![7u8; 64]),
    });
    let err = retrieve.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadBuffer), "{err}");
    assert!(
        err.to_string().contains("done_event: a CUDA event needs a registration in GPU"),
        "{err}"
    );
    client.retrieve(lookup.id, id, vec![ChunkBlocks::one(ChunkId(1), 1)]).unwrap();
    assert!(buffer.block(1).unwrap().iter().all(|&b| b == 0xAB), "the chunk came back whole");
    daemon.eventually("no shares left", |s| s.l1_leased_chunks == 0);
    witness.check();
}

#[test]
fn f4_a_namespace_not_declared_is_refused_and_other_namespaces_stay_invisible() {
    let daemon = Daemon::start();
    let mut witness = Witness::new(&daemon);
    let mut client = connect(&daemon);
    assert_eq!(code(client.lookup(1, vec![ChunkId(1)])), ErrorCode::NamespaceNotDeclared);
    let buffer = SharedBuffer::new(CHUNK, 1).unwrap();
    let id = client.register_buffer(&buffer).unwrap();
    let store = client.store(7, id, vec![ChunkBlocks::one(ChunkId(1), 0)]);
    assert_eq!(code(store), ErrorCode::NamespaceNotDeclared);

    // The witness's lookup belongs to namespace "model"; a session of another model cannot
    // even see it, let alone read it.
    let id = witness.0.run("lookup 42 16")["lookup"].as_u64().unwrap();
    let mut stranger =
        Client::connect_unix(&daemon.socket, Client::worker_hello("other", CHUNK)).unwrap();
    assert_eq!(code(stranger.query(id)), ErrorCode::UnknownLookup);
    let sbuf = SharedBuffer::new(CHUNK, 1).unwrap();
    let sid = stranger.register_buffer(&sbuf).unwrap();
    let steal = vec![ChunkBlocks::one(chunk_id(42, 0), 0)];
    assert_eq!(code(stranger.retrieve(id, sid, steal)), ErrorCode::UnknownLookup);
    assert!(sbuf.block(0).unwrap().iter().all(|&b| b == 0), "nothing was copied out");
    witness.0.run(&format!("release {id}"));
    witness.check();
}

#[test]
fn f4_session_rules_hello_first_versions_tokens_roles_and_buffers() {
    let daemon = Daemon::start();
    let mut witness = Witness::new(&daemon);

    let wrong_version = Hello { version: PROTOCOL_VERSION + 1, ..hello() };
    let err = Client::connect_unix(&daemon.socket, wrong_version).err().unwrap();
    assert_eq!(err.code(), Some(ErrorCode::VersionMismatch));
    let bad_rank = Hello { rank: 2, tp_size: 2, world_size: Some(2), ..hello() };
    assert_eq!(
        Client::connect_unix(&daemon.socket, bad_rank).err().unwrap().code(),
        Some(ErrorCode::BadRequest)
    );
    // A8 on the wire: an MLA group's extra_count is tp_size - 1, at most 127; one more (or
    // none at all) is refused naming the bound, and the bound itself is taken.
    for tp_size in [0, 129] {
        let mla = Hello { mla: true, tp_size, world_size: Some(tp_size), ..hello() };
        let refused = Client::connect_unix(&daemon.socket, mla).err().unwrap();
        assert_eq!(refused.code(), Some(ErrorCode::BadRequest), "tp_size {tp_size}");
        assert!(refused.to_string().contains("1..=128"), "{refused}");
    }
    let widest = Hello { mla: true, tp_size: 128, world_size: Some(128), ..hello() };
    let widest = Client::connect_unix(&daemon.socket, widest).unwrap();
    assert_eq!(widest.session().readers, 128, "one share per rank of the group");
    drop(widest);
    let too_big = Hello { chunk_bytes: 1 << 40, ..hello() };
    assert_eq!(
        Client::connect_unix(&daemon.socket, too_big).err().unwrap().code(),
        Some(ErrorCode::BadRequest)
    );

    // A hello the daemon cannot take is `bad_request`, and the connection stays for a corrected
    // one (docs/protocol.md); one of another version closes it.
    let mut stream = std::os::unix::net::UnixStream::connect(&daemon.socket).unwrap();
    let mut say = |id: u64, hello: Hello| {
        let mut frame = Vec::new();
        let request = Request { id, body: RequestBody::Hello(hello) };
        tierkv_client::proto::encode(&request, &mut frame).unwrap();
        stream.write_all(&frame).unwrap();
        let reply = tierkv_client::proto::read_frame(&mut stream, 1 << 20).unwrap().unwrap();
        tierkv_client::proto::decode::<tierkv_client::proto::Reply>(&reply).unwrap().body
    };
    let refused = say(1, Hello { rank: 2, tp_size: 2, world_size: Some(2), ..hello() });
    assert!(matches!(refused, ReplyBody::Error { code: ErrorCode::BadRequest, .. }), "{refused:?}");
    let welcome = say(2, hello());
    assert!(matches!(welcome, ReplyBody::Welcome { .. }), "{welcome:?}");

    // A request before the hello.
    let mut stream = std::os::unix::net::UnixStream::connect(&daemon.socket).unwrap();
    let mut frame = Vec::new();
    tierkv_client::proto::encode(&Request { id: 1, body: RequestBody::Status }, &mut frame)
        .unwrap();
    stream.write_all(&frame).unwrap();
    let reply = tierkv_client::proto::read_frame(&mut stream, 1 << 20).unwrap().unwrap();
    let reply: tierkv_client::proto::Reply = tierkv_client::proto::decode(&reply).unwrap();
    assert!(matches!(reply.body, ReplyBody::Error { code: ErrorCode::NoSession, .. }), "{reply:?}");

    // Roles: an admin cannot store, a worker cannot clear.
    let mut admin = Client::connect_unix(&daemon.socket, Client::admin_hello()).unwrap();
    assert_eq!(code(admin.lookup(0, vec![ChunkId(1)])), ErrorCode::Forbidden);
    let mut client = connect(&daemon);
    assert_eq!(code(client.clear()), ErrorCode::Forbidden);
    assert_eq!(code(client.call(RequestBody::Hello(hello()))), ErrorCode::NoSession);
    // A second hello closes the connection (issue 16): go on with a new one.
    assert!(client.call(RequestBody::Status).is_err(), "the connection is closed");
    let mut client = connect(&daemon);

    // Buffers: none attached, wrong block size, unsealed memfd, too small for its claim.
    let none = client.call(RequestBody::RegisterKv {
        regions: vec![RegionSource::Memfd { bytes: CHUNK }],
        layout: one_block_layout(1),
    });
    assert_eq!(code(none), ErrorCode::BadBuffer);
    let wrong = SharedBuffer::new(CHUNK / 2, 2).unwrap();
    assert_eq!(code(client.register_buffer(&wrong)), ErrorCode::BadBuffer);
    let unsealed = memfd(c"unsealed", libc::MFD_CLOEXEC).unwrap();
    unsealed.set_len(CHUNK * 2).unwrap();
    let unsealed = SharedBuffer::from_file(unsealed, CHUNK, 2).unwrap();
    let err = client.register_buffer(&unsealed).err().unwrap();
    assert_eq!(err.code(), Some(ErrorCode::BadBuffer));
    assert!(err.to_string().contains("F_SEAL_SHRINK"), "{err}");
    let short = SharedBuffer::new(CHUNK, 2).unwrap();
    let claim = client.call_with_descriptors(
        RequestBody::RegisterKv {
            regions: vec![RegionSource::Memfd { bytes: CHUNK * 3 }],
            layout: one_block_layout(3),
        },
        &[short.fd()],
    );
    assert_eq!(code(claim), ErrorCode::BadBuffer);

    // Lookups: unknown ids, releasing someone else's, retrieving chunks outside the hit.
    assert_eq!(code(client.query(987_654)), ErrorCode::UnknownLookup);
    let theirs = witness.0.run("lookup 42 16")["lookup"].as_u64().unwrap();
    assert_eq!(code(client.release(theirs)), ErrorCode::Forbidden);
    let buffer = SharedBuffer::new(CHUNK, 2).unwrap();
    let id = client.register_buffer(&buffer).unwrap();
    let mine = client.lookup(0, vec![chunk_id(42, 0)]).unwrap();
    let outside = vec![ChunkBlocks::one(chunk_id(42, 5), 0)];
    assert_eq!(code(client.retrieve(mine.id, id, outside)), ErrorCode::NotInHit);
    client.release(mine.id).unwrap();
    assert_eq!(code(client.release(mine.id)), ErrorCode::UnknownLookup, "released twice");
    witness.0.run(&format!("release {theirs}"));
    witness.check();
    daemon.eventually("no shares left", |s| s.l1_leased_chunks == 0);
}

#[test]
fn f4_another_ranks_lookup_is_forbidden_open_or_over() {
    let daemon = Daemon::start();
    let rank = |rank: u16| Hello { rank, tp_size: 2, world_size: Some(2), ..hello() };
    let mut zero = Client::connect_unix(&daemon.socket, rank(0)).unwrap();
    let mut one = Client::connect_unix(&daemon.socket, rank(1)).unwrap();
    let buffer = SharedBuffer::new(CHUNK, 2).unwrap();
    let (id0, id1) =
        (zero.register_buffer(&buffer).unwrap(), one.register_buffer(&buffer).unwrap());
    let chunk = vec![ChunkBlocks::one(chunk_id(7, 0), 0)];
    zero.store(0, id0, chunk.clone()).unwrap();
    let lookup = zero.lookup(0, vec![chunk_id(7, 0)]).unwrap().id;
    assert_eq!(code(one.retrieve(lookup, id1, chunk.clone())), ErrorCode::Forbidden, "open");
    zero.retrieve(lookup, id0, chunk.clone()).unwrap();
    // Over (its one reader returned its share): still rank 0's, not `share_returned` to rank 1.
    assert_eq!(code(one.retrieve(lookup, id1, chunk.clone())), ErrorCode::Forbidden, "over");
    assert_eq!(code(zero.retrieve(lookup, id0, chunk)), ErrorCode::ShareReturned);
}

#[test]
fn f4_a_refused_release_or_a_query_of_another_sessions_lookup_leaves_the_owner_its_share() {
    // Another session of the same model and rank sees the witness's lookup: the release it is
    // refused and the query it may make change nothing, not even once that session has gone.
    let daemon = Daemon::start();
    let mut witness = Witness::new(&daemon);
    let theirs = witness.0.run("lookup 42 16")["lookup"].as_u64().unwrap();
    let mut stranger = connect(&daemon);
    assert_eq!(code(stranger.release(theirs)), ErrorCode::Forbidden);
    assert_eq!(stranger.query(theirs).unwrap().map(|o| o.hit_chunks), Some(16));
    drop(stranger);
    daemon.eventually("the stranger's session is over", |s| s.connected_workers == 1);
    assert_eq!(daemon.status().l1_leased_chunks, 16, "the witness's share is still out");
    assert_eq!(witness.0.run(&format!("retrieve {theirs} 42 16"))["verified"], 16);
    daemon.eventually("no shares left", |s| s.l1_leased_chunks == 0 && s.open_lookups == 0);
}

#[test]
fn f4_sparse_memfds_are_refused_so_the_daemon_never_allocates_a_clients_pages() {
    // A sparse memfd costs its client nothing, whatever size it names; the daemon's reads of its
    // holes would allocate the pages, charged to the daemon. A memfd with a hole is refused, and
    // one session maps at most 1 TiB of memfds (checked before the memfd is looked at).
    let daemon = Daemon::start();
    let mut witness = Witness::new(&daemon);
    // Never written: sparse memfds (SharedBuffer::new would allocate their pages).
    let sparse = |bytes: u64| {
        let file = memfd(c"sparse", libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING).unwrap();
        file.set_len(bytes).unwrap();
        // SAFETY: fcntl on a descriptor we own.
        let sealed =
            unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        assert_eq!(sealed, 0);
        SharedBuffer::from_file(file, CHUNK, bytes / CHUNK).unwrap()
    };
    let refused = |err: tierkv_client::ClientError, what: &str| {
        assert_eq!(err.code(), Some(ErrorCode::BadBuffer));
        assert!(err.to_string().contains(what), "{err}");
    };
    let tib = 1u64 << 40;
    let mut client = connect(&daemon);
    refused(client.register_buffer(&sparse(10 * tib)).err().unwrap(), "one session maps");
    refused(client.register_buffer(&sparse(tib)).err().unwrap(), "fallocate");
    // Allocated but for its last chunk: still refused; whole, mapped.
    let buffer = sparse(4 * CHUNK);
    let allocate = |offset: u64, len: u64| {
        // SAFETY: fallocate on a descriptor we own, within its length.
        let done = unsafe {
            libc::fallocate(buffer.fd().as_raw_fd(), 0, offset as libc::off_t, len as libc::off_t)
        };
        assert_eq!(done, 0);
    };
    allocate(0, 3 * CHUNK);
    let partly = format!("has {} bytes of which {} are allocated", 4 * CHUNK, 3 * CHUNK);
    refused(client.register_buffer(&buffer).err().unwrap(), &partly);
    allocate(3 * CHUNK, CHUNK);
    let id = client.register_buffer(&buffer).unwrap();
    client.store(0, id, vec![ChunkBlocks::one(chunk_id(9, 0), 0)]).unwrap();
    witness.check();
}

/// Mappings the process `pid` has of the file whose inode is `inode` (its `/proc/PID/maps`
/// lines naming it).
fn mappings_of(pid: u32, inode: u64) -> usize {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("read /proc/PID/maps");
    maps.lines().filter(|line| line.split_whitespace().nth(4) == Some(&inode.to_string())).count()
}

#[test]
fn f4_one_memfd_registered_over_and_over_is_mapped_once_while_any_session_holds_it() {
    // A worker registers its KV on two sessions (the vLLM connector's step and loading
    // threads), a client may register one memfd many times: each mapping would cost the daemon
    // page tables and a populate of the whole memfd. It is mapped once, shared, and unmapped
    // with its last registration.
    let daemon = Daemon::start();
    let mut buffer = SharedBuffer::new(CHUNK, 4).unwrap();
    let inode = std::fs::File::from(buffer.fd().try_clone_to_owned().unwrap())
        .metadata()
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap();
    let (mut first, mut second) = (connect(&daemon), connect(&daemon));
    let a = first.register_buffer(&buffer).unwrap();
    first.register_buffer(&buffer).unwrap();
    let b = second.register_buffer(&buffer).unwrap();
    assert_eq!(mappings_of(daemon.pid(), inode), 1);
    // Stored through one session's registration, retrieved through the other's, byte for byte.
    let round_trip = |from: (&mut Client, u32), to: (&mut Client, u32), chunk, block| {
        from.0.store(0, from.1, vec![ChunkBlocks::one(chunk, block)]).unwrap();
        let hit = to.0.lookup(0, vec![chunk]).unwrap();
        to.0.retrieve(hit.id, to.1, vec![ChunkBlocks::one(chunk, block + 1)]).unwrap();
    };
    tierkv_client::payload::fill(buffer.block_mut(0).unwrap(), chunk_id(5, 0), 0);
    round_trip((&mut first, a), (&mut second, b), chunk_id(5, 0), 0);
    assert!(tierkv_client::payload::holds(buffer.block(1).unwrap(), chunk_id(5, 0), 0));
    // One session ends; the other's registration keeps the mapping and goes on working.
    first.end().unwrap();
    assert_eq!(mappings_of(daemon.pid(), inode), 1);
    tierkv_client::payload::fill(buffer.block_mut(2).unwrap(), chunk_id(6, 0), 0);
    let mut third = connect(&daemon);
    let c = third.register_buffer(&buffer).unwrap();
    round_trip((&mut second, b), (&mut third, c), chunk_id(6, 0), 2);
    assert!(tierkv_client::payload::holds(buffer.block(3).unwrap(), chunk_id(6, 0), 0));
    assert_eq!(mappings_of(daemon.pid(), inode), 1);
    // The last ones end (one says so, one disconnects): unmapped.
    second.end().unwrap();
    drop(third);
    daemon.eventually("no worker connected", |s| s.connected_workers == 0);
    assert_eq!(mappings_of(daemon.pid(), inode), 0);
}

#[test]
fn f4_a_descriptor_whose_close_blocks_never_blocks_the_daemon() {
    // A TCP socket whose peer never reads, its send buffer full, lingering on close: its last
    // close blocks. Four of them, each sent along with a request that takes no descriptor, the
    // daemon's copy the last: were those closes on the runtime's threads, no other client
    // would be served.
    let daemon = Daemon::start();
    let mut witness = Witness::new(&daemon);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut status = Vec::new();
    tierkv_client::proto::encode(&Request { id: 1, body: RequestBody::Status }, &mut status)
        .unwrap();
    let mut senders = Vec::new();
    for _ in 0..4 {
        let stuck = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        stuck.set_nonblocking(true).unwrap();
        let bytes = vec![0u8; 1 << 16];
        while (&stuck).write(&bytes).is_ok() {}
        // Blocking again: a non-blocking socket's close does not linger.
        stuck.set_nonblocking(false).unwrap();
        let linger = libc::linger { l_onoff: 1, l_linger: 30 };
        // SAFETY: setsockopt on a socket we own, with a linger struct of the size given.
        let set = unsafe {
            libc::setsockopt(
                stuck.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                std::ptr::from_ref(&linger).cast(),
                size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        assert_eq!(set, 0);
        let mut client = connect(&daemon);
        client.send_raw(&status, &[stuck.as_fd()]).unwrap();
        // Our copy goes while the message still holds one: the daemon's is the last.
        drop(stuck);
        senders.push(client);
    }
    let (done, answered) = std::sync::mpsc::channel();
    let socket = daemon.socket.clone();
    std::thread::spawn(move || {
        let mut other = Client::connect_unix(&socket, hello()).unwrap();
        let _ = done.send(other.status().is_ok());
    });
    let served = answered.recv_timeout(std::time::Duration::from_secs(5));
    assert_eq!(served, Ok(true), "another client was not served");
    witness.check();
    drop(senders);
}

#[test]
fn f4_descriptors_a_request_does_not_use_are_closed_and_never_taken_later() {
    let daemon = Daemon::start();
    let mut witness = Witness::new(&daemon);
    let mut client = connect(&daemon);
    // A request that takes no descriptor, sent with one, again and again: each is closed once
    // its request is answered, so they never pile up and the session goes on.
    let stray = memfd(c"stray", libc::MFD_CLOEXEC).unwrap();
    let mut status = Vec::new();
    tierkv_client::proto::encode(&Request { id: 1, body: RequestBody::Status }, &mut status)
        .unwrap();
    let before = open_fds(daemon.pid());
    for _ in 0..32 {
        client.send_raw(&status, &[stray.as_fd()]).unwrap();
        let reply = client.read_reply().unwrap();
        assert!(matches!(reply.body, ReplyBody::Status(_)), "{reply:?}");
    }
    // The witness's worker and the status replies open nothing that lasts: 32 kept would show.
    assert!(
        open_fds(daemon.pid()) <= before + 2,
        "the daemon kept the descriptors: {} open, {before} before",
        open_fds(daemon.pid())
    );
    // A registration the daemon cannot decode, carrying another buffer's memfd: refused, and its
    // descriptor is not left for the next registration to take. That one maps its own buffer,
    // so what it stores is its own bytes.
    let other = SharedBuffer::new(CHUNK, 4).unwrap();
    // {"id": 5, "body": {"register_kv": {"bogus": 1}}}
    let mut body = vec![0x82, 0xa2, b'i', b'd', 5, 0xa4, b'b', b'o', b'd', b'y', 0x81, 0xab];
    body.extend_from_slice(b"register_kv");
    body.extend_from_slice(&[0x81, 0xa5, b'b', b'o', b'g', b'u', b's', 0x01]);
    client.send_raw(&raw_frame(&body), &[other.fd()]).unwrap();
    let reply = client.read_reply().unwrap();
    assert!(
        matches!(reply.body, ReplyBody::Error { code: ErrorCode::BadRequest, .. }),
        "{reply:?}"
    );
    let mut mine = SharedBuffer::new(CHUNK, 4).unwrap();
    mine.block_mut(0).unwrap().fill(0x5a);
    let id = client.register_buffer(&mine).unwrap();
    let chunk = ChunkId(7);
    client.store(0, id, vec![ChunkBlocks::one(chunk, 0)]).unwrap();
    let lookup = client.lookup(0, vec![chunk]).unwrap();
    client.retrieve(lookup.id, id, vec![ChunkBlocks::one(chunk, 1)]).unwrap();
    assert!(
        mine.block(1).unwrap().iter().all(|&b| b == 0x5a),
        "the registration mapped another buffer than the one it sent"
    );
    daemon.eventually("no shares left", |s| s.l1_leased_chunks == 0);
    witness.check();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random bytes, random frames of random MessagePack-ish bodies, valid frames cut short:
    /// the daemon never dies, and the witness's data stays intact.
    #[test]
    fn f4_random_and_truncated_frames_never_hurt_the_daemon(
        cases in proptest::collection::vec(
            (any::<u8>(), proptest::collection::vec(any::<u8>(), 0..256), any::<usize>()), 1..6)
    ) {
        let daemon = shared_daemon();
        for (kind, bytes, cut) in cases {
            let mut client = connect(daemon);
            let wire = match kind % 3 {
                0 => bytes.clone(),
                1 => raw_frame(&bytes),
                _ => {
                    let mut frame = Vec::new();
                    let body = RequestBody::Lookup { namespace: 0, chunks: vec![ChunkId(bytes.len() as u128)], defer_prefetch: false };
                    tierkv_client::proto::encode(&Request { id: 3, body }, &mut frame).unwrap();
                    frame.truncate(cut % frame.len().max(1));
                    frame
                }
            };
            let _ = client.send_raw(&wire, &[]);
            drop(client);
        }
        let mut witness = WITNESS.lock().unwrap();
        witness.as_mut().unwrap().check();
        prop_assert!(daemon.status().connected_workers >= 1);
    }
}

static DAEMON: std::sync::OnceLock<Daemon> = std::sync::OnceLock::new();
static WITNESS: std::sync::Mutex<Option<Witness>> = std::sync::Mutex::new(None);

fn shared_daemon() -> &'static Daemon {
    let daemon = DAEMON.get_or_init(Daemon::start);
    let mut witness = WITNESS.lock().unwrap();
    if witness.is_none() {
        *witness = Some(Witness::new(daemon));
    }
    daemon
}

#[test]
fn f4_lookups_of_many_chunks_and_header_only_frames_are_fine() {
    let daemon = Daemon::start();
    let mut client = connect(&daemon);
    let many: Vec<ChunkId> = (0..10_000).map(ChunkId).collect();
    let lookup = client.lookup(0, many).unwrap();
    assert_eq!(lookup.l1_hit_chunks, 0);
    let outcome = client.wait(lookup.id, std::time::Duration::from_secs(10)).unwrap();
    assert_eq!(outcome.hit_chunks, 0);
    client.send_raw(&[0u8; HEADER_BYTES], &[]).unwrap();
    assert!(matches!(
        client.read_reply().unwrap().body,
        ReplyBody::Error { code: ErrorCode::BadFrame, .. }
    ));
}

#[test]
fn f4_a_client_that_never_says_hello_nor_reads_its_replies_loses_its_slot_in_time() {
    // Two connections, the daemon's two slots, each sending requests it cannot know the type
    // of (each answered bad_request, at length) and never reading: once their replies fill the
    // socket, the daemon's sends block. The hello's deadline still closes them.
    let daemon = Daemon::start_with(|dir| {
        tierkv_integration_tests::small_config(dir, None, "")
            .replace("[server]\n", "[server]\nhello_timeout = \"300ms\"\nmax_connections = 2\n")
    });
    let name = "x".repeat(60_000);
    let mut body = vec![0x82, 0xa2, b'i', b'd', 1, 0xa4, b'b', b'o', b'd', b'y', 0x81, 0xda];
    body.extend_from_slice(&(name.len() as u16).to_be_bytes());
    body.extend_from_slice(name.as_bytes());
    body.push(0x80);
    let frame = raw_frame(&body);
    let floods: Vec<_> = (0..2)
        .map(|_| {
            let mut stream = std::os::unix::net::UnixStream::connect(&daemon.socket).unwrap();
            stream.set_write_timeout(Some(std::time::Duration::from_secs(3))).unwrap();
            let frame = frame.clone();
            std::thread::spawn(move || {
                // Until the daemon stops reading (its replies unread) or closes the connection.
                while stream.write_all(&frame).is_ok() {}
                stream
            })
        })
        .collect();
    let floods: Vec<_> = floods.into_iter().map(|t| t.join().unwrap()).collect();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let mut client = Client::connect_unix(&daemon.socket, hello()).expect("a slot came free");
    client.status().unwrap();
    drop(floods);
}

#[test]
fn f4_a_connection_says_hello_soon_and_in_a_small_frame_or_is_closed() {
    let daemon = Daemon::start_with(|dir| {
        tierkv_integration_tests::small_config(dir, None, "")
            .replace("[server]\n", "[server]\nhello_timeout = \"300ms\"\n")
    });
    // Bare connections, each with a read deadline: a daemon that never answers fails the test.
    let raw = || {
        let stream = std::os::unix::net::UnixStream::connect(&daemon.socket).unwrap();
        stream.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
        stream
    };
    let read_reply = |stream: &mut std::os::unix::net::UnixStream| {
        let reply = tierkv_client::proto::read_frame(stream, 1 << 20).unwrap().unwrap();
        let reply: tierkv_client::proto::Reply = tierkv_client::proto::decode(&reply).unwrap();
        reply
    };
    // Silent: after the timeout a reply says why, then the daemon closes.
    let started = std::time::Instant::now();
    let mut silent = raw();
    let reply = read_reply(&mut silent);
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));
    match reply.body {
        ReplyBody::Error { code: ErrorCode::Timeout, message } => {
            assert!(message.contains("server.hello_timeout"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(
        tierkv_client::proto::read_frame(&mut silent, 1 << 20).unwrap().is_none(),
        "closed after the reply"
    );
    // Half a frame and then nothing is no hello either.
    let mut stalled = raw();
    stalled.write_all(&100u32.to_le_bytes()).unwrap();
    assert!(matches!(
        read_reply(&mut stalled).body,
        ReplyBody::Error { code: ErrorCode::Timeout, .. }
    ));
    // Before the hello, a frame over 64 KiB is refused at once, whatever server.max_frame says
    // (16 MiB here): nobody knows yet who sends it.
    let mut big = raw();
    big.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
    let reply = read_reply(&mut big);
    assert!(matches!(reply.body, ReplyBody::Error { code: ErrorCode::BadFrame, .. }), "{reply:?}");
    // A client that said hello is served past the timeout, and with frames up to max_frame.
    let mut client = connect(&daemon);
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(client.call(RequestBody::Status).is_ok());
    let many: Vec<ChunkId> = (1..=20_000).map(ChunkId).collect(); // a frame of about 200 KiB
    assert!(client.lookup(0, many).is_ok());
}
