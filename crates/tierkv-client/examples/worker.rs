//! A small engine worker: one session with a shared-memory KV buffer, driven by commands on
//! stdin, one JSON line per command on stdout. The integration tests run several of these as
//! separate processes to act as the ranks of a tensor-parallel group.
//!
//! ```text
//! worker --socket PATH --model M --chunk-bytes B --blocks N [--rank R --tp T --mla --salt S]
//!   store PROMPT N            store chunks 0..N of PROMPT from blocks 0..N
//!   lookup PROMPT N           look up chunks 0..N of PROMPT
//!   lookup-deferred PROMPT N  the same, prefetching nothing before its first wait
//!   wait LOOKUP               wait for a lookup to complete
//!   retrieve LOOKUP PROMPT N  copy chunks 0..N into blocks 0..N, verify every byte
//!   release LOOKUP            return every share of a lookup
//!   status                    the daemon's status
//!   help                      these commands
//!   exit                      end the session
//! ```
//!
//! `worker --help` prints the flags and the commands and exits.
//!
//! Chunk `i` of prompt `p` has a fixed id and fixed bytes (derived from the id, and from the
//! rank unless the KV is shared), so any process can check what another stored.

#![allow(clippy::print_stdout, reason = "the worker answers on stdout")]

use std::io::BufRead;
use std::time::Duration;

use serde_json::{Value, json};
use tierkv_client::payload::{SHARED_TAG, chunk_id, fill, holds};
use tierkv_client::proto::{ChunkBlocks, Hello, NamespaceDecl, PROTOCOL_VERSION, Role};
use tierkv_client::{Client, ClientError, SharedBuffer};

/// The flags, printed by `--help`.
const USAGE: &str =
    "usage: worker --socket PATH [--model M] [--salt S] [--chunk-bytes B] [--blocks N]
              [--rank R] [--tp T] [--mla]
Opens one worker session on the tierkv daemon at PATH, registers a shared buffer of N blocks
of B bytes, prints {\"ok\": true, \"ready\": true, \"session\": ID} and then reads commands
on stdin, one per line, answering each with one JSON line (\"ok\" says whether it worked).
";

/// The commands, printed by `--help` and answered to `help`.
const COMMANDS: [&str; 9] = [
    "store PROMPT N            store chunks 0..N of PROMPT from blocks 0..N",
    "lookup PROMPT N           look up chunks 0..N of PROMPT",
    "lookup-deferred PROMPT N  the same, prefetching nothing before its first wait",
    "wait LOOKUP               wait for a lookup to complete",
    "retrieve LOOKUP PROMPT N  copy chunks 0..N into blocks 0..N, verify every byte",
    "release LOOKUP            return every share of a lookup",
    "status                    the daemon's status",
    "help                      these commands",
    "exit                      end the session",
];

struct Args {
    socket: String,
    model: String,
    salt: String,
    chunk_bytes: u64,
    blocks: u64,
    rank: u16,
    tp: u16,
    mla: bool,
}

/// The flags; `None` when `--help` asked for the usage instead.
fn parse_args() -> Result<Option<Args>, String> {
    let mut args = Args {
        socket: String::new(),
        model: "model".into(),
        salt: String::new(),
        chunk_bytes: 4096,
        blocks: 64,
        rank: 0,
        tp: 1,
        mla: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Ok(None);
        }
        if flag == "--mla" {
            args.mla = true;
            continue;
        }
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let number = |v: &str| v.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--socket" => args.socket = value,
            "--model" => args.model = value,
            "--salt" => args.salt = value,
            "--chunk-bytes" => args.chunk_bytes = number(&value)?,
            "--blocks" => args.blocks = number(&value)?,
            "--rank" => args.rank = number(&value)? as u16,
            "--tp" => args.tp = number(&value)? as u16,
            _ => return Err(format!("unknown flag {flag} (try --help)")),
        }
    }
    if args.socket.is_empty() {
        return Err("--socket PATH is required (try --help)".into());
    }
    Ok(Some(args))
}

struct Worker {
    client: Client,
    buffer: SharedBuffer,
    buffer_id: u32,
    rank_tag: u64,
}

impl Worker {
    fn blocks(&self, prompt: u64, n: u64) -> Result<Vec<ChunkBlocks>, String> {
        if n > self.buffer.blocks() {
            return Err(format!("{n} chunks do not fit {} blocks", self.buffer.blocks()));
        }
        Ok((0..n).map(|i| ChunkBlocks::one(chunk_id(prompt, i), i)).collect())
    }

