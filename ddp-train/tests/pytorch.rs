//! Our `DistributedDataParallel` against PyTorch's own (`torch.nn.parallel.
//! DistributedDataParallel`, gloo, CPU, one thread per rank): the same model, initial weights
//! and batches on 2 ranks end with the same weights (and BatchNorm buffers) within 1e-5.
//!
//! The first scenario a test process checks runs `tests/reference_ddp.py` from `.deps/venv`
//! once for all of them (one Python start, one `import torch`); for each scenario it forks
//! PyTorch's ranks and writes, in a folder of its own, the initial weights
//! (`init.safetensors`), every rank's batches (`data.safetensors`) and each rank's final
//! state (`torch.{rank}.safetensors`). Then each test's ranks
//! (this test binary re-invoked with `--ignored --exact rank_worker` and torchrun's
//! environment) build the same model with PyTorch's parameter names and PyTorch's ops
//! (`linear`, `relu`, `batch_norm`, `mse_loss`), load the same files, train with our DDP and
//! write theirs; the test compares tensor by tensor, rank by rank.
//!
//! The mixed-precision scenarios run the forward and the loss under CPU autocast
//! (`torch.autocast("cpu", dtype=...)` there, [`Precision::autocast`] here) and backward
//! outside; with fp16, PyTorch's `torch.amp.GradScaler("cpu")` against our [`GradScaler`], whose
//! scale after every step must be PyTorch's exactly.

mod common;

use common::{wait_all, wait_bounded};

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ddp_comm::ProcessGroup;
use ddp_model::checkpoint;
use ddp_train::optim::{AdamConfig, Optimizer, OptimizerConfig, SgdConfig};
use ddp_train::{BuiltinHook, DdpOptions, DistributedDataParallel, GradScaler, Precision};
use tch::{nn, Device, Kind, Reduction, Tensor};

/// Must equal `reference_ddp.py`'s constants.
const STEPS: usize = 5;
const IN: i64 = 12;
const HIDDEN: i64 = 24;
const OUT: i64 = 4;
const BUCKET_CAP_BYTES: usize = 1024;
/// `Fp16GradScaler`'s scaler: PyTorch's default initial scale (which ours starts from too)
/// and a growth interval short enough for the scale to grow within `STEPS`.
const INIT_SCALE: f64 = 65536.0;
const GROWTH_INTERVAL: u64 = 2;

const TOLERANCE: f64 = 1e-5;
/// Every trained tensor must have moved at least this far from its initial value, or the
/// comparison would prove little.
const MIN_MOVE: f64 = 1e-3;
const LIMIT: Duration = Duration::from_secs(180);

const DIR_ENV: &str = "DDP_TEST_OUT";
const SCENARIO_ENV: &str = "DDP_TEST_SCENARIO";
/// How our ranks reduce: `overlap` (default), `deferred` (`overlap: false`) or `view`
/// (overlapped, gradients as bucket views).
const MODE_ENV: &str = "DDP_TEST_MODE";
const TAG_ENV: &str = "DDP_TEST_TAG";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// MLP, MSE, SGD with momentum, several small buckets.
    Plain,
    /// The same with 2 micro-batches per step, the first without gradient sync.
    Accumulate,
    /// Linear -> BatchNorm1d -> ReLU -> Linear in train mode, buffers broadcast.
    BatchNorm,
    /// Branches used by some ranks on some steps, a head used by none; Adam.
    Unused,
    /// The same with 2 micro-batches per step, the first without gradient sync; a branch
    /// is used on some steps only in the micro-batch without sync.
    UnusedAccumulate,
    /// The MLP with the bf16 compression hook.
    Bf16Compress,
    /// The MLP, its forward and MSE under bf16 autocast; SGD with momentum.
    Bf16Autocast,
    /// The MLP, its forward and MSE under fp16 autocast, with a grad scaler whose scale grows
    /// and backs off (one step skipped) during the run.
    Fp16GradScaler,
}

const SCENARIOS: [Scenario; 8] = [
    Scenario::Plain,
    Scenario::Accumulate,
    Scenario::BatchNorm,
    Scenario::Unused,
    Scenario::UnusedAccumulate,
    Scenario::Bf16Compress,
    Scenario::Bf16Autocast,
    Scenario::Fp16GradScaler,
];

