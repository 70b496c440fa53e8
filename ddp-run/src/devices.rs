//! Counting what ranks can run on, without libtorch: the visible NVIDIA GPUs and the cores.

use std::process::{Command, Stdio};
use std::str::FromStr;

/// GPUs this process may use: those `nvidia-smi --list-gpus` lists, narrowed by
/// `CUDA_VISIBLE_DEVICES` (an empty value hides them all). 0 without `nvidia-smi`.
pub fn visible_gpus() -> usize {
    narrow_by_visible_devices(
        listed_gpus(),
        std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
    )
}

/// The GPUs `nvidia-smi --list-gpus` lists; 0 where it cannot run or fails. In a process
/// that ignores SIGCHLD (a parent's `SIG_IGN` survives exec) the kernel reaps nvidia-smi
/// itself and its exit cannot be waited for (ECHILD): its listing then counts as it is.
fn listed_gpus() -> usize {
    let Ok(mut child) = Command::new("nvidia-smi")
        .arg("--list-gpus")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    else {
        return 0;
    };
    let mut listing = Vec::new();
    let read = child
        .stdout
        .take()
        .map(|mut out| std::io::Read::read_to_end(&mut out, &mut listing));
    let succeeded = match child.wait() {
        Ok(status) => status.success(),
        Err(e) => e.raw_os_error() == Some(libc::ECHILD),
    };
    if !succeeded || !matches!(read, Some(Ok(_))) {
        return 0;
    }
    String::from_utf8_lossy(&listing)
        .lines()
        .filter(|l| l.starts_with("GPU "))
        .count()
}

/// `listed` GPUs as seen through `CUDA_VISIBLE_DEVICES` = `visible` (None: unset). As CUDA
/// reads it, the list ends at its first entry that is neither an index of a listed GPU nor
/// a `GPU-`/`MIG-` UUID: `-1` hides every GPU, `0,2,-1,1` shows two.
fn narrow_by_visible_devices(listed: usize, visible: Option<&str>) -> usize {
    let valid = |entry: &str| {
        entry.parse::<usize>().is_ok_and(|i| i < listed)
            || entry.starts_with("GPU-")
            || entry.starts_with("MIG-")
    };
    match visible {
        None => listed,
        Some(v) => v
            .split(',')
            .map(str::trim)
            .take_while(|e| valid(e))
            .count()
            .min(listed),
    }
}

/// Refuses `ranks` ranks of one GPU each where fewer GPUs than that, but some, are
/// `visible` (a rank past the last would fail, after the start, for want of its device):
/// `asked` is the flag that asked for them, with its value (`--gpus 3`), `instead` what the
/// user may give instead.
pub fn refuse_more_ranks_than_gpus(
    asked: &str,
    ranks: usize,
    visible: usize,
    instead: &str,
) -> Result<(), crate::LaunchError> {
    if visible == 0 || ranks <= visible {
        return Ok(());
    }
    Err(crate::LaunchError::Invalid(format!(
        "{asked} asks for more GPUs than the {visible} visible here (nvidia-smi and \
         CUDA_VISIBLE_DEVICES); use {instead}"
    )))
}

/// Cores this process may run on: its affinity mask, as torch's `cpu_count` counts them
/// for torchrun's `--nproc-per-node cpu` (a cgroup's CPU quota does not lower it); at least 1.
pub fn available_cores() -> usize {
    // SAFETY: `set` is a plain bit set that sched_getaffinity fills; CPU_COUNT reads it.
    let from_mask = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        (libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0)
            .then(|| libc::CPU_COUNT(&set) as usize)
    };
    from_mask
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// torchrun's `--nproc-per-node`: a number, or one rank per device of a kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NprocPerNode {
    /// Exactly this many ranks.
    Count(usize),
    /// One rank per visible GPU (an error when there is none).
    Gpu,
    /// One rank per available core.
    Cpu,
    /// One rank per visible GPU, else one per core.
    Auto,
}

