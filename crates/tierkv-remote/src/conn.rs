//! The link to Redis: one multiplexed connection (a cluster connection, or one to a single
//! server), opened lazily, dropped when it fails, reopened at most once per reconnect interval.
//! Every call has a deadline. The link's health is what `status` reports as degraded.
//!
//! Each connection opened has a generation, and each call remembers the generation it used and
//! when it sent its command. Only a failure on the current connection says anything about the
//! link: a call that fails late on a connection already replaced (dropped after another call's
//! failure, and reopened since) leaves the new one alone, and a late success on an old one does
//! not declare the link healthy.
//!
//! A call past its deadline is a link failure only if the connection answered nothing at all
//! since the call sent its command: the link is silent, hung. If it answered other calls in
//! the meantime, it is busy, not broken (the call queued behind others' bytes on the one
//! connection, a long pipeline of large `SET`s): the call fails alone, as `busy`, and the tier
//! stays healthy. In a cluster one hung master looks busy too (the others answer), so a busy
//! timeout there renews the connection in the background, at most once per reconnect interval,
//! keeping the current one until the new one is open: the new connection learns the slot map
//! afresh, which is how a hung master's slots move to its promoted replica. Likewise a call that
//! fails for the link's sake at once (a dead master refuses it) while the cluster connection
//! answered other calls within the op deadline: one master's failure, not the link's. The tier
//! is degraded, but the connection stays and the other masters' keys keep hitting.
//!
//! In a cluster, a call that succeeds proves one master alive, not the link: with a master
//! dead, calls to the others succeed and calls to its slots fail, and a tier healed by every
//! success flapped between healthy and degraded. So there only a probe heals a degraded link,
//! and only once it reached every master the slots map to (`CLUSTER SLOTS` of the nodes it
//! knows, each by address, and a `PING` of a master not among them: the cluster client's own
//! `PING` to all masters skips a master it holds no connection to, a dead one). A call that
//! succeeds on a degraded cluster link starts such a probe, so a link that works again heals at
//! once. Probes run one at a time, the maintenance thread's too: two at once could end in
//! either order, and the older view of the cluster overwrite the newer.
//!
//! A probe asks the nodes over connections of its own, one a node, not through the cluster
//! client, and a master that has not answered within the op deadline of its question (a `PING`
//! sent once a slow slot map came has a whole deadline too), or that refuses the probe's
//! connection (dead), is *silent* (hung, cut off, or down): calls to that master's slots fail
//! at once, as misses, until a probe finds it answering or its slots served by another master. They must not reach the cluster client
//! (redis 1.8): a call that finds no connection to its slot's master (a cluster connection
//! opened while the master hung holds none to it) goes to another node, whose
//! `MOVED` makes the client refresh its slot map, and while `refresh_slots` runs (holding the
//! connections' write lock, connecting and `PING`ing every node, the hung one until its response
//! timeout) `poll_flush` polls no other request: every master's calls passed their deadline,
//! and one hung master took the whole tier's hits away. A timeout in a cluster starts a probe
//! (at most one a reconnect interval), so a hung master is found silent within a deadline or
//! two; so does a call to a silent master's slots, so its recovery or failover is noticed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::{
    Arg, AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, FromRedisValue,
    IntoConnectionInfo, Value,
};

use crate::config::{RemoteConfig, RemoteMode, without_secrets};
use crate::error::{CallError, is_link};

#[derive(Clone)]
enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

/// A cluster node, by address.
type Node = (String, u16);

/// Slots `first..=last` of a cluster, and the master that serves them.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SlotRange {
    first: u16,
    last: u16,
    master: Node,
}

/// The connection calls use now.
struct Current {
    conn: Conn,
    /// Which connection this is: 1 for the first opened, then one more for each.
    generation: u64,
    /// When a call on it last got an answer (a value or a server's error), or when it opened.
    last_answer: Instant,
}

struct State {
    conn: Option<Current>,
    /// Connections opened so far (the generation of the last one).
    generation: u64,
    last_attempt: Option<Instant>,
    /// A connection is being opened (by a task of its own).
    connecting: bool,
    /// Why the last attempt to open a connection failed.
    connect_error: Option<String>,
    /// Why the tier is degraded; `None` while calls succeed.
    degraded: Option<String>,
    /// When a call last failed for the link's sake.
    last_failure: Option<Instant>,
    /// A probe started by a call's success on a degraded cluster link is under way.
    probing: bool,
    /// When a call last started one: at most one a reconnect interval, since calls go on while
    /// a master is unreachable.
    probed: Option<Instant>,
    /// The cluster's slot map as the last probe learnt it (empty until one did).
    slots: Vec<SlotRange>,
    /// The masters of `slots` the last probe found silent: no answer within its deadline (a
    /// hung server, or a partition), or the connection refused (a dead one). Calls to their
    /// slots fail at once (see [`Link::call`]).
    silent: Vec<Node>,
    /// Which of `silent` serves each slot: 0 for none, else its index in `silent` plus one.
    /// Empty while no master is silent. A call finds its slot's master here in one step, under
    /// the lock every call takes anyway, where a scan of `slots` took as long as the map is
    /// fragmented (16,384 ranges at worst).
    silent_slots: Vec<u16>,
    /// The last connection (its generation) a call found busy: it timed out while the
    /// connection answered others. Calls on it that run out of time after it was replaced
    /// waited behind the same backlog.
    busy: Option<u64>,
}

/// Which connection a call used, and when it sent its command on it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Used {
    generation: u64,
    sent: Instant,
}

