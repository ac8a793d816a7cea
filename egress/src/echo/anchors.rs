//! Where a form of a secret can be, found without reading every byte through the regex.
//!
//! The regex that knows every form reads about 5 Gbit/s, a sixth of what the stack moves, so it
//! reads only windows around *anchors*, places every occurrence passes through (issue 29's
//! budget: the scan at most 10 % of a flow). Every text form is a run of the value's characters,
//! each raw or escaped (`%XX`, `\u00XX`, `\"`, `\\`, `\/`, `+` for a space). Cut each value into
//! pieces of at least 16 characters: an occurrence either holds one piece raw, or an escape in
//! every piece, so as many escapes as the value has pieces, in one line (no text form holds a
//! line break) and within the longest form. The anchors of text are those pieces and such
//! clusters of escapes, of any character (so which bytes are anchors tells nothing of which
//! characters the values hold; a quoted word on a line of model output is no cluster).
//! Every base64 form is a run of the encoding's characters with line breaks allowed between them
//! (raw with up to `MAX_INDENT` spaces after, or JSON's escaped `\n` and `\r\n`), and a `/` may
//! be JSON's `\/`; so an occurrence either holds a line break between two such characters, inside
//! a run of at least as many of them as the shortest form has, or holds any piece of the unbroken
//! encoding (in some spelling of its `/`).
//! The anchors of base64 are those line breaks and one piece (a *block*) of each alignment. The
//! pieces are found by Teddy (SIMD), the escapes and line breaks by memchr. The window around an
//! anchor reaches as far as the longest form on either side, but not past a byte no form of its
//! kind holds, so it holds every occurrence through the anchor, and the regex over the merged
//! windows finds what it would find over everything. The reach is the longest form of this
//! sandbox's values, as the rescan between chunks is: how long the scan of a body takes can tell
//! how long the longest value is (a key's format tells as much), never which characters it
//! holds. Ordinary text (model output, JSON, source code) has few anchors; a body that is all
//! base64 or all escapes costs what the regex alone costs.

use aho_corasick::{AhoCorasick, MatchKind};

/// The shortest text block, and the longest base64 block: past the three bytes Teddy's
/// fingerprint reads, length makes a false hit rarer, and a guess of one costlier.
const BLOCK: usize = 16;
/// Windows at most this far apart are searched as one.
const MERGE_GAP: usize = 512;
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
    /// One block of each value's raw text, then one of each base64 alignment's unbroken
    /// encoding (from pattern `text_blocks` on).
    blocks: AhoCorasick,
    /// How many of `blocks`' patterns are text blocks.
    text_blocks: usize,
    /// The fewest pieces a value's text is cut into: an occurrence with no piece raw holds at
    /// least this many escapes in one line, within `reach` (a length, never which characters).
    pieces: usize,
    /// Whether every value is printable ASCII, so no text form holds a control or non-ASCII
    /// byte and a text window stops at one (the secrets module admits no other values).
    printable: bool,
    /// The fewest base64 characters a form has: a shorter run cannot hold one.
    min_base64: usize,
    /// How far an occurrence through an anchor may reach on either side: the longest form.
    reach: usize,
}

use super::{MAX_INDENT, is_base64};

/// Whether no text form of a printable value holds `b`.
fn is_control(b: u8) -> bool {
    b.wrapping_sub(0x20) >= 0x5f
}

/// Whether no base64 form holds `b` (its characters, its line breaks raw, indented or escaped,
/// and JSON's `\/`).
fn ends_base64(b: u8) -> bool {
    !(is_base64(b) || matches!(b, b'\r' | b'\n' | b' ' | b'\\'))
}

/// The end of the line break a base64 form may hold that starts at `i`, if one does: `\n` or
/// `\r\n` with up to [`MAX_INDENT`] spaces after it, or JSON's escaped `\n` or `\r\n`.
fn break_from(hay: &[u8], i: usize) -> Option<usize> {
    let at = |k: usize| hay.get(i + k).copied();
    let raw = match (at(0), at(1)) {
        (Some(b'\n'), _) => Some(i + 1),
        (Some(b'\r'), Some(b'\n')) => Some(i + 2),
        _ => None,
    };
    if let Some(mut j) = raw {
        let most = j + MAX_INDENT;
        while j < most && hay.get(j) == Some(&b' ') {
            j += 1;
        }
        return Some(j);
    }
    match (at(0), at(1), at(2), at(3)) {
        (Some(b'\\'), Some(b'n'), _, _) => Some(i + 2),
        (Some(b'\\'), Some(b'r'), Some(b'\\'), Some(b'n')) => Some(i + 4),
        _ => None,
    }
}

