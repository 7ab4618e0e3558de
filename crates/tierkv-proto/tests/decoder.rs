//! The decoder against random input: it returns an error or a message, never panics, and never
//! reads past the frame it is given.

#![allow(clippy::unwrap_used, reason = "tests")]

use proptest::prelude::*;
use tierkv_proto::{
    ChunkBlocks, ChunkId, FrameError, Request, RequestBody, RequestHeader, decode, encode,
    read_frame,
};

fn request() -> impl Strategy<Value = Request> {
    let chunks = proptest::collection::vec(any::<u128>().prop_map(ChunkId), 0..20);
    let blocks = proptest::collection::vec(
        (any::<u128>(), any::<u64>()).prop_map(|(c, b)| ChunkBlocks::one(ChunkId(c), b)),
        0..20,
    );
    let body = prop_oneof![
        (any::<u32>(), chunks, any::<bool>()).prop_map(|(namespace, chunks, defer_prefetch)| {
            RequestBody::Lookup { namespace, chunks, defer_prefetch }
        }),
        (any::<u32>(), any::<u32>(), blocks.clone()).prop_map(|(namespace, buffer, chunks)| {
            RequestBody::Store { namespace, buffer, chunks, ready_event: None }
        }),
        (any::<u64>(), any::<u32>(), blocks).prop_map(|(lookup, buffer, chunks)| {
            RequestBody::Retrieve { lookup, buffer, chunks, done_event: None }
        }),
        (any::<u64>(), any::<u64>())
            .prop_map(|(lookup, timeout_ms)| RequestBody::Wait { lookup, timeout_ms }),
        Just(RequestBody::Status),
    ];
    (any::<u64>(), body).prop_map(|(id, body)| Request { id, body })
}

proptest! {
    #[test]
    fn random_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode::<Request>(&bytes);
        let _ = decode::<RequestHeader>(&bytes);
        let mut reader = &bytes[..];
        let _ = read_frame(&mut reader, 1 << 16);
    }

    #[test]
    fn requests_round_trip_and_every_cut_of_a_frame_is_refused(request in request(), cut in any::<usize>()) {
        let mut frame = Vec::new();
        encode(&request, &mut frame).unwrap();
        prop_assert_eq!(decode::<Request>(&frame[4..]).unwrap(), request);
        let cut = cut % frame.len();
        let mut reader = &frame[..cut];
        match read_frame(&mut reader, 1 << 20) {
            Ok(None) => prop_assert_eq!(cut, 0),
            Err(FrameError::Truncated) => {}
            other => prop_assert!(false, "a frame cut at {} read as {:?}", cut, other),
        }
        // A body cut short never decodes into a request.
        if cut > 4 {
            prop_assert!(decode::<Request>(&frame[4..cut]).is_err());
        }
    }

    #[test]
    fn flipped_bytes_decode_to_an_error_or_some_request(request in request(), at in any::<usize>(), bit in 0u8..8) {
        let mut frame = Vec::new();
        encode(&request, &mut frame).unwrap();
        let body = &mut frame[4..];
        let at = at % body.len();
        body[at] ^= 1 << bit;
        let _ = decode::<Request>(body);
    }
}
