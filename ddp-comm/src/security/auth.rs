//! The mutual challenge–response every connection between ranks starts with: the store's
//! (`store/`), and the ring's TCP and shared-memory links (`ring/connect.rs`).
//!
//! ```text
//! client -> server  hello      magic (4) | version (1) | number (u32 LE) | client nonce (16)
//! server -> client  challenge  server nonce (16) | server proof (32)
//! client -> server  proof      client proof (32)   (shared memory: with the sender's eventfd)
//! server -> client  ack        the connection's own (store: status OK; TCP ring: 1;
//!                              shared memory: 1 with the ring and the receiver's eventfd)
//!
//! proof = HMAC-SHA256(secret, "ddp-comm handshake" | magic | version | number
//!                             | client nonce | server nonce | "server" or "client")
//! ```
//!
//! The number is the connecting rank (0 for store clients); both nonces are 128 random bits
//! from the OS. The client checks the server's proof before it sends its own, so it never
//! trusts, nor gives a proof to, a server that does not know the secret; the server checks
//! the client's before it acknowledges or serves anything, and drops strangers. The secret
//! never crosses the wire, a proof is good for one pair of nonces only, and the role ends
//! the message, so a server's proof can never be replayed as a client's. Proofs are compared
//! in constant time. A handshake has one deadline in all, not one per read.
//!
//! What it does not do: encrypt, or protect the bytes after the handshake (someone who can
//! rewrite packets between two hosts can take over an established connection).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{AuthFailure, CommError};
use crate::security::secret::Secret;

/// Protocol version of every handshake (1 sent the run id in cleartext).
pub(crate) const PROTOCOL_VERSION: u8 = 2;
/// Bytes of each nonce.
const NONCE_LEN: usize = 16;
/// Bytes of a proof (HMAC-SHA256).
pub(crate) const PROOF_LEN: usize = 32;
/// Bytes of the client's hello.
pub(crate) const HELLO_LEN: usize = 4 + 1 + 4 + NONCE_LEN;
/// Bytes of the server's challenge.
pub(crate) const CHALLENGE_LEN: usize = NONCE_LEN + PROOF_LEN;
/// The longest a handshake may take, from its first byte to its last.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The store's deadline for a connection's handshake: [`HANDSHAKE_TIMEOUT`], but for the
/// flood test (`ddp-comm/tests/flood.rs`), which sees its strangers cut off many times over in
/// a few seconds: `DDP_COMM_TEST_STORE_HANDSHAKE_MS` (see [`injected`]).
pub(crate) fn store_handshake_timeout() -> Duration {
    injected("DDP_COMM_TEST_STORE_HANDSHAKE_MS").unwrap_or(HANDSHAKE_TIMEOUT)
}

/// The milliseconds in `var`, which a test sets to shorten a wait: with the
/// `fault-injection` feature only (users' builds never read it).
pub(crate) fn injected(var: &str) -> Option<Duration> {
    let ms = cfg!(feature = "fault-injection").then(|| std::env::var(var).ok()?.parse().ok());
    ms.flatten().map(Duration::from_millis)
}

const CONTEXT: &[u8] = b"ddp-comm handshake";

/// The connecting side of one handshake.
pub(crate) struct Client<'s> {
    secret: &'s Secret,
    magic: [u8; 4],
    number: u32,
    nonce: [u8; NONCE_LEN],
}

impl<'s> Client<'s> {
    /// A handshake presenting `number` (the connecting rank, 0 for store clients).
    pub(crate) fn new(secret: &'s Secret, magic: &[u8; 4], number: u32) -> io::Result<Self> {
        Ok(Client {
            secret,
            magic: *magic,
            number,
            nonce: nonce()?,
        })
    }

