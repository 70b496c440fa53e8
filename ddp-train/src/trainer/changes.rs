//! What a resume or an evaluation changes: the settings and task keys whose values given now
//! differ from those the run recorded (`{"settings": ..., "task": ...}`), in this version's
//! record or an earlier one's.

use serde_json::Value;

use crate::settings::{prefix_matches, Settings};
use crate::state::TrainState;

/// A leaf that differs: its dotted path, the run's value and the one given now.
pub(super) type Change = (String, Value, Value);

/// The settings a resume warns of elsewhere or may change freely: where the checkpoints go
/// and how the ranks run (`checkpoint.*`, `runtime.*`, `out`), the seed (refused), the
/// allocation (its own warning), the number of epochs (the plan's warning), DDP's overlap
/// and bucket views (the same bytes either way), and with a plateau scheduler its learning
/// rate and settings (which the checkpoint's state keeps).
fn warned_elsewhere(path: &str, plateau: bool) -> bool {
    let under = |prefix: &str| prefix_matches(prefix, path);
    [
        "checkpoint",
        "runtime",
        "out",
        "seed",
        "batch_size",
        "accumulate",
        "epochs",
        "ddp.overlap",
        "ddp.gradient_as_bucket_view",
    ]
    .iter()
    .any(|p| under(p))
        || (plateau && (under("optimizer.lr") || under("lr_schedule.config")))
}

/// Whether `settings` were recorded before they were grouped by job (0aa1f89): flat
/// (`device`, `threads`, `keep_checkpoints`, `comm_hook`, `plateau`, ...), beside a task
/// record that held every training flag too.
fn ungrouped(settings: &Value) -> bool {
    settings.is_object() && settings.get("runtime").is_none()
}

/// Ungrouped `settings` in today's terms where a key kept its name and changed its shape:
/// the per-step schedule (`null`: constant) and the plateau scheduler are one `lr_schedule`,
/// and no early stopping is a patience of `null`.
fn regroup(settings: &Value) -> Value {
    let mut settings = settings.clone();
    if settings["lr_schedule"].is_null() {
        settings["lr_schedule"] = match &settings["plateau"] {
            Value::Object(plateau) => {
                let mut schedule = plateau.clone();
                schedule.insert("kind".into(), "plateau".into());
                Value::Object(schedule)
            }
            _ => serde_json::json!({ "kind": "constant", "warmup": 0 }),
        };
    }
    if settings["early_stopping"].is_null() {
        settings["early_stopping"] = serde_json::json!({ "patience": null });
    }
    settings
}

