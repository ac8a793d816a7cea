//! Responses of intercepted hosts, scanned for the real values of the sandbox's secrets.
//!
//! A key can come back from a provider in many ways: an error that quotes a header, a debug
//! endpoint, a redirect, a file the guest stored through the key's host and reads back. Every
//! response header and every body byte of an intercepted host is checked, as it streams, for
//! each secret's value in every text form a program may have written it in, and in base64.
//!
//! - **Text:** each character of the value raw or escaped, each on its own, in any mixture:
//!   URL-encoded in either hex case, so partial encodings too (Python's `quote` leaves `/`,
//!   JavaScript's `encodeURI` leaves `+=&;:` and more), `+` for a space (form encoding), JSON's
//!   `\"`, `\\` and `\/`, and JSON's `\uXXXX` for any character.
//! - **Base64:** standard and URL-safe alphabets (and a mixture of the two), at each of the three
//!   alignments the value can have in a longer encoded text, and wrapped at any point by a line
//!   break: raw (`\n` or `\r\n`, at any width: MIME's 76 columns, PEM's 64, GitHub's 60), with
//!   up to [`MAX_INDENT`] spaces of indentation after it (YAML), or escaped in a JSON string
//!   (`\n`, `\r\n`); a `/` may be JSON's `\/` (PHP's encoder writes it so).
//!
//! An occurrence is overwritten with `*` of the same length (its line breaks kept), so lengths,
//! `Content-Length` and framing stay valid, and is counted.
//!
//! Streaming: a chunk is passed on at once except for its tail, which waits for the next chunk so
//! that a value split across chunks, frames or TLS records is still found. What is held back
//! depends on nothing secret (issue 29): it is every byte after the chunk's last *barrier* byte,
//! up to [`HOLD_BACK`] bytes, the longest form any value can have. A barrier is a control or
//! non-ASCII byte, which no text form holds (values are printable ASCII and so are their
//! escapes), except a line break right after a base64 character (`\n` or `\r\n`): base64 may be
//! wrapped there, wherever its form began on the line, so it holds nothing back. Text whose lines
//! end in letters or digits therefore waits for a line that ends otherwise (an SSE event's empty
//! line, a JSON line's `}`), up to [`HOLD_BACK`] bytes. Whether the tail begins a form plays no
//! part: the rule reads only which class each byte is in, so a guest that makes an upstream
//! reflect a guess of a key's next character sees
//! the same bytes, the same chunk and frame boundaries and the same moments of release for a
//! right guess and a wrong one; only a whole occurrence differs, masked. An SSE event (`…\n\n`)
//! ends on a barrier (the empty line's break) and so is never held back.

use std::fmt::Write as _;
use std::sync::Arc;

use bytes::Bytes;
use regex_automata::meta::Regex;
use regex_automata::util::syntax;

mod anchors;

use anchors::{AnchorError, Anchors};

/// The byte an occurrence is overwritten with.
pub const MASK: u8 = b'*';
/// Base64 forms shorter than this are not looked for (too likely to occur by chance).
const MIN_BASE64_FORM: usize = 12;
/// The most bytes one character of a value can take in a text form: JSON's `\u00XX`.
const WIDEST_ESCAPE: usize = 6;
/// The most spaces a wrapped base64 form may have after a line break (YAML's indentation).
pub const MAX_INDENT: usize = 4;
/// The longest line break inside a base64 form: `\r\n` and its indentation (JSON's escaped
/// `\r\n` is four bytes).
const WIDEST_BREAK: usize = 2 + MAX_INDENT;
/// The most bytes one base64 character can take: JSON's `\/`.
const WIDEST_BASE64_CHAR: usize = 2;

/// The longest any form of a value of `len` bytes can be: its text with every character
/// escaped as `\u00XX`, or its base64 (at most two characters more than its own, at the ends)
/// with every character escaped and a line break between every two.
pub const fn longest_form(len: usize) -> usize {
    let text = WIDEST_ESCAPE * len;
    let chars = (8 * len).div_ceil(6) + 2;
    let base64 = WIDEST_BASE64_CHAR * chars + WIDEST_BREAK * (chars - 1);
    if text > base64 { text } else { base64 }
}

/// The most a scan holds back between chunks: the longest form of the longest value a secret may
/// have, less one byte. A constant, not the longest form of this sandbox's values, whose length
/// would tell the guest how long the key is.
pub const HOLD_BACK: usize = longest_form(crate::secrets::MAX_VALUE_LEN) - 1;
/// What the compiled forms of one sandbox may take (a 4,096-byte value needs about 20 MiB, its
/// three base64 patterns most of it; a key of 200 bytes about 1 MiB).
const MATCHER_LIMIT: usize = 128 << 20;

/// Whether no text form of any value can hold `b`.
fn is_barrier(b: u8) -> bool {
    b.wrapping_sub(0x20) >= 0x5f
}

/// Whether `b` is a character of base64, in either alphabet.
fn is_base64(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'-' | b'_')
}

/// The blocks the control-byte tests read at once: a fixed size the compiler turns into SIMD
/// compares.
const BLOCK: usize = 32;

/// Where the last control or non-ASCII byte of `s` is.
fn last_control(s: &[u8]) -> Option<usize> {
    let blocks = s.rchunks_exact(BLOCK);
    let head = blocks.remainder().len();
    for (i, b) in blocks.enumerate() {
        if b.iter().fold(false, |any, &x| any | is_barrier(x)) {
            let start = s.len() - (i + 1) * BLOCK;
            return b.iter().rposition(|&x| is_barrier(x)).map(|j| start + j);
        }
    }
    s[..head].iter().rposition(|&x| is_barrier(x))
}

/// Why a sandbox's secrets could not be compiled into a scan (its sandbox does not start).
#[derive(Debug, thiserror::Error)]
pub enum EchoError {
    /// The matcher outgrew its limit (the secrets module's bounds on values keep it far below).
    #[error("compiling the response scan for the sandbox's secrets: {0}")]
    Build(String),
    /// The prefilter's literal search could not be built (its size is bounded; not expected).
    #[error(transparent)]
    Anchors(#[from] AnchorError),
}

/// Every form of every secret value, compiled once per sandbox into one matcher.
#[derive(Debug)]
pub struct EchoForms {
    matcher: Regex,
    /// Where an occurrence can be: the regex reads only the windows around these.
    anchors: Anchors,
    /// The most held back: HOLD_BACK, or more for a value the secrets module would refuse.
    hold: usize,
    /// The longest match: how far before a chunk an occurrence ending in it can start, so how
    /// much of what is held is scanned again (the work per chunk stays that plus the chunk,
    /// however small the chunks an upstream sends).
    longest: usize,
    /// Whether a barrier byte ends what must be held back (see `held_back`).
    barriers: bool,
    /// The patterns, for the matcher of header names ([`EchoForms::in_name`]), compiled the
    /// first time a response has a header (`None` if it outgrew its limit: every name is then
    /// taken to hold a value).
    patterns: Vec<String>,
    names: std::sync::OnceLock<Option<Regex>>,
}

impl EchoForms {
    /// The forms of `values`; `None` when there is nothing to look for.
    pub fn new<'a>(
        values: impl IntoIterator<Item = &'a str>,
    ) -> Result<Option<Arc<EchoForms>>, EchoError> {
        let mut values: Vec<&[u8]> = values
            .into_iter()
            .map(str::as_bytes)
            .filter(|v| !v.is_empty())
            .collect();
        // Longest first: of two values where one holds the other, the whole of the longer one
        // is masked.
        values.sort_by_key(|v| std::cmp::Reverse(v.len()));
        values.dedup();
        let Some(widest) = values.first().map(|v| v.len()) else {
            return Ok(None);
        };
        // What the barrier rule relies on: no text form holds a barrier or outgrows what is held
        // back. The secrets module admits only printable ASCII values of at most MAX_VALUE_LEN
        // bytes, so this always holds there; a caller that passed another value still gets every
        // form found, by holding back HOLD_BACK bytes (or the longest form) whatever the bytes are.
        let longest = longest_form(widest);
        let barriers =
            longest <= HOLD_BACK + 1 && values.iter().all(|v| !v.iter().any(|&b| is_barrier(b)));
        let patterns: Vec<String> = values.iter().flat_map(|v| patterns_of(v)).collect();
        let exact: Vec<Vec<u8>> = values
            .iter()
            .flat_map(|v| (0..3).filter_map(|lead| base64_chars(v, lead)))
            .map(|chars| exact_run(&chars))
            .collect();
        let anchors = Anchors::new(&values, &exact, MIN_BASE64_FORM, longest)?;
        let matcher = compile(&patterns, false).map_err(|e| EchoError::Build(e.to_string()))?;
        Ok(Some(Arc::new(EchoForms {
            matcher,
            anchors,
            hold: HOLD_BACK.max(longest - 1),
            longest,
            barriers,
            patterns,
            names: std::sync::OnceLock::new(),
        })))
    }

