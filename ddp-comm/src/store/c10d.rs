//! A client of PyTorch's c10d `TCPStore`, for runs started by `torchrun`.
//!
//! With `TORCHELASTIC_USE_AGENT_STORE=True`, torchrun's agent already serves a TCPStore on
//! `MASTER_ADDR:MASTER_PORT`, so rank 0 cannot listen there; every rank becomes a client of
//! the agent's store instead. The wire format (PyTorch 2.x, `TCPStoreBackend.hpp` and
//! `TCPStoreLibUvBackend.cpp`): a one-byte query type, then native-endian (little-endian)
//! `u64`-length-prefixed keys and values; a new connection first sends `VALIDATE` with the
//! magic number `0x3C85F7CE`, and `PING` echoes a `u32` nonce back. Keys are placed under
//! `/ddp-comm/<run id>/<group>/g<generation>/` so they never meet the agent's own keys,
//! another group's, or those of an earlier start of the ranks (`group/rendezvous/
//! generation.rs`). The store has no authentication: rendezvous wraps this client in
//! `signed.rs`, which tags every value with the job's secret.

use std::cell::Cell;
use std::io::BufReader;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::security::auth::Timeouts;
use crate::store::wire;
use crate::store::{out_of_step, Store};
use crate::tcp::Connection;

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const PING: u8 = 13;
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// CHECK's answers (`CheckResponseType`): every key is set, or not yet.
const CHECK_READY: u8 = 0;
const CHECK_NOT_READY: u8 = 1;

/// A connection to a c10d TCPStore.
#[derive(Debug)]
pub(crate) struct C10dStore {
    /// Requests are written whole through `reader.get_ref()`.
    reader: BufReader<TcpStream>,
    addr: String,
    local_ip: IpAddr,
    peer_ip: IpAddr,
    prefix: String,
    /// Set by the first failed request: the connection's answers are then out of step (a
    /// late answer would be read as the next request's), so it is not used again.
    broken: Cell<bool>,
}

/// How long the store may take to echo the ping: longer than a handshake, since thousands
/// of ranks may connect to torchrun's agent store at once.
const PING_TIMEOUT: Duration = Duration::from_secs(60);

/// The ping's bound for requests bounded by `io_timeout`.
fn ping_timeout(io_timeout: Duration) -> Duration {
    io_timeout.min(PING_TIMEOUT)
}

impl C10dStore {
    /// Connects (retrying until `deadline`), validates and pings: the ping's echo must come
    /// within [`PING_TIMEOUT`] (or `io_timeout`, if shorter), as the answer of a
    /// store and not of whatever else listens there; each later request may take
    /// `io_timeout`.
    pub(crate) fn connect(
        addrs: &[SocketAddr],
        prefix: String,
        deadline: Instant,
        io_timeout: Duration,
    ) -> Result<Self, CommError> {
        let c = Connection::open(addrs, deadline, io_timeout, "torchrun agent store")?;
        let mut store = C10dStore {
            reader: c.reader,
            addr: c.addr,
            local_ip: c.local_ip,
            peer_ip: c.peer_ip,
            prefix,
            broken: Cell::new(false),
        };
        let mut msg = vec![VALIDATE];
        msg.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        let nonce = std::process::id();
        msg.push(PING);
        msg.extend_from_slice(&nonce.to_le_bytes());
        store.send(&msg)?;
        let ping_timeout = ping_timeout(io_timeout);
        let echoed = store
            .reader
            .get_ref()
            .set_timeouts(Some(ping_timeout))
            .and_then(|()| wire::read_u32(&mut store.reader))
            .map_err(|e| store.fail("ping", e))?;
        store
            .reader
            .get_ref()
            .set_timeouts(Some(io_timeout))
            .map_err(|e| store.fail("ping", e))?;
        if echoed != nonce {
            return Err(CommError::Store {
                addr: store.addr.clone(),
                detail: format!("ping answered {echoed}, expected {nonce}: not a c10d TCPStore"),
            });
        }
        Ok(store)
    }

    fn fail(&self, what: &str, e: std::io::Error) -> CommError {
        self.broken.set(true);
        CommError::Store {
            addr: self.addr.clone(),
            detail: format!("{what}: {e}"),
        }
    }

    fn send(&mut self, msg: &[u8]) -> Result<(), CommError> {
        if self.broken.get() {
            return Err(out_of_step(&self.addr));
        }
        let result = wire::send_all(&mut self.reader.get_ref(), msg);
        result.map_err(|e| self.fail("send", e))
    }

    fn put_key(&self, msg: &mut Vec<u8>, key: &str) {
        let full = format!("{}{key}", self.prefix);
        msg.extend_from_slice(&(full.len() as u64).to_le_bytes());
        msg.extend_from_slice(full.as_bytes());
    }
}

