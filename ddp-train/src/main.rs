//! `ddp-train`: one rank of a data-parallel training of a ConvNet, ResNet or EfficientNet on
//! ODIR-5K, the ODIR application of the generic Trainer; `ddp-train predict` and `ddp-train evaluate`, one rank
//! of a trained model's predictions for a folder, or of its challenge score on one.
//!
//! Start N of these with torchrun's environment (`ddp-run` and `cargo xtask train` do it, and
//! so do `torchrun --no-python` and `srun`), or let it start its own with
//! `--nproc-per-node N|gpu|cpu|auto` (`ddp_train::cli::run`); see `ddp-train --help`. A launcher's
//! restart resumes from the run's latest checkpoint by itself (the Trainer's
//! `resume_after_restart`).

use std::process::ExitCode;

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Subcommand};
use ddp_data::DataError;
use ddp_run::cli::print_line;
use ddp_train::odir::{OdirCommand, OdirTask, TrainConfig, ODIR_TRAINING_ONLY};
use ddp_train::{TrainError, Trainer};

fn main() -> ExitCode {
    ddp_train::malloc::keep_freed_memory();
    ddp_train::logging::init();
    // A failed rank's Trainer, and so its links to the other ranks, outlives the report of
    // its error: the others fail for want of it only once it has recorded its error (the
    // launcher names the rank whose error came first).
    let mut trainer = None;
    let status = match parse() {
        // ODIR's own flags are checked before `--nproc-per-node` starts ranks that would
        // each refuse them.
        Invocation::Train(config) => ddp_train::cli::run_checked(
            &config.train,
            || valid(&config),
            || run(&config, &mut trainer),
        ),
        Invocation::Command(command) => match *command {
            OdirCommand::Predict(args) => ddp_train::cli::run_inference(
                &args.config.train,
                || valid(&args.config),
                || predict(&args),
            ),
            OdirCommand::Evaluate(args) => ddp_train::cli::run_inference(
                &args.config.train,
                || valid(&args.config),
                || evaluate(&args),
            ),
        },
    };
    drop(trainer);
    status
}

fn valid(config: &TrainConfig) -> Result<()> {
    Ok(config.validate()?)
}

/// What the command line asks for.
enum Invocation {
    /// Training (no command).
    Train(Box<TrainConfig>),
    /// `predict` or `evaluate`.
    Command(Box<OdirCommand>),
}

/// The command line: training's flags without a command (as always), or a command and its
/// flags. Exits with clap's message on a bad command line.
fn parse() -> Invocation {
    let train = TrainConfig::command();
    let about = train.get_about().cloned().unwrap_or_default();
    let mut cmd = OdirCommand::augment_subcommands(
        train
            .subcommand_negates_reqs(true)
            .args_conflicts_with_subcommands(true),
    )
    // The commands' own words for --data, and training's description for the program.
    .about(about)
    .mut_subcommand("predict", |c| {
        c.mut_arg("data", |a| {
            a.help(
                "The folder of images to predict, named as the challenge's test set \
                 (<id>_left.jpg, <id>_right.jpg), without labels",
            )
        })
    })
    .mut_subcommand("evaluate", |c| {
        c.mut_arg("data", |a| {
            a.help("The labelled ODIR folder to score, every image of it (either layout)")
        })
    });
    // Training flags a command does not read are hidden from its help.
    for command in ["predict", "evaluate"] {
        cmd = cmd.mut_subcommand(command, |mut c| {
            for arg in unread_flags(command) {
                c = c.mut_arg(arg.get_id(), |a| a.hide(true));
            }
            c
        });
    }
    let matches = cmd.clone().get_matches();
    // ... and refused when given, rather than silently dropped.
    if let Some((command, given)) = matches.subcommand() {
        let unread = unread_flags(command).into_iter().find(|a| {
            given.value_source(a.get_id().as_str()) == Some(clap::parser::ValueSource::CommandLine)
        });
        if let Some(unread) = unread {
            let arg = match unread.get_long() {
                Some(long) => format!("--{long}"),
                None => unread.get_id().to_string(),
            };
            let text = format!("{arg} is a training flag, which `{command}` does not read");
            let kind = clap::error::ErrorKind::ArgumentConflict;
            // The command's own usage line under the error.
            cmd.build();
            match cmd.find_subcommand_mut(command) {
                Some(sub) => sub.error(kind, text).exit(),
                None => cmd.error(kind, text).exit(),
            }
        }
    }
    let parsed = if matches.subcommand().is_some() {
        OdirCommand::from_arg_matches(&matches).map(|c| Invocation::Command(Box::new(c)))
    } else {
        TrainConfig::from_arg_matches(&matches).map(|c| Invocation::Train(Box::new(c)))
    };
    let parsed = parsed.unwrap_or_else(|e| e.format(&mut cmd).exit());
    // With --eval-only, ODIR's training transforms are refused as the generic training flags
    // are (the evaluation transform reads none of them).
    if let Invocation::Train(config) = &parsed {
        let given =
            |id: &&&str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
        if config.train.settings().checkpoint.eval_only {
            if let Some(id) = ODIR_TRAINING_ONLY.iter().find(given) {
                let text = format!(
                    "--{} is a training flag, which --eval-only does not read",
                    id.replace('_', "-")
                );
                cmd.error(clap::error::ErrorKind::ArgumentConflict, text)
                    .exit();
            }
        }
    }
    parsed
}

