//! Descriptors passed with a message (`SCM_RIGHTS`).

/// Sends `bytes` on a Unix socket with `fds` attached (`SCM_RIGHTS`) and returns how many bytes
/// went: the descriptors travel with the first of them, and the caller writes the rest. Both
/// VM processes take descriptors this way: `sandbox-vm` on its control socket, QEMU on its
/// monitor (`add-fd`).
pub fn send_with_fds(
    sock: std::os::fd::RawFd,
    bytes: &[u8],
    fds: &[std::os::fd::RawFd],
) -> std::io::Result<usize> {
    let fds_len = std::mem::size_of_val(fds) as u32;
    // SAFETY: sendmsg with an iovec over `bytes` and a control buffer sized by CMSG_SPACE for
    // the descriptors, both living across the call.
    unsafe {
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: bytes.len(),
        };
        let space = libc::CMSG_SPACE(fds_len) as usize;
        let mut control = vec![0u8; space];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fds_len) as _;
        for (i, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(
                libc::CMSG_DATA(cmsg).cast::<std::os::fd::RawFd>().add(i),
                *fd,
            );
        }
        // No SIGPIPE from a peer that is gone (Linux's flag; macOS has none, and Rust's runtime
        // ignores the signal there).
        #[cfg(target_os = "linux")]
        let flags = libc::MSG_NOSIGNAL;
        #[cfg(not(target_os = "linux"))]
        let flags = 0;
        loop {
            let n = libc::sendmsg(sock, &raw const msg, flags);
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}
