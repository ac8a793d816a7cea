//! The values of chosen top-level keys of a JSON object, captured from bytes in any chunking
//! without holding the document: a response body of any size passes through, and only the
//! captured values (each at most [`MAX_VALUE`] bytes) are kept.

/// Largest value captured; a longer one is dropped.
pub const MAX_VALUE: usize = 64 * 1024;
/// Longest key looked at (keys we want are short).
const MAX_KEY: usize = 64;

/// Scans one JSON document.
#[derive(Debug)]
pub struct KeyScanner {
    wanted: &'static [&'static str],
    depth: u32,
    in_string: bool,
    escape: bool,
    /// At depth 1, the next string is a key.
    expect_key: bool,
    key: Option<Vec<u8>>,
    /// A key was read and its ':' is awaited.
    pending_key: Option<String>,
    capture: Option<(String, Vec<u8>)>,
    done: Vec<(String, Vec<u8>)>,
    not_an_object: bool,
}

impl KeyScanner {
    /// A scanner capturing the values of `wanted` top-level keys.
    pub fn new(wanted: &'static [&'static str]) -> Self {
        KeyScanner {
            wanted,
            depth: 0,
            in_string: false,
            escape: false,
            expect_key: false,
            key: None,
            pending_key: None,
            capture: None,
            done: Vec::new(),
            not_an_object: false,
        }
    }

    /// Takes the next bytes of the document.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.not_an_object {
            return;
        }
        for &b in bytes {
            self.byte(b);
        }
    }

    /// The values captured so far (raw JSON text), by key; each key at most once.
    pub fn take(&mut self) -> Vec<(String, Vec<u8>)> {
        std::mem::take(&mut self.done)
    }

    fn byte(&mut self, b: u8) {
        // The capture of a value runs alongside the structural scan.
        if let Some((_, v)) = &mut self.capture {
            let ends = !self.in_string && self.depth == 1 && (b == b',' || b == b'}');
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
                if let Some(k) = self.key.take() {
                    self.pending_key = String::from_utf8(k).ok();
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
                if self.depth == 1 && self.expect_key {
                    self.key = Some(Vec::new());
                    self.expect_key = false;
                }
            }
            b':' if self.depth == 1 => {
                if let Some(k) = self.pending_key.take()
                    && self.wanted.contains(&k.as_str())
                    && !self.done.iter().any(|(d, _)| *d == k)
                {
                    self.capture = Some((k, Vec::new()));
                }
            }
            b'{' | b'[' => {
                if self.depth == 0 && b != b'{' {
                    self.not_an_object = true;
                }
                self.depth = self.depth.saturating_add(1);
                if self.depth == 1 {
                    self.expect_key = true;
                }
            }
            b'}' | b']' => {
                if self.depth == 1 {
                    self.finish_capture();
                }
                self.depth = self.depth.saturating_sub(1);
            }
            b',' if self.depth == 1 => {
                self.finish_capture();
                self.expect_key = true;
            }
            _ => {
                if self.depth == 0 {
                    self.not_an_object = true;
                }
            }
        }
    }

    fn finish_capture(&mut self) {
        if let Some((k, v)) = self.capture.take() {
            self.done.push((k, v));
        }
        self.pending_key = None;
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
