//! `Identity`: a guest restored from a snapshot that other guests share becomes a machine of its
//! own. Every clone of a template starts with the template's kernel random state and its clock;
//! the host sends fresh bytes and the time, the agent credits the bytes to the kernel's pool,
//! forces the generator to reseed from it (so `/dev/urandom`, `getrandom` and everything built
//! on them differ between clones from the next read on), and sets the realtime clock.

use std::os::fd::AsRawFd;

use sandbox_protocol::Kind;
use sandbox_protocol::message::{self, Identity, code};

use crate::outbox::Outbox;

/// `_IOW('R', 0x03, int[2])`: add bytes to the input pool and credit them.
const RNDADDENTROPY: libc::Ioctl = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the generator from the input pool now.
const RNDRESEEDCRNG: libc::Ioctl = 0x5207;

/// Answers an `Identity` request on `stream` with `Done` or an error.
pub fn handle(out: &Outbox, stream: u32, payload: &[u8]) {
    if stream == 0 {
        out.error(
            0,
            code::BAD_STREAM,
            "stream 0 is the control stream; open requests on a new id",
        );
        return;
    }
    let entropy = match parse(payload) {
        Ok(r) => r,
        Err(e) => {
            out.error(stream, code::BAD_REQUEST, e);
            return;
        }
    };
    // A channel that is gone takes the answer with it; the host learns of that on its own.
    let _ = match apply(&entropy.0, entropy.1) {
        Ok(()) => out.send_json(Kind::Done, stream, &message::Done::default()),
        Err(e) => out.error(stream, code::IO, e),
    };
}

/// The request's bytes and time, checked: 16 to [`Identity::MAX_ENTROPY`] bytes of hex.
fn parse(payload: &[u8]) -> Result<(Vec<u8>, u64), String> {
    let req: Identity =
        serde_json::from_slice(payload).map_err(|e| format!("bad Identity request: {e}"))?;
    let hex = req.entropy_hex.as_bytes();
    if !hex.len().is_multiple_of(2) || hex.len() < 32 || hex.len() > 2 * Identity::MAX_ENTROPY {
        return Err(format!(
            "entropy_hex must be 16 to {} bytes as hex",
            Identity::MAX_ENTROPY
        ));
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let bytes = hex
        .chunks(2)
        .map(|p| Some(nibble(p[0])? << 4 | nibble(p[1])?))
        .collect::<Option<Vec<u8>>>()
        .ok_or("entropy_hex is not hex")?;
    Ok((bytes, req.unix_ns))
}

fn apply(entropy: &[u8], unix_ns: u64) -> Result<(), String> {
    let random = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| format!("opening /dev/urandom: {e}"))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + entropy.len());
    info.extend_from_slice(&((entropy.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(entropy.len() as i32).to_ne_bytes());
    info.extend_from_slice(entropy);
    // The kernel reads the header as ints: keep the buffer's start 4-byte aligned.
    let words: Vec<u32> = info
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_ne_bytes(w)
        })
        .collect();
    // SAFETY: RNDADDENTROPY reads a rand_pool_info of `8 + buf_size` bytes, which `words` holds.
    if unsafe { libc::ioctl(random.as_raw_fd(), RNDADDENTROPY, words.as_ptr()) } != 0 {
        return Err(format!(
            "adding the host's entropy: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(random.as_raw_fd(), RNDRESEEDCRNG) } != 0 {
        return Err(format!(
            "reseeding the random generator: {}",
            std::io::Error::last_os_error()
        ));
    }
    let ts = libc::timespec {
        tv_sec: (unix_ns / 1_000_000_000) as _,
        tv_nsec: (unix_ns % 1_000_000_000) as _,
    };
    // SAFETY: a valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(format!(
            "setting the clock: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_checked_before_anything_is_touched() {
        let ok = br#"{"entropy_hex": "00112233445566778899aabbccddeeff", "unix_ns": 5}"#;
        let (bytes, ns) = parse(ok).unwrap();
        assert_eq!(bytes[..3], [0x00, 0x11, 0x22]);
        assert_eq!((bytes.len(), ns), (16, 5));
        for bad in [
            &br#"{"entropy_hex": "0011", "unix_ns": 5}"#[..],
            br#"{"entropy_hex": "zz112233445566778899aabbccddeeff", "unix_ns": 5}"#,
            br#"{"entropy_hex": "0112233445566778899aabbccddeeff", "unix_ns": 5}"#,
            br#"{"entropy_hex": "00112233445566778899aabbccddeeff"}"#,
            br#"{"entropy_hex": "00112233445566778899aabbccddeeff", "unix_ns": 5, "x": 1}"#,
            b"not json",
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let long = format!(
            r#"{{"entropy_hex": "{}", "unix_ns": 1}}"#,
            "ab".repeat(Identity::MAX_ENTROPY + 1)
        );
        assert!(parse(long.as_bytes()).is_err());
    }
}
