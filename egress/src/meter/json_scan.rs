//! The values of chosen members of a JSON object (top-level ones, or along a short path such as
//! `response.usage`), captured from bytes in any chunking without holding the document: a body of
//! any size passes through, and only the captured values (each at most [`MAX_VALUE`] bytes) are
//! kept.

/// Largest value captured; a longer one is dropped.
pub const MAX_VALUE: usize = 64 * 1024;
/// Longest key looked at (keys we want are short).
const MAX_KEY: usize = 64;
/// Nesting followed; deeper levels are only counted (nothing we capture lies deeper).
const MAX_TRACK: usize = 8;

/// One open object or array.
#[derive(Debug)]
struct Level {
    object: bool,
    /// The name of the member being read (objects).
    key: Option<String>,
    /// The next string is a member name.
    expect_key: bool,
}

/// Scans one JSON document.
#[derive(Debug)]
pub struct KeyScanner {
    wanted: Vec<Vec<&'static str>>,
    levels: Vec<Level>,
    /// Levels below the tracked ones.
    deep: u64,
    in_string: bool,
    escape: bool,
    /// A member name being read.
    key: Option<Vec<u8>>,
    /// The wanted path being captured, the level its value belongs to, and its bytes.
    capture: Option<(usize, usize, Vec<u8>)>,
    done: Vec<(String, Vec<u8>)>,
    started: bool,
    not_an_object: bool,
}

