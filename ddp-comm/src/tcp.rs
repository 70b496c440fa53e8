//! TCP socket settings for ring links: `TCP_NODELAY` and kernel buffer sizes. The links
//! themselves are driven by `link.rs` and `cpu.rs`.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;

/// Sets `TCP_NODELAY` and, when `bytes > 0`, the kernel send and receive buffer sizes.
pub(crate) fn tune_socket(stream: &TcpStream, bytes: usize) -> io::Result<()> {
    stream.set_nodelay(true)?;
    if bytes > 0 {
        set_buffer(stream.as_raw_fd(), bytes)?;
    }
    Ok(())
}

/// Sets `SO_SNDBUF` and `SO_RCVBUF` on a socket (a listener passes them to accepted ones).
pub(crate) fn set_buffer(fd: std::os::fd::RawFd, bytes: usize) -> io::Result<()> {
    let value = bytes.min(i32::MAX as usize) as libc::c_int;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: `value` is a valid c_int whose size is passed; `fd` is an open socket.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}
