//! One metered response: the shapes of Anthropic (Messages API), OpenAI (Chat Completions, the
//! Responses API, embeddings) and OpenRouter (OpenAI's shape plus the billed `usage.cost`), as
//! JSON bodies or SSE streams. The provider is told by what the response says, so any host named
//! in `meter` is read.

use serde_json::Value;

use super::json_scan::KeyScanner;
use super::sse::Splitter;

/// What a response cost.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct UsageRecord {
    /// The provider's response id (`msg_…`, `chatcmpl-…`, `gen-…`).
    pub response_id: Option<String>,
    /// The model that answered.
    pub model: Option<String>,
    /// Input tokens (Anthropic `input_tokens`, OpenAI `prompt_tokens`).
    pub input_tokens: u64,
    /// Output tokens (the last cumulative count of a stream).
    pub output_tokens: u64,
    /// Input tokens read from the prompt cache.
    pub cache_read_tokens: u64,
    /// Input tokens written to the prompt cache.
    pub cache_write_tokens: u64,
    /// The billed cost, when the provider reports one (OpenRouter's `usage.cost`).
    pub cost: Option<f64>,
    /// `anthropic`, `openai` or `openrouter`.
    pub provider: &'static str,
}

/// Reads one response body as it passes.
#[derive(Debug)]
pub enum Meter {
    /// `application/json`.
    Json(KeyScanner),
    /// `text/event-stream`: the record so far, and whether any event carried usage.
    Sse(Box<Splitter>, Option<UsageRecord>, bool),
}

const KEYS: &[&str] = &["id", "model", "usage", "type", "object"];

/// What [`sse_event`] reads, kept from events too long to hold whole (a Responses API event
/// repeats the response's instructions and output).
const SSE_PATHS: &[&[&str]] = &[
    &["type"],
    &["object"],
    &["id"],
    &["model"],
    &["usage"],
    &["message", "id"],
    &["message", "model"],
    &["message", "usage"],
    &["response", "id"],
    &["response", "model"],
    &["response", "usage"],
];

impl Meter {
    /// A meter for a body of this content type; `None` for bodies that carry no usage.
    pub fn for_content_type(content_type: &str) -> Option<Meter> {
        let ct = content_type.split(';').next()?.trim().to_ascii_lowercase();
        match ct.as_str() {
            "application/json" => Some(Meter::Json(KeyScanner::new(KEYS))),
            "text/event-stream" => Some(Meter::Sse(
                Box::new(Splitter::with_paths(
                    SSE_PATHS.iter().map(|p| p.to_vec()).collect(),
                )),
                None,
                false,
            )),
            _ => None,
        }
    }

    /// The next bytes of the (decoded) body.
    pub fn feed(&mut self, bytes: &[u8]) {
        match self {
            Meter::Json(s) => s.feed(bytes),
            Meter::Sse(split, rec, seen) => {
                for event in split.feed(bytes) {
                    if let Ok(v) = serde_json::from_str::<Value>(&event.data) {
                        *seen |= sse_event(rec, &v);
                    }
                }
            }
        }
    }

    /// The usage the body reported, once it has ended (or was cut: what came so far counts);
    /// `None` when it reported none.
    pub fn finish(self) -> Option<UsageRecord> {
        match self {
            Meter::Json(mut s) => {
                let mut doc = serde_json::Map::new();
                for (k, raw) in s.take() {
                    if let Ok(v) = serde_json::from_slice::<Value>(&raw) {
                        doc.insert(k, v);
                    }
                }
                let v = Value::Object(doc);
                let usage = v.get("usage").filter(|u| u.is_object())?;
                let mut r = UsageRecord {
                    response_id: str_of(&v, "id"),
                    model: str_of(&v, "model"),
                    ..Default::default()
                };
                apply_usage(&mut r, usage);
                r.provider = provider(
                    &r,
                    usage,
                    v.get("type").and_then(Value::as_str) == Some("message"),
                    v.get("object").and_then(Value::as_str) == Some("response"),
                );
                Some(r)
            }
            Meter::Sse(_, rec, seen) => rec.filter(|_| seen),
        }
    }
}

fn str_of(v: &Value, k: &str) -> Option<String> {
    v.get(k)
        .and_then(Value::as_str)
        .map(|s| s.chars().take(256).collect())
}

