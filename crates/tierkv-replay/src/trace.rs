//! Request traces: the Mooncake JSONL, a generic JSONL and the Azure LLM inference CSV, read
//! into one shape.
//!
//! The two JSONL formats are one JSON object per line, one line per request, and name each
//! request's chunks by *prefix* hashes: a chunk's id covers it and every chunk before it, so
//! equal ids mean reusable KV for the whole prefix.
//!
//! - Mooncake (FAST'25): `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//!   "hash_ids": [int, ...]}` with 512-token blocks.
//! - Generic: `{"timestamp_ms": ms, "chunks": [id, ...], "tokens": n}`, where an id is an
//!   unsigned integer or a string (hashed), `timestamp_ms` is optional (requests then arrive
//!   back to back) and `tokens` defaults to every chunk full.
//!
//! A line is recognised by its fields, so one reader takes either format.
//!
//! - Azure LLM inference 2023 (Splitwise): a CSV with the header
//!   `TIMESTAMP,ContextTokens,GeneratedTokens` and rows `2023-11-16 18:17:03.9799600,4808,10`.
//!   It has arrival times and lengths only, no hashes, so nothing in it is known to be shared:
//!   every chunk gets an id of its own, and the trace is a stream without reuse (a baseline of
//!   misses with a real arrival pattern).

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

/// Tokens per chunk in the Mooncake traces.
pub const MOONCAKE_CHUNK_TOKENS: u64 = 512;

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a request of either format.
    #[error("{path}:{line}: {message}")]
    Line {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// The file holds no request.
    #[error("{0}: no requests")]
    Empty(PathBuf),
}

/// One request of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// When it arrives, in milliseconds from the trace's start.
    pub timestamp_ms: f64,
    /// Its chunks' prefix hashes, root first.
    pub chunks: Vec<u64>,
    /// Its prompt length in tokens (the last chunk may be partial).
    pub tokens: u64,
}

/// A trace read into memory.
#[derive(Clone, Debug)]
pub struct Trace {
    /// A short name: the file's stem.
    pub name: String,
    /// Tokens per full chunk.
    pub chunk_tokens: u64,
    /// The requests, in arrival order.
    pub requests: Vec<TraceRequest>,
}