    /// The first message.
    pub(crate) fn hello(&self) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[..4].copy_from_slice(&self.magic);
        out[4] = PROTOCOL_VERSION;
        out[5..9].copy_from_slice(&self.number.to_le_bytes());
        out[9..].copy_from_slice(&self.nonce);
        out
    }

    /// Checks the server's proof and returns this side's, or `None` when the server did not
    /// prove that it knows the secret.
    pub(crate) fn answer(&self, challenge: &[u8; CHALLENGE_LEN]) -> Option<[u8; PROOF_LEN]> {
        let (server_nonce, server_proof) = challenge.split_at(NONCE_LEN);
        let server_nonce: &[u8; NONCE_LEN] = server_nonce.try_into().ok()?;
        let mac = |role| {
            transcript(
                self.secret,
                &self.magic,
                self.number,
                &self.nonce,
                server_nonce,
                role,
            )
        };
        mac(b"server").verify_slice(server_proof).ok()?;
        Some(mac(b"client").finalize().into_bytes().into())
    }
}

/// The accepting side of one handshake, after a well-formed hello.
pub(crate) struct Server<'s> {
    secret: &'s Secret,
    magic: [u8; 4],
    number: u32,
    client_nonce: [u8; NONCE_LEN],
    nonce: [u8; NONCE_LEN],
}

impl<'s> Server<'s> {
    /// Reads a hello through `read` (which fills its buffer or fails): magic and version
    /// first, so that anything else is refused before the rest is waited for. `Ok(Err(why))`
    /// for a hello that is not this protocol's.
    pub(crate) fn read(
        secret: &'s Secret,
        magic: &[u8; 4],
        mut read: impl FnMut(&mut [u8]) -> io::Result<()>,
    ) -> io::Result<Result<Self, String>> {
        let mut head = [0u8; 5];
        read(&mut head)?;
        if head[..4] != magic[..] {
            return Ok(Err(format!(
                "bad magic {:02x?} (not a ddp-comm peer)",
                &head[..4]
            )));
        }
        if head[4] != PROTOCOL_VERSION {
            return Ok(Err(format!(
                "protocol version {}, expected {PROTOCOL_VERSION} (an older ddp-comm, which \
                 sends its run id in cleartext)",
                head[4]
            )));
        }
        let mut rest = [0u8; HELLO_LEN - 5];
        read(&mut rest)?;
        let (number, client_nonce) = rest.split_at(4);
        Ok(Ok(Server {
            secret,
            magic: *magic,
            number: u32::from_le_bytes(number.try_into().expect("4 bytes")),
            client_nonce: client_nonce.try_into().expect("nonce bytes"),
            nonce: nonce()?,
        }))
    }

    /// The number the client presented (proven only once [`Server::check`] passes).
    pub(crate) fn number(&self) -> u32 {
        self.number
    }

    /// The second message: this side's nonce and proof.
    pub(crate) fn challenge(&self) -> [u8; CHALLENGE_LEN] {
        let mut out = [0u8; CHALLENGE_LEN];
        out[..NONCE_LEN].copy_from_slice(&self.nonce);
        out[NONCE_LEN..].copy_from_slice(&self.mac(b"server").finalize().into_bytes());
        out
    }

    /// Whether the client proved that it knows the secret (constant time).
    pub(crate) fn check(&self, proof: &[u8]) -> bool {
        self.mac(b"client").verify_slice(proof).is_ok()
    }

    fn mac(&self, role: &[u8]) -> Hmac<Sha256> {
        transcript(
            self.secret,
            &self.magic,
            self.number,
            &self.client_nonce,
            &self.nonce,
            role,
        )
    }
}

/// HMAC-SHA256 keyed with the job's secret: the handshake's proofs, and the tags of the
/// values ranks write into torchrun's agent store (`store/signed.rs`).
pub(crate) fn keyed(secret: &Secret) -> Hmac<Sha256> {
    Hmac::<Sha256>::new_from_slice(secret.key()).expect("HMAC takes keys of any length")
}

