//! `--nproc-per-node`: a training program that starts its own ranks by running its own
//! executable again, through `ddp-run`'s library, with `ddp-run`'s supervision and messages.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use ddp_comm::EnvSource;
use ddp_run::cli::Wording;
use ddp_run::{LaunchConfig, NprocPerNode};

use crate::error::TrainError;
use crate::DeviceChoice;

/// The flag's spellings, as `ddp-run` (and torchrun) take them.
const SPELLINGS: [&str; 2] = ["--nproc-per-node", "--nproc_per_node"];

/// Starts `nproc` ranks of this program on `device` with this process's arguments minus
/// `--nproc-per-node`, in the run directory `out` (or a new one, passed to the ranks as
/// `--out`), and supervises them until the job ends; returns the job's exit status.
pub(super) fn start_ranks(
    out: Option<&Path>,
    device: DeviceChoice,
    nproc: NprocPerNode,
) -> anyhow::Result<ExitCode> {
    let run_id = run_id_for_ranks(nproc, |name| std::env::var(name).ok())?;
    refuse_more_ranks_than_gpus(nproc, device, ddp_run::visible_gpus)?;
    let ranks = nproc.resolve()?;
    let exe = std::env::current_exe()
        .context("cannot find this program's executable to start its ranks from")?;
    let run_dir = out.map_or_else(crate::trainer::default_run_dir, Path::to_path_buf);
    let chosen = out.is_none().then_some(run_dir.as_path());
    let argv: Vec<OsString> = std::env::args_os().collect();
    let given = argv.get(1..).unwrap_or_default();
    // torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, as ddp-run reads it.
    let config = LaunchConfig {
        log_dir: Some(run_dir.join("logs")),
        run_id,
        ..LaunchConfig::new(&exe, ranks).args(rank_args(given, chosen))
    }
    .torchrun_shutdown_timeout()?;
    let name = exe
        .file_name()
        .map_or_else(|| "launcher".into(), |n| n.to_string_lossy());
    let wording = wording(&config, &argv, chosen);
    Ok(ddp_run::cli::launch_and_report_with(
        &config, &name, &wording,
    )?)
}

/// The advice of `ddp-run`'s messages in this program's words, for the job of `config`
/// started by `argv`, in the run directory `chosen` when it chose one.
fn wording(config: &LaunchConfig, argv: &[OsString], chosen: Option<&Path>) -> Wording {
    Wording {
        longer_shutdown: format!(
            "the launcher's shutdown timeout ({} s with --nproc-per-node): set \
             TORCH_ELASTIC_SHUTDOWN_TIMEOUT=SECONDS, or start the ranks with `ddp-run \
             --shutdown-timeout SECONDS`",
            config.shutdown_timeout.as_secs()
        ),
        // A start without --out makes a new run directory: the command that returns to this
        // one.
        to_continue: match chosen {
            Some(dir) => format!(
                "this command continues it in {}:\n  {}",
                dir.display(),
                continue_command(argv, dir)
            ),
            None => "the same command continues it".into(),
        },
        master_port: "one: start the ranks with `ddp-run --master-port PORT`".into(),
        log_dir: "--out (the rank logs go to its logs/ folder)".into(),
    }
}

/// Refuses a number of ranks above the GPUs that `visible` counts, where some are and the
/// ranks may take one each (`--device` auto or cuda): the ranks past the last GPU would
/// fail once started.
fn refuse_more_ranks_than_gpus(
    nproc: NprocPerNode,
    device: DeviceChoice,
    visible: impl FnOnce() -> usize,
) -> Result<(), ddp_run::LaunchError> {
    match (nproc, device) {
        (NprocPerNode::Count(n), DeviceChoice::Auto | DeviceChoice::Cuda) => {
            ddp_run::refuse_more_ranks_than_gpus(
                &format!("--nproc-per-node {n}"),
                n,
                visible(),
                "--nproc-per-node gpu (a rank per GPU) or --device cpu",
            )
        }
        _ => Ok(()),
    }
}

