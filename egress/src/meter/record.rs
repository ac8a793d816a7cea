//! One metered response: the shapes of Anthropic (Messages API), OpenAI (Chat Completions, the
//! Responses API, embeddings), OpenRouter (OpenAI's shape plus the billed `usage.cost`) and
//! Google's Gemini API (`usageMetadata`), as JSON bodies or SSE streams. The provider is told by what the response says, so any host named
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
    /// `anthropic`, `openai`, `openrouter` or `google`.
    pub provider: &'static str,
    /// Whether `output_tokens` is the host's own lower bound, not the provider's count: a
    /// stream cut (or ended) before its final usage, counted one token per content delta that
    /// passed (issue 29, item 5).
    pub estimated: bool,
    /// The price dimensions token counts do not show, as the provider reports them (see
    /// [`Details`]).
    pub details: Details,
}

/// What a call may be billed for besides its input, output and cache-read tokens.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Details {
    /// Anthropic's `usage.service_tier`, OpenAI's `service_tier` (`standard`, `priority`,
    /// `batch`, `flex`, `default`, `scale`…): tiers are priced apart.
    pub service_tier: Option<String>,
    /// Server-side tools the provider ran and bills per use: Anthropic's
    /// `usage.server_tool_use` (`web_search_requests`, `web_fetch_requests`, …), each count.
    pub server_tool_use: Vec<(String, u64)>,
    /// Anthropic's cache writes by lifetime (`cache_creation.ephemeral_5m_input_tokens` and
    /// `ephemeral_1h_input_tokens`: the hour costs more).
    pub cache_write_5m_tokens: Option<u64>,
    /// The one-hour cache writes.
    pub cache_write_1h_tokens: Option<u64>,
    /// OpenAI's audio and image token details (`prompt_tokens_details.audio_tokens`,
    /// `completion_tokens_details.audio_tokens`, `input_tokens_details.image_tokens`, …) and
    /// reasoning tokens (billed as output, shown apart).
    pub input_audio_tokens: Option<u64>,
    /// Audio tokens of the output.
    pub output_audio_tokens: Option<u64>,
    /// Image tokens of the input.
    pub input_image_tokens: Option<u64>,
    /// Image tokens of the output.
    pub output_image_tokens: Option<u64>,
    /// Reasoning tokens, already counted in the output.
    pub reasoning_tokens: Option<u64>,
}

/// The most server tools one call's record keeps (a hostile provider's object is not copied
/// whole).
const MAX_SERVER_TOOLS: usize = 16;

/// One SSE stream's reading.
#[derive(Debug)]
pub struct SseMeter {
    split: Splitter,
    /// The record so far.
    rec: Option<UsageRecord>,
    /// Whether an event carried the provider's final usage (Anthropic's `message_delta`,
    /// OpenAI's usage chunk, the Responses API's `response.completed`).
    final_usage: bool,
    /// Content deltas that passed: each is at least one output token.
    deltas: u64,
}

/// Reads one response body as it passes.
#[derive(Debug)]
pub enum Meter {
    /// `application/json`.
    Json(KeyScanner),
    /// `text/event-stream`.
    Sse(Box<SseMeter>),
}

const KEYS: &[&str] = &[
    "id",
    "model",
    "usage",
    "type",
    "object",
    "service_tier",
    "usageMetadata",
    "modelVersion",
    "responseId",
];

/// What [`sse_event`] reads, kept from events too long to hold whole (a Responses API event
/// repeats the response's instructions and output).
const SSE_PATHS: &[&[&str]] = &[
    &["type"],
    &["object"],
    &["id"],
    &["model"],
    &["usage"],
    &["service_tier"],
    &["message", "id"],
    &["message", "model"],
    &["message", "usage"],
    &["response", "id"],
    &["response", "model"],
    &["response", "usage"],
    &["response", "service_tier"],
    &["usageMetadata"],
    &["modelVersion"],
    &["responseId"],
];

