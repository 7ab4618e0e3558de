//! Real Redis for the remote tier's tests: a 3-master + 3-replica Redis Cluster, or one
//! standalone server, from the Debian `redis-server` package, on free loopback ports in a
//! temporary directory, stopped when dropped.
//!
//! The servers are started by one long-lived spawner thread with `PR_SET_PDEATHSIG`, so they also
//! stop when the test process dies without unwinding (a cluster shared by a test binary lives in
//! a static, which is never dropped). Where `redis-server` is missing, [`redis_available`] says
//! why: CI (`TIERKV_REDIS=1`, set by `.ci/run`) fails with that message, elsewhere the tests skip.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Whether `redis-server`, `redis-cli` run here. `Err` says why not, and panics instead when
/// `TIERKV_REDIS=1` (CI), so CI can never pass by skipping the remote tier's tests.
pub fn redis_available() -> Result<(), String> {
    let missing: Vec<&str> = ["redis-server", "redis-cli"]
        .into_iter()
        .filter(|bin| {
            Command::new(bin)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map_or(true, |s| !s.success())
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let why = format!(
        "{} not found: install Debian's redis-server and redis-tools (`apt-get install -y \
         redis-server redis-tools`) to run the remote tier's tests",
        missing.join(" and ")
    );
    if std::env::var("TIERKV_REDIS").is_ok_and(|v| v == "1") {
        panic!("TIERKV_REDIS=1 but {why}");
    }
    Err(why)
}

/// Skips the calling test (returns from it) when Redis is not installed and CI did not ask for
/// it; see [`redis_available`].
#[macro_export]
macro_rules! require_redis {
    () => {
        if let Err(why) = $crate::redis::redis_available() {
            eprintln!("skipped: {why}");
            return;
        }
    };
}

/// A free loopback port (also its cluster bus port, `port + 10000`, must be free).
fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(0);
        if port != 0 && port < 55000 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns every server from one thread that lives as long as the process, each child asking the
/// kernel to kill it when that thread (and so the process) dies.
fn spawn(mut command: Command) -> Child {
    static SPAWNER: OnceLock<parking_lot::Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("redis-spawner".into())
            .spawn(move || {
                while let Ok((mut command, reply)) = rx.recv() {
                    let _ = reply.send(command.spawn());
                }
                // The channel lives in a static: this thread runs until the process exits.
            })
            .expect("start the redis spawner thread");
        parking_lot::Mutex::new(tx)
    });
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches only the child's own attributes.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
    }
    let (reply, answer) = mpsc::channel();
    spawner.lock().send((command, reply)).expect("the redis spawner thread is alive");
    answer.recv().expect("the redis spawner answers").expect("start redis-server")
}

/// One `redis-server` process.
pub struct RedisNode {
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl RedisNode {
    fn start(port: u16, dir: &Path, extra: &[&str]) -> Self {
        std::fs::create_dir_all(dir).expect("create the node's directory");
        let mut args: Vec<String> = vec![
            "--port".into(),
            port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--dir".into(),
            dir.display().to_string(),
            "--save".into(),
            String::new(),
            "--appendonly".into(),
            "no".into(),
            "--daemonize".into(),
            "no".into(),
            "--logfile".into(),
            dir.join("redis.log").display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut node = RedisNode { port, dir: dir.to_path_buf(), args, child: None };
        node.restart();
        node
    }

    /// Starts the process again (after [`RedisNode::kill`]) with the same arguments and
    /// directory; a cluster node rejoins from its `nodes.conf`.
    pub fn restart(&mut self) {
        let mut command = Command::new("redis-server");
        command.args(&self.args).stdout(Stdio::null()).stderr(Stdio::null());
        self.child = Some(spawn(command));
        self.wait_ping(Duration::from_secs(10));
    }

    /// Kills the process (SIGKILL: no goodbye to the cluster) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether the process runs.
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Stops the process without killing it (SIGSTOP): a hung server that accepts connections
    /// and never answers.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Lets a paused process go on (SIGCONT).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: libc::c_int) {
        if let Some(child) = &self.child {
            // SAFETY: kill(2) on our own child's pid, which has not been reaped.
            unsafe {
                libc::kill(child.id() as libc::pid_t, signal);
            }
        }
    }

    /// Runs `redis-cli -p PORT args...` against this node; its standard output, trimmed.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn wait_ping(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while cli(self.port, &["PING"]) != "PONG" {
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} never answered PING; its log: {}",
                self.port,
                std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisNode {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

/// Runs `redis-cli -p port args...`; its standard output, trimmed (empty when it failed).
pub fn cli(port: u16, args: &[&str]) -> String {
    cli_with_input(port, args, None)
}

/// Runs `redis-cli -p port -x args...` with `input` on its standard input: `-x` makes those
/// bytes, unchanged, the command's last argument (how a test writes a binary value).
pub fn cli_with_input(port: u16, args: &[&str], input: Option<&[u8]>) -> String {
    use std::io::Write;
    let mut command = Command::new("redis-cli");
    command.args(["-h", "127.0.0.1", "-p", &port.to_string()]);
    if input.is_some() {
        command.arg("-x");
    }
    command.args(args).stdout(Stdio::piped()).stderr(Stdio::null());
    command.stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() });
    let Ok(mut child) = command.spawn() else { return String::new() };
    if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
        let _ = stdin.write_all(input);
    }
    child
        .wait_with_output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Whether a master's `INFO replication` shows at least one replica, each `online` at the
