//! Sessions: what one connection may do, and everything it holds.
//!
//! Request handling is plain synchronous code over the StorageManager, so it is the same
//! whichever transport carried the frame. Every lease and write reservation a session makes is
//! owned by its `OwnerId`; [`Session::close`] returns all of them, and the shares the session
//! took on lookups other ranks of its TP group made. A request that fails changes nothing.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tierkv_core::{ChunkHash, ExtraCount, KeyError, KvRank, Layout, Namespace, ObjectKey};
use tierkv_l1::{L1Error, OwnerId, Readers, WriteAccess};
use tierkv_prefetch::{BelowError, PrefetchError};
use tierkv_proto::{
    ChunkBlocks, ChunkId, ErrorCode, Hello, KvLayout, LookupOutcome, MAX_NAMESPACES,
    PROTOCOL_VERSION, RefusalReason, Refused, RegionSource, ReplyBody, RequestBody, Role,
    SessionReport, StatusReport, TierReport,
};
use tierkv_storage::{HitChunk, LookupId, LookupResult, StorageError, StorageManager, StoreTicket};

use crate::conn::Peer;
use crate::kv::{DeviceCopies, HostMaps, KvError, RegisteredKv};
use crate::metrics::ServerMetrics;

/// Buffers one session may register.
const MAX_BUFFERS: usize = 64;
/// Open lookups one session may have at once: each is kept until its deadline, a miss too, so
/// a client that never returns them would otherwise grow the daemon's records without bound.
const MAX_OPEN_LOOKUPS: usize = 4096;
/// The longest wait a client may ask for; longer asks wait this long.
const MAX_WAIT: Duration = Duration::from_secs(60);
/// The longest a store waits for its worker's `ready_event`, unless the client gives up first:
/// past it the kernels writing the blocks are taken as never finishing, and the store is refused.
/// Longer than any forward pass, shorter than a hang.
const READY_EVENT_WAIT: Duration = Duration::from_secs(30);
/// Lookups remembered after their last reader returned its share, the daemon's newest: so that
/// a late retrieve by a reader in another session than the owner's is answered `share_returned`,
/// not `unknown_lookup`.
const ENDED_LOOKUPS: usize = 4096;
/// A session's own lookups remembered after their last reader returned its share, until it
/// releases them or closes: so that its late `release` is answered `released` and its late
/// retrieve `share_returned`, however many lookups the rest of the daemon ended meanwhile. An
/// engine releases each of its lookups when its request finishes, so no more than its requests
/// in flight wait here; past this many, the session's oldest are forgotten.
const ENDED_PER_SESSION: usize = MAX_OPEN_LOOKUPS;
/// The error message of a lookup, store or retrieve the client gave up on before the daemon
/// carried it out (the client has shut its writing side or closed the connection).
const GAVE_UP: &str = "the client gave up on this request before the daemon carried it out; \
                       nothing of it was done";
/// The tiers a lookup outcome's `per_tier` always names, in order.
const TIER_NAMES: [&str; 4] = ["l1", "l2", "disk", "remote"];

/// A refused request: the error reply.
#[derive(Debug)]
pub struct Fail {
    /// What kind of failure.
    pub code: ErrorCode,
    /// What happened.
    pub message: String,
}

fn fail<T>(code: ErrorCode, message: impl Into<String>) -> Result<T, Fail> {
    Err(Fail { code, message: message.into() })
}

impl From<StorageError> for Fail {
    fn from(e: StorageError) -> Self {
        let code = match &e {
            StorageError::UnknownLookup(_)
            | StorageError::Expired(_)
            | StorageError::NotStarted(_) => ErrorCode::UnknownLookup,
            StorageError::NotCovered { .. } | StorageError::Below(BelowError::NotHeld) => {
                ErrorCode::NotInHit
            }
            StorageError::Below(BelowError::Timeout(_)) => ErrorCode::Timeout,
            StorageError::Stopped | StorageError::Prefetch(PrefetchError::Stopped) => {
                ErrorCode::Stopped
            }
            StorageError::Prefetch(PrefetchError::Timeout | PrefetchError::NoAnswer(_)) => {
                ErrorCode::Timeout
            }
            StorageError::Invalid(_) | StorageError::Prefetch(PrefetchError::Invalid(_)) => {
                ErrorCode::BadRequest
            }
            StorageError::L1(L1Error::AlreadyReleased { .. } | L1Error::LeaseReleased(_))
            | StorageError::ShareReturned { .. } => ErrorCode::ShareReturned,
            StorageError::NoSuchReader { .. } => ErrorCode::Forbidden,
            StorageError::Pending(_) => ErrorCode::Pending,
            StorageError::L1(L1Error::UnknownLease(_) | L1Error::LeaseExpired(_)) => {
                ErrorCode::UnknownLookup
            }
            StorageError::L1(L1Error::NoSuchReader { .. }) => ErrorCode::Forbidden,
            StorageError::L1(L1Error::LayoutTooLarge { .. } | L1Error::EmptyRelease(_)) => {
                ErrorCode::BadRequest
            }
            _ => ErrorCode::Internal,
        };
        Fail { code, message: e.to_string() }
    }
}

/// What the daemon remembers of a lookup, for the sessions that read it.
#[derive(Clone, Copy, Debug)]
struct LookupInfo {
    /// The session that made it (and owns its leases).
    owner: u64,
    namespace: Namespace,
    rank: KvRank,
    readers: u32,
    /// The owner's reader number: its share goes back with the owner's session.
    owner_reader: u16,
    /// Chunks it asked for: what its release has to return, at most.
    chunks: usize,
}

/// Lookups that ended (every reader returned its share).
#[derive(Default)]
struct Ended {
    /// The daemon's newest [`ENDED_LOOKUPS`], oldest forgotten first: for readers of other
    /// sessions than the owner's.
    lookups: HashMap<u64, LookupInfo>,
    order: VecDeque<u64>,
    /// Each open session's own that it has not released, [`ENDED_PER_SESSION`] at most (ids
    /// grow, so the first is the oldest): for the owner.
    by_owner: HashMap<u64, BTreeSet<u64>>,
}

impl Ended {
    /// Called with the registry locked, as the lookup leaves it: its owner's session is open
    /// ([`Session::close`] takes its lookups out of the registry and its entry out of here in
    /// one step), so no entry is made for a session gone.
    fn insert(&mut self, id: u64, info: LookupInfo) {
        if self.order.len() == ENDED_LOOKUPS
            && let Some(old) = self.order.pop_front()
        {
            self.lookups.remove(&old);
        }
        self.lookups.insert(id, info);
        self.order.push_back(id);
        let own = self.by_owner.entry(info.owner).or_default();
        own.insert(id);
        if own.len() > ENDED_PER_SESSION {
            own.pop_first();
        }
    }

    /// Whether `session` made `lookup` and it ended.
    fn owned_by(&self, session: u64, lookup: u64) -> bool {
        self.by_owner.get(&session).is_some_and(|own| own.contains(&lookup))
            || self.lookups.get(&lookup).is_some_and(|info| info.owner == session)
    }
}

/// Daemon-wide state every session reaches.
pub struct Daemon {
    storage: StorageManager,
    token: Option<String>,
    max_chunk_bytes: u64,
    /// Bytes of leases one session's open lookups may hold (`server.max_leased_per_session`).
    max_leased_per_session: u64,
    /// Where each lookup outcome's tier counts go in `[l1, l2, disk, remote]`.
    tier_slots: Vec<usize>,
    lookups: Mutex<HashMap<u64, LookupInfo>>,
    ended: Mutex<Ended>,
    sessions: Mutex<HashMap<u64, SessionReport>>,
    /// Chunk sizes already warned of as wasting most of a slot (once each).
    warned_chunk_sizes: Mutex<HashSet<u64>>,
    next_session: AtomicU64,
    started: Instant,
    metrics: ServerMetrics,
    /// Workers' memfds mapped, each once for every registration of it on any session.
    host_maps: HostMaps,
}

impl Daemon {
    /// Wraps a started StorageManager. `token` is what TCP clients, and admins that `clear`,
    /// must present; one session's
    /// open lookups may hold `max_leased_per_session` bytes of leases (`None`: a quarter of L1).
    pub fn new(
        storage: StorageManager,
        token: Option<String>,
        max_leased_per_session: Option<u64>,
    ) -> Self {
        let usage = storage.l1().usage();
        let max_chunk_bytes = usage.slot_bytes;
        let max_leased_per_session = max_leased_per_session.unwrap_or(usage.capacity_bytes / 4);
        let mut tier_slots = vec![0];
        for (i, (name, _)) in storage.status().tiers.iter().enumerate() {
            let slot = TIER_NAMES.iter().position(|n| n == name).unwrap_or(1 + i);
            tier_slots.push(slot.min(TIER_NAMES.len() - 1));
        }
        Daemon {
            storage,
            token,
            max_chunk_bytes,
            max_leased_per_session,
            tier_slots,
            lookups: Mutex::new(HashMap::new()),
            ended: Mutex::new(Ended::default()),
            sessions: Mutex::new(HashMap::new()),
            warned_chunk_sizes: Mutex::new(HashSet::new()),
            next_session: AtomicU64::new(1),
            started: Instant::now(),
            metrics: ServerMetrics::register(),
            host_maps: HostMaps::default(),
        }
    }

    /// Bytes of an L1 slot: what a chunk of any size takes of L1, and the largest chunk.
    fn slot_bytes(&self) -> u64 {
        self.max_chunk_bytes.max(1)
    }

    /// Chunks open lookup `lookup` asked for (0 for one not open): what its release returns,
    /// at most.
    pub fn lookup_chunks(&self, lookup: u64) -> usize {
        self.lookups.lock().get(&lookup).map_or(0, |info| info.chunks)
    }

    /// The storage below.
    pub fn storage(&self) -> &StorageManager {
        &self.storage
    }

    /// The server's own metrics.
    pub fn metrics(&self) -> &ServerMetrics {
        &self.metrics
    }

    /// The daemon's status, as `tierkv status` shows it.
    pub fn status(&self) -> StatusReport {
        let status = self.storage.status();
        let totals = &status.lookups;
        let hits = |t: usize| totals.hit_chunks.get(t).copied().unwrap_or(0);
        let l1 = &status.l1;
        let mut tiers = vec![TierReport {
            name: "l1".into(),
            // Every state, as below L1 and as `tierkv_tier_used_bytes` counts: L1's own usage
            // keeps its cached bytes apart.
            used_bytes: l1.used_bytes + l1.cached_bytes,
            cached_bytes: l1.cached_bytes,
            capacity_bytes: l1.capacity_bytes,
            objects: l1.writing + l1.leased + l1.cached,
            hit_chunks: hits(0),
            read_only: None,
            degraded: None,
        }];
        for (i, (name, usage)) in status.tiers.iter().enumerate() {
            tiers.push(TierReport {
                name: name.clone(),
                used_bytes: usage.used_bytes,
                cached_bytes: usage.used_bytes,
                capacity_bytes: usage.capacity_bytes,
                objects: usage.objects,
                hit_chunks: hits(i + 1),
                read_only: if name == "disk" { status.disk_read_only.clone() } else { None },
                degraded: if name == "remote" { status.remote_degraded.clone() } else { None },
            });
        }
        let hit_chunks: u64 = totals.hit_chunks.iter().sum();
        let sessions: Vec<SessionReport> = {
            let open = self.open_lookups_by_session();
            let mut all: Vec<SessionReport> = self
                .sessions
                .lock()
                .values()
                .map(|s| SessionReport {
                    open_lookups: open.get(&s.session).copied().unwrap_or(0),
                    ..s.clone()
                })
                .collect();
            all.sort_by_key(|s| s.session);
            all
        };
        StatusReport {
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            tiers,
            l1_leased_chunks: l1.leased,
            lookups: totals.lookups,
            requested_chunks: totals.requested_chunks,
            hit_chunks,
            hit_ratio: if totals.requested_chunks == 0 {
                0.0
            } else {
                hit_chunks as f64 / totals.requested_chunks as f64
            },
            requested_tokens: totals.requested_tokens,
            hit_tokens: totals.hit_tokens.iter().sum(),
            open_lookups: status.open_lookups as u64,
            store_in_flight: status.store_in_flight,
            connected_workers: sessions.iter().filter(|s| s.role == Role::Worker).count() as u32,
            sessions,
        }
    }

