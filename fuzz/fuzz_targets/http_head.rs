//! The HTTP/1 request head reader of intercepted plain HTTP connections. Invariants: a head is
//! found no later than its own bytes (head_len within the input, and the same head from exactly
//! those bytes), a Host is always present, an absolute-form target's authority is reported.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_egress::sniff::http::{parse_head, split_authority};

fuzz_target!(|data: &[u8]| {
    let Ok(Some(head)) = parse_head(data) else {
        return;
    };
    assert!(head.head_len <= data.len());
    let again = parse_head(&data[..head.head_len])
        .expect("the head's own bytes parse")
        .expect("the head's own bytes are a whole head");
    assert_eq!(again, head);
    // Every prefix shorter than the head is incomplete or an error, never another head.
    for cut in [head.head_len / 2, head.head_len.saturating_sub(1)] {
        if cut < head.head_len {
            if let Ok(Some(h)) = parse_head(&data[..cut]) {
                panic!(
                    "a head found in {cut} of its {} bytes: {h:?}",
                    head.head_len
                );
            }
        }
    }
    let _ = split_authority(&head.host);
    if let Some(a) = &head.target_authority {
        let _ = split_authority(a);
    }
});
