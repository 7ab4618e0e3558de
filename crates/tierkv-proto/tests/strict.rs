//! Issue 16, protocol mismatches: a request is exactly one value with only the fields it has.

#![allow(clippy::unwrap_used, reason = "tests")]

use tierkv_proto::{Request, RequestBody, RequestHeader, decode, encode};

fn body(value: &impl serde::Serialize) -> Vec<u8> {
    let mut out = Vec::new();
    encode(value, &mut out).unwrap();
    out.split_off(4)
}

#[derive(serde::Serialize)]
struct Loose<'a> {
    id: u64,
    body: LooseBody<'a>,
}

#[derive(serde::Serialize)]
#[serde(rename_all = "snake_case")]
enum LooseBody<'a> {
    Query { lookup: u64, typo_field: &'a str },
}

#[test]
fn h16_protocol_an_unknown_field_is_refused_not_ignored() {
    let frame = body(&Loose { id: 4, body: LooseBody::Query { lookup: 1, typo_field: "x" } });
    let refused = decode::<Request>(&frame);
    assert!(format!("{refused:?}").contains("typo_field"), "{refused:?}");
    // The id still comes through, so the daemon answers bad_request for request 4.
    assert_eq!(decode::<RequestHeader>(&frame).unwrap().id, 4);
}

#[test]
fn h16_protocol_trailing_bytes_after_the_message_are_refused() {
    let mut frame = body(&Request { id: 1, body: RequestBody::Status });
    assert!(decode::<Request>(&frame).is_ok());
    frame.push(0xc0);
    assert!(decode::<Request>(&frame).is_err());
    assert!(decode::<RequestHeader>(&frame).is_err(), "a frame with garbage is a bad frame");
}
