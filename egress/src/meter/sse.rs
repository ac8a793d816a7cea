//! Server-sent events (the WHATWG "event stream" format) split from bytes in any chunking, with
//! every line bounded.

/// Longest line kept; a longer one (and the event it belongs to) is skipped.
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
    /// Events dropped because a line was too long.
    pub skipped: u64,
}

impl Splitter {
    /// Takes the next bytes and returns the events they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<Event> {
        let mut out = Vec::new();
        for &b in bytes {
            if b == b'\n' {
                if self.skipping_line {
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
            if self.skipping_line {
                continue;
            }
            if self.line.len() == MAX_LINE {
                self.line.clear();
                self.skipping_line = true;
                continue;
            }
            self.line.push(b);
        }
        out
    }

    fn line_done(&mut self, line: &[u8]) -> Option<Event> {
        if line.is_empty() {
            let event = std::mem::take(&mut self.current);
            let (had, broken) = (self.has_data, self.broken);
            self.has_data = false;
            self.broken = false;
            if broken {
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
                if self.has_data {
                    self.current.data.push('\n');
                }
                if self.current.data.len() + value.len() > MAX_LINE {
                    self.broken = true;
                } else {
                    self.current.data.push_str(&value);
                }
                self.has_data = true;
            }
            _ => {}
        }
        None
    }
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
}