    /// Whether a header name holds a form of a value in any letter case: HTTP lower-cases the
    /// names it reads, so an upstream that puts a reflected value into a name (`X-Echo-<value>`)
    /// would pass it on lower-cased, a bit of the key per letter short of whole (issue 29's
    /// second review).
    pub fn in_name(&self, name: &[u8]) -> bool {
        self.names
            .get_or_init(|| compile(&self.patterns, true).ok())
            .as_ref()
            .is_none_or(|m| m.is_match(name))
    }

    /// Overwrites every occurrence in `buf` (keeping its line breaks); returns how many there
    /// were.
    pub fn mask(&self, buf: &mut [u8]) -> usize {
        self.mask_where(buf, |_| true)
    }

    /// [`EchoForms::mask`] for the occurrences whose start `settled` accepts (the others are
    /// left as they are, and not counted).
    fn mask_where(&self, buf: &mut [u8], settled: impl Fn(usize) -> bool) -> usize {
        let mut found: Vec<(usize, usize)> = Vec::new();
        for (start, end) in self.anchors.windows(buf) {
            found.extend(
                matches(&self.matcher, &buf[start..end])
                    .map(|(s, e)| (start + s, start + e))
                    .filter(|&(s, _)| settled(s)),
            );
        }
        overwrite(buf, &found)
    }

    /// Whether `hay` holds an occurrence: [`EchoForms::mask`] without writing, for a chunk that
    /// is to go on as it came if it holds none.
    fn any_in(&self, hay: &[u8]) -> bool {
        self.anchors
            .windows(hay)
            .into_iter()
            .any(|(start, end)| matches(&self.matcher, &hay[start..end]).next().is_some())
    }

    /// [`EchoForms::mask`] with the regex over all of `buf`: what the anchors must not change.
    #[cfg(test)]
    fn mask_everywhere(&self, buf: &mut [u8]) -> usize {
        let found: Vec<(usize, usize)> = matches(&self.matcher, buf).collect();
        overwrite(buf, &found)
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

/// Every occurrence in `hay`, as (start, end): after each, the search goes on from two bytes
/// before its end, not from its end, as two base64 forms side by side share up to two
/// characters (the boundary of two copies of a value falls inside a character, which carries
/// bits of both); from its end the second copy could not match (issue 29's third review).
fn matches<'h>(matcher: &'h Regex, hay: &'h [u8]) -> impl Iterator<Item = (usize, usize)> + 'h {
    let mut from = 0;
    std::iter::from_fn(move || {
        let m = matcher.find(regex_automata::Input::new(hay).span(from..hay.len()))?;
        from = m.end().saturating_sub(2).max(m.start() + 1);
        Some((m.start(), m.end()))
    })
}

/// The matcher of `patterns`, in any letter case with `any_case`; the error as its message.
fn compile(patterns: &[String], any_case: bool) -> Result<Regex, String> {
    Regex::builder()
        .syntax(
            syntax::Config::new()
                .unicode(false)
                .utf8(false)
                .case_insensitive(any_case),
        )
        .configure(
            Regex::config()
                .utf8_empty(false)
                .nfa_size_limit(Some(MATCHER_LIMIT)),
        )
        .build_many(patterns)
        .map_err(|e| e.to_string())
}

/// Overwrites the occurrences `found` in `buf`, keeping their line breaks; returns how many.
fn overwrite(buf: &mut [u8], found: &[(usize, usize)]) -> usize {
    for &(start, end) in found {
        for b in &mut buf[start..end] {
            if *b != b'\r' && *b != b'\n' {
                *b = MASK;
            }
        }
    }
    found.len()
}

/// A byte as the regex syntax matches it, whatever it is.
fn byte(out: &mut String, b: u8) {
    let _ = write!(out, "\\x{b:02x}");
}

/// A hex digit of an escape, in either case.
fn hex_digit(out: &mut String, nibble: u8) {
    let d = b"0123456789abcdef"[usize::from(nibble)];
    if d.is_ascii_digit() {
        byte(out, d);
    } else {
        out.push('[');
        byte(out, d);
        byte(out, d.to_ascii_uppercase());
        out.push(']');
    }
}

/// The patterns one value is looked for in: one for its text forms, and one per base64
/// alignment long enough to look for.
fn patterns_of(v: &[u8]) -> Vec<String> {
    let mut out = vec![text_pattern(v)];
    for lead in 0..3usize {
        if let Some(p) = base64_pattern(v, lead) {
            out.push(p);
        }
    }
    out
}

/// Each character raw or escaped, each on its own (see the module's documentation).
fn text_pattern(v: &[u8]) -> String {
    let mut p = String::with_capacity(v.len() * 48);
    for &b in v {
        p.push_str("(?:");
        // JSON's \u00XX, for any character.
        byte(&mut p, b'\\');
        byte(&mut p, b'u');
        byte(&mut p, b'0');
        byte(&mut p, b'0');
        hex_digit(&mut p, b >> 4);
        hex_digit(&mut p, b & 15);
        // URL-encoding, any character, either case.
        p.push('|');
        byte(&mut p, b'%');
        hex_digit(&mut p, b >> 4);
        hex_digit(&mut p, b & 15);
        // JSON's short escapes.
        if matches!(b, b'"' | b'\\' | b'/') {
            p.push('|');
            byte(&mut p, b'\\');
            byte(&mut p, b);
        }
        // Form encoding's space.
        if b == b' ' {
            p.push('|');
            byte(&mut p, b'+');
        }
        p.push('|');
        byte(&mut p, b);
        p.push(')');
    }
    p
}

/// The standard alphabet; the URL-safe one spells 62 and 63 `-` and `_`.
const STANDARD: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// The base64 of `v` after `lead` bytes of something else, as the 6-bit values each character
/// may have: every character that carries a bit of the value. A character at either end that
/// shares its bits with the bytes around the value may be any character those bits allow (so a
/// masked occurrence leaves no bit of the value readable, issue 29's review). `None` when fewer
/// than [`MIN_BASE64_FORM`] characters are the value's alone.
fn base64_chars(v: &[u8], lead: usize) -> Option<Vec<Vec<u8>>> {
    // The bits of `lead` unknown bytes, the value's, and unknown ones to the group's end.
    let known = 8 * lead..8 * (lead + v.len());
    let groups = (8 * (lead + v.len())).div_ceil(6);
    let bit = |i: usize| {
        known
            .contains(&i)
            .then(|| v[(i - known.start) / 8] >> (7 - (i - known.start) % 8) & 1)
    };
    let mut chars: Vec<Vec<u8>> = Vec::new();
    for g in (8 * lead / 6)..groups {
        let fixed: Vec<(usize, u8)> = (0..6)
            .filter_map(|j| bit(6 * g + j).map(|b| (5 - j, b)))
            .collect();
        if fixed.is_empty() {
            continue;
        }
        let values: Vec<u8> = (0u8..64)
            .filter(|x| fixed.iter().all(|&(shift, b)| x >> shift & 1 == b))
            .collect();
        chars.push(values);
    }
    let exact = chars.iter().filter(|c| c.len() == 1).count();
    (exact >= MIN_BASE64_FORM).then_some(chars)
}

/// The characters of a base64 form that are the value's alone (one 6-bit value each: all but
/// the ends), in the standard alphabet: what an unbroken occurrence always holds.
fn exact_run(chars: &[Vec<u8>]) -> Vec<u8> {
    chars
        .iter()
        .filter(|c| c.len() == 1)
        .map(|c| STANDARD[usize::from(c[0])])
        .collect()
}

/// A line break a base64 form may hold between two characters: raw, with its indentation, or
/// escaped in a JSON string.
const BASE64_BREAK: &str = "(?:\\x0d?\\x0a\\x20{0,4}|\\x5c\\x6e|\\x5c\\x72\\x5c\\x6e)?";
const _: () = assert!(MAX_INDENT == 4, "BASE64_BREAK spells MAX_INDENT");

/// The pattern of [`base64_chars`]: each character in either alphabet (a `/` also as JSON's
/// `\/`), any of them followed by a line break.
fn base64_pattern(v: &[u8], lead: usize) -> Option<String> {
    let chars = base64_chars(v, lead)?;
    let mut p = String::with_capacity(chars.len() * 64);
    for (i, values) in chars.iter().enumerate() {
        if i > 0 {
            p.push_str(BASE64_BREAK);
        }
        p.push_str("(?:[");
        for &x in values {
            byte(&mut p, STANDARD[usize::from(x)]);
            // The URL-safe alphabet's two that differ.
            match x {
                62 => byte(&mut p, b'-'),
                63 => byte(&mut p, b'_'),
                _ => {}
            }
        }
        p.push(']');
        if values.contains(&63) {
            p.push('|');
            byte(&mut p, b'\\');
            byte(&mut p, b'/');
        }
        p.push(')');
    }
    Some(p)
}

/// What one chunk releases, in order: the bytes held back from before it, then the chunk's own
/// (either may be empty). Two pieces, so that the chunk's own bytes go on as they came, without
/// a copy, wherever nothing in them is masked; and two pieces wherever something is, cut at the
/// same place: where the pieces meet depends on the bytes' classes alone (the held bytes are
/// those after the last chunk's last barrier), never on what was found.
#[derive(Debug, Default)]
pub struct Released {
    /// The bytes held back from before this chunk.
    pub held: Bytes,
    /// The chunk's own bytes that go on now.
    pub chunk: Bytes,
}

impl Released {
    /// The bytes `feed` released, cut after the first `held` of them.
    fn split(out: Vec<u8>, held: usize) -> Released {
        let mut held_bytes = Bytes::from(out);
        let chunk = held_bytes.split_off(held.min(held_bytes.len()));
        Released {
            held: held_bytes,
            chunk,
        }
    }
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
    /// Where in `buf` the last barrier byte is, if it may be among the held ones.
    barrier: Option<usize>,
    /// Whether the last byte read was a base64 character (a line feed after it is no barrier),
    /// and whether it was a carriage return after one, which waits for the next byte to say
    /// whether it begins a line break (see `lines`).
    after_base64: bool,
    cr: bool,
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
            after_base64: false,
            cr: false,
            #[cfg(test)]
            work: 0,
        }
    }

