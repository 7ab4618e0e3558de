//! Length-prefixed frames of MessagePack.

use std::io::Read;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Bytes of the length prefix.
pub const HEADER_BYTES: usize = 4;

/// No limit below this is accepted: a hello with a few namespaces must always fit.
pub const MIN_FRAME_LIMIT: u32 = 4096;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The length prefix announces more than the receiver accepts.
    #[error("frame of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The announced body length.
        len: u64,
        /// The receiver's limit.
        limit: u32,
    },
    /// A frame with an empty body.
    #[error("empty frame")]
    Empty,
    /// The body is not the MessagePack value expected.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The message could not be encoded.
    #[error("cannot encode message: {0}")]
    Encode(String),
    /// The peer closed the connection in the middle of a frame.
    #[error("connection closed inside a frame")]
    Truncated,
    /// The transport failed.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// Appends `message` to `out` as one frame.
pub fn encode<T: Serialize>(message: &T, out: &mut Vec<u8>) -> Result<(), FrameError> {
    let start = out.len();
    out.extend_from_slice(&[0; HEADER_BYTES]);
    rmp_serde::encode::write_named(out, message).map_err(|e| FrameError::Encode(e.to_string()))?;
    let len = u32::try_from(out.len() - start - HEADER_BYTES)
        .map_err(|_| FrameError::Encode("message longer than 4 GiB".into()))?;
    out[start..start + HEADER_BYTES].copy_from_slice(&len.to_le_bytes());
    Ok(())
}

/// The body length a header announces, checked against `limit`.
pub fn frame_len(header: [u8; HEADER_BYTES], limit: u32) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(header);
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > limit {
        return Err(FrameError::TooLarge { len: u64::from(len), limit });
    }
    Ok(len as usize)
}

/// How deep a frame's values may nest. The messages nest a few levels; the decoder recurses once
/// a level (skipping an unknown body too), so a small frame of deeply nested arrays would
/// otherwise overflow a thread's stack, before any hello.
const MAX_DEPTH: usize = 32;

/// Decodes one frame body: exactly one MessagePack value, with no bytes after it.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    let mut rest: &[u8] = body;
    let mut deserializer = rmp_serde::Deserializer::new(&mut rest);
    deserializer.set_max_depth(MAX_DEPTH);
    let value =
        T::deserialize(&mut deserializer).map_err(|e| FrameError::Malformed(e.to_string()))?;
    drop(deserializer);
    if !rest.is_empty() {
        return Err(FrameError::Malformed(format!(
            "{} bytes after the message; a frame holds exactly one value",
            rest.len()
        )));
    }
    Ok(value)
}

/// Reads one frame from a blocking reader: `Ok(None)` at a clean end of stream (between frames).
pub fn read_frame<R: Read>(reader: &mut R, limit: u32) -> Result<Option<Vec<u8>>, FrameError> {
    let mut header = [0u8; HEADER_BYTES];
    let mut got = 0;
    while got < HEADER_BYTES {
        match reader.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = frame_len(header, limit)?;
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => FrameError::Truncated,
        _ => FrameError::Io(e),
    })?;
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use crate::{Request, RequestBody};

    #[test]
    fn a_frame_round_trips_and_its_header_is_the_body_length() {
        let request = Request { id: 7, body: RequestBody::Query { lookup: 3 } };
        let mut out = Vec::new();
        encode(&request, &mut out).unwrap();
        let len = u32::from_le_bytes(out[..4].try_into().unwrap()) as usize;
        assert_eq!(len, out.len() - HEADER_BYTES);
        let back: Request = decode(&out[HEADER_BYTES..]).unwrap();
        assert_eq!(back, request);
        let mut reader = &out[..];
        assert_eq!(read_frame(&mut reader, 1 << 20).unwrap().unwrap(), &out[HEADER_BYTES..]);
        assert!(read_frame(&mut reader, 1 << 20).unwrap().is_none(), "clean end of stream");
    }

    /// A small frame of deeply nested arrays, where a request's body goes: refused, not decoded
    /// into a stack overflow (before any hello, and skipped as an unknown body too).
    #[test]
    fn a_frame_nested_past_the_depth_limit_is_malformed() {
        let mut body = vec![0x82, 0xa2, b'i', b'd', 0x03, 0xa4, b'b', b'o', b'd', b'y'];
        body.extend(std::iter::repeat_n(0x91, 100_000));
        body.push(0xc0);
        assert!(matches!(decode::<Request>(&body), Err(FrameError::Malformed(_))));
        assert!(matches!(decode::<crate::RequestHeader>(&body), Err(FrameError::Malformed(_))));
    }

    #[test]
    fn lists_past_their_limits_are_malformed_and_lists_at_them_decode() {
        use crate::{Hello, NamespaceDecl};
        let hello = |n: usize| Request {
            id: 1,
            body: RequestBody::Hello(Hello {
                version: crate::PROTOCOL_VERSION,
                role: crate::Role::Worker,
                rank: 0,
                tp_size: 1,
                world_size: None,
                mla: false,
                namespaces: vec![NamespaceDecl { model: "m".into(), cache_salt: String::new() }; n],
                chunk_bytes: 1,
                chunk_tokens: 1,
                token: None,
            }),
        };
        let frame = |request: &Request| {
            let mut out = Vec::new();
            encode(request, &mut out).unwrap();
            out.split_off(HEADER_BYTES)
        };
        let at = hello(crate::MAX_NAMESPACES);
        assert_eq!(decode::<Request>(&frame(&at)).unwrap(), at);
        match decode::<Request>(&frame(&hello(crate::MAX_NAMESPACES + 1))) {
            Err(FrameError::Malformed(why)) => assert!(why.contains("at most 64"), "{why}"),
            other => panic!("65 namespaces decoded: {other:?}"),
        }
    }

    #[test]
    fn oversized_empty_and_cut_frames_are_refused() {
        assert!(matches!(frame_len(100u32.to_le_bytes(), 99), Err(FrameError::TooLarge { .. })));
        assert!(matches!(frame_len([0; 4], 99), Err(FrameError::Empty)));
        let mut cut: &[u8] = &[10, 0, 0, 0, 1, 2];
        assert!(matches!(read_frame(&mut cut, 99), Err(FrameError::Truncated)));
        let mut half_header: &[u8] = &[10, 0];
        assert!(matches!(read_frame(&mut half_header, 99), Err(FrameError::Truncated)));
    }
}