impl Scenario {
    /// The name `reference_ddp.py --scenario` takes.
    fn name(self) -> &'static str {
        match self {
            Scenario::Plain => "plain",
            Scenario::Accumulate => "accumulate",
            Scenario::BatchNorm => "batch_norm",
            Scenario::Unused => "unused",
            Scenario::UnusedAccumulate => "unused_accumulate",
            Scenario::Bf16Compress => "bf16_compress",
            Scenario::Bf16Autocast => "bf16_autocast",
            Scenario::Fp16GradScaler => "fp16_grad_scaler",
        }
    }

    fn from_name(name: &str) -> Self {
        SCENARIOS
            .into_iter()
            .find(|s| s.name() == name)
            .unwrap_or_else(|| panic!("unknown scenario '{name}'"))
    }

    fn precision(self) -> Precision {
        match self {
            Scenario::Bf16Autocast => Precision::Bf16,
            Scenario::Fp16GradScaler => Precision::Fp16,
            _ => Precision::Fp32,
        }
    }

    /// The scenario's grad scaler, if it has one.
    fn scaler(self) -> Option<GradScaler> {
        (self == Scenario::Fp16GradScaler).then(|| {
            let scaler = GradScaler::with_growth_interval(GROWTH_INTERVAL);
            assert_eq!(scaler.scale(), INIT_SCALE, "our initial scale");
            scaler
        })
    }

    fn micro_batches(self) -> usize {
        match self {
            Scenario::Accumulate | Scenario::UnusedAccumulate => 2,
            _ => 1,
        }
    }

    /// Whether the model is `Branches`, with find_unused_parameters and Adam.
    fn branches(self) -> bool {
        matches!(self, Scenario::Unused | Scenario::UnusedAccumulate)
    }

    /// Parameters that no rank ever uses: they must keep their initial values exactly.
    fn never_used(self, name: &str) -> bool {
        self.branches() && name.starts_with("c.")
    }

    /// Parameters whose gradient is zero up to rounding: the bias of the Linear before
    /// BatchNorm, whose shift the normalisation removes. They are compared, but need not move.
    fn zero_gradient(self, name: &str) -> bool {
        self == Scenario::BatchNorm && name == "0.bias"
    }

    fn options(self, mode: &str) -> DdpOptions {
        DdpOptions {
            overlap: mode != "deferred",
            gradient_as_bucket_view: mode == "view",
            bucket_cap_bytes: BUCKET_CAP_BYTES,
            first_bucket_cap_bytes: BUCKET_CAP_BYTES,
            find_unused_parameters: self.branches(),
            comm_hook: if self == Scenario::Bf16Compress {
                BuiltinHook::Bf16Compress
            } else {
                BuiltinHook::Allreduce
            },
            ..DdpOptions::default()
        }
    }

    fn optimizer(self) -> OptimizerConfig {
        if self.branches() {
            OptimizerConfig::Adam(AdamConfig {
                lr: 1e-2,
                ..AdamConfig::default()
            })
        } else {
            OptimizerConfig::Sgd(SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
            })
        }
    }
}

/// Whether branch `b` is used by `rank` in micro-batch `micro` of `step` (as `uses_b` in
/// `reference_ddp.py`): without accumulation by rank 1 on odd steps only, so by nobody on
/// even steps; with it, by rank 1 in the micro-batch without sync of odd steps and by rank 0
/// in the synced one of step 3.
fn uses_b(accumulate: bool, rank: usize, step: usize, micro: usize) -> bool {
    if accumulate {
        (rank == 1 && micro == 0 && step % 2 == 1) || (rank == 0 && micro == 1 && step % 4 == 3)
    } else {
        rank == 1 && step % 2 == 1
    }
}

/// `torch.nn.Linear`'s parameters, applied with `F.linear`'s op.
struct Linear {
    weight: Tensor,
    bias: Tensor,
}

impl Linear {
    fn new(p: nn::Path, inputs: i64, outputs: i64) -> Self {
        // The values come from init.safetensors.
        Linear {
            weight: p.var("weight", &[outputs, inputs], nn::Init::Const(0.0)),
            bias: p.var("bias", &[outputs], nn::Init::Const(0.0)),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.weight, Some(&self.bias))
    }
}

/// The scenario's model, with PyTorch's state_dict names (`0.weight` for `nn.Sequential`'s
/// first layer).
enum Model {
    /// Linear(12, 24), ReLU, Linear(24, 24), ReLU, Linear(24, 4) (indices 0, 2, 4).
    Mlp([Linear; 3]),
    /// Linear(12, 24), BatchNorm1d(24), ReLU, Linear(24, 4) (indices 0, 1, 3).
    BatchNorm(Linear, nn::BatchNorm, Linear),
    /// `Branches` of `reference_ddp.py`.
    Branches {
        trunk: Linear,
        a: Linear,
        b: Linear,
        _c: Linear,
        accumulate: bool,
    },
}

