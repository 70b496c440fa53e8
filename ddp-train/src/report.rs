//! The public reports: an epoch's ([`EpochReport`], a line of `metrics.jsonl`) and an
//! evaluation's ([`EvalReport`]); and a named number of an epoch's report for what watches
//! it (the plateau scheduler, early stopping, best-model monitors).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::TrainError;
#[cfg(doc)]
use crate::{Settings, Stats, Trainer};

/// One epoch's results: a line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EpochReport {
    /// Epoch number (from 1).
    pub epoch: u64,
    /// Mean training loss over every sample of every rank.
    pub train_loss: f64,
    /// Mean validation loss over the whole validation split (none without validation data).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// The task's validation metrics ([`Stats::report`]).
    #[serde(flatten)]
    pub metrics: Map<String, Value>,
    /// Learning rate used in this epoch (with a per-step schedule: at its last step).
    pub lr: f64,
    /// Mean over the epoch's steps of the gradients' global norm before clipping (with
    /// [`Settings::clip_grad_norm`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Steps the fp16 gradient scaler skipped (inf/NaN gradients) in this epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u64>,
    /// Training samples per second, all ranks together.
    pub images_per_sec: f64,
    /// Wall time of the epoch (training and evaluation).
    pub epoch_seconds: f64,
    /// Optimizer steps taken in this epoch.
    pub steps: usize,
    /// Ranks that trained.
    pub world_size: usize,
    /// In the first epoch of a run resumed on another allocation (ranks, batch,
    /// accumulation) than its checkpoint's: what changed (the checkpoint's and the new
    /// allocation, their global batches and steps per epoch, and for a checkpoint inside the
    /// epoch its step and samples consumed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation_change: Option<Value>,
}

impl EpochReport {
    /// A number of the report by name: `train_loss`, `val_loss`, `lr` or a task metric. A
    /// task metric that was NaN or infinite (JSON's `null`) is NaN.
    pub fn metric(&self, name: &str) -> Option<f64> {
        match name {
            "train_loss" => Some(self.train_loss),
            "val_loss" => self.val_loss,
            "lr" => Some(self.lr),
            "grad_norm" => self.grad_norm,
            _ => match self.metrics.get(name)? {
                Value::Null => Some(f64::NAN),
                v => v.as_f64(),
            },
        }
    }
}

/// The result of [`Trainer::evaluate`]: the whole validation split's loss and metrics.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EvalReport {
    /// Mean validation loss.
    pub val_loss: f64,
    /// The task's metrics ([`Stats::report`] and [`Stats::details`]).
    #[serde(flatten)]
    pub metrics: Map<String, Value>,
    /// Ranks that evaluated.
    pub world_size: usize,
}

/// The fields of [`EpochReport`] beside the task's metrics, which a metric must not be
/// named as: the line would hold the name twice, and not read back.
const EPOCH_FIELDS: [&str; 11] = [
    "epoch",
    "train_loss",
    "val_loss",
    "lr",
    "grad_norm",
    "skipped_steps",
    "images_per_sec",
    "epoch_seconds",
    "steps",
    "world_size",
    "allocation_change",
];
/// The fields of [`EvalReport`] beside the task's metrics and details.
const EVAL_FIELDS: [&str; 2] = ["val_loss", "world_size"];

/// Refuses task metrics named as a field of the reports they go into: a fresh
/// [`Stats::report`]'s (`report`), in every epoch's report unless the run only evaluates,
/// and in the evaluation's; and its [`Stats::details`] (`details`), in the evaluation's.
pub(crate) fn check_metric_names(
    report: &Map<String, Value>,
    details: &Map<String, Value>,
    eval_only: bool,
) -> Result<(), TrainError> {
    const EPOCH: &str = "every epoch's report (a line of metrics.jsonl)";
    const EVAL: &str = "the evaluation's report";
    let (fields, into): (&[&str], _) = if eval_only {
        (&EVAL_FIELDS, EVAL)
    } else {
        (&EPOCH_FIELDS, EPOCH)
    };
    let taken = |names: &Map<String, Value>, fields: &[&str]| {
        names.keys().find(|k| fields.contains(&k.as_str())).cloned()
    };
    let (which, name, fields, report) = match (taken(report, fields), taken(details, &EVAL_FIELDS))
    {
        (Some(name), _) => ("Stats::report", name, fields, into),
        (None, Some(name)) => ("Stats::details", name, &EVAL_FIELDS[..], EVAL),
        (None, None) => return Ok(()),
    };
    let fields = fields.join(", ");
    Err(TrainError::Invalid(format!(
        "the task's {which} names a metric '{name}', which {report} has already: rename it \
         (the report's own fields are {fields})"
    )))
}

