//! Frame encoding and a decoder that survives garbage.
//!
//! A frame is a 20-byte header and a payload of at most [`MAX_PAYLOAD`] bytes:
//!
//! ```text
//! 0..4   magic  "SBX1"
//! 4      kind   (see Kind)
//! 5      flags  (0; reserved)
//! 6..8   reserved, 0
//! 8..12  stream id, u32 little-endian
//! 12..16 payload length, u32 little-endian
//! 16..20 CRC-32 (IEEE) of bytes 0..16 followed by the payload, u32 little-endian
//! ```
//!
//! The checksum is not there against line noise (the transports are reliable) but so that a
//! receiver fed garbage, a truncated frame or a lying length can find the next real frame again:
//! the decoder reports the bad bytes and resumes at the next magic whose frame checks out.

use thiserror::Error;

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 20;

/// Largest payload a frame may carry; a header announcing more is rejected before any allocation.
pub const MAX_PAYLOAD: usize = 1 << 20;

const MAGIC: [u8; 4] = *b"SBX1";

/// One decoded frame. `kind` is kept raw so that an unknown kind can be answered with an error
/// naming it instead of being lost in the decoder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Raw kind byte; see [`crate::Kind`].
    pub kind: u8,
    /// Stream the frame belongs to; 0 is the control stream.
    pub stream: u32,
    /// Payload bytes.
    pub payload: Vec<u8>,
}

/// What was wrong with bytes that did not form a frame. Every variant means the decoder has
/// already skipped past the offending bytes and can be asked for the next frame.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// Bytes that do not start with the frame magic were discarded.
    #[error("{skipped} bytes of garbage before a frame header were discarded")]
    Garbage {
        /// How many bytes were discarded.
        skipped: usize,
    },
    /// A header announced a payload larger than the limit.
    #[error(
        "frame on stream {stream} announces {len} payload bytes, more than the {max}-byte limit"
    )]
    TooLong {
        /// Stream named in the rejected header.
        stream: u32,
        /// Announced length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// Header and payload did not match their checksum (a truncated or corrupted frame).
    #[error("frame on stream {stream} has a bad checksum (truncated or corrupted); skipped")]
    BadChecksum {
        /// Stream named in the rejected header.
        stream: u32,
    },
    /// The reserved header bytes were not zero.
    #[error("frame on stream {stream} has non-zero reserved header bytes")]
    Reserved {
        /// Stream named in the rejected header.
        stream: u32,
    },
}

impl DecodeError {
    /// Stream the bad bytes claimed to belong to, or 0 when nothing could be read.
    pub fn stream(&self) -> u32 {
        match self {
            DecodeError::Garbage { .. } => 0,
            DecodeError::TooLong { stream, .. }
            | DecodeError::BadChecksum { stream }
            | DecodeError::Reserved { stream } => *stream,
        }
    }
}

impl Frame {
    /// A frame of `kind` on `stream`; the caller keeps payloads within [`MAX_PAYLOAD`].
    pub fn new(kind: impl Into<u8>, stream: u32, payload: Vec<u8>) -> Self {
        Frame {
            kind: kind.into(),
            stream,
            payload,
        }
    }

    /// Appends the encoded frame to `out`.
    ///
    /// # Panics
    /// If the payload exceeds [`MAX_PAYLOAD`]: that is a bug in the sender, never input data.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        assert!(
            self.payload.len() <= MAX_PAYLOAD,
            "frame payload over MAX_PAYLOAD"
        );
        let start = out.len();
        out.extend_from_slice(&MAGIC);
        out.push(self.kind);
        out.extend_from_slice(&[0, 0, 0]);
        out.extend_from_slice(&self.stream.to_le_bytes());
        out.extend_from_slice(&(self.payload.len() as u32).to_le_bytes());
        let crc = checksum(&out[start..start + 16], &self.payload);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&self.payload);
    }

    /// The encoded frame as a new buffer.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.payload.len());
        self.encode_into(&mut out);
        out
    }
}

fn checksum(head: &[u8], payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(head);
    h.update(payload);
    h.finalize()
}

/// Incremental decoder: feed it bytes as they arrive, take frames and errors out.
///
/// Its buffer never holds more than one maximal frame plus one read's worth of bytes, whatever
/// the input, because a header is validated (length limit) before its payload is awaited.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: Vec<u8>,
    /// Start of unconsumed bytes in `buf` (consumed bytes are dropped lazily).
    pos: usize,
}

impl Decoder {
    /// An empty decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.pos > 0 && (self.pos >= self.buf.len() / 2 || self.buf.len() > 4 * MAX_PAYLOAD) {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received but not yet consumed as frames or garbage.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The bytes received but not yet consumed, for a reader that goes on from here (the start
    /// of the next frame, or all of it).
    pub fn into_pending(mut self) -> Vec<u8> {
        self.buf.drain(..self.pos);
        self.buf
    }

