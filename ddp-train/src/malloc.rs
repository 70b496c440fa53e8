//! glibc allocator settings for training processes.
//!
//! One ConvNet activation at 224 px and batch 16 is about 100 MB. glibc serves allocations
//! that large with `mmap` and returns them with `munmap` (its dynamic mmap threshold stops
//! at 32 MB), so every step maps, faults in and zeroes hundreds of megabytes afresh: measured
//! at 7.3 s of system time in 19 s of CPU for a one-rank run. Keeping freed memory in the
//! heap instead (no mmap for large blocks, no trimming) made the same steps 1.4x-1.7x faster
//! (`cargo xtask bench` runs ours and PyTorch with these settings in its training
//! comparisons, and also times PyTorch's random-tensor training with glibc's defaults). A
//! training process reaches its peak memory in the first step and stays there, so keeping
//! it costs nothing.

/// Tells glibc to keep freed memory for reuse (`M_MMAP_MAX = 0`, and `M_TRIM_THRESHOLD = -1`,
/// which mallopt(3) defines as "no trimming at all"), unless the user chose otherwise through `MALLOC_MMAP_MAX_` or
/// `MALLOC_TRIM_THRESHOLD_`. Returns whether the settings were applied. Call it first thing
/// in `main`, before large allocations.
pub fn keep_freed_memory() -> bool {
    if std::env::var_os("MALLOC_MMAP_MAX_").is_some()
        || std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_some()
    {
        return false;
    }
    apply()
}

/// The `mallopt` parameters and values [`keep_freed_memory`] sets. A value is a C `int`:
/// a threshold above 2 GiB cannot be written (`16 << 30` as an `int` is 0, which trims on
/// every free), so trimming is turned off with -1 instead.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const SETTINGS: [(libc::c_int, libc::c_int); 2] =
    [(libc::M_MMAP_MAX, 0), (libc::M_TRIM_THRESHOLD, -1)];

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply() -> bool {
    SETTINGS.iter().all(|&(parameter, value)| {
        // SAFETY: mallopt only changes allocator parameters, under glibc's own locks, and
        // both values are valid for their parameters (mallopt(3)).
        unsafe { libc::mallopt(parameter, value) == 1 }
    })
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply() -> bool {
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn applies_on_glibc() {
        // The test harness sets neither variable.
        assert_eq!(
            super::keep_freed_memory(),
            cfg!(all(target_os = "linux", target_env = "gnu"))
        );
    }

    /// Runs [`worker_keeps_freed_memory`] in a child process whose threads share glibc's
    /// main arena (`MALLOC_ARENA_MAX=1`): a test thread's own arena maps a block larger than
    /// its 64 MiB heaps apart whatever the settings, while the main arena, where a training
    /// process does its forward and backward, keeps or trims it as they say.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn freed_memory_stays_with_the_process() {
        let out = ddp_testkit::ignored_test("malloc::tests::worker_keeps_freed_memory")
            .env("MALLOC_ARENA_MAX", "1")
            .env_remove("MALLOC_MMAP_MAX_")
            .env_remove("MALLOC_TRIM_THRESHOLD_")
            .output()
            .unwrap();
        ddp_testkit::assert_passed(&out);
    }

    #[test]
    #[ignore = "started by freed_memory_stays_with_the_process"]
    fn worker_keeps_freed_memory() {
        let resident = || {
            let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
            let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
            // SAFETY: sysconf has no preconditions.
            pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize
        };
        assert!(super::keep_freed_memory());
        for round in 0..2 {
            let block = std::hint::black_box(vec![1u8; 256 << 20]);
            let peak = resident();
            drop(block);
            let after = resident();
            // With trimming on every free (a threshold of 0), `after` is 256 MiB lower.
            assert!(
                after + (32 << 20) >= peak,
                "round {round}: {} MiB resident after freeing 256 MiB, {} MiB before",
                after >> 20,
                peak >> 20
            );
        }
    }
}