#[derive(Clone)]
pub(crate) struct Link {
    config: RemoteConfig,
    state: Arc<Mutex<State>>,
    /// Bumped each time an attempt to open a connection ends, for the calls waiting on it.
    opened: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Link {
    pub(crate) fn new(config: RemoteConfig) -> Self {
        Link {
            config,
            state: Arc::new(Mutex::new(State {
                conn: None,
                generation: 0,
                last_attempt: None,
                connecting: false,
                connect_error: None,
                degraded: Some("not connected yet".into()),
                last_failure: None,
                probing: false,
                probed: None,
                slots: Vec::new(),
                silent: Vec::new(),
                silent_slots: Vec::new(),
                busy: None,
            })),
            opened: Arc::new(tokio::sync::watch::channel(0).0),
        }
    }

    /// Why the tier is degraded, if it is.
    pub(crate) fn degraded(&self) -> Option<String> {
        self.state.lock().degraded.clone()
    }

    /// Runs `cmd` within the op deadline; a failure of the link drops the connection and marks
    /// the tier degraded, a success marks it healthy.
    ///
    /// While the tier is degraded, calls fail at once (as misses) until `reconnect_interval` has
    /// passed since the last failure; then calls try again (and [`Link::probe`] tries at any
    /// time). So a hung cluster costs the op deadline once per interval, not on every lookup:
    /// the prefetch pipeline waits for every tier's answer, and must not wait for this one.
    ///
    /// In a cluster, a call to the slots of a master the last probe found silent fails at once
    /// too (and starts a probe, at most one a reconnect interval, which lets its calls through
    /// once it answers or its slots moved): sent, it would pass its deadline, and the cluster
    /// client would hold every other master's calls while it refreshed its slot map from the
    /// silent node (see the module's docs).
    pub(crate) async fn call<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, CallError> {
        {
            let mut state = self.state.lock();
            if let (Some(why), Some(failed)) = (&state.degraded, state.last_failure)
                && failed.elapsed() < self.config.reconnect_interval
            {
                return Err(CallError::Unavailable(why.clone()));
            }
            if let Some((host, port)) = silent_master(&state, cmd) {
                let why = format!("the master {host}:{port} of its slot does not answer");
                self.start_probe(&mut state);
                return Err(CallError::Unavailable(why));
            }
        }
        self.attempt(cmd).await
    }

    /// Probes the link now ([`Link::probe`]) unless a probe is under way: whether it is healthy,
    /// `None` if another probe was under way. The maintenance thread's probes come this way,
    /// at any time; a call's at most once a reconnect interval ([`Link::start_probe`]).
    pub(crate) async fn probe_alone(&self) -> Option<bool> {
        if !self.claim_probe(&mut self.state.lock()) {
            return None;
        }
        Some(self.probe().await)
    }

    /// Marks a probe under way, unless one is: whether it may run. One probe at a time: two at
    /// once could end in either order, and the one that ended last would leave its view of the
    /// cluster (its slot map, its silent masters) even if it was the older one.
    fn claim_probe(&self, state: &mut State) -> bool {
        if state.probing {
            return false;
        }
        state.probing = true;
        state.probed = Some(Instant::now());
        true
    }

    /// Checks the link now, degraded or not: a `PING` of the server, or in a cluster of every
    /// master the slots map to; whether every one answered. Only a probe heals a degraded
    /// cluster link. Runs after [`Link::claim_probe`], and ends the probe it claimed.
    async fn probe(&self) -> bool {
        let mut used = None;
        let result = self.probe_inner(&mut used).await;
        let healthy = self.judge(used, result, true).is_ok();
        self.state.lock().probing = false;
        healthy
    }

    async fn probe_inner(&self, used: &mut Option<Used>) -> Result<(), CallError> {
        if self.config.mode == RemoteMode::Cluster {
            let sent = Instant::now();
            match self.probe_nodes().await {
                // Some master missed: whatever connection calls use now stays (see `judge`).
                Probed::Masters(Some(missed)) => {
                    *used = self.used_now(sent);
                    return Err(CallError::Unreachable(missed));
                }
                Probed::NoAnswer(e) => {
                    *used = self.used_now(sent);
                    return Err(e);
                }
                // Every master answered: the link heals once the connection calls use answers
                // too (below).
                Probed::Masters(None) | Probed::NotCluster => {}
            }
        }
        let deadline = self.config.op_timeout;
        let ping = async {
            let (conn, generation) = self.connection().await?;
            *used = Some(Used { generation, sent: Instant::now() });
            match conn {
                Conn::Single(mut c) => answered(redis::cmd("PING").query_async(&mut c).await),
                Conn::Cluster(mut c) => answered(redis::cmd("PING").query_async(&mut c).await),
            }
        };
        match tokio::time::timeout(deadline, ping).await {
            Ok(result) => result,
            Err(_) => Err(CallError::Timeout(deadline)),
        }
    }

    /// The connection calls use now, as used by a call that sent its command at `sent`.
    fn used_now(&self, sent: Instant) -> Option<Used> {
        self.state.lock().conn.as_ref().map(|c| Used { generation: c.generation, sent })
    }

    /// Asks the cluster's nodes themselves, each over a connection of its own opened for the
    /// probe (never through the cluster client, whose slot refresh a silent node stalls, and
    /// whose `PING` of all masters skips one it holds no connection to), one connection a node:
    /// `CLUSTER SLOTS` of the masters known and the seed nodes, all at once, the slot map taken
    /// from the first that answers with one; a master it names that was asked has answered
    /// (or will), and one that was not is sent a `PING`. Each node's answer is due within the op
    /// deadline of its own question: a `PING` sent once a slow slot map came has the whole
    /// deadline too, not what the slot map left of one. Records the slot map and the masters
    /// that answered nothing in time (silent), and renews the connection when the slot map's
    /// masters changed (a failover: the cluster client would keep routing to the old one, if
    /// it is hung).
    async fn probe_nodes(&self) -> Probed {
        let base = match self.config.urls.first().map(|url| url.as_str().into_connection_info()) {
            Some(Ok(info)) => info,
            _ => return Probed::NotCluster,
        };
        let mut asked: Vec<Node> = Vec::new();
        for range in &self.state.lock().slots {
            if !asked.contains(&range.master) {
                asked.push(range.master.clone());
            }
        }
        for url in &self.config.urls {
            if let Ok(info) = url.as_str().into_connection_info()
                && let ConnectionAddr::Tcp(host, port) = info.addr()
                && !asked.contains(&(host.clone(), *port))
            {
                asked.push((host.clone(), *port));
            }
        }

        let (connect_timeout, within) = (self.config.connect_timeout, self.config.op_timeout);
        let mut asks = tokio::task::JoinSet::new();
        let ask_of = |asks: &mut Asks, node: Node, cmd: Cmd| {
            let base = base.clone();
            asks.spawn(async move {
                let reply = ask(&base, &node, &cmd, connect_timeout, within).await;
                (node, reply)
            });
        };
        for node in &asked {
            ask_of(&mut asks, node.clone(), redis::cmd("CLUSTER").arg("SLOTS").clone());
        }
        // What each node's answer says of it, as it came.
        let mut heard: HashMap<Node, Heard> = HashMap::new();
        let (mut refused, mut failure) = (false, None);
        let ranges = loop {
            let Some(joined) = asks.join_next().await else { break None };
            let Ok((node, reply)) = joined else { continue };
            heard.insert(node.clone(), Heard::of(&reply));
            match reply {
                Ok(Some(reply)) => match ranges_of(&reply, &node.0) {
                    // An empty map (a node not yet in the cluster, or one that lost its
                    // nodes.conf) says nothing of the masters: another node's answer is taken.
                    Some(ranges) if ranges.is_empty() => {}
                    Some(ranges) => break Some(ranges),
                    None => refused = true,
                },
                // Refused (an ACL) or not understood (a server not in cluster mode, a proxy
                // that renames or hides CLUSTER): the node answered.
                Err(e) if !is_link(&e) => refused = true,
                Err(e) => failure = Some(CallError::from(e)),
                Ok(None) => {}
            }
        };
        let Some(mut ranges) = ranges else {
            if refused {
                return Probed::NotCluster;
            }
            return Probed::NoAnswer(failure.unwrap_or(CallError::Timeout(self.config.op_timeout)));
        };
        ranges.sort_by_key(|r| r.first);

        let mut masters: Vec<Node> = Vec::new();
        for range in &ranges {
            if !masters.contains(&range.master) {
                masters.push(range.master.clone());
            }
        }
        for master in masters.iter().filter(|m| !asked.contains(m)) {
            ask_of(&mut asks, master.clone(), redis::cmd("PING"));
        }
        // Every master's answer, or its deadline; the other nodes' are not waited for.
        while masters.iter().any(|m| !heard.contains_key(m)) {
            let Some(joined) = asks.join_next().await else { break };
            if let Ok((node, reply)) = joined {
                heard.insert(node, Heard::of(&reply));
            }
        }
        // The asks still under way end here.
        drop(asks);
        let (mut silent, mut missed) = (Vec::new(), Vec::new());
        for master in masters {
            let (host, port) = &master;
            match heard.remove(&master) {
                Some(Heard::Alive) => {}
                Some(Heard::Refused(why)) => missed.push(format!("{host}:{port}: {why}")),
                Some(Heard::Silent(why)) => {
                    missed.push(format!("{host}:{port}: {why}"));
                    silent.push(master);
                }
                None => missed.push(format!("{host}:{port}: the probe's question failed")),
            }
        }
        silent.sort();

        let mut state = self.state.lock();
        if silent != state.silent {
            for (host, port) in silent.iter().filter(|m| !state.silent.contains(m)) {
                tracing::warn!(
                    "the remote master {host}:{port} does not answer: calls to its slots miss \
                     at once until it does"
                );
            }
            for (host, port) in state.silent.iter().filter(|m| !silent.contains(m)) {
                tracing::info!("the remote master {host}:{port} answers again, or left");
            }
        }
        let moved = !state.slots.is_empty() && state.slots != ranges;
        state.silent_slots = silent_slots(&ranges, &silent);
        state.slots = ranges;
        state.silent = silent;
        if moved {
            self.renew(&mut state, "the cluster's slot map changed");
        }
        Probed::Masters((!missed.is_empty()).then(|| missed.join(", ")))
    }

    /// Starts a probe in the background ([`Link::probe`]) for a call, unless one is under way or
    /// one started within the reconnect interval.
    fn start_probe(&self, state: &mut State) {
        if state.probed.is_some_and(|at| at.elapsed() < self.config.reconnect_interval) {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current()
            && self.claim_probe(state)
        {
            let link = self.clone();
            runtime.spawn(async move { link.probe().await });
        }
    }

    async fn attempt<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, CallError> {
        let (used, result) = self.send(cmd).await;
        self.settle(used, result)
    }

    /// Runs `cmd` within the op deadline, without judging the link: the result, and which
    /// connection it used (`None` if it got none). [`Link::settle`] judges.
    pub(crate) async fn send<T: FromRedisValue>(
        &self,
        cmd: &Cmd,
    ) -> (Option<Used>, Result<T, CallError>) {
        let deadline = self.config.op_timeout;
        let mut used = None;
        let result = match tokio::time::timeout(deadline, self.call_inner(cmd, &mut used)).await {
            Ok(result) => result,
            Err(_) => Err(CallError::Timeout(deadline)),
        };
        (used, result)
    }

    /// What the result of a call on `used` says about the link: a link failure of the current
    /// connection drops it and marks the tier degraded, an answer on it marks it alive (and a
    /// success, healthy). Returns the result, a timeout on a busy connection as
    /// [`CallError::Busy`].
    pub(crate) fn settle<T>(
        &self,
        used: Option<Used>,
        result: Result<T, CallError>,
    ) -> Result<T, CallError> {
        // One server: its answer is the link's. A cluster's: one master's only.
        self.judge(used, result, self.config.mode == RemoteMode::Standalone)
    }

    /// [`Link::settle`]; a success heals a degraded link only if it `heals` (a probe's, or any
    /// call's on one server), else it starts a probe.
    fn judge<T>(
        &self,
        used: Option<Used>,
        result: Result<T, CallError>,
        heals: bool,
    ) -> Result<T, CallError> {
        let mut state = self.state.lock();
        let current = state.conn.as_ref().map(|c| c.generation);
        if let Some(used) = used
            && Some(used.generation) != current
        {
            // The connection this call used is gone (dropped after another call's failure, or
            // renewed): what happened on it says nothing about the one calls use now. A call that
            // ran out of time on one found busy (and so renewed) waited behind its backlog: it
            // is `busy` too, not a failure of the link.
            return match result {
                Err(e) if e.is_timeout() && state.busy == Some(used.generation) => {
                    Err(CallError::Busy(self.config.op_timeout))
                }
                other => other,
            };
        }
        match &result {
            Ok(_) => {
                if let Some(c) = state.conn.as_mut() {
                    c.last_answer = Instant::now();
                }
                if state.degraded.is_some() && heals {
                    tracing::info!("the remote tier answers again");
                    state.degraded = None;
                } else if state.degraded.is_some() {
                    // Whether every master answers, now, rather than at the next lookup.
                    self.start_probe(&mut state);
                }
                result
            }
            // A call refused while the link reconnects says nothing new: the reason stays the
            // failure that degraded it.
            Err(CallError::Unavailable(_)) => result,
            // A probe that reached some masters but not every one: the tier is degraded (only a
            // probe heals it), but the connection stays and calls go on, served by the masters
            // that answer; a call to a dead master's slots fails, and drops the link, by itself.
            Err(e @ CallError::Unreachable(_)) => {
                if state.degraded.is_none() {
                    tracing::warn!(error = %e, "the remote tier is degraded: a master is unreachable");
                }
                state.degraded = Some(e.to_string());
                result
            }
            Err(e) if e.is_timeout() => {
                if self.config.mode == RemoteMode::Cluster {
                    // Whether one master is silent, now: then calls to its slots stop going out
                    // (and holding the others' in the cluster client's slot refresh).
                    self.start_probe(&mut state);
                }
                let busy = match (used, state.conn.as_ref()) {
                    (Some(used), Some(c)) => c.last_answer > used.sent,
                    _ => false,
                };
                if !busy {
                    self.link_failed(&mut state, used.is_some(), e);
                    return result;
                }
                state.busy = used.map(|u| u.generation);
                if self.config.mode == RemoteMode::Cluster {
                    self.renew(&mut state, "a remote call timed out on a busy connection");
                }
                Err(CallError::Busy(self.config.op_timeout))
            }
            Err(e) if e.is_connection() && self.one_master(&state, used) => {
                // One master's failure, not the link's: the tier is degraded (only a probe that
                // reaches every master heals it), but the connection stays and calls go on,
                // the other masters' keys hitting. A new connection, opened in the background,
                // learns the slot map afresh once the master's replica took over.
                if state.degraded.is_none() {
                    tracing::warn!(error = %e, "the remote tier is degraded: a master fails");
                }
                state.degraded = Some(e.to_string());
                self.renew(&mut state, "a remote call to one master failed");
                result
            }
            Err(e) if e.is_connection() => {
                self.link_failed(&mut state, used.is_some(), e);
                result
            }
            // Redis answered, with an error of this one command (a full server refusing a SET).
            Err(CallError::Redis(_)) => {
                if let Some(c) = state.conn.as_mut() {
                    c.last_answer = Instant::now();
                }
                result
            }
            Err(_) => result,
        }
    }

    /// Whether a call that failed for the link's sake on `used` (not by its deadline: see
    /// [`CallError::Busy`]) failed for one master's: in a cluster, on the current connection,
    /// which answered another call within the last op deadline. A dead master refuses its
    /// calls at once while the others answer; dropping the connection for it, and failing
    /// every call for a reconnect interval, took the live masters' keys down with it each
    /// time a call went to the dead master's slots, which is every interval under load. A
    /// cluster gone or partitioned whole answers nothing, and fails as the link within a
    /// deadline.
    fn one_master(&self, state: &State, used: Option<Used>) -> bool {
        let current = state.conn.as_ref();
        self.config.mode == RemoteMode::Cluster
            && used.is_some_and(|u| current.is_some_and(|c| c.generation == u.generation))
            && current.is_some_and(|c| c.last_answer.elapsed() < self.config.op_timeout)
    }

    /// A call failed for the link's sake: on the current connection (`on_current`), which goes,
    /// or before it got any connection. The tier is degraded unless a connection opened since.
    fn link_failed(&self, state: &mut State, on_current: bool, e: &CallError) {
        if !on_current && state.conn.is_some() {
            // It waited for a connection that opened after its deadline, or failed to open while
            // another opened: the link works.
            return;
        }
        if state.degraded.is_none() {
            tracing::warn!(error = %e, "the remote tier is degraded: its calls are misses");
        }
        state.degraded = Some(e.to_string());
        state.last_failure = Some(Instant::now());
        // The connection goes, a timeout's too: a hung master never answers the cluster client,
        // which then keeps routing its slots to it after its replica took over. The next
        // connection learns the slot map afresh.
        state.conn = None;
    }

    /// Opens a new connection in the background, unless one is being opened or the last attempt
    /// is more recent than the reconnect interval; calls use the current one until it is open.
    fn renew(&self, state: &mut State, why: &str) {
        let due =
            state.last_attempt.is_none_or(|last| last.elapsed() >= self.config.reconnect_interval);
        if !state.connecting && due {
            tracing::info!("{why}: renewing the connection");
            state.connecting = true;
            state.last_attempt = Some(Instant::now());
            self.start_opening();
        }
    }

    async fn call_inner<T: FromRedisValue>(
        &self,
        cmd: &Cmd,
        used: &mut Option<Used>,
    ) -> Result<T, CallError> {
        let (conn, generation) = self.connection().await?;
        *used = Some(Used { generation, sent: Instant::now() });
        match conn {
            Conn::Single(mut c) => Ok(cmd.query_async(&mut c).await?),
            Conn::Cluster(mut c) => Ok(cmd.query_async(&mut c).await?),
        }
    }

    /// The connection, opening one if there is none. The opening runs as a task of its own, so
    /// a caller's deadline cannot cut it short (a cluster connection connects to every seed node
    /// at once, and a hung seed takes its whole connect timeout): callers wait for it within
    /// their own deadline, and at most one attempt starts per reconnect interval.
    async fn connection(&self) -> Result<(Conn, u64), CallError> {
        if let Some(c) = &self.state.lock().conn {
            return Ok((c.conn.clone(), c.generation));
        }
        // Subscribed before the state is read again, so an attempt that ends in between is seen.
        let mut opened = self.opened.subscribe();
        {
            let mut state = self.state.lock();
            if let Some(c) = &state.conn {
                return Ok((c.conn.clone(), c.generation));
            }
            if !state.connecting {
                if let Some(last) = state.last_attempt
                    && last.elapsed() < self.config.reconnect_interval
                {
                    let why = state.connect_error.clone().unwrap_or_else(|| "reconnecting".into());
                    return Err(CallError::Unavailable(why));
                }
                state.connecting = true;
                state.last_attempt = Some(Instant::now());
                self.start_opening();
            }
        }
        // Wait for the attempt under way (the caller's deadline bounds the wait).
        let _ = opened.changed().await;
        let state = self.state.lock();
        match (&state.conn, &state.connect_error) {
            (Some(c), _) => Ok((c.conn.clone(), c.generation)),
            (None, Some(why)) => Err(CallError::Connect(why.clone())),
            (None, None) => Err(CallError::Unavailable("reconnecting".into())),
        }
    }

    fn start_opening(&self) {
        let (config, state, opened) =
            (self.config.clone(), Arc::clone(&self.state), Arc::clone(&self.opened));
        tokio::spawn(async move {
            // Every seed within the connect timeout, then the slot map (a call).
            let limit = config.connect_timeout * 2 + config.op_timeout;
            let result = match tokio::time::timeout(limit, open(&config)).await {
                Ok(Ok(conn)) => Ok(conn),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no connection within {limit:?}")),
            };
            {
                let mut state = state.lock();
                state.connecting = false;
                match result {
                    Ok(conn) => {
                        state.generation += 1;
                        let generation = state.generation;
                        state.conn =
                            Some(Current { conn, generation, last_answer: Instant::now() });
                        state.connect_error = None;
                    }
                    // A renewal that failed keeps the connection calls use now.
                    Err(why) => state.connect_error = Some(why),
                }
            }
            opened.send_modify(|n| *n += 1);
        });
    }
}

/// A `PING`'s answer: any reply, or a refusal of the command (an ACL without `PING`), says the
/// server is there; the tier would otherwise stay degraded until the next lookup.
fn answered(reply: redis::RedisResult<Value>) -> Result<(), CallError> {
    match reply {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some("NOPERM") => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// What a probe of a cluster's nodes found.
enum Probed {
    /// The slot map, and every master it names answered (`None`) or some did not (why).
    Masters(Option<String>),
    /// No node answered `CLUSTER SLOTS` (all silent, or refused): why.
    NoAnswer(CallError),
    /// A node answered `CLUSTER SLOTS` with a refusal or a reply that is no slot map: a probe
    /// through the cluster connection's `PING` is all there is.
    NotCluster,
}

/// A probe's questions under way, each to a node.
type Asks = tokio::task::JoinSet<(Node, redis::RedisResult<Option<Value>>)>;

/// What a node's answer to a probe's question says of it.
enum Heard {
    /// It answered: a reply, or a refusal of the command (an ACL without it).
    Alive,
    /// It answered with an error: why. Not silent, but not serving either.
    Refused(String),
    /// Hung (no answer in time) or down (the connection refused: a dead master, whose calls
    /// the cluster client would retry and reconnect for): why.
    Silent(String),
}

impl Heard {
    fn of(reply: &redis::RedisResult<Option<Value>>) -> Self {
        match reply {
            Ok(Some(_)) => Heard::Alive,
            Ok(None) => Heard::Silent("no answer".into()),
            Err(e) if e.code() == Some("NOPERM") => Heard::Alive,
            Err(e) if is_link(e) => Heard::Silent(e.to_string()),
            Err(e) => Heard::Refused(e.to_string()),
        }
    }
}

/// `cmd` sent to `node` over a connection of its own (the credentials of `base`): the reply, or
/// `None` if none came `within` this of the question (the connection's opening included).
async fn ask(
    base: &ConnectionInfo,
    node: &Node,
    cmd: &Cmd,
    connect_timeout: Duration,
    within: Duration,
) -> redis::RedisResult<Option<Value>> {
    let by = tokio::time::Instant::now() + within;
    let info = base.clone().set_addr(ConnectionAddr::Tcp(node.0.clone(), node.1));
    let asked = async {
        let client = redis::Client::open(info)?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(None);
        let mut conn = client.get_multiplexed_async_connection_with_config(&config).await?;
        cmd.query_async::<Value>(&mut conn).await
    };
    match tokio::time::timeout_at(by, asked).await {
        Ok(Ok(reply)) => Ok(Some(reply)),
        Ok(Err(e)) if e.is_timeout() => Ok(None),
        Ok(Err(e)) => Err(e),
        Err(_) => Ok(None),
    }
}

/// The slot ranges and their masters of a `CLUSTER SLOTS` reply from `host`; `None` if it is
/// not one.
fn ranges_of(slots: &Value, host: &str) -> Option<Vec<SlotRange>> {
    let Value::Array(ranges) = slots else { return None };
    let mut found = Vec::new();
    for range in ranges {
        let Value::Array(fields) = range else { return None };
        let slot = |i: usize| match fields.get(i) {
            Some(Value::Int(slot)) => u16::try_from(*slot).ok(),
            _ => None,
        };
        let (first, last) = (slot(0)?, slot(1)?);
        let Some(Value::Array(master)) = fields.get(2) else { return None };
        let master_host = match master.first() {
            Some(Value::BulkString(h)) => String::from_utf8(h.clone()).ok()?,
            Some(Value::SimpleString(h)) => h.clone(),
            _ => return None,
        };
        let port = match master.get(1) {
            Some(Value::Int(port)) => u16::try_from(*port).ok()?,
            _ => return None,
        };
        // An empty host is the answering node's own.
        let master_host = if master_host.is_empty() { host.to_string() } else { master_host };
        found.push(SlotRange { first, last, master: (master_host, port) });
    }
    Some(found)
}

/// The master the last probe found silent that serves the slot of `cmd`'s key (its first
/// argument, as in every call of the tier), if there is one.
fn silent_master<'s>(state: &'s State, cmd: &Cmd) -> Option<&'s Node> {
    if state.silent_slots.is_empty() {
        return None;
    }
    let Some(Arg::Simple(key)) = cmd.args_iter().nth(1) else { return None };
    let master = *state.silent_slots.get(usize::from(key_slot(key)))?;
    state.silent.get(usize::from(master).checked_sub(1)?)
}

/// The cluster's slots in a table ([`State::silent_slots`]): for each, 0, or the index in
/// `silent` of the master `ranges` says serves it, plus one. Empty if no master is silent.
fn silent_slots(ranges: &[SlotRange], silent: &[Node]) -> Vec<u16> {
    if silent.is_empty() {
        return Vec::new();
    }
    let mut table = vec![0u16; SLOTS];
    for range in ranges {
        let Some(i) = silent.iter().position(|m| *m == range.master) else { continue };
        // At most one master a slot, so fewer than 16,384 silent ones: the index fits.
        let Ok(entry) = u16::try_from(i + 1) else { continue };
        let slots = usize::from(range.first)..=usize::from(range.last).min(SLOTS - 1);
        if let Some(entries) = table.get_mut(slots) {
            entries.fill(entry);
        }
    }
    table
}

/// The slots of a Redis Cluster.
const SLOTS: usize = 16384;

/// The cluster slot of `key`: CRC16 (XMODEM) of its hash tag (the first `{...}`, if not empty)
/// or of the whole key, modulo 16384, as Redis computes it.
fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let close = key[open + 1..].iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &key[open + 1..open + 1 + close])
    });
    let mut crc: u16 = 0;
    for &byte in tagged.unwrap_or(key) {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % SLOTS as u16
}

