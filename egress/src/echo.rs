//! Responses of intercepted hosts, scanned for the real values of the sandbox's secrets.
//!
//! A key can come back from a provider in many ways: an error that quotes a header, a debug
//! endpoint, a redirect. Every response header and every body byte of an intercepted host is
//! checked, as it streams, for each secret's value raw, JSON-escaped, URL-encoded (either hex
//! case) and base64-encoded (standard and URL-safe alphabets, at each of the three alignments
//! the value can have in a longer encoded text). An occurrence is overwritten with `*` of the
//! same length, so lengths, `Content-Length` and framing stay valid, and is counted.
//!
//! Streaming: a chunk is passed on at once except for its tail, which waits for the next chunk so
//! that a value split across chunks, frames or TLS records is still found. What is held back
//! depends on nothing secret (issue 29): it is every byte after the chunk's last *barrier* byte (a
//! control or non-ASCII byte, which no form of any value can hold: values are printable ASCII and
//! so is each of their encodings), up to [`HOLD_BACK`] bytes, the longest form any value can
//! have. Whether the tail begins a form plays no part, so a guest that makes an upstream reflect a
//! guess of a key's next character sees the same bytes, the same chunk and frame boundaries and
//! the same moments of release for a right guess and a wrong one; only a whole occurrence
//! differs, masked. An SSE event (`…\n\n`) ends on a barrier and so is never held back.

use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use base64::Engine;

/// The byte an occurrence is overwritten with.
pub const MASK: u8 = b'*';
/// Base64 forms shorter than this are not looked for (too likely to occur by chance).
const MIN_BASE64_FORM: usize = 12;
/// The most a scan holds back between chunks: the longest form of the longest value a secret may
/// have (URL-encoding triples a value), less one byte. A constant, not the longest form of this
/// sandbox's values, whose length would tell the guest how many bytes of the key need escaping.
pub const HOLD_BACK: usize = 3 * crate::secrets::MAX_VALUE_LEN - 1;

/// Whether no form of any value can hold `b`, so no occurrence straddles it.
fn is_barrier(b: u8) -> bool {
    !(0x20..0x7f).contains(&b)
}

