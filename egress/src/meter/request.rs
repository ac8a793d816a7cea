//! What the meter needs of a request before it goes upstream: which provider API it calls, and,
//! for an OpenAI-style streaming chat completion, `stream_options.include_usage` set, so that the
//! provider's last chunk reports the tokens. Without it a guest could stream completions that
//! report no usage at all and spend without a trace (issue 18).
//!
//! A body is changed only when usage has to be asked for, and then by splicing: every other byte
//! stays where the guest put it. Only the members the meter needs are kept while a body is read
//! (as borrowed text); every other member is skipped. A body the meter cannot read for certain (not one JSON object, a
//! key given twice, a `stream_options` that is not an object) is not guessed at: the call is
//! unmeterable, which is counted, and refused under `meter_strict`.

use serde::Deserialize;
use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

/// Why a call's usage could not be read. Each is counted per sandbox and in `/metrics`; the
/// request-side ones are refused before they go upstream under `meter_strict`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Unmetered {
    /// A POST to a path the meter does not know (`/v1/messages/batches`, an unknown API), or a
    /// known one whose usage is reported elsewhere (a background Responses call).
    UnknownRequest,
    /// A body the meter cannot read for certain: not one JSON object, a key given twice, a
    /// compressed body, `stream` or `stream_options` of the wrong type.
    UnreadableBody,
    /// A body too large to hold while usage is asked for (`SANDBOX_HOST_METER_BODY_MAX_MIB`, or
    /// the sandbox's share of it in use by its other requests).
    BodyTooLarge,
    /// A response compressed although `Accept-Encoding: identity` was asked for.
    EncodedResponse,
    /// A successful response of a type the meter does not read (not JSON, not SSE).
    UnknownResponse,
    /// A response cut before it reported any usage.
    CutBeforeUsage,
    /// A complete successful response that reported no usage.
    NoUsage,
    /// No answer: the guest went away, or the connection to the provider failed, after the
    /// request went upstream.
    Abandoned,
}

impl Unmetered {
    /// Every reason, for counters that list zeros too.
    pub const ALL: [Unmetered; 8] = [
        Unmetered::UnknownRequest,
        Unmetered::UnreadableBody,
        Unmetered::BodyTooLarge,
        Unmetered::EncodedResponse,
        Unmetered::UnknownResponse,
        Unmetered::CutBeforeUsage,
        Unmetered::NoUsage,
        Unmetered::Abandoned,
    ];

    /// The reason's name in the usage log, metrics and refusals.
    pub fn as_str(self) -> &'static str {
        match self {
            Unmetered::UnknownRequest => "unknown_request",
            Unmetered::UnreadableBody => "unreadable_body",
            Unmetered::BodyTooLarge => "body_too_large",
            Unmetered::EncodedResponse => "encoded_response",
            Unmetered::UnknownResponse => "unknown_response",
            Unmetered::CutBeforeUsage => "cut_before_usage",
            Unmetered::NoUsage => "no_usage",
            Unmetered::Abandoned => "abandoned",
        }
    }
}

/// The provider API a POST calls, told by the end of its path (`/v1/…`, OpenRouter's
/// `/api/v1/…` and Azure's `/openai/deployments/{d}/…` alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// OpenAI-style `…/chat/completions` and legacy `…/completions` (OpenAI, OpenRouter and
    /// every compatible server): a stream reports usage only when asked.
    Chat,
    /// OpenAI's Responses API: usage in the response and in `response.completed`.
    Responses,
    /// Anthropic's Messages API: usage in the message and in every stream.
    Messages,
    /// Embeddings: usage in the JSON response.
    Embeddings,
    /// Google's Gemini API (`…/models/{model}:generateContent` and `:streamGenerateContent`):
    /// usage in every response's `usageMetadata`.
    Gemini,
    /// Token counting (`…/messages/count_tokens`, `…/responses/input_tokens`): no model call,
    /// nothing billed, nothing recorded.
    Count,
}

