//! [`RuntimeSettings`]: where and how a rank runs (its device, threads, loader, time limits,
//! logging), and [`DeviceChoice`].

use serde::{Deserialize, Serialize};

use crate::error::SettingError;

/// Which device a rank trains on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// `cuda:LOCAL_RANK` when CUDA is available, else the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// `cuda:LOCAL_RANK`; an error when CUDA is not available.
    Cuda,
}

impl DeviceChoice {
    /// The device of the rank with `local_rank` on its machine: `ddp_comm::cuda::rank_device`'s
    /// (`cuda:local_rank`, or `cuda:0` for a rank bound to one GPU; CUDA is made visible
    /// first, see `ddp_comm::cuda::load_torch_cuda`) or the CPU. An error names
    /// what is missing when `Cuda` is asked for without CUDA, or for a rank without a GPU.
    pub fn resolve(self, local_rank: usize) -> Result<tch::Device, crate::TrainError> {
        if self == Self::Cpu {
            return Ok(tch::Device::Cpu);
        }
        // rustc links with --as-needed, so libtorch_cuda must be loaded before asking tch.
        let loaded = ddp_comm::cuda::load_torch_cuda().unwrap_or(false);
        let available = loaded && tch::Cuda::is_available();
        match (self, available) {
            (Self::Cuda, false) => Err(cuda_unavailable(
                &ddp_comm::cuda::no_gpu_reason().unwrap_or_else(|| "no device".into()),
            )
            .into()),
            (_, true) => {
                let count = tch::Cuda::device_count() as usize;
                let bound = std::env::var_os("CUDA_VISIBLE_DEVICES").is_some();
                match ddp_comm::cuda::rank_device(local_rank, count, bound) {
                    Ok(index) => Ok(tch::Device::Cuda(index)),
                    Err(ddp_comm::CommError::InvalidArgument(why)) => {
                        Err(crate::TrainError::Invalid(why))
                    }
                    Err(e) => Err(e.into()),
                }
            }
            (_, false) => Ok(tch::Device::Cpu),
        }
    }
}

/// The error of the device `cuda` where CUDA cannot be used, for the reason `why`.
/// `cargo xtask train`, which sets each rank's device, reads "CUDA is not available here"
/// in a failed rank's last lines to name its own flag for CPU ranks (xtask's `NO_CUDA`).
fn cuda_unavailable(why: &str) -> SettingError {
    SettingError::new(
        "runtime.device",
        format!(" cuda: CUDA is not available here ({why}); set "),
    )
    .setting("runtime.device")
    .text(" to cpu")
}