impl Meter {
    /// A meter for a body of this content type; `None` for bodies that carry no usage.
    pub fn for_content_type(content_type: &str) -> Option<Meter> {
        let ct = content_type.split(';').next()?.trim().to_ascii_lowercase();
        match ct.as_str() {
            "application/json" => Some(Meter::Json(KeyScanner::new(KEYS))),
            "text/event-stream" => Some(Meter::Sse(Box::new(SseMeter {
                split: Splitter::with_paths(SSE_PATHS.iter().map(|p| p.to_vec()).collect()),
                rec: None,
                final_usage: false,
                deltas: 0,
            }))),
            _ => None,
        }
    }

    /// The next bytes of the (decoded) body.
    pub fn feed(&mut self, bytes: &[u8]) {
        match self {
            Meter::Json(s) => s.feed(bytes),
            Meter::Sse(m) => {
                for event in m.split.feed(bytes) {
                    if let Ok(v) = serde_json::from_str::<Value>(&event.data) {
                        m.final_usage |= sse_event(&mut m.rec, &v);
                        m.deltas += u64::from(is_content_delta(&v));
                    }
                }
            }
        }
    }

    /// The usage the body reported, once it has ended (or was cut: what came so far counts);
    /// `None` when it reported none. A stream whose final usage never came but whose content
    /// did gives the host's lower bound, `estimated`: its output tokens at least one per
    /// content delta (the caller records why the provider's count is missing).
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
                if let Some(meta) = v.get("usageMetadata").filter(|u| u.is_object()) {
                    let mut r = gemini_record(&v);
                    apply_gemini_usage(&mut r, meta);
                    return Some(r);
                }
                let usage = v.get("usage").filter(|u| u.is_object())?;
                let mut r = UsageRecord {
                    response_id: str_of(&v, "id"),
                    model: str_of(&v, "model"),
                    ..Default::default()
                };
                apply_usage(&mut r, usage);
                apply_tier(&mut r, &v);
                r.provider = provider(
                    &r,
                    usage,
                    v.get("type").and_then(Value::as_str) == Some("message"),
                    v.get("object").and_then(Value::as_str) == Some("response"),
                );
                Some(r)
            }
            Meter::Sse(m) => {
                let mut r = m.rec?;
                if m.final_usage {
                    return Some(r);
                }
                if m.deltas == 0 && r.input_tokens == 0 && r.output_tokens == 0 {
                    return None; // nothing seen worth a record
                }
                r.output_tokens = r.output_tokens.max(m.deltas);
                r.estimated = true;
                Some(r)
            }
        }
    }
}

