//! `cargo xtask gpu-check`: everything that needs a GPU, in one command, for a GPU machine.
//!
//! 1. nccl-sys's loader tests and ddp-comm's NCCL tests (which skip with a printed reason
//!    where no GPU is usable; here they must run): among them, a wait after another wait's
//!    timeout aborted the communicator fails (`nccl_a_wait_after_an_abort_is_an_error`), a
//!    temporary dropped with its `Work` is not reused while in flight
//!    (`nccl_a_dropped_work_keeps_its_temporary`), collectives read inputs produced on a
//!    pool stream made current (`nccl_collectives_follow_the_current_stream`), a
//!    blocking collective does not wait for unrelated work on the default stream
//!    (`nccl_a_blocking_collective_waits_for_its_input_only`), and `wait_stream` makes the
//!    current stream wait (`nccl_wait_stream_makes_the_current_stream_wait`), each a few
//!    seconds on one GPU, and a figure, the host's time to queue a one-element
//!    `all_reduce_async` (`all_reduce_async enqueue: median`); with two GPUs, a group dropped
//!    while a collective waits for a peer that never comes is aborted, not destroyed
//!    (`nccl_peers.rs`; it says `skipped:` on one),
//! 2. the NCCL all-reduce bandwidth sweep (one rank per GPU),
//! 3. tch-ext's CUDA tests (streams, events, `record_stream`, hooks on CUDA parameters),
//!    and DDP's gradients with forward and backward on a pool stream, behind a second of
//!    queued work, against the default stream (ddp-train's `cuda_streams`, one rank per GPU:
//!    with one GPU the whole path runs, but a world of one reduces nothing, so only errors
//!    show), where SyncBatchNorm's all-reduces must also leave the host free; and the CUDA
//!    variants of ddp-train's unit tests ([`DDP_TRAIN_GPU_UNIT_TESTS`]: the fused fp16
//!    unscale on cuda:0 equals the per-parameter one; clipping equals the CPU's; a step's
//!    values come back from cuda:0 in one read; neither a compress hook's copy nor a
//!    dropped bucket is reused before the syncing stream has read it),
//! 4. ddp-data's CUDA tests and its ring tests: batches on `cuda:0` equal the CPU path's, also
//!    with a pool stream current (`cuda_batches_follow_the_current_stream`), and a consumer
//!    that holds the GPU for five batches' decoding time per step waits less than a quarter
//!    of one for each batch (`a_busy_gpu_keeps_no_worker_from_decoding`: the ring takes no
//!    slot whose copy waits behind the running step, and waits for a copy under no lock),
//! 5. the ConvNet fed by the CUDA loader from a synthetic sample (`ddp_steps --device cuda
//!    --data`; `data_median_s` is the data wait per step), a figure to read, and ResNet-50
//!    steps/s in fp16 with the fused unscale next to bf16 (the same step without a scaler) on
//!    random tensors, which fail when rank 0's loss is not finite or more than
//!    [`MAX_SKIPPED_STEPS`] steps were skipped for overflowing gradients,
//! 6. a short training on one GPU and one on every visible GPU, through the launcher, and
//!    one GPU in bf16 and in fp16.
//!
//! A GPU test that says `skipped:` fails the check, unless it needs a second GPU the machine
//! lacks: here a skip would pass for a run. The GPU tests run one at a time
//! (`--test-threads=1`): each spawns its ranks onto the same GPUs, and tests that time
//! queued work against a collective (`keep_busy`) measure nothing while others share the
//! device.
//!
//! Where the GPU machine has no cargo, the GPU bundle's `run.sh` with `xtask/gpu-extra.sh` as
//! its command runs the same steps from prebuilt binaries (`xtask/README.md`).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::launch::{self, TrainArgs};

/// Steps per epoch of the training runs: enough to exercise loading, DDP and checkpoints.
const TRAIN_STEPS: &str = "30";

