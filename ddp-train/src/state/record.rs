//! What a model file the Trainer writes (an epoch's checkpoint, a best model) records of the
//! settings it was trained and evaluated under, in its header's metadata.
//!
//! A run's `config.json` holds the settings of its last start: a run resumed with another
//! `precision` (or task key) rewrites it, while a best model of an epoch before the resume
//! was made under the earlier ones. The model's own record says which; files of earlier
//! versions have none, and are compared with `config.json`.

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};

/// The metadata key of the record.
const RECORD_KEY: &str = "trained_under";

/// The record of a model written under `config` (a run's record, as
/// [`TrainState::config`](super::TrainState::config) and `config.json` hold it): the
/// settings an evaluation of the model reads (`precision`, and the `seed` a task's
/// validation split derives from) and the task, in the same shape.
pub(crate) fn model_record(config: &Value) -> (String, String) {
    let settings = &config["settings"];
    // An empty `runtime` group marks the settings as grouped by job: the comparison reads
    // settings without one as a record of before they were (`trainer/changes.rs`).
    let record = json!({
        "settings": {
            "precision": settings["precision"],
            "seed": settings["seed"],
            "runtime": {},
        },
        "task": config["task"],
    });
    (RECORD_KEY.to_owned(), record.to_string())
}

/// The record a model file's `metadata` holds (a JSON object), if any.
pub(crate) fn recorded(metadata: &HashMap<String, String>) -> Option<Value> {
    let record: Value = serde_json::from_str(metadata.get(RECORD_KEY)?).ok()?;
    record.is_object().then_some(record)
}

/// The record to compare a model `file` with, and where it is (for the warnings): its
/// `own` record where it has one, else the `config.json` of the run directory that `dir`
/// (the model's folder, or the run's) belongs to (an earlier version's file).
pub(crate) fn training_record(
    file: &Path,
    dir: &Path,
    own: Option<Value>,
) -> Option<(Value, String)> {
    if let Some(own) = own {
        return Some((own, format!("{}, its own record", file.display())));
    }
    let config = super::run_of(dir).join("config.json");
    let text = std::fs::read_to_string(&config).ok()?;
    let record = serde_json::from_str::<Value>(&text).ok()?;
    Some((record, config.display().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The record keeps the settings an evaluation reads and the task, and reads back; a
    /// file without one (an earlier version's) or with a damaged one has none.
    #[test]
    fn a_model_record_keeps_the_evaluations_settings_and_the_task() {
        let config = json!({
            "settings": {"precision": "bf16", "seed": 3, "lr": 0.1, "data": "d"},
            "task": {"image_size": 32, "eye_combine": "mean"},
        });
        let metadata = HashMap::from([model_record(&config)]);
        let expected = json!({
            "settings": {"precision": "bf16", "seed": 3, "runtime": {}},
            "task": {"image_size": 32, "eye_combine": "mean"},
        });
        assert_eq!(recorded(&metadata), Some(expected));
        let epoch_only = HashMap::from([("epoch".to_owned(), "3".to_owned())]);
        assert_eq!(recorded(&epoch_only), None);
        let damaged = HashMap::from([(RECORD_KEY.to_owned(), "\"fp32\"".to_owned())]);
        assert_eq!(recorded(&damaged), None);
    }
}