/// Where and how a rank runs: its device, threads, loader, time limits, logging.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(default)]
#[non_exhaustive]
pub struct RuntimeSettings {
    /// Where each rank trains.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "runtime.device",
            long = "device",
            value_name = "DEVICE",
            value_enum,
            default_value_t = RuntimeSettings::default().device,
            help = "Device of each rank"
        )
    )]
    pub device: DeviceChoice,
    /// Intra-op threads per rank on the CPU (default: `OMP_NUM_THREADS` where set, as PyTorch
    /// takes it, else the cores divided among the ranks).
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "runtime.threads",
            long = "threads",
            value_name = "THREADS",
            help = "Intra-op threads per rank on CPU (default: OMP_NUM_THREADS where set, as \
                    PyTorch takes it, else the machine's cores shared among its ranks)"
        )
    )]
    pub threads: Option<usize>,
    /// Loader threads per rank (default: `ddp_data::default_workers`).
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "runtime.workers",
            long = "workers",
            value_name = "WORKERS",
            help = "Loader threads per rank (default: the machine's cores shared among its \
                    ranks)"
        )
    )]
    pub workers: Option<usize>,
    /// Batches the loader prepares ahead (default: 2 on the CPU, 4 on a GPU); the loader
    /// raises it to `ceil(workers / batch_size)`, so that every worker has a sample.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "runtime.prefetch",
            long = "prefetch",
            value_name = "PREFETCH",
            help = "Batches the loader threads may prepare ahead of the training step \
                    (default: 2 on the CPU, 4 on a GPU, where a slow image must not stall a \
                    fast step; at least ceil(workers / batch size), one sample per worker)"
        )
    )]
    pub prefetch: Option<usize>,
    /// Seconds a collective may take before the job fails (default: `DDP_OP_TIMEOUT_S`
    /// where set, else PyTorch's default for the backend,
    /// [`ddp_comm::Backend::default_op_timeout`]: 1800 s on CPUs, 600 s with NCCL).
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "runtime.collective_timeout_secs",
            long = "collective-timeout",
            value_name = "COLLECTIVE_TIMEOUT",
            help = "Seconds a collective may take before the job fails (a dead peer ends the \
                    job after at most this long) [default: DDP_OP_TIMEOUT_S where set, else \
                    PyTorch's: 1800 on CPUs, 600 with NCCL]"
        )
    )]
    pub collective_timeout_secs: Option<u64>,
    /// Stop cleanly, with a checkpoint, before this many seconds have passed since the job
    /// started (for a scheduler's time limit): since the launcher's start, which `ddp-run`
    /// and `cargo xtask train` give every attempt's ranks in `DDP_JOB_STARTED`, or the
    /// process's, whichever is earlier (where `/proc` cannot be read, the Trainer's creation
    /// stands for the process's start); the next start continues.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "runtime.time_limit_secs",
            long = "time-limit",
            value_name = "DURATION",
            value_parser = super::flags::parse_duration_secs,
            help = "Stop cleanly with a checkpoint before this much time has passed since the \
                    job started (the launcher's start across its restarts, else the process's; \
                    exit code 75); a start with the same --out continues. Seconds, or numbers \
                    with units (`90s`, `55m`, `4h`, `3h55m`)"
        )
    )]
    pub time_limit_secs: Option<u64>,
    /// Stop cleanly, with a checkpoint, at the next step when SIGTERM or SIGUSR1 arrives
    /// (see [`StopReason`](crate::StopReason)); when false the signals keep their previous
    /// behaviour.
    #[cfg_attr(feature = "cli", arg(skip = RuntimeSettings::default().stop_on_signals))]
    pub stop_on_signals: bool,
    /// Log a rank's loss every this many steps (0: never).
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "runtime.log_every",
            long = "log-every",
            value_name = "LOG_EVERY",
            default_value_t = RuntimeSettings::default().log_every,
            help = "Print every rank's loss every N steps (0: never), as the PyTorch tutorial \
                    does per GPU"
        )
    )]
    pub log_every: usize,
    /// Show rank 0's progress: a bar when stdout is a terminal, else a log line every tenth
    /// of an epoch. (Log lines are `tracing` events and go to `logs/rank-<r>.log`; the
    /// program's subscriber decides where else.)
    #[cfg_attr(feature = "cli", arg(skip = RuntimeSettings::default().progress))]
    pub progress: bool,
    /// Draw `curves.png` after every epoch. Only a build with the `plot` feature draws it: in
    /// one without, rank 0 says at start-up that it draws none.
    #[cfg_attr(feature = "cli", arg(skip = RuntimeSettings::default().plot))]
    pub plot: bool,
}

impl RuntimeSettings {
    /// This rank's device and intra-op thread count (`--threads`, else `OMP_NUM_THREADS`,
    /// else the cores per rank),
    /// with libtorch's CPU thread pool set to that count when the device is the CPU.
    pub(crate) fn place(
        &self,
        local_rank: usize,
        local_world_size: usize,
    ) -> Result<(tch::Device, usize), crate::TrainError> {
        let device = self.device.resolve(local_rank)?;
        let threads = thread_count(self.threads, local_world_size, |name| {
            std::env::var_os(name)
        })?;
        let torch_count = torch_threads(threads)?;
        if device == tch::Device::Cpu {
            tch::set_num_threads(torch_count);
        }
        Ok((device, threads))
    }
}

/// `threads` as libtorch's intra-op thread count, a C `int` (PyTorch bounds it by nothing
/// else); a larger count is an error naming `runtime.threads`.
pub(super) fn torch_threads(threads: usize) -> Result<i32, SettingError> {
    i32::try_from(threads).map_err(|_| {
        SettingError::new(
            "runtime.threads",
            format!(" {threads} must be at most {} (libtorch's limit)", i32::MAX),
        )
    })
}