    fn open_lookups_by_session(&self) -> HashMap<u64, u64> {
        let mut open = HashMap::new();
        for info in self.lookups.lock().values() {
            *open.entry(info.owner).or_default() += 1;
        }
        open
    }
}

#[cfg(test)]
impl Daemon {
    /// A daemon over an emulated L1 of 16 slots of `slot` bytes and no tier below, for tests.
    pub(crate) fn small(slot: u64) -> Arc<Self> {
        use tierkv_l1::{DeviceKind, L1Config};
        let l1 = L1Config { device: DeviceKind::Emulated, ..L1Config::new(16 * slot, slot) };
        let storage = StorageManager::start(tierkv_storage::StorageConfig::new(l1));
        Arc::new(Daemon::new(storage.unwrap_or_else(|e| panic!("{e}")), None, None))
    }
}

/// What the session knows once the hello is accepted.
struct Opened {
    hello: Hello,
    namespaces: Vec<Namespace>,
    rank: KvRank,
    extra: ExtraCount,
    layout: Layout,
    buffers: Vec<RegisteredKv>,
    /// Shares this session may hold on lookups another session made: returned at close.
    joined: HashSet<(u64, u8)>,
    /// The size of `joined` at which the lookups that ended are next forgotten.
    prune_joined_at: usize,
    /// Lookups this session made that may still be open: what its allowance is counted over,
    /// rather than the whole daemon's registry at every lookup.
    made: HashSet<u64>,
    /// The hello carried the daemon's token (always so over TCP): what `clear` needs.
    authenticated: bool,
    /// This session's stores since its last flush that are still going down, and what became
    /// of those already settled (folded in at every store, so a session that never flushes
    /// keeps no more than what is in flight).
    tickets: Vec<Arc<StoreTicket>>,
    settled: (u32, u32),
}

impl Opened {
    /// This session's reader number on a lookup of `rank`'s KV: its TP rank where the ranks
    /// share one copy (MLA), else 0, the one reader of a rank's own KV.
    fn reader_of(&self, rank: KvRank) -> u16 {
        if rank == KvRank::Shared { self.hello.rank } else { 0 }
    }
}

/// How the connection reached the daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// The Unix socket: descriptors can be passed; a token is needed only for `clear`.
    Unix,
    /// TCP: the hello must carry the token.
    Tcp,
}

/// The answer to one request.
pub struct Answer {
    /// The reply to send.
    pub reply: ReplyBody,
    /// Close the connection after sending it.
    pub close: bool,
}

/// One connection's state.
pub struct Session {
    daemon: Arc<Daemon>,
    id: u64,
    transport: Transport,
    opened: Option<Opened>,
    closed: bool,
}

impl Session {
    /// A new connection, not yet introduced.
    pub fn new(daemon: Arc<Daemon>, transport: Transport) -> Self {
        let id = daemon.next_session.fetch_add(1, Ordering::Relaxed);
        Session { daemon, id, transport, opened: None, closed: false }
    }

    fn owner(&self) -> OwnerId {
        OwnerId(self.id)
    }

    /// Handles one request. `descriptor` yields a file descriptor that arrived with the frame;
    /// `peer` says whether the client gave up on the request meanwhile.
    pub fn handle(
        &mut self,
        body: RequestBody,
        descriptor: &mut dyn FnMut() -> Option<OwnedFd>,
        peer: Peer,
    ) -> Answer {
        let op = op_name(&body);
        let started = Instant::now();
        let result = self.dispatch(body, descriptor, peer);
        self.daemon.metrics.request(op, started.elapsed());
        match result {
            Ok(reply) => {
                let close = matches!(reply, ReplyBody::Bye);
                Answer { reply, close }
            }
            Err(Fail { code, message }) => {
                self.daemon.metrics.error(code);
                // A client that cannot even open a session, or opens a second one on the same
                // connection, is not speaking the protocol: the connection closes.
                let close = (self.opened.is_none() && code != ErrorCode::BadRequest)
                    || (op == "hello" && code == ErrorCode::NoSession);
                Answer { reply: ReplyBody::Error { code, message }, close }
            }
        }
    }

    fn dispatch(
        &mut self,
        body: RequestBody,
        descriptor: &mut dyn FnMut() -> Option<OwnedFd>,
        peer: Peer,
    ) -> Result<ReplyBody, Fail> {
        if let RequestBody::Hello(hello) = body {
            return self.hello(hello);
        }
        let Some(opened) = &self.opened else {
            return fail(ErrorCode::NoSession, "the first request of a session must be hello");
        };
        let admin = opened.hello.role == Role::Admin;
        match body {
            RequestBody::Hello(_) => unreachable_hello(),
            RequestBody::Status => Ok(ReplyBody::Status(self.daemon.status())),
            RequestBody::EndSession => {
                self.close();
                Ok(ReplyBody::Bye)
            }
            RequestBody::Clear if admin && opened.authenticated => Ok(self.clear()),
            RequestBody::Clear if admin => fail(
                ErrorCode::Forbidden,
                if self.daemon.token.is_some() {
                    "clear needs the daemon's token (server.token) in the admin hello"
                } else {
                    "clear needs the daemon's token in the admin hello, and this daemon has \
                     none: set server.token"
                },
            ),
            RequestBody::Clear => fail(ErrorCode::Forbidden, "clear is for admin sessions"),
            _ if admin => {
                fail(ErrorCode::Forbidden, "admin sessions may only ask status and clear")
            }
            RequestBody::RegisterKv { regions, layout } => {
                self.register_kv(&regions, &layout, descriptor)
            }
            RequestBody::Store { namespace, buffer, chunks, ready_event } => {
                self.store(namespace, buffer, &chunks, ready_event.as_deref(), peer)
            }
            RequestBody::Lookup { namespace, chunks, defer_prefetch } => {
                self.lookup(namespace, &chunks, defer_prefetch, peer)
            }
            RequestBody::Query { lookup } => {
                let id = self.visible_lookup(lookup)?.0;
                Ok(match self.daemon.storage.query(id)? {
                    Some(result) => ReplyBody::Done(self.daemon.outcome(&result)),
                    None => ReplyBody::Pending,
                })
            }
            RequestBody::Wait { lookup, timeout_ms } => {
                let id = self.visible_lookup(lookup)?.0;
                let timeout = Duration::from_millis(timeout_ms).min(MAX_WAIT);
                Ok(ReplyBody::Done(self.daemon.outcome(&self.daemon.storage.wait(id, timeout)?)))
            }
            RequestBody::Retrieve { lookup, buffer, chunks, done_event } => {
                self.retrieve(lookup, buffer, &chunks, done_event.as_deref(), peer)
            }
            RequestBody::Release { lookup } => self.release(lookup),
            RequestBody::Flush { timeout_ms } => self.flush(Duration::from_millis(timeout_ms)),
        }
    }

    fn hello(&mut self, hello: Hello) -> Result<ReplyBody, Fail> {
        if self.opened.is_some() {
            return fail(ErrorCode::NoSession, "this session already said hello");
        }
        if hello.version != PROTOCOL_VERSION {
            return fail(
                ErrorCode::VersionMismatch,
                format!(
                    "protocol version {} is not this daemon's {PROTOCOL_VERSION} (version 2 \
                     registered KV memory with register_kv and named each chunk's blocks as a \
                     list; version 3 added flush, refusal reasons, per-tier hits of four tiers \
                     with the remote one, and a tier's degraded state; version 4 added a store's \
                     ready_event and a retrieve's done_event; version 5 sends a request's chunks \
                     flat, ids in one bin and blocks in another; version 6 added a lookup's \
                     defer_prefetch; update the client)",
                    hello.version
                ),
            );
        }
        // Over TCP every session needs the token. Over the Unix socket (whose mode decides who
        // may connect) a token is optional, but one that is given must be right: it is what
        // authorises `clear`.
        let authenticated = match (&hello.token, &self.daemon.token) {
            (Some(given), Some(token)) => {
                if !constant_time_eq(given.as_bytes(), token.as_bytes()) {
                    return fail(ErrorCode::Forbidden, "the hello's token is not the daemon's");
                }
                true
            }
            (Some(_), None) => {
                return fail(
                    ErrorCode::Forbidden,
                    "the hello carries a token, but this daemon has none (server.token)",
                );
            }
            (None, _) => false,
        };
        if self.transport == Transport::Tcp && !authenticated {
            return fail(ErrorCode::Forbidden, "a TCP session needs the daemon's token");
        }
        let worker = hello.role == Role::Worker;
        let bad = |why: String| fail(ErrorCode::BadRequest, why);
        if hello.tp_size == 0 || u32::from(hello.tp_size) > u32::from(ExtraCount::MAX) + 1 {
            return bad(format!("tp_size must be within 1..={}", u32::from(ExtraCount::MAX) + 1));
        }
        let world_size = hello.world_size.unwrap_or(hello.tp_size);
        if hello.rank >= hello.tp_size || world_size < hello.tp_size {
            return bad(format!(
                "rank {} of tp_size {} in world_size {world_size} is not a valid placement",
                hello.rank, hello.tp_size
            ));
        }
        if worker && (hello.namespaces.is_empty() || hello.namespaces.len() > MAX_NAMESPACES) {
            return bad(format!("a worker declares 1..={MAX_NAMESPACES} namespaces"));
        }
        if worker && (hello.chunk_bytes == 0 || hello.chunk_bytes > self.daemon.max_chunk_bytes) {
            return bad(format!(
                "chunk_bytes must be within 1..={} (the daemon's slot size), got {}",
                self.daemon.max_chunk_bytes, hello.chunk_bytes
            ));
        }
        if hello.chunk_tokens == 0 {
            return bad("chunk_tokens must be positive".into());
        }
        if worker && let Some(warning) = slot_waste(hello.chunk_bytes, self.daemon.max_chunk_bytes)
        {
            // Once per chunk size, and for a few sizes only: clients choose the sizes, and a
            // set that grew with every one of them would be theirs to fill.
            let mut warned = self.daemon.warned_chunk_sizes.lock();
            if warned.len() < MAX_WARNED_CHUNK_SIZES && warned.insert(hello.chunk_bytes) {
                tracing::warn!("{warning}");
            }
        }
        let extra = if hello.mla { i64::from(hello.tp_size) - 1 } else { 0 };
        let extra = ExtraCount::new(extra)
            .map_err(|e| Fail { code: ErrorCode::BadRequest, message: e.to_string() })?;
        let rank = if hello.mla {
            KvRank::Shared
        } else {
            KvRank::Rank { rank: hello.rank, world: hello.tp_size }
        };
        let layout = Layout::bytes(hello.chunk_bytes.max(1))
            .map_err(|e| Fail { code: ErrorCode::BadRequest, message: e.to_string() })?;
        let namespaces =
            hello.namespaces.iter().map(|n| Namespace::new(&n.model, &n.cache_salt)).collect();
        let report = SessionReport {
            session: self.id,
            role: hello.role,
            rank: hello.rank,
            tp_size: hello.tp_size,
            open_lookups: 0,
            joined_lookups: 0,
        };
        self.daemon.sessions.lock().insert(self.id, report);
        if worker {
            self.daemon.metrics.worker_connected(1.0);
        }
        let reply = ReplyBody::Welcome {
            version: PROTOCOL_VERSION,
            session: self.id,
            max_chunk_bytes: self.daemon.max_chunk_bytes,
            readers: extra.readers(),
        };
        self.opened = Some(Opened {
            hello,
            namespaces,
            rank,
            extra,
            layout,
            buffers: Vec::new(),
            joined: HashSet::new(),
            prune_joined_at: MAX_OPEN_LOOKUPS,
            made: HashSet::new(),
            authenticated,
            tickets: Vec::new(),
            settled: (0, 0),
        });
        Ok(reply)
    }

