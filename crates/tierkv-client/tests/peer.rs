//! The client checks who listens on the Unix socket before it sends anything: a listener of
//! another user (here `nobody`, a process of this test binary started again under that uid) is
//! refused and receives not a byte; told to trust that user, the client opens its session.
//!
//! The tests run as root, which may start a process as another user (elsewhere they skip, saying
//! so: `tierkv_testkit::may_run_as`); the listener's own user case (the client's and the daemon's
//! uid the same) is what every other test that connects to a daemon exercises.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]
#![allow(clippy::expect_used, reason = "test code: a failed expect is a failed test")]
#![allow(clippy::print_stdout, reason = "the listener reports to the test on its stdout")]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use tierkv_client::proto::{self, ReplyBody, Request, RequestBody};
use tierkv_client::{Client, ClientError, UnixOptions};

/// The user the listener runs as: `nobody`.
const OTHER_UID: u32 = 65534;
/// Names the socket the listener binds, in its environment; without it [`listener`] does nothing.
const LISTEN_AT: &str = "TIERKV_TEST_LISTEN_AT";
/// The session number the listener's welcome gives.
const SESSION: u64 = 77;

/// Not a test of its own: the listener the tests start as [`OTHER_UID`], by running this binary
/// again with this function alone. It binds the socket named in [`LISTEN_AT`], says
/// `listening` (on a line of its own), takes one connection, answers a hello with a welcome and an `end_session` with
/// `bye`, and when the client closes says how many bytes it received.
#[test]
#[ignore = "started by the other tests, as another user"]
fn listener() {
    let Some(path) = std::env::var_os(LISTEN_AT) else { return };
    // A test that never connects, or never closes, fails instead of hanging on this process.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(30));
        std::process::exit(3);
    });
    let listener = UnixListener::bind(&path).unwrap();
    // The harness writes "test listener ... " before a test's own output, on the same line.
    println!("\nlistening");
    let (mut stream, _) = listener.accept().unwrap();
    let mut received = 0;
    while let Some(frame) = proto::read_frame(&mut stream, 1 << 20).unwrap() {
        received += 4 + frame.len();
        let request: Request = proto::decode(&frame).unwrap();
        let body = match request.body {
            RequestBody::Hello(_) => ReplyBody::Welcome {
                version: proto::PROTOCOL_VERSION,
                session: SESSION,
                max_chunk_bytes: 1 << 20,
                readers: 1,
            },
            RequestBody::EndSession => ReplyBody::Bye,
            other => panic!("the listener answers no {other:?}"),
        };
        let mut out = Vec::new();
        proto::encode(&proto::Reply { id: request.id, body }, &mut out).unwrap();
        stream.write_all(&out).unwrap();
    }
    println!("\nreceived {received}");
}

/// A [`listener`] running as [`OTHER_UID`] on a socket in a directory of its own.
struct OtherUsersListener {
    child: Child,
    stdout: BufReader<ChildStdout>,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

/// Whether this test binary may start its [`listener`] as [`OTHER_UID`] here.
fn may_listen_as_another_user() -> bool {
    let mut probe = Command::new(std::env::current_exe().unwrap());
    probe.arg("--list");
    tierkv_testkit::may_run_as(OTHER_UID, probe)
}

impl OtherUsersListener {
    /// Starts it and waits until it listens.
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        // The listener's user must be able to create the socket there.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let path = dir.path().join("tierkv.sock");
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["listener", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env(LISTEN_AT, &path)
            .gid(OTHER_UID)
            .uid(OTHER_UID)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while line.trim() != "listening" {
            line.clear();
            assert_ne!(stdout.read_line(&mut line).unwrap(), 0, "the listener never listened");
        }
        OtherUsersListener { child, stdout, path, _dir: dir }
    }

    /// Waits for it to end (after the client closed); the bytes it received.
    fn received(mut self) -> usize {
        let mut rest = String::new();
        let mut line = String::new();
        while self.stdout.read_line(&mut line).unwrap() > 0 {
            rest.push_str(&line);
            line.clear();
        }
        assert!(self.child.wait().unwrap().success(), "the listener failed:\n{rest}");
        let count = rest.lines().find_map(|l| l.strip_prefix("received ")).expect(&rest);
        count.trim().parse().unwrap()
    }
}

fn options(timeout: Option<Duration>, daemon_uids: Vec<u32>) -> UnixOptions {
    UnixOptions { timeout, daemon_uids }
}

fn connect(path: &Path, options: &UnixOptions) -> Result<Client, ClientError> {
    Client::connect_unix_with(path, Client::admin_hello(), options)
}

#[test]
fn a_listener_of_another_user_is_refused_before_anything_is_sent() {
    if !may_listen_as_another_user() {
        return;
    }
    // Both ways of connecting: waiting as long as it takes, and within a timeout.
    for timeout in [None, Some(Duration::from_secs(5))] {
        let listener = OtherUsersListener::start();
        // A trusted user that is not the listener's changes nothing.
        let err = connect(&listener.path, &options(timeout, vec![1000])).err().unwrap();
        match &err {
            ClientError::UntrustedDaemon { path, uid, own } => {
                assert_eq!((path, *uid, *own), (&listener.path, OTHER_UID, 0));
            }
            other => panic!("not refused as untrusted: {other}"),
        }
        let message = err.to_string();
        let shown = listener.path.display().to_string();
        for said in [shown.as_str(), "uid 65534", "daemon_uids"] {
            assert!(message.contains(said), "{said:?} not in {message:?}");
        }
        assert_eq!(listener.received(), 0, "the client sent something to an untrusted listener");
    }
}

#[test]
fn a_listener_of_a_trusted_user_gets_the_session() {
    if !may_listen_as_another_user() {
        return;
    }
    for timeout in [None, Some(Duration::from_secs(5))] {
        let listener = OtherUsersListener::start();
        let client = connect(&listener.path, &options(timeout, vec![OTHER_UID])).unwrap();
        assert_eq!(client.session().id, SESSION);
        client.end().unwrap();
        assert!(listener.received() > 0);
    }
}
