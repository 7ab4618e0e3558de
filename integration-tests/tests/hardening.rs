//! Issue 16, hardening: what a hostile week in production found, one test per defect, each
//! named after it (`h16_<n>_...`, `h16_ops_...` for the operations list).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tierkv_client::Client;
use tierkv_integration_tests::{Daemon, artifact, open_fds, serve_refused, small_config};

#[test]
fn h16_ops_the_example_worker_answers_help() {
    let out = Command::new(artifact("example", "worker")).arg("--help").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    for word in ["--socket", "--chunk-bytes", "store PROMPT N", "retrieve LOOKUP", "exit"] {
        assert!(text.contains(word), "--help lacks {word}:\n{text}");
    }

    let daemon = Daemon::start();
    let mut worker = daemon.worker(&["--chunk-bytes", "65536"]);
    let answer = worker.run("help");
    let commands: Vec<&str> =
        answer["commands"].as_array().unwrap().iter().filter_map(|c| c.as_str()).collect();
    for command in ["store", "lookup", "wait", "retrieve", "release", "status", "help", "exit"] {
        assert!(commands.iter().any(|c| c.starts_with(command)), "{command}: {answer}");
    }
    worker.exit();
}

/// Processes with a limit on open files: `setrlimit` in the child before it runs the daemon.
fn with_fd_limit(limit: u64) -> impl Fn(&mut Command) + Send + Sync + 'static {
    move |command: &mut Command| {
        // SAFETY: the closure runs in the child between fork and exec and only calls
        // setrlimit, which is async-signal-safe.
        unsafe {
            command.pre_exec(move || {
                let rlimit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &rlimit) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }
}

/// CPU seconds the process `pid` has used (user and system).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
    let (_, after) = stat.rsplit_once(')').unwrap();
    let fields: Vec<&str> = after.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap()) / ticks
}