impl Api {
    /// The API of a request target (path, with or without its query); `None` when unknown.
    pub fn of(target: &str) -> Option<Api> {
        let path = target.split(['?', '#']).next().unwrap_or("");
        let ends = |s: &str| path.ends_with(s);
        if ends("/messages/count_tokens") || ends("/responses/input_tokens") || ends(":countTokens")
        {
            Some(Api::Count)
        } else if ends(":generateContent") || (ends(":streamGenerateContent") && sse(target)) {
            // A stream without `alt=sse` is one JSON array, which the meter does not read: an
            // unknown request, known before it goes upstream (so refused under `meter_strict`;
            // issue 29's second review).
            Some(Api::Gemini)
        } else if ends(":embedContent") || ends(":batchEmbedContents") {
            Some(Api::Embeddings)
        } else if ends("/completions") {
            Some(Api::Chat)
        } else if ends("/responses") {
            Some(Api::Responses)
        } else if ends("/messages") {
            Some(Api::Messages)
        } else if ends("/embeddings") {
            Some(Api::Embeddings)
        } else {
            None
        }
    }

    /// Whether the meter must read the body before it goes upstream.
    pub fn reads_body(self) -> bool {
        matches!(self, Api::Chat | Api::Responses)
    }
}

/// Whether a request target's query asks for server-sent events (`alt=sse`).
fn sse(target: &str) -> bool {
    target
        .split('#')
        .next()
        .and_then(|t| t.split_once('?'))
        .is_some_and(|(_, q)| q.split('&').any(|kv| kv == "alt=sse"))
}

/// The body to send upstream for a call of `api`: `Ok(None)` to send it as it is, `Ok(Some)` for
/// the body with usage asked for, `Err` when the call cannot be metered.
pub fn prepare(api: Api, body: &[u8]) -> Result<Option<Vec<u8>>, Unmetered> {
    match api {
        Api::Chat => ask_for_usage(body),
        Api::Responses => {
            let doc = Members::parse(body)?;
            // A background response answers at once without usage; its cost is never seen.
            match doc.background.map(RawValue::get) {
                None | Some("false") | Some("null") => Ok(None),
                Some("true") => Err(Unmetered::UnknownRequest),
                Some(_) => Err(Unmetered::UnreadableBody),
            }
        }
        Api::Messages | Api::Embeddings | Api::Count | Api::Gemini => Ok(None),
    }
}

/// A streaming chat completion body with `stream_options.include_usage: true`, spliced in.
fn ask_for_usage(body: &[u8]) -> Result<Option<Vec<u8>>, Unmetered> {
    let doc = Members::parse(body)?;
    match doc.stream.map(RawValue::get) {
        None | Some("false") | Some("null") => return Ok(None), // a JSON answer carries usage
        Some("true") => {}
        Some(_) => return Err(Unmetered::UnreadableBody),
    }
    let (at, cut, insert): (usize, usize, &[u8]) = match doc.stream_options {
        // First in the object, so that no member of the guest's comes between.
        None => (
            doc.open + 1,
            doc.open + 1,
            br#""stream_options":{"include_usage":true},"#,
        ),
        Some(options) => {
            let (start, end) = span(doc.text, options);
            match options.get() {
                "null" => (start, end, br#"{"include_usage":true}"#),
                text if text.starts_with('{') => {
                    let inner = Members::parse(text.as_bytes())?;
                    match inner.include_usage {
                        Some(v) if v.get() == "true" => return Ok(None),
                        // Present, but not true: the value alone is replaced.
                        Some(v) => {
                            let (s, e) = span(doc.text, v);
                            (s, e, b"true")
                        }
                        None if inner.count == 0 => (
                            start + inner.open + 1,
                            start + inner.open + 1,
                            br#""include_usage":true"#,
                        ),
                        None => (
                            start + inner.open + 1,
                            start + inner.open + 1,
                            br#""include_usage":true,"#,
                        ),
                    }
                }
                _ => return Err(Unmetered::UnreadableBody),
            }
        }
    };
    let mut out = Vec::with_capacity(body.len() - (cut - at) + insert.len());
    out.extend_from_slice(&body[..at]);
    out.extend_from_slice(insert);
    out.extend_from_slice(&body[cut..]);
    Ok(Some(out))
}

/// Where `value` (borrowed from `text`) lies in it.
fn span(text: &str, value: &RawValue) -> (usize, usize) {
    let start = value.get().as_ptr() as usize - text.as_ptr() as usize;
    (start, start + value.get().len())
}

/// The members of one JSON object that the meter reads, each as the text it was given in; the
/// others are skipped without being kept, so a body of millions of members costs nothing more.
struct Members<'a> {
    /// The whole document.
    text: &'a str,
    /// Where its `{` is.
    open: usize,
    /// How many members it has.
    count: usize,
    stream: Option<&'a RawValue>,
    stream_options: Option<&'a RawValue>,
    include_usage: Option<&'a RawValue>,
    background: Option<&'a RawValue>,
}