    /// The next complete frame, an error about bytes just skipped, or `None` when more input is
    /// needed.
    pub fn next_frame(&mut self) -> Option<Result<Frame, DecodeError>> {
        let avail = &self.buf[self.pos..];
        if avail.is_empty() {
            return None;
        }
        if !avail.starts_with(&MAGIC[..avail.len().min(4)]) {
            let skipped = garbage_len(avail);
            self.pos += skipped;
            return Some(Err(DecodeError::Garbage { skipped }));
        }
        if avail.len() < HEADER_LEN {
            return None;
        }
        let stream = u32::from_le_bytes([avail[8], avail[9], avail[10], avail[11]]);
        let len = u32::from_le_bytes([avail[12], avail[13], avail[14], avail[15]]) as usize;
        if avail[5..8] != [0, 0, 0] {
            self.pos += 1;
            return Some(Err(DecodeError::Reserved { stream }));
        }
        if len > MAX_PAYLOAD {
            self.pos += 1;
            return Some(Err(DecodeError::TooLong {
                stream,
                len: len as u64,
                max: MAX_PAYLOAD,
            }));
        }
        if avail.len() < HEADER_LEN + len {
            return None;
        }
        let want = u32::from_le_bytes([avail[16], avail[17], avail[18], avail[19]]);
        let payload = &avail[HEADER_LEN..HEADER_LEN + len];
        if checksum(&avail[..16], payload) != want {
            self.pos += 1;
            return Some(Err(DecodeError::BadChecksum { stream }));
        }
        let frame = Frame {
            kind: avail[4],
            stream,
            payload: payload.to_vec(),
        };
        self.pos += HEADER_LEN + len;
        Some(Ok(frame))
    }
}

/// Length of the prefix of `bytes` that cannot begin a frame: everything before the first full
/// magic, or before a partial magic at the very end (which more input may complete).
fn garbage_len(bytes: &[u8]) -> usize {
    for i in 1..bytes.len() {
        let rest = &bytes[i..];
        if rest.starts_with(&MAGIC[..rest.len().min(4)]) {
            return i;
        }
    }
    bytes.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_all(d: &mut Decoder) -> Vec<Result<Frame, DecodeError>> {
        std::iter::from_fn(|| d.next_frame()).collect()
    }

    #[test]
    fn round_trip_byte_by_byte() {
        let f = Frame::new(7u8, 42, b"hello".to_vec());
        let mut d = Decoder::new();
        let bytes = f.encode();
        for (i, b) in bytes.iter().enumerate() {
            d.push(&[*b]);
            let got = decode_all(&mut d);
            if i + 1 < bytes.len() {
                assert!(got.is_empty(), "frame reported early at byte {i}");
            } else {
                assert_eq!(got, vec![Ok(f.clone())]);
            }
        }
    }

    #[test]
    fn garbage_then_frame() {
        let f = Frame::new(1u8, 0, vec![]);
        let mut d = Decoder::new();
        d.push(b"not a frame at all");
        d.push(&f.encode());
        let got = decode_all(&mut d);
        assert_eq!(got, vec![Err(DecodeError::Garbage { skipped: 18 }), Ok(f)]);
    }

    #[test]
    fn huge_length_is_rejected_without_waiting() {
        let mut bad = Frame::new(2u8, 9, vec![]).encode();
        bad[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        let good = Frame::new(1u8, 0, b"x".to_vec());
        let mut d = Decoder::new();
        d.push(&bad);
        d.push(&good.encode());
        let got = decode_all(&mut d);
        assert!(matches!(
            got[0],
            Err(DecodeError::TooLong {
                stream: 9,
                len: 4294967295,
                ..
            })
        ));
        assert_eq!(got.last(), Some(&Ok(good)));
        assert!(got[1..got.len() - 1].iter().all(|r| r.is_err()));
    }

    #[test]
    fn truncated_frame_followed_by_a_good_one() {
        let long = Frame::new(3u8, 5, vec![b'a'; 100]).encode();
        let good = Frame::new(1u8, 0, b"ping".to_vec());
        let mut d = Decoder::new();
        d.push(&long[..60]);
        let mut good_bytes = good.encode();
        good_bytes.extend_from_slice(&[0u8; 64]); // enough to complete the lying length
        d.push(&good_bytes);
        let got = decode_all(&mut d);
        assert!(matches!(
            got[0],
            Err(DecodeError::BadChecksum { stream: 5 })
        ));
        assert!(got.contains(&Ok(good)), "{got:?}");
    }

    #[test]
    fn partial_magic_at_end_is_kept() {
        let f = Frame::new(1u8, 3, b"z".to_vec()).encode();
        let mut d = Decoder::new();
        d.push(b"xxSB");
        assert_eq!(
            decode_all(&mut d),
            vec![Err(DecodeError::Garbage { skipped: 2 })]
        );
        d.push(&f[2..]);
        assert_eq!(
            decode_all(&mut d),
            vec![Ok(Frame::new(1u8, 3, b"z".to_vec()))]
        );
    }

    #[test]
    fn buffer_stays_bounded_under_garbage() {
        let mut d = Decoder::new();
        for i in 0..10_000u32 {
            d.push(&i.to_le_bytes().repeat(64));
            while d.next_frame().is_some() {}
            assert!(d.pending() <= 3);
        }
    }

    #[test]
    fn reserved_bytes_must_be_zero() {
        let mut bad = Frame::new(1u8, 4, vec![]).encode();
        bad[6] = 1;
        let mut d = Decoder::new();
        d.push(&bad);
        assert_eq!(
            d.next_frame(),
            Some(Err(DecodeError::Reserved { stream: 4 }))
        );
    }
}