    fn run(&mut self, words: &[&str]) -> Result<Value, String> {
        let num = |i: usize| -> Result<u64, String> {
            words.get(i).ok_or("missing argument")?.parse::<u64>().map_err(|e| e.to_string())
        };
        let daemon = |e: ClientError| e.to_string();
        match words.first().copied().unwrap_or("") {
            "store" => {
                let refs = self.blocks(num(1)?, num(2)?)?;
                for r in &refs {
                    let block = self.buffer.block_mut(r.blocks[0]).ok_or("block out of range")?;
                    fill(block, r.chunk, self.rank_tag);
                }
                let stored = self.client.store(0, self.buffer_id, refs).map_err(daemon)?;
                Ok(json!({"stored": stored.stored, "present": stored.present,
                          "refused": stored.refused.len()}))
            }
            command @ ("lookup" | "lookup-deferred") => {
                let ids = self.blocks(num(1)?, num(2)?)?.iter().map(|r| r.chunk).collect();
                let lookup = if command == "lookup" {
                    self.client.lookup(0, ids)
                } else {
                    self.client.lookup_deferred(0, ids)
                };
                let lookup = lookup.map_err(daemon)?;
                Ok(json!({"lookup": lookup.id, "l1": lookup.l1_hit_chunks,
                          "hit": lookup.outcome.map(|o| o.hit_chunks)}))
            }
            "wait" => {
                let outcome = self.client.wait(num(1)?, Duration::from_secs(30)).map_err(daemon)?;
                Ok(json!({"hit": outcome.hit_chunks, "readers": outcome.readers,
                          "per_tier": outcome.per_tier}))
            }
            "retrieve" => {
                let refs = self.blocks(num(2)?, num(3)?)?;
                for r in &refs {
                    self.buffer.block_mut(r.blocks[0]).ok_or("block out of range")?.fill(0);
                }
                let bytes =
                    self.client.retrieve(num(1)?, self.buffer_id, refs.clone()).map_err(daemon)?;
                for r in &refs {
                    let block = self.buffer.block(r.blocks[0]).ok_or("block out of range")?;
                    if !holds(block, r.chunk, self.rank_tag) {
                        return Err(format!(
                            "block {} does not hold chunk {:?}",
                            r.blocks[0], r.chunk
                        ));
                    }
                }
                Ok(json!({"bytes": bytes, "verified": refs.len()}))
            }
            "release" => {
                self.client.release(num(1)?).map_err(daemon)?;
                Ok(json!({}))
            }
            "status" => serde_json::to_value(self.client.status().map_err(daemon)?)
                .map_err(|e| e.to_string()),
            "help" => Ok(json!({"commands": COMMANDS})),
            other => Err(format!("unknown command {other:?}; \"help\" lists the commands")),
        }
    }
}

fn main() -> Result<(), String> {
    let Some(args) = parse_args()? else {
        println!("{USAGE}\ncommands:");
        for command in COMMANDS {
            println!("  {command}");
        }
        return Ok(());
    };
    let hello = Hello {
        version: PROTOCOL_VERSION,
        role: Role::Worker,
        rank: args.rank,
        tp_size: args.tp,
        world_size: Some(args.tp),
        mla: args.mla,
        namespaces: vec![NamespaceDecl {
            model: args.model.clone(),
            cache_salt: args.salt.clone(),
        }],
        chunk_bytes: args.chunk_bytes,
        chunk_tokens: 16,
        token: None,
    };
    let mut client = Client::connect_unix(&args.socket, hello).map_err(|e| e.to_string())?;
    let buffer = SharedBuffer::new(args.chunk_bytes, args.blocks).map_err(|e| e.to_string())?;
    let buffer_id = client.register_buffer(&buffer).map_err(|e| e.to_string())?;
    let rank_tag = if args.mla { SHARED_TAG } else { u64::from(args.rank) };
    let mut worker = Worker { client, buffer, buffer_id, rank_tag };
    println!("{}", json!({"ok": true, "ready": true, "session": worker.client.session().id}));
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() == Some(&"exit") {
            break;
        }
        let answer = match worker.run(&words) {
            Ok(mut value) => {
                value["ok"] = json!(true);
                value
            }
            Err(error) => json!({"ok": false, "error": error}),
        };
        println!("{answer}");
    }
    worker.client.end().map_err(|e| e.to_string())
}