/// The training flags that `command` (`predict` or `evaluate`) does not read.
fn unread_flags(command: &str) -> Vec<clap::Arg> {
    use ddp_train::odir::{EVALUATE_FLAGS, PREDICT_FLAGS};
    let read = |id: &str| {
        PREDICT_FLAGS.contains(&id) || (command == "evaluate" && EVALUATE_FLAGS.contains(&id))
    };
    TrainConfig::command()
        .get_arguments()
        .filter(|a| {
            let id = a.get_id().as_str();
            !read(id) && id != "help" && id != "version"
        })
        .cloned()
        .collect()
}

fn predict(args: &ddp_train::odir::PredictArgs) -> Result<()> {
    let p = ddp_train::odir::predict(args)?;
    if p.rank0 {
        let thresholds = match &p.thresholds.1 {
            Some(file) => format!("the thresholds of {}", file.display()),
            None => "0.5".to_string(),
        };
        let files: Vec<String> = p.files.iter().map(|f| f.display().to_string()).collect();
        let model = model_words(&p.model, p.checkpoint_entry.as_deref());
        print_line(format_args!(
            "predict: {} images of {} patients ({} from one eye) on {} rank(s){model}; \
             decisions at {thresholds}; wrote {}",
            p.images,
            p.patients,
            p.one_eye.len(),
            p.world_size,
            files.join(", ")
        ));
    }
    Ok(())
}

/// ` with FILE (epoch E)` and the entry of a training checkpoint that held the model: what a
/// summary line says was scored.
fn model_words((file, epoch): &(std::path::PathBuf, Option<u64>), entry: Option<&str>) -> String {
    let mut words = format!(" with {}", file.display());
    if let Some(epoch) = epoch {
        words.push_str(&format!(" (epoch {epoch})"));
    }
    if let Some(entry) = entry {
        words.push_str(&format!(", its entry '{entry}'"));
    }
    words
}

fn evaluate(args: &ddp_train::odir::EvaluateArgs) -> Result<()> {
    let e = ddp_train::odir::evaluate(args)?;
    if e.rank0 {
        let num = |k: &str| e.report.get(k).and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
        print_line(format_args!(
            "evaluate: {} images of {} patients{}: challenge score {:.4} (kappa {:.4}, F1 \
             {:.4}, AUC {:.4}); per image macro-F1 {:.4}, micro-F1 {:.4}; wrote {}",
            num("images"),
            num("odir_patients"),
            model_words(&e.model, e.checkpoint_entry.as_deref()),
            num("odir_score"),
            num("odir_kappa"),
            num("odir_f1"),
            num("odir_auc"),
            num("val_macro_f1"),
            num("val_micro_f1"),
            e.file.display()
        ));
        print_line(serde_json::to_string(&e.report)?);
    }
    Ok(())
}

