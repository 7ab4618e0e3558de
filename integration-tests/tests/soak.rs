//! Many sessions at once against one daemon whose tiers are far smaller than what they store:
//! stores, lookups, retrieves of all or part of a hit, releases, sessions that vanish holding
//! shares, MLA readers that join a lookup and die, and an admin clearing every tier, all
//! interleaved while chunks move between the tiers (L1 in one index shard or eight): L1's victims
//! cascading through L2 to the disk, going straight to the disk without an L2, written through or
//! back to it, or admitted to it by reads; then sessions whose leases expire under them, sessions
//! whose daemon crashes or stops under them and comes back, and two nodes sharing a Redis Cluster
//! as their remote tier while one of its masters hangs. Every byte served is checked, and once
//! every session is gone nothing is held: no share, no open lookup, no store copy.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tierkv_client::payload::{SHARED_TAG, chunk_id, fill, holds};
use tierkv_client::proto::{ChunkBlocks, ChunkId, ErrorCode, Hello, LookupOutcome};
use tierkv_client::{Client, ClientError, SharedBuffer};
use tierkv_integration_tests::{Daemon, remote_section, small_config};
use tierkv_testkit::redis::RedisCluster;
use tierkv_testkit::require_redis;

/// One chunk a slot: L1 holds 64 chunks, L2 128 and the disk 512 (`small_config`).
const CHUNK: u64 = 65536;
/// The longest prompt, in chunks, and each session's buffer, in blocks.
const LONGEST: u64 = 24;
/// Prompts 0..PROMPTS: about 1,000 distinct chunks against 704 in all the tiers.
const PROMPTS: u64 = 40;
/// Operations of each plain session.
const OPERATIONS: usize = 150;
/// The admin clears every tier once every this many operations of the sessions.
const CLEAR_EVERY: u64 = 100;
/// The daemon goes down after this many operations of the sessions, and they do as many again
/// once it is back.
const RESTART_AFTER: u64 = 300;
const TOKEN: &str = "soak-admin-secret";
/// A pause longer than the 100 ms leases of the expiring daemon.
const PAST_THE_LEASE: Duration = Duration::from_millis(150);

/// What the daemon under test may do to the calls on a lookup once it is made.
#[derive(Clone, Copy)]
struct Mode {
    /// Whether sessions pause past the lease time to live before reading one lookup in six.
    pauses: bool,
    /// The codes a call on a made lookup may be refused with (the engine then recomputes);
    /// any other refusal fails the test.
    accepted: &'static [ErrorCode],
}

/// Nothing refuses a read.
const STRICT: Mode = Mode { pauses: false, accepted: &[] };

/// Leases shorter than the sessions' pauses: a read may find its lookup expired.
const EXPIRING: Mode = Mode {
    pauses: true,
    accepted: &[
        ErrorCode::UnknownLookup,
        ErrorCode::ShareReturned,
        ErrorCode::NotInHit,
        ErrorCode::Timeout,
    ],
};

/// A tier below L1 that fails or hangs under a read of the hit it holds.
const FAILING_TIER: Mode =
    Mode { pauses: false, accepted: &[ErrorCode::Internal, ErrorCode::Timeout] };

/// A small deterministic generator (xorshift), one per thread.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// What the sessions saw, summed over threads.
#[derive(Default)]
struct Seen {
    /// Operations done: what the admin's clears and the test's faults are timed by, so that
    /// they come in the middle of the work at any speed of the build and the machine.
    operations: AtomicU64,
    hit_chunks: AtomicU64,
    below_l1_chunks: AtomicU64,
    verified_chunks: AtomicU64,
    abandoned: AtomicU64,
    /// Hit chunks the remote tier served.
    remote_chunks: AtomicU64,
    /// Calls on made lookups refused with a code the run's [`Mode`] accepts.
    reads_refused: AtomicU64,
    /// Lookups refused while a dead rank's share was still out.
    lookups_refused: AtomicU64,
    /// Sessions that lost their daemon and connected again.
    reconnected: AtomicU64,
}

impl Seen {
    fn hit(&self, outcome: &LookupOutcome) {
        self.hit_chunks.fetch_add(u64::from(outcome.hit_chunks), Ordering::Relaxed);
        let below: u32 = outcome.per_tier.iter().skip(1).sum();
        self.below_l1_chunks.fetch_add(u64::from(below), Ordering::Relaxed);
        let remote = outcome.per_tier.get(3).copied().unwrap_or(0);
        self.remote_chunks.fetch_add(u64::from(remote), Ordering::Relaxed);
    }

