//! The scanner that finds a secret's placeholder in a request body going to a host the secret
//! is not for. Invariant: a placeholder planted anywhere in the body is found, however the
//! network splits the body; with none planted, nothing is found unless the body already held it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_egress::secrets::{LeakScanner, Secret};
use std::sync::OnceLock;

fn secrets() -> &'static [Secret] {
    static S: OnceLock<Vec<Secret>> = OnceLock::new();
    S.get_or_init(|| {
        vec![
            Secret::new(
                "ANTHROPIC_API_KEY",
                "sk-ant-fuzz-0123456789abcdef",
                &["api.anthropic.com".into()],
                None,
            )
            .unwrap(),
            Secret::new(
                "OPENAI_API_KEY",
                "sk-fuzz-0123456789abcdef0123",
                &["api.openai.com".into()],
                None,
            )
            .unwrap(),
        ]
    })
}

fn found(chunks: &[&[u8]]) -> bool {
    let mut s = LeakScanner::new(secrets(), "elsewhere.example");
    chunks.iter().any(|c| s.feed(c).is_some())
}

fuzz_target!(|data: &[u8]| {
    // Which secret, where (two bytes), and the split plan's seed come first.
    if data.len() < 4 {
        return;
    }
    let (which, at) = (
        usize::from(data[0] % 2),
        usize::from(u16::from_le_bytes([data[1], data[2]])),
    );
    let (_, body) = sandbox_fuzz::split(&data[3..]);
    let needle = secrets()[which].placeholder.as_bytes();
    let at = at.min(body.len());
    let mut planted = body[..at].to_vec();
    planted.extend_from_slice(needle);
    planted.extend_from_slice(&body[at..]);
    // The same split plan over the planted body.
    let mut plan = vec![data[3]];
    plan.extend_from_slice(&planted);
    let (chunks, _) = sandbox_fuzz::split(&plan);
    assert!(
        found(&chunks),
        "a placeholder at {at} of {} bytes was missed",
        planted.len()
    );
    // Without the plant: found exactly when the body holds a placeholder itself.
    let (chunks, body) = sandbox_fuzz::split(&data[3..]);
    let holds = secrets().iter().any(|s| {
        body.windows(s.placeholder.len())
            .any(|w| w == s.placeholder.as_bytes())
    });
    assert_eq!(found(&chunks), holds);
});
