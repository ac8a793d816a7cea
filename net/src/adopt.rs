//! Adoption: a service that went away (a crash, an upgrade) and came back takes over a network
//! process that ran on without it.
//!
//! The service may pass the process a listening Unix socket
//! ([`ADOPT_FD`](sandbox_control::net::ADOPT_FD)). When the channel ends, the process keeps the
//! guest's network (the stack and the frames run on the runtime; connections already made go on)
//! and waits there ([`wait`]). Whoever can reach the socket's path may connect, so each
//! connection is read as hostile until it has adopted the process: its first line must come
//! within [`ADOPT_WITHIN`], be at most [`MAX_ADOPT_LINE`] bytes, and be [`Request::Adopt`] with
//! the new dialer's socket attached. Anything else closes that connection, unanswered, and the
//! process waits for the next: nothing a connection says ends the process.

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use sandbox_control::line::{Reader, send};
use sandbox_control::net::{ADOPT_WITHIN, Event, MAX_ADOPT_LINE, Request};

use crate::dial::Dialer;

/// The pause after an accept that failed for a passing reason (out of descriptors or memory): a
/// failure that lasts costs a few calls a second, never a spinning thread.
const RETRY: Duration = Duration::from_millis(100);

/// Why the process can no longer wait for its service (it then ends: nothing could adopt it).
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    /// The socket cannot accept (it does not listen, or the filter refuses the call).
    #[error("accepting on the adoption socket: {0}")]
    Accept(io::Error),
}

/// Why one connection was closed without adopting the process.
#[derive(Debug, thiserror::Error)]
pub enum Dropped {
    /// Its first line did not come whole in time, was too long, or did not parse.
    #[error("its first line: {0}")]
    Read(io::Error),
    /// It closed before a line.
    #[error("it closed before it asked anything")]
    Closed,
    /// Its first message is another request (never printed: it may be settings, with secrets).
    #[error("its first message is not an adoption")]
    NotAdopt,
    /// The adoption came without the dialer's socket.
    #[error("its adoption came without the dialer's socket")]
    NoDialer,
    /// The process could not take it (its socket, the dialer's thread).
    #[error("taking it: {0}")]
    Take(io::Error),
}

/// Waits on `listener` until a connection adopts the process: returns that connection (the
/// channel from now on) once `dialer` makes its dials over the socket the adoption brought and
/// the answer, with `token`, has gone. Each connection dropped on the way is told to `log`.
pub fn wait(
    listener: &UnixListener,
    dialer: &Dialer,
    token: &str,
    mut log: impl FnMut(Dropped),
) -> Result<UnixStream, AdoptError> {
    loop {
        let conn = match listener.accept() {
            Ok((conn, _)) => conn,
            Err(e) if lasting(&e) => return Err(AdoptError::Accept(e)),
            Err(_) => {
                std::thread::sleep(RETRY);
                continue;
            }
        };
        match adopt(&conn, dialer, token) {
            Ok(()) => return Ok(conn),
            Err(e) => log(e),
        }
    }
}

/// Whether an accept's error will come again on every call: the socket does not listen, or the
/// filter refuses the call. Any other (a connection aborted before it was accepted, descriptors
/// or memory run out) passes.
fn lasting(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::InvalidInput | io::ErrorKind::PermissionDenied | io::ErrorKind::Unsupported
    )
}

/// Reads the first line of `conn`; if it is an adoption with its socket, attaches that socket to
/// `dialer` and answers with `token`.
fn adopt(conn: &UnixStream, dialer: &Dialer, token: &str) -> Result<(), Dropped> {
    let mut first = Reader::with_limit(conn, MAX_ADOPT_LINE).within(ADOPT_WITHIN);
    match first.read::<Request>() {
        Ok(Some(Request::Adopt)) => {}
        Ok(Some(_)) => return Err(Dropped::NotAdopt),
        Ok(None) => return Err(Dropped::Closed),
        Err(e) => return Err(Dropped::Read(e)),
    }
    let sock = first.take_fd().ok_or(Dropped::NoDialer)?;
    // The first line's bound set a receive timeout on the socket: the channel waits for the
    // service's requests without one, as it did on descriptor 0. (The service sends nothing more
    // before it has the answer, so nothing of the channel is left in `first`'s buffer.)
    conn.set_read_timeout(None).map_err(Dropped::Take)?;
    dialer
        .attach(UnixStream::from(sock))
        .map_err(Dropped::Take)?;
    let adopted = Event::Adopted {
        version: sandbox_control::net::VERSION,
        token: token.to_string(),
    };
    if let Err(e) = send(conn, &adopted, None) {
        // Not adopted after all: its dialer is not kept either.
        dialer.detach();
        return Err(Dropped::Take(e));
    }
    Ok(())
}