impl<'a> Members<'a> {
    /// One JSON object in which each member the meter reads appears once, under its exact name:
    /// a name given twice may be read either way upstream, and a server that matches names
    /// without regard to case (Go's `encoding/json`) would read `"Stream"` as `stream`.
    fn parse(body: &'a [u8]) -> Result<Self, Unmetered> {
        let text = std::str::from_utf8(body).map_err(|_| Unmetered::UnreadableBody)?;
        let open = text
            .find(|c: char| !c.is_ascii_whitespace())
            .filter(|&i| text.as_bytes()[i] == b'{')
            .ok_or(Unmetered::UnreadableBody)?;
        let found: Found<'a> = serde_json::from_str(text).map_err(|_| Unmetered::UnreadableBody)?;
        let Found(Ok(m)) = found else {
            return Err(Unmetered::UnreadableBody);
        };
        Ok(Members { text, open, ..m })
    }
}

/// A member name as the meter sees it.
enum Name {
    Stream,
    StreamOptions,
    IncludeUsage,
    Background,
    /// Equal to one of those when case is ignored, but not exactly: ambiguous.
    LookAlike,
    Other,
}

impl Name {
    fn of(s: &str) -> Name {
        const KNOWN: [&str; 4] = ["stream", "stream_options", "include_usage", "background"];
        match s {
            "stream" => Name::Stream,
            "stream_options" => Name::StreamOptions,
            "include_usage" => Name::IncludeUsage,
            "background" => Name::Background,
            _ => {
                // Simple case folding as Go's `strings.EqualFold` does it: ASCII, the long s
                // and the Kelvin sign.
                let folded: String = s
                    .chars()
                    .map(|c| match c {
                        '\u{17f}' => 's',
                        '\u{212a}' => 'k',
                        c => c.to_ascii_lowercase(),
                    })
                    .collect();
                if KNOWN.contains(&folded.as_str()) {
                    Name::LookAlike
                } else {
                    Name::Other
                }
            }
        }
    }
}

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Name;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a member name")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Name, E> {
                // Names far longer than any we read are skipped without folding them.
                Ok(if s.len() > 64 {
                    Name::Other
                } else {
                    Name::of(s)
                })
            }
        }
        d.deserialize_str(V)
    }
}

/// The members the meter reads (`Err(())` for an ambiguous object), without the text.
struct Found<'a>(Result<Members<'a>, ()>);

