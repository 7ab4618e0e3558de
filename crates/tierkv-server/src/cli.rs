//! The `tierkv` command line.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

mod replay;

use clap::{Parser, Subcommand};
use tierkv_client::{Client, ClientError, UnixOptions};
use tierkv_proto::StatusReport;

use crate::config::{ConfigError, DEFAULT_TOML, DaemonConfig, ServerConfig};

/// tierkv: a per-node, multi-tier KV-cache offload service for LLM inference.
#[derive(Parser, Debug)]
#[command(name = "tierkv", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs the daemon until SIGTERM or SIGINT.
    Serve {
        /// The TOML configuration; the embedded default (`tierkv config default`) without it.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Asks a running daemon how it is doing.
    Status {
        /// The daemon's socket; taken from --config, or the default's, without it.
        #[arg(long)]
        socket: Option<PathBuf>,
        /// The configuration the daemon runs with (to find its socket; only its [server]
        /// section is read).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// A user the daemon may run as besides yours and root (repeatable): a listener of any
        /// other user on the socket is refused before anything is sent to it.
        #[arg(long = "daemon-uid", value_name = "UID")]
        daemon_uid: Vec<u32>,
        /// Seconds to wait for each of the daemon's answers before giving up.
        #[arg(long, default_value_t = 10.0, value_parser = seconds)]
        timeout: f64,
    },
    /// Empties every tier of what nobody holds. Needs the daemon's token: from --config (its
    /// server.token) or the environment variable TIERKV_TOKEN.
    Clear {
        /// The daemon's socket; taken from --config, or the default's, without it.
        #[arg(long)]
        socket: Option<PathBuf>,
        /// The configuration the daemon runs with (its socket and token; only its [server]
        /// section is read).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// A user the daemon may run as besides yours and root (repeatable): a listener of any
        /// other user on the socket is refused before anything is sent to it.
        #[arg(long = "daemon-uid", value_name = "UID")]
        daemon_uid: Vec<u32>,
        /// Seconds to wait for the daemon to take the session and report its tiers before
        /// giving up. The clear itself is waited for as long as it takes (a large disk tier
        /// marks each of its records deleted).
        #[arg(long, default_value_t = 10.0, value_parser = seconds)]
        timeout: f64,
    },
    /// Configuration files.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// Replays request traces through a daemon (or, with --simulate, through the eviction
    /// policies alone) and reports hit ratios, bytes moved, latency and a plot.
    Replay(Box<replay::ReplayArgs>),
    /// A simulated TP worker, started by `tierkv replay`.
    #[command(hide = true)]
    ReplayWorker(replay::WorkerArgs),
}

#[derive(Subcommand, Debug)]
enum ConfigAction {
    /// Checks a configuration file as `tierkv serve` would and says what is wrong, with the key
    /// and line. Run it as the daemon's user: whether that user may give its files the groups
    /// server.socket_group and disk.group name is checked for the user who runs it.
    Check {
        /// The file.
        file: PathBuf,
    },
    /// Prints the embedded default configuration, every key commented.
    Default,
}

/// Runs the command line; the exit code says whether it worked.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve { config } => serve(config.as_deref()),
        Command::Status { socket, config, json, daemon_uid, timeout } => {
            let timeout = Duration::from_secs_f64(timeout);
            status(socket, config.as_deref(), json, Trust { timeout, daemon_uids: daemon_uid })
        }
        Command::Clear { socket, config, daemon_uid, timeout } => {
            let timeout = Duration::from_secs_f64(timeout);
            clear(socket, config.as_deref(), Trust { timeout, daemon_uids: daemon_uid })
        }
        Command::Config { action: ConfigAction::Check { file } } => check(&file),
        Command::Config { action: ConfigAction::Default } => print(DEFAULT_TOML),
        Command::Replay(args) => replay::replay(*args).and_then(|text| print(&text)),
        Command::ReplayWorker(args) => replay::worker(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            let _ = writeln!(std::io::stderr(), "tierkv: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The configuration at `path` as `read` reads it, or the embedded default's as `embedded`
/// does.
fn load<T>(
    path: Option<&Path>,
    read: impl FnOnce(&Path) -> Result<T, ConfigError>,
    embedded: impl FnOnce() -> Result<T, ConfigError>,
) -> Result<T, String> {
    match path {
        Some(path) => read(path).map_err(|e| e.to_string()),
        None => {
            embedded().map_err(|e| format!("the embedded default configuration is broken: {e}"))
        }
    }
}

/// The log filter `TIERKV_LOG` gives, `info` without it; a filter that does not parse is
/// reported on stderr (else a typo would silently log at `info`) and `info` is taken instead.
fn log_filter() -> tracing_subscriber::EnvFilter {
    let info = || tracing_subscriber::EnvFilter::new("info");
    match std::env::var("TIERKV_LOG") {
        Ok(text) => tracing_subscriber::EnvFilter::try_new(&text).unwrap_or_else(|e| {
            let _ = writeln!(
                std::io::stderr(),
                "tierkv: TIERKV_LOG={text:?} is not a log filter ({e}); logging at info"
            );
            info()
        }),
        Err(std::env::VarError::NotPresent) => info(),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "tierkv: TIERKV_LOG: {e}; logging at info");
            info()
        }
    }
}