#[test]
fn h16_1_max_connections_is_lowered_to_what_the_fd_limit_allows() {
    // One disk file (its 8 segments share it) and 64 of the daemon's own: 128 leaves 63.
    let daemon = Daemon::start_customized(|dir| small_config(dir, None, ""), with_fd_limit(128));
    let log = daemon.log();
    assert!(
        log.contains("server.max_connections lowered from 1024 to 63")
            && log.contains("RLIMIT_NOFILE"),
        "{log}"
    );
    // More connections than fit: the extra ones are refused with a reply, the rest serve.
    let mut held = Vec::new();
    for _ in 0..63 {
        held.push(Client::connect_unix(&daemon.socket, Client::admin_hello()).unwrap());
    }
    for _ in 0..20 {
        let refused = Client::connect_unix(&daemon.socket, Client::admin_hello());
        assert!(refused.is_err(), "a connection past the limit was served");
    }
    drop(held);
    // The daemon frees the places as it notices the closes: until then it may still refuse.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut admin = loop {
        match Client::connect_unix(&daemon.socket, Client::admin_hello()) {
            Ok(admin) => break admin,
            Err(e) => assert!(Instant::now() < deadline, "never served again: {e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(admin.status().unwrap().tiers.len(), 3);
    admin.end().unwrap();
    let (status, stderr) = serve_refused(&daemon.config, daemon.dir.path());
    assert!(!status.success());
    assert!(stderr.contains("another tierkv daemon is serving on"), "{stderr}");
}

#[test]
fn h16_1_running_out_of_descriptors_backs_off_and_serves_again() {
    let daemon = Daemon::start();
    let pid = daemon.pid();
    // Leave the daemon ten descriptors more than it has open: the eleventh connection fails
    // its accept with EMFILE, again and again while the connections stay open.
    let limit = open_fds(pid) + 10;
    let rlimit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
    // SAFETY: prlimit on our own child, with a valid struct and no old-value pointer.
    let rc = unsafe {
        libc::prlimit(pid as libc::pid_t, libc::RLIMIT_NOFILE, &rlimit, std::ptr::null_mut())
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    let connections: Vec<UnixStream> =
        (0..40).map(|_| UnixStream::connect(&daemon.socket).unwrap()).collect();
    // Wait for the first report, then hold the connections for a second: a daemon that
    // retries at once spins a core and writes thousands of lines in that second.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !daemon.log().contains("out of file descriptors") {
        assert!(Instant::now() < deadline, "EMFILE was never reported: {}", daemon.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let cpu_before = cpu_seconds(pid);
    std::thread::sleep(Duration::from_secs(1));
    let cpu = cpu_seconds(pid) - cpu_before;
    let log = daemon.log();
    let reports = log.lines().filter(|l| l.contains("accept on")).count();
    assert!(reports <= 2, "{reports} accept reports in a second:\n{}", &log[..log.len().min(4000)]);
    assert!(cpu < 0.5, "the daemon used {cpu:.2} s of CPU in a second while out of descriptors");
    // Once the connections close, it serves again.
    drop(connections);
    let report = daemon.eventually("the daemon serves again", |_| true);
    assert_eq!(report.tiers.len(), 3);
}

#[test]
fn h16_9_a_socket_path_holding_anything_but_a_socket_is_never_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tierkv.toml");
    std::fs::write(&config, small_config(dir.path(), None, "")).unwrap();
    let socket = dir.path().join("tierkv.sock");
    std::fs::write(&socket, "precious").unwrap();
    let (status, stderr) = serve_refused(&config, dir.path());
    assert!(!status.success());
    assert!(stderr.contains("is a regular file, not a socket"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&socket).unwrap(), "precious");
    std::fs::remove_file(&socket).unwrap();
    std::fs::create_dir(&socket).unwrap();
    let (_, stderr) = serve_refused(&config, dir.path());
    assert!(stderr.contains("is a directory, not a socket"), "{stderr}");
}

#[test]
fn h16_4_a_second_daemon_on_a_directory_is_refused_naming_the_holder() {
    let daemon = Daemon::start();
    // The same disk directory, another socket.
    let other = tempfile::tempdir().unwrap();
    let config = other.path().join("tierkv.toml");
    let text = std::fs::read_to_string(&daemon.config).unwrap().replace(
        &daemon.socket.display().to_string(),
        &other.path().join("tierkv.sock").display().to_string(),
    );
    std::fs::write(&config, text).unwrap();
    let (status, stderr) = serve_refused(&config, other.path());
    assert!(!status.success());
    assert!(
        stderr.contains("in use by another tierkv daemon")
            && stderr.contains(&format!("pid {}", daemon.pid())),
        "{stderr}"
    );
    assert_eq!(daemon.status().tiers.len(), 3, "the first daemon is untouched");
}

#[test]
fn h16_6_the_socket_and_the_disk_directory_are_private() {
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let daemon = Daemon::start();
    let mut worker = daemon.worker(&["--chunk-bytes", "65536"]);
    worker.run("store 1 4");
    daemon.settled();
    assert_eq!(mode(&daemon.socket), 0o600);
    let disk = daemon.dir.path().join("disk");
    assert_eq!(mode(&disk), 0o700);
    for entry in std::fs::read_dir(&disk).unwrap() {
        let path = entry.unwrap().path();
        assert_eq!(mode(&path), 0o600, "{}", path.display());
    }
    worker.exit();
    // SAFETY: getegid cannot fail.
    let gid = unsafe { libc::getegid() };
    let grouped = Daemon::start_with(|dir| {
        small_config(dir, None, &format!("group = \"{gid}\""))
            .replace("[server]\n", &format!("[server]\nsocket_group = \"{gid}\"\n"))
    });
    assert_eq!(mode(&grouped.socket), 0o660);
    assert_eq!(mode(&grouped.dir.path().join("disk")), 0o750);
}

#[test]
fn h16_ops_the_log_has_no_colours_in_a_file_and_says_what_the_disk_recovered() {
    let mut daemon = Daemon::start_customized(
        |dir| small_config(dir, None, ""),
        |command: &mut Command| {
            command.env("TIERKV_LOG", "info");
        },
    );
    let mut worker = daemon.worker(&["--chunk-bytes", "65536"]);
    worker.run("store 1 4");
    daemon.settled();
    worker.exit();
    daemon.stop();
    daemon.restart();
    let log = daemon.log();
    assert!(!log.contains('\u{1b}'), "escape codes in a log file:\n{log}");
    let recovered = log.lines().filter(|l| l.contains("recovered")).nth(1).unwrap_or_default();
    assert!(
        recovered.contains("recovered 4 records (262144 bytes)")
            && recovered.contains("skipped_files=0"),
        "{log}"
    );
}

/// A tmpfs mounted by a test, lazily unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs of `size` at `path` (created), or says why it cannot.
    fn mount(path: &Path, size: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(path).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(Tmpfs(path.to_path_buf()))
    }

    /// Remounts it with `options` (`ro`, `rw`).
    fn remount(&self, options: &str) -> Result<(), String> {
        let out = Command::new("mount")
            .args(["-o", &format!("remount,{options}")])
            .arg(&self.0)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(())
    }

    /// Writes a file until the filesystem is full.
    fn fill(&self) -> std::path::PathBuf {
        let path = self.0.join("filler");
        let mut file = std::fs::File::create(&path).unwrap();
        let block = vec![1u8; 64 << 10];
        while std::io::Write::write_all(&mut file, &block).is_ok() {}
        while std::io::Write::write_all(&mut file, &block[..512]).is_ok() {}
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).output();
    }
}

#[test]
fn h16_3_a_restart_on_a_read_only_filesystem_is_reported_and_one_on_a_full_one_stores() {
    let mut mounted = Err(String::new());
    let mut daemon = Daemon::start_with(|dir| {
        mounted = Tmpfs::mount(&dir.join("disk"), "16m");
        // Write-through, so that stores reach the disk while the daemon runs.
        small_config(dir, None, "\n[storage]\nstore_policy = \"write_through\"\n")
    });
    let tmpfs = match mounted {
        Ok(tmpfs) => tmpfs,
        Err(why) => {
            tierkv_testkit::cannot_mount(&format!("cannot mount a tmpfs here ({why})"));
            return;
        }
    };
    let disk = |daemon: &Daemon| daemon.status().tiers[2].clone();
    let plain = ["--chunk-bytes", "65536"];
    let mut worker = daemon.worker(&plain);
    worker.run("store 1 4");
    daemon.eventually("the chunks reach disk", |s| s.tiers[2].objects == 4);
    assert_eq!(disk(&daemon).read_only, None);
    worker.exit();
    daemon.stop();

    // A restart on a filesystem remounted read-only: reported, and writable once it is again.
    tmpfs.remount("ro").unwrap();
    daemon.restart();
    let why = disk(&daemon).read_only.expect("status shows a read-only disk tier");
    assert!(why.contains("Read-only file system"), "{why}");
    assert!(daemon.log().contains("the disk tier is read-only"), "{}", daemon.log());
    assert_eq!(disk(&daemon).objects, 4, "what was on disk still loads");
    let out = Command::new(artifact("bin", "tierkv"))
        .args(["status", "--socket"])
        .arg(&daemon.socket)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("disk is READ-ONLY"), "{text}");
    tmpfs.remount("rw").unwrap();
    daemon.eventually("the disk tier is writable again", |s| s.tiers[2].read_only.is_none());
    daemon.stop();

    // A restart on a full filesystem: the directory is writable, only its space is taken, so
    // stores reuse the tier's segment, as when the tier fills the disk while running.
    let _filler = tmpfs.fill();
    daemon.restart();
    assert_eq!(disk(&daemon).read_only, None, "a full filesystem turned the disk tier read-only");
    assert_eq!(disk(&daemon).objects, 4, "what was on disk still loads");
    let mut worker = daemon.worker(&plain);
    worker.run("store 2 4");
    daemon.settled();
    worker.exit();
    daemon.stop();
    // Restarted once more, only the disk holds chunks: prompt 2's, in the reused segment.
    daemon.restart();
    let mut worker = daemon.worker(&plain);
    let id = worker.run("lookup-deferred 2 4")["lookup"].as_u64().unwrap();
    let done = worker.run(&format!("wait {id}"));
    assert_eq!(done["per_tier"], serde_json::json!([0, 0, 4, 0]));
    assert_eq!(worker.run(&format!("retrieve {id} 2 4"))["verified"], 4);
    worker.exit();
    drop(daemon);
    drop(tmpfs);
}