/// The start of the line break a base64 form may hold that ends at `i` (see [`break_from`]).
fn break_to(hay: &[u8], i: usize) -> Option<usize> {
    let mut j = i;
    while j > 0 && i - j < MAX_INDENT && hay[j - 1] == b' ' {
        j -= 1;
    }
    // Spaces that no raw line feed comes before: the break, if any, is an escaped one without
    // them (which `break_from` would not have read past them either).
    if j > 0 && hay[j - 1] == b'\n' {
        let start = j - 1;
        return Some(if start > 0 && hay[start - 1] == b'\r' {
            start - 1
        } else {
            start
        });
    }
    if i >= 2 && hay[i - 2] == b'\\' && hay[i - 1] == b'n' {
        return Some(if i >= 4 && hay[i - 4] == b'\\' && hay[i - 3] == b'r' {
            i - 4
        } else {
            i - 2
        });
    }
    None
}

/// The length of the base64 character at `i` (`\/` is two bytes), if one is there.
fn char_from(hay: &[u8], i: usize) -> Option<usize> {
    match hay.get(i) {
        Some(&b) if is_base64(b) => Some(1),
        Some(b'\\') if hay.get(i + 1) == Some(&b'/') => Some(2),
        _ => None,
    }
}

/// The length of the base64 character that ends at `i`, if one does.
fn char_to(hay: &[u8], i: usize) -> Option<usize> {
    match i.checked_sub(1).map(|k| hay[k]) {
        Some(b'/') if i >= 2 && hay[i - 2] == b'\\' => Some(2),
        Some(b) if is_base64(b) => Some(1),
        _ => None,
    }
}

/// The positions of the bytes the windows' pass reads (`%`, `\`, `+` and the line feed), in
/// order: sixteen bytes compared at once (safe SIMD, `wide`), four such masks a block, their set
/// bits taken one by one; so a body whose line breaks come every hundred bytes (model output)
/// costs one pass, not a search started again after each (issue 29's budget).
struct Marks<'h> {
    hay: &'h [u8],
    /// Where the block of `bits` starts, and where the next one does.
    base: usize,
    next: usize,
    bits: u64,
}

impl<'h> Marks<'h> {
    fn new(hay: &'h [u8]) -> Self {
        Marks {
            hay,
            base: 0,
            next: 0,
            bits: 0,
        }
    }

    /// The marks of sixteen bytes, bit `i` for byte `i`.
    #[inline(always)]
    fn lane(lane: [u8; 16]) -> u64 {
        use wide::u8x16;
        let v = u8x16::new(lane);
        let hit = v.cmp_eq(u8x16::splat(b'%'))
            | v.cmp_eq(u8x16::splat(b'\\'))
            | v.cmp_eq(u8x16::splat(b'+'))
            | v.cmp_eq(u8x16::splat(b'\n'));
        u64::from(hit.move_mask() as u16)
    }

    /// The marks of up to 64 bytes, bit `i` for byte `i`.
    #[inline]
    fn block(bytes: &[u8]) -> u64 {
        if let Ok(full) = <&[u8; 64]>::try_from(bytes) {
            let (a, rest) = full.split_at(16);
            let (b, rest) = rest.split_at(16);
            let (c, d) = rest.split_at(16);
            let lane = |x: &[u8]| Self::lane(x.try_into().unwrap_or([0; 16]));
            return lane(a) | lane(b) << 16 | lane(c) << 32 | lane(d) << 48;
        }
        bytes
            .iter()
            .enumerate()
            .filter(|&(_, &b)| matches!(b, b'%' | b'\\' | b'+' | b'\n'))
            .fold(0, |bits, (i, _)| bits | 1 << i)
    }
}