impl KeyScanner {
    /// A scanner capturing the values of `wanted` top-level keys.
    pub fn new(wanted: &'static [&'static str]) -> Self {
        Self::paths(wanted.iter().map(|k| vec![*k]).collect())
    }

    /// A scanner capturing the values at `wanted` paths of member names (`["response", "usage"]`);
    /// each is reported under its names joined with `.`.
    pub fn paths(wanted: Vec<Vec<&'static str>>) -> Self {
        KeyScanner {
            wanted,
            levels: Vec::new(),
            deep: 0,
            in_string: false,
            escape: false,
            key: None,
            capture: None,
            done: Vec::new(),
            started: false,
            not_an_object: false,
        }
    }

    /// Takes the next bytes of the document.
    pub fn feed(&mut self, bytes: &[u8]) {
        // Checked at every byte: a document that is not an object is not read past the byte
        // that shows it, however the network split it (found by the usage_meter fuzz target).
        for &b in bytes {
            if self.not_an_object {
                return;
            }
            self.byte(b);
        }
    }

    /// The values captured so far (raw JSON text), by path; each path at most once.
    pub fn take(&mut self) -> Vec<(String, Vec<u8>)> {
        std::mem::take(&mut self.done)
    }

    fn depth(&self) -> usize {
        self.levels.len()
    }

    fn byte(&mut self, b: u8) {
        // The capture of a value runs alongside the structural scan.
        if let Some((_, level, v)) = &mut self.capture {
            let ends = !self.in_string
                && self.deep == 0
                && self.levels.len() == *level
                && (b == b',' || b == b'}');
            if !ends {
                if v.len() < MAX_VALUE {
                    v.push(b);
                } else {
                    self.capture = None; // too long: not a usage object
                }
            }
        }
        if self.in_string {
            if self.escape {
                self.escape = false;
            } else if b == b'\\' {
                self.escape = true;
            } else if b == b'"' {
                self.in_string = false;
                if let (Some(k), Some(top)) = (self.key.take(), self.levels.last_mut()) {
                    top.key = String::from_utf8(k).ok();
                }
                return;
            }
            if let Some(k) = &mut self.key {
                if k.len() < MAX_KEY {
                    k.push(b);
                } else {
                    self.key = None;
                }
            }
            return;
        }
        match b {
            b' ' | b'\t' | b'\r' | b'\n' => {}
            b'"' => {
                self.in_string = true;
                if self.deep == 0
                    && let Some(top) = self.levels.last_mut()
                    && top.object
                    && top.expect_key
                {
                    top.expect_key = false;
                    self.key = Some(Vec::new());
                }
            }
            b':' if self.deep == 0 => self.value_starts(),
            b'{' | b'[' => {
                if !self.started {
                    self.started = true;
                    if b != b'{' {
                        self.not_an_object = true;
                        return;
                    }
                }
                if self.deep > 0 || self.depth() == MAX_TRACK {
                    self.deep = self.deep.saturating_add(1);
                } else {
                    self.levels.push(Level {
                        object: b == b'{',
                        key: None,
                        expect_key: b == b'{',
                    });
                }
            }
            b'}' | b']' => {
                if self.deep > 0 {
                    self.deep -= 1;
                    return;
                }
                self.finish_capture();
                self.levels.pop();
            }
            b',' if self.deep == 0 => {
                self.finish_capture();
                if let Some(top) = self.levels.last_mut()
                    && top.object
                {
                    top.expect_key = true;
                    top.key = None;
                }
            }
            _ => {
                if !self.started {
                    self.not_an_object = true;
                }
            }
        }
    }

    /// A member's value begins: capture it if its path is wanted (and not captured yet).
    fn value_starts(&mut self) {
        if self.capture.is_some() {
            return;
        }
        let mut path = Vec::with_capacity(self.levels.len());
        for l in &self.levels {
            match (&l.key, l.object) {
                (Some(k), true) => path.push(k.as_str()),
                _ => return,
            }
        }
        let Some(i) = self.wanted.iter().position(|w| *w == path) else {
            return;
        };
        let name = path.join(".");
        if !self.done.iter().any(|(d, _)| *d == name) {
            self.capture = Some((i, self.levels.len(), Vec::new()));
        }
    }

    fn finish_capture(&mut self) {
        if let Some((i, level, v)) = self.capture.take() {
            if level != self.levels.len() {
                self.capture = Some((i, level, v));
                return;
            }
            self.done.push((self.wanted[i].join("."), v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(doc: &[u8], chunk: usize) -> Vec<(String, String)> {
        let mut s = KeyScanner::new(&["id", "usage", "model"]);
        for c in doc.chunks(chunk) {
            s.feed(c);
        }
        s.take()
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8(v).unwrap().trim().to_string()))
            .collect()
    }

    /// Fuzz finding `usage_meter` crash-e6e837da: a byte before the document's `{` ended the
    /// scan only for the chunks after it, so a body in one piece yielded usage that the same
    /// body in pieces did not.
    #[test]
    fn fuzz_usage_meter_e6e837da_not_an_object_in_any_chunking() {
        let doc = b"\x88\x00{\"id\":\"chatcmpl-1\",\"usage\":{\"prompt_tokens\":2}}";
        for chunk in [doc.len(), 5, 1] {
            assert_eq!(scan(doc, chunk), vec![], "chunks of {chunk}");
        }
    }

    #[test]
    fn captures_top_level_values_only() {
        let doc = br#"{"id":"msg_1","content":[{"type":"text","text":"a \"usage\": {\"x\":1}, }"}],
            "nested":{"usage":{"input_tokens":999}},"model" : "claude-x",
            "usage":{"input_tokens":10,"output_tokens":[1,2,{"k":"}"}]}}"#;
        for chunk in [doc.len(), 3, 1] {
            assert_eq!(
                scan(doc, chunk),
                [
                    ("id".to_string(), r#""msg_1""#.to_string()),
                    ("model".to_string(), r#""claude-x""#.to_string()),
                    (
                        "usage".to_string(),
                        r#"{"input_tokens":10,"output_tokens":[1,2,{"k":"}"}]}"#.to_string()
                    ),
                ]
            );
        }
    }

    #[test]
    fn captures_values_along_paths() {
        let doc = br#"{"type":"response.completed","response":{"id":"resp_1","instructions":"a \"usage\": 1","output":[{"usage":{"x":1}}],"nested":{"usage":2},"usage":{"input_tokens":5}},"usage":{"top":1}}"#;
        for chunk in [doc.len(), 7, 1] {
            let mut s = KeyScanner::paths(vec![
                vec!["type"],
                vec!["response", "usage"],
                vec!["response", "id"],
            ]);
            for c in doc.chunks(chunk) {
                s.feed(c);
            }
            let got: Vec<(String, String)> = s
                .take()
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8(v).unwrap()))
                .collect();
            assert_eq!(
                got,
                [
                    ("type".to_string(), r#""response.completed""#.to_string()),
                    ("response.id".to_string(), r#""resp_1""#.to_string()),
                    (
                        "response.usage".to_string(),
                        r#"{"input_tokens":5}"#.to_string()
                    ),
                ]
            );
        }
        // Nesting past what is tracked is counted, not kept, and the scan comes back out of it.
        let mut deep = br#"{"a":"#.to_vec();
        deep.extend(std::iter::repeat_n(b'[', 1_000_000));
        deep.extend(std::iter::repeat_n(b']', 1_000_000));
        deep.extend(br#","usage":{"k":1}}"#);
        let mut s = KeyScanner::new(&["usage"]);
        s.feed(&deep);
        assert_eq!(s.take(), [("usage".to_string(), br#"{"k":1}"#.to_vec())]);
        assert!(s.levels.capacity() <= 16);
    }

    #[test]
    fn big_bodies_pass_with_bounded_memory() {
        let mut doc = br#"{"content":""#.to_vec();
        doc.resize(10 * 1024 * 1024, b'x');
        doc.extend(br#"","usage":{"cost":0.5},"id":"#);
        let mut big = vec![b'"'];
        big.resize(MAX_VALUE + 10, b'y');
        doc.extend(big);
        doc.extend(br#""}"#);
        let got = scan(&doc, 65536);
        assert_eq!(
            got,
            [("usage".to_string(), r#"{"cost":0.5}"#.to_string())],
            "the oversized id is dropped"
        );
        assert!(scan(b"[1,2,{\"id\":1}]", 1).is_empty(), "not an object");
        assert!(scan(b"garbage", 1).is_empty());
    }
}