fn serve(path: Option<&Path>) -> Result<(), String> {
    tracing_subscriber::fmt()
        .with_env_filter(log_filter())
        .with_writer(std::io::stderr)
        // Colours are escape codes: only a terminal shows them; a file or a journal keeps
        // them as noise.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let config = load(path, DaemonConfig::from_file, DaemonConfig::embedded_default)?;
    let source =
        path.map_or_else(|| "the embedded default".to_string(), |p| p.display().to_string());
    tracing::info!("configuration: {source}");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tierkv-io")
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let served = runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        // Installed before start-up, which may take seconds (prefaulting L1, pinning L2,
        // scanning the disk): a signal then is kept, and the daemon stops cleanly as soon as it
        // has started, instead of dying of it.
        let signals = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()));
        let stop = async move {
            match signals {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => tracing::info!("SIGTERM"),
                        _ = int.recv() => tracing::info!("SIGINT"),
                    }
                    // A second signal during the clean stop (stuck behind a tier that does not
                    // answer, say) ends the process at once.
                    tokio::spawn(async move {
                        tokio::select! {
                            _ = term.recv() => {}
                            _ = int.recv() => {}
                        }
                        tracing::warn!(
                            "a second signal: exiting now, before the clean stop finished (what \
                             it had not handed down to disk is lost)"
                        );
                        std::process::exit(1);
                    });
                }
                _ => {
                    tracing::error!("cannot install signal handlers; stop with SIGKILL");
                    std::future::pending::<()>().await;
                }
            }
        };
        crate::daemon::serve(config, stop).await.map_err(|e| e.to_string())
    });
    // A request still blocked in a tier past the stop is not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    served
}

/// `--timeout`: a positive number of seconds that a `Duration` holds.
fn seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s > 0.0 && Duration::try_from_secs_f64(s).is_ok() => Ok(s),
        _ => Err(format!("{text:?} is not a positive number of seconds")),
    }
}

/// How an admin command connects: each answer waited for at most `timeout`, and the daemon
/// trusted as one of `daemon_uids` besides this user and root.
struct Trust {
    timeout: Duration,
    daemon_uids: Vec<u32>,
}

/// An admin session on `socket`, connected as `trust` says.
fn admin(socket: &Path, hello: tierkv_proto::Hello, trust: Trust) -> Result<Client, String> {
    let options = UnixOptions { timeout: Some(trust.timeout), daemon_uids: trust.daemon_uids };
    Client::connect_unix_with(socket, hello, &options).map_err(|e| match e {
        ClientError::NoAnswer { .. } => e.to_string(),
        ClientError::UntrustedDaemon { uid, .. } => format!("{e} (here: --daemon-uid {uid})"),
        e => format!("no daemon answers on {}: {e}", socket.display()),
    })
}

/// A failed call of an admin session, saying which and, past its timeout, that it was one.
fn failed(what: &str, socket: &Path, timeout: Duration) -> impl Fn(ClientError) -> String {
    move |e| {
        if e.is_timeout() {
            format!(
                "the daemon on {} did not answer {what} within {} s",
                socket.display(),
                timeout.as_secs_f64()
            )
        } else {
            format!("{what}: {e}")
        }
    }
}