    /// Whether the client said hello (and was let in).
    pub fn said_hello(&self) -> bool {
        self.opened.is_some()
    }

    fn opened(&self) -> &Opened {
        match &self.opened {
            Some(opened) => opened,
            None => unreachable_hello(),
        }
    }

    fn namespace(&self, index: u32) -> Result<Namespace, Fail> {
        let declared = &self.opened().namespaces;
        match declared.get(index as usize) {
            Some(ns) => Ok(*ns),
            None => fail(
                ErrorCode::NamespaceNotDeclared,
                format!(
                    "namespace {index} was not declared (the hello declared {})",
                    declared.len()
                ),
            ),
        }
    }

    fn buffer(&self, index: u32, chunks: &[ChunkBlocks]) -> Result<&RegisteredKv, Fail> {
        let Some(buffer) = self.opened().buffers.get(index as usize) else {
            return fail(ErrorCode::BadBuffer, format!("buffer {index} is not registered"));
        };
        for (i, c) in chunks.iter().enumerate() {
            if let Err(e) = buffer.check(&c.blocks) {
                return fail(
                    ErrorCode::BlockOutOfRange,
                    format!("chunk {i} of buffer {index}: {e}"),
                );
            }
        }
        Ok(buffer)
    }

    fn key(&self, namespace: Namespace, rank: KvRank, chunk: ChunkId) -> ObjectKey {
        ObjectKey::new(namespace, ChunkHash(chunk.0), rank)
    }

    fn register_kv(
        &mut self,
        regions: &[RegionSource],
        layout: &KvLayout,
        descriptor: &mut dyn FnMut() -> Option<OwnedFd>,
    ) -> Result<ReplyBody, Fail> {
        // The descriptors are taken first, whatever happens next, so a refused registration
        // leaves none queued for the next one to pick up by mistake.
        let fds = RegisteredKv::take_descriptors(regions, descriptor);
        if self.transport == Transport::Tcp {
            // A memfd's descriptor cannot cross TCP, and a CUDA IPC handle names memory only a
            // process on this node can map: a worker registers over the Unix socket, whose
            // permissions say who may.
            return Err(Fail {
                code: ErrorCode::BadBuffer,
                message: "KV buffers are registered over the Unix socket only; a TCP session may \
                          look up, release and read status"
                    .into(),
            });
        }
        let opened = self.opened();
        let mapped = if opened.buffers.len() >= MAX_BUFFERS {
            Err(KvError::Shape(format!("at most {MAX_BUFFERS} buffers per session")))
        } else {
            RegisteredKv::map(
                regions,
                fds,
                layout,
                opened.hello.chunk_bytes,
                &self.daemon.host_maps,
                &opened.buffers,
            )
        };
        let buffer =
            mapped.map_err(|e| Fail { code: ErrorCode::BadBuffer, message: e.to_string() })?;
        let Some(opened) = &mut self.opened else { unreachable_hello() };
        opened.buffers.push(buffer);
        Ok(ReplyBody::BufferRegistered { buffer: (opened.buffers.len() - 1) as u32 })
    }