fn num(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

/// Reads a `usage` object of either shape into `r`.
fn apply_usage(r: &mut UsageRecord, u: &Value) {
    if let Some(n) = num(u, "input_tokens").or_else(|| num(u, "prompt_tokens")) {
        r.input_tokens = n;
    }
    if let Some(n) = num(u, "output_tokens").or_else(|| num(u, "completion_tokens")) {
        r.output_tokens = n;
    }
    if let Some(n) = num(u, "cache_read_input_tokens").or_else(|| {
        u.get("prompt_tokens_details")
            .or_else(|| u.get("input_tokens_details"))
            .and_then(|d| num(d, "cached_tokens"))
    }) {
        r.cache_read_tokens = n;
    }
    if let Some(n) = num(u, "cache_creation_input_tokens") {
        r.cache_write_tokens = n;
    }
    if let Some(c) = u
        .get("cost")
        .and_then(Value::as_f64)
        .filter(|c| c.is_finite() && *c >= 0.0)
    {
        r.cost = Some(c);
    }
}

fn provider(r: &UsageRecord, usage: &Value, anthropic: bool, response: bool) -> &'static str {
    if !response && (anthropic || usage.get("input_tokens").is_some()) {
        "anthropic"
    } else if r.cost.is_some() {
        "openrouter"
    } else {
        "openai"
    }
}

