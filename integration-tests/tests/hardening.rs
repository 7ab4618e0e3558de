//! Issue 16, hardening: what a hostile week in production found, one test per defect, each
//! named after it (`h16_<n>_...`, `h16_ops_...` for the operations list).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::process::Command;

use tierkv_integration_tests::{Daemon, artifact};

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