impl Model {
    fn new(root: &nn::Path, scenario: Scenario) -> Self {
        match scenario {
            Scenario::BatchNorm => Model::BatchNorm(
                Linear::new(root / "0", IN, HIDDEN),
                nn::batch_norm1d(root / "1", HIDDEN, Default::default()),
                Linear::new(root / "3", HIDDEN, OUT),
            ),
            Scenario::Unused | Scenario::UnusedAccumulate => Model::Branches {
                trunk: Linear::new(root / "trunk", IN, HIDDEN),
                a: Linear::new(root / "a", HIDDEN, OUT),
                b: Linear::new(root / "b", HIDDEN, OUT),
                _c: Linear::new(root / "c", HIDDEN, OUT),
                accumulate: scenario == Scenario::UnusedAccumulate,
            },
            _ => Model::Mlp([
                Linear::new(root / "0", IN, HIDDEN),
                Linear::new(root / "2", HIDDEN, HIDDEN),
                Linear::new(root / "4", HIDDEN, OUT),
            ]),
        }
    }

    /// The training forward of `rank` in micro-batch `micro` of `step`.
    fn forward(&self, x: &Tensor, rank: usize, step: usize, micro: usize) -> Tensor {
        match self {
            Model::Mlp([l0, l2, l4]) => l4.forward(&l2.forward(&l0.forward(x).relu()).relu()),
            Model::BatchNorm(l0, bn, l3) => {
                l3.forward(&nn::ModuleT::forward_t(bn, &l0.forward(x), true).relu())
            }
            Model::Branches {
                trunk,
                a,
                b,
                accumulate,
                ..
            } => {
                let h = trunk.forward(x).relu();
                let out = a.forward(&h);
                if uses_b(*accumulate, rank, step, micro) {
                    out + b.forward(&h)
                } else {
                    out
                }
            }
        }
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

/// Copies `init`'s tensor of each of the store's names into the store (PyTorch's extra
/// `num_batches_tracked` is not in ours and is left out).
fn load_init(vs: &nn::VarStore, init: &BTreeMap<String, Tensor>) {
    tch::no_grad(|| {
        for (name, mut var) in vs.variables() {
            let t = init
                .get(&name)
                .unwrap_or_else(|| panic!("init.safetensors has no '{name}'"));
            assert_eq!(t.size(), var.size(), "shape of '{name}'");
            var.copy_(t);
        }
    });
}

/// One of our ranks: trains the scenario of `SCENARIO_ENV` on the files in `DIR_ENV` and
/// writes `{TAG}.{rank}.safetensors`.
#[test]
#[ignore = "a rank of the PyTorch comparison tests; run by them"]
fn rank_worker() {
    tch::set_num_threads(1);
    let dir = PathBuf::from(env(DIR_ENV));
    let scenario = Scenario::from_name(&env(SCENARIO_ENV));
    let mode = env(MODE_ENV);
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();

    let vs = nn::VarStore::new(Device::Cpu);
    let model = Model::new(&vs.root(), scenario);
    load_init(
        &vs,
        &checkpoint::read_tensors(dir.join("init.safetensors"))
            .unwrap()
            .tensors,
    );
    let data = checkpoint::read_tensors(dir.join("data.safetensors"))
        .unwrap()
        .tensors;
    let mut ddp = DistributedDataParallel::new(&vs, pg, scenario.options(&mode)).unwrap();
    if scenario != Scenario::BatchNorm {
        let sizes = ddp.bucket_sizes();
        assert!(sizes.len() >= 3, "expected several buckets, got {sizes:?}");
    }
    let params = ddp
        .parameters()
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let mut opt = Optimizer::new(params, scenario.optimizer());
    let micros = scenario.micro_batches();
    let mut scaler = scenario.scaler();
    let mut scales = Vec::new();
    for step in 0..STEPS {
        opt.zero_grad();
        for micro in 0..micros {
            ddp.set_require_gradient_sync(micro + 1 == micros);
            // Once per step, as PyTorch's DDP (and the Trainer) sync them: in the first
            // forward after a backward that synchronised.
            if micro == 0 {
                ddp.broadcast_buffers().unwrap();
            }
            let key = format!("{rank}.{step}.{micro}");
            let x = &data[&format!("x.{key}")];
            let y = &data[&format!("y.{key}")];
            // As the Trainer does: forward and loss under autocast, backward outside.
            let loss = {
                let _autocast = scenario.precision().autocast(Device::Cpu).unwrap();
                let pred = model.forward(x, rank, step, micro);
                let kind = scenario.precision().autocast_kind().unwrap_or(Kind::Float);
                assert_eq!(pred.kind(), kind, "the kind of the model's output");
                pred.mse_loss(y, Reduction::Mean)
            };
            let loss = loss / micros as f64;
            let root = match &scaler {
                Some(scaler) => scaler.scale_loss(&loss),
                None => loss,
            };
            // As the Trainer does (PyTorch's DDP in forward): with find_unused_parameters,
            // buckets are then reduced while backward runs.
            ddp.prepare_for_backward(&root).unwrap();
            root.backward();
        }
        ddp.sync_gradients().unwrap();
        if mode == "view" {
            assert_gradients_lie_in_their_buckets(&ddp);
        }
        match &mut scaler {
            Some(scaler) => {
                let found_inf = scaler.unscale(ddp.parameters()).unwrap().found().unwrap();
                if !found_inf {
                    opt.step();
                }
                scaler.update(found_inf);
                scales.push(scaler.scale());
            }
            None => opt.step(),
        }
    }
    let tag = env(TAG_ENV);
    checkpoint::save(
        &vs,
        dir.join(format!("{tag}.{rank}.safetensors")),
        &HashMap::new(),
    )
    .unwrap();
    if scaler.is_some() {
        checkpoint::write_tensors(
            [("scales".to_string(), Tensor::from_slice(&scales))],
            &HashMap::new(),
            dir.join(format!("{tag}.{rank}.scales.safetensors")),
        )
        .unwrap();
    }
}

/// With `gradient_as_bucket_view`, each bucket's gradients are consecutive pieces of one
/// buffer: every member's gradient starts where the previous one ends (parameters that no
/// rank used have none).
fn assert_gradients_lie_in_their_buckets(ddp: &DistributedDataParallel) {
    let by_name: HashMap<&str, &Tensor> = ddp
        .parameters()
        .iter()
        .map(|(n, t)| (n.as_str(), t))
        .collect();
    for names in ddp.bucket_parameters() {
        for pair in names.windows(2) {
            let (a, b) = (
                by_name[pair[0].as_str()].grad(),
                by_name[pair[1].as_str()].grad(),
            );
            if !a.defined() || !b.defined() {
                continue;
            }
            let end_of_a = a.data_ptr() as usize + a.numel() * a.kind().elt_size_in_bytes();
            assert_eq!(
                b.data_ptr() as usize,
                end_of_a,
                "the gradients of '{}' and '{}' are not neighbours in one bucket",
                pair[0],
                pair[1]
            );
        }
    }
}

/// Runs our `world` ranks on the files in `dir`; they write `{tag}.{rank}.safetensors`.
fn run_ours(scenario: Scenario, world: usize, dir: &Path, tag: &str) {
    let children = common::spawn_worker_ranks("rank_worker", world, |_, cmd| {
        cmd.env(DIR_ENV, dir)
            .env(SCENARIO_ENV, scenario.name())
            .env(MODE_ENV, tag)
            .env(TAG_ENV, tag)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
    });
    let outputs = wait_all(children, LIMIT);
    for (rank, output) in outputs.iter().enumerate() {
        assert!(
            output.status.success(),
            "our rank {rank} of {} ({tag}) failed ({}):\n{}",
            scenario.name(),
            output.status,
            common::text(output)
        );
    }
}

/// PyTorch's DDP on every scenario, run once per test process: the folder holding, per
/// scenario, a folder with its init, data and `torch.{rank}.safetensors` (under cargo's
/// temporary folder for tests, emptied first).
fn pytorch_results() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pytorch-reference");
        if dir.exists() {
            std::fs::remove_dir_all(&dir).expect("cannot empty the reference folder");
        }
        std::fs::create_dir_all(&dir).expect("cannot create the reference folder");
        run_pytorch(&dir);
        dir
    })
}

