//! What the ranks must agree on before the first step, each having been started on its own:
//! the settings (the same command on every rank, but for what a rank sets its own way), the
//! task's options, the build, and the data each rank opened. PyTorch checks none of these,
//! and a difference trains replicas that drift apart, shards mismatched lists or fails an
//! epoch later with a ring mismatch; here every rank fails at start naming what differs.

use ddp_comm::ProcessGroup;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::changes::{differences, Change};
use crate::error::{Disagreement, TrainError};
use crate::settings::{prefix_matches, Settings};
use crate::state;
use crate::task::Task;

/// The settings each rank may hold its own value of (with everything under them), left out
/// of the comparison; every other setting must be the same on every rank, a new one too.
const PER_RANK: [&str; 5] = [
    // Where and how this rank runs: its device, threads, loader, collective timeout, logging
    // and time limit (the first rank over its limit stops every rank, agreed).
    "runtime",
    // The run directory: every rank takes rank 0's.
    "out",
    // A path each rank resolves on its own, to another copy of the run perhaps: what it
    // resolves to is compared (the resume agreement).
    "checkpoint.resume",
    // A file each rank reads from its own disk: the names, shapes and types of what it loads
    // are compared (DDP's model check), and rank 0's values are broadcast to every rank.
    "checkpoint.init_from",
    // Only rank 0 prunes step checkpoints.
    "checkpoint.keep",
];

/// What must be the same on every rank: the settings but [`PER_RANK`] (`settings`), the
/// task's description but where its data lies (`task`), and the versions of this crate and
/// of libtorch (`build`).
fn description<T: Task>(settings: &Settings, task: &T) -> Value {
    let mut settings = serde_json::to_value(settings).unwrap_or_default();
    for path in PER_RANK {
        remove(&mut settings, path);
    }
    let mut described = task.describe();
    for key in task.location_keys() {
        remove(&mut described, key);
    }
    serde_json::json!({
        "settings": settings,
        "task": described,
        "build": {
            "ddp-train": env!("CARGO_PKG_VERSION"),
            "libtorch": tch_ext::torch_version(),
        },
    })
}

/// Removes the leaf or object at the dotted `path` from `value`.
fn remove(value: &mut Value, path: &str) {
    let Some(object) = value.as_object_mut() else {
        return;
    };
    match path.split_once('.') {
        Some((head, rest)) => {
            if let Some(inner) = object.get_mut(head) {
                remove(inner, rest);
            }
        }
        None => {
            object.remove(path);
        }
    }
}

/// Fails on every rank alike when the ranks were started with different settings, task
/// options or builds ([`TrainError::RanksDisagree`]): the ranks compare a SHA-256 of their
/// descriptions, and exchange the descriptions only when those differ.
pub(super) fn check_settings<T: Task>(
    pg: &ProcessGroup,
    settings: &Settings,
    task: &T,
) -> Result<(), TrainError> {
    let text = description(settings, task).to_string();
    let digests = pg.all_gather_bytes(&Sha256::digest(text.as_bytes()))?;
    if digests.iter().all(|d| *d == digests[0]) {
        return Ok(());
    }
    let texts = pg.all_gather_bytes(text.as_bytes())?;
    Err(TrainError::RanksDisagree {
        settings: disagreements(&texts),
    })
}

/// Each setting where a rank's description (gathered in rank order) differs from rank 0's.
fn disagreements(texts: &[Vec<u8>]) -> Vec<Disagreement> {
    // What a rank sent is not trusted: a description that does not read is `null`, which
    // differs from rank 0's whole.
    let read = |t: &Vec<u8>| serde_json::from_slice::<Value>(t).unwrap_or_default();
    let Some(first) = texts.first().map(read) else {
        return Vec::new();
    };
    let mut found: Vec<Disagreement> = Vec::new();
    for (rank, text) in texts.iter().enumerate().skip(1) {
        for (path, ours, theirs) in both_ways(&first, &read(text)) {
            let setting = match path.strip_prefix("settings.") {
                Some(setting) => setting.to_string(),
                None if path.is_empty() => "description".to_string(),
                None => path,
            };
            match found.iter_mut().find(|d| d.setting == setting) {
                Some(d) => d.add(rank, theirs),
                None => found.push(Disagreement::new(setting, ours, rank, theirs)),
            }
        }
    }
    found
}

