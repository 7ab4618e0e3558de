//! Tidy checks that keep the crate graph as ARCHITECTURE.md draws it. They run as ordinary
//! tests, so `cargo test` is the single gate.

use std::path::Path;

/// The dependency names of a crate's `[dependencies]` table.
fn dependencies(crate_dir: &str) -> Vec<String> {
    let manifest =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(crate_dir).join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest)
        .unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
    let mut in_dependencies = false;
    let mut names = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_dependencies = line == "[dependencies]";
        } else if in_dependencies && let Some((name, _)) = line.split_once('=') {
            names.push(name.trim().trim_end_matches(".workspace").to_string());
        }
    }
    names
}

#[test]
fn core_is_pure_logic() {
    let deps = dependencies("tierkv-core");
    assert!(
        deps.contains(&"xxhash-rust".to_string()),
        "the parser found no dependencies: {deps:?}"
    );
    for banned in ["tokio", "cudarc", "memmap2", "metrics", "tierkv-l1"] {
        assert!(
            !deps.iter().any(|d| d == banned),
            "tierkv-core must not depend on {banned}: {deps:?}"
        );
    }
}

#[test]
fn l1_knows_no_runtime_protocol_or_exporter() {
    let deps = dependencies("tierkv-l1");
    assert!(
        deps.contains(&"tierkv-core".to_string()),
        "the parser found no dependencies: {deps:?}"
    );
    for banned in ["tokio", "serde", "toml", "metrics-exporter-prometheus"] {
        assert!(
            !deps.iter().any(|d| d == banned),
            "tierkv-l1 must not depend on {banned}: {deps:?}"
        );
    }
}
