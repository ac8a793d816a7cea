//! Frame kinds. Values below 0x80 are sent by the host, values from 0x80 by the agent, except
//! [`Kind::Window`] and [`Kind::Error`], which both sides send.

/// What a frame means. JSON payloads are described in [`crate::message`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Host → agent, any stream: answer with `Ready`. Payload empty.
    Ping = 0x01,
    /// Host → agent, new stream: start a process. Payload: `ExecRequest` JSON.
    Exec = 0x02,
    /// Host → agent: bytes for the process's stdin; an empty payload closes stdin.
    Stdin = 0x03,
    /// Host → agent: send a signal to the process group. Payload: `SignalRequest` JSON.
    Signal = 0x04,
    /// Either way: grant the peer this many more bytes of data on the stream. Payload: u32 LE.
    Window = 0x05,
    /// Host → agent, new stream: unpack the tar (or tar.gz) stream that follows into a directory.
    /// Payload: `PathRequest` JSON.
    ArchivePut = 0x06,
    /// Host → agent, new stream: send a directory as a tar stream. Payload: `PathRequest` JSON.
    ArchiveGet = 0x07,
    /// Host → agent, new stream: write the bytes that follow to a file. Payload: `FilePut` JSON.
    FilePut = 0x08,
    /// Host → agent, new stream: send a file's bytes. Payload: `PathRequest` JSON.
    FileGet = 0x09,
    /// Host → agent: upload bytes for a put; an empty payload ends the upload.
    Data = 0x0a,
    /// Host → agent: sync filesystems and power off. Payload empty.
    Shutdown = 0x0b,
    /// Host → agent: the host has given up on the stream; stop its work (kill its processes).
    Cancel = 0x0c,
    /// Host → agent, new stream: this guest was restored from a snapshot that other guests
    /// share; make it a machine of its own (reseed the kernel's random generator with the
    /// host's bytes, set the clock). Payload: `Identity` JSON; answered with `Done`.
    Identity = 0x0d,
    /// Host → agent, new stream: send the file events of a directory as NDJSON lines until the
    /// host cancels the stream. Payload: `WatchRequest` JSON.
    Watch = 0x0e,
    /// Host → agent: the terminal of an exec started with a `pty` has a new size (its
    /// foreground process group gets SIGWINCH). Payload: `TermSize` JSON.
    Resize = 0x0f,
    /// Host → agent, new stream: connect to a TCP port on the guest's loopback and relay the
    /// connection: the host's `Data` to it, its bytes back as `Output` (empty when it closed
    /// its side). Payload: `PortRequest` JSON.
    PortOpen = 0x10,
    /// Agent → host: the agent is up. Payload: `Ready` JSON. Sent unsolicited on stream 0 at
    /// start, and in answer to `Ping`.
    Ready = 0x81,
    /// Agent → host: process stdout bytes.
    Stdout = 0x82,
    /// Agent → host: process stderr bytes.
    Stderr = 0x83,
    /// Agent → host: the process ended and its output is complete. Payload: `ExitStatus` JSON.
    Exit = 0x84,
    /// Agent → host: download bytes for a get; an empty payload ends the download.
    Output = 0x85,
    /// Agent → host: a put finished. Payload: `Done` JSON.
    Done = 0x86,
    /// Either way: the stream (or, on stream 0, the channel) failed. Payload: `ErrorMessage` JSON.
    /// It ends the stream it names.
    Error = 0x87,
}

impl Kind {
    /// The kind for a raw byte, if it is one.
    pub fn from_u8(b: u8) -> Option<Kind> {
        use Kind::*;
        Some(match b {
            0x01 => Ping,
            0x02 => Exec,
            0x03 => Stdin,
            0x04 => Signal,
            0x05 => Window,
            0x06 => ArchivePut,
            0x07 => ArchiveGet,
            0x08 => FilePut,
            0x09 => FileGet,
            0x0a => Data,
            0x0b => Shutdown,
            0x0c => Cancel,
            0x0d => Identity,
            0x0e => Watch,
            0x0f => Resize,
            0x10 => PortOpen,
            0x81 => Ready,
            0x82 => Stdout,
            0x83 => Stderr,
            0x84 => Exit,
            0x85 => Output,
            0x86 => Done,
            0x87 => Error,
            _ => return None,
        })
    }
}

impl From<Kind> for u8 {
    fn from(k: Kind) -> u8 {
        k as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips_and_nothing_else_parses() {
        let mut known = 0;
        for b in 0..=255u8 {
            if let Some(k) = Kind::from_u8(b) {
                assert_eq!(u8::from(k), b);
                known += 1;
            }
        }
        assert_eq!(known, 23);
    }
}