pub fn run(root: &Path) -> Result<()> {
    let gpus = ddp_run::visible_gpus();
    if gpus == 0 {
        bail!(
            "gpu-check needs NVIDIA GPUs, and none is visible here (nvidia-smi lists none, or \
             CUDA_VISIBLE_DEVICES hides them); run it on a GPU machine"
        );
    }
    crate::setup::run(root, &crate::setup::SetupArgs::default())?;
    println!("gpu-check: {gpus} GPU(s) visible");
    let mut test = crate::cargo();
    test.args(["test", "-p", "nccl-sys"]);
    crate::run(root, test)?;
    run_gpu_tests(root, "ddp-comm", &["nccl", "nccl_peers"], gpus)?;
    // tch-ext's streams, events and CUDA-side hooks, and DDP on a GPU.
    run_gpu_tests(root, "tch-ext", &["cuda"], gpus)?;
    run_gpu_tests(root, "ddp-train", &["cuda_streams"], gpus)?;
    let units = gpu_unit_test_command("ddp-train", &DDP_TRAIN_GPU_UNIT_TESTS);
    run_gpu_command(root, units, gpus)?;
    let mut sweep = crate::cargo();
    sweep.args([
        "bench",
        "-p",
        "ddp-comm",
        "--bench",
        "collectives",
        "--",
        "--backend",
        "nccl",
    ]);
    crate::run(root, sweep)?;
    run_gpu_tests(root, "ddp-data", &["tensor", "ring"], gpus)?;
    feed_and_fp16(root)?;
    let runs = if gpus > 1 { vec![1, gpus] } else { vec![1] };
    // The runs' folder is removed after they all pass; a failed run's logs stay there.
    let runs_dir = private_temp_dir("gpu-check-")?;
    let runs_root = runs_dir.path().to_path_buf();
    let precisions = runs
        .iter()
        .map(|&n| (n, "fp32"))
        .chain([(1, "bf16"), (1, "fp16")]);
    for (n, precision) in precisions {
        println!("gpu-check: training on {n} GPU(s) in {precision}");
        let args = TrainArgs {
            gpus: Some(n),
            cpus: None,
            node: ddp_run::cli::NodeArgs::default(),
            out: None,
            grace: 10,
            cache: None,
            runs_root: Some(runs_root.clone()),
            bin: None,
            gen_data_bin: None,
            rest: [
                "--epochs",
                "2",
                "--max-steps-per-epoch",
                TRAIN_STEPS,
                "--precision",
                precision,
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        };
        let code = launch::run(root, args)?;
        if code != 0 {
            bail!(
                "the {precision} training on {n} GPU(s) failed (exit code {code}); its run \
                 directory, with the ranks' logs, is kept in {}",
                runs_dir.keep().display()
            );
        }
    }
    drop(runs_dir);
    println!("gpu-check: all GPU tests, the NCCL sweep and the GPU trainings passed");
    Ok(())
}

/// One GPU: the ConvNet fed by ddp-data's CUDA loader from a synthetic sample (the data wait
/// per step is `data_median_s` in the `RESULT` line), then ResNet-50 on random tensors in fp16
/// and bf16 (each a few seconds on one GPU), judged by [`precision_verdict`].
fn feed_and_fp16(root: &Path) -> Result<()> {
    let sample = private_temp_dir("gpu-check-feed-")?;
    launch::generate_sample(root, None, sample.path(), 256, 512, 0)?;
    let steps = [
        "--device",
        "cuda",
        "--ranks",
        "1",
        "--batch-size",
        "64",
        "--warmup",
        "5",
        "--steps",
        "40",
    ];
    println!("gpu-check: the CUDA loader beside a busy GPU (data wait per step: data_median_s)");
    let mut feed = crate::cargo();
    feed.args(["bench", "-p", "ddp-train", "--bench", "ddp_steps", "--"])
        .args(steps)
        .arg("--data")
        .arg(sample.path());
    crate::run(root, feed)?;
    drop(sample);
    for precision in ["fp16", "bf16"] {
        println!("gpu-check: ResNet-50 steps/s in {precision}, random tensors, 224 px");
        let mut bench = crate::cargo();
        bench
            .args(["bench", "-p", "ddp-train", "--bench", "ddp_steps", "--"])
            .args(steps)
            .args(["--image-size", "224", "--precision", precision])
            .args(["--model", "resnet50"]);
        let output = run_echoed(root, bench)?;
        let verdict = precision_verdict(&output)
            .with_context(|| format!("ResNet-50 in {precision} on random tensors"))?;
        println!("gpu-check: ResNet-50 in {precision}: {verdict}");
    }
    Ok(())
}

/// A new folder under the system's temporary directory, named `<prefix>` and random letters,
/// created exclusively with mode 0700: another user can neither guess it beforehand nor plant
/// links in it for the check's writes to follow. Dropping it removes it and what it holds.
fn private_temp_dir(prefix: &str) -> Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    // tempfile's folders default to 0777 less the umask: readable by all.
    tempfile::Builder::new()
        .prefix(prefix)
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir()
        .with_context(|| {
            format!(
                "cannot create a private folder in {}",
                std::env::temp_dir().display()
            )
        })
}

