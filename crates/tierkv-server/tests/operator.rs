//! What an operator runs into around the daemon: the commands that talk to it run by another
//! user than the daemon's, a start refused over an address, and a mistyped log filter.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// The user the commands run as in these tests: an operator who may connect to the socket but
/// is in none of the daemon's groups.
const NOBODY: u32 = 65534;

fn tierkv() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tierkv"));
    command.stdin(Stdio::null());
    command
}

/// `command` run as `uid` (its groups dropped), or as this process where `uid` is `None`.
fn run_as(mut command: Command, uid: Option<u32>) -> Output {
    if let Some(uid) = uid {
        command.uid(uid).gid(uid);
    }
    command.output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A directory everyone may read, for files another user's command reads.
fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// Whether this process may run the `tierkv` binary as [`NOBODY`] here (the tests run as root;
/// elsewhere the tests that need it say so and skip: `tierkv_testkit::may_run_as`).
fn may_switch_users() -> bool {
    let mut probe = tierkv();
    probe.arg("--version");
    tierkv_testkit::may_run_as(NOBODY, probe)
}

#[test]
fn status_and_clear_read_the_server_section_alone_and_check_no_group_for_their_user() {
    if !may_switch_users() {
        return;
    }
    let dir = open_dir();
    let socket = dir.path().join("nobody-listens.sock");
    // Groups nobody is not in, and a tier setting the daemon would refuse: neither concerns a
    // command that only needs the socket and the token.
    let config = dir.path().join("tierkv.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nsocket = \"{}\"\ntoken = \"a-token-of-sixteen-or-more\"\nsocket_group = \
             \"root\"\n[l1]\ncapacity = \"1KiB\"\n[disk]\ngroup = \"root\"\n",
            socket.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
    for uid in [None, Some(NOBODY)] {
        for command in ["status", "clear"] {
            let mut cli = tierkv();
            cli.args([command, "--timeout", "1", "--config"]).arg(&config);
            let out = run_as(cli, uid);
            let stderr = stderr(&out);
            assert!(!out.status.success(), "{command} as {uid:?}: no daemon runs");
            // It got as far as the socket: nothing in the file refused it.
            assert!(
                stderr.contains(&format!("no daemon answers on {}", socket.display())),
                "{command} as {uid:?}: {stderr}"
            );
        }
    }
    // A mistake in the server section is still one.
    std::fs::write(&config, "[server]\nsocket = \"\"\n").unwrap();
    let out = run_as(
        {
            let mut cli = tierkv();
            cli.args(["status", "--config"]).arg(&config);
            cli
        },
        None,
    );
    assert!(stderr(&out).contains("server.socket"), "{}", stderr(&out));
}

#[test]
fn config_check_checks_the_groups_for_the_user_who_runs_it_and_says_so() {
    if !may_switch_users() {
        return;
    }
    let dir = open_dir();
    let config = dir.path().join("tierkv.toml");
    std::fs::write(&config, "[server]\nsocket_group = \"root\"\n[disk]\ngroup = \"root\"\n")
        .unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
    let check = || {
        let mut cli = tierkv();
        cli.args(["config", "check"]).arg(&config);
        cli
    };
    // Root may give its files any group: the file is right for a daemon run as root.
    let out = run_as(check(), None);
    assert!(out.status.success(), "{}", stderr(&out));
    // Run as another user, the verdict is that user's, and the refusal says whose and what to
    // do about it.
    let out = run_as(check(), Some(NOBODY));
    let stderr = stderr(&out);
    assert!(!out.status.success(), "nobody may not give its files the group root");
    for key in ["server.socket_group", "disk.group"] {
        assert!(stderr.contains(&format!(": {key}: this user (uid {NOBODY})")), "{key}: {stderr}");
    }
    assert!(stderr.contains("run `tierkv config check` as the daemon's user"), "{stderr}");
}

#[test]
fn a_taken_tcp_port_fails_the_start_before_the_tiers_open_and_leaves_no_socket() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let (socket, disk) = (dir.path().join("tierkv.sock"), dir.path().join("disk"));
    let config = dir.path().join("tierkv.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nsocket = \"{}\"\ntcp = \"{addr}\"\ntoken = \"a-token-of-sixteen-or-more\"\n\
             [metrics]\nenabled = false\n[l1]\ndevice = \"emulated\"\ncapacity = \"4MiB\"\n\
             slot = \"64KiB\"\n[l2]\nenabled = false\n[disk]\ndir = \"{}\"\ncapacity = \"32MiB\"\n\
             segment = \"4MiB\"\n",
            socket.display(),
            disk.display()
        ),
    )
    .unwrap();
    let mut cli = tierkv();
    cli.args(["serve", "--config"]).arg(&config).env("TIERKV_LOG", "warn");
    let out = run_as(cli, None);
    let stderr = stderr(&out);
    assert!(!out.status.success(), "started on a port another process holds");
    assert!(stderr.contains(&format!("cannot listen on {addr} (server.tcp)")), "{stderr}");
    assert!(!socket.exists(), "the failed start left its socket file behind");
    assert!(!disk.exists(), "the tiers opened before the port was tried");
    drop(taken);
}

#[test]
fn a_log_filter_that_does_not_parse_is_reported_before_falling_back_to_info() {
    let missing = Path::new("/nonexistent/tierkv.toml");
    let serve = |filter: &str| {
        let mut cli = tierkv();
        cli.args(["serve", "--config"]).arg(missing).env("TIERKV_LOG", filter);
        run_as(cli, None)
    };
    let out = serve("info,tierkv=loud");
    let stderr_text = stderr(&out);
    assert!(
        stderr_text.contains("TIERKV_LOG=\"info,tierkv=loud\" is not a log filter")
            && stderr_text.contains("logging at info"),
        "{stderr_text}"
    );
    // It went on to read the configuration.
    assert!(stderr_text.contains("/nonexistent/tierkv.toml"), "{stderr_text}");
    let out = serve("warn,tierkv_disk=debug");
    assert!(
        !stderr(&out).contains("TIERKV_LOG"),
        "a good filter is taken as it is: {}",
        stderr(&out)
    );
}
