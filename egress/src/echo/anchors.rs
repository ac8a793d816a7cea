//! Where a form of a secret can be, found without reading every byte through the regex.
//!
//! The regex that knows every form reads about 5 Gbit/s, a sixth of what the stack moves, so it
//! reads only windows around *anchors*, places every occurrence passes through (issue 29's
//! budget: the scan at most 10 % of a flow). Every text form is a run of the value's characters,
//! each raw or escaped; so an occurrence either holds an escape of one of them (`%XX`, `\u00XX`,
//! `\"`, `\\`, `\/`, or `+` for a space), or is the value itself, raw, and holds any piece of it.
//! Every base64 form is a run of the encoding's characters with line breaks allowed between them;
//! so an occurrence either holds a line break between two such characters, inside a run of at
//! least as many of them as the shortest form has, or holds any piece of the unbroken encoding.
//! The anchors are those escapes, those line breaks, and one piece (a *block*) of each form,
//! found by Teddy (SIMD) and memchr; the window around an anchor reaches as far as the longest
//! form on either side, so it holds every occurrence through the anchor, and the regex over the
//! merged windows finds what it would find over everything. Ordinary text (model output, JSON,
//! source code) has few anchors; a body that is all base64 or all escapes costs what the regex
//! alone costs.

use aho_corasick::{AhoCorasick, MatchKind};

/// The longest block looked for: past the three bytes Teddy's fingerprint reads, length only
/// makes a false hit rarer.
const BLOCK: usize = 16;
/// The most variants of a base64 block (each character that is `+` or `/` in one alphabet is `-`
/// or `_` in the other): a block is shortened until it has at most this many.
const MAX_VARIANTS: usize = 16;

/// Why the anchors of a sandbox's forms could not be built.
#[derive(Debug, thiserror::Error)]
pub enum AnchorError {
    /// The literal searcher refused its blocks (their number is bounded; not expected).
    #[error("building the response scan's literal search: {0}")]
    Blocks(#[from] aho_corasick::BuildError),
}

/// The anchors of a set of forms (see the module's documentation).
#[derive(Debug)]
pub struct Anchors {
    /// One block of each value's raw text and one of each base64 alignment's unbroken encoding.
    blocks: AhoCorasick,
    /// The bytes a value holds: an escape of any other byte begins no form.
    chars: [bool; 128],
    /// Whether `+` begins a form (form encoding's space: some value holds a space).
    plus: bool,
    /// The fewest base64 characters a form has: a shorter run cannot hold one.
    min_base64: usize,
    /// How far an occurrence through an anchor may reach on either side: the longest form.
    reach: usize,
}

/// Whether `b` is a character of base64, in either alphabet.
fn is_base64(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'-' | b'_')
}

/// The value of a hex digit.
fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