/// One SSE event of either provider; whether it carried usage.
fn sse_event(rec: &mut Option<UsageRecord>, v: &Value) -> bool {
    let usage = |v: &Value| v.get("usage").filter(|u| u.is_object()).cloned();
    match v.get("type").and_then(Value::as_str) {
        // Anthropic: the message's id, model and input usage first; then cumulative deltas.
        Some("message_start") => {
            let m = v.get("message").unwrap_or(&Value::Null);
            let mut r = UsageRecord {
                response_id: str_of(m, "id"),
                model: str_of(m, "model"),
                provider: "anthropic",
                ..Default::default()
            };
            let u = usage(m);
            if let Some(u) = &u {
                apply_usage(&mut r, u);
            }
            *rec = Some(r);
            u.is_some()
        }
        Some("message_delta") => match (rec.as_mut(), usage(v)) {
            (Some(r), Some(u)) => {
                apply_usage(r, &u);
                true
            }
            _ => false,
        },
        // OpenAI's Responses API: the response object on its first and its last event.
        Some(
            t @ ("response.created"
            | "response.in_progress"
            | "response.completed"
            | "response.incomplete"
            | "response.failed"),
        ) => {
            let resp = v.get("response").unwrap_or(&Value::Null);
            let r = rec.get_or_insert_with(|| UsageRecord {
                response_id: str_of(resp, "id"),
                model: str_of(resp, "model"),
                provider: "openai",
                ..Default::default()
            });
            match usage(resp) {
                Some(u) if !matches!(t, "response.created" | "response.in_progress") => {
                    apply_usage(r, &u);
                    true
                }
                _ => false,
            }
        }
        _ => {
            // OpenAI / OpenRouter chunks (and legacy completions'): id and model on every
            // chunk, usage on the last.
            if matches!(
                v.get("object").and_then(Value::as_str),
                Some("chat.completion.chunk" | "text_completion")
            ) {
                let r = rec.get_or_insert_with(|| UsageRecord {
                    response_id: str_of(v, "id"),
                    model: str_of(v, "model"),
                    provider: "openai",
                    ..Default::default()
                });
                if let Some(u) = usage(v) {
                    apply_usage(r, &u);
                    r.provider = provider(r, &u, false, false);
                    return true;
                }
            }
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(ct: &str, body: &[u8], chunk: usize) -> Option<UsageRecord> {
        let mut m = Meter::for_content_type(ct)?;
        for c in body.chunks(chunk) {
            m.feed(c);
        }
        m.finish()
    }

    #[test]
    fn anthropic_json_and_stream() {
        let json = br#"{"id":"msg_01","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":12,"cache_creation_input_tokens":3,"cache_read_input_tokens":4,"output_tokens":7}}"#;
        let want = UsageRecord {
            response_id: Some("msg_01".into()),
            model: Some("claude-sonnet-4-5".into()),
            input_tokens: 12,
            output_tokens: 7,
            cache_read_tokens: 4,
            cache_write_tokens: 3,
            cost: None,
            provider: "anthropic",
        };
        for chunk in [json.len(), 1] {
            assert_eq!(
                run("application/json; charset=utf-8", json, chunk).as_ref(),
                Some(&want)
            );
        }
        let sse = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01\",\"model\":\"claude-sonnet-4-5\",\"usage\":{\"input_tokens\":12,\"cache_creation_input_tokens\":3,\"cache_read_input_tokens\":4,\"output_tokens\":1}}}\n\n\
event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hi\"}}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":5}}\n\n\
event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":7}}\n\n\
event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        for chunk in [sse.len(), 7, 1] {
            assert_eq!(run("text/event-stream", sse, chunk).as_ref(), Some(&want));
        }
    }

    #[test]
    fn openai_and_openrouter_shapes() {
        let json = br#"{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-5","choices":[],"usage":{"prompt_tokens":20,"completion_tokens":8,"total_tokens":28,"prompt_tokens_details":{"cached_tokens":6}}}"#;
        let r = run("application/json", json, 3).unwrap();
        assert_eq!(
            (
                r.provider,
                r.input_tokens,
                r.output_tokens,
                r.cache_read_tokens,
                r.cost
            ),
            ("openai", 20, 8, 6, None)
        );
        assert_eq!(r.response_id.as_deref(), Some("chatcmpl-1"));
        let sse = b"data: {\"id\":\"gen-9\",\"object\":\"chat.completion.chunk\",\"model\":\"anthropic/claude\",\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n\
data: {\"id\":\"gen-9\",\"object\":\"chat.completion.chunk\",\"model\":\"anthropic/claude\",\"choices\":[],\"usage\":{\"prompt_tokens\":30,\"completion_tokens\":4,\"cost\":0.00123}}\n\n\
data: [DONE]\n\n";
        let r = run("text/event-stream", sse, 2).unwrap();
        assert_eq!(
            (r.provider, r.input_tokens, r.output_tokens, r.cost),
            ("openrouter", 30, 4, Some(0.00123))
        );
        assert_eq!(r.response_id.as_deref(), Some("gen-9"));
    }

    #[test]
    fn responses_api_and_streams_without_usage() {
        let json = br#"{"id":"resp_1","object":"response","model":"gpt-5","output":[],"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":8},"output_tokens":9,"total_tokens":49}}"#;
        let r = run("application/json", json, 5).unwrap();
        assert_eq!(
            (
                r.provider,
                r.input_tokens,
                r.output_tokens,
                r.cache_read_tokens
            ),
            ("openai", 40, 9, 8)
        );
        let sse = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_2\",\"model\":\"gpt-5\",\"usage\":null}}\n\n\
event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"usage\"}\n\n\
event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_2\",\"model\":\"gpt-5\",\"usage\":{\"input_tokens\":11,\"output_tokens\":3}}}\n\n";
        let r = run("text/event-stream", sse, 3).unwrap();
        assert_eq!(
            (
                r.provider,
                r.response_id.as_deref(),
                r.input_tokens,
                r.output_tokens
            ),
            ("openai", Some("resp_2"), 11, 3)
        );
        // A last event too long to hold (the response repeats its instructions and output)
        // still gives its usage.
        let mut long = b"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_3\",\"instructions\":\"".to_vec();
        long.resize(long.len() + 1_000_000, b'i');
        long.extend(b"\",\"usage\":{\"input_tokens\":250000,\"output_tokens\":9}}}\n\n");
        let r = run("text/event-stream", &long, 8192).unwrap();
        assert_eq!(
            (r.response_id.as_deref(), r.input_tokens, r.output_tokens),
            (Some("resp_3"), 250000, 9)
        );
        // Cut before its last event, a Responses stream reported nothing.
        assert_eq!(run("text/event-stream", &sse[..sse.len() - 120], 3), None);
        // An OpenAI stream that never sent its usage chunk reported nothing either.
        let bare = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":null}\n\ndata: [DONE]\n\n";
        assert_eq!(run("text/event-stream", bare, 4), None);
        assert_eq!(
            run("application/json", br#"{"id":"x","usage":null}"#, 4),
            None
        );
    }

    #[test]
    fn other_bodies_and_hostile_values() {
        assert!(Meter::for_content_type("text/html").is_none());
        assert_eq!(
            run("application/json", br#"{"error":{"type":"overloaded"}}"#, 4),
            None
        );
        let r = run(
            "application/json",
            br#"{"id":"x","usage":{"prompt_tokens":-5,"completion_tokens":1e99,"cost":-1}}"#,
            4,
        )
        .unwrap();
        assert_eq!((r.input_tokens, r.output_tokens, r.cost), (0, 0, None));
        // A stream cut before its end still reports what came.
        let cut = b"data: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":3}}}\n\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":2}}\n\ndata: {\"type\":\"message_de";
        let r = run("text/event-stream", cut, 5).unwrap();
        assert_eq!((r.input_tokens, r.output_tokens), (3, 2));
    }
}
