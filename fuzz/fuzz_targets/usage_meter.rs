//! The usage meter's readers of provider responses (JSON bodies and SSE streams), which a guest
//! can shape through what it asks a provider to echo. Invariants: no panic, and the usage read
//! does not depend on how the body was split.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_egress::meter::Meter;

fn read(ct: &str, chunks: &[&[u8]]) -> Option<sandbox_egress::meter::UsageRecord> {
    let mut m = Meter::for_content_type(ct).expect("a metered content type");
    for c in chunks {
        m.feed(c);
    }
    m.finish()
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let ct = if kind & 1 == 0 {
        "application/json"
    } else {
        "text/event-stream; charset=utf-8"
    };
    let (chunks, payload) = sandbox_fuzz::split(rest);
    let whole = read(ct, &[payload]);
    let split = read(ct, &chunks);
    // NaN costs compare unequal to themselves: compare their bits.
    let key = |r: &Option<sandbox_egress::meter::UsageRecord>| {
        r.as_ref().map(|r| {
            (
                r.response_id.clone(),
                r.model.clone(),
                r.input_tokens,
                r.output_tokens,
                r.cache_read_tokens,
                r.cache_write_tokens,
                r.cost.map(f64::to_bits),
                r.provider,
            )
        })
    };
    assert_eq!(key(&whole), key(&split));
});
