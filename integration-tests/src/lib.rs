//! Processes for the black-box tests: a real `tierkv` daemon and real worker processes (the
//! client's `worker` example), talking over the real socket.
//!
//! Every process started here is killed when its handle drops, so a failing test leaves
//! nothing running.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failure is a test failure"
)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;
use tempfile::TempDir;
use tierkv_client::Client;
use tierkv_client::proto::StatusReport;
use tierkv_replay::process::die_with_parent;

/// The target directory the test binary runs from (`target/<profile>`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test binary>
    exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf()
}

/// Path of a workspace binary or example, built first when it is missing or older than the
/// workspace's sources: a plain `cargo test -p` of this package builds neither, and would
/// otherwise test whatever daemon an earlier build left behind. `TIERKV_BIN` names the daemon
/// instead, as it is: a machine without a toolchain runs a carried test executable against a
/// carried daemon (`scripts/gpu-all.sh`).
pub fn artifact(kind: &str, name: &str) -> PathBuf {
    if (kind, name) == ("bin", "tierkv")
        && let Some(bin) = std::env::var_os("TIERKV_BIN")
    {
        // Absolute: the daemon runs in a directory of its own.
        let path = std::path::absolute(&bin).unwrap_or_else(|_| PathBuf::from(&bin));
        assert!(
            path.is_file(),
            "TIERKV_BIN={} names no file (a relative path is taken from the test's directory, {})",
            bin.display(),
            std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default()
        );
        return path;
    }
    let path = match kind {
        "example" => profile_dir().join("examples").join(name),
        _ => profile_dir().join(name),
    };
    let built = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
    if built.is_none_or(|built| built < *newest_source()) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let (package, flag) = match kind {
            "example" => ("tierkv-client", "--example"),
            _ => ("tierkv-server", "--bin"),
        };
        let mut build = Command::new(cargo);
        build.args(["build", "-p", package, flag, name]);
        if profile_dir().file_name().is_some_and(|p| p == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo build");
        assert!(status.success(), "cargo build of {name} failed");
    }
    path
}

/// When the newest Rust source or manifest of the workspace was last changed (read once per
/// test process).
fn newest_source() -> &'static SystemTime {
    static NEWEST: OnceLock<SystemTime> = OnceLock::new();
    NEWEST.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root");
        let mut newest = SystemTime::UNIX_EPOCH;
        newest_in(&root.join("crates"), &mut newest);
        for file in ["Cargo.toml", "Cargo.lock"] {
            if let Ok(changed) = std::fs::metadata(root.join(file)).and_then(|m| m.modified()) {
                newest = newest.max(changed);
            }
        }
        newest
    })
}

/// Raises `newest` to the change time of every `.rs` file and manifest under `dir`.
fn newest_in(dir: &Path, newest: &mut SystemTime) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = entry.metadata() else { continue };
        if meta.is_dir() {
            newest_in(&path, newest);
        } else if (path.extension().is_some_and(|e| e == "rs")
            || path.file_name().is_some_and(|n| n == "Cargo.toml"))
            && let Ok(changed) = meta.modified()
        {
            *newest = (*newest).max(changed);
        }
    }
}

/// Descriptors the process `pid` has open.
pub fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).expect("read /proc/PID/fd").count() as u64
}

/// Kills a child when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Changes made to the daemon's command before each start (limits, environment).
type Customize = Box<dyn Fn(&mut Command) + Send + Sync>;

/// A daemon process with its own directory, socket and config. Its log (stderr) goes to
/// `tierkv.log` in its directory ([`Daemon::log`]).
pub struct Daemon {
    child: Option<Reaped>,
    customize: Option<Customize>,
    /// The directory holding the config, the socket and the disk tier.
    pub dir: TempDir,
    /// The Unix socket.
    pub socket: PathBuf,
    /// The config file.
    pub config: PathBuf,
}