impl NprocPerNode {
    /// The number of ranks on this machine.
    pub fn resolve(self) -> Result<usize, crate::LaunchError> {
        match self {
            Self::Count(n) => Ok(n),
            Self::Cpu => Ok(available_cores()),
            Self::Gpu => match visible_gpus() {
                0 => Err(crate::LaunchError::Invalid(
                    "--nproc-per-node gpu: no GPU is visible here (nvidia-smi lists none, or \
                     CUDA_VISIBLE_DEVICES hides them); give a number of ranks or `cpu`"
                        .to_string(),
                )),
                n => Ok(n),
            },
            Self::Auto => Ok(match visible_gpus() {
                0 => available_cores(),
                n => n,
            }),
        }
    }
}

impl std::fmt::Display for NprocPerNode {
    /// As the flag takes it: the number, or `gpu`, `cpu`, `auto`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Count(n) => write!(f, "{n}"),
            Self::Gpu => f.write_str("gpu"),
            Self::Cpu => f.write_str("cpu"),
            Self::Auto => f.write_str("auto"),
        }
    }
}

impl FromStr for NprocPerNode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "gpu" => Ok(Self::Gpu),
            "cpu" => Ok(Self::Cpu),
            "auto" => Ok(Self::Auto),
            _ => s.parse().map(Self::Count).map_err(|_| {
                format!("'{s}' is not a number of ranks, nor one of `gpu`, `cpu`, `auto`")
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_visible_devices_narrows_the_listed_gpus() {
        assert_eq!(narrow_by_visible_devices(4, None), 4);
        assert_eq!(narrow_by_visible_devices(4, Some("")), 0);
        assert_eq!(narrow_by_visible_devices(4, Some("2,3")), 2);
        assert_eq!(narrow_by_visible_devices(1, Some("0,1,2")), 1);
        assert_eq!(narrow_by_visible_devices(0, Some("0")), 0);
        // CUDA stops at the first entry that names no device.
        assert_eq!(narrow_by_visible_devices(4, Some("-1")), 0);
        assert_eq!(narrow_by_visible_devices(4, Some("0,2,-1,1")), 2);
        assert_eq!(narrow_by_visible_devices(4, Some("1,,2")), 1);
        assert_eq!(narrow_by_visible_devices(2, Some("GPU-8e3a, 1, 5, 0")), 2);
    }

    #[test]
    fn more_ranks_than_visible_gpus_are_refused_when_some_are_visible() {
        let refuse = |ranks, visible| {
            refuse_more_ranks_than_gpus("--gpus 3", ranks, visible, "--gpus 2")
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            refuse(3, 2),
            Err(
                "--gpus 3 asks for more GPUs than the 2 visible here (nvidia-smi and \
                 CUDA_VISIBLE_DEVICES); use --gpus 2"
                    .to_string()
            )
        );
        assert_eq!(refuse(2, 2), Ok(()));
        assert_eq!(refuse(1, 2), Ok(()));
        // None visible: what the ranks meet then (a CPU, an error naming CUDA) is the
        // launcher's to say.
        assert_eq!(refuse(3, 0), Ok(()));
    }

    /// The cores are the affinity mask's, as the kernel lists them in `Cpus_allowed_list`
    /// (`0-3,8`: 5 cores).
    #[test]
    fn the_cores_are_those_of_the_affinity_mask() {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let list = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim();
        let count: usize = list
            .split(',')
            .map(|range| match range.split_once('-') {
                Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
                None => 1,
            })
            .sum();
        assert_eq!(available_cores(), count, "Cpus_allowed_list: {list}");
    }

    #[test]
    fn nproc_per_node_takes_torchruns_words() {
        assert_eq!("4".parse(), Ok(NprocPerNode::Count(4)));
        assert_eq!("gpu".parse(), Ok(NprocPerNode::Gpu));
        assert_eq!("cpu".parse(), Ok(NprocPerNode::Cpu));
        assert_eq!("auto".parse(), Ok(NprocPerNode::Auto));
        assert_eq!(
            "four".parse::<NprocPerNode>(),
            Err("'four' is not a number of ranks, nor one of `gpu`, `cpu`, `auto`".to_string())
        );
        assert_eq!(NprocPerNode::Cpu.resolve().unwrap(), available_cores());
        for word in ["4", "gpu", "cpu", "auto"] {
            assert_eq!(word.parse::<NprocPerNode>().unwrap().to_string(), word);
        }
    }
}
