//! A guest's TCP port, reached from the host over the agent's channel (issue 35): the bytes of
//! one connection to `127.0.0.1:<port>` in the guest, both ways, under the stream's windows.
//! Nothing of it passes through the guest's network device or the host's egress: the host
//! speaks HTTP over this stream to a dev server the agent's run started.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

use sandbox_protocol::message::{PortRequest, code};

use crate::streams::StreamCtx;
use crate::transfer::Download;

/// How long a connection to the guest's port may take (on the loopback: refused or accepted at
/// once, unless the listener's backlog is full).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Relays one connection: the host's `Data` to the port, the port's bytes back as `Output`
/// until the port closes its side (then an empty `Output`). The host closing its side (an
/// empty `Data`) shuts the port's write side, as a TCP half-close would; cancelling the stream
/// closes the connection.
pub fn relay(mut ctx: StreamCtx, req: PortRequest) {
    if req.port == 0 {
        return ctx.fail(code::BAD_REQUEST, "port 0 is not a port to connect to");
    }
    let addr = SocketAddr::from(([127, 0, 0, 1], req.port));
    let sock = match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
        Ok(s) => s,
        Err(e) => {
            return ctx.fail(
                code::REFUSED,
                format!(
                    "nothing accepts connections on port {} in the guest ({e})",
                    req.port
                ),
            );
        }
    };
    let _ = sock.set_nodelay(true);
    let Some(mut upload) = ctx.take_upload() else {
        return ctx.fail(code::BAD_STREAM, "a port stream has no upload");
    };
    let (mut to_port, mut from_port) = match (sock.try_clone(), sock.try_clone()) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return ctx.fail(code::IO, format!("the connection: {e}")),
    };
    // The host's bytes to the port; its end (or a cancel) shuts the port's write side.
    let up = std::thread::Builder::new()
        .name(format!("port-{}-up", ctx.id))
        .spawn(move || {
            let mut buf = vec![0u8; sandbox_protocol::DATA_CHUNK];
            loop {
                match upload.read(&mut buf) {
                    Ok(0) => break,
                    // Cancelled (or the host went away): the connection goes at once, which also
                    // ends the read below, however long the port would stay silent.
                    Err(_) => {
                        let _ = to_port.shutdown(Shutdown::Both);
                        return;
                    }
                    Ok(n) => {
                        if to_port.write_all(&buf[..n]).is_err() {
                            // The port stopped reading: the rest is dropped, so the host never
                            // waits for window that will not come.
                            let _ = upload.drain();
                            break;
                        }
                    }
                }
            }
            let _ = to_port.shutdown(Shutdown::Write);
        });
    if let Err(e) = up {
        return ctx.fail(code::BUSY, format!("cannot start a worker thread: {e}"));
    }
    let mut dl = Download::new(
        ctx.out.clone(),
        ctx.id,
        sandbox_protocol::Kind::Output,
        ctx.credit.clone(),
    );
    let mut buf = vec![0u8; sandbox_protocol::DATA_CHUNK];
    loop {
        match from_port.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if dl.send_now(&buf[..n]).is_err() {
                    // Cancelled or abandoned: the connection goes.
                    let _ = sock.shutdown(Shutdown::Both);
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = dl.finish();
    let _ = sock.shutdown(Shutdown::Both);
}