/// Whether an SSE event carries generated content (so at least one output token): Anthropic's
/// `content_block_delta`, a chat chunk's non-empty delta, a Responses API `….delta` event.
fn is_content_delta(v: &Value) -> bool {
    let non_empty = |x: Option<&Value>| match x {
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        _ => false,
    };
    match v.get("type").and_then(Value::as_str) {
        Some("content_block_delta") => v.get("delta").and_then(Value::as_object).is_some_and(|d| {
            ["text", "partial_json", "thinking", "signature", "citation"]
                .iter()
                .any(|k| non_empty(d.get(*k)))
        }),
        Some(t) if t.starts_with("response.") && t.ends_with(".delta") => non_empty(v.get("delta")),
        // Gemini: a chunk's candidates' parts.
        None if v.get("candidates").is_some() => v
            .get("candidates")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter().any(|c| {
                    c.pointer("/content/parts")
                        .and_then(Value::as_array)
                        .is_some_and(|ps| ps.iter().any(|p| non_empty(Some(p))))
                })
            }),
        _ => v
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter().any(|c| {
                    c.get("delta").and_then(Value::as_object).is_some_and(|d| {
                        [
                            "content",
                            "reasoning",
                            "reasoning_content",
                            "tool_calls",
                            "refusal",
                            "audio",
                        ]
                        .iter()
                        .any(|k| non_empty(d.get(*k)))
                    }) || non_empty(c.get("text"))
                })
            }),
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
    let d = &mut r.details;
    if let Some(c) = u.get("cache_creation") {
        d.cache_write_5m_tokens = num(c, "ephemeral_5m_input_tokens").or(d.cache_write_5m_tokens);
        d.cache_write_1h_tokens = num(c, "ephemeral_1h_input_tokens").or(d.cache_write_1h_tokens);
    }
    if let Some(tools) = u.get("server_tool_use").and_then(Value::as_object) {
        d.server_tool_use = tools
            .iter()
            .filter_map(|(k, v)| Some((k.chars().take(64).collect(), v.as_u64()?)))
            .take(MAX_SERVER_TOOLS)
            .collect();
    }
    if let Some(t) = u.get("service_tier").and_then(Value::as_str) {
        d.service_tier = Some(t.chars().take(64).collect());
    }
    let input = u
        .get("prompt_tokens_details")
        .or_else(|| u.get("input_tokens_details"));
    let output = u
        .get("completion_tokens_details")
        .or_else(|| u.get("output_tokens_details"));
    if let Some(i) = input {
        d.input_audio_tokens = num(i, "audio_tokens").or(d.input_audio_tokens);
        d.input_image_tokens = num(i, "image_tokens").or(d.input_image_tokens);
    }
    if let Some(o) = output {
        d.output_audio_tokens = num(o, "audio_tokens").or(d.output_audio_tokens);
        d.output_image_tokens = num(o, "image_tokens").or(d.output_image_tokens);
        d.reasoning_tokens = num(o, "reasoning_tokens").or(d.reasoning_tokens);
    }
    if let Some(c) = u
        .get("cost")
        .and_then(Value::as_f64)
        .filter(|c| c.is_finite() && *c >= 0.0)
    {
        r.cost = Some(c);
    }
}

/// OpenAI's `service_tier`, beside the usage rather than in it.
fn apply_tier(r: &mut UsageRecord, v: &Value) {
    if let Some(t) = v.get("service_tier").and_then(Value::as_str) {
        r.details.service_tier = Some(t.chars().take(64).collect());
    }
}

/// A Gemini response's id and model (`responseId`, `modelVersion`).
fn gemini_record(v: &Value) -> UsageRecord {
    UsageRecord {
        response_id: str_of(v, "responseId"),
        model: str_of(v, "modelVersion"),
        provider: "google",
        ..Default::default()
    }
}