    /// Stores a chain of chunks, root first, after the worker's `ready_event` if it sent one.
    /// With lower tiers, a store larger than a window
    /// (`StorageManager::store_window`) goes in windows, the last first: each window is made
    /// visible before the next is reserved, so L1 can pass it down (cascade) or copy it down and
    /// free it (write-through) while the rest arrives, and the chain becomes visible leaf first
    /// as a one-window store does. A window that finds no room ends the store: the windows
    /// before it are refused (stored later, by the next request of the chain). The windows
    /// share one deadline for room (`storage.store_backpressure` from when the first is
    /// reserved), so a store waits that long at most however many windows it has: a client
    /// whose deadline is longer (the vLLM connector's `timeout_s`) gets its answer in time.
    /// The client giving up ends the store too, before a window, during its wait for room or
    /// after its copies: the windows finished before stay (their copies were over while the
    /// client still held the blocks), nothing more is made visible, and the `timeout` reply
    /// says how much stayed.
    fn store(
        &mut self,
        namespace: u32,
        buffer: u32,
        chunks: &[ChunkBlocks],
        ready_event: Option<&[u8]>,
        peer: Peer,
    ) -> Result<ReplyBody, Fail> {
        let ns = self.namespace(namespace)?;
        let source = self.buffer(buffer, chunks)?;
        if let Some(handle) = ready_event {
            // Before any copy is enqueued, and on the host: a copy stream waiting on the GPU
            // for an event that never completes could never be waited for, nor its slots freed.
            let completed = source
                .await_event(handle, Instant::now() + READY_EVENT_WAIT, || peer.gave_up())
                .map_err(|e| Fail {
                    code: ErrorCode::BadBuffer,
                    message: format!("ready_event: {e}"),
                })?;
            if !completed {
                if peer.gave_up() {
                    return Err(self.gave_up("store", chunks.len()));
                }
                return Err(Fail {
                    code: ErrorCode::Timeout,
                    message: format!(
                        "ready_event: the worker's event did not complete within {READY_EVENT_WAIT:?} \
                         (its kernels never finished?); nothing was stored"
                    ),
                });
            }
        }
        let opened = self.opened();
        let keys: Vec<ObjectKey> =
            chunks.iter().map(|c| self.key(ns, opened.rank, c.chunk)).collect();
        let window = self.daemon.storage.store_window().max(1);
        let deadline = self.daemon.storage.store_deadline();
        let mut total = StoredPart::default();
        let mut tickets = Vec::new();
        // The last window first: each window's chunks become visible leaf first, so the whole
        // chain does, as in a store of one window, and every tier's recency order then loses a
        // chain's tail before its root.
        let starts: Vec<usize> = (0..chunks.len()).step_by(window).collect();
        // A window that fails ends the request with its error, but the windows before it are
        // stored: their tickets are still kept, so the session's durability report counts them.
        let (mut failed, mut gave_up) = (None, false);
        for start in starts.into_iter().rev() {
            if peer.gave_up() {
                // Nothing more is reserved, copied or waited for.
                gave_up = true;
                break;
            }
            let end = (start + window).min(chunks.len());
            let part = match self.store_part(
                source,
                &chunks[start..end],
                &keys[start..end],
                start,
                peer,
                deadline,
            ) {
                Ok(part) => part,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
            total.stored += part.stored;
            total.present += part.present;
            total.bytes += part.bytes;
            total.refused.extend(part.refused);
            tickets.extend(part.ticket);
            if part.gave_up {
                gave_up = true;
                break;
            }
            if part.out_of_room {
                total.refused.extend((0..start).map(|i| refusal(i, KeyError::OutOfMemory)));
                break;
            }
        }
        total.refused.sort_by_key(|r| r.index);
        if let Some(opened) = &mut self.opened {
            opened.tickets.extend(tickets);
            let settled = &mut opened.settled;
            opened.tickets.retain(|t| match t.outcome() {
                Some(d) => {
                    settled.0 = settled.0.saturating_add(d.durable);
                    settled.1 = settled.1.saturating_add(d.not_durable);
                    false
                }
                None => true,
            });
        }
        self.daemon.metrics.data_bytes("store", total.bytes);
        if gave_up {
            return Err(self.gave_up_after("store", chunks.len(), total.stored));
        }
        if let Some(e) = failed {
            return Err(e);
        }
        Ok(ReplyBody::Stored {
            stored: total.stored,
            present: total.present,
            refused: total.refused,
        })
    }

    /// Stores one window of a request: `chunks` with their `keys`, the first at request index
    /// `offset`. Reserves (waiting for room until the request's `deadline` at most), copies in,
    /// and makes visible what was copied whole, unless the client gave up on the request before
    /// the copies were over: then nothing of the window is (`StoredPart::gave_up`).
    fn store_part(
        &self,
        source: &RegisteredKv,
        chunks: &[ChunkBlocks],
        keys: &[ObjectKey],
        offset: usize,
        peer: Peer,
        deadline: Instant,
    ) -> Result<StoredPart, Fail> {
        let storage = &self.daemon.storage;
        let opened = self.opened();
        let reserved = if peer.may_wait() {
            // The wait for room ends when the client gives up, rather than holding what the
            // window reserved until the deadline.
            let gave_up = || peer.gave_up();
            storage.reserve_write_until(self.owner(), keys, &opened.layout, deadline, gave_up)?
        } else {
            storage.reserve_write_now(self.owner(), keys, &opened.layout)?
        };
        if peer.gave_up() {
            // Given up on while the window waited for room (or before): nothing is copied from
            // blocks the client may have handed to another request since.
            let held: Vec<ObjectKey> =
                keys.iter().zip(&reserved).filter(|(_, r)| r.is_ok()).map(|(k, _)| *k).collect();
            storage.abort_write(self.owner(), &held)?;
            return Ok(StoredPart { gave_up: true, ..StoredPart::default() });
        }
        let mut part = StoredPart::default();
        let (mut written, mut broken) = (Vec::new(), Vec::new());
        // Device-to-device copies still in flight: their slots stay pinned until the wait.
        let mut in_flight: Vec<(usize, WriteAccess)> = Vec::new();
        let mut copies = DeviceCopies::gathers();
        for (i, (chunk, result)) in chunks.iter().zip(reserved).enumerate() {
            match result {
                Ok(_) => match self.copy_in(source, &mut copies, &chunk.blocks, &keys[i]) {
                    Ok(CopiedIn::Done(n)) => {
                        part.bytes += n;
                        written.push(keys[i]);
                    }
                    Ok(CopiedIn::InFlight(access)) => in_flight.push((i, access)),
                    Err(why) => {
                        broken.push(keys[i]);
                        part.refused.push(Refused {
                            index: (offset + i) as u32,
                            reason: RefusalReason::CopyFailed,
                            message: why,
                        });
                    }
                },
                Err(KeyError::AlreadyPresent | KeyError::WriteInFlight) => part.present += 1,
                Err(e) => {
                    part.out_of_room |= e == KeyError::OutOfMemory;
                    part.refused.push(refusal(offset + i, e));
                }
            }
        }
        if !in_flight.is_empty() {
            // One wait for the whole window; a failure fails every chunk it may have touched
            // (aborted below: a miss, never a visible half chunk).
            let waited = source.run_device(copies);
            for (i, access) in in_flight {
                match &waited {
                    Ok(()) => {
                        part.bytes += access.handle().len;
                        written.push(keys[i]);
                    }
                    Err(e) => {
                        broken.push(keys[i]);
                        part.refused.push(Refused {
                            index: (offset + i) as u32,
                            reason: RefusalReason::CopyFailed,
                            message: e.to_string(),
                        });
                    }
                }
            }
        }
        if (!written.is_empty() || part.out_of_room) && peer.gave_up() {
            // The client gave up at its deadline and may have handed the blocks to another
            // request since: what was copied may be another prompt's KV. Asked after the copies,
            // so a window that passes read blocks the client still held for this store; and
            // after a wait for room that found none, which may have outlasted the client.
            broken.append(&mut written);
            storage.abort_write(self.owner(), &broken)?;
            return Ok(StoredPart { gave_up: true, ..StoredPart::default() });
        }
        storage.abort_write(self.owner(), &broken)?;
        let (finished, ticket) = storage.finish_write_tracked(self.owner(), &written)?;
        for (key, result) in written.iter().zip(finished) {
            match result {
                Ok(()) => part.stored += 1,
                Err(e) => {
                    let i = keys.iter().position(|k| k == key).unwrap_or(0);
                    part.refused.push(refusal(offset + i, e));
                }
            }
        }
        part.ticket = Some(ticket);
        Ok(part)
    }

    /// Gathers the chunk at `blocks` into the reserved slot of `key`: done (the bytes copied),
    /// or, device to device, added to `copies` (the slot's guard, held until they ran).
    fn copy_in(
        &self,
        source: &RegisteredKv,
        copies: &mut DeviceCopies,
        blocks: &[u64],
        key: &ObjectKey,
    ) -> Result<CopiedIn, String> {
        let mut access =
            self.daemon.storage.write_access(self.owner(), key).map_err(|e| e.to_string())?;
        if let (true, Some(slot)) = (source.on_device(), access.device_address()) {
            let len = access.handle().len;
            // SAFETY: the slot belongs to this write reservation, which `access` pins, and the
            // caller holds `access` until `copies` ran or is dropped: nothing else reads or
            // writes the slot until the write is finished or aborted.
            return match unsafe { source.gather_device(copies, blocks, slot, len) } {
                Ok(()) => Ok(CopiedIn::InFlight(access)),
                // Nothing of this chunk was collected.
                Err(e) => Err(e.to_string()),
            };
        }
        if let Some(slot) = access.host_bytes_mut() {
            source.gather(blocks, slot).map_err(|e| e.to_string())?;
            return Ok(CopiedIn::Done(slot.len() as u64));
        }
        let mut staging = vec![0u8; access.handle().len as usize];
        source.gather(blocks, &mut staging).map_err(|e| e.to_string())?;
        access.write_at(0, &staging).map_err(|e| e.to_string())?;
        Ok(CopiedIn::Done(staging.len() as u64))
    }

    /// Waits until this session's stores since its last flush are through the store pipeline.
    /// Past the timeout nothing is forgotten: the next flush waits for the same chunks.
    fn flush(&mut self, timeout: Duration) -> Result<ReplyBody, Fail> {
        let deadline = Instant::now() + timeout.min(MAX_WAIT);
        let Some(opened) = &mut self.opened else { unreachable_hello() };
        let (mut durable, mut not_durable) = opened.settled;
        for ticket in &opened.tickets {
            match ticket.wait_until(deadline) {
                Some(outcome) => {
                    durable = durable.saturating_add(outcome.durable);
                    not_durable = not_durable.saturating_add(outcome.not_durable);
                }
                None => {
                    return fail(
                        ErrorCode::Timeout,
                        "chunks are still on their way to the lower tiers; flush again",
                    );
                }
            }
        }
        opened.tickets.clear();
        opened.settled = (0, 0);
        Ok(ReplyBody::Flushed { durable, not_durable })
    }

    /// Bytes of L1 this session's open lookups hold in leases, a whole slot a chunk whatever its
    /// size (a lookup still prefetching counts every chunk it asked for), and how many are open. Forgets lookups that are over, here
    /// and in the registry.
    fn open_lookups(&mut self) -> (u64, usize) {
        let Some(opened) = &mut self.opened else { unreachable_hello() };
        let storage = &self.daemon.storage;
        let (mut chunks, mut over) = (0u64, Vec::new());
        {
            // Gone from the registry: released, ended by its last reader, or past its deadline.
            let registry = self.daemon.lookups.lock();
            opened.made.retain(|id| registry.contains_key(id));
        }
        for &id in &opened.made {
            match storage.held_chunks(LookupId(id)) {
                Some(n) => chunks += n as u64,
                None => over.push(id),
            }
        }
        if !over.is_empty() {
            let mut registry = self.daemon.lookups.lock();
            for id in &over {
                opened.made.remove(id);
                registry.remove(id);
            }
        }
        (chunks.saturating_mul(self.daemon.slot_bytes()), opened.made.len())
    }

    fn lookup(
        &mut self,
        namespace: u32,
        chunks: &[ChunkId],
        defer_prefetch: bool,
        peer: Peer,
    ) -> Result<ReplyBody, Fail> {
        let ns = self.namespace(namespace)?;
        if peer.gave_up() {
            // Nobody reads the reply: no prefetch takes room in L1, no lease is held for it.
            return Err(self.gave_up("lookup", chunks.len()));
        }
        let (held, open) = self.open_lookups();
        if open >= MAX_OPEN_LOOKUPS {
            // Each costs the daemon its record until its deadline, a miss as much as a hit.
            return fail(
                ErrorCode::LeaseLimit,
                format!(
                    "this session has {open} open lookups, the most one may have: retrieve or \
                     release some first"
                ),
            );
        }
        if held >= self.daemon.max_leased_per_session {
            return fail(
                ErrorCode::LeaseLimit,
                format!(
                    "this session's open lookups hold {held} bytes of L1 slots in leases, the \
                     limit is {} (server.max_leased_per_session): retrieve or release some first",
                    self.daemon.max_leased_per_session
                ),
            );
        }
        let opened = self.opened();
        let keys: Vec<ObjectKey> = chunks.iter().map(|c| self.key(ns, opened.rank, *c)).collect();
        let storage = &self.daemon.storage;
        let mut request = tierkv_storage::LookupRequest::prefix(
            self.owner(),
            opened.extra,
            opened.layout.clone(),
            keys,
        );
        request.chunk_tokens = u64::from(opened.hello.chunk_tokens);
        // What is left of the session's allowance bounds the L1 slots this lookup may load its
        // hit into (a slot a chunk, however small); the rest of the hit is read from the tier
        // that holds it.
        let left = (self.daemon.max_leased_per_session - held) / self.daemon.slot_bytes();
        request.max_promoted = usize::try_from(left).unwrap_or(usize::MAX);
        request.defer_prefetch = defer_prefetch;
        let id = storage.submit_lookup(request)?;
        let info = LookupInfo {
            owner: self.id,
            namespace: ns,
            rank: opened.rank,
            readers: opened.extra.readers(),
            owner_reader: opened.reader_of(opened.rank),
            chunks: chunks.len(),
        };
        self.daemon.lookups.lock().insert(id.0, info);
        if let Some(opened) = &mut self.opened {
            opened.made.insert(id.0);
        }
        let l1_hit_chunks = storage.l1_hit(id)? as u32;
        // Asking the pipeline would start a deferred lookup: only a complete one answers now.
        let outcome =
            if defer_prefetch { storage.result_if_complete(id)? } else { storage.query(id)? };
        let outcome = outcome.map(|r| self.daemon.outcome(&r));
        Ok(ReplyBody::LookupStarted { lookup: id.0, l1_hit_chunks, outcome })
    }

    /// A lookup this session may read: made by a session of one of its namespaces, for its
    /// rank's KV. Returns the id and this session's reader number.
    fn visible_lookup(&mut self, lookup: u64) -> Result<(LookupId, u8, LookupInfo), Fail> {
        let unknown = || Fail {
            code: ErrorCode::UnknownLookup,
            message: format!("no lookup {lookup} is open for this session"),
        };
        let info = self.daemon.lookups.lock().get(&lookup).copied().ok_or_else(unknown)?;
        let Some(opened) = &mut self.opened else { unreachable_hello() };
        if !opened.namespaces.contains(&info.namespace) {
            return Err(unknown());
        }
        if info.rank != opened.rank {
            return fail(ErrorCode::Forbidden, "the lookup was made for another rank's KV");
        }
        let reader = opened.reader_of(info.rank);
        if u32::from(reader) >= info.readers {
            return fail(
                ErrorCode::Forbidden,
                format!("the lookup has {} readers; this session is reader {reader}", info.readers),
            );
        }
        let mut joined = None;
        if info.owner != self.id && reader != info.owner_reader {
            // Another reader's share, which this session now answers for: returned when it
            // ends. The owner's reader's share is the owner's, whoever else may look.
            let before = opened.joined.len();
            if opened.joined.len() >= opened.prune_joined_at {
                // Lookups that ended another way (their owner released them or left, or they
                // expired) owe this session nothing: forgotten, so the set stays within twice
                // the lookups still open (and each prune pays for as many joins).
                let open = self.daemon.lookups.lock();
                opened.joined.retain(|(id, _)| open.contains_key(id));
                opened.prune_joined_at = (2 * opened.joined.len()).max(MAX_OPEN_LOOKUPS);
            }
            opened.joined.insert((lookup, reader as u8));
            // The status report is told of changes only: most asks are of a lookup joined already.
            if opened.joined.len() != before {
                joined = Some(opened.joined.len());
            }
        }
        if let Some(joined) = joined {
            self.report_joined(joined);
        }
        let reader = reader as u8;
        Ok((LookupId(lookup), reader, info))
    }

    /// Puts the number of other sessions' lookups this one answers for into its status report.
    fn report_joined(&self, joined: usize) {
        if let Some(report) = self.daemon.sessions.lock().get_mut(&self.id) {
            report.joined_lookups = joined as u64;
        }
    }

    fn retrieve(
        &mut self,
        lookup: u64,
        buffer: u32,
        chunks: &[ChunkBlocks],
        done_event: Option<&[u8]>,
        peer: Peer,
    ) -> Result<ReplyBody, Fail> {
        let (own, ended) = {
            let ended = self.daemon.ended.lock();
            (ended.owned_by(self.id, lookup), ended.lookups.get(&lookup).copied())
        };
        if own {
            // Its owner's reader returned its share with the rest.
            return fail(
                ErrorCode::ShareReturned,
                format!("every reader returned its share of lookup {lookup}; it is over"),
            );
        }
        if let Some(info) = ended
            && self.opened().namespaces.contains(&info.namespace)
        {
            // As while it was open (`visible_lookup`): another rank's lookup is not this
            // session's to read, over or not.
            if info.rank != self.opened().rank {
                return fail(ErrorCode::Forbidden, "the lookup was made for another rank's KV");
            }
            // Every reader, this one included, returned its share already.
            return fail(
                ErrorCode::ShareReturned,
                format!("every reader returned its share of lookup {lookup}; it is over"),
            );
        }
        let (id, reader, info) = self.visible_lookup(lookup)?;
        let answer = self.retrieve_visible((id, reader, info), buffer, chunks, done_event, peer);
        // The reader's share is owed no more once returned: by this retrieve, or by one before
        // it (a second retrieve of the same reader, which `visible_lookup` joined again).
        let returned = match &answer {
            Ok(_) => true,
            Err(refused) => refused.code == ErrorCode::ShareReturned,
        };
        if returned
            && let Some(opened) = &mut self.opened
            && opened.joined.remove(&(lookup, reader))
        {
            let joined = opened.joined.len();
            self.report_joined(joined);
        }
        answer
    }

    /// [`Session::retrieve`] of a lookup this session may read, as this reader.
    fn retrieve_visible(
        &mut self,
        (id, reader, info): (LookupId, u8, LookupInfo),
        buffer: u32,
        chunks: &[ChunkBlocks],
        done_event: Option<&[u8]>,
        peer: Peer,
    ) -> Result<ReplyBody, Fail> {
        let lookup = id.0;
        let target = self.buffer(buffer, chunks)?;
        if let Some(handle) = done_event {
            // Refused before the hit is read: the reader's share stays for another try.
            target.check_event(handle).map_err(|e| Fail {
                code: ErrorCode::BadBuffer,
                message: format!("done_event: {e}"),
            })?;
        }
        let storage = &self.daemon.storage;
        let keys: Vec<ObjectKey> =
            chunks.iter().map(|c| self.key(info.namespace, info.rank, c.chunk)).collect();
        // Every chunk is checked before any is copied: a request that names a chunk outside the
        // hit, or comes from a reader that already returned its share, copies nothing.
        // `may_read_below`, not `holds_below`: a lookup still prefetching may complete with
        // chunks below L1 before the pins are taken, and the L1 path would read them all at once.
        let scattered = if storage.may_read_below(id) {
            // Chunks held below L1 are read into buffers of their own: a window at a time, so
            // a hit of any size takes at most `RETRIEVE_WINDOW_BYTES` of the daemon's memory.
            // The whole request is checked first, since each window is read on its own.
            storage.check_hit(id, reader, &keys)?;
            let per = (RETRIEVE_WINDOW_BYTES / target.chunk_bytes().max(1)).max(1) as usize;
            let mut bytes = 0;
            let mut scattered = Ok(());
            for (part, keys) in chunks.chunks(per).zip(keys.chunks(per)) {
                if peer.gave_up() {
                    return Err(self.gave_up("retrieve", chunks.len()));
                }
                let pinned = read_pinned(storage, (id, reader), part, keys, target.chunk_bytes())?;
                match scatter_all(target, &pinned, peer) {
                    Ok(copied) => bytes += copied,
                    Err(e) => {
                        scattered = Err(e);
                        break;
                    }
                }
            }
            scattered.and_then(|()| match done_event {
                Some(handle) => target
                    .signal_event(handle)
                    .map(|()| bytes)
                    .map_err(|e| Fail { code: ErrorCode::Internal, message: e.to_string() }),
                None => Ok(bytes),
            })
        } else {
            // Every chunk is leased in L1: checked and pinned together, no copy in between.
            let pinned = read_pinned(storage, (id, reader), chunks, &keys, target.chunk_bytes())?;
            if peer.gave_up() {
                // The client gave up at its deadline (it recomputes these blocks) and may have
                // handed them to another request since: nothing is written into them. The
                // reader's share goes back when the session ends, which it is about to.
                return Err(self.gave_up("retrieve", chunks.len()));
            }
            match done_event {
                Some(handle) => scatter_signalled(target, pinned, handle, peer),
                None => {
                    let scattered = scatter_all(target, &pinned, peer);
                    drop(pinned);
                    scattered
                }
            }
        };
        let bytes = match scattered {
            Ok(bytes) => bytes,
            // The scatter's only timeout: the client gave up while it copied.
            Err(e) if e.code == ErrorCode::Timeout => {
                return Err(self.gave_up("retrieve", chunks.len()));
            }
            Err(e) => return Err(e),
        };
        if let Err(e) = self.daemon.return_share(lookup, reader) {
            // Refused now (the owner released the lookup meanwhile, or its deadline passed): an
            // error tells the engine the blocks are its own again, to recompute or to hand to
            // another request, so not while copies into them may still run (device to device
            // with a `done_event`, the reply does not wait for them).
            if done_event.is_some()
                && let Err(copies) = target.sync_all()
            {
                tracing::error!("copies of a refused retrieve failed: {copies}");
            }
            return Err(e.into());
        }
        self.daemon.metrics.data_bytes("retrieve", bytes);
        Ok(ReplyBody::Retrieved { chunks: chunks.len() as u32, bytes })
    }

    /// The error of a request of `op` (over `chunks` chunks) the client gave up on before the
    /// daemon carried it out: logged and counted.
    fn gave_up(&self, op: &'static str, chunks: usize) -> Fail {
        self.gave_up_after(op, chunks, 0)
    }

    /// [`Session::gave_up`], of a store whose windows finished before the client gave up made
    /// `kept` chunks visible: those stay (whole, read while the client still held their
    /// blocks), and the error says so.
    fn gave_up_after(&self, op: &'static str, chunks: usize, kept: u32) -> Fail {
        tracing::warn!(
            session = self.id,
            op,
            chunks,
            kept,
            "the client gave up on a request (its deadline passed) before the daemon carried it \
             out; none of it is done but the chunks kept, stored before it gave up"
        );
        self.daemon.metrics.given_up(op);
        let message = if kept == 0 {
            GAVE_UP.into()
        } else {
            format!(
                "the client gave up on this store before the daemon finished it: the {kept} \
                 chunks stored before it gave up (whole windows of the chain's tail, copied \
                 while the client still held their blocks) stay cached; nothing more of it was \
                 stored"
            )
        };
        Fail { code: ErrorCode::Timeout, message }
    }

    fn release(&mut self, lookup: u64) -> Result<ReplyBody, Fail> {
        let unknown = match self.visible_lookup(lookup) {
            Ok((_, _, info)) if info.owner != self.id => {
                return fail(
                    ErrorCode::Forbidden,
                    "only the session that made a lookup may release it",
                );
            }
            Ok(_) => {
                if self.daemon.release_open(lookup)? {
                    return Ok(ReplyBody::Released);
                }
                // Its last reader ended it since: in the ended ones now.
                Fail {
                    code: ErrorCode::UnknownLookup,
                    message: format!("no lookup {lookup} is open for this session"),
                }
            }
            Err(e) if e.code == ErrorCode::UnknownLookup => e,
            Err(e) => return Err(e),
        };
        let mut ended = self.daemon.ended.lock();
        if ended.owned_by(self.id, lookup) {
            // Every reader returned its share already: there is nothing left to release, and
            // the session's record of it goes.
            if let Some(own) = ended.by_owner.get_mut(&self.id) {
                own.remove(&lookup);
            }
            return Ok(ReplyBody::Released);
        }
        Err(unknown)
    }

    fn clear(&self) -> ReplyBody {
        let storage = &self.daemon.storage;
        let mut removed = vec![storage.clear_l1(false).removed as u64];
        let mut tier = 0;
        while let Some(n) = storage.clear_tier(tier) {
            removed.push(n as u64);
            tier += 1;
        }
        ReplyBody::Cleared { removed }
    }

    /// Returns everything the session holds. Idempotent; called when the connection ends for
    /// any reason.
    pub fn close(&mut self) {
        if std::mem::replace(&mut self.closed, true) {
            return;
        }
        let storage = &self.daemon.storage;
        if let Some(opened) = self.opened.take() {
            for (lookup, reader) in opened.joined {
                // The owner may have released it already; nothing is left to return then.
                let _ = self.daemon.return_share(lookup, reader);
            }
            if opened.hello.role == Role::Worker {
                self.daemon.metrics.worker_connected(-1.0);
            }
        }
        {
            // In one step, so that no lookup of this session ends into the ended ones after
            // its record there is gone (`Ended::insert`).
            let mut registry = self.daemon.lookups.lock();
            registry.retain(|_, info| info.owner != self.id);
            self.daemon.ended.lock().by_owner.remove(&self.id);
        }
        let released = storage.release_owner(self.owner());
        if released.leases + released.aborted_writes > 0 {
            tracing::debug!(session = self.id, ?released, "returned what a departed session held");
        }
        self.daemon.sessions.lock().remove(&self.id);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.close();
    }
}

impl Daemon {
    /// A lookup's outcome on the wire: `per_tier` is always `[l1, l2, disk, remote]`.
    fn outcome(&self, result: &LookupResult) -> LookupOutcome {
        let mut per_tier = vec![0u32; TIER_NAMES.len()];
        for (tier, n) in result.per_tier.iter().enumerate() {
            let slot = self.tier_slots.get(tier).copied().unwrap_or(TIER_NAMES.len() - 1);
            per_tier[slot] += *n as u32;
        }
        LookupOutcome {
            hit_chunks: result.hit_chunks as u32,
            hit_tokens: result.hit_tokens,
            readers: result.readers,
            per_tier,
        }
    }