/// Opens a connection as `c` says.
async fn open(c: &RemoteConfig) -> redis::RedisResult<Conn> {
    match c.mode {
        RemoteMode::Standalone => {
            let url = c.urls.first().map(String::as_str).unwrap_or_default();
            let client = redis::Client::open(url)?;
            let config = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(c.connect_timeout))
                .set_response_timeout(Some(c.op_timeout));
            let mut conn = client.get_multiplexed_async_connection_with_config(&config).await?;
            // A node of a Redis Cluster answers every key of another master's slots with
            // `MOVED`: as one server it would serve a third of the keys (with three masters)
            // and fail the rest, and the tier would flap between degraded and healthy. It is
            // refused here, saying which setting is wrong. A server that does not let us ask
            // (an ACL without `INFO`) is taken as it is.
            let info: redis::RedisResult<String> =
                redis::cmd("INFO").arg("cluster").query_async(&mut conn).await;
            if info.is_ok_and(|info| info.lines().any(|l| l.trim() == "cluster_enabled:1")) {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "a Redis Cluster node",
                    format!(
                        "{} is a node of a Redis Cluster: set remote.mode = \"cluster\"",
                        without_secrets(url)
                    ),
                )));
            }
            Ok(Conn::Single(conn))
        }
        RemoteMode::Cluster => {
            let client = redis::cluster::ClusterClient::builder(c.urls.clone())
                .connection_timeout(c.connect_timeout)
                .response_timeout(c.op_timeout)
                .retries(3)
                .min_retry_wait(10)
                .max_retry_wait(c.op_timeout.as_millis().min(500) as u64)
                .build()?;
            Ok(Conn::Cluster(client.get_async_connection().await?))
        }
    }
}