impl Trace {
    /// Reads a trace file. `chunk_tokens` is the chunk size of generic traces (Mooncake's is
    /// fixed at 512).
    pub fn read(path: &Path, chunk_tokens: u64) -> Result<Trace, TraceError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| TraceError::Read { path: path.to_path_buf(), source })?;
        let name = path
            .file_stem()
            .map_or_else(|| path.display().to_string(), |stem| stem.to_string_lossy().into_owned());
        let trace = Trace::parse(&name, &text, chunk_tokens).map_err(|(line, message)| {
            TraceError::Line { path: path.to_path_buf(), line, message }
        })?;
        if trace.requests.is_empty() {
            return Err(TraceError::Empty(path.to_path_buf()));
        }
        Ok(trace)
    }

    /// Parses trace text; an error is the line (from 1) and what is wrong with it.
    pub fn parse(name: &str, text: &str, chunk_tokens: u64) -> Result<Trace, (usize, String)> {
        if chunk_tokens == 0 {
            return Err((0, "chunk_tokens must be positive".into()));
        }
        let azure =
            text.lines().find(|line| !line.trim().is_empty()).map(str::trim) == Some(AZURE_HEADER);
        let mut requests = Vec::new();
        let mut trace_chunk_tokens = chunk_tokens;
        let mut azure_start = None;
        let mut next_id = 0;
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() || (azure && line.trim() == AZURE_HEADER) {
                continue;
            }
            let parsed = if azure {
                parse_azure_row(line, chunk_tokens, &mut azure_start, &mut next_id)
                    .map(|request| (request, chunk_tokens))
            } else {
                parse_line(line, chunk_tokens)
            };
            let (request, tokens) = parsed.map_err(|e| (n + 1, e))?;
            if let Some(previous) = requests.last().map(|r: &TraceRequest| r.timestamp_ms)
                && request.timestamp_ms < previous
            {
                return Err((
                    n + 1,
                    format!("timestamp {} before {previous}", request.timestamp_ms),
                ));
            }
            trace_chunk_tokens = tokens;
            requests.push(request);
        }
        Ok(Trace { name: name.to_string(), chunk_tokens: trace_chunk_tokens, requests })
    }

    /// Keeps only the first `n` requests.
    pub fn truncate(&mut self, n: usize) {
        self.requests.truncate(n);
    }

    /// Chunks over all requests.
    pub fn chunks(&self) -> u64 {
        self.requests.iter().map(|r| r.chunks.len() as u64).sum()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Mooncake {
    timestamp: f64,
    input_length: u64,
    #[allow(dead_code, reason = "a field of the format, unused by a prefix cache")]
    output_length: u64,
    hash_ids: Vec<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Generic {
    #[serde(default)]
    timestamp_ms: Option<f64>,
    chunks: Vec<Value>,
    #[serde(default)]
    tokens: Option<u64>,
}

/// One line of either format, and the chunk size it implies.
fn parse_line(line: &str, chunk_tokens: u64) -> Result<(TraceRequest, u64), String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let request = if value.get("hash_ids").is_some() {
        let m: Mooncake =
            serde_json::from_value(value).map_err(|e| format!("Mooncake line: {e}"))?;
        let blocks = m.input_length.div_ceil(MOONCAKE_CHUNK_TOKENS);
        if m.hash_ids.len() as u64 != blocks {
            return Err(format!(
                "{} hash_ids for {} input tokens (512-token blocks need {blocks})",
                m.hash_ids.len(),
                m.input_length
            ));
        }
        let request =
            TraceRequest { timestamp_ms: m.timestamp, chunks: m.hash_ids, tokens: m.input_length };
        (request, MOONCAKE_CHUNK_TOKENS)
    } else if value.get("chunks").is_some() {
        let g: Generic = serde_json::from_value(value).map_err(|e| format!("generic line: {e}"))?;
        let chunks = g.chunks.iter().map(chunk_key).collect::<Result<Vec<_>, _>>()?;
        let full = (chunks.len() as u64).saturating_mul(chunk_tokens);
        let tokens = g.tokens.unwrap_or(full);
        if tokens > full || tokens.saturating_add(chunk_tokens) <= full {
            return Err(format!(
                "{tokens} tokens do not fill {} chunks of {chunk_tokens} tokens",
                chunks.len()
            ));
        }
        (TraceRequest { timestamp_ms: g.timestamp_ms.unwrap_or(0.0), chunks, tokens }, chunk_tokens)
    } else {
        return Err("neither `hash_ids` (Mooncake) nor `chunks` (generic)".into());
    };
    let (request, tokens) = request;
    let mut seen = std::collections::HashSet::with_capacity(request.chunks.len());
    if let Some(id) = request.chunks.iter().find(|id| !seen.insert(**id)) {
        return Err(format!("chunk id {id} repeats: prefix hashes cannot"));
    }
    if !request.timestamp_ms.is_finite() || request.timestamp_ms < 0.0 {
        return Err(format!("timestamp {} is not a time", request.timestamp_ms));
    }
    Ok((request, tokens))
}

/// The first line of an Azure LLM inference trace.
const AZURE_HEADER: &str = "TIMESTAMP,ContextTokens,GeneratedTokens";

/// The longest prompt an Azure row may name, in tokens (the public traces' longest is 14,050):
/// a row's chunks are made from its length alone, so a wild number would be a wild allocation.
const MAX_AZURE_TOKENS: u64 = 1 << 24;

/// One row of an Azure trace: its prompt in chunks of `chunk_tokens`, each with an id of its
/// own from `next_id` on, timed from the trace's first row (`start`, in milliseconds since the
/// epoch, set by that row).
fn parse_azure_row(
    row: &str,
    chunk_tokens: u64,
    start: &mut Option<f64>,
    next_id: &mut u64,
) -> Result<TraceRequest, String> {
    let fields: Vec<&str> = row.trim().split(',').collect();
    let [timestamp, context, _generated] = fields[..] else {
        return Err(format!("an Azure row has 3 fields, this one {}", fields.len()));
    };
    let at = azure_time_ms(timestamp)
        .ok_or_else(|| format!("timestamp {timestamp:?} is not YYYY-MM-DD HH:MM:SS.fraction"))?;
    let tokens: u64 = context.parse().ok().filter(|&t| t <= MAX_AZURE_TOKENS).ok_or_else(|| {
        format!("ContextTokens {context:?} is not a count of 0..={MAX_AZURE_TOKENS}")
    })?;
    let start = *start.get_or_insert(at);
    let chunks = tokens.div_ceil(chunk_tokens);
    let first = *next_id;
    *next_id = first.checked_add(chunks).ok_or("more chunks than ids")?;
    Ok(TraceRequest { timestamp_ms: at - start, chunks: (first..*next_id).collect(), tokens })
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC, years 1..=9999) in milliseconds since 1970-01-01.
fn azure_time_ms(text: &str) -> Option<f64> {
    let (date, time) = text.trim().split_once(' ')?;
    let mut date = date.splitn(3, '-').map(|part| part.parse::<i64>().ok());
    let (year, month, day) = (date.next()??, date.next()??, date.next()??);
    let mut time = time.splitn(3, ':');
    let hour: i64 = time.next()?.parse().ok()?;
    let minute: i64 = time.next()?.parse().ok()?;
    let second: f64 = time.next()?.parse().ok()?;
    let valid = (1..=9999).contains(&year)
        && (1..=12).contains(&month)
        && (1..=31).contains(&day)
        && (0..24).contains(&hour)
        && (0..60).contains(&minute)
        && (0.0..61.0).contains(&second);
    if !valid {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm), March-based years.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    let seconds = (days * 86_400 + hour * 3_600 + minute * 60) as f64 + second;
    Some(seconds * 1e3)
}

/// A generic chunk id: an unsigned integer as it is, a string by its hash.
fn chunk_key(id: &Value) -> Result<u64, String> {
    match id {
        Value::Number(n) => {
            n.as_u64().ok_or_else(|| format!("chunk id {n} is not an unsigned integer"))
        }
        Value::String(s) => Ok(xxhash_rust::xxh3::xxh3_64(s.as_bytes())),
        other => Err(format!("chunk id {other} is neither an integer nor a string")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_lines_are_read_with_512_token_chunks() {
        let text = "{\"timestamp\": 0, \"input_length\": 1025, \"output_length\": 5, \"hash_ids\": [0, 1, 2]}\n\
                    \n{\"timestamp\": 7, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [0]}\n";
        let trace = Trace::parse("t", text, 16).unwrap();
        assert_eq!(trace.chunk_tokens, 512);
        assert_eq!(trace.requests.len(), 2);
        assert_eq!(trace.requests[0].chunks, [0, 1, 2]);
        assert_eq!((trace.requests[1].timestamp_ms, trace.requests[1].tokens), (7.0, 512));
    }

    #[test]
    fn generic_lines_take_integers_and_strings() {
        let text = "{\"chunks\": [1, \"a\"], \"tokens\": 30}\n{\"timestamp_ms\": 2.5, \"chunks\": [\"a\"]}\n";
        let trace = Trace::parse("g", text, 16).unwrap();
        assert_eq!(trace.requests[0].chunks[0], 1);
        assert_eq!(
            trace.requests[0].chunks[1], trace.requests[1].chunks[0],
            "same string, same id"
        );
        assert_eq!(trace.requests[1].tokens, 16, "tokens default to full chunks");
    }

    #[test]
    fn azure_rows_are_timed_from_the_first_and_share_no_chunk() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 18:17:03.9799600,1000,10\n\
                    2023-11-16 18:17:04.0319600,512,8\n\
                    2023-11-17 00:00:00,0,1\n";
        let trace = Trace::parse("azure", text, 512).unwrap();
        assert_eq!(trace.chunk_tokens, 512);
        let r = &trace.requests;
        assert_eq!(
            (r[0].timestamp_ms, r[0].chunks.as_slice(), r[0].tokens),
            (0.0, &[0, 1][..], 1000)
        );
        assert!((r[1].timestamp_ms - 52.0).abs() < 1e-6, "{}", r[1].timestamp_ms);
        assert_eq!((r[1].chunks.as_slice(), r[1].tokens), (&[2][..], 512));
        // Across midnight: 5 h 42 min 56.02 s after the first row.
        assert!((r[2].timestamp_ms - 20_576_020.04).abs() < 1e-3, "{}", r[2].timestamp_ms);
        assert!(r[2].chunks.is_empty());
    }

    #[test]
    fn civil_dates_count_leap_days() {
        assert_eq!(azure_time_ms("1970-01-01 00:00:00"), Some(0.0));
        assert_eq!(azure_time_ms("2000-03-01 00:00:00"), Some(951_868_800_000.0));
        assert_eq!(azure_time_ms("2023-11-16 18:17:03.5"), Some(1_700_158_623_500.0));
        assert_eq!(azure_time_ms("2023-13-16 18:17:03"), None);
        assert_eq!(azure_time_ms("2023-11-16T18:17:03"), None);
    }

    #[test]
    fn bad_lines_are_named() {
        for (text, line, needle) in [
            ("{\"hash_ids\": [1]}", 1, "Mooncake line"),
            (
                "{\"timestamp\": 0, \"input_length\": 2000, \"output_length\": 1, \"hash_ids\": [1]}",
                1,
                "hash_ids for",
            ),
            ("{\"chunks\": [1]}\n{\"chunks\": [-1]}", 2, "unsigned"),
            ("{\"chunks\": [1], \"tokens\": 40}", 1, "do not fill"),
            ("{\"chunks\": [1], \"colour\": 1}", 1, "unknown field"),
            ("[1, 2]", 1, "neither"),
            (
                "{\"timestamp_ms\": 5, \"chunks\": [1]}\n{\"timestamp_ms\": 4, \"chunks\": [1]}",
                2,
                "before",
            ),
            ("not json", 1, "not JSON"),
            ("{\"chunks\": [1, 2, 1]}", 1, "repeats"),
            (
                "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,12,1\n\
                 2023-11-16 18:17:02,12,1",
                3,
                "before",
            ),
            (
                "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,-1,1",
                2,
                "ContextTokens",
            ),
            ("TIMESTAMP,ContextTokens,GeneratedTokens\n18:17:03,12,1", 2, "not YYYY"),
            ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,12", 2, "3 fields"),
            // A length past any prompt, and a year past any clock: refused, not computed.
            (
                "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,99999999999,1",
                2,
                "ContextTokens",
            ),
            (
                "TIMESTAMP,ContextTokens,GeneratedTokens\n99999999999999999-11-16 18:17:03,1,1",
                2,
                "not YYYY",
            ),
        ] {
            let (at, message) = Trace::parse("bad", text, 16).unwrap_err();
            assert_eq!(at, line, "{text}: {message}");
            assert!(message.contains(needle), "{text}: {message}");
        }
    }
}