/// Runs PyTorch's DDP on every scenario, each into `dir/<scenario>`.
fn run_pytorch(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference_ddp.py");
    let child = ddp_testkit::setup_python()
        .arg(script)
        .arg("--out")
        .arg(dir)
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python starts");
    let output = wait_bounded(child, LIMIT);
    let text = common::text(&output);
    assert!(
        output.status.success(),
        "reference_ddp.py failed ({}):\n{text}",
        output.status
    );
    print!("{text}");
}

fn read(dir: &Path, file: &str) -> BTreeMap<String, Tensor> {
    checkpoint::read_tensors(dir.join(file))
        .unwrap_or_else(|e| panic!("{e}"))
        .tensors
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn bytes(t: &Tensor) -> Vec<u8> {
    let t = t.contiguous();
    let mut out = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut out, t.numel());
    out
}

/// Trains `scenario` with PyTorch and with ours, and compares every float tensor of ours with
/// PyTorch's, rank with rank.
fn check_against_pytorch(scenario: Scenario) {
    check_modes_against_pytorch(scenario, &["overlap"]);
}

/// [`check_against_pytorch`] with ours run in each of `modes` (see [`MODE_ENV`]).
fn check_modes_against_pytorch(scenario: Scenario, modes: &[&str]) {
    for mode in modes {
        check_mode_against_pytorch(scenario, mode);
    }
}