fn status(
    socket: Option<PathBuf>,
    config: Option<&Path>,
    json: bool,
    trust: Trust,
) -> Result<(), String> {
    let socket = match socket {
        Some(socket) => socket,
        None => load(config, ServerConfig::from_file, ServerConfig::embedded_default)?.socket,
    };
    let timeout = trust.timeout;
    let mut client = admin(&socket, Client::admin_hello(), trust)?;
    let report = client.status().map_err(failed("status", &socket, timeout))?;
    let _ = client.end();
    if json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        return print(&format!("{text}\n"));
    }
    print(&render(&report))
}

fn clear(socket: Option<PathBuf>, config: Option<&Path>, trust: Trust) -> Result<(), String> {
    let timeout = trust.timeout;
    // The `[server]` section alone: neither the other sections nor the groups the daemon's user
    // must belong to are checked for whoever runs this.
    let loaded = load(config, ServerConfig::from_file, ServerConfig::embedded_default)?;
    let socket = socket.unwrap_or(loaded.socket);
    let token = std::env::var("TIERKV_TOKEN").ok().or(loaded.token).ok_or(
        "clear needs the daemon's token: give --config with its server.token, or set TIERKV_TOKEN",
    )?;
    let hello = tierkv_proto::Hello { token: Some(token), ..Client::admin_hello() };
    let mut client = admin(&socket, hello, trust)?;
    let tiers = client.status().map_err(failed("status", &socket, timeout))?.tiers;
    // A daemon that answered is there: its clear may take minutes on a large disk tier, and
    // one given up on would go on all the same (reported as failed, though it is not).
    client.set_timeout(None).map_err(|e| format!("cannot wait for the clear: {e}"))?;
    let removed = client.clear().map_err(failed("clear", &socket, timeout))?;
    let _ = client.end();
    let parts: Vec<String> = removed
        .iter()
        .enumerate()
        .map(|(i, n)| format!("{} {n}", tiers.get(i).map_or("tier", |t| t.name.as_str())))
        .collect();
    print(&format!("cleared: {}\n", parts.join(", ")))
}

fn check(file: &Path) -> Result<(), String> {
    match DaemonConfig::from_file(file) {
        Ok(_) => print(&format!("{}: ok\n", file.display())),
        Err(e) => {
            let all = e.all();
            if all.len() == 1 {
                return Err(e.to_string());
            }
            let mut stderr = std::io::stderr().lock();
            for error in &all {
                let _ = writeln!(stderr, "{error}");
            }
            Err(format!("{}: {} errors", file.display(), all.len()))
        }
    }
}

fn print(text: &str) -> Result<(), String> {
    std::io::stdout().write_all(text.as_bytes()).map_err(|e| e.to_string())
}

/// The human form of a status report.
pub fn render(report: &StatusReport) -> String {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut out = format!(
        "tierkv {}, up {:.0} s, {} worker(s) connected\n\n",
        report.version, report.uptime_s, report.connected_workers
    );
    out.push_str("tier   used GiB  capacity GiB  used %   chunks  hit chunks\n");
    for t in &report.tiers {
        let pct = if t.capacity_bytes == 0 {
            0.0
        } else {
            100.0 * t.used_bytes as f64 / t.capacity_bytes as f64
        };
        out.push_str(&format!(
            "{:<5} {:>9.3} {:>13.3} {:>7.1} {:>8} {:>11}\n",
            t.name,
            gib(t.used_bytes),
            gib(t.capacity_bytes),
            pct,
            t.objects,
            t.hit_chunks
        ));
    }
    for t in &report.tiers {
        if let Some(why) = &t.read_only {
            out.push_str(&format!("{} is READ-ONLY (stores refused, retrying): {why}\n", t.name));
        }
        if let Some(why) = &t.degraded {
            out.push_str(&format!("{} is DEGRADED (misses, reconnecting): {why}\n", t.name));
        }
    }
    out.push_str(&format!(
        "\nlookups {}: {} of {} chunks hit ({:.1}%), {} of {} tokens\n",
        report.lookups,
        report.hit_chunks,
        report.requested_chunks,
        100.0 * report.hit_ratio,
        report.hit_tokens,
        report.requested_tokens
    ));
    out.push_str(&format!(
        "open lookups {}, L1 chunks leased {}, store copies in flight {}\n",
        report.open_lookups, report.l1_leased_chunks, report.store_in_flight
    ));
    out
}
