//! The virtio-vsock packet header (virtio 1.2, section 5.10.6), parsed by hand from its 44
//! little-endian bytes so that no guest byte is ever reinterpreted in place.

/// Size of the header on the wire.
pub const HEADER_LEN: usize = 44;
/// The host's context id.
pub const HOST_CID: u64 = 2;
/// The only socket type we carry.
pub const TYPE_STREAM: u16 = 1;

/// Packet operations.
pub mod op {
    /// Connect.
    pub const REQUEST: u16 = 1;
    /// Accept.
    pub const RESPONSE: u16 = 2;
    /// Refuse or abort.
    pub const RST: u16 = 3;
    /// One or both directions are done.
    pub const SHUTDOWN: u16 = 4;
    /// Data.
    pub const RW: u16 = 5;
    /// Here is my buffer state.
    pub const CREDIT_UPDATE: u16 = 6;
    /// Tell me your buffer state.
    pub const CREDIT_REQUEST: u16 = 7;
}

/// SHUTDOWN flag: the sender will receive no more.
pub const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more.
pub const SHUTDOWN_SEND: u32 = 2;

/// One packet header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    /// Source context id.
    pub src_cid: u64,
    /// Destination context id.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length.
    pub len: u32,
    /// Socket type.
    pub type_: u16,
    /// Operation.
    pub op: u16,
    /// Operation flags.
    pub flags: u32,
    /// The sender's receive buffer size.
    pub buf_alloc: u32,
    /// Bytes the sender has taken out of its receive buffer, ever (wrapping).
    pub fwd_cnt: u32,
}

impl Header {
    /// Decodes the wire form.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Header {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]));
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap_or([0; 2]));
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    /// Encodes the wire form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let h = Header {
            src_cid: 2,
            dst_cid: 3,
            src_port: 1024,
            dst_port: 52,
            len: 7,
            type_: TYPE_STREAM,
            op: op::RW,
            flags: 0,
            buf_alloc: 262_144,
            fwd_cnt: u32::MAX,
        };
        assert_eq!(Header::decode(&h.encode()), h);
        assert_eq!(h.encode()[28], 1);
    }
}