fn check_mode_against_pytorch(scenario: Scenario, mode: &str) {
    tch::set_num_threads(1);
    let dir = &pytorch_results().join(scenario.name());
    run_ours(scenario, 2, dir, mode);

    let init = read(dir, "init.safetensors");
    let mut failures = Vec::new();
    let mut largest = 0f64;
    for rank in 0..2 {
        let ours = read(dir, &format!("{mode}.{rank}.safetensors"));
        let theirs = read(dir, &format!("torch.{rank}.safetensors"));
        assert!(!ours.is_empty(), "our rank {rank} wrote no tensors");
        for (name, got) in &ours {
            assert_eq!(got.kind(), Kind::Float, "'{name}' is not float32");
            let want = theirs
                .get(name)
                .unwrap_or_else(|| panic!("PyTorch's state_dict has no '{name}'"));
            assert_eq!(got.size(), want.size(), "shape of '{name}'");
            let diff = max_abs_diff(got, want);
            largest = largest.max(diff);
            println!(
                "{} ({mode}) rank {rank} {name}: max |ours - pytorch| = {diff:.3e}",
                scenario.name()
            );
            if diff > TOLERANCE {
                failures.push(format!(
                    "rank {rank} '{name}' ({mode}): max |ours - pytorch| = {diff:.3e}"
                ));
            }
            let start = &init[name];
            if scenario.never_used(name) {
                assert!(
                    bytes(got) == bytes(start),
                    "rank {rank}: '{name}', used by no rank, changed in ours"
                );
                assert!(
                    bytes(want) == bytes(start),
                    "rank {rank}: '{name}', used by no rank, changed in PyTorch"
                );
            } else if !scenario.zero_gradient(name) {
                let moved = max_abs_diff(got, start);
                assert!(
                    moved > MIN_MOVE,
                    "rank {rank}: '{name}' moved only {moved:.3e} from its initial value"
                );
            }
        }
    }
    println!(
        "{}: largest max |ours - pytorch| = {largest:.3e}",
        scenario.name()
    );
    if scenario.scaler().is_some() {
        check_scales(dir);
    }
    assert!(
        failures.is_empty(),
        "{}: ours differs from PyTorch's DDP by more than {TOLERANCE:e}:\n{}",
        scenario.name(),
        failures.join("\n")
    );
}

/// The scale after each step, PyTorch's (`scaler.get_scale()`) and ours, must be equal on
/// every rank, and have grown and backed off (a skipped step) during the run.
fn check_scales(dir: &Path) {
    for rank in 0..2 {
        let scales = |file: String| -> Vec<f64> {
            let t = &read(dir, &file)["scales"];
            assert_eq!(t.kind(), Kind::Double, "the kind of {file}'s scales");
            Vec::<f64>::try_from(t).unwrap()
        };
        let ours = scales(format!("overlap.{rank}.scales.safetensors"));
        let theirs = scales(format!("torch.{rank}.scales.safetensors"));
        println!("rank {rank} scales after each step: ours {ours:?}, pytorch {theirs:?}");
        assert_eq!(ours.len(), STEPS, "our rank {rank}'s scales");
        assert_eq!(ours, theirs, "rank {rank}: our scales are not PyTorch's");
        let before: Vec<f64> = std::iter::once(INIT_SCALE).chain(ours.clone()).collect();
        let changes: Vec<_> = before.windows(2).map(|w| w[1] / w[0]).collect();
        assert!(
            changes.contains(&2.0) && changes.contains(&0.5),
            "rank {rank}: the scale should both grow and back off during the run: {ours:?}"
        );
    }
}

