//! The wire vectors a client in another language is tested against.
//!
//! Every request and reply type, encoded by this crate, is written as hex into
//! `python/tests/wire_vectors.json`; the Python package's tests encode the same messages with
//! their own code and compare bytes, and decode the replies. The Rust types are the source of
//! truth: this test fails when the committed file no longer matches what they encode, and
//! `TIERKV_BLESS=1 cargo test -p tierkv-proto --test wire_vectors` rewrites it.
//!
//! The chunk-hash vectors ride along, so a client that hashes token ids itself is held to
//! `tierkv_core::hash` by the same file.

#![allow(clippy::unwrap_used, reason = "tests")]

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;
use tierkv_core::hash::{ChunkHasher, chain, root};
use tierkv_proto::{
    ChunkBlocks, ChunkId, ErrorCode, Hello, KvLayout, LookupOutcome, NamespaceDecl,
    PROTOCOL_VERSION, RefusalReason, Refused, RegionSource, Reply, ReplyBody, Request, RequestBody,
    Role, Segment, SessionReport, StatusReport, TierReport, encode,
};

fn hex<T: Serialize>(value: &T) -> String {
    let mut out = Vec::new();
    encode(value, &mut out).unwrap();
    out[4..].iter().map(|b| format!("{b:02x}")).collect()
}

fn hello() -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        role: Role::Worker,
        rank: 1,
        tp_size: 2,
        world_size: Some(2),
        mla: false,
        namespaces: vec![NamespaceDecl { model: "tiny-llama".into(), cache_salt: "t1".into() }],
        chunk_bytes: 1 << 20,
        chunk_tokens: 128,
        token: None,
    }
}

/// A lookup id past 32 bits, as the daemon's are (each run counts them from a random point below
/// 2^52): it travels as a msgpack `uint 64`.
const LARGE_LOOKUP: u64 = (1 << 52) - 3;

