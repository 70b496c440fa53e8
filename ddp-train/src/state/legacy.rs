//! Training states as earlier versions of the Trainer wrote them, brought into today's shape
//! before [`TrainState`] reads them:
//!
//! - the first format held the bests of its two monitors as `best_macro` and `best_micro`,
//!   today the bests of `best-macro.safetensors` and `best-micro.safetensors`;
//! - step checkpoints of runs with fp16 and clipping could hold `"grad_norm_sum": null`: a
//!   skipped step's infinite norm was added to the sum, which JSON writes as `null`. The
//!   epoch's norms so far are then unknown: the sum starts again at the resume, with a note.

use serde::Deserialize;
use serde_json::Value;

use super::TrainState;

/// The file names of the first format's two bests, by its field names.
const FIRST_BESTS: [(&str, &str); 2] = [
    ("best_macro", "best-macro.safetensors"),
    ("best_micro", "best-micro.safetensors"),
];

/// Reads a training state's JSON, today's or an earlier version's, and returns it with a
/// sentence for each value the earlier version did not record usably.
pub(super) fn parse(json: &str) -> Result<(TrainState, Vec<String>), serde_json::Error> {
    let mut value: Value = serde_json::from_str(json)?;
    let norms_unknown = upgrade(&mut value);
    // Built from the typed state, so that a damaged position stays serde's error.
    let state = TrainState::deserialize(value)?;
    let notes = match (&state.position, norms_unknown) {
        (Some(p), true) => vec![format!(
            "the gradient norms of the {} step(s) of epoch {} before the checkpoint are \
             unknown (the sum an earlier version wrote counted a skipped step's infinite \
             norm): the epoch's mean gradient norm covers only the steps after the resume",
            p.step, p.epoch
        )],
        _ => Vec::new(),
    };
    Ok((state, notes))
}

/// Rewrites an earlier version's fields of `state` into today's; whether the epoch's
/// gradient norms so far are lost.
fn upgrade(state: &mut Value) -> bool {
    let Some(fields) = state.as_object_mut() else {
        return false;
    };
    if !fields.contains_key("bests") {
        let bests: serde_json::Map<String, Value> = FIRST_BESTS
            .iter()
            .filter_map(|(key, file)| match fields.remove(*key)? {
                Value::Null => None,
                best => Some(((*file).to_owned(), best)),
            })
            .collect();
        fields.insert("bests".to_owned(), Value::Object(bests));
    }
    if let Some(Value::Object(p)) = fields.get_mut("position") {
        if p.get("grad_norm_sum").is_some_and(Value::is_null) {
            p.insert("grad_norm_sum".to_owned(), 0.0.into());
            p.insert("grad_norm_steps".to_owned(), 0.into());
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::check_state;
    use std::path::Path;

    /// A step checkpoint's state as the versions from 919690e to e6ca916 wrote it after a
    /// skipped fp16 step with clipping (no `grad_norm_steps` yet).
    const INFINITE_NORM: &str = r#"{"epoch":0,"position":{"epoch":1,"step":6,
        "loss_sum":13.25,"samples":48,"train_seconds":0.5,"grad_norm_sum":null,
        "skipped_steps":1,"consumed":48,"epoch_end":96},"optimizer_steps":5,"lr":0.001,
        "scheduler":null,"bests":{},"grad_scaler":{"scale":32768.0,"growth_tracker":5,
        "skipped_steps":1},"seed":0,"allocation":{"world_size":2,"batch_size":4,
        "accumulate":1},"plan":{"epochs":2,"optimizer_steps":24},
        "config":{"settings":{"clip_grad_norm":1.0,"precision":"fp16"},"task":{}}}"#;

    #[test]
    fn an_infinite_norm_sum_reads_as_no_norm_so_far() {
        let (st, notes) = parse(INFINITE_NORM).unwrap();
        check_state(&st, Path::new("epoch-0001-step-000006.state.safetensors")).unwrap();
        let p = st.position.unwrap();
        assert_eq!((p.grad_norm_sum, p.grad_norm_steps), (0.0, Some(0)));
        assert_eq!((p.epoch, p.step, p.skipped_steps, p.samples), (1, 6, 1, 48));
        assert_eq!((st.optimizer_steps, st.skipped_steps()), (5, 1));
        assert_eq!(notes.len(), 1);
        assert!(
            notes[0].starts_with("the gradient norms of the 6 step(s) of epoch 1 before"),
            "{}",
            notes[0]
        );
        // A damaged position stays an error, not a panic.
        let damaged = INFINITE_NORM.replace(r#""step":6,"#, "");
        let e = parse(&damaged).unwrap_err().to_string();
        assert!(e.contains("missing field `step`"), "{e}");
        // A recorded sum is kept, without a note.
        let finite = INFINITE_NORM.replace(r#""grad_norm_sum":null"#, r#""grad_norm_sum":2.5"#);
        let (st, notes) = parse(&finite).unwrap();
        let p = st.position.unwrap();
        assert_eq!(
            (p.grad_norm_sum, p.grad_norm_steps, notes.len()),
            (2.5, None, 0)
        );
    }

    #[test]
    fn the_first_formats_two_bests_are_the_bests_of_their_files() {
        // As 0c03cb0 wrote it: `adam_steps`, a scheduler always, `best_macro`/`best_micro`.
        let first = r#"{"epoch":1,"adam_steps":4,"lr":0.001,"scheduler":{"config":{"factor":0.5,
            "patience":2,"threshold":0.0001,"cooldown":0,"min_lr":1e-06},"best":0.18,
            "num_bad_epochs":0,"cooldown_counter":0},"best_macro":{"value":0.18,"epoch":1},
            "best_micro":{"value":0.33,"epoch":1},"seed":0,"config":{"data":"data",
            "epochs":1,"batch_size":8,"lr":0.001,"seed":0}}"#;
        let (st, notes) = parse(first).unwrap();
        let best = |value, epoch| crate::state::Best { value, epoch };
        assert_eq!(
            st.bests,
            std::collections::BTreeMap::from([
                ("best-macro.safetensors".to_owned(), best(0.18, 1)),
                ("best-micro.safetensors".to_owned(), best(0.33, 1)),
            ])
        );
        assert_eq!((st.epoch, st.optimizer_steps, notes.len()), (1, 4, 0));
        // No best yet (`null`), or an infinite one: none.
        let none = first.replace(r#"{"value":0.33,"epoch":1}"#, "null");
        let none = none.replace(r#"{"value":0.18,"epoch":1}"#, r#"{"value":null,"epoch":1}"#);
        assert!(parse(&none).unwrap().0.bests.is_empty());
        // Today's map wins over fields it does not know.
        let both = first.replace(r#""seed":0,"config""#, r#""bests":{},"seed":0,"config""#);
        assert!(parse(&both).unwrap().0.bests.is_empty());
    }
}