    /// Finds the last barrier of `chunk`, which starts at `old` in `buf`, and the state its last
    /// byte leaves. A barrier is every control or non-ASCII byte but a line feed right after a
    /// base64 character (or after a carriage return right after one): base64 may be wrapped
    /// there. A carriage return after a base64 character at the chunk's end waits for the next
    /// byte. Only the last barrier matters (what is held back starts after it), so the chunk is
    /// read from its end: an event that ends in `\n\n` costs two bytes, and a body of wrapped
    /// base64 its line breaks, never a byte at a time (issue 29's budget).
    fn lines(&mut self, old: usize, chunk: &[u8]) {
        let (mut old, mut chunk) = (old, chunk);
        // A return that waited for this chunk's first byte: that byte decides it.
        if self.cr && !chunk.is_empty() {
            self.step(old, chunk[0]);
            (old, chunk) = (old + 1, &chunk[1..]);
        }
        let Some(&last) = chunk.last() else {
            return;
        };
        let after_before = self.after_base64;
        // Whether the byte before `i` is a base64 character (from the state before the chunk
        // for its first byte).
        let base64_before = |i: usize| {
            if i == 0 {
                after_before
            } else {
                is_base64(chunk[i - 1])
            }
        };
        let waits = last == b'\r' && base64_before(chunk.len() - 1);
        (self.after_base64, self.cr) = (!waits && is_base64(last), waits);
        let mut end = if waits { chunk.len() - 1 } else { chunk.len() };
        while let Some(c) = last_control(&chunk[..end]) {
            if chunk[c] == b'\n' {
                if base64_before(c) {
                    end = c;
                    continue;
                }
                if c > 0 && chunk[c - 1] == b'\r' && base64_before(c - 1) {
                    end = c - 1;
                    continue;
                }
            }
            self.barrier = Some(old + c);
            return;
        }
    }

    /// One byte of [`EchoScanner::lines`], read in order: the rule itself, which `lines` applies
    /// from a chunk's end (and a test holds it to this).
    fn step(&mut self, at: usize, b: u8) {
        let (after, cr) = (self.after_base64, self.cr);
        (self.after_base64, self.cr) = (false, false);
        if b == b'\n' && (after || cr) {
            return; // a line break inside base64
        }
        if cr {
            // The return no line feed followed was a barrier (one already released and dropped
            // leaves nothing held before it).
            self.barrier = at.checked_sub(1).or(self.barrier);
        }
        if b == b'\r' && after {
            self.cr = true;
            return;
        }
        if is_barrier(b) {
            self.barrier = Some(at);
        }
        self.after_base64 = is_base64(b);
    }

