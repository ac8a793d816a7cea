//! Responses of intercepted hosts, scanned for the real values of the sandbox's secrets.
//!
//! A key can come back from a provider in many ways: an error that quotes a header, a debug
//! endpoint, a redirect. Every response header and every body byte of an intercepted host is
//! checked, as it streams, for each secret's value raw, JSON-escaped, URL-encoded (either hex
//! case) and base64-encoded (standard and URL-safe alphabets, at each of the three alignments
//! the value can have in a longer encoded text). An occurrence is overwritten with `*` of the
//! same length, so lengths, `Content-Length` and framing stay valid, and is counted.
//!
//! Streaming: a chunk is passed on at once except for its last bytes when they are the start of
//! one of the forms; those wait for the next chunk (never more than the longest form minus one
//! byte), so a value split across chunks, frames or TLS records is still found, and an SSE
//! event that ends a chunk is not held back.

use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use base64::Engine;

/// The byte an occurrence is overwritten with.
pub const MASK: u8 = b'*';
/// Base64 forms shorter than this are not looked for (too likely to occur by chance).
const MIN_BASE64_FORM: usize = 12;

/// Every form of every secret value, compiled once per sandbox.
#[derive(Debug)]
pub struct EchoForms {
    matcher: AhoCorasick,
    forms: Vec<Vec<u8>>,
    longest: usize,
}

impl EchoForms {
    /// The forms of `values`; `None` when there is nothing to look for.
    pub fn new<'a>(values: impl IntoIterator<Item = &'a str>) -> Option<Arc<EchoForms>> {
        let mut forms: Vec<Vec<u8>> = Vec::new();
        for v in values {
            for f in forms_of(v.as_bytes()) {
                if !f.is_empty() && !forms.contains(&f) {
                    forms.push(f);
                }
            }
        }
        if forms.is_empty() {
            return None;
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&forms)
            .ok()?;
        let longest = forms.iter().map(Vec::len).max().unwrap_or(1);
        Some(Arc::new(EchoForms {
            matcher,
            forms,
            longest,
        }))
    }

    /// Overwrites every occurrence in `buf`; returns how many there were.
    pub fn mask(&self, buf: &mut [u8]) -> usize {
        let found: Vec<(usize, usize)> = self
            .matcher
            .find_iter(&*buf)
            .map(|m| (m.start(), m.end()))
            .collect();
        for &(start, end) in &found {
            buf[start..end].fill(MASK);
        }
        found.len()
    }

    /// How many bytes at the end of `buf` are the beginning of a form (and must wait for more).
    fn pending(&self, buf: &[u8]) -> usize {
        let mut keep = 0;
        for f in &self.forms {
            let window = (f.len() - 1).min(buf.len());
            for i in buf.len() - window..buf.len() {
                let rest = buf.len() - i;
                if rest > keep && buf[i] == f[0] && f.starts_with(&buf[i..]) {
                    keep = rest;
                    break;
                }
            }
        }
        keep
    }
}

/// The forms one value is looked for in.
fn forms_of(v: &[u8]) -> Vec<Vec<u8>> {
    let mut out = vec![v.to_vec()];
    // JSON: quotes and backslashes escaped, and the solidus too (some encoders escape it).
    let json = |slash: bool| {
        let mut o = Vec::with_capacity(v.len() + 8);
        for &b in v {
            match b {
                b'"' | b'\\' => o.extend([b'\\', b]),
                b'/' if slash => o.extend(b"\\/"),
                _ => o.push(b),
            }
        }
        o
    };
    out.push(json(false));
    out.push(json(true));
    // URL-encoded: everything but the unreserved characters, in either hex case.
    for hex in [b"0123456789ABCDEF", b"0123456789abcdef"] {
        let mut o = Vec::with_capacity(v.len() * 3);
        for &b in v {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                o.push(b);
            } else {
                o.extend([b'%', hex[usize::from(b >> 4)], hex[usize::from(b & 15)]]);
            }
        }
        out.push(o);
    }
    // Base64 at each alignment: only the characters that the value's bytes alone decide.
    for engine in [
        base64::engine::general_purpose::STANDARD,
        base64::engine::general_purpose::URL_SAFE,
    ] {
        for lead in 0..3usize {
            let mut bytes = vec![0u8; lead];
            bytes.extend_from_slice(v);
            let text = engine.encode(&bytes);
            let first = if lead == 0 { 0 } else { 4 };
            let last = (lead + v.len()) / 3 * 4;
            if last > first && last - first >= MIN_BASE64_FORM {
                out.push(text.as_bytes()[first..last].to_vec());
            }
        }
    }
    out
}

