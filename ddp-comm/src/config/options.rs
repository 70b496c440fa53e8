//! [`Options`]: what `ProcessGroup::new` needs. This rank's place in the job and the
//! settings the environment can give are an [`EnvConfig`] (read by [`Options::from_env`],
//! or given in code with [`Options::new`]); `Options` adds only what code alone chooses: the
//! backend, the ring sockets' kernel buffers and the size of the shared-memory rings.

use std::time::Duration;

use crate::config::env::{EnvConfig, MAX_TIMEOUT};
use crate::error::CommError;
use crate::ring::link::Transport;
use crate::ring::shm;
use crate::security::secret::Secret;

/// Default rendezvous timeout: 600 s, as torchrun's rendezvous.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(600);
/// Default timeout of one collective with the CPU backend: 30 minutes, PyTorch's default for
/// Gloo (`default_pg_timeout`).
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(1800);
/// Default timeout of one collective with the NCCL backend (CPU collectives of that group
/// included): 10 minutes, PyTorch's default for NCCL (`default_pg_nccl_timeout`).
pub const DEFAULT_NCCL_OP_TIMEOUT: Duration = Duration::from_secs(600);
/// Default kernel send/receive buffer of ring sockets: 0, Linux's autotuning, which grows
/// each socket's buffers up to `net.ipv4.tcp_rmem`/`tcp_wmem` (32 MiB / 4 MiB here).
/// Setting `SO_RCVBUF` explicitly turns autotuning off and caps the buffer at
/// `net.core.rmem_max`; on loopback that measured slower (see the README).
pub const DEFAULT_SOCKET_BUFFER: usize = 0;
/// Default data bytes of each shared-memory ring (one per link between ranks on one host).
pub const DEFAULT_SHM_RING_BYTES: usize = shm::DEFAULT_CAPACITY;

/// Which engine carries CUDA tensors. CPU tensors always travel around the CPU ring, whose
/// links are shared memory between ranks on one host and TCP between hosts (see
/// [`Transport`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// NCCL for CUDA tensors (plus the CPU ring for CPU tensors and byte-level calls).
    Nccl,
    /// The CPU ring only: CPU tensors; CUDA tensors are refused.
    Cpu,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Nccl => "nccl",
            Backend::Cpu => "cpu",
        })
    }
}

impl Backend {
    /// How long one collective may take when nothing sets it: PyTorch's default for the
    /// matching backend ([`DEFAULT_NCCL_OP_TIMEOUT`], [`DEFAULT_OP_TIMEOUT`]).
    pub fn default_op_timeout(self) -> Duration {
        match self {
            Backend::Nccl => DEFAULT_NCCL_OP_TIMEOUT,
            Backend::Cpu => DEFAULT_OP_TIMEOUT,
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = String;

    /// `nccl` and `cpu` in any case; `tcp`, the CPU backend's earlier name, is taken as `cpu`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "nccl" => Ok(Backend::Nccl),
            "cpu" | "tcp" => Ok(Backend::Cpu),
            _ => Err(format!("unknown backend {s:?} (expected cpu or nccl)")),
        }
    }
}

/// Everything `ProcessGroup::new` needs. Build with [`Options::new`] or
/// [`Options::from_env`], then adjust with the builder methods.
#[derive(Clone, Debug)]
pub struct Options {
    /// This rank's place in the job, how to reach the others, and the settings the
    /// environment can give (`DDP_*`, see [`EnvConfig`]); the builder methods set them in
    /// code. What is unset takes its default: the timeouts [`DEFAULT_RENDEZVOUS_TIMEOUT`]
    /// and [`Backend::default_op_timeout`], the transport [`Transport::Auto`], and the secret is
    /// derived from the user's key file and the run id ([`Secret::from_key_file`]; the
    /// file is `DDP_SECRET_FILE`, else `~/.config/ddp/secret`, created if missing), which
    /// every rank must be able to read (see the crate's README, "Security").
    pub env: EnvConfig,
    /// `None`: NCCL (initialised at the first CUDA collective) when [`Options::device`] set
    /// a CUDA device (creating the group fails with [`CommError::Load`] if NCCL cannot be
    /// loaded) or one is visible and NCCL loads, else the CPU links only. `Some(Nccl)`:
    /// NCCL, initialised now.
    pub backend: Option<Backend>,
    /// Kernel socket buffer size for ring sockets in bytes; 0 (the default) leaves Linux's
    /// autotuning, which grows buffers as large as the sysctl limits allow.
    pub socket_buffer: usize,
    /// Data bytes of each shared-memory ring this rank creates: a power of two from 4 KiB
    /// to 1 GiB.
    pub shm_ring_bytes: usize,
    /// The CUDA device of this rank's NCCL collectives; `None`: with the NCCL backend,
    /// [`cuda::rank_device`](crate::cuda::rank_device) of `LOCAL_RANK` among the devices the
    /// CUDA runtime sees: `cuda:LOCAL_RANK`, or `cuda:0` for a rank bound to one GPU
    /// (`CUDA_VISIBLE_DEVICES` showing only it); where that rule finds none (or no device
    /// can be counted), `cuda:LOCAL_RANK`.
    pub cuda_device: Option<usize>,
}