/// A small config: `l1` and `l2` in KiB-sized chunk counts, disk on, metrics where asked.
pub fn small_config(dir: &Path, metrics: Option<u16>, extra: &str) -> String {
    let metrics = match metrics {
        Some(port) => format!("enabled = true\nlisten = \"127.0.0.1:{port}\""),
        None => "enabled = false".into(),
    };
    format!(
        r#"
[server]
socket = "{socket}"

[metrics]
{metrics}

[l1]
device = "emulated"
capacity = "4MiB"
slot = "64KiB"
lease_ttl = "30s"

[l2]
capacity = "8MiB"
memory = "plain"

[disk]
dir = "{disk}"
capacity = "32MiB"
segment = "4MiB"
fsync = "always"
{extra}
"#,
        socket = dir.join("tierkv.sock").display(),
        disk = dir.join("disk").display(),
    )
}

/// The `[remote]` section of a node whose remote tier is the Redis Cluster at `urls`, its keys
/// under `prefix`, with the short timeouts of a test.
pub fn remote_section(urls: &[String], prefix: &str) -> String {
    let urls: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "\n[remote]\nenabled = true\nurls = [{}]\nkey_prefix = \"{prefix}\"\n\
         op_timeout = \"500ms\"\nconnect_timeout = \"500ms\"\nreconnect_interval = \"200ms\"\n",
        urls.join(", ")
    )
}