fn requests() -> Vec<(&'static str, RequestBody)> {
    let chunk = ChunkId(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
    vec![
        ("hello", RequestBody::Hello(hello())),
        ("hello_mla", RequestBody::Hello(Hello { mla: true, world_size: None, ..hello() })),
        (
            "hello_admin_token",
            RequestBody::Hello(Hello {
                role: Role::Admin,
                rank: 0,
                tp_size: 1,
                world_size: None,
                namespaces: Vec::new(),
                chunk_bytes: 0,
                chunk_tokens: 1,
                token: Some("secret".into()),
                ..hello()
            }),
        ),
        (
            "register_kv",
            RequestBody::RegisterKv {
                regions: vec![RegionSource::Memfd { bytes: 4 << 20 }],
                layout: KvLayout {
                    blocks: 16,
                    block_bytes: 65536,
                    block_stride: 65536,
                    blocks_per_chunk: 2,
                    segments: vec![
                        Segment { region: 0, offset: 0 },
                        Segment { region: 0, offset: 1 << 20 },
                    ],
                },
            },
        ),
        (
            "register_kv_cuda_ipc",
            RequestBody::RegisterKv {
                regions: vec![RegionSource::CudaIpc {
                    handle: (0..64).collect(),
                    device: "0000:3b:00.0".into(),
                    bytes: 1 << 30,
                }],
                layout: KvLayout {
                    blocks: 1024,
                    block_bytes: 32768,
                    block_stride: 32768,
                    blocks_per_chunk: 1,
                    segments: vec![Segment { region: 0, offset: 0 }],
                },
            },
        ),
        (
            "store",
            RequestBody::Store {
                namespace: 0,
                buffer: 0,
                chunks: vec![
                    ChunkBlocks { chunk, blocks: vec![3, 4] },
                    ChunkBlocks { chunk: ChunkId(7), blocks: vec![9, 300] },
                ],
                ready_event: None,
            },
        ),
        (
            "store_ready_event",
            RequestBody::Store {
                namespace: 0,
                buffer: 0,
                chunks: vec![ChunkBlocks { chunk, blocks: vec![3] }],
                ready_event: Some((0..64).collect()),
            },
        ),
        (
            "lookup",
            RequestBody::Lookup {
                namespace: 1,
                chunks: vec![chunk, ChunkId(u128::MAX)],
                defer_prefetch: false,
            },
        ),
        (
            "lookup_deferred",
            RequestBody::Lookup { namespace: 1, chunks: vec![chunk], defer_prefetch: true },
        ),
        (
            "store_no_chunks",
            RequestBody::Store { namespace: 0, buffer: 0, chunks: Vec::new(), ready_event: None },
        ),
        (
            "store_chunks_of_no_blocks",
            RequestBody::Store {
                namespace: 0,
                buffer: 0,
                chunks: vec![
                    ChunkBlocks { chunk, blocks: Vec::new() },
                    ChunkBlocks { chunk: ChunkId(7), blocks: Vec::new() },
                ],
                ready_event: None,
            },
        ),
        (
            "lookup_no_chunks",
            RequestBody::Lookup { namespace: 1, chunks: Vec::new(), defer_prefetch: false },
        ),
        ("query", RequestBody::Query { lookup: 17 }),
        ("query_large_id", RequestBody::Query { lookup: LARGE_LOOKUP }),
        ("wait", RequestBody::Wait { lookup: 17, timeout_ms: 2500 }),
        ("wait_large_id", RequestBody::Wait { lookup: LARGE_LOOKUP, timeout_ms: 60000 }),
        (
            "retrieve",
            RequestBody::Retrieve {
                lookup: 17,
                buffer: 0,
                chunks: vec![ChunkBlocks { chunk, blocks: vec![70000, 1] }],
                done_event: None,
            },
        ),
        (
            "retrieve_done_event",
            RequestBody::Retrieve {
                lookup: 17,
                buffer: 0,
                chunks: vec![ChunkBlocks { chunk, blocks: vec![1] }],
                done_event: Some((0..64).rev().collect()),
            },
        ),
        (
            "retrieve_large_id",
            RequestBody::Retrieve {
                lookup: LARGE_LOOKUP,
                buffer: 63,
                chunks: vec![ChunkBlocks { chunk, blocks: vec![(1 << 32) + 5] }],
                done_event: None,
            },
        ),
        (
            "retrieve_no_chunks",
            RequestBody::Retrieve { lookup: 17, buffer: 0, chunks: Vec::new(), done_event: None },
        ),
        ("release", RequestBody::Release { lookup: 17 }),
        ("release_large_id", RequestBody::Release { lookup: LARGE_LOOKUP }),
        ("flush", RequestBody::Flush { timeout_ms: 30000 }),
        ("end_session", RequestBody::EndSession),
        ("status", RequestBody::Status),
        ("clear", RequestBody::Clear),
    ]
}

fn replies() -> Vec<(&'static str, ReplyBody)> {
    // Always four tiers, `[l1, l2, disk, remote]`, as the daemon sends them.
    let outcome =
        LookupOutcome { hit_chunks: 3, hit_tokens: 384, readers: 2, per_tier: vec![1, 1, 1, 0] };
    let mut all = vec![
        (
            "welcome",
            ReplyBody::Welcome {
                version: PROTOCOL_VERSION,
                session: 5,
                max_chunk_bytes: 1 << 21,
                readers: 1,
            },
        ),
        ("buffer_registered", ReplyBody::BufferRegistered { buffer: 3 }),
        (
            "stored",
            ReplyBody::Stored {
                stored: 2,
                present: 1,
                refused: vec![Refused {
                    index: 3,
                    reason: RefusalReason::NoSpace,
                    message: "out of memory".into(),
                }],
            },
        ),
        (
            "lookup_started_done",
            ReplyBody::LookupStarted {
                lookup: 9,
                l1_hit_chunks: 3,
                outcome: Some(outcome.clone()),
            },
        ),
        (
            "lookup_started_pending",
            ReplyBody::LookupStarted { lookup: 10, l1_hit_chunks: 0, outcome: None },
        ),
        (
            "lookup_started_large_id",
            ReplyBody::LookupStarted { lookup: LARGE_LOOKUP, l1_hit_chunks: 0, outcome: None },
        ),
        ("pending", ReplyBody::Pending),
        ("done", ReplyBody::Done(outcome)),
        ("retrieved", ReplyBody::Retrieved { chunks: 2, bytes: 2 << 20 }),
        ("released", ReplyBody::Released),
        ("flushed", ReplyBody::Flushed { durable: 5, not_durable: 1 }),
        ("bye", ReplyBody::Bye),
        ("cleared", ReplyBody::Cleared { removed: vec![4, 0, 2] }),
        (
            "status",
            ReplyBody::Status(StatusReport {
                version: "0.1.0".into(),
                uptime_s: 1.5,
                tiers: vec![TierReport {
                    name: "l1".into(),
                    used_bytes: 1,
                    cached_bytes: 2,
                    capacity_bytes: 3,
                    objects: 4,
                    hit_chunks: 5,
                    read_only: None,
                    degraded: None,
                }],
                l1_leased_chunks: 6,
                lookups: 7,
                requested_chunks: 8,
                hit_chunks: 4,
                hit_ratio: 0.5,
                requested_tokens: 1024,
                hit_tokens: 512,
                open_lookups: 1,
                store_in_flight: 0,
                connected_workers: 1,
                sessions: vec![SessionReport {
                    session: 5,
                    role: Role::Worker,
                    rank: 0,
                    tp_size: 1,
                    open_lookups: 1,
                    joined_lookups: 0,
                }],
            }),
        ),
    ];
    for code in error_codes() {
        let name = format!("error_{}", serde_json::to_value(code).unwrap().as_str().unwrap());
        let reply = ReplyBody::Error { code, message: format!("{code:?} happened") };
        all.push((Box::leak(name.into_boxed_str()), reply));
    }
    all
}

/// Every error code: the match fails to compile when one is added, so none is left untested.
fn error_codes() -> Vec<ErrorCode> {
    use ErrorCode::*;
    let all = [
        BadFrame,
        BadRequest,
        VersionMismatch,
        NoSession,
        Forbidden,
        NamespaceNotDeclared,
        BadBuffer,
        BlockOutOfRange,
        UnknownLookup,
        Pending,
        NotInHit,
        ShareReturned,
        Timeout,
        Full,
        Stopped,
        TooManyConnections,
        LeaseLimit,
        Internal,
    ];
    for code in all {
        match code {
            BadFrame | BadRequest | VersionMismatch | NoSession | Forbidden
            | NamespaceNotDeclared | BadBuffer | BlockOutOfRange | UnknownLookup | Pending
            | NotInHit | ShareReturned | Timeout | Full | Stopped | TooManyConnections
            | LeaseLimit | Internal => {}
        }
    }
    all.to_vec()
}

fn hashes() -> serde_json::Value {
    let tokens: Vec<u32> = (0..8).collect();
    let chained = ChunkHasher::new(4).unwrap().prefix_hashes(&tokens);
    let long: Vec<u32> = (0..300).map(|t| t * 7919 % 32000).collect();
    let long_chained = ChunkHasher::new(128).unwrap().prefix_hashes(&long);
    serde_json::json!({
        "root": format!("{:032x}", root().0),
        "tokens_0_to_7_chunk_4": chained.iter().map(|h| format!("{:032x}", h.0)).collect::<Vec<_>>(),
        "tokens_t_times_7919_mod_32000_300_chunk_128":
            long_chained.iter().map(|h| format!("{:032x}", h.0)).collect::<Vec<_>>(),
        "extra_lora7_tokens_1_2_3": format!("{:032x}", chain(root(), &[1, 2, 3], b"lora:7").0),
    })
}

fn vectors() -> String {
    let requests: BTreeMap<&str, serde_json::Value> = requests()
        .into_iter()
        .enumerate()
        .map(|(i, (name, body))| {
            let id = i as u64 + 1;
            (name, serde_json::json!({"id": id, "hex": hex(&Request { id, body })}))
        })
        .collect();
    let replies: BTreeMap<&str, String> =
        replies().into_iter().map(|(name, body)| (name, hex(&Reply { id: 42, body }))).collect();
    let doc = serde_json::json!({
        "_about": "Written by crates/tierkv-proto/tests/wire_vectors.rs from the Rust types; do not edit. Each request is encoded with the id beside it; every reply carries id 42.",
        "protocol_version": tierkv_proto::PROTOCOL_VERSION,
        "requests": requests,
        "replies": replies,
        "hashes": hashes(),
    });
    serde_json::to_string_pretty(&doc).unwrap() + "\n"
}

#[test]
fn python_wire_vectors_match_the_rust_types() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../python/tests/wire_vectors.json");
    let now = vectors();
    if std::env::var_os("TIERKV_BLESS").is_some() {
        std::fs::write(&path, &now).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == now,
        "{} is not what the Rust types encode; if the protocol change is intended, run \
         TIERKV_BLESS=1 cargo test -p tierkv-proto --test wire_vectors and update the Python \
         package to match",
        path.display()
    );
}