/// A rank's intra-op threads: `threads` (`--threads`); else `OMP_NUM_THREADS`, read with
/// `env`, as PyTorch takes it (launchers set it: torchrun and `ddp-run` to 1 when a node runs
/// several ranks); else the machine's cores divided among the `local_world_size` ranks. An
/// empty `OMP_NUM_THREADS` counts as unset; another that is not a number of threads
/// libtorch takes (1 to `i32::MAX`) is an error naming it.
fn thread_count(
    threads: Option<usize>,
    local_world_size: usize,
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Result<usize, SettingError> {
    if let Some(threads) = threads {
        return Ok(threads);
    }
    let name = ddp_run::env::OMP_NUM_THREADS;
    // An empty value counts as unset, as for every variable ddp-comm reads.
    match env(name).filter(|v| !v.to_string_lossy().trim().is_empty()) {
        None => Ok(ddp_data::default_workers(local_world_size)),
        Some(value) => match value.to_str().map(|v| v.trim().parse::<usize>()) {
            Some(Ok(n)) if n > 0 && torch_threads(n).is_ok() => Ok(n),
            _ => Err(SettingError::starting(format!(
                "{name}={} is not a number of threads (1 to {}): set it to one, unset it \
                 (the cores are then divided among the ranks), or give ",
                value.to_string_lossy(),
                i32::MAX
            ))
            .setting("runtime.threads")),
        },
    }
}

impl Default for RuntimeSettings {
    fn default() -> Self {
        Self {
            device: DeviceChoice::Auto,
            threads: None,
            workers: None,
            prefetch: None,
            collective_timeout_secs: None,
            time_limit_secs: None,
            stop_on_signals: true,
            log_every: 0,
            progress: true,
            plot: true,
        }
    }
}

builder!(RuntimeSettings {
    device: DeviceChoice,
    threads: Option<usize>,
    workers: Option<usize>,
    prefetch: Option<usize>,
    collective_timeout_secs: Option<u64>,
    time_limit_secs: Option<u64>,
    stop_on_signals: bool,
    log_every: usize,
    progress: bool,
    plot: bool,
});

#[cfg(test)]
mod tests {
    use super::{thread_count, DeviceChoice, RuntimeSettings};
    use crate::{SettingError, TrainError};

    #[test]
    fn threads_are_the_flags_else_omp_num_threads_else_the_cores_per_rank() {
        let omp = |value: &'static str| {
            move |name: &str| (name == "OMP_NUM_THREADS").then(|| value.into())
        };
        assert_eq!(thread_count(None, 2, omp("1")), Ok(1));
        assert_eq!(thread_count(None, 2, omp(" 3 ")), Ok(3));
        assert_eq!(thread_count(Some(4), 2, omp("1")), Ok(4));
        assert_eq!(
            thread_count(None, 1, |_| None),
            Ok(ddp_data::default_workers(1))
        );
        for unset in ["", "  "] {
            assert_eq!(
                thread_count(None, 2, omp(unset)),
                Ok(ddp_data::default_workers(2))
            );
        }
        assert_eq!(
            thread_count(None, 2, omp("2147483647")),
            Ok(i32::MAX as usize)
        );
        // libtorch takes an int: 2^31 would be negative, 2^32 none, 2^32 + 1 one thread.
        for bad in ["abc", "0", "2147483648", "4294967296", "4294967297"] {
            let e = thread_count(None, 2, omp(bad)).unwrap_err();
            assert_eq!(
                e.render(|f| format!("--{}", f.trim_start_matches("runtime."))),
                format!(
                    "OMP_NUM_THREADS={bad} is not a number of threads (1 to 2147483647): set it \
                     to one, unset it (the cores are then divided among the ranks), or give \
                     --threads"
                )
            );
        }
        // A bad value is not read when --threads is given.
        assert_eq!(thread_count(Some(2), 2, omp("abc")), Ok(2));
    }

    #[test]
    fn more_threads_than_libtorch_takes_are_an_error_not_a_panic() {
        for threads in [1 << 31, 1 << 32, (1 << 32) + 1] {
            let runtime = RuntimeSettings::default()
                .device(DeviceChoice::Cpu)
                .threads(Some(threads));
            let e = SettingError::new(
                "runtime.threads",
                format!(" {threads} must be at most 2147483647 (libtorch's limit)"),
            );
            match runtime.place(0, 1) {
                Err(TrainError::Setting(got)) => assert_eq!(got, e),
                other => panic!("{threads} threads gave {other:?}"),
            }
        }
    }

    /// Its words are read by `cargo xtask train` (xtask's `NO_CUDA`).
    #[test]
    fn cuda_that_cannot_be_used_is_named_with_the_setting_to_change() {
        assert_eq!(
            super::cuda_unavailable("no CUDA device")
                .render(|f| format!("--{}", f.trim_start_matches("runtime."))),
            "--device cuda: CUDA is not available here (no CUDA device); set --device to cpu"
        );
    }
}
