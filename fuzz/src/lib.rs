//! What the fuzz targets share: cutting one input into the chunks a stream delivers it in, so
//! a target can check that a reader's answer does not depend on where the network split it.

/// Splits `data` into a chunk plan and the payload: the first byte (if any) seeds the chunk
/// sizes (1 to 64 bytes, or everything at once for seed 0), the rest is the payload.
pub fn split(data: &[u8]) -> (Vec<&[u8]>, &[u8]) {
    let Some((&seed, payload)) = data.split_first() else {
        return (vec![], data);
    };
    if seed == 0 {
        return (vec![payload], payload);
    }
    let mut chunks = vec![];
    let mut rest = payload;
    let mut state = u32::from(seed);
    while !rest.is_empty() {
        // A small linear congruential sequence: deterministic for one input, varied across.
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let n = ((state >> 16) as usize % 64 + 1).min(rest.len());
        let (head, tail) = rest.split_at(n);
        chunks.push(head);
        rest = tail;
    }
    (chunks, payload)
}

/// A fresh scratch directory for one input, named `<name>-<pid>-…` on tmpfs where there is one
/// (/dev/shm: creating and removing thousands of inodes a second on ext4 costs more than the
/// code under test). The first call also removes what runs that died left (a crash aborts before
/// the directory's drop): directories of this name whose process is gone.
pub fn scratch_dir(name: &str) -> tempfile::TempDir {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    SWEPT.call_once(|| {
        let Ok(entries) = std::fs::read_dir(&base) else {
            return;
        };
        for e in entries.flatten() {
            let file = e.file_name().to_string_lossy().into_owned();
            let pid = file
                .strip_prefix(name)
                .and_then(|r| r.strip_prefix('-'))
                .and_then(|r| r.split('-').next())
                .and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()) {
                // remove_dir_all removes symlinks, never what they point to.
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    });
    tempfile::Builder::new()
        .prefix(&format!("{name}-{}-", std::process::id()))
        .tempdir_in(&base)
        .unwrap()
}

/// The input, read field by field; a field past its end reads as `None` (or a shorter slice),
/// so every input is a whole session.
pub struct Input<'a>(pub &'a [u8]);

impl Input<'_> {
    pub fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    /// Network order, for the fields of frames.
    pub fn u16_be(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes([self.byte()?, self.byte()?]))
    }
    /// Little-endian, for virtio's registers and rings.
    pub fn u16_le(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes([self.byte()?, self.byte()?]))
    }
    pub fn u32_le(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes([
            self.byte()?,
            self.byte()?,
            self.byte()?,
            self.byte()?,
        ]))
    }
    pub fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Guest frames with valid checksums, so that they get past the checks to the code behind them.
pub mod frame {
    use std::net::Ipv4Addr;

    fn sum(data: &[u8]) -> u32 {
        data.chunks(2)
            .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
            .sum()
    }

    fn fold(mut s: u32) -> u16 {
        while s > 0xffff {
            s = (s & 0xffff) + (s >> 16);
        }
        !(s as u16)
    }

    /// An Ethernet + IPv4 frame from `(src_mac, src)` to `(dst_mac, dst)` carrying `proto`'s
    /// `l4`, whose checksum field at `csum_at` (if any) is filled in with the pseudo-header.
    pub fn ipv4(
        (src_mac, src): ([u8; 6], Ipv4Addr),
        (dst_mac, dst): ([u8; 6], Ipv4Addr),
        proto: u8,
        mut l4: Vec<u8>,
        csum_at: Option<usize>,
    ) -> Vec<u8> {
        if let Some(at) = csum_at {
            if l4.len() >= at + 2 {
                l4[at..at + 2].copy_from_slice(&[0, 0]);
                let mut pseudo = vec![];
                pseudo.extend_from_slice(&src.octets());
                pseudo.extend_from_slice(&dst.octets());
                pseudo.extend_from_slice(&[0, proto]);
                pseudo.extend_from_slice(&(l4.len() as u16).to_be_bytes());
                let c = fold(sum(&pseudo) + sum(&l4));
                l4[at..at + 2].copy_from_slice(&c.to_be_bytes());
            }
        }
        let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, proto, 0, 0];
        let total = (20 + l4.len()) as u16;
        ip[2..4].copy_from_slice(&total.to_be_bytes());
        ip.extend_from_slice(&src.octets());
        ip.extend_from_slice(&dst.octets());
        let c = fold(sum(&ip));
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        let mut f = dst_mac.to_vec();
        f.extend_from_slice(&src_mac);
        f.extend_from_slice(&[0x08, 0x00]);
        f.extend_from_slice(&ip);
        f.extend_from_slice(&l4);
        f
    }

    /// A DNS query for `qname` (wire form) of `qtype`, as a UDP payload.
    pub fn dns_query(id: u16, qname: &[u8], qtype: u16) -> Vec<u8> {
        let mut q = vec![];
        for v in [id, 0x0100, 1, 0, 0, 0] {
            q.extend_from_slice(&v.to_be_bytes());
        }
        q.extend_from_slice(qname);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&1u16.to_be_bytes());
        q
    }

    /// A UDP datagram (header and payload) from `sport` to `dport`, checksum left for [`ipv4`].
    pub fn udp(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
        let mut u = sport.to_be_bytes().to_vec();
        u.extend_from_slice(&dport.to_be_bytes());
        u.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        u.extend_from_slice(&[0, 0]);
        u.extend_from_slice(payload);
        u
    }

    /// A name in DNS wire form (labels, then the root).
    pub fn qname(name: &str) -> Vec<u8> {
        let mut q = vec![];
        for l in name.trim_end_matches('.').split('.') {
            q.push(l.len() as u8);
            q.extend_from_slice(l.as_bytes());
        }
        q.push(0);
        q
    }
}