impl Link {
    /// How long a caller waits at most for one call.
    pub(crate) fn op_timeout(&self) -> Duration {
        self.config.op_timeout
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

    use std::sync::Arc;
    use std::time::Duration;

    use tierkv_testkit::redis::{RedisCluster, RedisStandalone};
    use tierkv_testkit::require_redis;

    use super::*;

    /// One cluster for this module's tests, lent to one test at a time: they pause its nodes or
    /// count the connections its nodes accept, which another test's calls would disturb.
    async fn cluster() -> tokio::sync::MutexGuard<'static, RedisCluster> {
        static CLUSTER: std::sync::OnceLock<tokio::sync::Mutex<RedisCluster>> =
            std::sync::OnceLock::new();
        CLUSTER.get_or_init(|| tokio::sync::Mutex::new(RedisCluster::start())).lock().await
    }

    fn cluster_link(urls: Vec<String>, op_timeout: Duration) -> Link {
        Link::new(RemoteConfig {
            op_timeout,
            connect_timeout: op_timeout,
            reconnect_interval: Duration::from_millis(20),
            ..RemoteConfig::new(urls, RemoteMode::Cluster, 1 << 20)
        })
    }

    /// The client connections `node` has accepted so far, this question's own included.
    fn connections_received(node: &tierkv_testkit::redis::RedisNode) -> u64 {
        let stats = node.cli(&["INFO", "stats"]);
        let line = stats.lines().find_map(|l| l.strip_prefix("total_connections_received:"));
        line.and_then(|n| n.trim().parse().ok()).unwrap()
    }