/// The names of the numbers of an epoch's report, which the plateau scheduler, early
/// stopping and best-model monitors may watch ([`EpochReport::metric`]): `train_loss`, `lr`,
/// `grad_norm` when clipping, and with validation data `val_loss` and the numbers of the
/// task's `metrics` (NaN ones too, as JSON's `null`; not its lists).
pub(crate) fn numbers(grad_norm: bool, metrics: Option<&Map<String, Value>>) -> Vec<&str> {
    let mut names = vec!["train_loss", "lr"];
    if grad_norm {
        names.push("grad_norm");
    }
    if let Some(metrics) = metrics {
        names.push("val_loss");
        let number = |v: &Value| v.is_number() || v.is_null();
        names.extend(
            metrics
                .iter()
                .filter(|(_, v)| number(v))
                .map(|(k, _)| k.as_str()),
        );
    }
    names
}

/// The number `metric` of an epoch's report, or an error naming what watches it.
pub(crate) fn watched(
    report: &EpochReport,
    metric: &str,
    watcher: &str,
) -> Result<f64, TrainError> {
    report.metric(metric).ok_or_else(|| {
        let validation = report.val_loss.is_some().then_some(&report.metrics);
        let names = numbers(report.grad_norm.is_some(), validation);
        TrainError::Invalid(format!(
            "{watcher} watches '{metric}', which is not a number of the epoch's report \
             (it has: {})",
            names.join(", ")
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field a report writes is a name no metric may take, and a metric that takes one
    /// is refused, naming it.
    #[test]
    fn metrics_named_as_a_reports_field_are_refused() {
        let full = EpochReport {
            epoch: 1,
            train_loss: 0.5,
            val_loss: Some(0.6),
            metrics: Map::new(),
            lr: 0.1,
            grad_norm: Some(1.0),
            skipped_steps: Some(0),
            images_per_sec: 1.0,
            epoch_seconds: 1.0,
            steps: 1,
            world_size: 1,
            allocation_change: Some(Value::Null),
        };
        let fields = |v: Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        let sorted = |f: &[&str]| {
            let mut f: Vec<String> = f.iter().map(|n| n.to_string()).collect();
            f.sort();
            f
        };
        assert_eq!(
            fields(serde_json::to_value(full).unwrap()),
            sorted(&EPOCH_FIELDS)
        );
        let eval = EvalReport {
            val_loss: 0.6,
            metrics: Map::new(),
            world_size: 1,
        };
        assert_eq!(
            fields(serde_json::to_value(eval).unwrap()),
            sorted(&EVAL_FIELDS)
        );
        let named = |names: &[&str]| -> Map<String, Value> {
            names.iter().map(|n| (n.to_string(), 0.5.into())).collect()
        };
        let none = Map::new();
        assert!(check_metric_names(&named(&["val_mse"]), &none, false).is_ok());
        let err = check_metric_names(&named(&["val_mse", "steps"]), &none, false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Stats::report names a metric 'steps', which every epoch's report"),
            "{err}"
        );
        // An evaluation has no steps; its details go into its report too.
        assert!(check_metric_names(&named(&["steps"]), &none, true).is_ok());
        let err = check_metric_names(&none, &named(&["world_size"]), true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Stats::details names a metric 'world_size', which the evaluation's"),
            "{err}"
        );
    }

    #[test]
    fn reports_round_trip_and_name_their_numbers() {
        let line = r#"{"epoch":2,"train_loss":0.5,"val_loss":0.6,"val_f1":0.7,"val_f1_per_class":[0.1,0.2],"lr":0.001,"images_per_sec":10.0,"epoch_seconds":1.5,"steps":4,"world_size":2}"#;
        let r: EpochReport = serde_json::from_str(line).unwrap();
        assert_eq!(r.metric("val_f1"), Some(0.7));
        assert_eq!(r.metric("val_loss"), Some(0.6));
        assert_eq!(r.metric("val_f1_per_class"), None);
        assert_eq!(r.metrics.len(), 2);
        // A NaN metric (null in JSON) is a NaN, not a missing name.
        let mut nan = r.clone();
        nan.metrics.insert("odir_score".into(), f64::NAN.into());
        assert!(watched(&nan, "odir_score", "a monitor").unwrap().is_nan());
        let back: EpochReport = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        let err = watched(&r, "accuracy", "a monitor")
            .unwrap_err()
            .to_string();
        // The report's numbers, not its lists.
        assert_eq!(
            err,
            "a monitor watches 'accuracy', which is not a number of the epoch's report (it \
             has: train_loss, lr, val_loss, val_f1)"
        );
    }
}
