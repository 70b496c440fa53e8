//! What a user supplies to train their own model: a [`Task`] (the model, the data, the loss
//! and the evaluation) and its [`Stats`] (evaluation counts that add up across ranks).

use ddp_data::{Batch, Dataset};
use ddp_model::weights::LoadReport;
use serde_json::{Map, Value};
use tch::{nn, Tensor};

use crate::gather::Rows;

/// Evaluation statistics that combine across ranks by summation: counts, sums of errors,
/// confusion matrices. The Trainer all-reduces [`Stats::to_sums`] and hands the totals back
/// to [`Stats::set_sums`], so every rank reports the metrics of the whole validation split,
/// exactly as one process would (ratios like F1 or accuracy are computed from the totals,
/// never averaged).
pub trait Stats {
    /// The statistics as numbers to add up; the length must not depend on the data.
    fn to_sums(&self) -> Vec<f64>;

    /// Replaces the statistics with `sums` (the element-wise totals over all ranks).
    fn set_sums(&mut self, sums: &[f64]);

    /// The metrics of an epoch's report (`metrics.jsonl`), by name: numbers or lists.
    /// Names that [`crate::Monitor`] or [`crate::lr_schedule::Plateau`] watch must be numbers.
    /// The names must be the same whether or not any sample was added (a metric of no
    /// sample is NaN, not left out): the Trainer checks at start what the plateau scheduler,
    /// early stopping and best-model monitors watch against the report of a fresh
    /// [`Task::new_stats`], rather than fail after the first epoch.
    fn report(&self) -> Metrics;

    /// Per-sample rows that cannot be summed (the scores an AUC ranks), keyed by each
    /// sample's index in the validation split ([`Batch::indices`]); `None` (the default)
    /// gathers nothing. When `Some` (on every rank alike), the Trainer gathers every rank's
    /// rows exactly ([`crate::gather_rows`]) and hands all of them, ordered by key, to
    /// [`Stats::set_rows`] after [`Stats::set_sums`].
    fn rows(&self) -> Option<Rows> {
        None
    }

    /// Replaces the rows with those of every rank, ordered by key.
    fn set_rows(&mut self, _rows: Rows) {}

    /// A JSON document to save beside each best model the epoch's metrics improve
    /// (`best.safetensors` gets `best.json`): what else a prediction with that model needs,
    /// such as decision thresholds tuned on the validation split. None by default. The
    /// Trainer adds the model's epoch to an object (`"epoch"`), and a best model saved
    /// without a document removes the one an earlier model had.
    fn beside_best_model(&self) -> Option<Value> {
        None
    }

    /// More detail for an evaluation-only run's report (counts, say); none by default.
    fn details(&self) -> Metrics {
        Metrics::new()
    }

    /// A few words for the epoch's log line; by default every number of the report as
    /// `name value`.
    fn summary(&self) -> String {
        self.report()
            .numbers()
            .map(|(k, v)| format!("{k} {v:.4}"))
            .collect::<Vec<_>>()
            .join("  ")
    }
}

/// Named metrics, in the order of their names: numbers, or lists of numbers or counts (one
/// value per class, say). What [`Stats::report`] returns, without the user's code touching
/// JSON.
///
/// ```
/// use ddp_train::Metrics;
///
/// let m = Metrics::new()
///     .number("val_accuracy", 0.75)
///     .list("val_f1_per_class", [0.5, 1.0])
///     .counts("tp", [3, 4])
///     .count("patients", 2);
/// assert_eq!(m.get("val_accuracy"), Some(0.75));
/// assert_eq!(m.get("patients"), Some(2.0));
/// assert_eq!(m.get("val_f1_per_class"), None); // a list, not a number
/// assert_eq!(
///     m.numbers().collect::<Vec<_>>(),
///     [("patients", 2.0), ("val_accuracy", 0.75)]
/// );
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics(Map<String, Value>);

impl Metrics {
    /// No metric.
    pub fn new() -> Self {
        Self::default()
    }

    /// With the number `value` named `name` (replacing one of that name).
    pub fn number(mut self, name: impl Into<String>, value: f64) -> Self {
        self.0.insert(name.into(), value.into());
        self
    }

    /// With the list `values` named `name`.
    pub fn list(mut self, name: impl Into<String>, values: impl IntoIterator<Item = f64>) -> Self {
        let list: Vec<Value> = values.into_iter().map(Value::from).collect();
        self.0.insert(name.into(), list.into());
        self
    }

    /// With the count `value` named `name` (an integer in JSON, a number to [`Self::get`]).
    pub fn count(mut self, name: impl Into<String>, value: i64) -> Self {
        self.0.insert(name.into(), value.into());
        self
    }

    /// With the integer list `values` named `name`.
    pub fn counts(
        mut self,
        name: impl Into<String>,
        values: impl IntoIterator<Item = i64>,
    ) -> Self {
        let list: Vec<Value> = values.into_iter().map(Value::from).collect();
        self.0.insert(name.into(), list.into());
        self
    }

    /// The number named `name`, if there is one (lists are not numbers).
    pub fn get(&self, name: &str) -> Option<f64> {
        self.0.get(name)?.as_f64()
    }

    /// Every number (not the lists), by name, in the order of the names.
    pub fn numbers(&self) -> impl Iterator<Item = (&str, f64)> {
        self.0
            .iter()
            .filter_map(|(k, v)| Some((k.as_str(), v.as_f64()?)))
    }

    /// Number of metrics.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is no metric.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The metrics as the JSON object written to `metrics.jsonl`.
    pub fn into_map(self) -> Map<String, Value> {
        self.0
    }
}

impl From<Metrics> for Map<String, Value> {
    fn from(m: Metrics) -> Self {
        m.0
    }
}

