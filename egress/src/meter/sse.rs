//! Server-sent events (the WHATWG "event stream" format) split from bytes in any chunking, with
//! every line bounded. A `data:` line too long to keep (a Responses API event that carries the
//! whole response, instructions and output included) is not lost: its JSON streams through a
//! [`KeyScanner`] for the members the meter reads, and the event comes out with those alone.

use super::json_scan::KeyScanner;

/// Longest line kept; a longer `data:` line is scanned for the wanted paths as it passes, any
/// other longer line (and the event it belongs to) is skipped.
pub const MAX_LINE: usize = 256 * 1024;

/// One event: its `event:` name (empty if none) and its `data:` lines joined with `\n`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Event {
    /// The event type.
    pub name: String,
    /// The data.
    pub data: String,
}

/// Splits a byte stream into events.
#[derive(Debug, Default)]
pub struct Splitter {
    line: Vec<u8>,
    skipping_line: bool,
    current: Event,
    has_data: bool,
    broken: bool,
    /// Member paths read from an overlong `data:` line.
    paths: Vec<Vec<&'static str>>,
    /// The overlong `data:` line being scanned.
    scanning: Option<KeyScanner>,
    /// What an overlong `data:` line of the current event held.
    scanned: Option<KeyScanner>,
    /// Events dropped because a line was too long.
    pub skipped: u64,
}

impl Splitter {
    /// A splitter that reads `paths` (member names from the top of the JSON) out of `data:`
    /// lines too long to keep.
    pub fn with_paths(paths: Vec<Vec<&'static str>>) -> Self {
        Splitter {
            paths,
            ..Default::default()
        }
    }

    /// Takes the next bytes and returns the events they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<Event> {
        let mut out = Vec::new();
        for &b in bytes {
            if b == b'\n' {
                if let Some(scan) = self.scanning.take() {
                    self.scanned = Some(scan);
                    self.has_data = true;
                } else if self.skipping_line {
                    self.skipping_line = false;
                    self.broken = true;
                } else {
                    let line = std::mem::take(&mut self.line);
                    let line = line.strip_suffix(b"\r").unwrap_or(&line);
                    if let Some(e) = self.line_done(line) {
                        out.push(e);
                    }
                }
                continue;
            }
            if let Some(scan) = self.scanning.as_mut() {
                scan.feed(&[b]);
                continue;
            }
            if self.skipping_line {
                continue;
            }
            if self.line.len() == MAX_LINE {
                if !self.paths.is_empty() && self.line.starts_with(b"data:") {
                    let mut scan = KeyScanner::paths(self.paths.clone());
                    let rest = &self.line[5..];
                    scan.feed(rest.strip_prefix(b" ").unwrap_or(rest));
                    scan.feed(&[b]);
                    self.scanning = Some(scan);
                } else {
                    self.skipping_line = true;
                }
                self.line.clear();
                continue;
            }
            self.line.push(b);
        }
        out
    }

    fn line_done(&mut self, line: &[u8]) -> Option<Event> {
        if line.is_empty() {
            let mut event = std::mem::take(&mut self.current);
            let (had, broken) = (self.has_data, self.broken);
            self.has_data = false;
            self.broken = false;
            if let Some(mut scan) = self.scanned.take() {
                event.data = rebuild(scan.take());
            } else if broken {
                self.skipped += 1;
                return None;
            }
            return had.then_some(event);
        }
        if line.starts_with(b":") {
            return None; // a comment (keep-alive)
        }
        let text = String::from_utf8_lossy(line);
        let (field, value) = match text.split_once(':') {
            Some((f, v)) => (f.to_string(), v.strip_prefix(' ').unwrap_or(v).to_string()),
            None => (text.to_string(), String::new()),
        };
        match field.as_str() {
            "event" => self.current.name = value,
            "data" => {
                // Past its bound, nothing more of the event is kept, not even the line breaks
                // between its lines (an upstream of many short lines would grow it otherwise).
                let sep = usize::from(self.has_data);
                if self.broken || self.current.data.len() + sep + value.len() > MAX_LINE {
                    self.broken = true;
                } else {
                    if sep == 1 {
                        self.current.data.push('\n');
                    }
                    self.current.data.push_str(&value);
                }
                self.has_data = true;
            }
            _ => {}
        }
        None
    }
}