    fn link(server: &RedisStandalone, op_timeout: Duration) -> Link {
        Link::new(RemoteConfig {
            op_timeout,
            reconnect_interval: Duration::from_millis(20),
            ..RemoteConfig::new(vec![server.url()], RemoteMode::Standalone, 1 << 20)
        })
    }

    #[test]
    fn key_slots_are_redis_cluster_slots() {
        // Redis's own CLUSTER KEYSLOT answers.
        assert_eq!(key_slot(b"123456789"), 12739);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_ne!(key_slot(b"foo{}{bar}"), key_slot(b"bar"));
        for key in ["tierkv:0123:abcd:s0.0:0", "a", "", "{x}y"] {
            let theirs = format!("{:?}", redis::cluster_routing::Slot::for_key(key));
            assert_eq!(theirs, format!("Slot({})", key_slot(key.as_bytes())), "{key}");
        }
    }

    /// The table a call looks its slot up in says what the slot map and the silent masters
    /// say, slot by slot, on a map fragmented as resharding leaves it, with slots no master
    /// serves; and says nothing while no master is silent.
    #[test]
    fn a_calls_slot_finds_its_silent_master_in_the_table() {
        let master = |port: u16| ("127.0.0.1".to_string(), port);
        let mut ranges = Vec::new();
        let mut first = 0u16;
        for i in 0..600u16 {
            // Ranges of 1 to 40 slots, every third followed by a slot no master serves, and the
            // last few thousand slots served by none.
            let last = (first + i % 40).min(16383);
            ranges.push(SlotRange { first, last, master: master(7000 + i % 5) });
            first = last + 1 + u16::from(i % 3 == 0);
            if first > 16383 {
                break;
            }
        }
        let silent = vec![master(7001), master(7003)];
        let link = Link::new(RemoteConfig::new(vec!["redis://x".into()], RemoteMode::Cluster, 1));
        let mut state = link.state.lock();
        assert!(silent_master(&state, &cmd(&["EXISTS", "a"])).is_none());
        state.silent_slots = silent_slots(&ranges, &silent);
        state.slots = ranges.clone();
        state.silent = silent.clone();
        let mut found = 0;
        for i in 0..100_000 {
            let key = format!("tierkv-test:{i}");
            let slot = key_slot(key.as_bytes());
            let serves = ranges.iter().find(|r| r.first <= slot && slot <= r.last);
            let expected = serves.map(|r| &r.master).filter(|m| silent.contains(m));
            assert_eq!(silent_master(&state, &cmd(&["EXISTS", &key])), expected, "slot {slot}");
            found += usize::from(expected.is_some());
        }
        assert!(found > 0 && found < 100_000, "{found} keys on silent masters");
        state.silent_slots = silent_slots(&state.slots, &[]);
        assert!(state.silent_slots.is_empty());
        assert!(silent_master(&state, &cmd(&["EXISTS", "a"])).is_none());
    }