#[test]
fn plain_ddp_in_several_buckets_matches_pytorch() {
    check_against_pytorch(Scenario::Plain);
}

#[test]
fn gradient_accumulation_without_sync_matches_pytorch() {
    check_against_pytorch(Scenario::Accumulate);
}

#[test]
fn batch_norm_with_broadcast_buffers_matches_pytorch() {
    check_against_pytorch(Scenario::BatchNorm);
}

#[test]
fn find_unused_parameters_with_adam_matches_pytorch() {
    check_against_pytorch(Scenario::Unused);
}

/// A parameter used only in a micro-batch without sync is still averaged over the ranks,
/// with each rank's accumulated gradient, as PyTorch's reducer does; overlapped, deferred
/// and with gradients as bucket views.
#[test]
fn find_unused_parameters_with_accumulation_matches_pytorch() {
    check_modes_against_pytorch(Scenario::UnusedAccumulate, &["overlap", "deferred", "view"]);
}

#[test]
fn bf16_compress_hook_matches_pytorch() {
    check_against_pytorch(Scenario::Bf16Compress);
}

#[test]
fn bf16_autocast_matches_pytorch() {
    check_against_pytorch(Scenario::Bf16Autocast);
}

#[test]
fn fp16_autocast_with_grad_scaler_matches_pytorch() {
    check_against_pytorch(Scenario::Fp16GradScaler);
}

/// Writes a seeded init.safetensors and data.safetensors for the MLP and `world` ranks.
fn write_mlp_inputs(dir: &Path, world: usize) {
    tch::manual_seed(11);
    let vs = nn::VarStore::new(Device::Cpu);
    let _ = Model::new(&vs.root(), Scenario::Plain);
    let init: Vec<(String, Tensor)> = checkpoint::named_tensors(&vs)
        .into_iter()
        .map(|(name, t)| {
            let fan_in = *t.size().last().unwrap_or(&1) as f64;
            let values = Tensor::randn(t.size(), (Kind::Float, Device::Cpu)) / fan_in.sqrt();
            (name, values)
        })
        .collect();
    checkpoint::write_tensors(init, &HashMap::new(), dir.join("init.safetensors")).unwrap();
    let mut data = Vec::new();
    for rank in 0..world {
        for step in 0..STEPS {
            let key = format!("{rank}.{step}.0");
            let x = Tensor::randn([8, IN], (Kind::Float, Device::Cpu)) * (1.0 + rank as f64);
            data.push((format!("x.{key}"), x));
            data.push((
                format!("y.{key}"),
                Tensor::randn([8, OUT], (Kind::Float, Device::Cpu)),
            ));
        }
    }
    checkpoint::write_tensors(data, &HashMap::new(), dir.join("data.safetensors")).unwrap();
}

/// Reducing each bucket during backward, reducing all of them after backward, and reducing
/// during backward with gradients as bucket views give the same weights, bit for bit (3
/// ranks, so that the average's division is inexact).
#[test]
fn overlapped_and_deferred_reduction_are_bit_identical_on_three_ranks() {
    tch::set_num_threads(1);
    let world = 3;
    let tmp = common::temp_dir("ddp-train-pytorch-overlap");
    let dir = tmp.path();
    write_mlp_inputs(dir, world);
    for mode in ["overlap", "deferred", "view"] {
        run_ours(Scenario::Plain, world, dir, mode);
    }
    let init = read(dir, "init.safetensors");
    let reference = read(dir, "overlap.0.safetensors");
    assert_eq!(reference.len(), 6, "the MLP has 6 tensors");
    for rank in 0..world {
        for tag in ["overlap", "deferred", "view"] {
            let got = read(dir, &format!("{tag}.{rank}.safetensors"));
            assert_eq!(got.len(), reference.len());
            for (name, want) in &reference {
                assert!(
                    bytes(&got[name]) == bytes(want),
                    "'{name}' of {tag} rank {rank} differs from overlap rank 0 by up to {:.3e}",
                    max_abs_diff(&got[name], want)
                );
            }
        }
    }
    for (name, t) in &reference {
        let moved = max_abs_diff(t, &init[name]);
        assert!(
            moved > MIN_MOVE,
            "'{name}' moved only {moved:.3e} from its initial value"
        );
    }
}