impl Iterator for Marks<'_> {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        while self.bits == 0 {
            if self.next >= self.hay.len() {
                return None;
            }
            let end = self.hay.len().min(self.next + 64);
            self.bits = Self::block(&self.hay[self.next..end]);
            (self.base, self.next) = (self.next, end);
        }
        let i = self.bits.trailing_zeros() as usize;
        self.bits &= self.bits - 1;
        Some(self.base + i)
    }
}

/// The windows of one kind of anchor, in order. A window reaches `reach` bytes either side of
/// its anchor, but not past a byte no form of that kind holds (a text form is printable, a
/// base64 form is base64 characters and line breaks), so binary data and short lines cost
/// little; and each byte is read at most once more than the anchors are, however dense.
struct Windows<'h, F> {
    hay: &'h [u8],
    stops: F,
    reach: usize,
    list: Vec<(usize, usize)>,
    /// Whether the last window ends at a stop (or at the end): an anchor inside it then has
    /// nothing to add.
    closed: bool,
}

impl<'h, F: Fn(u8) -> bool> Windows<'h, F> {
    fn new(hay: &'h [u8], reach: usize, stops: F) -> Self {
        Windows {
            hay,
            stops,
            reach,
            list: Vec::new(),
            closed: false,
        }
    }

    /// Where a window reaching right from `from` towards `to` ends, and whether at a stop.
    fn right(&self, from: usize, to: usize) -> (usize, bool) {
        let to = to.min(self.hay.len());
        let from = from.min(to);
        match self.hay[from..to].iter().position(|&b| (self.stops)(b)) {
            Some(i) => (from + i, true),
            None => (to, to == self.hay.len()),
        }
    }

    /// An anchor at `start..end` (anchors of one kind come in order).
    fn add(&mut self, start: usize, end: usize) {
        if let Some(&(s, e)) = self.list.last()
            && start >= s
            && start < e
        {
            if self.closed || end.saturating_add(self.reach) <= e {
                return;
            }
            // Reach on from where the last window stopped.
            let (to, closed) = self.right(e, end.saturating_add(self.reach));
            if let Some(last) = self.list.last_mut() {
                last.1 = to.max(e);
            }
            self.closed = closed;
            return;
        }
        // Leftwards no further than the last window: what lies between is read once.
        let floor = self.list.last().map_or(0, |l| l.1).min(start);
        let lo = start.saturating_sub(self.reach).max(floor);
        let left = match self.hay[lo..start].iter().rposition(|&b| (self.stops)(b)) {
            Some(i) => lo + i + 1,
            None => lo,
        };
        let (to, closed) = self.right(end, end.saturating_add(self.reach));
        match self.list.last_mut() {
            Some(last) if left <= last.1 => last.1 = last.1.max(to),
            _ => self.list.push((left, to)),
        }
        self.closed = closed;
    }
}

/// The pieces a value's text is cut into, each at least [`BLOCK`] bytes (a guest that wants to
/// learn from a piece's hit must guess all of it at once): an occurrence either holds one of
/// them raw, or an escape (or a `+` for a space) in every one of them.
fn text_blocks(v: &[u8]) -> Vec<&[u8]> {
    let k = (v.len() / BLOCK).max(1);
    let size = v.len().div_ceil(k);
    v.chunks(size).collect()
}