    fn cmd(args: &[&str]) -> Cmd {
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd
    }

    /// The server's id of the connection the link uses now.
    async fn client_id(link: &Link) -> u64 {
        link.call::<u64>(&cmd(&["CLIENT", "ID"])).await.unwrap()
    }

    /// The order is the test's: each call runs with `send`, and its result reaches the link's
    /// judgement (`settle`) when the test says, so "late" is exact, not a race of timers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_late_failure_on_a_replaced_connection_leaves_the_new_one_alone() {
        require_redis!();
        let server = RedisStandalone::start(&[]);
        let link = link(&server, Duration::from_secs(2));
        let first = client_id(&link).await;
        assert!(link.degraded().is_none());

        // The server closes the first connection: two calls on it fail, for the link's sake.
        assert_eq!(server.node.cli(&["CLIENT", "KILL", "ID", &first.to_string()]), "1");
        let (late_used, late) = link.send::<String>(&cmd(&["PING"])).await;
        let (used, failed) = link.send::<String>(&cmd(&["PING"])).await;
        assert!(late.as_ref().is_err_and(CallError::is_connection), "{late:?}");
        assert!(failed.as_ref().is_err_and(CallError::is_connection), "{failed:?}");
        // The first one judged degrades the tier and drops the connection.
        assert!(link.settle(used, failed).is_err());
        assert!(link.degraded().is_some());