/// The most steps (of 45) a mixed-precision ResNet-50 run may skip for overflowing
/// gradients: the fp16 scaler starts at 2^16 and halves at each skip, so the first few steps
/// may overflow; a run that keeps skipping is not training. gpu-extra.sh uses the same bound.
const MAX_SKIPPED_STEPS: u64 = 5;

/// Whether a `ddp_steps` run trained: rank 0's `RESULT` line has a finite loss and at most
/// [`MAX_SKIPPED_STEPS`] skipped steps. Its loss and skipped steps, or why it failed.
fn precision_verdict(output: &str) -> Result<String> {
    let Some(line) = output
        .lines()
        .find(|l| l.starts_with("RESULT ddp_steps ") && l.contains(" rank=0 "))
    else {
        bail!("no `RESULT ddp_steps ... rank=0` line in the bench's output");
    };
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .with_context(|| format!("no {key}= in {line:?}"))
    };
    let loss: f64 = field("loss")?
        .parse()
        .with_context(|| format!("loss= is no number in {line:?}"))?;
    let skipped: u64 = field("skipped_steps")?
        .parse()
        .with_context(|| format!("skipped_steps= is no count in {line:?}"))?;
    if !loss.is_finite() {
        bail!("the loss is {loss} ({skipped} skipped steps)");
    }
    if skipped > MAX_SKIPPED_STEPS {
        bail!("{skipped} steps skipped for overflowing gradients, more than {MAX_SKIPPED_STEPS}");
    }
    Ok(format!("loss {loss}, {skipped} skipped steps"))
}

/// `cargo test` of the GPU test targets `tests` of `package`, with `--nocapture` (their
/// `skipped:` lines are read) and one test at a time: each test spawns ranks onto the same
/// GPUs, and a test that times queued work against a collective measures nothing while
/// another runs beside it.
fn gpu_test_command(package: &str, tests: &[&str]) -> Command {
    let mut cmd = crate::cargo();
    cmd.args(["test", "-p", package]);
    for test in tests {
        cmd.args(["--test", test]);
    }
    cmd.args(["--", "--nocapture", "--test-threads=1"]);
    cmd
}

/// The unit tests of ddp-train that have a CUDA variant (libtest filters; each says
/// `skipped:` without a GPU). gpu-extra.sh runs the same filters.
const DDP_TRAIN_GPU_UNIT_TESTS: [&str; 6] = [
    "amp::tests::the_fused_unscale_equals_the_per_parameter_one_in_one_flag_on_cuda",
    "amp::tests::the_fused_unscale_leaves_the_host_free_on_cuda",
    "optim::tests::clipping_on_cuda_equals_clipping_on_the_cpu",
    "trainer::reads::tests::values_of_every_shape_and_kind_come_back_in_order_on_cuda",
    "ddp::comm_hook::tests::",
    "ddp::bucket::tests::a_dropped_bucket_keeps_its_memory_until_the_dropping_stream_has_read_it",
];

/// `cargo test --lib` of `package`'s unit tests matching `filters`, as [`gpu_test_command`]
/// runs test targets (output shown, one test at a time).
fn gpu_unit_test_command(package: &str, filters: &[&str]) -> Command {
    let mut cmd = crate::cargo();
    cmd.args(["test", "-p", package, "--lib", "--"]);
    cmd.args(filters);
    cmd.args(["--nocapture", "--test-threads=1"]);
    cmd
}