/// master's own replication offset.
fn replica_caught_up(info: &str) -> bool {
    let field = |line: &str, name: &str| {
        line.split(',').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')).map(str::to_string)
    };
    let Some(offset) = info.lines().find_map(|l| l.strip_prefix("master_repl_offset:")) else {
        return false;
    };
    let replicas: Vec<&str> =
        info.lines().filter(|l| l.starts_with("slave") && l.contains("state=")).collect();
    !replicas.is_empty()
        && replicas.iter().all(|line| {
            field(line, "state").as_deref() == Some("online")
                && field(line, "offset").as_deref() == Some(offset.trim())
        })
}

/// Whether a `CLUSTER NODES` line's flags (`myself,master`, `master,fail?`, ...) name a master not
/// marked failing. Flag by flag: `nofailover` (a node with `cluster-replica-no-failover yes`)
/// contains "fail" and is no failure.
fn serving_master(flags: &str) -> bool {
    let mut flags = flags.split(',');
    let (mut master, mut failing) = (false, false);
    for flag in &mut flags {
        master |= flag == "master";
        failing |= flag == "fail" || flag == "fail?";
    }
    master && !failing
}

/// One standalone Redis server in its own temporary directory.
pub struct RedisStandalone {
    /// The server.
    pub node: RedisNode,
    _dir: tempfile::TempDir,
}

impl RedisStandalone {
    /// Starts a server with `extra` arguments (e.g. `--maxmemory 2mb`).
    pub fn start(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let node = RedisNode::start(free_port(), dir.path(), extra);
        RedisStandalone { node, _dir: dir }
    }

    /// Its URL.
    pub fn url(&self) -> String {
        self.node.url()
    }
}

