//! A DNS query from the guest (UDP to the gateway's port 53): parsed, answered, or refused.
//! Invariants: a parsed name is lower-case ASCII, dotless at the end and at most 253 bytes;
//! an answer echoes the id and the question and parses back to the same query; no answer
//! (even a FORMERR) is ever sent for a message that is itself a response.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_egress::dns::wire::{Answer, format_error, parse_query, response};
use std::net::Ipv4Addr;

fuzz_target!(|data: &[u8]| {
    let is_response = data.len() >= 4 && data[2] & 0x80 != 0;
    match parse_query(data) {
        Ok(q) => {
            assert!(!is_response, "a response parsed as a query");
            assert!(q.name.len() <= 253, "{}", q.name.len());
            assert!(!q.name.ends_with('.'));
            assert!(
                q.name
                    .bytes()
                    .all(|b| b.is_ascii() && !b.is_ascii_uppercase()),
                "{:?}",
                q.name
            );
            for a in [
                Answer::A(Ipv4Addr::new(10, 0, 2, 100)),
                Answer::NoData,
                Answer::NxDomain,
                Answer::ServFail,
            ] {
                let r = response(&q, a);
                assert_eq!(r[..2], q.id.to_be_bytes());
                assert!(
                    r.len() <= 12 + data.len() + 16,
                    "an answer bigger than the query allows"
                );
                // The answer, read as a query again (flip QR back), is the same question.
                let mut back = r.clone();
                back[2] &= 0x7f;
                back[6..8].copy_from_slice(&[0, 0]);
                let again = parse_query(
                    &back[..back.len() - if matches!(a, Answer::A(_)) { 16 } else { 0 }],
                )
                .expect("our own answer parses back");
                assert_eq!(
                    (again.name, again.qtype, again.qclass),
                    (q.name.clone(), q.qtype, q.qclass)
                );
            }
        }
        Err(_) => {
            if let Some(r) = format_error(data) {
                assert!(
                    !is_response,
                    "a FORMERR sent for a response: a reflection loop"
                );
                assert_eq!(r.len(), 12);
                assert_eq!(r[..2], data[..2]);
            }
        }
    }
});