/// Runs `package`'s GPU test targets `tests` (see [`gpu_test_command`]) as
/// [`run_gpu_command`] does.
fn run_gpu_tests(root: &Path, package: &str, tests: &[&str], gpus: usize) -> Result<()> {
    run_gpu_command(root, gpu_test_command(package, tests), gpus)
}

/// Runs GPU tests with `cmd`, echoing their output, and fails when a test said `skipped:`
/// although this machine has what it needs (CUDA not loadable, say): on a GPU machine a
/// skipped GPU test must not pass for a run one; and when a test binary ran none (its
/// filters name no test, and libtest says ok).
fn run_gpu_command(root: &Path, cmd: Command, gpus: usize) -> Result<()> {
    let line = format!("{cmd:?}");
    let output = run_echoed(root, cmd)?;
    let empty = |l: &str| l.starts_with("test result:") && l.contains(". 0 passed;");
    if output.lines().any(empty) {
        bail!("{line}: a test binary ran no test: its filters name none");
    }
    let skipped = unexpected_skips(&output, gpus);
    if !skipped.is_empty() {
        bail!(
            "{line}: GPU tests skipped on a machine with {gpus} GPU(s): {}",
            skipped.join("; ")
        );
    }
    Ok(())
}

/// Runs `cmd` in `root` as `crate::run` does, echoing its standard output and returning it.
fn run_echoed(root: &Path, mut cmd: Command) -> Result<String> {
    cmd.current_dir(root).stdout(Stdio::piped());
    let line = format!("{cmd:?}");
    println!("xtask: {line}");
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {line}"))?;
    let mut output = String::new();
    if let Some(out) = child.stdout.take() {
        for text in BufReader::new(out).lines() {
            let text = text.with_context(|| format!("reading the output of {line}"))?;
            println!("{text}");
            output.push_str(&text);
            output.push('\n');
        }
    }
    let status = child
        .wait()
        .with_context(|| format!("waiting for {line}"))?;
    if !status.success() {
        bail!("{line} failed ({status})");
    }
    Ok(output)
}

/// How a test that needs two GPUs says so when it skips itself (`skipped: needs two GPUs, 1
/// visible`, tch-ext's `skipped: needs 2 CUDA devices`): on a machine with one GPU, these
/// skips are expected. gpu-extra.sh excuses the same phrases.
const TWO_GPU_SKIPS: [&str; 2] = ["needs two GPUs", "needs 2 CUDA"];