impl Options {
    /// Options for rank `rank` of `world_size`, meeting at `master_addr:master_port`, every
    /// rank on this host (local rank `rank` of `world_size`: NCCL on `cuda:rank`, the store
    /// bound to `master_addr` alone), automatic backend, default timeouts (see
    /// [`EnvConfig::new`]). Ranks on several hosts give their place with [`Options::local`].
    pub fn new(
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> Self {
        Self::from_config(&EnvConfig::new(rank, world_size, master_addr, master_port))
    }

    /// Options from the environment (see [`EnvConfig`]).
    pub fn from_env() -> Result<Self, CommError> {
        Ok(Self::from_config(&EnvConfig::from_env()?))
    }

    /// Options from an already-read environment.
    pub fn from_config(env: &EnvConfig) -> Self {
        Options {
            env: env.clone(),
            backend: None,
            socket_buffer: DEFAULT_SOCKET_BUFFER,
            shm_ring_bytes: DEFAULT_SHM_RING_BYTES,
            cuda_device: None,
        }
    }

    /// Sets the device this rank trains on: a CUDA device becomes that of its NCCL
    /// collectives (default: see [`Options::cuda_device`]); the CPU changes nothing.
    pub fn device(mut self, device: tch::Device) -> Self {
        if let tch::Device::Cuda(index) = device {
            self.cuda_device = Some(index);
        }
        self
    }

    /// Chooses the backend explicitly.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Sets the rendezvous timeout (also the least time NCCL communicator init is given:
    /// see [`Options::op_timeout`]). A timeout of 10^9 s (about 31 years) or more is taken
    /// as 10^9 s, the most `DDP_RDZV_TIMEOUT_S` accepts: `Duration::MAX` waits that long.
    pub fn rendezvous_timeout(mut self, timeout: Duration) -> Self {
        self.env.rendezvous_timeout = Some(timeout.min(MAX_TIMEOUT));
        self
    }

    /// Sets how long one collective may take. A timed-out collective then spends up to
    /// three heartbeat intervals (`op_timeout / 20`, clamped to 100 ms ..= 1 s; at least
    /// 500 ms in all) finding out which rank is hung, before it returns
    /// [`CommError::Timeout`]. NCCL communicator init, a meeting of every rank like the
    /// rendezvous (and about a second for the first one in a process), may take the longer
    /// of this and the rendezvous timeout. A timeout of 10^9 s or more is taken as 10^9 s,
    /// as for [`Options::rendezvous_timeout`].
    pub fn op_timeout(mut self, timeout: Duration) -> Self {
        self.env.op_timeout = Some(timeout.min(MAX_TIMEOUT));
        self
    }

    /// Sets the run id (and with it the fallback secret, see [`Options::env`]).
    pub fn run_id(mut self, run_id: impl Into<String>) -> Self {
        self.env.run_id = run_id.into();
        self
    }

    /// Sets the secret every rank must prove (the same on every rank).
    pub fn with_secret(mut self, secret: Secret) -> Self {
        self.env.secret = Some(secret);
        self
    }

    /// Chooses the transport between ranks on one host (TCP is for comparison and
    /// debugging; `DDP_TRANSPORT=tcp` does the same from the environment).
    pub fn transport(mut self, transport: Transport) -> Self {
        self.env.transport = Some(transport);
        self
    }

    /// Replaces this rank's detected host identity (host name, boot id, network
    /// namespace): ranks with equal identities use shared memory. Like `NCCL_HOSTID`
    /// (`DDP_HOST_ID` from the environment).
    pub fn host_id(mut self, id: impl Into<String>) -> Self {
        self.env.host_id = Some(id.into());
        self
    }

    /// Sets the node-local rank and world size.
    pub fn local(mut self, local_rank: usize, local_world_size: usize) -> Self {
        self.env.local_rank = local_rank;
        self.env.local_world_size = local_world_size;
        self.env.local_world_size_guessed = false;
        self.env.local_rank_given = true;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_from_the_environment_carry_every_setting() {
        let config = EnvConfig::from_lookup(|k| {
            let v = match k {
                "RANK" => "1",
                "WORLD_SIZE" => "4",
                "LOCAL_RANK" => "1",
                "LOCAL_WORLD_SIZE" => "2",
                "MASTER_ADDR" => "node7",
                "MASTER_PORT" => "29400",
                "DDP_RUN_ID" => "r9",
                "DDP_OP_TIMEOUT_S" => "7",
                "DDP_TRANSPORT" => "tcp",
                "DDP_HOST_ID" => "node7",
                _ => return None,
            };
            Some(v.to_string())
        })
        .unwrap();
        let o = Options::from_config(&config).backend(Backend::Cpu);
        assert_eq!(o.env, config);
        let e = &o.env;
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (1, 4, 1, 2)
        );
        assert_eq!(
            (e.master_addr.as_str(), e.master_port, e.run_id.as_str()),
            ("node7", 29400, "r9")
        );
        assert_eq!(e.op_timeout, Some(Duration::from_secs(7)));
        assert_eq!(e.rendezvous_timeout, None);
        assert_eq!(e.transport, Some(Transport::Tcp));
        assert_eq!(e.host_id.as_deref(), Some("node7"));
        assert_eq!(o.backend, Some(Backend::Cpu));
        assert_eq!(o.socket_buffer, DEFAULT_SOCKET_BUFFER);
        assert_eq!(o.shm_ring_bytes, DEFAULT_SHM_RING_BYTES);
    }

    #[test]
    fn options_in_code_put_every_rank_on_one_host_and_builders_set_them() {
        let o = Options::new(2, 3, "10.0.0.1", 29500);
        let e = &o.env;
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (2, 3, 2, 3)
        );
        assert_eq!((e.master_addr.as_str(), e.master_port), ("10.0.0.1", 29500));
        assert_eq!(e.run_id, "ddp-comm");
        assert_eq!(
            (e.secret.clone(), e.agent_store, e.restart_count),
            (None, false, 0)
        );
        assert_eq!((e.rendezvous_timeout, e.op_timeout), (None, None));
        assert_eq!((e.transport, e.host_id.clone()), (None, None));
        assert_eq!(o.backend, None);

        let secret = Secret::from_hex(&"5".repeat(32)).unwrap();
        let o = o
            .backend(Backend::Nccl)
            .rendezvous_timeout(Duration::from_secs(3))
            .op_timeout(Duration::from_secs(4))
            .run_id("job")
            .with_secret(secret.clone())
            .transport(Transport::Tcp)
            .host_id("h")
            .local(0, 1);
        let e = &o.env;
        assert_eq!(o.backend, Some(Backend::Nccl));
        assert_eq!(e.rendezvous_timeout, Some(Duration::from_secs(3)));
        assert_eq!(e.op_timeout, Some(Duration::from_secs(4)));
        assert_eq!((e.run_id.as_str(), e.secret.clone()), ("job", Some(secret)));
        assert_eq!(e.transport, Some(Transport::Tcp));
        assert_eq!(e.host_id.as_deref(), Some("h"));
        assert_eq!((e.local_rank, e.local_world_size), (0, 1));
    }

    #[test]
    fn backends_are_named_and_parsed_alike_and_tcp_still_means_the_cpu_ring() {
        for backend in [Backend::Nccl, Backend::Cpu] {
            assert_eq!(backend.to_string().parse(), Ok(backend));
        }
        assert_eq!("CPU".parse(), Ok(Backend::Cpu));
        assert_eq!("tcp".parse(), Ok(Backend::Cpu));
        assert_eq!(
            "gloo".parse::<Backend>(),
            Err("unknown backend \"gloo\" (expected cpu or nccl)".to_string())
        );
    }
}