/// `error`, told that `--skip-corrupt` exists when an image it would have left out (one that
/// does not decode, is over the decoder's pixel limit, or made the decoder panic) stopped the
/// training without it.
fn with_skip_hint(error: anyhow::Error, config: &TrainConfig) -> anyhow::Error {
    let undecodable = error.chain().any(|e| {
        let data = match e.downcast_ref::<TrainError>() {
            Some(TrainError::Data(d)) => Some(d),
            _ => e.downcast_ref::<DataError>(),
        };
        matches!(
            data,
            Some(
                DataError::DecodeImage { .. }
                    | DataError::ImageTooLarge { .. }
                    | DataError::WorkerPanicked { .. }
            )
        )
    });
    if undecodable && !config.skip_corrupt {
        error.context(
            "training stopped at an image that does not decode (--skip-corrupt decodes every \
             image at the start and leaves out, naming each, those that fail)",
        )
    } else {
        error
    }
}

/// For the fault tests, with the `fault-injection` feature only: `DDP_TRAIN_OPEN_DATA_AFTER=
/// <file>` holds the rank before it opens its data until `<file>` exists (a minute at most),
/// after saying so on stderr, so that a test can signal a rank that is opening its data.
fn hold_before_opening_data() {
    if !cfg!(feature = "fault-injection") {
        return;
    }
    let Some(file) = std::env::var_os("DDP_TRAIN_OPEN_DATA_AFTER") else {
        return;
    };
    let file = std::path::PathBuf::from(file);
    tracing::warn!(
        "injected hold: waiting for {} before opening the data",
        file.display()
    );
    let start = std::time::Instant::now();
    while !file.exists() && start.elapsed() < std::time::Duration::from_secs(60) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Trains, in `trainer`'s place, which keeps the Trainer after an error.
fn run(config: &TrainConfig, trainer: &mut Option<Trainer<OdirTask>>) -> Result<()> {
    config.validate()?;
    hold_before_opening_data();
    let task = OdirTask::new(config)?;
    let settings = config.settings();
    let eval_only = settings.checkpoint.eval_only;
    let trainer = trainer.insert(Trainer::new(task, settings)?);
    let rank0 = trainer.process_group().rank() == 0;
    if eval_only {
        let report = trainer.evaluate()?;
        if rank0 {
            print_line(serde_json::to_string(&report)?);
        }
        return Ok(());
    }
    let reports = trainer
        .run()
        .map_err(|e| with_skip_hint(anyhow::Error::new(e), config))?;
    if let (Some(last), true) = (reports.last(), rank0) {
        // The best models' epochs, as the tutorials end: `best macro f1 ... in epoch ...`.
        let bests: Vec<String> = config
            .settings()
            .monitors
            .iter()
            .filter_map(|m| {
                let best = trainer.bests().get(&m.file)?;
                Some(format!(
                    "{} {:.3} at epoch {} ({})",
                    m.metric, best.value, best.epoch, m.file
                ))
            })
            .collect();
        let bests = match bests.is_empty() {
            true => String::new(),
            false => format!("; best {}", bests.join(", ")),
        };
        print_line(format_args!(
            "done: {} epochs, final validation macro-F1 {:.3}, micro-F1 {:.3}, challenge score \
             {:.3}{bests}; run directory {}",
            last.epoch,
            last.metric("val_macro_f1").unwrap_or(f64::NAN),
            last.metric("val_micro_f1").unwrap_or(f64::NAN),
            last.metric("odir_score").unwrap_or(f64::NAN),
            trainer.out_dir().display()
        ));
    }
    Ok(())
}