/// Reads Gemini's `usageMetadata` into `r`: the prompt (with the tool-use prompt, billed as
/// input; the cached part of it also as cache reads), and the candidates with the thoughts
/// (billed as output; shown apart as reasoning).
fn apply_gemini_usage(r: &mut UsageRecord, u: &Value) {
    let prompt = num(u, "promptTokenCount");
    let tools = num(u, "toolUsePromptTokenCount");
    if prompt.is_some() || tools.is_some() {
        r.input_tokens = prompt.unwrap_or(0).saturating_add(tools.unwrap_or(0));
    }
    let candidates = num(u, "candidatesTokenCount");
    let thoughts = num(u, "thoughtsTokenCount");
    if candidates.is_some() || thoughts.is_some() {
        r.output_tokens = candidates
            .unwrap_or(0)
            .saturating_add(thoughts.unwrap_or(0));
    }
    if let Some(n) = num(u, "cachedContentTokenCount") {
        r.cache_read_tokens = n;
    }
    r.details.reasoning_tokens = thoughts.or(r.details.reasoning_tokens);
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
            if let Some(u) = &usage(m) {
                apply_usage(&mut r, u);
            }
            *rec = Some(r);
            // Its output count is 1 whatever follows: the final one is message_delta's.
            false
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
            apply_tier(r, resp);
            match usage(resp) {
                Some(u) if !matches!(t, "response.created" | "response.in_progress") => {
                    apply_usage(r, &u);
                    true
                }
                _ => false,
            }
        }
        None if v.get("usageMetadata").is_some_and(Value::is_object) => {
            // Gemini: every chunk a response with the usage so far; the last one, which
            // gives each candidate its finishReason, the whole of it.
            let r = rec.get_or_insert_with(|| gemini_record(v));
            if let Some(u) = v.get("usageMetadata") {
                apply_gemini_usage(r, u);
            }
            v.get("candidates")
                .and_then(Value::as_array)
                .is_some_and(|cs| {
                    !cs.is_empty() && cs.iter().all(|c| c.get("finishReason").is_some())
                })
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
                apply_tier(r, v);
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

    /// Gemini's `generateContent` (JSON) and `streamGenerateContent?alt=sse`: the prompt with
    /// the tool-use prompt as input, the candidates with the thoughts as output (both billed
    /// so), the cached part as cache reads; a stream's last chunk (every candidate finished)
    /// is its final usage, and one cut before it is the host's lower bound.
    #[test]
    fn gemini_json_and_stream() {
        let json = br#"{"candidates":[{"content":{"parts":[{"text":"hi"}],"role":"model"},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":20,"candidatesTokenCount":7,"totalTokenCount":40,"cachedContentTokenCount":8,"thoughtsTokenCount":11,"toolUsePromptTokenCount":2},"modelVersion":"gemini-2.5-pro","responseId":"resp-1"}"#;
        let want = UsageRecord {
            response_id: Some("resp-1".into()),
            model: Some("gemini-2.5-pro".into()),
            input_tokens: 22,
            output_tokens: 18,
            cache_read_tokens: 8,
            provider: "google",
            details: Details {
                reasoning_tokens: Some(11),
                ..Default::default()
            },
            ..Default::default()
        };
        for chunk in [json.len(), 1] {
            assert_eq!(run("application/json", json, chunk).as_ref(), Some(&want));
        }
        let chunk = |text: &str, out: u64, fin: bool| {
            format!(
                "data: {{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":\"{text}\"}}],\"role\":\"model\"}}{}}}],\"usageMetadata\":{{\"promptTokenCount\":20,\"candidatesTokenCount\":{out},\"totalTokenCount\":{}}},\"modelVersion\":\"gemini-2.5-flash\",\"responseId\":\"resp-2\"}}\r\n\r\n",
                if fin {
                    ",\"finishReason\":\"STOP\""
                } else {
                    ""
                },
                20 + out
            )
        };
        let whole = [
            chunk("a", 1, false),
            chunk("b c", 3, false),
            chunk("d", 9, true),
        ]
        .concat();
        for size in [whole.len(), 7, 1] {
            let r = run("text/event-stream", whole.as_bytes(), size).unwrap();
            assert_eq!(
                (r.input_tokens, r.output_tokens, r.estimated, r.provider),
                (20, 9, false, "google"),
                "chunks of {size}"
            );
            assert_eq!(r.model.as_deref(), Some("gemini-2.5-flash"));
        }
        // Cut before the last chunk: what the chunks said so far, at least one token for each
        // that carried text, marked as the host's estimate.
        let cut = [chunk("a", 1, false), chunk("b c", 3, false)].concat();
        let r = run("text/event-stream", cut.as_bytes(), 5).unwrap();
        assert_eq!((r.output_tokens, r.estimated), (3, true));
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
            ..Default::default()
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
        // Cut before its last event, a Responses stream reported only the host's lower bound:
        // one token for its one delta.
        let r = run("text/event-stream", &sse[..sse.len() - 120], 3).unwrap();
        assert_eq!(
            (r.response_id.as_deref(), r.output_tokens, r.estimated),
            (Some("resp_2"), 1, true)
        );
        // An OpenAI stream that never sent its usage chunk reported nothing either.
        let bare = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":null}\n\ndata: [DONE]\n\n";
        assert_eq!(run("text/event-stream", bare, 4), None);
        assert_eq!(
            run("application/json", br#"{"id":"x","usage":null}"#, 4),
            None
        );
    }

    /// Issue 29, item 5: an Anthropic stream cut before `message_delta` is not recorded as
    /// complete and low (`message_start`'s `output_tokens: 1`): its output is at least one
    /// token per delta that passed, marked as an estimate.
    #[test]
    fn a_stream_cut_before_its_usage_gives_a_marked_lower_bound() {
        let start = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_9\",\"model\":\"claude-x\",\"usage\":{\"input_tokens\":2100,\"output_tokens\":1}}}\n\n";
        let delta = b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"word \"}}\n\n";
        let ping = b"event: ping\ndata: {\"type\":\"ping\"}\n\n";
        let mut body = start.to_vec();
        for _ in 0..40 {
            body.extend(delta);
            body.extend(ping);
        }
        for chunk in [body.len(), 9] {
            let r = run("text/event-stream", &body, chunk).unwrap();
            assert_eq!(
                (r.input_tokens, r.output_tokens, r.estimated, r.provider),
                (2100, 40, true, "anthropic")
            );
        }
        // The same stream with its message_delta: the provider's count, not an estimate.
        body.extend(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":57}}\n\n");
        let r = run("text/event-stream", &body, 9).unwrap();
        assert_eq!((r.output_tokens, r.estimated), (57, false));
        // An OpenAI stream cut before its usage chunk: one per content chunk.
        let chunk = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let r = run("text/event-stream", &chunk.repeat(7), 5).unwrap();
        assert_eq!((r.output_tokens, r.estimated), (7, true));
    }

    /// The price dimensions token counts do not show (issue 29, item 5).
    #[test]
    fn server_tools_tiers_cache_lifetimes_and_modalities_are_recorded() {
        let anthropic = br#"{"id":"msg_1","type":"message","model":"claude","usage":{"input_tokens":10,"output_tokens":5,"cache_creation_input_tokens":30,"cache_creation":{"ephemeral_5m_input_tokens":10,"ephemeral_1h_input_tokens":20},"server_tool_use":{"web_search_requests":3,"web_fetch_requests":1,"junk":"x"},"service_tier":"priority"}}"#;
        let r = run("application/json", anthropic, 7).unwrap();
        assert_eq!(
            r.details,
            Details {
                service_tier: Some("priority".into()),
                // In name order, whatever the provider's order.
                server_tool_use: vec![
                    ("web_fetch_requests".into(), 1),
                    ("web_search_requests".into(), 3)
                ],
                cache_write_5m_tokens: Some(10),
                cache_write_1h_tokens: Some(20),
                ..Default::default()
            }
        );
        assert_eq!(r.cache_write_tokens, 30);
        let openai = br#"{"id":"chatcmpl-2","object":"chat.completion","model":"gpt-audio","service_tier":"flex","usage":{"prompt_tokens":100,"completion_tokens":50,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":40},"completion_tokens_details":{"reasoning_tokens":12,"audio_tokens":30}}}"#;
        let r = run("application/json", openai, 4).unwrap();
        assert_eq!(
            r.details,
            Details {
                service_tier: Some("flex".into()),
                input_audio_tokens: Some(40),
                output_audio_tokens: Some(30),
                reasoning_tokens: Some(12),
                ..Default::default()
            }
        );
        let image = br#"{"id":"img","object":"response","model":"gpt-image","usage":{"input_tokens":70,"output_tokens":4000,"input_tokens_details":{"image_tokens":64,"text_tokens":6},"output_tokens_details":{"image_tokens":4000}}}"#;
        let r = run("application/json", image, 4).unwrap();
        assert_eq!(
            (r.details.input_image_tokens, r.details.output_image_tokens),
            (Some(64), Some(4000))
        );
        // A stream's tier comes on its chunks.
        let sse = b"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"service_tier\":\"priority\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n";
        let r = run("text/event-stream", sse, 3).unwrap();
        assert_eq!(r.details.service_tier.as_deref(), Some("priority"));
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