        // After the reconnect interval a call opens a second connection, and the tier is
        // healthy again.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let second = client_id(&link).await;
        assert_ne!(second, first);
        assert!(link.degraded().is_none());

        // The other failure on the first connection, judged late: it says nothing about the
        // second, which stays, healthy.
        assert!(link.settle(late_used, late).is_err());
        assert!(link.degraded().is_none(), "a late failure degraded the tier");
        assert_eq!(client_id(&link).await, second, "a late failure dropped the new connection");

        // A late success on an old connection does not declare a degraded link healthy either.
        let (old_used, ok) = link.send::<String>(&cmd(&["PING"])).await;
        assert!(ok.is_ok());
        assert_eq!(server.node.cli(&["CLIENT", "KILL", "ID", &second.to_string()]), "1");
        let (used, failed) = link.send::<String>(&cmd(&["PING"])).await;
        assert!(link.settle(used, failed).is_err());
        tokio::time::sleep(Duration::from_millis(50)).await;
        let third = client_id(&link).await;
        assert_ne!(third, second);
        assert!(link.degraded().is_none());
        assert_eq!(server.node.cli(&["CLIENT", "KILL", "ID", &third.to_string()]), "1");
        let (used, failed) = link.send::<String>(&cmd(&["PING"])).await;
        assert!(link.settle(used, failed).is_err());
        assert!(link.degraded().is_some());
        assert!(link.settle(old_used, ok).is_ok());
        assert!(link.degraded().is_some(), "a late success on an old connection healed the tier");
    }

    /// Calls queued behind others on the one connection pass their deadline while the
    /// connection answers: each fails alone, as busy, and the tier stays healthy. A connection
    /// that answers nothing for a whole deadline is still a link failure.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_timeout_on_a_busy_connection_fails_alone() {
        require_redis!();
        let server = RedisStandalone::start(&[]);
        let link = Arc::new(link(&server, Duration::from_millis(350)));
        link.call::<String>(&cmd(&["PING"])).await.unwrap();

        // Eight BLPOPs of 100 ms on one connection: the server answers them one after the other
        // (a blocked client's next command waits), one every 100 ms, so the later ones wait in
        // the queue past the 350 ms deadline while the first ones are answered.
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let link = Arc::clone(&link);
            calls.spawn(async move {
                link.call::<redis::Value>(&cmd(&["BLPOP", "tierkv-test-empty", "0.1"])).await
            });
        }
        let (mut answered, mut busy) = (0, 0);
        while let Some(result) = calls.join_next().await {
            match result.unwrap() {
                Ok(_) => answered += 1,
                Err(CallError::Busy(_)) => busy += 1,
                Err(e) => panic!("a queued call failed as {e:?}, not as busy"),
            }
        }
        assert!(answered >= 1 && busy >= 1, "{answered} answered, {busy} busy");
        assert!(link.degraded().is_none(), "queueing degraded the tier: {:?}", link.degraded());
        // Let the server work through the queue; the connection serves on.
        tokio::time::sleep(Duration::from_millis(800)).await;
        link.call::<String>(&cmd(&["PING"])).await.unwrap();

        // Silent for the whole deadline: a hung link.
        let hung = link.call::<redis::Value>(&cmd(&["BLPOP", "tierkv-test-empty", "0"])).await;
        assert!(matches!(hung, Err(ref e) if e.is_timeout()), "{hung:?}");
        assert!(link.degraded().is_some());
    }

    /// A cluster connection found busy is renewed; calls that were queued on it and run out of
    /// time after the new one replaced it waited behind the same backlog: busy too, not
    /// timeouts of the link (which the metrics count as the link's failures).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_timeout_on_a_busy_connection_judged_after_its_renewal_is_still_busy() {
        require_redis!();
        let cluster = cluster().await;
        let link = Arc::new(cluster_link(cluster.urls(), Duration::from_millis(350)));
        link.call::<redis::Value>(&cmd(&["EXISTS", "tierkv-test-empty"])).await.unwrap();
        // A new cluster link is degraded until a probe heals it, and that first call started
        // one. Its `PING` must not queue behind the BLPOPs below: this test settles their
        // answers only later, so the probe would judge the connection silent and drop it.
        let healing = Instant::now();
        while link.degraded().is_some() {
            assert!(healing.elapsed() < Duration::from_secs(5), "{:?}", link.degraded());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Twelve BLPOPs of 100 ms on one key, so on one master's connection: answered one
        // after the other, the later ones past the deadline. Sent now, judged below in order.
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..12 {
            let link = Arc::clone(&link);
            calls.spawn(async move {
                link.send::<redis::Value>(&cmd(&["BLPOP", "tierkv-test-empty", "0.1"])).await
            });
        }
        let (mut answered, mut timed_out) = (Vec::new(), Vec::new());
        while let Some(sent) = calls.join_next().await {
            let sent = sent.unwrap();
            if sent.1.is_ok() { answered.push(sent) } else { timed_out.push(sent) }
        }
        assert!(!answered.is_empty() && timed_out.len() >= 2, "{answered:?} {timed_out:?}");
        for (used, result) in answered {
            assert!(link.settle(used, result).is_ok());
        }
        let generation = || link.state.lock().conn.as_ref().map(|c| c.generation);
        let first = generation();
        let mut timed_out = timed_out.into_iter();
        let (used, result) = timed_out.next().unwrap();
        let judged = link.settle(used, result);
        assert!(matches!(judged, Err(CallError::Busy(_))), "judged {judged:?}, not busy");
        // The busy connection is renewed by a task of its own.
        let renewed = Instant::now();
        while generation() == first || generation().is_none() {
            assert!(renewed.elapsed() < Duration::from_secs(5), "the connection was not renewed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for (used, result) in timed_out {
            let judged = link.settle(used, result);
            assert!(matches!(judged, Err(CallError::Busy(_))), "judged {judged:?}, not busy");
        }
    }

    /// Under load `CLUSTER SLOTS` may answer late; the masters it names then get the whole
    /// deadline to answer their `PING`, counted from when it is sent, not what the slot map
    /// left of one deadline shared by both: a live master that answers within the deadline is
    /// not silent. Here every node holds its clients' commands (`CLIENT PAUSE`): the seeds (the
    /// replicas) for 0.8 s, the masters for 1.8 s, of a 2 s deadline.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_slot_map_leaves_the_masters_their_whole_deadline() {
        require_redis!();
        let cluster = cluster().await;
        let masters = cluster.masters();
        let replicas: Vec<usize> =
            (0..cluster.nodes.len()).filter(|i| !masters.contains(i)).collect();
        let link = cluster_link(
            replicas.iter().map(|&i| cluster.nodes[i].url()).collect(),
            Duration::from_secs(2),
        );
        for &i in &replicas {
            assert_eq!(cluster.nodes[i].cli(&["CLIENT", "PAUSE", "800"]), "OK");
        }
        for &i in &masters {
            assert_eq!(cluster.nodes[i].cli(&["CLIENT", "PAUSE", "1800"]), "OK");
        }
        link.probe().await;
        let state = link.state.lock();
        assert!(!state.slots.is_empty(), "the probe learnt no slot map");
        assert!(state.silent.is_empty(), "live masters found silent: {:?}", state.silent);
    }

    /// A probe opens one connection to each node it asks: `CLUSTER SLOTS` of each known node,
    /// whose answer also says a master is alive, and a `PING` only of a master not asked yet.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_opens_one_connection_to_each_node() {
        require_redis!();
        let cluster = cluster().await;
        let link = cluster_link(cluster.urls(), Duration::from_secs(2));
        // The link's own connection first, and the probe its first success starts.
        link.call::<u64>(&cmd(&["EXISTS", "tierkv-test-absent"])).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while link.state.lock().probing || link.degraded().is_some() {
            assert!(Instant::now() < deadline, "never healthy: {:?}", link.degraded());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let masters = cluster.masters();
        let before: Vec<u64> = cluster.nodes.iter().map(connections_received).collect();
        assert!(link.probe().await);
        for (i, node) in cluster.nodes.iter().enumerate() {
            // The second question's own connection aside.
            let opened = connections_received(node) - before[i] - 1;
            let role = if masters.contains(&i) { "master" } else { "replica" };
            assert_eq!(opened, 1, "the probe opened {opened} connections to a {role}");
        }
    }
}