impl<'de: 'a, 'a> Deserialize<'de> for Found<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Found<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut m: M) -> Result<Found<'a>, M::Error> {
                let mut out = Members {
                    text: "",
                    open: 0,
                    count: 0,
                    stream: None,
                    stream_options: None,
                    include_usage: None,
                    background: None,
                };
                let mut ambiguous = false;
                while let Some(name) = m.next_key::<Name>()? {
                    out.count += 1;
                    let slot = match name {
                        Name::Stream => &mut out.stream,
                        Name::StreamOptions => &mut out.stream_options,
                        Name::IncludeUsage => &mut out.include_usage,
                        Name::Background => &mut out.background,
                        Name::LookAlike => {
                            ambiguous = true;
                            m.next_value::<IgnoredAny>()?;
                            continue;
                        }
                        Name::Other => {
                            m.next_value::<IgnoredAny>()?;
                            continue;
                        }
                    };
                    let v = m.next_value::<&'de RawValue>()?;
                    ambiguous |= slot.replace(v).is_some();
                }
                Ok(Found(if ambiguous { Err(()) } else { Ok(out) }))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn chat(body: &str) -> Result<Option<String>, Unmetered> {
        prepare(Api::Chat, body.as_bytes()).map(|o| o.map(|b| String::from_utf8(b).unwrap()))
    }

    fn options(body: &str) -> Value {
        let v: Value = serde_json::from_str(body).unwrap();
        v["stream_options"].clone()
    }

    #[test]
    fn reasons_index_their_counters() {
        for (i, r) in Unmetered::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i, "{}", r.as_str());
        }
    }

    #[test]
    fn paths_name_their_api() {
        for (p, want) in [
            ("/v1/chat/completions", Some(Api::Chat)),
            ("/api/v1/chat/completions?x=1", Some(Api::Chat)),
            (
                "/openai/deployments/d/chat/completions?api-version=2024",
                Some(Api::Chat),
            ),
            ("/v1/completions", Some(Api::Chat)),
            ("/v1/responses", Some(Api::Responses)),
            ("/v1/messages", Some(Api::Messages)),
            (
                "/v1beta/models/gemini-2.5-pro:generateContent",
                Some(Api::Gemini),
            ),
            (
                "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
                Some(Api::Gemini),
            ),
            (
                "/v1beta/models/gemini-2.5-flash:streamGenerateContent?key=k&alt=sse",
                Some(Api::Gemini),
            ),
            // One JSON array, which the meter does not read: unknown, so refused when strict.
            (
                "/v1beta/models/gemini-2.5-flash:streamGenerateContent",
                None,
            ),
            (
                "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=json",
                None,
            ),
            ("/v1/models/gemini-2.5-pro:countTokens", Some(Api::Count)),
            (
                "/v1beta/models/text-embedding-004:embedContent",
                Some(Api::Embeddings),
            ),
            ("/v1/messages/count_tokens", Some(Api::Count)),
            ("/v1/responses/input_tokens", Some(Api::Count)),
            ("/v1/embeddings", Some(Api::Embeddings)),
            ("/v1/messages/batches", None),
            ("/v1/chat/completions/", None),
            ("/v1/Chat/Completions", None),
            ("/v1/models", None),
            ("/v1/x?/chat/completions", None),
        ] {
            assert_eq!(Api::of(p), want, "{p}");
        }
    }

    #[test]
    fn a_stream_without_usage_is_made_to_ask_for_it() {
        let body = r#"  {"model":"gpt-5","stream":true,"messages":[{"role":"user","content":"{\"stream_options\":1}"}]}"#;
        let got = chat(body).unwrap().unwrap();
        assert_eq!(
            got,
            r#"  {"stream_options":{"include_usage":true},"model":"gpt-5","stream":true,"messages":[{"role":"user","content":"{\"stream_options\":1}"}]}"#
        );
        // Present but off, or null, or with other options: set, the others kept.
        let got = chat(r#"{"stream":true,"stream_options":{"include_usage":false,"include_obfuscation":false},"n":1}"#)
            .unwrap()
            .unwrap();
        assert!(got.ends_with(r#","n":1}"#), "{got}");
        assert_eq!(
            options(&got),
            serde_json::json!({"include_usage": true, "include_obfuscation": false})
        );
        let got = chat(r#"{"stream_options":null,"stream":true}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            got,
            r#"{"stream_options":{"include_usage":true},"stream":true}"#
        );
        // Spliced inside the guest's own options, byte for byte around it.
        for (body, want) in [
            (
                r#"{"stream":true,"stream_options":{ }}"#,
                r#"{"stream":true,"stream_options":{"include_usage":true }}"#,
            ),
            (
                r#"{"stream":true,"stream_options":{"include_obfuscation":false, "x":1.50}}"#,
                r#"{"stream":true,"stream_options":{"include_usage":true,"include_obfuscation":false, "x":1.50}}"#,
            ),
            (
                r#"{"stream":true,"stream_options":{"x":12345678901234567890123,"include_usage":0}}"#,
                r#"{"stream":true,"stream_options":{"x":12345678901234567890123,"include_usage":true}}"#,
            ),
        ] {
            assert_eq!(chat(body).unwrap().as_deref(), Some(want), "{body}");
        }
        // An escaped key is the same key to the provider.
        let got = chat(r#"{"stre\u0061m":true,"stream_\u006fptions":{"include_usage":false}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(options(&got)["include_usage"], true);
    }

    #[test]
    fn nothing_changes_where_nothing_is_asked_for() {
        for body in [
            r#"{"model":"m","messages":[]}"#,
            r#"{"stream":false}"#,
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
        ] {
            assert_eq!(chat(body), Ok(None), "{body}");
        }
        for api in [Api::Messages, Api::Embeddings, Api::Count, Api::Gemini] {
            assert_eq!(prepare(api, b"not even json"), Ok(None));
        }
        assert_eq!(
            prepare(
                Api::Responses,
                br#"{"model":"m","stream":true,"input":"x"}"#
            ),
            Ok(None)
        );
    }

    #[test]
    fn what_cannot_be_read_for_certain_is_not_guessed() {
        for body in [
            "",
            "[]",
            "null",
            r#"{"stream":true"#,
            r#"{"stream":true} {}"#,
            r#"{"stream":"true"}"#,
            r#"{"stream":true,"stream":false}"#,
            r#"{"stream":true,"str\u0065am":false}"#,
            r#"{"stream":true,"stream_options":"x"}"#,
            r#"{"stream":true,"stream_options":{"include_usage":true,"include_usage":false}}"#,
            // Names a case-insensitive server (Go's encoding/json) would take for ours.
            r#"{"Stream":true}"#,
            r#"{"stream":false,"STREAM":true}"#,
            "{\"\u{17f}tream\":true}",
            r#"{"stream":true,"stream_options":{"Include_Usage":false}}"#,
        ] {
            assert_eq!(chat(body), Err(Unmetered::UnreadableBody), "{body}");
        }
        assert_eq!(
            prepare(Api::Chat, b"\xff{}"),
            Err(Unmetered::UnreadableBody)
        );
        assert_eq!(
            prepare(Api::Responses, br#"{"background":true}"#),
            Err(Unmetered::UnknownRequest)
        );
        assert_eq!(
            prepare(Api::Responses, br#"{"background":1}"#),
            Err(Unmetered::UnreadableBody)
        );
    }

    #[test]
    fn deep_or_large_bodies_are_bounded() {
        // A deep body neither overflows the stack nor loses its nesting.
        let deep = format!(
            r#"{{"stream":true,"x":{}{}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        match chat(&deep) {
            Ok(Some(got)) => assert_eq!(got.len(), deep.len() + 40),
            other => assert_eq!(other, Err(Unmetered::UnreadableBody)),
        }
        let deep_options = format!(
            r#"{{"stream":true,"stream_options":{{"x":{}{}}}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        match chat(&deep_options) {
            Ok(Some(got)) => assert_eq!(got.len(), deep_options.len() + 21),
            other => assert_eq!(other, Err(Unmetered::UnreadableBody)),
        }
        // A million members are skipped, not kept.
        let mut many = String::from(r#"{"stream":true"#);
        for i in 0..1_000_000 {
            many.push_str(&format!(r#","m{i}":0"#));
        }
        many.push('}');
        assert_eq!(chat(&many).unwrap().unwrap().len(), many.len() + 40);
        let mut big = String::from(r#"{"stream":true,"messages":[""#);
        big.push_str(&"x".repeat(4 << 20));
        big.push_str(r#""]}"#);
        let got = chat(&big).unwrap().unwrap();
        assert_eq!(
            got.len(),
            big.len() + r#""stream_options":{"include_usage":true},"#.len()
        );
    }
}
