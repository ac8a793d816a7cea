//! The ClientHello reader of intercepted TLS connections, fed the guest's first bytes as the
//! network splits them. Invariants: the answer (hello, error or not yet) does not depend on
//! the split; what it keeps never exceeds what it was given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_egress::sniff::tls::HelloReader;

fn read(
    chunks: &[&[u8]],
) -> (
    Option<Result<sandbox_egress::sniff::tls::ClientHello, String>>,
    usize,
) {
    let mut r = HelloReader::new();
    let mut given = 0;
    for c in chunks {
        given += c.len();
        match r.feed(c) {
            Ok(None) => {}
            Ok(Some(h)) => return (Some(Ok(h)), given),
            Err(e) => return (Some(Err(e.to_string())), given),
        }
        assert!(r.raw().len() <= given);
    }
    (None, given)
}

fuzz_target!(|data: &[u8]| {
    let (chunks, payload) = sandbox_fuzz::split(data);
    // Past MAX_RAW the whole input is refused at once, while a split one may finish its hello
    // first: a difference of the limit, not of the reader.
    if payload.len() > sandbox_egress::sniff::tls::MAX_RAW {
        return;
    }
    let (whole, _) = read(&[payload]);
    let (split, _) = read(&chunks);
    // Bytes after the hello are the connection's and may differ in where they stop the read;
    // the verdict itself must match.
    match (&whole, &split) {
        (Some(Ok(a)), Some(Ok(b))) => assert_eq!(a, b),
        (Some(Err(_)), Some(Err(_))) | (None, None) => {}
        (a, b) => {
            // A split may only see an error the whole input also meets (a size limit counted
            // per record can differ only if the hello completes first).
            panic!("whole input gave {a:?}, split input gave {b:?}");
        }
    }
});
