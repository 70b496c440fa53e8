//! Creating a communicator: a non-blocking `ncclCommInitRankConfig`, polled until it is
//! done, it fails, or the timeout passes (the module's documentation says why).

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_sys::{ncclComm_t, ncclConfig_t, ncclResult_t, ncclUniqueId, Cudart, Nccl};

use super::inflight::InFlight;
use super::{check_cuda, last_error, nccl_text, settle, NcclComm, Unsettled};
use crate::error::{CommError, Diagnosis};
use crate::store::heartbeat::Heartbeat;

impl NcclComm {
    /// `cudaSetDevice(device)`, then a non-blocking `ncclCommInitRankConfig`, polled until
    /// it is done, it fails, or `init_timeout` passes (see the module's documentation); its
    /// collectives then time out after `op_timeout`.
    pub(crate) fn init(
        rank: usize,
        world: usize,
        device: usize,
        id: ncclUniqueId,
        init_timeout: Duration,
        op_timeout: Duration,
        heartbeat: Arc<Heartbeat>,
    ) -> Result<Self, CommError> {
        let nccl = Nccl::load()?;
        let cudart = Cudart::load()?;
        let ordinal = device as c_int;
        // SAFETY: plain CUDA runtime call with a device ordinal.
        check_cuda("cudaSetDevice", unsafe { (cudart.cudaSetDevice)(ordinal) })?;
        let failed = |what: String, diagnosis: Diagnosis| CommError::NcclInit {
            rank,
            device,
            what,
            diagnosis: Box::new(diagnosis),
        };
        let abort = |comm: ncclComm_t| {
            if !comm.is_null() {
                // SAFETY: `comm` came from ncclCommInitRankConfig and is not used again.
                unsafe { (nccl.ncclCommAbort)(comm) };
            }
        };
        let mut config = ncclConfig_t::initializer();
        config.blocking = 0;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let start = Instant::now();
        // SAFETY: `comm` is a valid out-pointer, `config` a valid config that outlives the
        // call (NCCL copies it); `id` is passed by value as the C API expects.
        let rc = unsafe {
            (nccl.ncclCommInitRankConfig)(&mut comm, world as c_int, id, rank as c_int, &mut config)
        };
        let nccl_failed = |prefix: &str, rc: ncclResult_t| {
            let what = format!(
                "failed: {prefix}{} {}",
                nccl_text(nccl, rc),
                last_error(nccl, comm)
            );
            abort(comm);
            Err(failed(what.trim_end().to_string(), Diagnosis::default()))
        };
        if rc != ncclResult_t::ncclSuccess && rc != ncclResult_t::ncclInProgress {
            return nccl_failed("ncclCommInitRankConfig: ", rc);
        }
        if comm.is_null() {
            let what = "failed: ncclCommInitRankConfig returned no communicator".to_string();
            return Err(failed(what, Diagnosis::default()));
        }
        match settle(nccl, comm, "ncclCommInitRankConfig", start, init_timeout) {
            Ok(()) => {}
            Err(Unsettled::Failed { rc, .. }) => return nccl_failed("", rc),
            Err(Unsettled::TimedOut) => {
                // Diagnose first: the heartbeats say which rank never joined.
                let diagnosis = heartbeat.diagnose();
                abort(comm);
                let what = format!("timed out after {init_timeout:?}");
                return Err(failed(what, diagnosis));
            }
        }
        Ok(NcclComm {
            nccl,
            cudart,
            comm,
            side: None,
            device: ordinal,
            timeout: op_timeout,
            inflight: InFlight::new(),
            heartbeat,
        })
    }
}