/// A Redis Cluster of three masters, each with one replica.
pub struct RedisCluster {
    /// The six nodes; which are masters changes with failovers (see [`RedisCluster::masters`]).
    pub nodes: Vec<RedisNode>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    /// Starts six nodes, creates the cluster with one replica per master and waits until every
    /// node says `cluster_state:ok`. A node that stops answering is failed over after 1 s.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let mut nodes = Vec::with_capacity(6);
        for i in 0..6 {
            let port = loop {
                let p = free_port();
                if nodes.iter().all(|n: &RedisNode| n.port != p) {
                    break p;
                }
            };
            nodes.push(RedisNode::start(
                port,
                &dir.path().join(format!("node{i}")),
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    "--cluster-replica-validity-factor",
                    "0",
                    // A replica's first sync otherwise waits 5 s for other replicas to join it,
                    // and holds nothing until then.
                    "--repl-diskless-sync-delay",
                    "0",
                ],
            ));
        }
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let mut args: Vec<&str> = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", "1", "--cluster-yes"]);
        let created = Command::new("redis-cli")
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            created.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&created.stdout)
        );
        let cluster = RedisCluster { nodes, _dir: dir };
        cluster.wait_ok(Duration::from_secs(30));
        cluster
    }

    /// Seed URLs of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisNode::url).collect()
    }

    /// Waits until every running node reports `cluster_state:ok` and three masters with slots.
    pub fn wait_ok(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let ok = self
                .nodes
                .iter()
                .filter(|n| n.running())
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
                && self.masters().len() == 3;
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "the cluster never reached cluster_state:ok");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every master's replica has every write the master has taken: the replica's
    /// link is `online` and its acknowledged offset equals the master's `master_repl_offset`.
    /// `cluster_state:ok` alone does not say this: a replica may still be in its first full
    /// sync, and a master killed then takes its writes with it (CI saw a failover lose a third
    /// of a test's keys this way). `WAIT` cannot say it either, from a connection that wrote
    /// nothing.
    pub fn wait_replicated(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let lagging: Vec<u16> = self
                .masters()
                .into_iter()
                .map(|i| &self.nodes[i])
                .filter(|n| !replica_caught_up(&n.cli(&["INFO", "replication"])))
                .map(|n| n.port)
                .collect();
            if lagging.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the replicas of the masters on ports {lagging:?} never caught up"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Indices into `nodes` of the masters that hold slots, as a running node sees them.
    pub fn masters(&self) -> Vec<usize> {
        let Some(seen_by) = self.nodes.iter().find(|n| n.running()) else { return Vec::new() };
        let table = seen_by.cli(&["CLUSTER", "NODES"]);
        table
            .lines()
            .filter(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                fields.len() > 8 && serving_master(fields[2])
            })
            .filter_map(|line| {
                let addr = line.split_whitespace().nth(1)?;
                let port: u16 = addr.split(['@', ':']).nth(1)?.parse().ok()?;
                self.nodes.iter().position(|n| n.port == port && n.running())
            })
            .collect()
    }

    /// The node that serves `key`'s slot now (a master).
    pub fn master_of(&self, key: &str) -> Option<usize> {
        let seen_by = self.nodes.iter().find(|n| n.running())?;
        let slot: u16 = seen_by.cli(&["CLUSTER", "KEYSLOT", key]).parse().ok()?;
        let table = seen_by.cli(&["CLUSTER", "NODES"]);
        table.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 || !serving_master(fields[2]) {
                return None;
            }
            let serves = fields[8..].iter().any(|range| match range.split_once('-') {
                Some((a, b)) => {
                    a.parse::<u16>().is_ok_and(|a| a <= slot)
                        && b.parse::<u16>().is_ok_and(|b| slot <= b)
                }
                None => range.parse::<u16>().is_ok_and(|s| s == slot),
            });
            let port: u16 = fields[1].split(['@', ':']).nth(1)?.parse().ok()?;
            serves.then(|| self.nodes.iter().position(|n| n.port == port)).flatten()
        })
    }

    /// Runs `redis-cli -c` (following redirections) against the first running node.
    pub fn cli(&self, args: &[&str]) -> String {
        self.cli_with_input(args, None)
    }

    /// Like [`RedisCluster::cli`], with `input` as the last argument (see [`cli_with_input`]).
    pub fn cli_with_input(&self, args: &[&str], input: Option<&[u8]>) -> String {
        let Some(node) = self.nodes.iter().find(|n| n.running()) else { return String::new() };
        let mut all = vec!["-c"];
        all.extend_from_slice(args);
        cli_with_input(node.port, &all, input)
    }
}

#[cfg(test)]
mod tests {
    use super::{replica_caught_up, serving_master};

    /// `INFO replication` of a master whose replica is in its first sync, as Redis 7 prints it.
    const SYNCING: &str = "# Replication\r\nrole:master\r\nconnected_slaves:1\r\n\
        slave0:ip=127.0.0.1,port=6398,state=wait_bgsave,offset=0,lag=0\r\n\
        master_failover_state:no-failover\r\nmaster_repl_offset:50\r\nsecond_repl_offset:-1";

    #[test]
    fn a_replica_counts_as_caught_up_only_online_at_the_masters_offset() {
        assert!(!replica_caught_up(SYNCING), "a replica in its first sync");
        let online_behind = SYNCING.replace("wait_bgsave,offset=0", "online,offset=36");
        assert!(!replica_caught_up(&online_behind), "an online replica behind the master");
        let caught_up = SYNCING.replace("wait_bgsave,offset=0", "online,offset=50");
        assert!(replica_caught_up(&caught_up));
        let alone = "role:master\r\nconnected_slaves:0\r\nmaster_repl_offset:50";
        assert!(!replica_caught_up(alone), "a master without a replica");
        assert!(!replica_caught_up(""), "no answer");
    }

    #[test]
    fn a_master_barred_from_failover_still_counts_as_a_master() {
        assert!(serving_master("myself,master"));
        assert!(serving_master("master,nofailover"));
        assert!(serving_master("myself,master,nofailover"));
        assert!(!serving_master("master,fail"));
        assert!(!serving_master("master,fail?,nofailover"));
        assert!(!serving_master("slave,nofailover"));
        assert!(!serving_master("myself,slave"));
    }
}