impl Store for C10dStore {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), CommError> {
        let mut msg = vec![SET];
        self.put_key(&mut msg, key);
        msg.extend_from_slice(&(value.len() as u64).to_le_bytes());
        msg.extend_from_slice(value);
        self.send(&msg)
    }

    fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, CommError> {
        // GET of a missing key is not defined by the protocol (the C++ client waits first).
        if !self.check(&[key.to_string()])? {
            return Ok(None);
        }
        let mut msg = vec![GET];
        self.put_key(&mut msg, key);
        self.send(&msg)?;
        let len = wire::read_u64(&mut self.reader).map_err(|e| self.fail("get", e))?;
        wire::read_bounded(&mut self.reader, len, wire::MAX_VALUE_LEN, "value")
            .map(Some)
            .map_err(|e| self.fail("get", e))
    }

    fn add(&mut self, key: &str, delta: i64) -> Result<i64, CommError> {
        let mut msg = vec![ADD];
        self.put_key(&mut msg, key);
        msg.extend_from_slice(&delta.to_le_bytes());
        self.send(&msg)?;
        wire::read_u64(&mut self.reader)
            .map(|v| v as i64)
            .map_err(|e| self.fail("add", e))
    }

    fn check(&mut self, keys: &[String]) -> Result<bool, CommError> {
        let mut msg = vec![CHECK];
        msg.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for key in keys {
            self.put_key(&mut msg, key);
        }
        self.send(&msg)?;
        match wire::read_u8(&mut self.reader).map_err(|e| self.fail("check", e))? {
            CHECK_READY => Ok(true),
            CHECK_NOT_READY => Ok(false),
            other => Err({
                // Not a store's answer: nothing later on this connection can be trusted.
                self.broken.set(true);
                CommError::Store {
                    addr: self.addr.clone(),
                    detail: format!(
                        "check answered {other}, expected {CHECK_READY} (ready) or \
                         {CHECK_NOT_READY} (not ready): not a c10d TCPStore"
                    ),
                }
            }),
        }
    }

    fn addr(&self) -> &str {
        &self.addr
    }

    fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    fn peer_ip(&self) -> IpAddr {
        self.peer_ip
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener};
    use std::sync::mpsc;

    /// A listener whose one connection `serve` gets once accepted.
    fn fake_store(
        serve: impl FnOnce(TcpStream) + Send + 'static,
    ) -> (SocketAddr, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let thread = std::thread::spawn(move || serve(listener.accept().unwrap().0));
        (addr, thread)
    }

    /// Reads the validation and the ping (10 bytes) and echoes the ping's nonce, as a
    /// TCPStore does.
    fn validate(stream: &mut TcpStream) {
        let mut hello = [0u8; 10];
        stream.read_exact(&mut hello).unwrap();
        stream.write_all(&hello[6..10]).unwrap();
    }

    /// Reads whatever the client sends until it hangs up, answering nothing.
    fn drain(mut stream: TcpStream) {
        let _ = std::io::copy(&mut stream, &mut std::io::sink());
    }

    /// A c10d store impostor: it validates and echoes the ping like a TCPStore, then answers
    /// whatever comes with `answer` and ends its side (reading on, so that the client's
    /// requests never meet a reset).
    fn impostor(answer: Vec<u8>) -> (SocketAddr, std::thread::JoinHandle<()>) {
        fake_store(move |mut stream| {
            validate(&mut stream);
            let _ = stream.write_all(&answer);
            let _ = stream.shutdown(Shutdown::Write);
            drain(stream);
        })
    }

    fn connect(addr: SocketAddr, io_timeout: Duration) -> Result<C10dStore, CommError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        C10dStore::connect(&[addr], "/t/".into(), deadline, io_timeout)
    }

    fn store_detail(got: Result<impl std::fmt::Debug, CommError>) -> String {
        match got {
            Err(CommError::Store { detail, .. }) => detail,
            other => panic!("expected a Store error, got {other:?}"),
        }
    }

    /// What `get("k")`, `add` and `check` must return, in this order, when the store's
    /// answers are `answer` and then the end of the stream: `None` for an error, and for
    /// every request after one that failed (the connection is not used again).
    #[allow(clippy::type_complexity)]
    fn expected(answer: &[u8]) -> (Option<Option<Vec<u8>>>, Option<i64>, Option<bool>) {
        let mut rest = answer;
        let mut take = |n: u64| {
            let n = usize::try_from(n).ok().filter(|n| *n <= rest.len());
            let Some(n) = n else {
                // A short read consumes what is left, then meets the end.
                rest = &[];
                return None;
            };
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Some(head.to_vec())
        };
        let get = match take(1).map(|b| b[0]) {
            Some(CHECK_NOT_READY) => Some(None),
            Some(CHECK_READY) => take(8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
                .and_then(|len| {
                    // A length past the bound is refused before its bytes are read.
                    (len <= wire::MAX_VALUE_LEN as u64)
                        .then(|| take(len))
                        .flatten()
                })
                .map(Some),
            _ => None,
        };
        let add = get
            .is_some()
            .then(|| take(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())))
            .flatten();
        let check = match add.is_some().then(|| take(1).map(|b| b[0])).flatten() {
            Some(CHECK_READY) => Some(true),
            Some(CHECK_NOT_READY) => Some(false),
            _ => None,
        };
        (get, add, check)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// torchrun's agent store is not authenticated (see the README): whatever it
        /// answers, every request returns what the answer says or a typed error, without a
        /// panic or an allocation past the wire's bounds.
        #[test]
        fn any_answer_of_the_store_is_a_value_or_an_error(
            answer in proptest::collection::vec(any::<u8>(), 0..64),
            big in any::<u64>(),
            ready in any::<bool>(),
        ) {
            let mut answer = answer;
            // Often a store that says the key is there, sometimes with a huge length where
            // GET's value length goes.
            if ready && !answer.is_empty() {
                answer[0] = CHECK_READY;
            }
            if big % 2 == 0 {
                answer.splice(1.min(answer.len())..1.min(answer.len()), big.to_le_bytes());
            }
            let (want_get, want_add, want_check) = expected(&answer);
            let (addr, thread) = impostor(answer);
            let mut store = connect(addr, Duration::from_secs(2)).unwrap();
            let is_store_error = |e: &CommError| matches!(e, CommError::Store { .. });
            let get = store.get("k");
            prop_assert!(get.as_ref().err().is_none_or(is_store_error), "{get:?}");
            prop_assert_eq!(get.ok(), want_get);
            let add = store.add("n", 1);
            prop_assert!(add.as_ref().err().is_none_or(is_store_error), "{add:?}");
            prop_assert_eq!(add.ok(), want_add);
            let check = store.check(&["k".to_string()]);
            prop_assert!(check.as_ref().err().is_none_or(is_store_error), "{check:?}");
            prop_assert_eq!(check.ok(), want_check);
            drop(store);
            thread.join().unwrap();
        }
    }

    /// PyTorch's client takes only 0 (ready) and 1 (not ready) for a check; anything else is
    /// not a TCPStore's answer.
    #[test]
    fn a_check_answered_with_another_byte_is_a_protocol_error() {
        for (byte, want) in [(0u8, Some(true)), (1, Some(false)), (2, None), (0xff, None)] {
            let (addr, thread) = impostor(vec![byte]);
            let mut store = connect(addr, Duration::from_secs(2)).unwrap();
            let got = store.check(&["k".to_string()]);
            match want {
                Some(ready) => assert_eq!(got.unwrap(), ready, "{byte}"),
                None => assert_eq!(
                    store_detail(got),
                    format!(
                        "check answered {byte}, expected 0 (ready) or 1 (not ready): not a c10d \
                         TCPStore"
                    )
                ),
            }
            drop(store);
            thread.join().unwrap();
        }
    }

    /// A store that takes requests but never answers: a request fails once the I/O timeout
    /// has passed, as a timeout, not a hang; the connection is then out of step (a late
    /// answer would be taken for the next request's), so the next request fails at once.
    #[test]
    fn a_silent_store_times_out_a_request_and_is_not_used_again() {
        let (addr, thread) = fake_store(|mut stream| {
            validate(&mut stream);
            drain(stream);
        });
        let io_timeout = Duration::from_millis(500);
        let mut store = connect(addr, io_timeout).unwrap();
        let start = Instant::now();
        let detail = store_detail(store.get("k"));
        let waited = start.elapsed();
        assert!(detail.starts_with("check: "), "{detail}");
        assert!(
            detail.contains("Resource temporarily unavailable") || detail.contains("timed out"),
            "{detail}"
        );
        assert!(
            (io_timeout..Duration::from_secs(20)).contains(&waited),
            "{waited:?}"
        );
        let start = Instant::now();
        assert_eq!(
            store_detail(store.add("n", 1)),
            "an earlier request on this connection failed; it is not used again"
        );
        assert!(start.elapsed() < io_timeout, "{:?}", start.elapsed());
        drop(store);
        thread.join().unwrap();
    }

    /// Whatever listens at the store's address must echo the ping within
    /// `ping_timeout(io_timeout)`: a minute at most, not the rendezvous timeout that later
    /// requests get.
    #[test]
    fn the_ping_is_answered_within_its_own_timeout() {
        assert_eq!(ping_timeout(Duration::from_secs(300)), PING_TIMEOUT);
        assert_eq!(PING_TIMEOUT, Duration::from_secs(60));
        let io_timeout = Duration::from_secs(2);
        assert_eq!(ping_timeout(io_timeout), io_timeout);
        let (addr, thread) = fake_store(drain);
        let (tx, rx) = mpsc::channel();
        let start = Instant::now();
        std::thread::spawn(move || {
            let _ = tx.send(connect(addr, io_timeout).map(drop));
        });
        let got = rx
            .recv_timeout(io_timeout * 5)
            .expect("the ping waited past its timeout");
        let waited = start.elapsed();
        assert!(store_detail(got).starts_with("ping: "));
        assert!(waited >= io_timeout, "{waited:?}");
        thread.join().unwrap();
    }
}