/// The `skipped:` reasons in `output` that `gpus` GPUs do not explain: all but a two-GPU
/// test's on a machine with one.
fn unexpected_skips(output: &str, gpus: usize) -> Vec<String> {
    output
        .lines()
        .filter_map(|l| l.find("skipped:").map(|at| l[at..].trim().to_string()))
        .filter(|reason| {
            let needs_two = TWO_GPU_SKIPS.iter().any(|p| reason.contains(p));
            !(needs_two && gpus < 2)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_folders_are_new_private_and_removed_after() {
        use std::os::unix::fs::MetadataExt;
        let first = private_temp_dir("gpu-check-").unwrap();
        let second = private_temp_dir("gpu-check-").unwrap();
        assert_ne!(first.path(), second.path());
        for dir in [&first, &second] {
            let meta = std::fs::symlink_metadata(dir.path()).unwrap();
            assert!(meta.is_dir(), "{} is a link", dir.path().display());
            assert_eq!(meta.mode() & 0o777, 0o700, "{}", dir.path().display());
            // SAFETY: getuid(2) has no preconditions and cannot fail.
            assert_eq!(meta.uid(), unsafe { libc::getuid() });
            let name = dir.path().file_name().unwrap().to_str().unwrap();
            let suffix = name.strip_prefix("gpu-check-").unwrap();
            assert!(suffix.len() >= 6 && !suffix.contains(&std::process::id().to_string()));
        }
        let path = first.path().to_path_buf();
        std::fs::write(path.join("0_left.jpg"), b"x").unwrap();
        drop(first);
        assert!(!path.exists());
    }

    #[test]
    fn only_a_missing_second_gpu_excuses_a_skip() {
        let output = "test a ... skipped: needs two GPUs, 1 visible\nok\n\
                      test b ... skipped: no CUDA device (libcudart not found)\n\
                      skipped: needs 2 CUDA devices\n";
        assert_eq!(
            unexpected_skips(output, 1),
            ["skipped: no CUDA device (libcudart not found)"]
        );
        assert_eq!(unexpected_skips(output, 2).len(), 3);
        assert!(unexpected_skips("test result: ok. 3 passed\n", 1).is_empty());
    }

    #[test]
    fn every_gpu_test_runs_alone_with_its_output_shown() {
        let cmd = gpu_test_command("ddp-data", &["tensor", "ring"]);
        let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy()).collect();
        assert_eq!(
            args,
            [
                "test",
                "-p",
                "ddp-data",
                "--test",
                "tensor",
                "--test",
                "ring",
                "--",
                "--nocapture",
                "--test-threads=1"
            ]
        );
    }

    #[test]
    fn a_mixed_precision_run_fails_on_a_bad_loss_or_many_skipped_steps() {
        let run = |loss: &str, skipped: u64| {
            let output = format!(
                "RESULT ddp_steps source=random world=1 rank=1 loss=0.5 skipped_steps=0\n\
                 RESULT ddp_steps source=random world=1 rank=0 images_per_sec=900.0 \
                 loss={loss} precision=fp16 loss_scale=8192 skipped_steps={skipped}\n"
            );
            precision_verdict(&output).map_err(|e| e.to_string())
        };
        assert_eq!(run("0.69310", 3).unwrap(), "loss 0.6931, 3 skipped steps");
        assert!(run("NaN", 0).unwrap_err().contains("the loss is NaN"));
        assert!(run("inf", 0).unwrap_err().contains("the loss is inf"));
        let many = run("0.69310", MAX_SKIPPED_STEPS + 1).unwrap_err();
        assert!(
            many.contains("steps skipped for overflowing gradients"),
            "{many}"
        );
        assert!(precision_verdict("test result: ok\n").is_err());
    }

    #[test]
    fn gpu_extra_applies_the_same_rules() {
        // The shell script on the machine without cargo must judge as this command does.
        let script = include_str!("../gpu-extra.sh");
        for phrase in TWO_GPU_SKIPS {
            assert!(
                script.contains(&format!("-e '{phrase}'")),
                "gpu-extra.sh does not excuse `{phrase}`"
            );
        }
        assert!(script.contains(&format!("MAX_SKIPPED_STEPS={MAX_SKIPPED_STEPS}\n")));
        assert!(script.contains("--test-threads=1"));
        for filter in DDP_TRAIN_GPU_UNIT_TESTS {
            assert!(
                script.contains(&format!(" {filter} ")),
                "gpu-extra.sh does not run ddp-train's `{filter}`"
            );
        }
        assert!(
            script.contains(". 0 passed'"),
            "gpu-extra.sh ignores an empty run"
        );
    }

    /// Each filter names a test (or a test module) of ddp-train's source: a renamed test
    /// would leave its filter running nothing on the GPU machine.
    #[test]
    fn the_gpu_unit_test_filters_name_tests_that_exist() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ddp-train/src");
        for filter in DDP_TRAIN_GPU_UNIT_TESTS {
            let (module, test) = filter.split_once("::tests::").unwrap();
            let file = src.join(format!("{}.rs", module.replace("::", "/")));
            let text = std::fs::read_to_string(&file).unwrap();
            let wanted = match test {
                "" => "mod tests {".to_string(),
                name => format!("fn {name}()"),
            };
            assert!(
                text.contains(&wanted),
                "{}: no `{wanted}` for the filter {filter}",
                file.display()
            );
        }
    }

    #[test]
    fn gpu_unit_tests_run_filtered_alone_with_their_output_shown() {
        let cmd = gpu_unit_test_command("ddp-train", &["a::", "b::c"]);
        let args: Vec<_> = cmd.get_args().map(|a| a.to_string_lossy()).collect();
        assert_eq!(
            args,
            [
                "test",
                "-p",
                "ddp-train",
                "--lib",
                "--",
                "a::",
                "b::c",
                "--nocapture",
                "--test-threads=1"
            ]
        );
    }
}
