//! A client of PyTorch's c10d `TCPStore`, for runs started by `torchrun`.
//!
//! With `TORCHELASTIC_USE_AGENT_STORE=True`, torchrun's agent already serves a TCPStore on
//! `MASTER_ADDR:MASTER_PORT`, so rank 0 cannot listen there; every rank becomes a client of
//! the agent's store instead. The wire format (PyTorch 2.x, `TCPStoreBackend.hpp` and
//! `TCPStoreLibUvBackend.cpp`): a one-byte query type, then native-endian (little-endian)
//! `u64`-length-prefixed keys and values; a new connection first sends `VALIDATE` with the
//! magic number `0x3C85F7CE`, and `PING` echoes a `u32` nonce back. Keys are placed under
//! `/ddp-comm/<run id>/<restart count>/` so they never meet the agent's own keys or those of
//! an earlier restart.

use std::io::{BufReader, BufWriter, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::store::wire;
use crate::store::Store;
use crate::tcp::Connection;

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const PING: u8 = 13;
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
const CHECK_READY: u8 = 0;

/// A connection to a c10d TCPStore.
#[derive(Debug)]
pub(crate) struct C10dStore {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
    addr: String,
    local_ip: IpAddr,
    peer_ip: IpAddr,
    prefix: String,
}

impl C10dStore {
    /// Connects (retrying until `deadline`), validates and pings.
    pub(crate) fn connect(
        addrs: &[SocketAddr],
        prefix: String,
        deadline: Instant,
        io_timeout: Duration,
    ) -> Result<Self, CommError> {
        let c = Connection::open(addrs, deadline, io_timeout, "torchrun agent store")?;
        let mut store = C10dStore {
            reader: c.reader,
            writer: c.writer,
            addr: c.addr,
            local_ip: c.local_ip,
            peer_ip: c.peer_ip,
            prefix,
        };
        let mut msg = vec![VALIDATE];
        msg.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        let nonce = std::process::id();
        msg.push(PING);
        msg.extend_from_slice(&nonce.to_le_bytes());
        store.send(&msg)?;
        let echoed = wire::read_u32(&mut store.reader).map_err(|e| store.fail("ping", e))?;
        if echoed != nonce {
            return Err(CommError::Store {
                addr: store.addr.clone(),
                detail: format!("ping answered {echoed}, expected {nonce}: not a c10d TCPStore"),
            });
        }
        Ok(store)
    }

    fn fail(&self, what: &str, e: std::io::Error) -> CommError {
        CommError::Store {
            addr: self.addr.clone(),
            detail: format!("{what}: {e}"),
        }
    }

    fn send(&mut self, msg: &[u8]) -> Result<(), CommError> {
        let result = self
            .writer
            .write_all(msg)
            .and_then(|()| self.writer.flush());
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
        wire::read_u8(&mut self.reader)
            .map(|r| r == CHECK_READY)
            .map_err(|e| self.fail("check", e))
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
    use std::io::Read;
    use std::net::TcpListener;

    /// A c10d store impostor: it validates and echoes the ping like a TCPStore, then answers
    /// whatever comes with `answer` and hangs up.
    fn impostor(answer: Vec<u8>) -> (SocketAddr, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let thread = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut hello = [0u8; 10];
            stream.read_exact(&mut hello).unwrap();
            stream.write_all(&hello[6..10]).unwrap();
            let _ = stream.write_all(&answer);
        });
        (addr, thread)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// torchrun's agent store is not authenticated (see the README): whatever it
        /// answers, every request returns a value or a typed error, without a panic or an
        /// allocation past the wire's bounds, and an answer that stops short times out.
        #[test]
        fn any_answer_of_the_store_is_a_value_or_an_error(
            answer in proptest::collection::vec(any::<u8>(), 0..64),
            big in any::<u64>(),
        ) {
            let mut answer = answer;
            // Sometimes a huge length where GET's value length goes.
            if big % 2 == 0 {
                answer.splice(1.min(answer.len())..1.min(answer.len()), big.to_le_bytes());
            }
            let (addr, thread) = impostor(answer);
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut store = C10dStore::connect(&[addr], "/t/".into(), deadline, Duration::from_secs(2))
                .unwrap();
            let got = store.get("k");
            if let Ok(Some(v)) = &got {
                prop_assert!(v.len() <= wire::MAX_VALUE_LEN);
            }
            let _ = store.add("n", 1);
            let _ = store.check(&["k".to_string()]);
            thread.join().unwrap();
        }
    }
}