/// A task's [`Task::location_keys`](crate::Task::location_keys) and, of them, its
/// [`Task::presence_keys`](crate::Task::presence_keys).
pub(super) type Locations<'a> = (&'a [&'a str], &'a [&'a str]);

/// The leaves of the task's description `now` that differ from the run's record `record`
/// (none without one), by `task.` paths, leaving out its location keys but where one of
/// its presence keys was given or dropped. A task record beside ungrouped settings held the
/// training flags too: of it, only the keys `now` has count.
pub(super) fn task_changes(
    record: &Value,
    now: &Value,
    (locations, presence): Locations<'_>,
) -> Vec<Change> {
    let mut changes = Vec::new();
    let recorded = &record["task"];
    if !recorded.is_null() {
        let gone_skipped = ungrouped(&record["settings"]);
        differences(recorded, now, "task", gone_skipped, &mut changes);
    }
    changes.retain(|(path, was, is)| {
        let key = path.strip_prefix("task.").unwrap_or(path);
        // Data given at another place is no change; data given where there was none, or
        // no longer given (ODIR's `--val-data`: then validation is split from `--data`), is.
        let given_or_dropped = presence.contains(&key) && was.is_null() != is.is_null();
        given_or_dropped || !locations.iter().any(|l| prefix_matches(l, key))
    });
    changes
}

/// One warning per setting (a dotted path of [`Settings`], or `task.` and a key of the task's
/// description `task` other than its `locations`) whose value now differs from the run's in
/// `st`: the run changes there at the resume point, and does not continue as it began.
pub(super) fn changed_settings(
    st: &TrainState,
    s: &Settings,
    (task, locations): (&Value, Locations<'_>),
) -> Vec<String> {
    let plateau = |v: &Value| v["lr_schedule"]["kind"] == "plateau";
    let now = serde_json::to_value(s).unwrap_or_default();
    let mut was = &st.config["settings"];
    let regrouped;
    if ungrouped(was) {
        regrouped = regroup(was);
        was = &regrouped;
    }
    let both_plateau = plateau(&now) && plateau(was);
    let mut changes = Vec::new();
    // A checkpoint without the record (none the Trainer writes) has nothing to compare.
    // Settings record every field: one `now` lacks is gone from this version.
    if !was.is_null() {
        differences(was, &now, "", true, &mut changes);
        changes.retain(|(path, _, _)| !warned_elsewhere(path, both_plateau));
    }
    changes.extend(task_changes(&st.config, task, locations));
    changes
        .into_iter()
        .map(|(path, was, now)| {
            format!(
                "{path} was {was} in the run and is {now} from here on: the run does not \
                 continue as it began (resume with {was} to continue it exactly)"
            )
        })
        .collect()
}

/// The leaves where `now` differs from `was` (objects field by field, anything else
/// whole), by dotted path under `path`, with both values (`null` where `now` lacks it, or
/// left out with `gone_skipped`). A key `was` lacks is left out: a record written before it
/// existed says nothing of its value.
pub(super) fn differences(
    was: &Value,
    now: &Value,
    path: &str,
    gone_skipped: bool,
    out: &mut Vec<Change>,
) {
    match (was, now) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, x) in a {
                let inner = match path {
                    "" => key.clone(),
                    _ => format!("{path}.{key}"),
                };
                match b.get(key) {
                    Some(y) => differences(x, y, &inner, gone_skipped, out),
                    None if gone_skipped => {}
                    None => differences(x, &Value::Null, &inner, gone_skipped, out),
                }
            }
        }
        (a, b) if a != b => out.push((path.to_string(), a.clone(), b.clone())),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a run of the versions before 0aa1f89 recorded: flat settings, and an ODIR task
    /// record holding every training flag too.
    const UNGROUPED: &str = r#"{"settings":{"epochs":1,"batch_size":8,"accumulate":1,
        "optimizer":{"kind":"adam","lr":0.001,"beta1":0.9,"beta2":0.999,"eps":1e-08,
        "weight_decay":0.0},"plateau":{"metric":"val_macro_f1","goal":"max","config":{
        "factor":0.5,"patience":2,"threshold":0.0001,"cooldown":0,"min_lr":1e-06}},
        "monitors":[{"file":"best-macro.safetensors","goal":"max","metric":"val_macro_f1"},
        {"file":"best-micro.safetensors","goal":"max","metric":"val_micro_f1"},
        {"file":"best-score.safetensors","goal":"max","metric":"odir_score"}],"seed":0,
        "device":"auto","threads":1,"workers":1,"prefetch":null,"out":"run","resume":null,
        "eval_only":false,"resume_after_restart":true,"log_every":0,
        "max_steps_per_epoch":null,"collective_timeout_secs":300,"checkpoint_every":null,
        "checkpoint_minutes":null,"keep_checkpoints":2,"time_limit_secs":null,
        "stop_on_signals":true,"progress":true,"plot":true,"precision":"fp32",
        "find_unused_parameters":false,"comm_hook":"allreduce","overlap":true,
        "clip_grad_norm":null,"lr_schedule":null,"early_stopping":null},
        "task":{"data":"data","val_data":null,"val_split":0.2,"labels":"auto",
        "skip_corrupt":false,"image_size":32,"min_crop_scale":0.2,"hflip":false,
        "dropout":0.5,"dct_upsampling":1.0,"epochs":1,"batch_size":8,"accumulate":1,
        "lr":0.001,"weight_decay":0.0,"workers":1,"prefetch":null,"threads":1,"seed":0,
        "out":"run","resume":null,"eval_only":false,"device":"auto","log_every":0,
        "plateau_factor":0.5,"plateau_patience":2,"min_lr":1e-06,"max_steps_per_epoch":null,
        "collective_timeout":300,"checkpoint_every":null,"checkpoint_minutes":null,
        "keep_checkpoints":2,"time_limit":null,"precision":"fp32",
        "find_unused_parameters":false,"comm_hook":"allreduce","no_overlap":false,
        "optimizer":"adam","momentum":0.0,"clip_grad_norm":null}}"#;

    /// The same run's settings as this version records them, resumed for a second epoch.
    const GROUPED: &str = r#"{"accumulate":1,"batch_size":8,"checkpoint":{"keep":2,
        "resume":"latest"},"clip_grad_norm":null,"early_stopping":{"goal":"max",
        "metric":"val_macro_f1","min_delta":0.0,"patience":null},"epochs":2,
        "lr_schedule":{"config":{"cooldown":0,"factor":0.5,"min_lr":1e-06,"patience":2,
        "threshold":0.0001},"goal":"max","kind":"plateau","metric":"val_macro_f1"},
        "monitors":[{"file":"best-macro.safetensors","goal":"max","metric":"val_macro_f1"},
        {"file":"best-micro.safetensors","goal":"max","metric":"val_micro_f1"},
        {"file":"best-score.safetensors","goal":"max","metric":"odir_score"}],
        "optimizer":{"beta1":0.9,"beta2":0.999,"eps":1e-08,"kind":"adam","lr":0.001,
        "weight_decay":0.0},"out":"run","precision":"fp32","seed":0}"#;

    /// ODIR's description of the same task in this version, where `dct_upsampling` changed.
    const TASK: &str = r#"{"brightness":0.0,"contrast":0.0,"data":"data",
        "dct_upsampling":2.0,"dropout":0.5,"eval_resize":null,"eye_combine":"max",
        "hflip":false,"image_dir":null,"image_size":32,"labels":"auto","min_crop_scale":0.2,
        "model":"convnet","normalize":"none","pos_weight":null,"rotation":0.0,
        "saturation":0.0,"skip_corrupt":false,"tune_thresholds":false,"val_data":null,
        "val_split":0.2,"vflip":false}"#;

    fn state(config: &str) -> TrainState {
        let config: Value = serde_json::from_str(config).unwrap();
        serde_json::from_value(serde_json::json!({"epoch": 1, "optimizer_steps": 4,
            "lr": 0.001, "scheduler": null, "seed": 0, "config": config}))
        .unwrap()
    }

    #[test]
    fn a_resume_of_ungrouped_settings_warns_only_of_what_changed() {
        let now: Settings = serde_json::from_str(GROUPED).unwrap();
        let task: Value = serde_json::from_str(TASK).unwrap();
        let warnings = changed_settings(&state(UNGROUPED), &now, (&task, (&["data"], &["data"])));
        assert_eq!(
            warnings,
            [
                "task.dct_upsampling was 1.0 in the run and is 2.0 from here on: the run does not \
              continue as it began (resume with 1.0 to continue it exactly)"
            ]
        );
        // Of the regrouped keys, a change still counts.
        let mut other = now.clone();
        other.early_stopping.patience = Some(3);
        other.lr_schedule = crate::lr_schedule::LrSchedule::Constant { warmup: 0 };
        let warnings = changed_settings(&state(UNGROUPED), &other, (&task, (&["data"], &["data"])));
        let mut paths: Vec<&str> = warnings
            .iter()
            .map(|w| w.split(' ').next().unwrap())
            .collect();
        paths.sort_unstable();
        assert_eq!(
            paths,
            [
                "early_stopping.patience",
                "lr_schedule.kind",
                "task.dct_upsampling"
            ]
        );
    }

    /// In this version's record a task key the description no longer has is still a change:
    /// ODIR's `val_data` dropped (then validation is split from the training data).
    #[test]
    fn a_grouped_record_still_warns_of_a_task_key_now_missing() {
        let record = serde_json::json!({"settings": {"runtime": {}}, "task": {"val_data": "v"}});
        let changes = task_changes(
            &record,
            &serde_json::json!({}),
            (&["val_data"], &["val_data"]),
        );
        let expected = ("task.val_data".to_string(), Value::from("v"), Value::Null);
        assert_eq!(changes, [expected]);
    }
}