    /// Returns `reader`'s share of `lookup`; returns whether that ended it. A lookup that ends
    /// leaves the registry for the ended ones in the same step, under the registry's lock, as
    /// its storage record goes: its owner's `release` ([`Daemon::release_open`]) finds it in
    /// one or the other, never in neither.
    fn return_share(&self, lookup: u64, reader: u8) -> Result<bool, StorageError> {
        let mut registry = self.lookups.lock();
        let ended = self.storage.release(LookupId(lookup), Readers::One(reader))?;
        if ended && let Some(info) = registry.remove(&lookup) {
            self.ended.lock().insert(lookup, info);
        }
        Ok(ended)
    }

    /// The owner releases `lookup`: out of the registry and every share it holds returned, in
    /// one step under the registry's lock (so a retrieve cannot end it in between, leaving it
    /// in neither the registry nor the ended ones). `false` when it is no longer in the
    /// registry: its last reader ended it since it was looked up.
    fn release_open(&self, lookup: u64) -> Result<bool, StorageError> {
        let mut registry = self.lookups.lock();
        if registry.remove(&lookup).is_none() {
            return Ok(false);
        }
        self.storage.release_all(LookupId(lookup))?;
        Ok(true)
    }
}

/// A chunk of a store L1 refused, as its code and words.
/// A retrieve at least this large is split over threads (one core's memcpy is the limit of one
/// client otherwise: 62 MiB for an 8,000-token prompt of the tests' model is ~5 ms on one core).
const PARALLEL_SCATTER_BYTES: u64 = 8 << 20;
/// Bytes a retrieve's host copies write between two checks that the client has not given up
/// (one `poll`, about 0.2 µs: under 0.1% of copying this much).
const GIVE_UP_CHECK_BYTES: u64 = 1 << 20;
/// Threads one retrieve may use at most.
const MAX_SCATTER_THREADS: usize = 4;

/// Threads a large retrieve is split over: the cores this process may use, read once. Reading
/// them means reading cgroup files, 24-28 µs a call on the CI machine: half a 64 KiB
/// retrieve, and it was read on every retrieve.
fn scatter_threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_SCATTER_THREADS)
    })
}