fn transcript(
    secret: &Secret,
    magic: &[u8; 4],
    number: u32,
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
    role: &[u8],
) -> Hmac<Sha256> {
    let mut mac = keyed(secret);
    for part in [
        CONTEXT,
        magic,
        &[PROTOCOL_VERSION],
        &number.to_le_bytes(),
        client_nonce,
        server_nonce,
        role,
    ] {
        mac.update(part);
    }
    mac
}

fn nonce() -> io::Result<[u8; NONCE_LEN]> {
    let mut out = [0u8; NONCE_LEN];
    getrandom::fill(&mut out).map_err(|e| io::Error::other(format!("no random bytes: {e}")))?;
    Ok(out)
}

/// A socket whose reads and writes can be limited in time.
pub(crate) trait Timeouts {
    /// Sets the read and write timeouts.
    fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()>;
}

impl Timeouts for TcpStream {
    fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(timeout)?;
        self.set_write_timeout(timeout)
    }
}

impl Timeouts for UnixStream {
    fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(timeout)?;
        self.set_write_timeout(timeout)
    }
}

/// Time left before `deadline`, or a `TimedOut` error.
pub(crate) fn left(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "handshake deadline passed",
        ));
    }
    Ok(left.max(Duration::from_millis(1)))
}

/// Fills `buf` from `s` before `deadline` (each read limited to the time left, so a peer
/// that sends a byte at a time cannot stretch it).
pub(crate) fn read_by<S: Timeouts>(s: &S, buf: &mut [u8], deadline: Instant) -> io::Result<()>
where
    for<'a> &'a S: Read,
{
    let mut done = 0;
    while done < buf.len() {
        s.set_timeouts(Some(left(deadline)?))?;
        let mut reader: &S = s;
        match reader.read(&mut buf[done..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(timed_out(e)),
        }
    }
    Ok(())
}

/// Writes all of `data` to `s` before `deadline`.
pub(crate) fn write_by<S: Timeouts>(s: &S, data: &[u8], deadline: Instant) -> io::Result<()>
where
    for<'a> &'a S: Write,
{
    let mut done = 0;
    while done < data.len() {
        s.set_timeouts(Some(left(deadline)?))?;
        let mut writer: &S = s;
        match writer.write(&data[done..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(timed_out(e)),
        }
    }
    Ok(())
}

/// A socket timeout reads as `WouldBlock` on Linux.
pub(crate) fn timed_out(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(io::ErrorKind::TimedOut, "handshake deadline passed")
    } else {
        e
    }
}

/// How a client's handshake failed.
#[derive(Debug)]
pub(crate) enum Failed {
    /// The peer is not trusted, or refused this rank.
    Auth(AuthFailure),
    /// The peer hung up before its challenge: busy with other handshakes (worth another
    /// connection), or not a peer of this version.
    TurnedAway,
    /// The connection failed otherwise.
    Io(io::Error),
}

impl Failed {
    /// An I/O error during a handshake: a hang-up means the peer refused this rank, a
    /// timeout that it did not answer in time.
    pub(crate) fn from_io(e: io::Error, secret: &Secret, waited: Duration) -> Self {
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => Failed::Auth(AuthFailure::Refused {
                hint: secret.hint().to_string(),
            }),
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
                Failed::Auth(AuthFailure::NoAnswer { waited })
            }
            _ => Failed::Io(e),
        }
    }

    /// [`Failed::from_io`] for an error before the server's challenge, where a hang-up
    /// refuses no proof: the server turned the connection away.
    pub(crate) fn before_challenge(e: io::Error, secret: &Secret, waited: Duration) -> Self {
        match Failed::from_io(e, secret, waited) {
            Failed::Auth(AuthFailure::Refused { .. }) => Failed::TurnedAway,
            other => other,
        }
    }

    /// The server's proof was wrong.
    pub(crate) fn unproven(secret: &Secret) -> Self {
        Failed::Auth(AuthFailure::Unproven {
            hint: secret.hint().to_string(),
        })
    }

    /// The error of the connection to `addr`.
    pub(crate) fn into_error(self, addr: String) -> CommError {
        match self {
            Failed::Auth(failure) => CommError::Handshake { addr, failure },
            Failed::TurnedAway => CommError::Handshake {
                addr,
                failure: AuthFailure::TurnedAway { times: 1 },
            },
            Failed::Io(source) => CommError::io(format!("handshake with {addr}"), source),
        }
    }
}