/// A JSON object of the captured values, each at its path.
fn rebuild(captured: Vec<(String, Vec<u8>)>) -> String {
    use serde_json::{Map, Value};
    fn put(at: &mut Map<String, Value>, names: &[&str], v: Value) {
        match names {
            [] => {}
            [last] => {
                at.insert(last.to_string(), v);
            }
            [first, rest @ ..] => {
                let slot = at
                    .entry(first.to_string())
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Value::Object(m) = slot {
                    put(m, rest, v);
                }
            }
        }
    }
    let mut root = Map::new();
    for (path, raw) in captured {
        if let Ok(v) = serde_json::from_slice::<Value>(&raw) {
            put(&mut root, &path.split('.').collect::<Vec<_>>(), v);
        }
    }
    Value::Object(root).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_in_any_chunking() {
        let stream = b"event: message_start\r\ndata: {\"a\":1}\r\n\r\n: ping\n\nevent: x\ndata: 1\ndata: 2\n\ndata: [DONE]\n\n";
        for chunk in [stream.len(), 5, 1] {
            let mut s = Splitter::default();
            let mut events = Vec::new();
            for c in stream.chunks(chunk) {
                events.extend(s.feed(c));
            }
            assert_eq!(
                events,
                [
                    Event {
                        name: "message_start".into(),
                        data: "{\"a\":1}".into()
                    },
                    Event {
                        name: "x".into(),
                        data: "1\n2".into()
                    },
                    Event {
                        name: String::new(),
                        data: "[DONE]".into()
                    },
                ]
            );
        }
    }

    #[test]
    fn overlong_lines_are_skipped_not_kept() {
        let mut s = Splitter::default();
        let mut big = b"data: ".to_vec();
        big.resize(MAX_LINE + 100, b'x');
        big.extend(b"\n\ndata: ok\n\n");
        let events = s.feed(&big);
        assert_eq!(
            events,
            [Event {
                name: String::new(),
                data: "ok".into()
            }]
        );
        assert_eq!(s.skipped, 1);
        assert!(s.line.capacity() <= MAX_LINE * 2);
    }

    #[test]
    fn an_event_of_many_short_lines_stops_growing_at_its_bound() {
        let mut s = Splitter::default();
        let lines = b"data: xxxxx\n".repeat(MAX_LINE / 6 + 10);
        assert!(s.feed(&lines).is_empty());
        assert!(s.broken, "past MAX_LINE of data");
        let kept = s.current.data.capacity();
        assert!(s.feed(&lines).is_empty());
        assert_eq!(
            s.current.data.capacity(),
            kept,
            "nothing more kept once broken"
        );
        assert!(s.current.data.len() <= MAX_LINE);
        assert_eq!(s.feed(b"\ndata: ok\n\n").len(), 1, "the next event is read");
    }

    #[test]
    fn overlong_data_lines_keep_the_members_asked_for() {
        let mut event = b"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"output\":\"".to_vec();
        event.resize(event.len() + 3 * MAX_LINE, b'y');
        event.extend(b"\",\"usage\":{\"input_tokens\":7}}}\n\ndata: ok\n\n");
        for chunk in [event.len(), 4096, 1] {
            let mut s = Splitter::with_paths(vec![vec!["type"], vec!["response", "usage"]]);
            let mut events = Vec::new();
            for c in event.chunks(chunk) {
                events.extend(s.feed(c));
            }
            assert_eq!(events.len(), 2);
            assert_eq!(events[0].name, "response.completed");
            let v: serde_json::Value = serde_json::from_str(&events[0].data).unwrap();
            assert_eq!(
                v,
                serde_json::json!({"type": "response.completed", "response": {"usage": {"input_tokens": 7}}})
            );
            assert_eq!(events[1].data, "ok");
            assert!(s.line.capacity() <= MAX_LINE * 2);
        }
    }
}