/// The most bytes of chunks held below L1 a retrieve reads into memory at once: it reads and
/// copies a hit held there a window at a time.
const RETRIEVE_WINDOW_BYTES: u64 = 64 << 20;

/// Pins (in L1) or loads (held below L1) the chunks `keys` of lookup `id` for `reader`, each
/// with the blocks it goes to; refused when a chunk is not the size of the buffer's chunks.
fn read_pinned<'c>(
    storage: &StorageManager,
    (id, reader): (LookupId, u8),
    chunks: &'c [ChunkBlocks],
    keys: &[ObjectKey],
    chunk_bytes: u64,
) -> Result<Vec<(&'c [u64], HitChunk)>, Fail> {
    let read = storage.read_hit(id, reader, keys, chunk_bytes)?;
    let mut pinned = Vec::with_capacity(chunks.len());
    for (c, chunk) in chunks.iter().zip(read) {
        if chunk.len() != chunk_bytes {
            return fail(
                ErrorCode::BadBuffer,
                format!(
                    "the chunk has {} bytes, a chunk of the buffer's layout {chunk_bytes}",
                    chunk.len()
                ),
            );
        }
        pinned.push((c.blocks.as_slice(), chunk));
    }
    Ok(pinned)
}

/// Scatters every pinned chunk into its blocks; returns the bytes copied. A large retrieve whose
/// blocks are all distinct runs on several threads, each over its own chunks (distinct blocks:
/// no two threads ever write the same bytes).
fn scatter_all(
    target: &RegisteredKv,
    pinned: &[(&[u64], HitChunk)],
    peer: Peer,
) -> Result<u64, Fail> {
    let bytes: u64 = pinned.iter().map(|(_, chunk)| chunk.len()).sum();
    if bytes < PARALLEL_SCATTER_BYTES || target.on_device() {
        // Small, or (GPU regions) already asynchronous on the region's own stream: no threads.
        return scatter_part(target, pinned, peer).map(|()| bytes);
    }
    let threads = scatter_threads().min(pinned.len());
    let distinct = || {
        let mut seen = HashSet::new();
        pinned.iter().flat_map(|(blocks, _)| blocks.iter()).all(|b| seen.insert(*b))
    };
    if threads < 2 || !distinct() {
        return scatter_part(target, pinned, peer).map(|()| bytes);
    }
    let per = pinned.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let (mut spawned, mut refused) = (Vec::new(), Vec::new());
        for part in pinned.chunks(per) {
            let copy = move || scatter_part(target, part, peer);
            match std::thread::Builder::new().spawn_scoped(scope, copy) {
                Ok(thread) => spawned.push(thread),
                // The OS refused a thread (`EAGAIN`: the user's process limit, a cgroup's
                // `pids.max`): this thread copies the part itself, after the rest started.
                Err(_) => refused.push(part),
            }
        }
        let mut copied = Ok(());
        for part in refused {
            copied = copied.and_then(|()| scatter_part(target, part, peer));
        }
        for thread in spawned {
            let joined = thread.join().map_err(|_| Fail {
                code: ErrorCode::Internal,
                message: "a copy thread panicked".into(),
            });
            copied = copied.and(joined.and_then(|part| part));
        }
        copied.map(|()| bytes)
    })
}

/// Scatters every pinned chunk into its blocks and records the worker's `done_event` after the
/// copies; returns the bytes. Device to device the copies are only enqueued: the reply goes out
/// while they run, and the slots' guards are dropped by the completion thread once they are
/// done (the engine waits for the event, never for the reply). Otherwise the scatter is done
/// when this returns, and so is the event.
fn scatter_signalled(
    target: &RegisteredKv,
    pinned: Vec<(&[u64], HitChunk)>,
    done_event: &[u8],
    peer: Peer,
) -> Result<u64, Fail> {
    let failed = |e: KvError| Fail { code: ErrorCode::Internal, message: e.to_string() };
    let all_device = pinned
        .iter()
        .all(|(_, c)| matches!(c, HitChunk::L1(access) if access.device_address().is_some()));
    if !all_device || !target.on_device() {
        let bytes = scatter_all(target, &pinned, peer)?;
        target.signal_event(done_event).map_err(failed)?;
        return Ok(bytes);
    }
    let bytes = pinned.iter().map(|(_, chunk)| chunk.len()).sum();
    let mut copies = DeviceCopies::scatters();
    for (blocks, chunk) in &pinned {
        if let HitChunk::L1(access) = chunk
            && let Some(slot) = access.device_address()
        {
            // SAFETY: the slot is leased and pinned (`chunk`) until the completion thread drops
            // the guards, after the copies: nobody writes it meanwhile. On an error `copies`
            // is dropped unrun, or the run waits for what it enqueued.
            unsafe { target.scatter_device(&mut copies, blocks, slot, chunk.len()) }
                .map_err(failed)?;
        }
    }
    let guards: Vec<HitChunk> = pinned.into_iter().map(|(_, chunk)| chunk).collect();
    target.run_device_signalled(copies, done_event, Box::new(guards)).map_err(failed)?;
    Ok(bytes)
}

/// Scatters `pinned` into its blocks. Host copies ask `peer` again every
/// [`GIVE_UP_CHECK_BYTES`] and stop once the client gave up: of a large retrieve, a daemon that
/// stops and resumes after the client's deadline writes at most that much more into its memory.
/// Device copies are enqueued together, before anything runs.
fn scatter_part(
    target: &RegisteredKv,
    pinned: &[(&[u64], HitChunk)],
    peer: Peer,
) -> Result<(), Fail> {
    let failed = |e: KvError| Fail { code: ErrorCode::Internal, message: e.to_string() };
    let device_slot = |chunk: &HitChunk| match chunk {
        HitChunk::L1(access) => access.device_address(),
        HitChunk::Loaded(_) => None,
    };
    if let (true, Some(true)) = (
        target.on_device(),
        pinned.iter().map(|(_, c)| device_slot(c).is_some()).reduce(|a, b| a && b),
    ) {
        // Device to device: every chunk collected, then enqueued together and waited for once.
        // `pinned` keeps every slot leased and pinned until this returns.
        let mut copies = DeviceCopies::scatters();
        for (blocks, chunk) in pinned {
            if let Some(slot) = device_slot(chunk) {
                // SAFETY: the slot is leased and pinned (`chunk`) past the run below: nobody
                // writes it meanwhile. On an error `copies` is dropped unrun.
                unsafe { target.scatter_device(&mut copies, blocks, slot, chunk.len()) }
                    .map_err(failed)?;
            }
        }
        return target.run_device(copies).map_err(failed);
    }
    let mut staging = Vec::new();
    let mut unchecked = 0u64;
    for (blocks, chunk) in pinned {
        if unchecked >= GIVE_UP_CHECK_BYTES {
            if peer.gave_up() {
                return fail(ErrorCode::Timeout, GAVE_UP);
            }
            unchecked = 0;
        }
        unchecked += chunk.len();
        let copied = match chunk {
            HitChunk::Loaded(bytes) => target.scatter(blocks, bytes),
            HitChunk::L1(access) => match access.host_bytes() {
                Some(slot) => target.scatter(blocks, slot),
                None => {
                    staging.resize(access.handle().len as usize, 0);
                    access.read_at(0, &mut staging).map_err(StorageError::from)?;
                    target.scatter(blocks, &staging)
                }
            },
        };
        copied.map_err(failed)?;
    }
    Ok(())
}

/// What one window of a store came to.
#[derive(Default)]
struct StoredPart {
    stored: u32,
    present: u32,
    refused: Vec<Refused>,
    bytes: u64,
    /// The store pipeline's ticket for the window's chunks.
    ticket: Option<Arc<StoreTicket>>,
    /// A chunk found no room in L1.
    out_of_room: bool,
    /// The client gave up before the copies were over: nothing of the window was kept.
    gave_up: bool,
}

/// What `copy_in` did with a chunk.
enum CopiedIn {
    /// Copied: these many bytes.
    Done(u64),
    /// Collected for the registration's streams; the slot stays pinned by this guard until the
    /// request ran them (`RegisteredKv::run_device`).
    InFlight(WriteAccess),
}

fn refusal(index: usize, error: KeyError) -> Refused {
    let reason = match error {
        KeyError::OutOfMemory => RefusalReason::NoSpace,
        KeyError::Busy | KeyError::Locked => RefusalReason::Busy,
        _ => RefusalReason::Internal,
    };
    Refused { index: index as u32, reason, message: error.to_string() }
}

/// The metric label of a request.
pub fn op_name(body: &RequestBody) -> &'static str {
    match body {
        RequestBody::Hello(_) => "hello",
        RequestBody::RegisterKv { .. } => "register_kv",
        RequestBody::Store { .. } => "store",
        RequestBody::Lookup { .. } => "lookup",
        RequestBody::Query { .. } => "query",
        RequestBody::Wait { .. } => "wait",
        RequestBody::Retrieve { .. } => "retrieve",
        RequestBody::Release { .. } => "release",
        RequestBody::Flush { .. } => "flush",
        RequestBody::EndSession => "end_session",
        RequestBody::Status => "status",
        RequestBody::Clear => "clear",
    }
}

/// Chunk sizes the daemon warns of as wasting most of a slot, at most (each once).
const MAX_WARNED_CHUNK_SIZES: usize = 16;

/// What to tell the operator when workers' chunks fill at most half of a slot: L1 and L2 keep
/// one chunk per `slot_bytes` slot, so most of both tiers would go unused.
fn slot_waste(chunk_bytes: u64, slot_bytes: u64) -> Option<String> {
    if chunk_bytes == 0 || chunk_bytes.saturating_mul(2) > slot_bytes {
        return None;
    }
    Some(format!(
        "workers store chunks of {chunk_bytes} bytes, and L1 and L2 keep one chunk per slot of \
         {slot_bytes} bytes (l1.slot): {:.0}% of both tiers cannot be used; set l1.slot to the \
         chunk size",
        100.0 * (1.0 - chunk_bytes as f64 / slot_bytes as f64)
    ))
}

/// A hello was handled before `dispatch` matched; it cannot come back here.
fn unreachable_hello() -> ! {
    unreachable!("hello is handled before the session is open")
}