/// The client side over TCP, up to the server's one-byte acknowledgement, which it
/// returns; all before `deadline`. A hang-up before the server's challenge is
/// [`Failed::TurnedAway`] (see [`handshake_retrying`]).
pub(crate) fn tcp_client(
    stream: &TcpStream,
    secret: &Secret,
    magic: &[u8; 4],
    number: u32,
    deadline: Instant,
) -> Result<u8, Failed> {
    let start = Instant::now();
    let fail = |e| Failed::from_io(e, secret, deadline.saturating_duration_since(start));
    let turned_away =
        |e| Failed::before_challenge(e, secret, deadline.saturating_duration_since(start));
    let client = Client::new(secret, magic, number).map_err(Failed::Io)?;
    write_by(stream, &client.hello(), deadline).map_err(turned_away)?;
    let mut challenge = [0u8; CHALLENGE_LEN];
    read_by(stream, &mut challenge, deadline).map_err(turned_away)?;
    let proof = client
        .answer(&challenge)
        .ok_or_else(|| Failed::unproven(secret))?;
    write_by(stream, &proof, deadline).map_err(fail)?;
    let mut ack = [0u8; 1];
    read_by(stream, &mut ack, deadline).map_err(fail)?;
    Ok(ack[0])
}

/// Runs `attempt` (a new connection and its handshake) again while the peer turns it away
/// before its challenge (a store or listener busy with other handshakes closes new
/// connections at once), pausing 10 ms doubling to 200 ms, until `deadline`; the last
/// refusal counts the connections turned away.
pub(crate) fn handshake_retrying<T>(
    deadline: Instant,
    mut attempt: impl FnMut() -> Result<T, CommError>,
) -> Result<T, CommError> {
    let mut pause = Duration::from_millis(10);
    let mut times = 0;
    loop {
        match attempt() {
            Err(CommError::Handshake {
                addr,
                failure: AuthFailure::TurnedAway { .. },
            }) => {
                times += 1;
                let now = Instant::now();
                if now >= deadline {
                    return Err(CommError::Handshake {
                        addr,
                        failure: AuthFailure::TurnedAway { times },
                    });
                }
                std::thread::sleep(pause.min(deadline - now));
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            done => return done,
        }
    }
}

/// The server side over TCP, up to (not including) the acknowledgement: the number the
/// client presented once it has proven the secret, else why it was refused (for the log).
pub(crate) fn tcp_server(
    stream: &TcpStream,
    secret: &Secret,
    magic: &[u8; 4],
    deadline: Instant,
) -> Result<u32, String> {
    let incomplete = |e: io::Error| format!("incomplete handshake ({e})");
    let server =
        Server::read(secret, magic, |buf| read_by(stream, buf, deadline)).map_err(incomplete)??;
    write_by(stream, &server.challenge(), deadline).map_err(incomplete)?;
    let mut proof = [0u8; PROOF_LEN];
    read_by(stream, &mut proof, deadline).map_err(incomplete)?;
    if !server.check(&proof) {
        return Err(WRONG_PROOF.to_string());
    }
    Ok(server.number())
}

/// Why a server refuses a client whose proof is wrong.
pub(crate) const WRONG_PROOF: &str = "wrong proof of the job secret (the secrets differ)";

/// The peer's uid must be this process's effective uid (Unix sockets only).
pub(crate) fn same_user(stream: &UnixStream) -> Result<(), AuthFailure> {
    let uid = rustix::process::geteuid().as_raw();
    let peer_uid = rustix::net::sockopt::socket_peercred(stream)
        .map(|cred| cred.uid.as_raw())
        // No credentials: treat as another user.
        .unwrap_or(u32::MAX);
    if peer_uid == uid {
        Ok(())
    } else {
        Err(AuthFailure::OtherUser { peer_uid, uid })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn secret(hex: &str) -> Secret {
        Secret::from_hex(&hex.repeat(32)).unwrap()
    }

    /// Runs a client and a server over in-memory messages.
    fn run(client_secret: &Secret, server_secret: &Secret) -> (bool, bool) {
        let client = Client::new(client_secret, b"TEST", 7).unwrap();
        let hello = client.hello();
        let mut at = 0;
        let server = Server::read(server_secret, b"TEST", |buf| {
            buf.copy_from_slice(&hello[at..at + buf.len()]);
            at += buf.len();
            Ok(())
        })
        .unwrap()
        .unwrap();
        assert_eq!(server.number(), 7);
        match client.answer(&server.challenge()) {
            Some(proof) => (true, server.check(&proof)),
            None => (false, false),
        }
    }

    #[test]
    fn equal_secrets_prove_themselves_both_ways() {
        assert_eq!(run(&secret("a"), &secret("a")), (true, true));
    }

    #[test]
    fn a_server_without_the_secret_is_not_trusted() {
        assert_eq!(run(&secret("a"), &secret("b")), (false, false));
    }

    #[test]
    fn a_replayed_or_reflected_proof_is_refused() {
        let s = secret("c");
        let client = Client::new(&s, b"TEST", 1).unwrap();
        let hello = client.hello();
        let read = |hello: [u8; HELLO_LEN]| {
            let mut at = 0;
            Server::read(&s, b"TEST", move |buf| {
                buf.copy_from_slice(&hello[at..at + buf.len()]);
                at += buf.len();
                Ok(())
            })
            .unwrap()
            .unwrap()
        };
        let first = read(hello);
        let proof = client.answer(&first.challenge()).unwrap();
        assert!(first.check(&proof));
        // The same hello again: a fresh server nonce makes the old proof worthless.
        let second = read(hello);
        assert!(!second.check(&proof));
        // The server's own proof, sent back as a client's.
        let challenge = second.challenge();
        assert!(!second.check(&challenge[NONCE_LEN..]));
        // A claim of another rank invalidates the proof.
        let mut other = hello;
        other[5] = 2;
        let third = read(other);
        let proof = client.answer(&first.challenge()).unwrap();
        assert!(!third.check(&proof));
    }

    #[test]
    fn hellos_of_another_protocol_are_refused_after_five_bytes() {
        let s = secret("d");
        for (bytes, why) in [
            (&b"GET /"[..], "bad magic"),
            (&b"TEST\x01"[..], "protocol version 1, expected 2"),
        ] {
            let mut reads = 0;
            let got = Server::read(&s, b"TEST", |buf| {
                reads += 1;
                buf.copy_from_slice(&bytes[..buf.len()]);
                Ok(())
            })
            .unwrap();
            assert!(got.err().unwrap().contains(why), "{why}");
            assert_eq!(reads, 1);
        }
    }

    #[test]
    fn a_silent_server_times_out_within_one_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let s = secret("e");
        let start = Instant::now();
        let deadline = start + Duration::from_millis(300);
        match tcp_client(&stream, &s, b"TEST", 0, deadline) {
            Err(Failed::Auth(AuthFailure::NoAnswer { waited })) => assert!(
                (Duration::from_millis(250)..=Duration::from_millis(300)).contains(&waited),
                "{waited:?}"
            ),
            other => panic!("expected NoAnswer, got {other:?}"),
        }
        assert!(start.elapsed() >= Duration::from_millis(300));
    }
}
