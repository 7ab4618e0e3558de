//! The `tierkv` command: the daemon and the tools around it.

fn main() -> std::process::ExitCode {
    tierkv_server::cli::main()
}