/// Compares secrets without leaking where they differ through timing.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use crate::conn::{Conn, Stream};
    use tierkv_client::SharedBuffer;
    use tierkv_proto::{KvLayout, Segment};

    /// A worker's hello: one namespace ("m"), rank 0 of 1, chunks of `chunk` bytes.
    fn worker_hello(chunk: u64) -> Hello {
        Hello { chunk_tokens: 16, ..tierkv_client::Client::worker_hello("m", chunk) }
    }

    /// A buffer's layout: `blocks` blocks of one chunk of `chunk` bytes each, in one region.
    fn chunk_blocks(chunk: u64, blocks: u64) -> KvLayout {
        KvLayout {
            blocks,
            block_bytes: chunk,
            block_stride: chunk,
            blocks_per_chunk: 1,
            segments: vec![Segment { region: 0, offset: 0 }],
        }
    }

    /// Such a buffer in host memory, mapped as `register_kv` maps it, with the memory behind it.
    fn host_kv(chunk: u64, blocks: u64) -> (RegisteredKv, SharedBuffer) {
        let shared = SharedBuffer::new(chunk, blocks).unwrap();
        let regions = [RegionSource::Memfd { bytes: chunk * blocks }];
        let fd = shared.fd().try_clone_to_owned().unwrap();
        let layout = chunk_blocks(chunk, blocks);
        let kv =
            RegisteredKv::map(&regions, vec![Some(fd)], &layout, chunk, &HostMaps::default(), &[]);
        (kv.unwrap(), shared)
    }

    /// A session of `daemon` that said [`worker_hello`] and registered buffer 0: `blocks`
    /// blocks of one chunk each, in the memory returned with it.
    fn worker(
        daemon: &Arc<Daemon>,
        chunk: u64,
        blocks: u64,
        peer: Peer,
    ) -> (Session, SharedBuffer) {
        let mut session = Session::new(Arc::clone(daemon), Transport::Unix);
        let hello = RequestBody::Hello(worker_hello(chunk));
        let welcomed = session.handle(hello, &mut || None, peer);
        assert!(matches!(welcomed.reply, ReplyBody::Welcome { .. }), "{:?}", welcomed.reply);
        let shared = SharedBuffer::new(chunk, blocks).unwrap();
        let mut fd = Some(shared.fd().try_clone_to_owned().unwrap());
        let register = RequestBody::RegisterKv {
            regions: vec![RegionSource::Memfd { bytes: blocks * chunk }],
            layout: chunk_blocks(chunk, blocks),
        };
        let registered = session.handle(register, &mut || fd.take(), peer);
        assert!(matches!(registered.reply, ReplyBody::BufferRegistered { buffer: 0 }));
        (session, shared)
    }

    /// Registers `shared` whole on `session`, as [`worker`] registers its buffer.
    fn register(session: &mut Session, shared: &SharedBuffer) -> ReplyBody {
        let mut fd = Some(shared.fd().try_clone_to_owned().unwrap());
        let register = RequestBody::RegisterKv {
            regions: vec![RegionSource::Memfd { bytes: shared.blocks() * shared.block_bytes() }],
            layout: chunk_blocks(shared.block_bytes(), shared.blocks()),
        };
        session.handle(register, &mut || fd.take(), Peer::detached()).reply
    }

    #[test]
    fn a_memfd_registered_on_two_sessions_stays_mapped_until_both_end() {
        const CHUNK: u64 = 4 << 10;
        let daemon = Daemon::small(CHUNK);
        let peer = Peer::detached();
        let (mut first, shared) = worker(&daemon, CHUNK, 2, peer);
        let (mut second, _other) = worker(&daemon, CHUNK, 2, peer);
        let mapped = || (daemon.host_maps.mapped_files(), daemon.host_maps.mapped_bytes());
        assert_eq!(mapped(), (2, 4 * CHUNK));
        // The first session's memfd, registered again on both: no new mapping.
        assert!(matches!(register(&mut first, &shared), ReplyBody::BufferRegistered { buffer: 1 }));
        assert!(matches!(
            register(&mut second, &shared),
            ReplyBody::BufferRegistered { buffer: 1 }
        ));
        assert_eq!(mapped(), (2, 4 * CHUNK));
        let reply = first.handle(RequestBody::EndSession, &mut || None, peer).reply;
        assert!(matches!(reply, ReplyBody::Bye), "{reply:?}");
        assert_eq!(mapped(), (2, 4 * CHUNK), "the second session still holds both memfds");
        drop(second);
        assert_eq!(mapped(), (0, 0));
    }

    /// A daemon whose L1 (16 slots, windows of two chunks, write-through to a fake disk) is
    /// full: 14 chunks are held by three lookups (`first` holds keys 0 and 1, `second` keys 2
    /// and 3), and two are under a copy the disk holds (a store waits while such copies are
    /// under way, for `store_backpressure` at most). Releasing `first` or `second` makes room
    /// for a window.
    struct FullL1 {
        daemon: Arc<Daemon>,
        first: LookupId,
        second: LookupId,
        disk: Arc<tierkv_testkit::FakeTier>,
    }

    impl FullL1 {
        const CHUNK: u64 = 4 << 10;

        fn new(store_backpressure: Duration) -> Self {
            use tierkv_core::{ManualClock, TierAdapter};
            use tierkv_l1::{DeviceKind, L1Config, Watermark};
            use tierkv_storage::{StorageConfig, StorePolicy};
            use tierkv_testkit::contract::{keys, payload};
            use tierkv_testkit::{FakeTier, eventually};

            const CHUNK: u64 = FullL1::CHUNK;
            const SLOTS: u64 = 16; // windows of two chunks
            let disk = Arc::new(FakeTier::new("disk", 64, CHUNK));
            let tiers: Vec<Arc<dyn TierAdapter>> = vec![disk.clone()];
            let l1 = L1Config {
                device: DeviceKind::Emulated,
                watermark: Watermark { high: 1.0, low: 1.0 },
                ..L1Config::new(SLOTS * CHUNK, CHUNK)
            };
            let config = StorageConfig {
                store_policy: StorePolicy::WriteThrough,
                store_backpressure,
                ..StorageConfig::new(l1)
            };
            let clock = Arc::new(ManualClock::new());
            let storage = StorageManager::start_with_tiers(config, clock, tiers).unwrap();
            assert_eq!(storage.store_window(), 2);
            let (other, layout) = (OwnerId(1000), Layout::bytes(CHUNK).unwrap());
            let fill = |chunks: &[ObjectKey]| {
                let reserved = storage.reserve_write(other, chunks, &layout).unwrap();
                assert!(reserved.iter().all(|r| r.is_ok()));
                for k in chunks {
                    let mut access = storage.write_access(other, k).unwrap();
                    access.write_at(0, &payload(k, CHUNK)).unwrap();
                }
                assert!(storage.finish_write(other, chunks).unwrap().iter().all(|r| r.is_ok()));
            };
            fill(&keys(0..14));
            eventually("the first copies are down", || storage.status().store_in_flight == 0);
            let lookup = |chunks: Vec<ObjectKey>| {
                let id = storage.submit_prefetch(other, chunks, ExtraCount::ZERO, layout.clone());
                let id = id.unwrap();
                assert!(storage.wait(id, MAX_WAIT).unwrap().hit_chunks > 0);
                id
            };
            let (first, second) = (lookup(keys(0..2)), lookup(keys(2..4)));
            lookup(keys(4..14));
            disk.hold();
            fill(&keys(14..16));
            eventually("a copy is held", || disk.held_tasks() == 1);
            let daemon = Arc::new(Daemon::new(storage, None, None));
            FullL1 { daemon, first, second, disk }
        }
    }

    /// A connection the daemon's side of which is `Conn` (in the test's runtime), and the
    /// client's end: shutting its writing side is the client giving up.
    fn connected() -> (Conn, std::os::unix::net::UnixStream) {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let conn = Conn::new(Stream::Unix(tokio::net::UnixStream::from_std(ours).unwrap()), 1024);
        (conn, theirs)
    }

    /// Does `then` on a thread of its own once a store of `daemon` waits for room in L1.
    fn once_a_store_waits<T: Send + 'static>(
        daemon: &Arc<Daemon>,
        then: impl FnOnce(&Daemon) -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let daemon = Arc::clone(daemon);
        std::thread::spawn(move || {
            let l1 = daemon.storage().l1();
            tierkv_testkit::eventually("a store waits for room", || l1.room_watchers() == 1);
            then(&daemon)
        })
    }

    /// A retrieve's host copies after the client gave up: at most `GIVE_UP_CHECK_BYTES` more are
    /// written, then the scatter stops with `timeout`. While it has not, all are.
    #[tokio::test]
    async fn a_scatter_stops_within_a_check_of_the_client_giving_up() {
        const CHUNK: u64 = 256 << 10;
        const CHUNKS: u64 = 16;
        let (kv, shared) = host_kv(CHUNK, CHUNKS);
        let blocks: Vec<[u64; 1]> = (0..CHUNKS).map(|b| [b]).collect();
        let hit = |value: u8| -> Vec<(&[u64], HitChunk)> {
            blocks
                .iter()
                .map(|b| (&b[..], HitChunk::Loaded(Arc::new(vec![value; CHUNK as usize]))))
                .collect()
        };
        let (conn, theirs) = connected();
        let peer = conn.peer();

        scatter_part(&kv, &hit(1), peer).unwrap();
        assert!((0..CHUNKS).all(|b| shared.block(b).unwrap().iter().all(|&x| x == 1)));

        theirs.shutdown(std::net::Shutdown::Write).unwrap();
        let stopped = scatter_part(&kv, &hit(2), peer).unwrap_err();
        assert_eq!(stopped.code, ErrorCode::Timeout);
        let written = (0..CHUNKS)
            .filter(|&b| shared.block(b).unwrap().iter().all(|&x| x == 2))
            .count() as u64;
        assert_eq!(written, GIVE_UP_CHECK_BYTES / CHUNK, "copies past the first check");
        assert!((written..CHUNKS).all(|b| shared.block(b).unwrap()[0] == 1));
    }

    /// A large retrieve's host copies are split over threads; where the OS refuses a thread
    /// (`EAGAIN`: the user's process limit, a cgroup's `pids.max`), the calling thread copies
    /// that part itself, and the retrieve is whole. The OS is made to refuse threads for real,
    /// in a process of its own (this test run again): `RLIMIT_NPROC` of 0, under an
    /// unprivileged user when run as root (the limit does not bind root).
    #[test]
    fn a_large_scatter_copies_on_the_calling_thread_when_the_os_refuses_threads() {
        const CHILD: &str = "TIERKV_TEST_THREADS_REFUSED";
        const NAME: &str = "session::tests::a_large_scatter_copies_on_the_calling_thread_when_the_os_refuses_threads";
        if std::env::var_os(CHILD).is_none() {
            let run = std::process::Command::new(std::env::current_exe().unwrap())
                .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .output()
                .unwrap();
            let said = format!(
                "{}{}",
                String::from_utf8_lossy(&run.stdout),
                String::from_utf8_lossy(&run.stderr)
            );
            assert!(run.status.success(), "the copy with threads refused failed:\n{said}");
            assert!(
                said.contains("threads refused") || said.contains("one core"),
                "the test did not run in the child:\n{said}"
            );
            return;
        }
        const CHUNK: u64 = 256 << 10;
        const CHUNKS: u64 = 2 * PARALLEL_SCATTER_BYTES / CHUNK;
        let (kv, shared) = host_kv(CHUNK, CHUNKS);
        let blocks: Vec<[u64; 1]> = (0..CHUNKS).map(|b| [b]).collect();
        let hit: Vec<(&[u64], HitChunk)> = blocks
            .iter()
            .map(|b| (&b[..], HitChunk::Loaded(Arc::new(vec![b[0] as u8 + 1; CHUNK as usize]))))
            .collect();
        if scatter_threads() < 2 {
            println!("one core: a scatter uses no threads here");
            return;
        }
        // SAFETY: plain system calls on this process's own credentials and limits.
        unsafe {
            if libc::geteuid() == 0 {
                assert_eq!(libc::setuid(65534), 0, "{}", std::io::Error::last_os_error());
            }
            let none = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            assert_eq!(libc::setrlimit(libc::RLIMIT_NPROC, &none), 0);
        }
        assert!(std::thread::Builder::new().spawn(|| ()).is_err(), "the OS still gives threads");
        println!("threads refused");
        let copied = scatter_all(&kv, &hit, Peer::detached()).unwrap();
        assert_eq!(copied, CHUNK * CHUNKS);
        for b in 0..CHUNKS {
            assert!(shared.block(b).unwrap().iter().all(|&x| x == b as u8 + 1), "block {b}");
        }
    }

    /// A store of several windows waits for room once, not once per window: its windows share
    /// one deadline, `storage.store_backpressure` from its start, so a client whose own
    /// deadline is longer gets its answer in time. L1 is full of chunks three lookups hold, and
    /// of two whose copy the disk never answers (a store waits while such copies are under
    /// way). The room for the first window reserved comes within the wait, the room for the
    /// second after it: the second is refused, where a deadline per window stored it.
    #[test]
    fn a_store_of_two_windows_waits_for_room_one_store_backpressure_in_all() {
        // Long enough that a second of scheduling delay under load (the test thread starting the
        // store late, a release late) changes no outcome: the margins below are a quarter of it.
        const BACKPRESSURE: Duration = Duration::from_secs(4);
        let FullL1 { daemon, first, second, disk } = FullL1::new(BACKPRESSURE);
        let peer = Peer::detached();
        let (mut session, _kv) = worker(&daemon, FullL1::CHUNK, 4, peer);
        let chunks: Vec<ChunkBlocks> = (0..4)
            .map(|i| ChunkBlocks { chunk: ChunkId(1000 + i), blocks: vec![i as u64] })
            .collect();
        let store = RequestBody::Store { namespace: 0, buffer: 0, chunks, ready_event: None };

        // The releases are timed from `started`, taken before the store starts (its deadline
        // can only start later): room for the first window half way to the store's deadline;
        // for the second a quarter of the backpressure after that deadline, and a quarter before
        // the deadline a second window of its own would have had (1.5 x the backpressure).
        let started = Instant::now();
        let releaser = {
            let daemon = Arc::clone(&daemon);
            std::thread::spawn(move || {
                std::thread::sleep(
                    (started + BACKPRESSURE / 2).saturating_duration_since(Instant::now()),
                );
                daemon.storage().release_all(first).unwrap();
                let second_at = started + BACKPRESSURE * 5 / 4;
                std::thread::sleep(second_at.saturating_duration_since(Instant::now()));
                daemon.storage().release_all(second).unwrap();
            })
        };
        let answer = session.handle(store, &mut || None, peer);
        let took = started.elapsed();
        releaser.join().unwrap();
        let ReplyBody::Stored { stored, refused, .. } = answer.reply else {
            panic!("{:?}", answer.reply)
        };
        let refused: Vec<(u32, RefusalReason)> =
            refused.iter().map(|r| (r.index, r.reason)).collect();
        assert_eq!(
            (stored, refused),
            (2, vec![(0, RefusalReason::NoSpace), (1, RefusalReason::NoSpace)]),
            "the second window waited a store_backpressure of its own"
        );
        assert!(took < BACKPRESSURE * 3 / 2, "the store took {took:?}");
        disk.release_held();
    }

    /// A store whose window waits for room (L1 full of chunks lookups hold and of copies on
    /// their way down) is stored as soon as a lookup is released, not when the copies end or
    /// the store's deadline (30 s away) passes: the release wakes the wait. (The vLLM
    /// connector's stores run inside the engine's step, which a needless wait stalls.)
    #[test]
    fn a_store_waiting_for_room_is_stored_as_soon_as_a_lookup_is_released() {
        const BACKPRESSURE: Duration = Duration::from_secs(30);
        let FullL1 { daemon, first, disk, .. } = FullL1::new(BACKPRESSURE);
        let peer = Peer::detached();
        let (mut session, _kv) = worker(&daemon, FullL1::CHUNK, 2, peer);
        let releases = once_a_store_waits(&daemon, move |daemon| {
            daemon.storage().release_all(first).unwrap();
        });
        let chunks: Vec<ChunkBlocks> = (0..2)
            .map(|i| ChunkBlocks { chunk: ChunkId(1000 + i), blocks: vec![i as u64] })
            .collect();
        let store = RequestBody::Store { namespace: 0, buffer: 0, chunks, ready_event: None };
        let deadline = Instant::now() + BACKPRESSURE;
        let answer = session.handle(store, &mut || None, peer);
        assert!(Instant::now() < deadline, "the store waited out its deadline");
        releases.join().unwrap();
        assert!(matches!(answer.reply, ReplyBody::Stored { stored: 2, .. }), "{:?}", answer.reply);
        // The copies that held L1 are still held (the store's own write-through may be too).
        assert!(disk.held_tasks() >= 1, "the room came before the copies ended");
        disk.release_held();
    }

    /// A store of two windows given up on while its second window waited for room: the first
    /// window (the chain's tail, stored first) was finished before the client gave up, read
    /// while the client still held its blocks, and stays; the second is never made visible;
    /// the reply says what stayed rather than that nothing did.
    #[tokio::test]
    async fn a_store_given_up_on_between_windows_keeps_the_windows_before_and_says_so() {
        use tierkv_l1::Presence;
        // The second window waits for room; the client gives up, and `first` leaves room,
        // which wakes the wait (if the give-up did not end it first).
        let FullL1 { daemon, first, second, disk } = FullL1::new(Duration::from_secs(30));
        let (conn, theirs) = connected();
        let (mut session, _kv) = worker(&daemon, FullL1::CHUNK, 4, conn.peer());
        // Room for one window now; for the other once the client has given up.
        daemon.storage().release_all(second).unwrap();
        let gives_up = once_a_store_waits(&daemon, move |daemon| {
            theirs.shutdown(std::net::Shutdown::Write).unwrap();
            daemon.storage().release_all(first).unwrap();
            theirs
        });
        let chunks: Vec<ChunkBlocks> = (0..4)
            .map(|i| ChunkBlocks { chunk: ChunkId(1000 + i), blocks: vec![i as u64] })
            .collect();
        let store = RequestBody::Store { namespace: 0, buffer: 0, chunks, ready_event: None };
        let answer = session.handle(store, &mut || None, conn.peer());
        let _theirs = gives_up.join().unwrap();
        disk.release_held();
        let ReplyBody::Error { code: ErrorCode::Timeout, message } = answer.reply else {
            panic!("{:?}", answer.reply)
        };
        let presence = |chunk: u64| {
            let key = ObjectKey::new(
                Namespace::new("m", ""),
                ChunkHash(chunk.into()),
                KvRank::Rank { rank: 0, world: 1 },
            );
            daemon.storage().l1().presence(&key)
        };
        assert!(matches!(presence(1002), Presence::Ready { .. }), "{:?}", presence(1002));
        assert!(matches!(presence(1003), Presence::Ready { .. }), "{:?}", presence(1003));
        assert_eq!(presence(1000), Presence::Absent);
        assert_eq!(presence(1001), Presence::Absent);
        assert!(
            message.contains("the 2 chunks stored before") && !message.contains("nothing of it"),
            "the reply does not say what stayed: {message}"
        );
    }

    /// The same, the second window's wait for room finding none: the client gave up during it,
    /// which ends the wait then, not at the store's deadline (30 s away), and the window holds
    /// nothing it reserved; the reply is the give-up saying what stayed, not the second
    /// window's refusals.
    #[tokio::test]
    async fn a_store_given_up_on_while_its_window_waited_in_vain_for_room_says_what_stayed() {
        const BACKPRESSURE: Duration = Duration::from_secs(30);
        let FullL1 { daemon, first, disk, .. } = FullL1::new(BACKPRESSURE);
        let (conn, theirs) = connected();
        let (mut session, _kv) = worker(&daemon, FullL1::CHUNK, 4, conn.peer());
        // Room for one window, never for the other.
        daemon.storage().release_all(first).unwrap();
        let gives_up = once_a_store_waits(&daemon, move |_| {
            theirs.shutdown(std::net::Shutdown::Write).unwrap();
            theirs
        });
        let chunks: Vec<ChunkBlocks> = (0..4)
            .map(|i| ChunkBlocks { chunk: ChunkId(1000 + i), blocks: vec![i as u64] })
            .collect();
        let store = RequestBody::Store { namespace: 0, buffer: 0, chunks, ready_event: None };
        let deadline = Instant::now() + BACKPRESSURE;
        let answer = session.handle(store, &mut || None, conn.peer());
        assert!(Instant::now() < deadline, "the window waited out the store's deadline");
        let _theirs = gives_up.join().unwrap();
        disk.release_held();
        let ReplyBody::Error { code: ErrorCode::Timeout, message } = answer.reply else {
            panic!("{:?}", answer.reply)
        };
        assert!(message.contains("the 2 chunks stored before"), "{message}");
    }

    /// A lookup's owner releases it when its request finishes, often long after its retrieves
    /// ended it: however many lookups other sessions ended meanwhile, the owner's late release
    /// is `released` and its late retrieve `share_returned`, not `unknown_lookup`.
    #[test]
    fn a_late_release_of_a_lookup_that_ended_is_released_however_many_ended_since() {
        const CHUNK: u64 = 4 << 10;
        let daemon = Daemon::small(CHUNK);
        let peer = Peer::detached();
        let (mut owner, _owner_kv) = worker(&daemon, CHUNK, 1, peer);
        let (mut busy, _busy_kv) = worker(&daemon, CHUNK, 1, peer);
        let lookup = |session: &mut Session| {
            let lookup = RequestBody::Lookup {
                namespace: 0,
                chunks: vec![ChunkId(7)],
                defer_prefetch: false,
            };
            match session.handle(lookup, &mut || None, peer).reply {
                ReplyBody::LookupStarted { lookup, .. } => lookup,
                other => panic!("{other:?}"),
            }
        };
        // A miss: its retrieve names no chunks and returns the reader's share, which ends it.
        let retrieve = |session: &mut Session, lookup: u64| {
            let retrieve =
                RequestBody::Retrieve { lookup, buffer: 0, chunks: vec![], done_event: None };
            session.handle(retrieve, &mut || None, peer).reply
        };
        let ended = lookup(&mut owner);
        assert!(matches!(retrieve(&mut owner, ended), ReplyBody::Retrieved { .. }));
        for _ in 0..=ENDED_LOOKUPS {
            let other = lookup(&mut busy);
            assert!(matches!(retrieve(&mut busy, other), ReplyBody::Retrieved { .. }));
        }
        let again = retrieve(&mut owner, ended);
        assert!(
            matches!(again, ReplyBody::Error { code: ErrorCode::ShareReturned, .. }),
            "{again:?}"
        );
        let release = RequestBody::Release { lookup: ended };
        let released = owner.handle(release, &mut || None, peer).reply;
        assert!(matches!(released, ReplyBody::Released), "{released:?}");
    }

    #[test]
    fn chunks_of_half_a_slot_or_less_are_warned_of_and_larger_ones_are_not() {
        assert!(slot_waste(1 << 20, 1 << 20).is_none());
        assert!(slot_waste((1 << 20) / 2 + 1, 1 << 20).is_none());
        let warning = slot_waste(2 << 20, 16 << 20).unwrap();
        assert!(warning.contains("88%") && warning.contains("l1.slot"), "{warning}");
        assert!(slot_waste(0, 1 << 20).is_none());
    }
}
