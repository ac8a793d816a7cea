//! The frame decoder both ends of the agent channel run on what the other end sends (the host's
//! on a hostile agent's bytes). Invariants: the frames do not depend on how the bytes were split
//! (how garbage between them is counted may); every frame decoded re-encodes to bytes that were in the input; each call does
//! bounded work (every error skips at least one byte) and nothing is held beyond the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_protocol::{Decoder, Frame};

fn decode(chunks: &[&[u8]]) -> Vec<Result<Frame, String>> {
    let mut d = Decoder::new();
    let mut out = vec![];
    let mut given = 0usize;
    for c in chunks {
        d.push(c);
        given += c.len();
        // Each result consumes input: at most one result per byte given.
        for _ in 0..=given {
            match d.next_frame() {
                None => break,
                Some(r) => out.push(r.map_err(|e| e.to_string())),
            }
        }
        assert!(d.pending() <= given);
        assert!(
            d.next_frame().is_none(),
            "the decoder kept producing results without input"
        );
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let (chunks, payload) = sandbox_fuzz::split(data);
    let whole = decode(&[payload]);
    let split = decode(&chunks);
    let frames = |v: &[Result<Frame, String>]| v.iter().flatten().cloned().collect::<Vec<_>>();
    assert_eq!(frames(&whole), frames(&split));
    for f in whole.iter().flatten() {
        let bytes = f.encode();
        assert!(
            payload.windows(bytes.len()).any(|w| w == bytes.as_slice()),
            "a frame that was not in the input"
        );
    }
});