/// Every form of every secret value, compiled once per sandbox.
#[derive(Debug)]
pub struct EchoForms {
    matcher: AhoCorasick,
    /// The most held back: HOLD_BACK, or more for a value the secrets module would refuse.
    hold: usize,
    /// The longest form: how far before a chunk an occurrence ending in it can start, so how much
    /// of what is held is scanned again (the work per chunk stays that plus the chunk, however
    /// small the chunks an upstream sends).
    longest: usize,
    /// Whether a barrier byte ends what must be held back (see `held_back`).
    barriers: bool,
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
        // What the barrier rule relies on: no form holds a barrier or outgrows what is held back.
        // The secrets module admits only printable ASCII values of at most MAX_VALUE_LEN bytes, so
        // this always holds there; a caller that passed another value still gets every form
        // found, by holding back HOLD_BACK bytes (or the longest form) whatever the bytes are.
        let barriers = forms
            .iter()
            .all(|f| f.len() <= HOLD_BACK + 1 && !f.iter().any(|&b| is_barrier(b)));
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&forms)
            .ok()?;
        let longest = forms.iter().map(Vec::len).max().unwrap_or(1);
        Some(Arc::new(EchoForms {
            matcher,
            hold: HOLD_BACK.max(longest - 1),
            longest,
            barriers,
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

    /// How many of `pending` bytes, whose last barrier byte (if any) is at `barrier`, wait for
    /// more: those after that barrier, at most [`HOLD_BACK`]. A function of the bytes alone,
    /// never of the forms (see the module's documentation): any start of a form at the end is
    /// among them, as no form holds a barrier and none is longer than `HOLD_BACK + 1`.
    fn held_back(&self, pending: usize, barrier: Option<usize>) -> usize {
        let after = match barrier {
            Some(i) if self.barriers => pending - i - 1,
            _ => pending,
        };
        after.min(self.hold)
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

/// One response body's scan: bytes in, masked bytes out, the tail after the last barrier byte
/// (at most [`HOLD_BACK`] bytes) held back between chunks. Each chunk costs work in proportion to
/// itself and the longest form, never to what is held: the held bytes are neither scanned again
/// (but for the last `longest - 1`) nor moved but once for as many bytes released.
#[derive(Debug)]
pub struct EchoScanner {
    forms: Arc<EchoForms>,
    /// Released bytes (before `start`), then the held ones.
    buf: Vec<u8>,
    start: usize,
    /// Where in `buf` the last barrier byte is, if it is among the held ones.
    barrier: Option<usize>,
    /// Bytes scanned and moved, for the test that bounds the work per chunk.
    #[cfg(test)]
    work: usize,
}

impl EchoScanner {
    /// A scan for `forms`.
    pub fn new(forms: Arc<EchoForms>) -> EchoScanner {
        EchoScanner {
            forms,
            buf: Vec::new(),
            start: 0,
            barrier: None,
            #[cfg(test)]
            work: 0,
        }
    }

    /// Takes the next chunk; returns what may go on now and the occurrences found.
    pub fn feed(&mut self, chunk: &[u8]) -> (Vec<u8>, usize) {
        let old = self.buf.len();
        self.buf.extend_from_slice(chunk);
        if let Some(i) = chunk.iter().rposition(|&b| is_barrier(b)) {
            self.barrier = Some(old + i);
        }
        // An occurrence not seen before ends in the chunk, so starts at most longest - 1 bytes
        // before it; everything earlier was scanned (and masked) already.
        let from = old.saturating_sub(self.forms.longest - 1).max(self.start);
        let found = self.forms.mask(&mut self.buf[from..]);
        #[cfg(test)]
        {
            self.work += self.buf.len() - from;
        }
        let pending = self.buf.len() - self.start;
        let keep = self
            .forms
            .held_back(pending, self.barrier.map(|b| b - self.start));
        let end = self.buf.len() - keep;
        let out = self.buf[self.start..end].to_vec();
        self.start = end;
        if self.barrier.is_some_and(|b| b < self.start) {
            self.barrier = None;
        }
        // Drop what was released once it outweighs what is held: each held byte moves once per
        // as many bytes released.
        if self.start > self.buf.len() - self.start {
            #[cfg(test)]
            {
                self.work += self.buf.len() - self.start;
            }
            self.buf.drain(..self.start);
            self.barrier = self.barrier.map(|b| b - self.start);
            self.start = 0;
        }
        (out, found)
    }

    /// The bytes still held back (the body ended: they cannot complete a form).
    pub fn finish(&mut self) -> Vec<u8> {
        let out = self.buf.split_off(self.start);
        self.buf.clear();
        self.start = 0;
        self.barrier = None;
        out
    }

    /// What it looks for.
    pub fn forms(&self) -> &Arc<EchoForms> {
        &self.forms
    }

    /// Whether bytes are held back.
    pub fn holding(&self) -> bool {
        self.start < self.buf.len()
    }

    /// How many bytes are held back.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.buf.len() - self.start
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
            assert!(s.held() <= HOLD_BACK, "held back at most HOLD_BACK");
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
        // A tail with no barrier waits for the next chunk, whatever it is.
        let (out, _) = s.feed(b"data: sk-ant-api0");
        assert_eq!(out, b"");
        let (out, n) = s.feed(b"9 is fine\n\n");
        assert_eq!(
            (out.as_slice(), n),
            (&b"data: sk-ant-api09 is fine\n\n"[..], 0)
        );
    }

    /// The framing (each feed's output length) and what is held, for `body` in chunks of `size`.
    fn framing(body: &[u8], size: usize) -> Vec<(usize, bool)> {
        let mut s = EchoScanner::new(forms());
        let mut frames: Vec<(usize, bool)> = body
            .chunks(size)
            .map(|c| (s.feed(c).0.len(), s.holding()))
            .collect();
        frames.push((s.finish().len(), false));
        frames
    }

    /// The oracle of issue 29: a reflected guess of the key's next character, right or wrong,
    /// leaves the same chunk boundaries and the same bytes held, for every prefix of every
    /// form, in every split (a whole occurrence, masked, is the one thing allowed to differ).
    #[test]
    fn a_right_and_a_wrong_guess_are_framed_alike() {
        for enc in encodings() {
            let enc = enc.as_bytes();
            for k in 1..enc.len() {
                let right = enc[k];
                let wrong = if right == b'Q' { b'R' } else { b'Q' };
                for tail in [&b""[..], b"\"}", b"\n", b"&x=1\r\n\r\n"] {
                    let body = |next: u8| {
                        let mut b = b"{\"echo\":\"q=".to_vec();
                        b.extend_from_slice(&enc[..k]);
                        b.push(next);
                        b.extend_from_slice(tail);
                        b
                    };
                    let (r, w) = (body(right), body(wrong));
                    for size in [1, 5, 16, r.len()] {
                        assert_eq!(
                            framing(&r, size),
                            framing(&w, size),
                            "prefix {k} of {}, tail {tail:?}, chunks of {size}",
                            String::from_utf8_lossy(enc)
                        );
                    }
                }
            }
        }
    }

    /// An upstream that sends a long text with no barrier a byte at a time (the guest's own
    /// server, over plain HTTP) costs the scan a bounded amount per byte, not the whole
    /// HOLD_BACK again for each one.
    #[test]
    fn work_per_chunk_is_bounded() {
        let mut s = EchoScanner::new(forms());
        let body = vec![b'x'; 200_000];
        let mut out = Vec::new();
        for b in body.chunks(1) {
            out.extend(s.feed(b).0);
        }
        out.extend(s.finish());
        assert_eq!(out, body);
        let longest = forms().longest;
        assert!(
            s.work <= body.len() * (longest + 2),
            "{} bytes of work for {} bytes (longest form {longest})",
            s.work,
            body.len()
        );
    }

    /// What is held back ends at the last barrier, and an event or line goes on at once.
    #[test]
    fn held_back_ends_at_a_barrier() {
        let mut s = EchoScanner::new(forms());
        let (out, _) = s.feed(b"line one\nline tw");
        assert_eq!(out, b"line one\n");
        let (out, _) = s.feed(b"o\r\n");
        assert_eq!(out, b"line two\r\n");
        assert!(!s.holding());
        // Binary data holds at most the bytes after its last non-ASCII byte.
        let (out, _) = s.feed(&[b'a', 0xff, b'b', b'c']);
        assert_eq!(out, [b'a', 0xff]);
        // Text with no barrier at all: at most HOLD_BACK bytes wait.
        let big = vec![b'x'; HOLD_BACK + 100];
        let (out, _) = s.feed(&big);
        assert_eq!(out.len(), 2 + 100);
        assert_eq!(s.finish().len(), HOLD_BACK);
    }

    #[test]
    fn short_values_have_no_base64_forms_that_match_by_chance() {
        assert!(forms_of(b"abcdefgh").iter().all(|x| x.len() >= 8));
        let f = EchoForms::new(["abcdefgh"]).unwrap();
        let mut text = b"YWJjZGVm ordinary base64 QUJD".to_vec();
        assert_eq!(f.mask(&mut text), 0);
        assert!(EchoForms::new([]).is_none());
    }
}