impl Extend<(String, Value)> for Metrics {
    fn extend<I: IntoIterator<Item = (String, Value)>>(&mut self, iter: I) {
        self.0.extend(iter);
    }
}

impl IntoIterator for Metrics {
    type Item = (String, Value);
    type IntoIter = serde_json::map::IntoIter;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

/// A model, its data and its loss: everything the Trainer does not know.
///
/// The Trainer calls `model` once (on a `VarStore` on the CPU, after seeding libtorch with
/// the run's seed, then moves the store to the rank's device), `train_data` and `val_data`
/// once, and `train_loss` / `eval_batch` for every batch. Batches arrive on the rank's
/// device as inputs of shape `[batch, layout.shape...]` and targets of shape
/// `[batch, layout.target_shape...]`, each of the kind the data set's layout declares
/// (`f32`, or `i64` for token ids and class indices); padded layouts add the lengths
/// ([`Batch::lengths`], [`Batch::mask`]).
pub trait Task {
    /// The model (any type; the Trainer reaches its weights through the `VarStore`).
    type Model;
    /// The data set: ODIR's images, generated samples, anything the loader can read. The
    /// Trainer clones it for each epoch's loader and each evaluation: keep the clone cheap
    /// (the samples behind an `Arc`), not a copy of the data.
    type Data: Dataset + Clone;
    /// The evaluation statistics.
    type Stats: Stats;

    /// Builds the model's variables under `root`.
    fn model(&self, root: &nn::Path) -> Self::Model;

    /// Called on every rank once `checkpoint.init_from` is loaded into the model (not on a
    /// resume), with what the load copied: gives what a partial load left out (a new
    /// classification head) the initialisation fine-tuning wants where it differs from the
    /// model's own, as PyTorch code that replaces a pretrained model's head with a new
    /// `nn.Linear` does. Returns the names of the tensors it drew anew, which rank 0's log and
    /// `config.json` (`init_weights.reinitialised`) list. Does nothing by default.
    fn init_unloaded(&self, _model: &Self::Model, _report: &LoadReport) -> Vec<String> {
        Vec::new()
    }

    /// The training samples (the sampler shards `0..len()` across ranks).
    fn train_data(&self) -> Self::Data;

    /// The validation samples; `None` trains without evaluation.
    fn val_data(&self) -> Option<Self::Data> {
        None
    }

    /// The mean loss of a training batch; the Trainer calls `backward` on it (scaled by
    /// `1 / accumulate`, and by the fp16 loss scale). tch modules have no mode of their own:
    /// run layers that behave differently in training (dropout, BatchNorm) with their
    /// training behaviour, e.g. `model.forward_t(inputs, true)`. With
    /// [`crate::Settings::precision`] bf16 or fp16 this runs under autocast.
    fn train_loss(&self, model: &Self::Model, batch: &Batch) -> Tensor;

    /// Empty evaluation statistics.
    fn new_stats(&self) -> Self::Stats;

    /// Evaluates one validation batch, without gradients (and under autocast in bf16 or
    /// fp16): adds to `stats` and returns the *sum* of the batch's per-sample losses (a
    /// scalar tensor; the Trainer divides by the number of samples of the whole split). Run
    /// layers with their evaluation behaviour, e.g. `model.forward_t(inputs, false)`: the
    /// Trainer sets no mode.
    fn eval_batch(&self, model: &Self::Model, batch: &Batch, stats: &mut Self::Stats) -> Tensor;

    /// What `config.json` records about the task (its own settings, the data's size). At
    /// start every rank's description, less [`Task::location_keys`], is compared, and ranks
    /// that differ refuse to train: nothing here may depend on the rank (a host name, a
    /// device index); per-rank values belong under the location keys.
    fn describe(&self) -> Value {
        Value::Null
    }

    /// Whether the validation samples depend on the seed, as a split of the training data
    /// drawn from it does (the default). An evaluation of a model
    /// (`checkpoint.eval_only`) refuses another seed than its run's only then: return `false`
    /// when the validation samples are the same whatever the seed (a set of their own).
    fn validation_depends_on_seed(&self) -> bool {
        true
    }

    /// The keys of [`Task::describe`] that say where the data lies (folders, files) rather
    /// than what it is: neither the ranks at start nor a resume or an evaluation compare
    /// them, as the same data may lie elsewhere (a relative path, a link, a job's staging
    /// copy). None by default.
    fn location_keys(&self) -> &[&str] {
        &[]
    }

    /// Of the [`Task::location_keys`], those whose presence changes the data: one given
    /// where the run had none, or dropped, is a change a resume or an evaluation warns of
    /// (ODIR's `val_data`: without it, validation is split from the training data). All of
    /// them by default.
    fn presence_keys(&self) -> &[&str] {
        self.location_keys()
    }

    /// What the data is beyond its sizes, for the ranks to compare at start: named parts
    /// (`labels`, say), each a SHA-256 of what it covers, the same on every rank that opened
    /// the same data. The Trainer refuses to train when a part differs between ranks, naming
    /// it (a copy of the data with other labels would otherwise train on mixed labels). None
    /// by default: only the numbers of samples are compared.
    fn data_fingerprint(&self) -> Option<Vec<(String, [u8; 32])>> {
        None
    }

    /// What the user should know before training starts (data left out, say): rank 0
    /// shows each line as a warning and writes it to its log. None by default.
    fn warnings(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Statistics with nothing to count, for tasks that report only the validation loss.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoStats;

impl Stats for NoStats {
    fn to_sums(&self) -> Vec<f64> {
        Vec::new()
    }

    fn set_sums(&mut self, _sums: &[f64]) {}

    fn report(&self) -> Metrics {
        Metrics::new()
    }
}