    /// Takes the next chunk; returns what may go on now and the occurrences found.
    pub fn feed(&mut self, chunk: &[u8]) -> (Vec<u8>, usize) {
        if chunk.is_empty() {
            return (Vec::new(), 0); // an empty frame: nothing to scan again
        }
        let old = self.buf.len();
        self.buf.extend_from_slice(chunk);
        self.lines(old, chunk);
        let pending = self.buf.len() - self.start;
        let barrier = self
            .barrier
            .filter(|&b| b >= self.start)
            .map(|b| b - self.start);
        let keep = self.forms.held_back(pending, barrier);
        let end = self.buf.len() - keep;
        // An occurrence not masked before ends in the chunk, or was left for it (below), so it
        // starts at most `longest` bytes before the chunk.
        let from = old.saturating_sub(self.forms.longest).max(self.start);
        // One that starts in the last `longest` bytes and is not released now waits: the next
        // chunk may complete a longer value that holds it (a password inside a connection
        // string), which must be masked whole. The next chunk's scan starts before it.
        let settled = end.max(self.buf.len().saturating_sub(self.forms.longest));
        let found = self
            .forms
            .mask_where(&mut self.buf[from..], |at| from + at < settled);
        #[cfg(test)]
        {
            self.work += self.buf.len() - from;
        }
        if self.start == 0 && end >= keep {
            // Everything before the held bytes goes: hand it over, buffer and all, and keep the
            // held bytes alone (no more of them than are released: each moves once per as many
            // released, as below), which saves copying what goes.
            let held = self.buf.split_off(end);
            #[cfg(test)]
            {
                self.work += held.len();
            }
            self.barrier = self.barrier.and_then(|b| b.checked_sub(end));
            return (std::mem::replace(&mut self.buf, held), found);
        }
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

    /// [`EchoScanner::feed`] for a chunk the caller owns and gives up: the same bytes released
    /// and the same occurrences found, as [`Released`]'s two pieces. Where the chunk holds back
    /// no more than itself, and neither it nor its seam with the bytes before it holds an
    /// occurrence, the chunk's released bytes are the chunk's own memory (issue 29's budget: the
    /// scan was a copy of every byte besides its reading). The seam is the last `longest` bytes
    /// before the chunk that `feed` would read again and the chunk's first `longest`: an
    /// occurrence that starts before the chunk ends there. The work is `feed`'s, in proportion
    /// to the chunk and the longest form, never to all that is held (issue 29's review).
    pub fn feed_bytes(&mut self, chunk: Bytes) -> (Released, usize) {
        if chunk.is_empty() {
            return (Released::default(), 0);
        }
        let held = self.buf.len() - self.start;
        let old = self.buf.len();
        // What `feed` would hold back, read from the chunk as it would be read.
        let saved = (self.barrier, self.after_base64, self.cr);
        self.lines(old, &chunk);
        let barrier = self
            .barrier
            .filter(|&b| b >= self.start)
            .map(|b| b - self.start);
        let keep = self.forms.held_back(held + chunk.len(), barrier);
        // The seam starts where `feed` reads from: an occurrence that starts before it was
        // read with an earlier chunk, and masked, or left, unsettled, after it.
        let clean = keep <= chunk.len() && {
            let from = old.saturating_sub(self.forms.longest).max(self.start);
            let seam_end = chunk.len().min(self.forms.longest);
            let mut seam = Vec::with_capacity(old - from + seam_end);
            seam.extend_from_slice(&self.buf[from..]);
            seam.extend_from_slice(&chunk[..seam_end]);
            #[cfg(test)]
            {
                self.work += seam.len() + chunk.len();
            }
            !self.forms.any_in(&seam) && !self.forms.any_in(&chunk)
        };
        if !clean {
            (self.barrier, self.after_base64, self.cr) = saved;
            let (out, found) = self.feed(&chunk);
            return (Released::split(out, held), found);
        }
        let cut = chunk.len() - keep;
        let held_bytes = Bytes::copy_from_slice(&self.buf[self.start..]);
        self.buf.clear();
        self.buf.extend_from_slice(&chunk[cut..]);
        self.start = 0;
        self.barrier = self.barrier.and_then(|b| b.checked_sub(old + cut));
        #[cfg(test)]
        {
            self.work += held + keep;
        }
        let released = Released {
            held: held_bytes,
            chunk: chunk.slice(..cut),
        };
        (released, 0)
    }

    /// The bytes still held back, masked (the body ended: nothing can complete a longer form),
    /// and the occurrences found in them.
    pub fn finish(&mut self) -> (Vec<u8>, usize) {
        let mut out = self.buf.split_off(self.start);
        let found = self.forms.mask(&mut out);
        self.buf.clear();
        self.start = 0;
        self.barrier = None;
        (self.after_base64, self.cr) = (false, false);
        (out, found)
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
    use base64::Engine;

    const KEY: &str = "sk-ant-api03-Zx9/Qw+Er\"Ty\\Ui_Op-000000";

    /// The forms of [`KEY`], compiled once for every test.
    fn forms() -> Arc<EchoForms> {
        static FORMS: std::sync::OnceLock<Arc<EchoForms>> = std::sync::OnceLock::new();
        FORMS
            .get_or_init(|| EchoForms::new([KEY]).unwrap().unwrap())
            .clone()
    }

    /// Streams `body` through a scanner of `forms` in chunks of `size`; returns the output and
    /// the count.
    /// `body` in chunks of `size` through `feed`, and through `feed_bytes` beside it, which
    /// must release the same bytes at each step, cut after the held bytes, and find the same.
    fn stream_with(forms: &Arc<EchoForms>, body: &[u8], size: usize) -> (Vec<u8>, usize) {
        let mut s = EchoScanner::new(forms.clone());
        let mut b = EchoScanner::new(forms.clone());
        let (mut out, mut n) = (Vec::new(), 0);
        for c in body.chunks(size) {
            let held = b.held();
            let (o, f) = s.feed(c);
            let (r, g) = b.feed_bytes(Bytes::copy_from_slice(c));
            assert!(s.held() <= HOLD_BACK, "held back at most HOLD_BACK");
            assert_eq!(o, [&r.held[..], &r.chunk[..]].concat(), "size {size}");
            assert!(r.chunk.is_empty() || r.held.len() == held, "cut elsewhere");
            assert_eq!((f, s.held()), (g, b.held()), "size {size}");
            out.extend(o);
            n += f;
        }
        let (rest, m) = s.finish();
        assert_eq!((rest.clone(), m), b.finish());
        out.extend(rest);
        (out, n + m)
    }

    fn stream(body: &[u8], size: usize) -> (Vec<u8>, usize) {
        stream_with(&forms(), body, size)
    }

    /// URL-encoding of every byte outside `keep` (and the unreserved characters), upper case.
    fn url(v: &str, keep: &str) -> String {
        v.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || keep.as_bytes().contains(&b)
                {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect()
    }

    /// Base64 wrapped MIME's way (76 columns, CRLF) or PEM's (64, LF).
    fn wrap(text: &str, width: usize, eol: &str) -> String {
        let lines: Vec<&str> = text
            .as_bytes()
            .chunks(width)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        lines.join(eol)
    }

    /// The forms that stand on a line of their own (wrapped base64) and those that sit in text.
    fn encodings() -> Vec<String> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let url_safe = base64::engine::general_purpose::URL_SAFE;
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
            url(KEY, ""),
            url(KEY, "")
                .split('%')
                .enumerate()
                .map(|(i, s)| {
                    if i == 0 {
                        s.to_string()
                    } else {
                        format!("%{}{}", s[..2].to_lowercase(), &s[2..])
                    }
                })
                .collect(),
            // Python's quote(): `/` left as it is.
            url(KEY, "/"),
            // JavaScript's encodeURI: these left as they are.
            url(KEY, ";,/?:@&=+$!*'()#"),
            // JSON \u escapes of every character, in either case, and of every other one.
            KEY.bytes().map(|b| format!("\\u{:04x}", b)).collect(),
            KEY.bytes().map(|b| format!("\\u{:04X}", b)).collect(),
            KEY.bytes()
                .enumerate()
                .map(|(i, b)| {
                    if i % 2 == 0 {
                        format!("\\u{b:04x}")
                    } else {
                        (b as char).to_string()
                    }
                })
                .collect(),
            b64.encode(KEY),
            b64.encode(format!("x{KEY}")),
            b64.encode(format!("xy{KEY}")),
            url_safe.encode(format!("Bearer {KEY}")),
            b64.encode(format!("user:{KEY}")),
            wrap(
                &b64.encode(format!("{}{KEY}{}", "a".repeat(50), "b".repeat(40))),
                76,
                "\r\n",
            ),
            wrap(&b64.encode(format!("{}{KEY}", "c".repeat(40))), 64, "\n"),
            // GitHub's contents API wraps at 60, others at 72; YAML indents; JSON strings hold
            // their breaks escaped, and PHP's encoder writes `/` as `\/`.
            wrap(&b64.encode(format!("{}{KEY}", "d".repeat(30))), 60, "\n"),
            wrap(&b64.encode(format!("{}{KEY}", "e".repeat(20))), 72, "\r\n"),
            wrap(&b64.encode(KEY), 16, "\n    "),
            wrap(&b64.encode(format!("{}{KEY}", "f".repeat(10))), 60, "\\n"),
            wrap(
                &b64.encode(format!("{}{KEY}", "g".repeat(10))),
                76,
                "\\r\\n",
            ),
            b64.encode(format!("{}{KEY}", "h".repeat(3)))
                .replace('/', "\\/"),
        ]
    }

    /// `enc` in a body: wrapped base64 as a MIME part's body, the rest in a JSON error.
    fn body_of(enc: &str) -> String {
        if enc.contains('\n') {
            format!("--b\r\nContent-Transfer-Encoding: base64\r\n\r\n{enc}\r\n--b--\r\n")
        } else {
            format!("{{\"error\":\"Unexpected value(s) `{enc}` for the header\"}}\n")
        }
    }

    /// `feed_bytes` releases what `feed` does, byte for byte and occurrence for occurrence, in
    /// every split, cut after the held bytes; and holds back the same.
    #[test]
    fn feed_bytes_releases_what_feed_does() {
        let forms = forms();
        let mut bodies: Vec<Vec<u8>> = encodings()
            .iter()
            .map(|e| body_of(e).into_bytes())
            .collect();
        bodies.push(b"data: {\"text\":\"Hello, world. \"}\n\ndata: {\"x\":1}\n\n".repeat(40));
        bodies.push(b"line one ends in a letter\nline two too\r\nand three".repeat(30));
        for body in &bodies {
            for size in [1, 3, 7, 16, 64, 100, 333, 4096] {
                let (mut a, mut b) = (
                    EchoScanner::new(forms.clone()),
                    EchoScanner::new(forms.clone()),
                );
                let (mut out_a, mut out_b) = (Vec::new(), Vec::new());
                let (mut found_a, mut found_b) = (0, 0);
                for piece in body.chunks(size) {
                    let held = b.held();
                    let (o, n) = a.feed(piece);
                    let (r, m) = b.feed_bytes(Bytes::copy_from_slice(piece));
                    assert!(
                        r.held.len() <= held,
                        "more held bytes released than were held"
                    );
                    assert!(
                        r.chunk.is_empty() || r.held.len() == held,
                        "cut elsewhere than after the held bytes"
                    );
                    assert_eq!(o, [&r.held[..], &r.chunk[..]].concat(), "size {size}");
                    assert_eq!(a.held(), b.held());
                    out_a.extend_from_slice(&o);
                    out_b.extend_from_slice(&r.held);
                    out_b.extend_from_slice(&r.chunk);
                    (found_a, found_b) = (found_a + n, found_b + m);
                }
                let ((o, n), (p, m)) = (a.finish(), b.finish());
                assert_eq!(o, p);
                out_a.extend_from_slice(&o);
                out_b.extend_from_slice(&p);
                assert_eq!(out_a, out_b, "size {size}");
                assert_eq!(found_a + n, found_b + m, "size {size}");
                assert_eq!(out_a.len(), body.len());
            }
        }
    }

    #[test]
    fn every_form_is_masked_in_any_split_and_lengths_hold() {
        for enc in encodings() {
            let body = body_of(&enc);
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
                let head = &body[..body.find(&enc).unwrap()];
                assert!(text.starts_with(head), "{text}");
                // Line breaks stay where they were.
                assert_eq!(
                    text.match_indices('\n').collect::<Vec<_>>(),
                    body.match_indices('\n').collect::<Vec<_>>()
                );
            }
        }
    }