impl Daemon {
    /// Starts a daemon on `config` (the text of its TOML file, written into a fresh directory;
    /// `{dir}` in it is replaced by that directory).
    pub fn start_with(config: impl FnOnce(&Path) -> String) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = config(dir.path());
        let path = dir.path().join("tierkv.toml");
        std::fs::write(&path, text).expect("write config");
        let socket = dir.path().join("tierkv.sock");
        let mut daemon = Daemon { child: None, customize: None, dir, socket, config: path };
        daemon.restart();
        daemon
    }

    /// Like [`Daemon::start_with`], with `customize` applied to the command before every start
    /// (a resource limit in a `pre_exec`, an environment variable).
    pub fn start_customized(
        config: impl FnOnce(&Path) -> String,
        customize: impl Fn(&mut Command) + Send + Sync + 'static,
    ) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = config(dir.path());
        let path = dir.path().join("tierkv.toml");
        std::fs::write(&path, text).expect("write config");
        let socket = dir.path().join("tierkv.sock");
        let mut daemon =
            Daemon { child: None, customize: Some(Box::new(customize)), dir, socket, config: path };
        daemon.restart();
        daemon
    }

    /// The daemon's log so far (every start appends to it).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Where the daemon's log is written.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("tierkv.log")
    }

    /// A daemon on [`small_config`].
    pub fn start() -> Daemon {
        Self::start_with(|dir| small_config(dir, None, ""))
    }

    /// (Re)starts the process on the same config and waits until it answers.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop the daemon before restarting it");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the daemon's log");
        let mut command = Command::new(artifact("bin", "tierkv"));
        command
            .args(["serve", "--config"])
            .arg(&self.config)
            .env("TIERKV_LOG", "warn")
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stderr(log);
        if let Some(customize) = &self.customize {
            customize(&mut command);
        }
        let child = die_with_parent(&mut command).spawn().expect("spawn tierkv");
        self.child = Some(Reaped(child));
        let child = self.child.as_mut().map(|c| &mut c.0);
        if let Err(why) = try_wait_for_socket(&self.socket, child) {
            panic!("{why}; its log:\n{}", self.log());
        }
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.0.id()).unwrap_or(0)
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn stop(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        terminate(&mut child.0)
    }

    /// Kills the process with SIGKILL (a crash: nothing is flushed or cleaned up) and waits
    /// for it; the socket file stays behind, as after a real crash.
    pub fn kill(&mut self) {
        let mut child = self.child.take().expect("running");
        let _ = child.0.kill();
        let _ = child.0.wait();
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        match &mut self.child {
            Some(c) => c.0.try_wait().ok().flatten().is_none(),
            None => false,
        }
    }

    /// An admin session's view of the daemon.
    pub fn status(&self) -> StatusReport {
        let mut admin = Client::connect_unix(&self.socket, Client::admin_hello()).expect("admin");
        let report = admin.status().expect("status");
        admin.end().expect("end");
        report
    }

    /// Polls the status until `ok` holds (background work is asynchronous), or panics.
    pub fn eventually(&self, what: &str, ok: impl Fn(&StatusReport) -> bool) -> StatusReport {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let report = self.status();
            if ok(&report) {
                return report;
            }
            assert!(Instant::now() < deadline, "{what}: never true; last status {report:#?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the store pipeline is idle and holds no share (each chunk it copies down is
    /// leased while it copies): the point from which usage figures are steady.
    pub fn settled(&self) -> StatusReport {
        self.eventually("the store pipeline settles", |s| {
            s.store_in_flight == 0 && s.l1_leased_chunks == 0
        })
    }

    /// Starts a worker process on this daemon.
    pub fn worker(&self, args: &[&str]) -> Worker {
        Worker::start(&self.socket, args)
    }
}

/// SIGTERM, then wait up to 30 s (SIGKILL after).
pub fn terminate(child: &mut Child) -> ExitStatus {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the daemon did not exit within 30 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until something accepts on `socket` (and the process, if given, has not died).
pub fn wait_for_socket(socket: &Path, child: Option<&mut Child>) {
    if let Err(why) = try_wait_for_socket(socket, child) {
        panic!("{why}");
    }
}

fn try_wait_for_socket(socket: &Path, mut child: Option<&mut Child>) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if std::os::unix::net::UnixStream::connect(socket).is_ok() {
            return Ok(());
        }
        if let Some(child) = child.as_deref_mut()
            && let Some(status) = child.try_wait().expect("wait")
        {
            return Err(format!("the daemon exited before listening: {status}"));
        }
        if Instant::now() > deadline {
            return Err(format!("nothing listens on {} after 30 s", socket.display()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `tierkv serve --config CONFIG` (in `cwd`) expecting it to refuse to start: its exit
/// status and everything it wrote to stderr. A daemon that starts instead is killed after 30 s
/// and the test fails.
pub fn serve_refused(config: &Path, cwd: &Path) -> (ExitStatus, String) {
    let mut child = die_with_parent(&mut Command::new(artifact("bin", "tierkv")))
        .args(["serve", "--config"])
        .arg(config)
        .env("TIERKV_LOG", "info")
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tierkv");
    let mut stderr = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tierkv serve did not refuse to start within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, reader.join().unwrap_or_default())
}

/// A worker process: commands in on stdin, one JSON answer per line out.
pub struct Worker {
    child: Reaped,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The daemon's session number of this worker.
    pub session: u64,
}

impl Worker {
    /// Starts `worker --socket SOCKET ARGS...` and waits until its session is open.
    pub fn start(socket: &Path, args: &[&str]) -> Worker {
        let mut child = die_with_parent(&mut Command::new(artifact("example", "worker")))
            .arg("--socket")
            .arg(socket)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn worker");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut worker = Worker { child: Reaped(child), stdin, stdout, session: 0 };
        let ready = worker.answer();
        assert_eq!(ready["ready"], true, "worker did not start: {ready}");
        worker.session = ready["session"].as_u64().expect("session");
        worker
    }

    fn answer(&mut self) -> Value {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).expect("read worker");
        assert!(n > 0, "the worker exited");
        serde_json::from_str(&line).expect("worker answers JSON")
    }

    /// Runs a command; its answer (`ok` tells whether it worked).
    pub fn try_run(&mut self, command: &str) -> Value {
        writeln!(self.stdin, "{command}").expect("write worker");
        self.answer()
    }

    /// Runs a command that must work.
    pub fn run(&mut self, command: &str) -> Value {
        let answer = self.try_run(command);
        assert_eq!(answer["ok"], true, "{command}: {answer}");
        answer
    }

    /// Kills the process without ending its session (a crash, as the daemon sees it).
    pub fn kill(mut self) {
        let _ = self.child.0.kill();
        let _ = self.child.0.wait();
    }

    /// Ends the session and waits for the exit.
    pub fn exit(mut self) {
        writeln!(self.stdin, "exit").expect("write worker");
        let status = self.child.0.wait().expect("wait worker");
        assert!(status.success(), "worker exited with {status}");
    }
}

/// A loopback TCP port nobody listens on right now.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// A plain HTTP/1.0 GET on loopback: (status code, body).
pub fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let code = response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((code, body))
}