/// The run id to give the ranks, from the environment that `lookup` reads: the one this
/// process would have as the one rank of its job (`DDP_RUN_ID`, else SLURM's, in its batch
/// script or a step of one task), which the ranks would lose to the launcher's fresh
/// `TORCHELASTIC_RUN_ID`: with it a requeued job names the same job and continues its run.
/// `None` (a fresh id) when none is set. Fails as [`refuse_inside_a_launcher`].
fn run_id_for_ranks(
    nproc: NprocPerNode,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Option<String>, TrainError> {
    let source = refuse_inside_a_launcher(nproc, &lookup)?;
    Ok(ddp_comm::EnvConfig::run_id_from_lookup(source, lookup)?)
}

/// Fails when this process already is one of a launcher's ranks (torchrun's `RANK` and
/// `WORLD_SIZE`, as `ddp-run` sets them, or an `srun` step of several tasks): starting
/// ranks from each of them would run N times as many processes as asked for. Else where its
/// place in a job comes from: nowhere (`Single`), or SLURM (its batch script, or a step of
/// one task).
fn refuse_inside_a_launcher(
    nproc: NprocPerNode,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<EnvSource, TrainError> {
    let conflict = |what: String| {
        Err(TrainError::Invalid(format!(
            "--nproc-per-node {nproc} starts this program's ranks, but {what}: drop \
             --nproc-per-node when a launcher (ddp-run, torchrun, srun) starts the ranks, or \
             run the program without the launcher"
        )))
    };
    match ddp_comm::EnvConfig::from_lookup(lookup) {
        Ok(env) => match env.source {
            // `Code` is never read from the environment.
            source @ (EnvSource::Single | EnvSource::Code) => Ok(source),
            EnvSource::Slurm if env.world_size == 1 => Ok(EnvSource::Slurm),
            EnvSource::Torchrun => conflict(format!(
                "this process already is rank {} of {} started by a launcher (RANK and \
                 WORLD_SIZE are set)",
                env.rank, env.world_size
            )),
            EnvSource::Slurm => conflict(format!(
                "this process already is rank {} of {} started by SLURM (SLURM_PROCID and \
                 SLURM_NTASKS are set)",
                env.rank, env.world_size
            )),
        },
        // SLURM's batch script (SLURM_PROCID without SLURM_STEP_ID) is no launcher's rank:
        // the ranks it starts are the job's.
        Err(ddp_comm::CommError::MissingEnv { var, .. }) if var == "SLURM_STEP_ID" => {
            Ok(EnvSource::Slurm)
        }
        Err(err) => Err(TrainError::Invalid(format!(
            "--nproc-per-node {nproc}: cannot tell whether a launcher started this process: \
             {}",
            crate::error::with_causes(&err)
        ))),
    }
}

/// `argv` (the program first) with `--out OUT` in front of `--nproc-per-node`, quoted for a
/// POSIX shell: the command that continues a run started by `argv`, without `--out`, in the
/// run directory `out` that it chose.
fn continue_command(argv: &[OsString], out: &Path) -> String {
    let at = argv
        .iter()
        .take_while(|a| *a != "--")
        .position(|a| nproc_flag(a).is_some())
        .unwrap_or(argv.len().min(1));
    let mut words: Vec<String> = argv.iter().map(|a| a.to_string_lossy().into()).collect();
    let out = out.to_string_lossy().into_owned();
    words.splice(at..at, ["--out".to_owned(), out]);
    ddp_run::cli::shell_command(&words)
}

/// Whether `arg` is `--nproc-per-node` (either spelling): `Some(true)` alone, its value next,
/// `Some(false)` as `--nproc-per-node=N`.
fn nproc_flag(arg: &OsStr) -> Option<bool> {
    let bytes = arg.as_encoded_bytes();
    let spelled = |s: &str| bytes == s.as_bytes();
    let joined = |s: &str| bytes.starts_with(s.as_bytes()) && bytes.get(s.len()) == Some(&b'=');
    if SPELLINGS.iter().any(|s| spelled(s)) {
        Some(true)
    } else if SPELLINGS.iter().any(|s| joined(s)) {
        Some(false)
    } else {
        None
    }
}

/// The arguments each rank gets: `given` without `--nproc-per-node N` (`--nproc-per-node=N`,
/// either spelling), with `--out DIR` in the flag's place when `out` is given (the place is
/// one where the program's parser takes `TrainArgs`' flags). What follows `--` is the
/// program's own and is left alone.
fn rank_args(given: &[OsString], out: Option<&Path>) -> Vec<OsString> {
    let mut out: Option<PathBuf> = out.map(Path::to_path_buf);
    let mut kept = Vec::with_capacity(given.len() + 2);
    let mut rest = given.iter();
    while let Some(arg) = rest.next() {
        if arg == "--" {
            kept.push(arg.clone());
            kept.extend(rest.by_ref().cloned());
            break;
        }
        match nproc_flag(arg) {
            Some(true) => {
                rest.next(); // its value
            }
            Some(false) => {}
            None => {
                kept.push(arg.clone());
                continue;
            }
        }
        if let Some(dir) = out.take() {
            kept.extend(["--out".into(), dir.into_os_string()]);
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strip(args: &[&str], out: Option<&str>) -> Vec<String> {
        let given: Vec<OsString> = args.iter().map(OsString::from).collect();
        rank_args(&given, out.map(Path::new))
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect()
    }

    #[test]
    fn the_flag_and_its_value_are_taken_out_in_both_forms_and_nothing_else() {
        let ranks = ["--epochs", "2", "--batch-size", "8"];
        for args in [
            &[
                "--nproc-per-node",
                "2",
                "--epochs",
                "2",
                "--batch-size",
                "8",
            ][..],
            &["--epochs", "2", "--nproc-per-node=2", "--batch-size", "8"],
            &[
                "--epochs",
                "2",
                "--batch-size",
                "8",
                "--nproc_per_node",
                "gpu",
            ],
            &["--nproc_per_node=cpu", "--epochs", "2", "--batch-size", "8"],
        ] {
            assert_eq!(strip(args, None), ranks, "{args:?}");
        }
        // With `=`, the next word is another flag's value and stays.
        assert_eq!(
            strip(&["--nproc-per-node=2", "2", "--seed", "2"], None),
            ["2", "--seed", "2"]
        );
        // Other flags that only begin alike, values that mention it, and whatever follows
        // `--` are the program's.
        let untouched = [
            "--nproc-per-node-extra",
            "3",
            "--note=--nproc-per-node",
            "--nproc-per-nodes=4",
            "--",
            "--nproc-per-node",
            "5",
        ];
        assert_eq!(strip(&untouched, None), untouched);
        assert_eq!(strip(&[], None), Vec::<String>::new());
    }

    #[test]
    fn a_stop_without_out_is_continued_by_a_command_with_the_chosen_directory() {
        let argv = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        let dir = Path::new("runs/20261206-101500-42");
        assert_eq!(
            continue_command(
                &argv(&["./ddp-train", "--data", "my data", "--nproc_per_node=2"]),
                dir
            ),
            "./ddp-train --data 'my data' --out runs/20261206-101500-42 --nproc_per_node=2"
        );
        // Never after `--`, where the program's own arguments are.
        assert_eq!(
            continue_command(&argv(&["t", "--", "--nproc-per-node", "2"]), dir),
            "t --out runs/20261206-101500-42 -- --nproc-per-node 2"
        );
    }

    /// More ranks than the GPUs, where some are visible, are refused before any starts,
    /// unless they train on the CPU; the visible GPUs are counted only then.
    #[test]
    fn more_ranks_than_the_visible_gpus_are_refused_up_front() {
        let refusal = |nproc: &str, device, visible: usize| {
            let counted = std::cell::Cell::new(false);
            let result = refuse_more_ranks_than_gpus(nproc.parse().unwrap(), device, || {
                counted.set(true);
                visible
            });
            (result.map_err(|e| e.to_string()), counted.get())
        };
        let too_many = "--nproc-per-node 4 asks for more GPUs than the 2 visible here \
                        (nvidia-smi and CUDA_VISIBLE_DEVICES); use --nproc-per-node gpu (a rank \
                        per GPU) or --device cpu"
            .to_string();
        for device in [DeviceChoice::Auto, DeviceChoice::Cuda] {
            assert_eq!(refusal("4", device, 2), (Err(too_many.clone()), true));
            assert_eq!(refusal("2", device, 2), (Ok(()), true));
            // Without a GPU, `auto` trains on the CPU and `cuda` fails on every rank alike,
            // naming --device.
            assert_eq!(refusal("4", device, 0), (Ok(()), true));
            for word in ["gpu", "cpu", "auto"] {
                assert_eq!(refusal(word, device, 2), (Ok(()), false));
            }
        }
        assert_eq!(refusal("4", DeviceChoice::Cpu, 2), (Ok(()), false));
    }

    /// `ddp-run`'s advice names this program's flags: its run directory holds the logs.
    #[test]
    fn the_launchers_advice_names_this_programs_flags() {
        let config = LaunchConfig::new("t", 2);
        let wording = wording(&config, &[], None);
        let port = ddp_run::LaunchError::NoFreePort {
            port_flag: "--master-port".into(),
            source: std::io::ErrorKind::AddrInUse.into(),
        };
        assert_eq!(
            wording.reword(port).to_string(),
            "cannot find a free port on 127.0.0.1 for the ranks to meet on (give one: start the \
             ranks with `ddp-run --master-port PORT`)"
        );
        let file = ddp_run::LaunchError::LogDirIsFile {
            path: "run/logs".into(),
            log_dir_flag: "--log-dir".into(),
        };
        assert_eq!(
            wording.reword(file).to_string(),
            "the folder of the rank logs run/logs is a file: remove it, or give another --out \
             (the rank logs go to its logs/ folder)"
        );
    }

    /// The ranks keep the run id that one process would have had in the same place, so that
    /// a requeued SLURM job continues its run: SLURM's only in its batch script or a step of
    /// one task, `DDP_RUN_ID` before it, blank values unset.
    #[test]
    fn the_ranks_keep_the_run_id_of_the_job_they_start_in() {
        let run_id = |vars: &[(&str, &str)]| {
            let nproc = "2".parse().unwrap();
            run_id_for_ranks(nproc, |name| {
                vars.iter()
                    .find(|(var, _)| *var == name)
                    .map(|(_, value)| value.to_string())
            })
            .map_err(|e| e.to_string())
        };
        let batch = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_JOB_NODELIST", "n1"),
        ];
        let one_task = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_JOB_NODELIST", "n1"),
        ];
        let ddp = |id| [&batch[..], &[("DDP_RUN_ID", id)]].concat();
        assert_eq!(run_id(&batch), Ok(Some("4242".into())));
        assert_eq!(run_id(&one_task), Ok(Some("4242.0".into())));
        assert_eq!(run_id(&ddp("job8")), Ok(Some("job8".into())));
        assert_eq!(run_id(&ddp(" ")), Ok(Some("4242".into())));
        // No task of SLURM's (an `salloc` shell), or nothing at all: a fresh id.
        assert_eq!(run_id(&[("SLURM_JOB_ID", "4242")]), Ok(None));
        assert_eq!(run_id(&[("SLURM_JOB_ID", " ")]), Ok(None));
        assert_eq!(run_id(&[]), Ok(None));
        let long = "j".repeat(ddp_comm::MAX_RUN_ID_LEN + 1);
        assert_eq!(
            run_id(&ddp(&long)),
            Err(format!(
                "environment variable DDP_RUN_ID={long:?} is not valid: expected at most 256 \
                 bytes"
            ))
        );
        // ddp-run refuses what the ranks would: the two bounds are one.
        assert_eq!(ddp_run::MAX_RUN_ID_LEN, ddp_comm::MAX_RUN_ID_LEN);
    }

    #[test]
    fn a_chosen_run_directory_takes_the_flags_place() {
        assert_eq!(
            strip(
                &["--epochs", "2", "--nproc-per-node", "2", "--lr", "0.1"],
                Some("runs/20260101-000000")
            ),
            [
                "--epochs",
                "2",
                "--out",
                "runs/20260101-000000",
                "--lr",
                "0.1"
            ]
        );
        assert_eq!(
            strip(&["--nproc_per_node=auto", "--", "x"], Some("r")),
            ["--out", "r", "--", "x"]
        );
    }
}