/// Whether the byte at `p` (`%` or `\`) begins an escape a text form may hold: `%XX`,
/// `\u00XX`, `\"`, `\\` or `\/`, of whatever character (so which bytes are anchors does not
/// depend on the characters of the values).
fn escape_at(hay: &[u8], p: usize) -> bool {
    let at = |i: usize| hay.get(p + i).copied().unwrap_or(0);
    match hay[p] {
        b'%' => at(1).is_ascii_hexdigit() && at(2).is_ascii_hexdigit(),
        _ => match at(1) {
            b'"' | b'\\' | b'/' => true,
            b'u' => {
                at(2) == b'0'
                    && at(3) == b'0'
                    && at(4).is_ascii_hexdigit()
                    && at(5).is_ascii_hexdigit()
            }
            _ => false,
        },
    }
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
        let pieces = values
            .iter()
            .map(|v| text_blocks(v).len())
            .min()
            .unwrap_or(1);
        let mut text: Vec<Vec<u8>> = values
            .iter()
            .flat_map(|v| text_blocks(v))
            .map(<[u8]>::to_vec)
            .collect();
        text.sort();
        text.dedup();
        let mut b64: Vec<Vec<u8>> = base64.iter().flat_map(|e| base64_block(e)).collect();
        b64.sort();
        b64.dedup();
        let text_blocks = text.len();
        let blocks = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostFirst)
            .build(text.iter().chain(&b64))?;
        Ok(Anchors {
            blocks,
            text_blocks,
            pieces,
            printable: values.iter().all(|v| !v.iter().any(|&b| is_control(b))),
            min_base64,
            reach,
        })
    }

    /// The fewest pieces a value's text is cut into (see `pieces`).
    #[cfg(test)]
    pub fn pieces(&self) -> usize {
        self.pieces
    }

    /// The windows of `hay` the regex must read, in order and apart: every occurrence of a form
    /// in `hay` lies inside one of them. Which bytes are anchors depends on the values' blocks
    /// alone, never on which characters the values hold (issue 29's review: an escape of any
    /// character is one, so the time a body takes does not tell which the keys have). The work
    /// is in proportion to `hay`, whatever it holds.
    pub fn windows(&self, hay: &[u8]) -> Vec<(usize, usize)> {
        let printable = self.printable;
        let text_stop = move |b: u8| printable && is_control(b);
        let mut escapes = Windows::new(hay, self.reach, text_stop);
        let mut text = Windows::new(hay, self.reach, text_stop);
        let mut base64 = Windows::new(hay, self.reach, ends_base64);
        let mut breaks = Windows::new(hay, self.reach, ends_base64);
        // Every block wherever it starts, overlapping ones too: a base64 block that ends inside
        // a value's text piece must not hide the piece (a window of base64 stops at the first
        // byte no base64 form holds, before the text's occurrence; issue 29's third review).
        // Two blocks that start at one byte are one anchor: either's window, which stops only
        // at bytes neither form holds, covers the other's occurrence.
        let mut from = 0;
        while let Some(m) = self
            .blocks
            .find(aho_corasick::Input::new(hay).span(from..hay.len()))
        {
            if m.pattern().as_usize() < self.text_blocks {
                text.add(m.start(), m.end());
            } else {
                base64.add(m.start(), m.end());
            }
            from = m.start() + 1;
        }
        // Escapes, `+` and line breaks in one pass; an escape is an anchor when its line holds
        // `pieces` of them within `reach` (the ones in `recent`).
        let mut recent: std::collections::VecDeque<usize> = std::collections::VecDeque::new();
        let mut escape = |p: usize, recent: &mut std::collections::VecDeque<usize>| {
            while recent.front().is_some_and(|&q| q + self.reach <= p) {
                recent.pop_front();
            }
            recent.push_back(p);
            if recent.len() >= self.pieces {
                escapes.add(p, p + 1);
                recent.pop_front();
            }
        };
        let mut at = 0;
        for p in Marks::new(hay) {
            if p < at {
                continue; // a line feed of an empty line (below)
            }
            at = p + 1;
            if hay[p] == b'+' {
                escape(p, &mut recent);
            } else if hay[p] == b'\n' {
                recent.clear(); // no text form holds a line break
                let start = if p > 0 && hay[p - 1] == b'\r' {
                    p - 1
                } else {
                    p
                };
                // Only between two base64 characters (most lines end otherwise).
                if start > 0
                    && is_base64(hay[start - 1])
                    && let Some(end) = self.break_at(hay, start)
                {
                    breaks.add(start, end);
                }
                // The line feeds that follow (an event's empty line) lie between no two
                // characters of anything.
                while hay.get(at) == Some(&b'\n') {
                    at += 1;
                }
            } else {
                // A backslash may begin an escaped line break inside base64, and an escape.
                if hay[p] == b'\\'
                    && matches!(hay.get(p + 1), Some(b'n' | b'r'))
                    && let Some(end) = self.break_at(hay, p)
                {
                    breaks.add(p, end);
                }
                if escape_at(hay, p) {
                    escape(p, &mut recent);
                }
            }
        }
        let mut spans: Vec<(usize, usize)> = [escapes.list, text.list, base64.list, breaks.list]
            .into_iter()
            .flatten()
            .collect();
        spans.sort_unstable();
        let mut merged: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
        for (s, e) in spans {
            match merged.last_mut() {
                // Windows a few lines apart are read as one: a regex search has a cost of its
                // own, which many small windows (an escape on every line) would pay each.
                Some(last) if s <= last.1 + MERGE_GAP => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        merged
    }

    /// Whether the line break at `start` (see [`break_from`]) lies between two base64 characters
    /// in a run long enough to hold a form: base64 characters with at most one line break between
    /// two of them, as the forms have. At most `min_base64` characters and their breaks are
    /// read. Read backwards, `\n` after a backslash is taken for a break (inside a form a
    /// backslash begins only a break or `\/`), so the count never falls short of a form's.
    #[inline]
    fn break_at(&self, hay: &[u8], start: usize) -> Option<usize> {
        let end = break_from(hay, start)?;
        char_to(hay, start)?;
        char_from(hay, end)?;
        let want = self.min_base64;
        let mut n = 0;
        let mut i = start;
        while n < want {
            if let Some(k) = break_to(hay, i).filter(|&k| k < i && char_to(hay, k).is_some()) {
                i = k;
                continue;
            }
            match char_to(hay, i) {
                Some(len) => {
                    n += 1;
                    i -= len;
                }
                None => break,
            }
        }
        let mut j = end;
        while n < want {
            match char_from(hay, j) {
                Some(len) => {
                    n += 1;
                    j += len;
                }
                None => match break_from(hay, j).filter(|&k| char_from(hay, k).is_some()) {
                    Some(k) => j = k,
                    None => break,
                },
            }
        }
        (n >= want).then_some(end)
    }
}

/// How a base64 character (given in the standard alphabet) may be spelled: `+` is the URL-safe
/// alphabet's `-`, and `/` its `_` or JSON's `\/`.
fn spellings(b: &u8) -> Vec<Vec<u8>> {
    match b {
        b'+' => vec![b"+".to_vec(), b"-".to_vec()],
        b'/' => vec![b"/".to_vec(), b"_".to_vec(), b"\\/".to_vec()],
        &b => vec![vec![b]],
    }
}

/// One block of a base64 encoding's unbroken characters (given in the standard alphabet), in
/// every spelling: the piece of at most [`BLOCK`] characters with the fewest spellings, shortened
/// until it has at most [`MAX_VARIANTS`].
fn base64_block(exact: &[u8]) -> Vec<Vec<u8>> {
    let count = |block: &[u8]| {
        block
            .iter()
            .fold(1usize, |n, b| n.saturating_mul(spellings(b).len()))
    };
    let mut len = BLOCK.min(exact.len());
    loop {
        let best = (0..=exact.len() - len)
            .min_by_key(|&s| count(&exact[s..s + len]))
            .unwrap_or(0);
        let block = &exact[best..best + len];
        if count(block) <= MAX_VARIANTS || len == 1 {
            let mut out = vec![Vec::with_capacity(len + 2)];
            for b in block {
                out = out
                    .iter()
                    .flat_map(|v| {
                        spellings(b).into_iter().map(move |s| {
                            let mut w = v.clone();
                            w.extend_from_slice(&s);
                            w
                        })
                    })
                    .collect();
            }
            return out;
        }
        len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::Marks;

    /// The SIMD pass finds what a byte-by-byte one finds, at every length and offset (blocks,
    /// lanes and tails).
    #[test]
    fn marks_are_every_mark_in_order() {
        let mut x: u32 = 0x9e37_79b9;
        let pool = b"%\\+\nab \x00\xff\r";
        for len in (0..200).chain([1000, 4096 + 7]) {
            let hay: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    pool[x as usize % pool.len()]
                })
                .collect();
            let want: Vec<usize> = hay
                .iter()
                .enumerate()
                .filter(|&(_, b)| matches!(b, b'%' | b'\\' | b'+' | b'\n'))
                .map(|(i, _)| i)
                .collect();
            assert_eq!(Marks::new(&hay).collect::<Vec<_>>(), want, "length {len}");
        }
    }
}