    /// One more operation done.
    fn operation(&self) {
        self.operations.fetch_add(1, Ordering::Relaxed);
    }

    /// Waits until the sessions have done `operations` between them; false if they stalled
    /// short of it for a minute (a failed session: its panic says why).
    fn until_operations(&self, operations: u64) -> bool {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.operations.load(Ordering::Relaxed) < operations {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    /// Counts a retrieve's checked chunks, or its refusal ([`Mode::accepted`]).
    fn read(&self, checked: Option<u64>) {
        match checked {
            Some(chunks) => self.verified_chunks.fetch_add(chunks, Ordering::Relaxed),
            None => self.reads_refused.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// A session with one registered buffer of `LONGEST` blocks; `tag` is what its chunks' bytes
/// are derived from besides their ids (the rank, or `SHARED_TAG` for MLA).
struct Session {
    client: Client,
    buffer: SharedBuffer,
    tag: u64,
    /// The refusals its calls on a made lookup may meet: never wrong bytes.
    mode: Mode,
}

impl Session {
    fn open(daemon: &Daemon, hello: Hello, tag: u64, mode: Mode) -> Session {
        Session::connect(&daemon.socket, hello, tag, mode).unwrap()
    }

    /// [`Session::open`] on `socket`, or why the daemon could not be reached.
    fn connect(socket: &Path, hello: Hello, tag: u64, mode: Mode) -> Result<Session, ClientError> {
        let mut client = Client::connect_unix(socket, hello)?;
        // A daemon that stops answering fails the test instead of hanging it.
        client.set_timeout(Some(Duration::from_secs(20)))?;
        let buffer = SharedBuffer::new(CHUNK, LONGEST)?;
        assert_eq!(client.register_buffer(&buffer)?, 0);
        Ok(Session { client, buffer, tag, mode })
    }

    /// `Some` with what a call on a lookup returned; `None` if it was refused with a code the
    /// session's [`Mode`] accepts.
    fn unless_refused<T>(&self, result: Result<T, ClientError>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(e) if e.code().is_some_and(|code| self.mode.accepted.contains(&code)) => None,
            Err(e) => panic!("a call on a lookup failed: {e}"),
        }
    }

    fn release(&mut self, id: u64) {
        let released = self.client.release(id);
        self.unless_refused(released);
    }

    fn store(&mut self, prompt: u64, n: u64) {
        self.try_store(prompt, n).unwrap();
    }

    /// [`Session::store`], or why the store failed.
    fn try_store(&mut self, prompt: u64, n: u64) -> Result<(), ClientError> {
        let refs = chunks(prompt, 0, n);
        for r in &refs {
            fill(self.buffer.block_mut(r.blocks[0]).unwrap(), r.chunk, self.tag);
        }
        let stored = self.client.store(0, 0, refs)?;
        assert!(stored.stored + stored.present + stored.refused.len() as u32 <= n as u32);
        Ok(())
    }

    /// Looks up `n` chunks of `prompt` and waits for the outcome, by `wait` or by polling.
    fn lookup(&mut self, prompt: u64, n: u64, poll: bool) -> (u64, LookupOutcome) {
        self.try_lookup(prompt, n, poll).unwrap()
    }

    /// [`Session::lookup`], or the refusal of the lookup itself.
    fn try_lookup(
        &mut self,
        prompt: u64,
        n: u64,
        poll: bool,
    ) -> Result<(u64, LookupOutcome), ClientError> {
        let ids: Vec<ChunkId> = (0..n).map(|i| chunk_id(prompt, i)).collect();
        let started = self.client.lookup(0, ids)?;
        let outcome = match started.outcome {
            Some(outcome) => outcome,
            None if poll => loop {
                if let Some(outcome) = self.client.query(started.id)? {
                    break outcome;
                }
                std::thread::sleep(Duration::from_micros(200));
            },
            None => self.client.wait(started.id, Duration::from_secs(30))?,
        };
        assert_eq!(outcome.per_tier.iter().sum::<u32>(), outcome.hit_chunks);
        assert!(u64::from(outcome.hit_chunks) <= n);
        Ok((started.id, outcome))
    }

    /// Retrieves chunks `from..to` of `prompt` (part of lookup `id`'s hit) into blocks
    /// `from..to` and checks every byte; returns the chunks checked, `None` if it was refused
    /// ([`Session::unless_refused`]).
    fn retrieve(&mut self, id: u64, prompt: u64, from: u64, to: u64) -> Option<u64> {
        let retrieved = self.try_retrieve(id, prompt, from, to);
        self.unless_refused(retrieved)
    }

    /// [`Session::retrieve`], or why the retrieve failed (the blocks are then not checked: an
    /// engine recomputes them).
    fn try_retrieve(
        &mut self,
        id: u64,
        prompt: u64,
        from: u64,
        to: u64,
    ) -> Result<u64, ClientError> {
        let refs = chunks(prompt, from, to);
        for r in &refs {
            self.buffer.block_mut(r.blocks[0]).unwrap().fill(0);
        }
        self.client.retrieve(id, 0, refs.clone())?;
        for r in &refs {
            let block = self.buffer.block(r.blocks[0]).unwrap();
            assert!(
                holds(block, r.chunk, self.tag),
                "block {} was served with other bytes than chunk {:?} of prompt {prompt}",
                r.blocks[0],
                r.chunk
            );
        }
        Ok(refs.len() as u64)
    }
}

/// Chunks `from..to` of `prompt`, chunk `i` into block `i`.
fn chunks(prompt: u64, from: u64, to: u64) -> Vec<ChunkBlocks> {
    (from..to).map(|i| ChunkBlocks::one(chunk_id(prompt, i), i)).collect()
}

fn plain_hello() -> Hello {
    Client::worker_hello("soak", CHUNK)
}

fn mla_hello(rank: u16) -> Hello {
    Hello {
        rank,
        tp_size: 2,
        world_size: Some(2),
        mla: true,
        ..Client::worker_hello("soak-mla", CHUNK)
    }
}

/// One plain session's random operations; a session that vanishes is replaced by a new one.
fn plain_worker(daemon: &Daemon, seed: u64, seen: &Seen, mode: Mode) {
    let mut rng = Rng(seed);
    let mut session = Session::open(daemon, plain_hello(), 0, mode);
    for _ in 0..OPERATIONS {
        seen.operation();
        let prompt = rng.below(PROMPTS);
        let n = 1 + rng.below(LONGEST);
        if rng.below(3) == 0 {
            session.store(prompt, n);
            continue;
        }
        let (id, outcome) = session.lookup(prompt, n, rng.below(4) == 0);
        seen.hit(&outcome);
        let hit = u64::from(outcome.hit_chunks);
        if mode.pauses && rng.below(6) == 0 {
            std::thread::sleep(PAST_THE_LEASE);
        }
        // A read refused is a miss the engine recomputes; then it releases the lookup, as
        // docs/protocol.md asks.
        let read = |session: &mut Session, from, to| {
            let read = session.retrieve(id, prompt, from, to);
            if read.is_none() {
                session.release(id);
            }
            seen.read(read);
        };
        match rng.below(10) {
            // The whole hit.
            0..=4 => read(&mut session, 0, hit),
            // The engine already had the first chunks: the rest of the hit only.
            5 | 6 => read(&mut session, rng.below(hit + 1), hit),
            7 => session.release(id),
            // Nothing wanted: an empty retrieve returns the share.
            8 => read(&mut session, 0, 0),
            // The session vanishes holding its lookup (no end_session): the daemon must give
            // its shares back by itself.
            _ => {
                drop(session);
                seen.abandoned.fetch_add(1, Ordering::Relaxed);
                session = Session::open(daemon, plain_hello(), 0, mode);
            }
        }
        // Then store what the request computed past its hit, as an engine does.
        if hit < n && rng.below(2) == 0 {
            session.store(prompt, n);
        }
    }
    session.client.end().unwrap();
}

/// An MLA TP group of two: rank 0 stores and looks up, rank 1 joins its lookups by id; either
/// may read, release, or die holding its share.
fn mla_group(daemon: &Daemon, seed: u64, seen: &Seen, mode: Mode) {
    let mut rng = Rng(seed);
    let open = |rank| Session::open(daemon, mla_hello(rank), SHARED_TAG, mode);
    let mut ranks = [open(0), open(1)];
    let mut died = false;
    for _ in 0..OPERATIONS / 2 {
        seen.operation();
        let prompt = rng.below(PROMPTS);
        let n = 1 + rng.below(LONGEST);
        ranks[0].store(prompt, n);
        let (id, outcome) = match ranks[0].try_lookup(prompt, n, false) {
            Ok(found) => found,
            // A dead rank's share comes back once the daemon has seen its connection close, a
            // moment after: until then its lookup's leases count against rank 0's allowance,
            // and a lookup past that allowance is refused (the engine recomputes).
            Err(e) if died && e.code() == Some(ErrorCode::LeaseLimit) => {
                seen.lookups_refused.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Err(e) => panic!("rank 0's lookup failed: {e}"),
        };
        died = false;
        seen.hit(&outcome);
        assert_eq!(outcome.readers, 2, "one share for each rank of the group");
        let hit = u64::from(outcome.hit_chunks);
        // Rank 1 learns of the lookup as an engine's other ranks do, and joins it.
        let joined = ranks[1].client.wait(id, Duration::from_secs(30));
        if let Some(joined) = ranks[1].unless_refused(joined) {
            assert_eq!(joined.hit_chunks, outcome.hit_chunks);
        }
        for rank in 0..2 {
            // A rank's read refused is a miss the group recomputes; then the owner releases
            // the lookup, as docs/protocol.md asks.
            let read = |ranks: &mut [Session; 2], to| {
                let read = ranks[rank].retrieve(id, prompt, 0, to);
                let refused = read.is_none();
                seen.read(read);
                if refused {
                    ranks[0].release(id);
                }
                refused
            };
            match rng.below(6) {
                0..=3 => {
                    if read(&mut ranks, hit) {
                        break;
                    }
                }
                4 if rank == 1 => {
                    // Rank 1 dies after joining: its share comes back with its session.
                    drop(std::mem::replace(&mut ranks[1], open(1)));
                    seen.abandoned.fetch_add(1, Ordering::Relaxed);
                    died = true;
                }
                _ => {
                    if rank == 0 {
                        // The owner gives up on the whole lookup: every share returns.
                        ranks[0].release(id);
                        break;
                    }
                    read(&mut ranks, 0);
                }
            }
        }
    }
    for rank in ranks {
        rank.client.end().unwrap();
    }
}

/// Clears every tier once every [`CLEAR_EVERY`] operations of the sessions, until told to
/// stop.
fn admin(daemon: &Daemon, done: &AtomicBool, seen: &Seen) -> u32 {
    let hello = Hello { token: Some(TOKEN.into()), ..Client::admin_hello() };
    let mut admin = Client::connect_unix(&daemon.socket, hello).unwrap();
    let mut clears = 0;
    let mut next = CLEAR_EVERY;
    // Never after the sessions are done, so that what they left is read back after.
    while !done.load(Ordering::Relaxed) {
        if seen.operations.load(Ordering::Relaxed) >= next {
            admin.clear().unwrap();
            clears += 1;
            next += CLEAR_EVERY;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    admin.end().unwrap();
    clears
}

/// One session's stores and whole-hit reads until `stop`, across crashes of the daemon: a call
/// that loses the connection drops the session (and the lookup it was reading: its blocks are
/// recomputed), and the session connects again once the daemon is back.
fn crash_worker(socket: &Path, seed: u64, stop: &AtomicBool, seen: &Seen) {
    let mut rng = Rng(seed);
    let mut session: Option<Session> = None;
    while !stop.load(Ordering::Relaxed) {
        let Some(current) = session.as_mut() else {
            session = reconnect(socket);
            continue;
        };
        let prompt = rng.below(PROMPTS);
        let n = 1 + rng.below(LONGEST);
        let done = if rng.below(3) == 0 {
            current.try_store(prompt, n)
        } else {
            current.try_lookup(prompt, n, false).and_then(|(id, outcome)| {
                seen.hit(&outcome);
                let hit = u64::from(outcome.hit_chunks);
                current.try_retrieve(id, prompt, 0, hit).map(|checked| seen.read(Some(checked)))
            })
        };
        match done {
            Ok(()) => seen.operation(),
            // A daemon stopping cleanly refuses what comes after the signal; nothing else in
            // this test should make it refuse.
            Err(e) if e.code().is_some_and(|code| code != ErrorCode::Stopped) => {
                panic!("the daemon refused a call: {e}")
            }
            // The connection is gone with the daemon.
            Err(_) => {
                session = None;
                seen.reconnected.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    if let Some(session) = session {
        session.client.end().unwrap();
    }
}

/// A new session once the daemon answers again; `None` while it does not, for 30 s at most.
fn reconnect(socket: &Path) -> Option<Session> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match Session::connect(socket, plain_hello(), 0, STRICT) {
            Ok(session) => return Some(session),
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("the daemon did not come back within 30 s: {e}"),
        }
    }
}

/// Looks up every prompt whole on `daemon` and reads back the hit, checking every byte: what
/// the tiers hold after a run is still each chunk's own bytes. Returns the chunks read, and
/// checks that the daemon never panicked.
fn read_back(daemon: &Daemon, mode: Mode) -> u64 {
    let mut reader = Session::open(daemon, plain_hello(), 0, mode);
    let mut read = 0;
    for prompt in 0..PROMPTS {
        let (id, outcome) = reader.lookup(prompt, LONGEST, false);
        read += reader.retrieve(id, prompt, 0, u64::from(outcome.hit_chunks)).unwrap_or(0);
    }
    reader.client.end().unwrap();
    let log = daemon.log();
    assert!(!log.contains("panicked"), "the daemon panicked:\n{log}");
    read
}

/// A daemon of `small_config` (L2 and disk segments of 64 chunks unless `config` changes
/// them), with the admin token and no fsync. `TIERKV_SOAK_L1_DEVICE` names the L1 device
/// instead of the emulated one (`cuda` on a GPU machine: `scripts/gpu-all.sh`).
fn daemon(config: impl FnOnce(String) -> String) -> Daemon {
    let device = std::env::var("TIERKV_SOAK_L1_DEVICE").unwrap_or_else(|_| "emulated".into());
    Daemon::start_with(|dir| {
        config(small_config(dir, None, ""))
            .replace("[server]\n", &format!("[server]\ntoken = \"{TOKEN}\"\n"))
            .replace("fsync = \"always\"", "fsync = \"never\"")
            .replace("device = \"emulated\"", &format!("device = \"{device}\""))
    })
}

#[test]
fn many_sessions_through_the_cascade_are_served_exact_bytes_and_hold_nothing_once_gone() {
    served_from_below(&soak(&daemon(|config| config), STRICT));
}

#[test]
fn many_sessions_over_a_sharded_l1_are_served_exact_bytes_and_hold_nothing_once_gone() {
    // Eight index shards, each with its policy, judged together as one (`PolicyGroup`).
    let sharded = |config: String| config.replace("[l1]\n", "[l1]\nshards = 8\n");
    served_from_below(&soak(&daemon(sharded), STRICT));
}

#[test]
fn many_sessions_without_an_l2_are_served_exact_bytes_and_hold_nothing_once_gone() {
    // L1's victims go straight to a disk that frees one chunk at a time (the default segment).
    let no_l2 = |config: String| {
        config.replace("[l2]\n", "[l2]\nenabled = false\n").replace("segment = \"4MiB\"\n", "")
    };
    served_from_below(&soak(&daemon(no_l2), STRICT));
}

#[test]
fn many_sessions_writing_through_are_served_exact_bytes_and_hold_nothing_once_gone() {
    served_from_below(&soak(&daemon(store_policy("write_through")), STRICT));
}

#[test]
fn many_sessions_writing_back_are_served_exact_bytes_and_hold_nothing_once_gone() {
    // L1 writes its coldest chunks back in batches of its own leases above its watermark, at
    // its maintenance ticks, and what a store evicts in between goes down too: the lower tiers
    // serve hits at any pace (in a release build, before, none).
    served_from_below(&soak(&daemon(store_policy("write_back")), STRICT));
}

#[test]
fn many_sessions_writing_back_without_an_l2_are_served_exact_bytes_and_hold_nothing_once_gone() {
    // What L1 writes back, and what a store evicts in between, goes straight to the disk, which
    // serves it from its copy in memory until it is written (the departure board).
    let write_back_to_disk = |config: String| {
        store_policy("write_back")(config)
            .replace("[l2]\n", "[l2]\nenabled = false\n")
            .replace("segment = \"4MiB\"\n", "")
    };
    served_from_below(&soak(&daemon(write_back_to_disk), STRICT));
}

#[test]
fn many_sessions_under_disk_admission_are_served_exact_bytes_and_hold_nothing_once_gone() {
    // L2 takes every store; the disk what was read often enough.
    served_from_below(&soak(&daemon(store_policy("disk_admission")), STRICT));
}

/// Checks that some hits came from below L1: the run used the tiers.
fn served_from_below(seen: &Seen) {
    let (hits, below) =
        (seen.hit_chunks.load(Ordering::Relaxed), seen.below_l1_chunks.load(Ordering::Relaxed));
    assert!(below > 0, "no hit came from below L1 ({hits} hit chunks): the tiers were not used");
}

/// A config change: the daemon's `storage.store_policy`.
fn store_policy(policy: &'static str) -> impl FnOnce(String) -> String {
    move |config| format!("{config}\n[storage]\nstore_policy = \"{policy}\"\n")
}

#[test]
fn many_sessions_whose_leases_expire_are_refused_never_served_wrong_bytes() {
    let short = |config: String| config.replace("lease_ttl = \"30s\"", "lease_ttl = \"100ms\"");
    let seen = soak(&daemon(short), EXPIRING);
    served_from_below(&seen);
    let refused = seen.reads_refused.load(Ordering::Relaxed);
    assert!(refused > 0, "no lookup expired: the test tests nothing");
}

#[test]
fn sessions_across_a_crash_connect_again_and_are_never_served_wrong_bytes() {
    across_a_restart(|daemon| daemon.kill());
}

#[test]
fn sessions_across_a_clean_stop_connect_again_and_are_never_served_wrong_bytes() {
    across_a_restart(|daemon| {
        assert!(daemon.stop().success(), "SIGTERM must end the daemon with 0")
    });
}

/// Three sessions store and read while the daemon goes down under them (`down`) and comes back
/// on the same directory: each connects again, nothing wrong is ever served, nothing is held
/// once they are gone, and what the daemon kept reads back exact.
fn across_a_restart(down: impl FnOnce(&mut Daemon)) {
    let mut daemon = daemon(|config| config);
    let socket = daemon.socket.clone();
    let (stop, seen) = (AtomicBool::new(false), Seen::default());
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..3u64)
            .map(|i| {
                let (socket, stop, seen) = (&socket, &stop, &seen);
                scope.spawn(move || crash_worker(socket, 0x5DEE_CE66 ^ (i + 1), stop, seen))
            })
            .collect();
        // Work, the daemon down under the sessions' feet (a crash flushes nothing and leaves
        // the socket file behind), the same daemon back on its directory, work again.
        let worked = seen.until_operations(RESTART_AFTER) && {
            down(&mut daemon);
            daemon.restart();
            let back = seen.operations.load(Ordering::Relaxed);
            seen.until_operations(back + RESTART_AFTER)
        };
        stop.store(true, Ordering::Relaxed);
        let failed = workers.into_iter().map(|worker| worker.join()).filter(Result::is_err).count();
        assert_eq!(failed, 0, "a session's thread failed (its panic is above)");
        assert!(worked, "the sessions stalled");
    });
    let reconnected = seen.reconnected.load(Ordering::Relaxed);
    assert!(reconnected > 0, "no session saw the daemon go: the test tests nothing");
    daemon.eventually("nothing held once every session is gone", |s| {
        s.l1_leased_chunks == 0 && s.open_lookups == 0 && s.connected_workers == 0
    });
    // What the restarted daemon recovered from its disk, and what came after, reads back exact.
    read_back(&daemon, STRICT);
    eprintln!(
        "restart: {} verified, {reconnected} sessions connected again",
        seen.verified_chunks.load(Ordering::Relaxed)
    );
}

/// Runs four plain sessions, an MLA group of two and a clearing admin at once on `daemon`,
/// then checks that nothing is held and that what is left reads back exact.
fn soak(daemon: &Daemon, mode: Mode) -> Seen {
    let seen = Seen::default();
    let done = AtomicBool::new(false);
    let clears = std::thread::scope(|scope| {
        let clearing = scope.spawn(|| admin(daemon, &done, &seen));
        let workers: Vec<_> = (0..4u64)
            .map(|i| {
                let seen = &seen;
                scope.spawn(move || {
                    plain_worker(daemon, 0x9E37_79B9_7F4A_7C15 ^ (i + 1), seen, mode)
                })
            })
            .chain(std::iter::once(scope.spawn(|| mla_group(daemon, 0x2545_F491, &seen, mode))))
            .collect();
        let failed = workers.into_iter().map(|worker| worker.join()).filter(Result::is_err).count();
        // Told even when a session failed, so that the test ends with its failure.
        done.store(true, Ordering::Relaxed);
        let clears = clearing.join().expect("the admin's thread failed");
        assert_eq!(failed, 0, "a session's thread failed (its panic is above)");
        clears
    });

    // Every session is gone: whatever they held, they returned or the daemon took back.
    let after = daemon.eventually("nothing held once every session is gone", |s| {
        s.l1_leased_chunks == 0
            && s.open_lookups == 0
            && s.store_in_flight == 0
            && s.connected_workers == 0
    });
    for tier in &after.tiers {
        assert!(
            tier.used_bytes <= tier.capacity_bytes,
            "{} over its capacity: {tier:?}",
            tier.name
        );
    }
    let hits = seen.hit_chunks.load(Ordering::Relaxed);
    let below = seen.below_l1_chunks.load(Ordering::Relaxed);
    let verified = seen.verified_chunks.load(Ordering::Relaxed);
    let abandoned = seen.abandoned.load(Ordering::Relaxed);
    assert!(clears > 0 && abandoned > 0, "clears {clears}, sessions abandoned {abandoned}");
    assert!(verified > 0);

    // What is left in the tiers is still every chunk's own bytes, wherever it lies.
    let left = read_back(daemon, STRICT);
    daemon.eventually("the last reader's shares returned", |s| {
        s.l1_leased_chunks == 0 && s.open_lookups == 0
    });
    eprintln!(
        "soak: {hits} hit chunks ({below} below L1), {verified} verified, {} reads and {} \
         lookups refused, {abandoned} sessions abandoned, {clears} clears, {left} chunks left \
         and verified",
        seen.reads_refused.load(Ordering::Relaxed),
        seen.lookups_refused.load(Ordering::Relaxed)
    );
    seen
}

#[test]
fn two_nodes_sharing_a_remote_tier_that_hangs_are_never_served_wrong_bytes() {
    require_redis!();
    let cluster = RedisCluster::start();
    let prefix = format!("soak-{}", std::process::id());
    let nodes = [remote_node(&cluster, &prefix), remote_node(&cluster, &prefix)];
    let seen = Seen::default();
    std::thread::scope(|scope| {
        // Two sessions on each node, over the same prompts: one node's stores are the other's
        // hits through the cluster.
        let workers: Vec<_> = (0..4u64)
            .map(|i| {
                let (node, seen) = (&nodes[(i % 2) as usize], &seen);
                scope.spawn(move || plain_worker(node, 0xC0FF_EE00 ^ (i + 1), seen, FAILING_TIER))
            })
            .collect();
        // A quarter of the way in, a master hangs for a while (it takes connections and never
        // answers), then goes on.
        let hung = &cluster.nodes[cluster.masters()[0]];
        let paused = seen.until_operations(OPERATIONS as u64);
        if paused {
            hung.pause();
            // Felt by whichever node next sends the master a command: under a loaded machine
            // that may take a while for one node, so either will do, within 30 s.
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while !nodes.iter().any(|node| node.status().tiers[3].degraded.is_some()) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the hung master never degraded either node's remote tier"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            std::thread::sleep(Duration::from_millis(500));
            hung.resume();
        }
        let failed = workers.into_iter().map(|worker| worker.join()).filter(Result::is_err).count();
        assert_eq!(failed, 0, "a session's thread failed (its panic is above)");
        assert!(paused, "the sessions stalled before the master was paused");
    });
    for node in &nodes {
        node.eventually("nothing held once every session is gone", |s| {
            s.l1_leased_chunks == 0
                && s.open_lookups == 0
                && s.store_in_flight == 0
                && s.connected_workers == 0
        });
    }
    let remote = seen.remote_chunks.load(Ordering::Relaxed);
    assert!(remote > 0, "no hit came through the remote tier: the test tests nothing");
    // What either node reads now, from wherever it lies, is exact.
    for node in &nodes {
        read_back(node, FAILING_TIER);
    }
    eprintln!(
        "remote: {remote} hit chunks from the remote tier, {} verified, {} reads refused",
        seen.verified_chunks.load(Ordering::Relaxed),
        seen.reads_refused.load(Ordering::Relaxed)
    );
}

/// A node of `small_config` whose remote tier is `cluster`, under `prefix`, with the short
/// timeouts of a test.
fn remote_node(cluster: &RedisCluster, prefix: &str) -> Daemon {
    let remote = remote_section(&cluster.urls(), prefix);
    daemon(|config| format!("{config}{remote}"))
}