    /// A value with a space, sent as a form field.
    #[test]
    fn form_encoding_is_masked() {
        let value = "pass word+x/y \"quoted\"";
        let forms = EchoForms::new([value]).unwrap().unwrap();
        let form = url(value, "").replace("%20", "+");
        let body = format!("user=a&password={form}&next=1");
        let (out, n) = stream_with(&forms, body.as_bytes(), 3);
        assert_eq!(n, 1);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("user=a&password={}&next=1", "*".repeat(form.len()))
        );
    }

    /// A small generator (xorshift), so that the property tests below need no crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Property: any value the secrets module admits, each character independently raw,
    /// URL-encoded (either case), JSON-escaped or `\u`-escaped (either case), in any text, in
    /// any split, is masked whole.
    #[test]
    fn any_mixture_of_escapes_is_masked() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for case in 0..300 {
            let len = 16 + rng.below(48);
            let value: String = (0..len)
                .map(|_| (0x20 + rng.below(0x5f) as u8) as char)
                .collect();
            let forms = EchoForms::new([value.as_str()]).unwrap().unwrap();
            let enc: String = value
                .bytes()
                .map(|b| match rng.below(5) {
                    0 => format!("%{b:02X}"),
                    1 => format!("%{b:02x}"),
                    2 => format!("\\u{b:04x}"),
                    3 if matches!(b, b'"' | b'\\' | b'/') => format!("\\{}", b as char),
                    3 if b == b' ' => "+".to_string(),
                    _ => (b as char).to_string(),
                })
                .collect();
            let body = format!("before {enc} after\n");
            let size = 1 + rng.below(40);
            let (out, n) = stream_with(&forms, body.as_bytes(), size);
            assert!(n >= 1, "case {case}: {enc} in chunks of {size}");
            let text = String::from_utf8(out).unwrap();
            assert!(text.starts_with("before "), "case {case}: {text}");
            assert!(text.ends_with(" after\n"), "case {case}: {text}");
            assert!(
                text[7..text.len() - 7].bytes().all(|b| b == MASK),
                "case {case}: {enc} left {text}"
            );
        }
    }

    /// Property: any value in base64 of either alphabet, after any lead, wrapped at 64 or 76
    /// columns with either line end, is masked but for the characters its neighbours share.
    #[test]
    fn any_wrapped_base64_is_masked() {
        let b64 = base64::engine::general_purpose::STANDARD;
        let url_safe = base64::engine::general_purpose::URL_SAFE;
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for case in 0..200 {
            let len = 16 + rng.below(100);
            let value: String = (0..len)
                .map(|_| (0x21 + rng.below(0x5e) as u8) as char)
                .collect();
            let forms = EchoForms::new([value.as_str()]).unwrap().unwrap();
            let lead: String = "L".repeat(rng.below(120));
            let plain = format!("{lead}{value}trailing text");
            let text = if rng.below(2) == 0 {
                b64.encode(&plain)
            } else {
                url_safe.encode(&plain)
            };
            let (width, eol) = [(76, "\r\n"), (64, "\n"), (76, "\n")][rng.below(3)];
            let body = format!("header: x\r\n\r\n{}\r\n", wrap(&text, width, eol));
            let size = 1 + rng.below(100);
            let (out, n) = stream_with(&forms, body.as_bytes(), size);
            assert!(n >= 1, "case {case}: width {width}, lead {}", lead.len());
            let masked = out.iter().filter(|&&b| b == MASK).count();
            // Every character that carries a bit of the value, those it shares with the bytes
            // around it included.
            let carrying = (8 * (lead.len() + len)).div_ceil(6) - 8 * lead.len() / 6;
            assert!(
                masked >= carrying,
                "case {case}: {masked} of {carrying} masked"
            );
        }
    }

    /// Property: the regex over the anchors' windows finds what it finds over everything, in
    /// bodies that mix every form of several values (escaped, wrapped at any width, either
    /// alphabet), their near misses and noise of every kind of byte.
    #[test]
    fn anchored_scan_finds_what_a_full_scan_finds() {
        let b64 = base64::engine::general_purpose::STANDARD;
        let url_safe = base64::engine::general_purpose::URL_SAFE;
        let mut rng = Rng(0x51_7cc1_b727_220a);
        let noise = |rng: &mut Rng| -> Vec<u8> {
            let pool: &[&[u8]] = &[
                b"data: {\"text\":\"hi\\n\"}\n\n",
                b"%2F%41%4a",
                b"\\u0041\\\"\\/",
                b"+ +",
                b"\r\nABCDEFGHIJKLMNOP\nQRSTUVWXYZ0123\r\n",
                b"\xff\x00\t",
                b"plain words in a line ",
            ];
            let mut out = Vec::new();
            for _ in 0..rng.below(6) {
                out.extend_from_slice(pool[rng.below(pool.len())]);
            }
            out
        };
        for case in 0..300 {
            let values: Vec<String> = (0..1 + rng.below(3))
                .map(|_| {
                    (0..16 + rng.below(40))
                        .map(|_| (0x20 + rng.below(0x5f) as u8) as char)
                        .collect()
                })
                .collect();
            let forms = EchoForms::new(values.iter().map(String::as_str))
                .unwrap()
                .unwrap();
            let mut body = Vec::new();
            for _ in 0..1 + rng.below(4) {
                body.extend(noise(&mut rng));
                let v = &values[rng.below(values.len())];
                let lead = "Q".repeat(rng.below(4));
                let enc: String = match rng.below(5) {
                    0 => v.clone(),
                    1 => v
                        .bytes()
                        .map(|b| match rng.below(4) {
                            0 => format!("%{b:02x}"),
                            1 => format!("\\u{b:04X}"),
                            2 if b == b' ' => "+".to_string(),
                            _ => (b as char).to_string(),
                        })
                        .collect(),
                    2 | 3 => {
                        let engine = if rng.below(2) == 0 { &b64 } else { &url_safe };
                        let eols = ["\n", "\r\n", "\\n", "\\r\\n", "\n  ", "\r\n    "];
                        let eol = eols[rng.below(eols.len())];
                        let text =
                            wrap(&engine.encode(format!("{lead}{v}")), 1 + rng.below(80), eol);
                        if rng.below(3) == 0 {
                            text.replace('/', "\\/")
                        } else {
                            text
                        }
                    }
                    // A near miss: the value with one character changed.
                    _ => {
                        let mut w = v.clone().into_bytes();
                        let i = rng.below(w.len());
                        w[i] = if w[i] == b'#' { b'$' } else { b'#' };
                        String::from_utf8(w).unwrap()
                    }
                };
                body.extend_from_slice(enc.as_bytes());
            }
            body.extend(noise(&mut rng));
            let (mut anchored, mut full) = (body.clone(), body.clone());
            let n = forms.mask(&mut anchored);
            let m = forms.mask_everywhere(&mut full);
            assert_eq!(
                (n, String::from_utf8_lossy(&anchored)),
                (m, String::from_utf8_lossy(&full)),
                "case {case}: {values:?} in {}",
                String::from_utf8_lossy(&body)
            );
        }
    }

    /// Property: the last barrier and the state that `lines` finds from a chunk's end are what
    /// the rule finds a byte at a time, in bodies of lines that end in base64 characters or not,
    /// with either line end, indented, returns in every place, binary bytes and events, in
    /// every chunking.
    #[test]
    fn barriers_from_the_end_are_the_rules_barriers() {
        let mut rng = Rng(0x3c6e_f372_fe94_f82b);
        let piece = |rng: &mut Rng| -> Vec<u8> {
            let len = [64, 76, 63, 0, 1, 5][rng.below(6)];
            let mut p: Vec<u8> = (0..len)
                .map(|_| {
                    let pool = b"AZaz09+/-_ .:\\\"{";
                    pool[rng.below(pool.len())]
                })
                .collect();
            match rng.below(8) {
                0 => p.extend_from_slice(b"\r\n"),
                1 => p.extend_from_slice(b"\n"),
                2 => p.push(b'\r'),
                3 => p.extend_from_slice(b"\n\n"),
                4 => p.push(0xff),
                5 => p.extend_from_slice(b"\r\r\n"),
                _ => {}
            }
            p
        };
        let forms = forms();
        for case in 0..2000 {
            let mut body = Vec::new();
            for _ in 0..rng.below(12) {
                body.extend(piece(&mut rng));
            }
            let (mut fast, mut slow) = (
                EchoScanner::new(forms.clone()),
                EchoScanner::new(forms.clone()),
            );
            let mut at = 0;
            while at < body.len() {
                let most = if rng.below(2) == 0 { 4 } else { 200 };
                let n = 1 + rng.below(most);
                let chunk = &body[at..(at + n).min(body.len())];
                fast.lines(at, chunk);
                for (i, &b) in chunk.iter().enumerate() {
                    slow.step(at + i, b);
                }
                at += chunk.len();
                let state = |s: &EchoScanner| (s.barrier, s.after_base64, s.cr);
                assert_eq!(
                    state(&fast),
                    state(&slow),
                    "case {case}, after {at} bytes of {:?}",
                    String::from_utf8_lossy(&body)
                );
            }
        }
    }

    /// Base64 wrapped at any width, its breaks raw, indented or escaped in a JSON string, is
    /// masked as a scan of the whole body masks it wherever one chunk ends (issue 29's second
    /// review: at 60 or 72 columns every break was a barrier, and a chunk that ended after one
    /// let both halves out unmasked; escaped breaks were never matched).
    #[test]
    fn wrapped_base64_is_masked_wherever_a_chunk_ends() {
        let b64 = base64::engine::general_purpose::STANDARD;
        let forms = forms();
        let encoded = b64.encode(format!("Authorization: Bearer {KEY}\n"));
        for width in [1, 3, 60, 64, 72, 76] {
            for eol in ["\n", "\r\n", "\n    ", "\\n", "\\r\\n"] {
                let form = wrap(&encoded, width, eol);
                for body in [
                    format!("{form}\n"),
                    format!("content: {form}\n"),
                    format!("{{\"content\":\"{form}\",\"encoding\":\"base64\"}}\n"),
                ] {
                    let mut whole = body.clone().into_bytes();
                    assert!(
                        forms.mask(&mut whole) >= 1,
                        "width {width}, {eol:?}: {body}"
                    );
                    for cut in 1..body.len() {
                        let mut s = EchoScanner::new(forms.clone());
                        let (mut out, _) = s.feed(&body.as_bytes()[..cut]);
                        out.extend(s.feed(&body.as_bytes()[cut..]).0);
                        out.extend(s.finish().0);
                        assert_eq!(
                            String::from_utf8_lossy(&out),
                            String::from_utf8_lossy(&whole),
                            "width {width}, {eol:?}, cut at {cut}"
                        );
                    }
                }
            }
        }
    }

    /// A base64 block that starts before a value's only text piece and overlaps it does not hide
    /// the piece (issue 29's third review: the blocks were searched without overlaps, and the
    /// block's window stopped at the `:` before the other value's occurrence).
    #[test]
    fn a_base64_block_overlapping_a_text_piece_hides_nothing() {
        let y = "ABCDEFGHIJKLMNOPQRS";
        let x = "EVGR0hJSktM:tail";
        let forms = EchoForms::new([y, x]).unwrap().unwrap();
        let body = format!("echo: QUJDR{x} end\n");
        let (mut anchored, mut full) = (body.clone().into_bytes(), body.clone().into_bytes());
        let n = forms.mask(&mut anchored);
        assert_eq!(n, forms.mask_everywhere(&mut full));
        assert!(n >= 1 && !String::from_utf8_lossy(&anchored).contains("tail"));
        assert_eq!(stream_with(&forms, body.as_bytes(), 1).0, full);
    }

    /// Two copies of a value side by side, base64-encoded together so that their boundary falls
    /// inside a character: both are masked (issue 29's third review: the first match took the
    /// shared character and the second copy could not start).
    #[test]
    fn two_base64_copies_that_share_a_character_are_both_masked() {
        let v = "sk-test-0123456789abcdefXYZ";
        let forms = EchoForms::new([v]).unwrap().unwrap();
        let b64 = base64::engine::general_purpose::STANDARD;
        for lead in 1..4 {
            let enc = b64.encode(format!("{}{v}{v}", "L".repeat(lead)));
            let mut full = enc.clone().into_bytes();
            forms.mask_everywhere(&mut full);
            let mut anchored = enc.clone().into_bytes();
            forms.mask(&mut anchored);
            assert_eq!(anchored, full, "lead {lead}");
            // Every character carrying a bit of either copy is masked.
            let (first, last) = ((8 * lead) / 6 + 1, (8 * (lead + 2 * v.len())) / 6);
            let left: String = full[first..last]
                .iter()
                .filter(|&&b| b != MASK)
                .map(|&b| b as char)
                .collect();
            assert!(left.is_empty(), "lead {lead}: {left:?} left in {enc}");
        }
    }

    /// A value inside another (a password inside a connection string): cut anywhere, the
    /// longer one is masked whole, as a scan of the whole body masks it (issue 29's review:
    /// the shorter one, complete at the end of a chunk, was masked first and the rest of the
    /// longer one went out).
    #[test]
    fn a_value_inside_another_is_masked_whole_wherever_the_chunks_end() {
        let inner = "hunter2hunter2hunter2";
        let outer = "admin:hunter2hunter2hunter2@db.internal";
        let forms = EchoForms::new([inner, outer]).unwrap().unwrap();
        for body in [format!("dsn={outer} end\n"), outer.to_string()] {
            let mut whole = body.clone().into_bytes();
            assert_eq!(forms.mask_everywhere(&mut whole), 1);
            for cut in 1..body.len() {
                let mut s = EchoScanner::new(forms.clone());
                let (mut out, mut n) = s.feed(&body.as_bytes()[..cut]);
                let (more, m) = s.feed(&body.as_bytes()[cut..]);
                let (rest, k) = s.finish();
                out.extend(more);
                out.extend(rest);
                n += m + k;
                assert_eq!((out.as_slice(), n), (whole.as_slice(), 1), "cut at {cut}");
            }
            for size in [1, 2, 3, 5] {
                assert_eq!(stream_with(&forms, body.as_bytes(), size).0, whole);
            }
        }
    }

    /// Which bytes are anchors, so how much of a body the regex reads and how long it takes,
    /// does not depend on which characters the values hold (issue 29's review: `%51` was one
    /// only for keys with a `Q`), and an empty frame costs no scan.
    #[test]
    fn the_scans_work_tells_nothing_of_the_values_characters() {
        let with_q = EchoForms::new(["sk-ant-api03-abcdefghQjklmnopqrstuvwxyz0123456789"])
            .unwrap()
            .unwrap();
        let without = EchoForms::new(["sk-ant-api03-abcdefghijklmnopqrstuvwxyz0123456789"])
            .unwrap()
            .unwrap();
        for body in [
            "%51 and %7e and %2F".to_string(),
            "\\u0051 \\\" \\/ \\\\".to_string(),
            format!("{}\n{}", "%51".repeat(500), "x".repeat(2000)),
        ] {
            let (a, b) = (
                with_q.anchors.windows(body.as_bytes()),
                without.anchors.windows(body.as_bytes()),
            );
            assert!(!a.is_empty(), "{body}");
            assert_eq!(a, b, "{body}");
        }
        let mut s = EchoScanner::new(forms());
        s.feed(&vec![b'x'; 30_000]);
        let work = s.work;
        for _ in 0..1000 {
            assert_eq!(s.feed(&[]), (Vec::new(), 0));
        }
        assert_eq!(s.work, work, "an empty chunk is scanned again");
    }

    /// A value the secrets module would refuse (non-ASCII) is still found in its escapes.
    #[test]
    fn escapes_of_any_byte_are_anchors() {
        let forms = EchoForms::new(["abcdefghijklmnopq\u{e9}"])
            .unwrap()
            .unwrap();
        let mut body = b"x abcdefghijklmnopq%C3%A9 y".to_vec();
        assert_eq!(forms.mask(&mut body), 1);
        assert_eq!(body, b"x *********************** y");
    }

    /// Ordinary model output and code leave the regex nothing to read (the anchors' windows
    /// are where the scan's time goes), nor do lines with fewer escapes than a value has
    /// pieces (a quoted word in an answer); a line with as many gets a window that stops at
    /// its line breaks, which no text form holds.
    #[test]
    fn ordinary_text_has_no_windows_and_escapes_their_lines() {
        let forms = EchoForms::new([
            "sk-ant-api03-Zx9Qw0Er1Ty2Ui_Op-000000000000000000000",
            "sk-proj-0123456789abcdefghijklmnopqrstuvwxyz0123456789",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(forms.anchors.pieces(), 3);
        let event =
            "data: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hello, world.\"}}\n\n";
        let code = "fn main() {\n    let url = \"https://example.com/a-b\";\n    println!(\"{url}\");\n}\n";
        let quoted = "data: {\"delta\":{\"text\":\"say \\\"hi\\\"\"}}\n\n";
        for text in [event, code, quoted] {
            let body = text.repeat(200);
            assert_eq!(forms.anchors.windows(body.as_bytes()), vec![], "{text}");
        }
        let escaped = format!(
            "{}data: {{\"text\":\"a \\\"b\\\" \\\\c\"}}\n\n{}",
            event.repeat(20),
            event.repeat(20)
        );
        let line = escaped.find("data: {\"text\"").unwrap();
        let end = line + escaped[line..].find('\n').unwrap();
        assert_eq!(
            forms.anchors.windows(escaped.as_bytes()),
            vec![(line, end)],
            "the line with three escapes, to its ends"
        );
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
        // So does an event whose data line is a base64 wrap's length.
        let event = format!("data: {}\n\n", "x".repeat(70));
        let (out, _) = s.feed(event.as_bytes());
        assert_eq!(out, event.as_bytes());
        assert!(!s.holding());
    }

    /// The framing (each feed's output length) and what is held, for `body` in chunks of `size`.
    fn framing(body: &[u8], size: usize) -> Vec<(usize, bool)> {
        let mut s = EchoScanner::new(forms());
        let mut frames: Vec<(usize, bool)> = body
            .chunks(size)
            .map(|c| (s.feed(c).0.len(), s.holding()))
            .collect();
        frames.push((s.finish().0.len(), false));
        frames
    }

    /// The oracle of issue 29: a reflected guess of the key's next character, right or wrong,
    /// leaves the same chunk boundaries and the same bytes held, for every prefix of every
    /// form, in every split (a whole occurrence, masked, is the one thing allowed to differ).
    #[test]
    fn a_right_and_a_wrong_guess_are_framed_alike() {
        for enc in encodings() {
            let enc = enc.as_bytes();
            // Every short prefix, then one in four, and the last: the hold depends on no
            // prefix, so a sample finds a dependence as well as all of them (and costs a
            // fourth).
            let last = enc.len() - 1;
            for k in (1..enc.len()).filter(|&k| k <= 8 || k % 4 == 0 || k == last) {
                let right = enc[k];
                if is_barrier(right) {
                    continue; // a line break is not a guess of the key
                }
                // A wrong guess of the same class (a base64 character or not): the class of a
                // byte the guest chose is the guest's own knowledge, and the rule reads it.
                let wrong = match (is_base64(right), right) {
                    (true, b'Q') => b'R',
                    (true, _) => b'Q',
                    (false, b'#') => b'$',
                    (false, _) => b'#',
                };
                let json = &b"{\"echo\":\"q="[..];
                let ends = [
                    (json, &b""[..]),
                    (json, b"\"}"),
                    (b"", b"\n"),
                    (b"", b"&x=1\r\n\r\n"),
                ];
                for (head, tail) in ends {
                    let body = |next: u8| {
                        let mut b = head.to_vec();
                        b.extend_from_slice(&enc[..k]);
                        b.push(next);
                        b.extend_from_slice(tail);
                        b
                    };
                    let (r, w) = (body(right), body(wrong));
                    let sizes = if k % 5 == 0 {
                        &[1, 5, 16, r.len()][..]
                    } else {
                        &[5, 16, r.len()]
                    };
                    for &size in sizes {
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
        let longest = forms().longest;
        let body = vec![b'x'; 200_000];
        for size in [1, 1400] {
            let (mut s, mut b) = (EchoScanner::new(forms()), EchoScanner::new(forms()));
            let (mut out, mut out_b) = (Vec::new(), Vec::new());
            for c in body.chunks(size) {
                out.extend(s.feed(c).0);
                let (r, _) = b.feed_bytes(Bytes::copy_from_slice(c));
                out_b.extend_from_slice(&r.held);
                out_b.extend_from_slice(&r.chunk);
            }
            out.extend(s.finish().0);
            out_b.extend(b.finish().0);
            assert_eq!((&out, &out_b), (&body, &body));
            // Through `feed_bytes` too (issue 29's review: its seam once held all that was
            // held back, 43 kB of it for every chunk of a line with no barrier).
            for work in [s.work, b.work] {
                assert!(
                    work <= body.len() * (longest + 2),
                    "{work} bytes of work for {} bytes in chunks of {size} (longest form {longest})",
                    body.len()
                );
            }
        }
    }

    /// A form far into a chunk that follows held bytes: the chunk is read whole, not only its
    /// seam with them (issue 29's review: a scan of the seam alone passed every other test).
    #[test]
    fn a_form_past_the_seam_is_masked() {
        let forms = forms();
        let mut body = b"{\"a\":\"xyz".to_vec();
        let first = body.len();
        body.extend(std::iter::repeat_n(b'.', forms.longest + 50));
        body.extend_from_slice(KEY.as_bytes());
        body.extend_from_slice(b"\"}\n");
        let mut whole = body.clone();
        assert_eq!(forms.mask_everywhere(&mut whole), 1);
        let mut b = EchoScanner::new(forms.clone());
        let (r, n) = b.feed_bytes(Bytes::copy_from_slice(&body[..first]));
        let (s, m) = b.feed_bytes(Bytes::copy_from_slice(&body[first..]));
        let (t, k) = b.finish();
        let out = [&r.held[..], &r.chunk[..], &s.held[..], &s.chunk[..], &t[..]].concat();
        assert_eq!((out, n + m + k), (whole, 1));
    }

    /// What is held back ends at the last barrier, and an event or line goes on at once.
    #[test]
    fn held_back_ends_at_a_barrier() {
        let mut s = EchoScanner::new(forms());
        let (out, _) = s.feed(b"line one.\nline tw");
        assert_eq!(out, b"line one.\n");
        let (out, _) = s.feed(b"o.\r\n");
        assert_eq!(out, b"line two.\r\n");
        assert!(!s.holding());
        // Binary data holds at most the bytes after its last non-ASCII byte.
        let (out, _) = s.feed(&[b'a', 0xff, b'b', b'c']);
        assert_eq!(out, [b'a', 0xff]);
        // Text with no barrier at all: at most HOLD_BACK bytes wait.
        let big = vec![b'x'; HOLD_BACK + 100];
        let (out, _) = s.feed(&big);
        assert_eq!(out.len(), 2 + 100);
        assert_eq!(s.finish().0.len(), HOLD_BACK);
        // A line break after a base64 character is none (base64 may be wrapped there, whatever
        // the line's length); a return with no line feed after it is a barrier once the next
        // byte shows it.
        let line = "y".repeat(60);
        let (out, _) = s.feed(format!("{line}\r").as_bytes());
        assert_eq!(out, b"");
        let (out, _) = s.feed(b"\nabc");
        assert_eq!(out, b"");
        let (out, _) = s.feed(b"\n");
        assert_eq!(out, b"");
        let (out, _) = s.feed(b"    de.\n");
        assert_eq!(out.len(), 60 + 2 + 4 + 8);
        let (out, _) = s.feed(format!("{line}\r").as_bytes());
        assert_eq!(out, b"");
        let (out, _) = s.feed(b"zz");
        assert_eq!(out.len(), 61);
    }

    #[test]
    fn short_values_have_no_base64_forms_that_match_by_chance() {
        assert_eq!(patterns_of(b"abcdefgh").len(), 1);
        let f = EchoForms::new(["abcdefgh"]).unwrap().unwrap();
        let mut text = b"YWJjZGVm ordinary base64 QUJD".to_vec();
        assert_eq!(f.mask(&mut text), 0);
        assert!(EchoForms::new([]).unwrap().is_none());
    }

    /// The largest values the secrets module admits, of the characters with the most forms,
    /// compile, and mask.
    #[test]
    fn the_longest_values_compile() {
        let values: Vec<String> = (0..4)
            .map(|i| format!("{i}{}", "/ \"\\".repeat(crate::secrets::MAX_VALUE_LEN / 4)))
            .map(|v| v[..crate::secrets::MAX_VALUE_LEN].to_string())
            .collect();
        let f = EchoForms::new(values.iter().map(String::as_str))
            .unwrap()
            .unwrap();
        let enc = url(&values[2], "");
        let mut body = format!("x{enc}y").into_bytes();
        assert_eq!(f.mask(&mut body), 1);
        assert!(body[1..body.len() - 1].iter().all(|&b| b == MASK));
    }
}