/// One response body's scan: bytes in, masked bytes out, at most the longest form minus one
/// byte held back between chunks.
#[derive(Debug)]
pub struct EchoScanner {
    forms: Arc<EchoForms>,
    held: Vec<u8>,
}

impl EchoScanner {
    /// A scan for `forms`.
    pub fn new(forms: Arc<EchoForms>) -> EchoScanner {
        EchoScanner {
            forms,
            held: Vec::new(),
        }
    }

    /// Takes the next chunk; returns what may go on now and the occurrences found.
    pub fn feed(&mut self, chunk: &[u8]) -> (Vec<u8>, usize) {
        let mut buf = std::mem::take(&mut self.held);
        buf.extend_from_slice(chunk);
        let found = self.forms.mask(&mut buf);
        let keep = self.forms.pending(&buf).min(self.forms.longest - 1);
        self.held = buf.split_off(buf.len() - keep);
        (buf, found)
    }

    /// The bytes still held back (the body ended: they cannot complete a form).
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held)
    }

    /// What it looks for.
    pub fn forms(&self) -> &Arc<EchoForms> {
        &self.forms
    }

    /// Whether bytes are held back.
    pub fn holding(&self) -> bool {
        !self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "sk-ant-api03-Zx9/Qw+Er\"Ty\\Ui_Op-000000";

    fn forms() -> Arc<EchoForms> {
        EchoForms::new([KEY]).unwrap()
    }

    /// Streams `body` through a scanner in chunks of `size`; returns the output and the count.
    fn stream(body: &[u8], size: usize) -> (Vec<u8>, usize) {
        let mut s = EchoScanner::new(forms());
        let (mut out, mut n) = (Vec::new(), 0);
        for c in body.chunks(size) {
            let (o, f) = s.feed(c);
            assert!(s.held.len() < forms().longest, "held back at most a form");
            out.extend(o);
            n += f;
        }
        out.extend(s.finish());
        (out, n)
    }

    fn encodings() -> Vec<String> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let url = base64::engine::general_purpose::URL_SAFE;
        vec![
            KEY.to_string(),
            serde_json::to_string(KEY).unwrap(),
            KEY.chars()
                .map(|c| match c {
                    '"' => "\\\"".to_string(),
                    '\\' => "\\\\".to_string(),
                    '/' => "\\/".to_string(),
                    c => c.to_string(),
                })
                .collect(),
            KEY.bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect(),
            b64.encode(KEY),
            b64.encode(format!("x{KEY}")),
            b64.encode(format!("xy{KEY}")),
            url.encode(format!("Bearer {KEY}")),
            b64.encode(format!("user:{KEY}")),
        ]
    }

    #[test]
    fn every_form_is_masked_in_any_split_and_lengths_hold() {
        for enc in encodings() {
            let body = format!("{{\"error\":\"Unexpected value(s) `{enc}` for the header\"}}\n");
            for size in [1, 2, 3, 7, 64, body.len()] {
                let (out, n) = stream(body.as_bytes(), size);
                assert_eq!(out.len(), body.len(), "same length ({enc}, {size})");
                assert!(n >= 1, "found ({enc}, chunk {size})");
                let text = String::from_utf8(out).unwrap();
                for form in encodings() {
                    assert!(!text.contains(&form), "{form} survived in {text}");
                }
                // What can still be decoded from what is left holds no more than a fragment.
                assert!(!text.contains("Zx9"), "{text}");
                assert!(
                    text.starts_with("{\"error\":\"Unexpected value(s) `"),
                    "{text}"
                );
            }
        }
    }

    #[test]
    fn clean_streams_pass_byte_for_byte_and_events_are_not_held() {
        let body: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (out, n) = stream(&body, 4096);
        assert_eq!((out, n), (body, 0));
        // An SSE event that ends a chunk goes on at once.
        let mut s = EchoScanner::new(forms());
        let (out, _) = s.feed(b"data: {\"type\":\"ping\"}\n\n");
        assert_eq!(out, b"data: {\"type\":\"ping\"}\n\n");
        assert!(!s.holding());
        // The start of the key is held, then released once it is not the key after all.
        let (out, _) = s.feed(b"data: sk-ant-api0");
        assert_eq!(out, b"data: ");
        let (out, n) = s.feed(b"9 is fine\n\n");
        assert_eq!((out.as_slice(), n), (&b"sk-ant-api09 is fine\n\n"[..], 0));
    }

    #[test]
    fn short_values_have_no_base64_forms_that_match_by_chance() {
        let f = EchoForms::new(["abcdefgh"]).unwrap();
        assert!(f.forms.iter().all(|x| x.len() >= 8));
        let mut text = b"YWJjZGVm ordinary base64 QUJD".to_vec();
        assert_eq!(f.mask(&mut text), 0);
        assert!(EchoForms::new([]).is_none());
    }
}