#[test]
fn h16_7_clear_needs_the_token_and_status_does_not() {
    use tierkv_client::proto::{ErrorCode, Hello};
    let token = "a-local-admin-secret-h16";
    let mut daemon = Daemon::start_with(|dir| {
        small_config(dir, None, "")
            .replace("[server]\n", &format!("[server]\ntoken = \"{token}\"\n"))
    });
    let mut worker = daemon.worker(&["--chunk-bytes", "65536"]);
    worker.run("store 1 4");
    daemon.settled();
    worker.exit();
    let admin =
        |token: Option<&str>| Hello { token: token.map(String::from), ..Client::admin_hello() };

    // Anyone who can connect may read the status, but not clear.
    let mut local = Client::connect_unix(&daemon.socket, admin(None)).unwrap();
    assert_eq!(local.status().unwrap().tiers[0].objects, 4);
    let refused = local.clear().err().unwrap();
    assert_eq!(refused.code(), Some(ErrorCode::Forbidden), "{refused}");
    assert!(refused.to_string().contains("token"), "{refused}");
    assert_eq!(local.status().unwrap().tiers[0].objects, 4, "a refused clear removed nothing");
    local.end().unwrap();
    let wrong = Client::connect_unix(&daemon.socket, admin(Some("a-wrong-secret-of-length"))).err();
    assert_eq!(wrong.and_then(|e| e.code()), Some(ErrorCode::Forbidden));
    let mut trusted = Client::connect_unix(&daemon.socket, admin(Some(token))).unwrap();
    assert_eq!(trusted.clear().unwrap()[0], 4);
    trusted.end().unwrap();

    // The CLI: status as before; clear with the token read from the config file.
    let tierkv = |args: &[&str]| {
        Command::new(artifact("bin", "tierkv")).args(args).arg(&daemon.config).output().unwrap()
    };
    assert!(tierkv(&["status", "--config"]).status.success());
    let cleared = tierkv(&["clear", "--config"]);
    assert!(cleared.status.success(), "{cleared:?}");
    assert!(
        String::from_utf8_lossy(&cleared.stdout).starts_with("cleared: l1 0, l2 "),
        "{cleared:?}"
    );

    // A daemon without a token cannot be cleared over its socket, and says how to allow it.
    daemon.stop();
    std::fs::write(&daemon.config, small_config(daemon.dir.path(), None, "")).unwrap();
    daemon.restart();
    let mut local = Client::connect_unix(&daemon.socket, admin(None)).unwrap();
    let refused = local.clear().err().unwrap();
    assert!(refused.to_string().contains("set server.token"), "{refused}");
    local.end().unwrap();
}
