// The one count of the cores a machine's ranks share, `include!`d by ddp-data
// (`loader.rs`: `default_workers`, which is also a rank's default intra-op threads) and xtask
// (`launch.rs`: each rank's `--threads`), which share no crate that could hold it (xtask
// builds without ddp-data, and ddp-data knows nothing of launchers).

/// The cores this process may run on, as `std::thread::available_parallelism` counts them
/// (its affinity mask, lowered by a cgroup's CPU quota, e.g. `docker --cpus`), shared among
/// the `processes` of its machine: at least 1 each. torchrun's `--nproc-per-node cpu`
/// counts the affinity mask alone (`ddp_run::available_cores`).
fn cores_per_process(processes: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    share_cores(cores, processes)
}

/// `cores` shared among `processes`: at least 1 each ([`cores_per_process`]' arithmetic).
fn share_cores(cores: usize, processes: usize) -> usize {
    (cores / processes.max(1)).max(1)
}
