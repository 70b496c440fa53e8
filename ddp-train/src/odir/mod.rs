//! The ODIR-5K application of the generic Trainer (feature `odir`): [`OdirTask`], the
//! `--model` (ConvNet, ResNet, EfficientNet) on ODIR-5K fundus photos (8-label
//! BCE-with-logits, exact per-class, macro and micro F1, and the challenge's patient-level score in [`OdirStats`], [`challenge`]), and
//! [`TrainConfig`], the `ddp-train` command line that becomes the Trainer's settings and the
//! task's options; `ddp-train predict` and `evaluate` ([`OdirCommand`]), a trained model on
//! a folder. The `ddp-train` binary (`src/main.rs`) is one rank of it.

pub mod challenge;
mod cli;
mod options;
mod predict;
mod score;
mod stats;
mod task;

pub use challenge::{ChallengeScores, EyeCombine};
pub use cli::{Labels, OdirDefaults, TrainConfig};
pub use options::{auto_pos_weight, Normalize, PosWeight};
pub use predict::{
    evaluate, predict, submission_csv, EvaluateArgs, Evaluation, ModelFile, OdirCommand,
    PredictArgs, Prediction, EVALUATE_FLAGS, ODIR_TRAINING_ONLY, PREDICT_FLAGS,
};
pub use score::{load_checkpoint, score, LoadedCheckpoint, LoadedModel, Scored};
pub use stats::{combine_patients, OdirStats, PatientPredictions, Patients};
pub use task::{odir_model, OdirTask};