/// The leaves where `theirs` differs from `ours`, with both values (`null` where one has
/// none): those of `ours`, then those only `theirs` has.
fn both_ways(ours: &Value, theirs: &Value) -> Vec<Change> {
    let mut changes = Vec::new();
    differences(ours, theirs, "", false, &mut changes);
    let mut only_theirs = Vec::new();
    differences(theirs, ours, "", false, &mut only_theirs);
    for (path, t, o) in only_theirs {
        if !changes.iter().any(|(p, _, _)| prefix_matches(p, &path)) {
            changes.push((path, o, t));
        }
    }
    changes
}

/// Fails on every rank alike when the ranks opened different data: other numbers of
/// samples, or another [`Task::data_fingerprint`] (naming the parts that differ).
pub(super) fn check_data<T: Task>(
    pg: &ProcessGroup,
    task: &T,
    (train, val): (usize, usize),
) -> Result<(), TrainError> {
    let mut key = format!("{train} training and {val} validation samples");
    for (name, digest) in task.data_fingerprint().unwrap_or_default() {
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        key.push_str(&format!("\n{name} {hex}"));
    }
    data_agreement(&pg.all_gather_bytes(key.as_bytes())?)
}

/// [`check_data`] on the ranks' keys, gathered in rank order: the numbers of samples on the
/// first line, then a line per part of the fingerprint (`labels 3fa2...`).
fn data_agreement(keys: &[Vec<u8>]) -> Result<(), TrainError> {
    let texts: Vec<String> = keys
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect();
    let sizes: Vec<Vec<u8>> = texts
        .iter()
        .map(|t| t.lines().next().unwrap_or_default().as_bytes().to_vec())
        .collect();
    state::check_data_agreement(&sizes)?;
    let Some((first, rank, other)) = state::first_disagreement(keys) else {
        return Ok(());
    };
    let parts = |text: &str| -> Vec<(String, String)> {
        text.lines()
            .skip(1)
            .filter_map(|l| l.split_once(' '))
            .map(|(name, hex)| (name.to_string(), hex.to_string()))
            .collect()
    };
    let (ours, theirs) = (parts(&first), parts(&other));
    let mut names: Vec<&str> = Vec::new();
    for (name, hex) in ours.iter().chain(&theirs) {
        let differs = [&ours, &theirs]
            .iter()
            .any(|side| !side.iter().any(|(n, h)| n == name && h == hex));
        if differs && !names.contains(&name.as_str()) {
            names.push(name);
        }
    }
    let names = match names.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => "data".to_string(),
    };
    Err(TrainError::Invalid(format!(
        "the ranks opened different data: rank 0 and rank {rank} have {} each, but different \
         {names}; give every rank the same data, on a folder every rank sees the same",
        first.lines().next().unwrap_or_default()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamConfig, OptimizerConfig};

    /// A task whose description holds an option and a data location.
    struct Described(Value);

    impl Task for Described {
        type Model = ();
        type Data = ddp_data::TensorDataset;
        type Stats = crate::NoStats;

        fn model(&self, _root: &tch::nn::Path) {}
        fn train_data(&self) -> Self::Data {
            unreachable!("not trained")
        }
        fn train_loss(&self, _model: &(), _batch: &ddp_data::Batch) -> tch::Tensor {
            unreachable!("not trained")
        }
        fn new_stats(&self) -> crate::NoStats {
            crate::NoStats
        }
        fn eval_batch(
            &self,
            _model: &(),
            _batch: &ddp_data::Batch,
            _stats: &mut crate::NoStats,
        ) -> tch::Tensor {
            unreachable!("not trained")
        }
        fn describe(&self) -> Value {
            self.0.clone()
        }
        fn location_keys(&self) -> &[&str] {
            &["data"]
        }
    }

    fn text(settings: &Settings, task: Value) -> Vec<u8> {
        description(settings, &Described(task))
            .to_string()
            .into_bytes()
    }

    fn with_lr(lr: f64) -> Settings {
        Settings::default().optimizer(OptimizerConfig::Adam(AdamConfig {
            lr,
            ..AdamConfig::default()
        }))
    }

    #[test]
    fn what_a_rank_sets_its_own_way_is_not_compared() {
        let task = || serde_json::json!({"image_size": 32, "data": "/a"});
        let mut other = Settings::default();
        other.runtime.threads = Some(3);
        other.runtime.workers = Some(5);
        other.out = Some("elsewhere".into());
        other.checkpoint.resume = Some("latest".into());
        other.checkpoint.keep = 9;
        other.checkpoint.init_from = Some("copy/weights.pth".into());
        let moved = serde_json::json!({"image_size": 32, "data": "/b"});
        let a = text(&Settings::default(), task());
        assert_eq!(a, text(&other, moved));
        // Everything else is: the description is this crate's and libtorch's too.
        let a: Value = serde_json::from_slice(&a).unwrap();
        assert_eq!(a["build"]["libtorch"], tch_ext::torch_version());
        assert_eq!(a["settings"]["checkpoint"]["eval_only"], false);
        assert!(a["settings"]["runtime"].is_null() && a["task"]["data"].is_null());
    }

    #[test]
    fn each_setting_that_differs_is_named_with_both_values_and_the_ranks() {
        let task = serde_json::json!({"image_size": 32});
        let mut seeded = with_lr(1e-3);
        seeded.seed = 7;
        let texts = [
            text(&with_lr(1e-3), task.clone()),
            text(&with_lr(1e-1), task.clone()),
            text(
                &with_lr(1e-3),
                serde_json::json!({"image_size": 48, "hflip": true}),
            ),
            text(&seeded, task.clone()),
            text(&with_lr(1e-1), task),
        ];
        let found = disagreements(&texts);
        let err = TrainError::RanksDisagree { settings: found };
        assert_eq!(
            err.to_string(),
            "the ranks were started with different settings: ranks 1, 4 have optimizer.lr 0.1, \
             rank 0 0.001; rank 2 has task.image_size 48, rank 0 32; rank 2 has task.hflip true, \
             rank 0 none; rank 3 has seed 7, rank 0 0: give every rank the same command"
        );
        let same = [
            text(&with_lr(1e-3), Value::Null),
            text(&with_lr(1e-3), Value::Null),
        ];
        assert!(disagreements(&same).is_empty());
        // A rank that sends what does not read differs whole.
        let garbled = [same[0].clone(), b"{".to_vec()];
        let found = disagreements(&garbled);
        assert_eq!(found.len(), 1);
        assert_eq!(
            (found[0].setting.as_str(), &found[0].others[0].0),
            ("description", &Value::Null)
        );
    }

    #[test]
    fn a_difference_of_build_asks_for_the_same_build() {
        let found = vec![Disagreement::new(
            "build.libtorch".into(),
            "2.13.0".into(),
            1,
            "2.12.0".into(),
        )];
        assert_eq!(
            crate::error::render_disagreements(&found, &|s| s.to_string()),
            "the ranks were started with different settings: rank 1 has build.libtorch 2.12.0, \
             rank 0 2.13.0: give every rank the same command and the same build of the program"
        );
    }

    #[test]
    fn data_that_differs_beyond_its_size_is_named_by_the_parts_that_differ() {
        let key = |labels: &str| {
            format!("12 training and 4 validation samples\nfiles aa\nsplit bb\nlabels {labels}")
                .into_bytes()
        };
        assert!(data_agreement(&[key("cc"), key("cc")]).is_ok());
        match data_agreement(&[key("cc"), key("cc"), key("dd")]) {
            Err(TrainError::Invalid(m)) => assert_eq!(
                m,
                "the ranks opened different data: rank 0 and rank 2 have 12 training and 4 \
                 validation samples each, but different labels; give every rank the same \
                 data, on a folder every rank sees the same"
            ),
            other => panic!("{other:?}"),
        }
        let sizes = [key("cc"), b"16 training and 4 validation samples".to_vec()];
        match data_agreement(&sizes) {
            Err(TrainError::Invalid(m)) => assert!(
                m.starts_with(
                    "the ranks opened different data: rank 0 has 12 training and 4 validation \
                     samples, rank 1 16 training and 4 validation samples"
                ),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
    }
}