impl Anchors {
    /// The anchors of `values`' text forms and of the base64 encodings `base64` gives (for each,
    /// the characters that carry only the value's bits, in the standard alphabet), whose shortest
    /// has `min_base64` such characters; no form is longer than `reach`.
    pub fn new(
        values: &[&[u8]],
        base64: &[Vec<u8>],
        min_base64: usize,
        reach: usize,
    ) -> Result<Anchors, AnchorError> {
        let mut chars = [false; 128];
        let mut blocks: Vec<Vec<u8>> = Vec::new();
        for v in values {
            for &b in *v {
                if let Some(c) = chars.get_mut(usize::from(b)) {
                    *c = true;
                }
            }
            // The value's end: keys share their prefixes (`sk-ant-api03-`), their ends are random.
            blocks.push(v[v.len().saturating_sub(BLOCK)..].to_vec());
        }
        for exact in base64 {
            blocks.extend(base64_block(exact));
        }
        blocks.sort();
        blocks.dedup();
        let blocks = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostFirst)
            .build(&blocks)?;
        Ok(Anchors {
            blocks,
            plus: chars[usize::from(b' ')],
            chars,
            min_base64,
            reach,
        })
    }

    /// The windows of `hay` the regex must read, in order and apart: every occurrence of a form
    /// in `hay` lies inside one of them. The work is in proportion to `hay`, whatever it holds.
    pub fn windows(&self, hay: &[u8]) -> Vec<(usize, usize)> {
        let mut spans: Vec<(usize, usize)> = Vec::new();
        let window = |start: usize, end: usize| {
            (
                start.saturating_sub(self.reach),
                end.saturating_add(self.reach).min(hay.len()),
            )
        };
        // Whether the window of an anchor at `p` lies in the last span already: nothing more to
        // learn from it (and no byte read twice for it).
        let covered = |spans: &[(usize, usize)], p: usize| {
            let (s, e) = window(p, p + 1);
            spans.last().is_some_and(|last| s >= last.0 && e <= last.1)
        };
        let add = |spans: &mut Vec<(usize, usize)>, start: usize, end: usize| {
            let (start, end) = window(start, end);
            match spans.last_mut() {
                // Anchors of one kind come in order: merge as they come, so a dense body keeps
                // one span, not one per anchor.
                Some(last) if start <= last.1 && start >= last.0 => last.1 = last.1.max(end),
                _ => spans.push((start, end)),
            }
        };
        for m in self.blocks.find_iter(hay) {
            add(&mut spans, m.start(), m.end());
        }
        // Escapes and line breaks in one pass; `+` in another only where a value holds a space.
        for p in memchr::memchr3_iter(b'%', b'\\', b'\n', hay) {
            if covered(&spans, p) {
                continue;
            }
            let anchor = match hay[p] {
                b'\n' => self.break_at(hay, p),
                _ => self.escape_at(hay, p),
            };
            if anchor {
                add(&mut spans, p, p + 1);
            }
        }
        if self.plus {
            for p in memchr::memchr_iter(b'+', hay) {
                if !covered(&spans, p) {
                    add(&mut spans, p, p + 1);
                }
            }
        }
        spans.sort_unstable();
        let mut merged: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
        for (s, e) in spans {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        merged
    }

    /// Whether the byte at `p` (`%` or `\`) begins an escape of a value's character.
    #[inline]
    fn escape_at(&self, hay: &[u8], p: usize) -> bool {
        let at = |i: usize| hay.get(p + i).copied();
        let escaped = match hay[p] {
            b'%' => match (at(1).and_then(hex), at(2).and_then(hex)) {
                (Some(h), Some(l)) => h << 4 | l,
                _ => return false,
            },
            _ => match at(1) {
                Some(c @ (b'"' | b'\\' | b'/')) => c,
                Some(b'u') if at(2) == Some(b'0') && at(3) == Some(b'0') => {
                    match (at(4).and_then(hex), at(5).and_then(hex)) {
                        (Some(h), Some(l)) => h << 4 | l,
                        _ => return false,
                    }
                }
                _ => return false,
            },
        };
        self.chars
            .get(usize::from(escaped))
            .copied()
            .unwrap_or(false)
    }

    /// Whether the line feed at `p` (with the carriage return before it, if any) lies between
    /// two base64 characters in a run long enough to hold a form: base64 characters with at
    /// most one line break (`\n` or `\r\n`) between two of them, as the forms have. At most
    /// `min_base64` characters and their breaks are read.
    #[inline]
    fn break_at(&self, hay: &[u8], p: usize) -> bool {
        let start = if p > 0 && hay[p - 1] == b'\r' {
            p - 1
        } else {
            p
        };
        if start == 0
            || !is_base64(hay[start - 1])
            || !hay.get(p + 1).is_some_and(|&b| is_base64(b))
        {
            return false;
        }
        let want = self.min_base64;
        let mut n = 0;
        let mut i = start;
        loop {
            while i > 0 && n < want && is_base64(hay[i - 1]) {
                n += 1;
                i -= 1;
            }
            if n >= want || i == 0 || hay[i - 1] != b'\n' {
                break;
            }
            let mut k = i - 1;
            if k > 0 && hay[k - 1] == b'\r' {
                k -= 1;
            }
            if k == 0 || !is_base64(hay[k - 1]) {
                break;
            }
            i = k;
        }
        let mut j = p + 1;
        loop {
            while j < hay.len() && n < want && is_base64(hay[j]) {
                n += 1;
                j += 1;
            }
            if n >= want || j >= hay.len() {
                break;
            }
            let k = match hay[j] {
                b'\n' => j + 1,
                b'\r' if hay.get(j + 1) == Some(&b'\n') => j + 2,
                _ => break,
            };
            if !hay.get(k).is_some_and(|&b| is_base64(b)) {
                break;
            }
            j = k;
        }
        n >= want
    }
}

/// One block of a base64 encoding's unbroken characters (given in the standard alphabet), in
/// every alphabet's spelling: the piece of at most [`BLOCK`] characters with the fewest
/// characters that the two alphabets spell differently, shortened until it has at most
/// [`MAX_VARIANTS`] spellings.
fn base64_block(exact: &[u8]) -> Vec<Vec<u8>> {
    let differs = |b: &u8| matches!(b, b'+' | b'/');
    let mut len = BLOCK.min(exact.len());
    loop {
        let best = (0..=exact.len() - len)
            .min_by_key(|&s| exact[s..s + len].iter().filter(|b| differs(b)).count())
            .unwrap_or(0);
        let block = &exact[best..best + len];
        let n = block.iter().filter(|b| differs(b)).count();
        if 1usize << n.min(usize::BITS as usize - 1) <= MAX_VARIANTS || len == 1 {
            let mut out = vec![Vec::with_capacity(len)];
            for &b in block {
                let other = match b {
                    b'+' => Some(b'-'),
                    b'/' => Some(b'_'),
                    _ => None,
                };
                if let Some(o) = other {
                    let mut alt = out.clone();
                    alt.iter_mut().for_each(|v| v.push(o));
                    out.iter_mut().for_each(|v| v.push(b));
                    out.extend(alt);
                } else {
                    out.iter_mut().for_each(|v| v.push(b));
                }
            }
            return out;
        }
        len -= 1;
    }
}
