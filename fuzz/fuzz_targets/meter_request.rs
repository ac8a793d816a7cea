//! The meter's look at a request body to a model API (is it a call, does a stream ask for its
//! usage, and the body rewritten to ask for it). Invariants: no panic; only JSON is rewritten,
//! into JSON that asks for usage and keeps every member the guest sent.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_egress::meter::Api;
use sandbox_egress::meter::request::prepare;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let targets = [
        "/v1/messages",
        "/v1/chat/completions",
        "/v1/responses",
        "/api/v1/chat/completions",
        "/v1/completions",
    ];
    let Some(api) = Api::of(targets[usize::from(which) % targets.len()]) else {
        return;
    };
    if let Ok(Some(new)) = prepare(api, body) {
        // JSON's grammar, which allows numbers no f64 holds (serde_json's Value refuses them,
        // a provider's parser may not).
        let grammar = |b: &[u8]| serde_json::from_slice::<serde::de::IgnoredAny>(b).is_ok();
        assert!(grammar(body), "a body that is not JSON was rewritten");
        assert!(grammar(&new), "the rewritten body is not JSON");
        let (Ok(before), Ok(after)) = (
            serde_json::from_slice::<serde_json::Value>(body),
            serde_json::from_slice::<serde_json::Value>(&new),
        ) else {
            return;
        };
        // What the rewrite is for: the stream reports its usage (as a provider reads the body,
        // the last of duplicate members wins).
        assert_eq!(
            after["stream_options"]["include_usage"],
            serde_json::Value::Bool(true),
            "a rewritten body that does not ask for usage"
        );
        if let (Some(b), Some(a)) = (before.as_object(), after.as_object()) {
            for k in b.keys() {
                assert!(a.contains_key(k), "the rewrite lost member {k}");
            }
        }
    }
});
