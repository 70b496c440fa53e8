//! `weights` against files that PyTorch itself wrote (`tests/weights.py`, run once with the
//! Python of `cargo xtask setup`): every dtype's exact values, strides, offsets and shared
//! storages, big-endian records, a `cuda:0` location, a DDP prefix, strict and partial loads,
//! training checkpoints and their entries, a malicious pickle, damaged and legacy files.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ddp_model::checkpoint::TensorProblem;
use ddp_model::weights::{
    self, KindMismatch, PickleError, ShapeMismatch, StateDict, Strictness, WeightsError,
};
use ddp_model::{ConvNet, ConvNetConfig};
use tch::{nn, Device, Kind, Tensor};

/// The folder of files written by `weights.py`, and the marker its malicious pickle would
/// create if anything ran it.
fn files() -> &'static (PathBuf, PathBuf) {
    static DIR: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("weights-from-torch");
        if dir.exists() {
            std::fs::remove_dir_all(&dir).expect("cannot empty the folder");
        }
        std::fs::create_dir_all(&dir).expect("cannot create the folder");
        let marker = dir.join("ran-os-system");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/weights.py");
        let out = ddp_testkit::setup_python()
            .arg(script)
            .arg(&dir)
            .arg(&marker)
            .arg(dir.join("python-ran-it"))
            .env("OMP_NUM_THREADS", "1")
            .output()
            .expect("python runs");
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "written",
            "weights.py failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (dir, marker)
    })
}

fn file(name: &str) -> PathBuf {
    files().0.join(name)
}

fn f64s(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1)).unwrap()
}

fn i64s(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(t.to_kind(Kind::Int64).flatten(0, -1)).unwrap()
}

fn convnet(classes: i64) -> (nn::VarStore, ConvNet) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = ConvNet::new(
        &vs.root(),
        ConvNetConfig {
            num_classes: classes,
            dropout: 0.5,
        },
    );
    (vs, net)
}

fn var(vs: &nn::VarStore, name: &str) -> Tensor {
    vs.variables()[name].shallow_clone()
}

fn check_dtypes(sd: &StateDict) {
    let names: Vec<&str> = sd.names().collect();
    assert_eq!(
        names,
        [
            "f32",
            "f16",
            "bf16",
            "f64",
            "i64",
            "i32",
            "i16",
            "i8",
            "u8",
            "bool",
            "transposed",
            "view_a",
            "view_b",
            "view_strided",
            "param",
            "scalar"
        ],
        "file order"
    );
    let t = |n: &str| sd.get(n).unwrap();
    let kinds: Vec<Kind> = names.iter().take(10).map(|n| t(n).kind()).collect();
    assert_eq!(
        kinds,
        [
            Kind::Float,
            Kind::Half,
            Kind::BFloat16,
            Kind::Double,
            Kind::Int64,
            Kind::Int,
            Kind::Int16,
            Kind::Int8,
            Kind::Uint8,
            Kind::Bool
        ]
    );
    assert_eq!(f64s(t("f32")), [1.5, -2.25, 3.0e-8f32 as f64, 65504.0]);
    assert_eq!(t("f16").size(), [2, 2]);
    assert_eq!(f64s(t("f16")), [1.5, -2.25, 0.0009765625, 65504.0]);
    assert_eq!(f64s(t("bf16")), [1.5, -2.25, 256.0, -0.0078125]);
    assert_eq!(f64s(t("f64")), [1.0 / 3.0, -2.5, 1e300]);
    assert_eq!(i64s(t("i64")), [-(1 << 62), 7, -1, 1 << 40]);
    assert_eq!(i64s(t("i32")), [i32::MIN as i64, i32::MAX as i64, 0]);
    assert_eq!(i64s(t("i16")), [-32768, 32767, 1]);
    assert_eq!(i64s(t("i8")), [-128, 127, 3]);
    assert_eq!(i64s(t("u8")), [0, 255, 128]);
    assert_eq!(i64s(t("bool")), [1, 0, 1]);

    // arange(12).reshape(3, 4).t(): shape [4, 3], strides [1, 4], not contiguous.
    let tr = t("transposed");
    assert_eq!((tr.size(), tr.stride()), (vec![4, 3], vec![1, 4]));
    assert!(!tr.is_contiguous());
    assert_eq!(
        f64s(tr),
        [0.0, 4.0, 8.0, 1.0, 5.0, 9.0, 2.0, 6.0, 10.0, 3.0, 7.0, 11.0]
    );

    // Views of one storage (10 * arange(10)) at offsets 2, 4 and 1 (stride 3).
    assert_eq!(f64s(t("view_a")), [20.0, 30.0, 40.0]);
    assert_eq!(f64s(t("view_b")), [40.0, 50.0, 60.0, 70.0]);
    assert_eq!(f64s(t("view_strided")), [10.0, 40.0, 70.0]);
    assert_eq!(t("view_strided").stride(), [3]);
    let ptr = |n: &str| t(n).data_ptr() as usize;
    assert_eq!(
        ptr("view_b") - ptr("view_a"),
        2 * 4,
        "one storage, offsets 2 and 4"
    );
    assert_eq!(ptr("view_a") - ptr("view_strided"), 4);

    assert_eq!(f64s(t("param")), [0.25, 0.5]);
    let scalar = t("scalar");
    assert_eq!((scalar.size(), scalar.int64_value(&[])), (vec![], 42));
}

#[test]
fn every_dtype_stride_and_view_reads_exactly() {
    check_dtypes(&weights::read_state_dict(file("dtypes.pth")).unwrap());
    // Pickle protocol 4 (frames, short strings, memoize, stack globals), and a top folder
    // (`first/`) that is not the file's name.
    check_dtypes(&weights::read_state_dict(file("dtypes-p4.pt")).unwrap());
}

#[test]
fn big_endian_records_are_swapped_and_locations_are_ignored() {
    let sd = weights::read_state_dict(file("big-endian.pth")).unwrap();
    assert_eq!(f64s(sd.get("f32").unwrap()), [1.5, -2.25, 3.0e-8f32 as f64]);
    assert_eq!(f64s(sd.get("f16").unwrap()), [1.5, -2.25]);
    assert_eq!(i64s(sd.get("i64").unwrap()), [-(1 << 62), 7]);

    // Saved with the storage location `cuda:0`: read onto the CPU.
    let sd = weights::read_state_dict(file("cuda.pth")).unwrap();
    let w = sd.get("w").unwrap();
    assert_eq!(w.device(), Device::Cpu);
    assert_eq!(f64s(w), [1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn a_convnet_loads_from_pth_ddp_pth_and_safetensors_named_bin() {
    let reference = weights::read_state_dict(file("convnet8.pth")).unwrap();
    assert_eq!(reference.len(), 26);
    for name in [
        "convnet8.pth",
        "convnet8-ddp.pth",
        "convnet8.bin",
        "convnet8-compiled-ddp.pth",
    ] {
        let (vs, _net) = convnet(8);
        let report = weights::load(&vs, file(name), None, Strictness::Strict).unwrap();
        assert!(report.is_complete(), "{name}: {report}");
        assert_eq!(report.loaded.len(), 26, "{name}");
        let stripped = match name {
            "convnet8-ddp.pth" => Some("module."),
            "convnet8-compiled-ddp.pth" => Some("module._orig_mod."),
            _ => None,
        };
        assert_eq!(report.stripped_prefix.as_deref(), stripped, "{name}");
        for (n, t) in reference.tensors() {
            assert!(var(&vs, n).equal(t), "{name}: {n} differs from the file");
        }
    }
    // A model whose own names begin with `module.` keeps them: only the compiler's
    // wrapper is stripped, and so is DDP's around a model without that prefix.
    for (model_name, file_name, stripped) in [
        ("module.a", "_orig_mod.module.a", "_orig_mod."),
        ("a", "module._orig_mod.a", "module._orig_mod."),
    ] {
        let vs = nn::VarStore::new(Device::Cpu);
        let _a = match model_name.split_once('.') {
            Some((outer, name)) => (vs.root() / outer).zeros(name, &[2]),
            None => vs.root().zeros(model_name, &[2]),
        };
        let file = StateDict::new(
            "w.pth",
            vec![(file_name.to_string(), Tensor::from_slice(&[1.0f32, 2.0]))],
        );
        let report = weights::load_state_dict(&vs, &file, Strictness::Strict).unwrap();
        assert_eq!(report.loaded, [model_name], "{file_name}");
        assert_eq!(report.stripped_prefix.as_deref(), Some(stripped));
    }
    // A model whose names only some begin with `module.` keeps them too.
    let vs = nn::VarStore::new(Device::Cpu);
    let _a = (vs.root() / "module").zeros("a", &[2]);
    let _b = (vs.root() / "head").zeros("b", &[2]);
    let both = |n: &str| (n.to_string(), Tensor::from_slice(&[1.0f32, 2.0]));
    let sd = StateDict::new("w.pth", vec![both("module.a"), both("head.b")]);
    let report = weights::load_state_dict(&vs, &sd, Strictness::Strict).unwrap();
    assert_eq!(report.loaded, ["head.b", "module.a"]);
    assert_eq!(report.stripped_prefix, None);
    // An AveragedModel of that model: its names under `module.`, its counter without.
    let sd = StateDict::new(
        "ema.pth",
        vec![
            both("module.module.a"),
            both("module.head.b"),
            ("n_averaged".to_string(), Tensor::from_slice(&[3i64])),
        ],
    );
    let report = weights::load_state_dict(&vs, &sd, Strictness::Partial).unwrap();
    assert_eq!(report.loaded, ["head.b", "module.a"]);
    assert_eq!(report.unexpected, ["n_averaged"]);
    assert_eq!(report.stripped_prefix.as_deref(), Some("module."));
    // An AveragedModel of a DDP or a compiled model: both wrappers go.
    for (wrapped, stripped) in [
        ("module.module.a", "module.module."),
        ("module._orig_mod.a", "module._orig_mod."),
    ] {
        let vs = nn::VarStore::new(Device::Cpu);
        let _a = vs.root().zeros("a", &[2]);
        let counter = ("n_averaged".to_string(), Tensor::from_slice(&[3i64]));
        let sd = StateDict::new("ema.pth", vec![both(wrapped), counter]);
        let report = weights::load_state_dict(&vs, &sd, Strictness::Partial).unwrap();
        assert_eq!(report.loaded, ["a"], "{wrapped}");
        assert_eq!(report.stripped_prefix.as_deref(), Some(stripped));
    }
    // The DDP file's names as saved, before loading strips them.
    let ddp = weights::read_state_dict(file("convnet8-ddp.pth")).unwrap();
    assert_eq!(ddp.names().next(), Some("module.features.0.weight"));
    let compiled = weights::read_state_dict(file("convnet8-compiled-ddp.pth")).unwrap();
    assert_eq!(
        compiled.names().next(),
        Some("module._orig_mod.features.0.weight")
    );
}

/// An `AveragedModel`'s state_dict (torchvision's `--model-ema` weights) has the model's
/// names under `module.` and its `n_averaged` without: the prefix goes from the names that
/// have it, as `consume_prefix_in_state_dict_if_present` does, and `n_averaged` is left over.
#[test]
fn an_averaged_models_weights_load_beside_its_counter() {
    let averaged = weights::read_state_dict(file("averaged.pth")).unwrap();
    assert_eq!(averaged.len(), 27);
    let (vs, _net) = convnet(8);
    let err = weights::load(&vs, file("averaged.pth"), None, Strictness::Strict).unwrap_err();
    assert!(
        err.to_string().contains("n_averaged") && !err.to_string().contains("missing"),
        "{err}"
    );
    let report = weights::load(&vs, file("averaged.pth"), None, Strictness::Partial).unwrap();
    assert_eq!(report.stripped_prefix.as_deref(), Some("module."));
    assert_eq!(report.loaded.len(), 26, "{report}");
    assert_eq!(report.unexpected, ["n_averaged"]);
    assert!(report.missing.is_empty(), "{report}");
    for (n, t) in averaged.tensors() {
        if let Some(name) = n.strip_prefix("module.") {
            assert!(var(&vs, name).equal(t), "{name} differs from the file");
        }
    }
}

#[test]
fn a_pickle_naming_os_system_is_refused_and_nothing_runs() {
    let (dir, marker) = files();
    assert!(
        dir.join("python-ran-it").exists(),
        "Python's pickle ran the payload"
    );
    let err = weights::read_state_dict(file("evil.pth")).unwrap_err();
    match &err {
        WeightsError::Pickle {
            source: PickleError::Forbidden(global),
            ..
        } => assert_eq!(global, "os.system"),
        other => panic!("{other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("evil.pth") && msg.contains("'os.system'"),
        "{msg}"
    );
    let (vs, _net) = convnet(8);
    let before = var(&vs, "features.0.weight").copy();
    assert!(weights::load(&vs, file("evil.pth"), None, Strictness::Partial).is_err());
    assert!(var(&vs, "features.0.weight").equal(&before));
    assert!(!marker.exists(), "the payload ran");
}

#[test]
fn strict_loading_lists_every_difference_and_copies_nothing() {
    let (vs, _net) = convnet(8);
    let before = var(&vs, "features.1.weight").copy();
    let err = weights::load(&vs, file("wrong.pth"), None, Strictness::Strict).unwrap_err();
    let WeightsError::Mismatch {
        path,
        problems,
        file_holds,
    } = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!(path, &file("wrong.pth"));
    // Names of no model of this crate: nothing to tell about what the file holds.
    assert_eq!(file_holds, &None);
    assert_eq!(
        problems,
        &[
            TensorProblem::Unexpected("extra.bias".into()),
            TensorProblem::Shape {
                name: "features.0.weight".into(),
                expected: vec![32, 3, 3, 3],
                found: vec![16, 3, 3, 3],
            },
        ]
    );
    let msg = err.to_string();
    assert!(
        msg.contains(
            "'features.0.weight' has shape [16, 3, 3, 3] in the checkpoint but [32, 3, 3, 3]"
        ) && msg.contains("'extra.bias' is in the checkpoint but not in the model"),
        "{msg}"
    );
    assert!(
        var(&vs, "features.1.weight").equal(&before),
        "a name that matched was copied"
    );
}

/// A file of another model: the message names that model, lists the first differences and
/// counts the others, instead of every one of its 182 names.
#[test]
fn strict_loading_another_models_file_names_it_and_counts_what_it_does_not_list() {
    let (vs, _net) = convnet(8);
    let err = weights::load(&vs, file("resnet18-ddp.pth"), None, Strictness::Strict).unwrap_err();
    let WeightsError::Mismatch {
        problems,
        file_holds,
        ..
    } = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!(*file_holds, Some(ddp_model::ModelKind::Resnet18));
    let missing = problems
        .iter()
        .filter(|p| matches!(p, TensorProblem::Missing(_)))
        .count();
    let unexpected = problems.len() - missing;
    // The ConvNet's 4 x 6 + 2 tensors, and resnet18's 122 (BatchNorms' counters included).
    assert_eq!((missing, unexpected), (26, 122));
    let msg = err.to_string();
    assert!(
        msg.contains("(nothing was loaded; a partial load copies what fits); the file holds a resnet18 model: "),
        "{msg}"
    );
    let shown = ddp_model::checkpoint::MISMATCH_SHOWN;
    let rest = &problems[shown..];
    let rest_missing = rest
        .iter()
        .filter(|p| matches!(p, TensorProblem::Missing(_)))
        .count();
    assert!(
        msg.ends_with(&format!(
            "; and {} more ({rest_missing} missing from the file, {} not in the model)",
            rest.len(),
            rest.len() - rest_missing
        )),
        "{msg}"
    );
    assert_eq!(msg.matches("' is ").count(), shown, "{msg}");
}

#[test]
fn a_complex_file_tensor_for_a_real_one_is_a_dtype_problem_in_both_modes() {
    let vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().zeros("w", &[2]);
    let _b = vs.root().zeros("b", &[2]);
    let z = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0])
        .view([2, 2])
        .view_as_complex();
    let state = StateDict::new(
        "z.pth",
        vec![
            ("w".into(), z),
            ("b".into(), Tensor::from_slice(&[5.0f64, 6.0])),
        ],
    );
    let err = weights::load_state_dict(&vs, &state, Strictness::Strict).unwrap_err();
    assert!(
        matches!(&err, WeightsError::Mismatch { problems, .. }
        if problems == &[TensorProblem::Dtype {
            name: "w".into(),
            expected: Kind::Float,
            found: Kind::ComplexFloat,
        }]),
        "{err:?}"
    );
    let report = weights::load_state_dict(&vs, &state, Strictness::Partial).unwrap();
    assert_eq!(
        report.kind_mismatched,
        [KindMismatch {
            name: "w".into(),
            expected: Kind::Float,
            found: Kind::ComplexFloat,
        }]
    );
    assert!(report.mismatched.is_empty() && !report.is_complete());
    assert_eq!(report.loaded, ["b"]);
    assert_eq!(
        report.to_string(),
        "loaded 1 tensors; kept the model's own values of 1 (complex in the file: w \
         ComplexFloat for Float)"
    );
    assert!(w.equal(&Tensor::zeros([2], (Kind::Float, Device::Cpu))));
}

#[test]
fn partial_loading_a_1000_class_file_reports_the_head() {
    let file_1000 = weights::read_state_dict(file("convnet1000.pth")).unwrap();
    let (vs, _net) = convnet(8);
    let head = var(&vs, "classifier.3.weight").copy();
    let report = weights::load_state_dict(&vs, &file_1000, Strictness::Partial).unwrap();
    assert_eq!(
        report.mismatched,
        [
            ShapeMismatch {
                name: "classifier.3.bias".into(),
                expected: vec![8],
                found: vec![1000],
            },
            ShapeMismatch {
                name: "classifier.3.weight".into(),
                expected: vec![8, 256],
                found: vec![1000, 256],
            },
        ]
    );
    assert!(report.missing.is_empty() && report.unexpected.is_empty());
    assert_eq!(report.loaded.len(), 24);
    assert!(
        var(&vs, "classifier.3.weight").equal(&head),
        "the head kept its values"
    );
    for name in &report.loaded {
        assert!(var(&vs, name).equal(file_1000.get(name).unwrap()), "{name}");
    }
    assert!(
        report
            .to_string()
            .contains("classifier.3.weight [1000, 256] for [8, 256]"),
        "{report}"
    );
    // The same file strictly: the two head tensors, nothing copied.
    let (vs, _net) = convnet(8);
    let err = weights::load_state_dict(&vs, &file_1000, Strictness::Strict).unwrap_err();
    assert!(
        matches!(&err, WeightsError::Mismatch { problems, .. } if problems.len() == 2),
        "{err}"
    );
}

#[test]
fn dtype_conversion_follows_copy() {
    // A float64 file into float32 variables, and a float file into the int64 counter.
    let (vs, _net) = convnet(8);
    let sd = weights::read_state_dict(file("convnet8.pth")).unwrap();
    let converted: Vec<(String, Tensor)> = sd
        .tensors()
        .iter()
        .map(|(n, t)| (n.clone(), t.to_kind(Kind::Double)))
        .collect();
    let converted = StateDict::new("converted", converted);
    weights::load_state_dict(&vs, &converted, Strictness::Strict).unwrap();
    let w = var(&vs, "features.0.weight");
    assert_eq!(w.kind(), Kind::Float);
    assert!(w.equal(sd.get("features.0.weight").unwrap()));
    assert!(!w.grad().defined(), "the copy recorded no gradient");
    assert_eq!(
        var(&vs, "features.1.num_batches_tracked").kind(),
        Kind::Int64
    );
    assert_eq!(
        var(&vs, "features.1.num_batches_tracked").int64_value(&[]),
        1
    );
}

#[test]
fn the_legacy_format_and_other_files_are_refused_with_what_to_do() {
    for name in ["legacy.pt", "legacy-p0.pt", "legacy-p1.pt"] {
        let err = weights::read_state_dict(file(name)).unwrap_err();
        assert!(
            matches!(err, WeightsError::LegacyFormat { .. }),
            "{name}: {err:?}"
        );
        assert!(err.to_string().contains("re-save it"), "{name}: {err}");
    }
    // A dtype tch lacks is unsupported, not a forbidden global that re-saving would mend.
    let err = weights::read_state_dict(file("float8-e8m0.pth")).unwrap_err();
    assert!(
        matches!(&err, WeightsError::UnsupportedDtype { name, dtype, .. }
            if name == "e8" && dtype == "float8_e8m0fnu"),
        "{err:?}"
    );

    let dir = &files().0;
    let text = dir.join("notes.pth");
    std::fs::write(&text, "not weights").unwrap();
    let err = weights::read_state_dict(&text).unwrap_err();
    assert!(matches!(err, WeightsError::UnknownFormat { .. }), "{err:?}");
    let err = weights::read_state_dict(dir.join("absent.pth")).unwrap_err();
    assert!(
        matches!(&err, WeightsError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
        "{err:?}"
    );
    // A truncated archive.
    let bytes = std::fs::read(file("convnet8.pth")).unwrap();
    let cut = dir.join("cut.pth");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = weights::read_state_dict(&cut).unwrap_err();
    assert!(matches!(err, WeightsError::Archive { .. }), "{err:?}");
}

#[test]
fn a_training_checkpoint_is_read_from_its_one_state_dict_entry() {
    let reference = weights::read_state_dict(file("convnet8.pth")).unwrap();
    assert_eq!(reference.entry(), None);
    // {"epoch": 3, "model": state_dict, "optimizer": SGD's state_dict with its buffers}.
    let sd = weights::read_state_dict(file("checkpoint.pth")).unwrap();
    assert_eq!(sd.entry(), Some("model"));
    let names: Vec<&str> = sd.names().collect();
    assert_eq!(names, reference.names().collect::<Vec<_>>());
    for (n, t) in reference.tensors() {
        assert!(sd.get(n).unwrap().equal(t), "{n} differs from convnet8.pth");
    }
    let (vs, _net) = convnet(8);
    let report = weights::load(&vs, file("checkpoint.pth"), None, Strictness::Strict).unwrap();
    assert!(report.is_complete(), "{report}");
    assert_eq!(report.entry.as_deref(), Some("model"));
    assert!(report
        .to_string()
        .starts_with("loaded 26 tensors of its entry 'model'"));
    // The same entry by its key, as `checkpoint["model"]` in PyTorch.
    let keyed = weights::read_state_dict_entry(file("checkpoint.pth"), "model").unwrap();
    assert_eq!(keyed.entry(), Some("model"));
    assert_eq!(keyed.len(), 26);
}

#[test]
fn a_file_with_several_state_dicts_needs_the_key_of_one() {
    let err = weights::read_state_dict(file("two-models.pth")).unwrap_err();
    match &err {
        WeightsError::SeveralStateDicts { entries, .. } => {
            assert_eq!(
                entries,
                &[("model".to_string(), 26), ("ema".to_string(), 26)]
            )
        }
        other => panic!("expected SeveralStateDicts, got {other:?}"),
    }
    assert!(
        err.to_string().ends_with(
            "holds several state_dicts, under 'model' (26 tensors), 'ema' (26 tensors): \
             choose one by its key"
        ),
        "{err}"
    );
    let reference = weights::read_state_dict(file("convnet8.pth")).unwrap();
    let ema = weights::read_state_dict_entry(file("two-models.pth"), "ema").unwrap();
    assert_eq!(ema.entry(), Some("ema"));
    for (n, t) in reference.tensors() {
        let expected = if t.is_floating_point() {
            t * 2
        } else {
            t.shallow_clone()
        };
        assert!(ema.get(n).unwrap().equal(&expected), "{n} is not doubled");
    }
    let (vs, _net) = convnet(8);
    weights::load(&vs, file("two-models.pth"), Some("ema"), Strictness::Strict).unwrap();
    assert!(var(&vs, "features.0.weight").equal(&(reference.get("features.0.weight").unwrap() * 2)));

    // Keys that are no state_dict, or no entry at all.
    let err = weights::read_state_dict_entry(file("two-models.pth"), "student").unwrap_err();
    assert!(
        matches!(&err, WeightsError::NoEntry { key, entries, .. }
            if key == "student" && entries == &["model", "ema", "epoch"]),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .ends_with("has no entry 'student' (its entries: 'model', 'ema', 'epoch')"),
        "{err}"
    );
    let err = weights::read_state_dict_entry(file("checkpoint.pth"), "epoch").unwrap_err();
    assert!(
        matches!(&err, WeightsError::NotAStateDict { reason, .. } if reason == "entry 'epoch' is an int"),
        "{err:?}"
    );
    let err = weights::read_state_dict_entry(file("checkpoint.pth"), "optimizer").unwrap_err();
    assert!(
        matches!(&err, WeightsError::NotAStateDict { reason, .. }
            if reason == "entry 'optimizer' is a dict, but not of names to tensors: entry 'state' is a dict, not a tensor"),
        "{err:?}"
    );
    // A safetensors file is one state_dict: it has no entries to choose from.
    let err = weights::read_state_dict_entry(file("convnet8.bin"), "model").unwrap_err();
    assert!(
        matches!(&err, WeightsError::NoEntry { entries, .. } if entries.is_empty()),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("it has none: the file is one state_dict"),
        "{err}"
    );
}

#[test]
fn files_that_are_not_state_dicts_or_are_damaged_say_so() {
    // {"epoch": 3, "weights": [tensor]}: no entry is a state_dict.
    let err = weights::read_state_dict(file("not-a-state-dict.pth")).unwrap_err();
    assert!(matches!(err, WeightsError::NotAStateDict { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("entry 'epoch' is an int, not a tensor: save the model's state_dict alone"),
        "{err}"
    );
    let err = weights::read_state_dict(file("short-record.pth")).unwrap_err();
    assert!(
        matches!(&err, WeightsError::BadTensor { name, reason, .. }
            if name == "t" && reason.contains("has 8 bytes, but its storage of 4 Float elements needs 16")),
        "{err:?}"
    );
    let err = weights::read_state_dict(file("past-storage.pth")).unwrap_err();
    assert!(
        matches!(&err, WeightsError::BadTensor { name, reason, .. }
            if name == "t" && reason.contains("reaches past the end of its storage of 2 elements")),
        "{err:?}"
    );
}

#[test]
fn a_torchvision_resnet18_state_dict_reads_as_its_safetensors_copy() {
    let pth = weights::read_state_dict(file("resnet18-ddp.pth")).unwrap();
    let st = weights::read_state_dict(file("resnet18.safetensors")).unwrap();
    assert_eq!(pth.len(), 122);
    // The module order of torchvision's state_dict() (safetensors orders by dtype and name).
    let names: Vec<&str> = pth.names().collect();
    assert_eq!(
        names[..3],
        [
            "module.conv1.weight",
            "module.bn1.weight",
            "module.bn1.bias"
        ]
    );
    assert_eq!(names[120..], ["module.fc.weight", "module.fc.bias"]);
    assert_eq!(st.len(), 122);
    for (name, b) in st.tensors() {
        let a = pth.get(&format!("module.{name}")).unwrap();
        assert_eq!(a.kind(), b.kind(), "{name}");
        assert!(a.equal(b), "{name}");
    }
    assert_eq!(
        pth.get("module.bn1.num_batches_tracked").unwrap().kind(),
        Kind::Int64
    );
}

/// torchvision's ImageNet ResNet files lack `num_batches_tracked`; PyTorch's strict
/// `load_state_dict` takes them, keeping each counter's value, and so does this crate.
#[test]
fn a_state_dict_without_batch_norm_counters_loads_strictly_keeping_them() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = ddp_model::Model::new(&vs.root(), ddp_model::ModelKind::Resnet18, 8, None);
    tch::no_grad(|| {
        let _ = var(&vs, "layer1.0.bn1.num_batches_tracked").fill_(7);
    });
    let report = weights::load(&vs, file("resnet18-legacy.pth"), None, Strictness::Strict).unwrap();
    assert!(report.is_complete(), "{report}");
    assert_eq!(report.loaded.len(), 102);
    assert!(report
        .loaded
        .iter()
        .all(|n| !n.ends_with("num_batches_tracked")));
    assert_eq!(
        i64s(&var(&vs, "layer1.0.bn1.num_batches_tracked")),
        [7],
        "the model's counter is kept"
    );
    let full = weights::read_state_dict(file("resnet18.safetensors")).unwrap();
    assert!(
        var(&vs, "layer4.1.bn2.running_var").equal(full.get("layer4.1.bn2.running_var").unwrap())
    );
    // Without its running_mean the layer is not one the file holds: the counter is missing.
    let legacy = weights::read_state_dict(file("resnet18-legacy.pth")).unwrap();
    let mut tensors = legacy.into_tensors();
    tensors.retain(|(name, _)| name != "bn1.running_mean");
    let without = StateDict::new("without.pth", tensors);
    let err = weights::load_state_dict(&vs, &without, Strictness::Strict).unwrap_err();
    let WeightsError::Mismatch { problems, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(
        problems,
        &[
            TensorProblem::Missing("bn1.num_batches_tracked".into()),
            TensorProblem::Missing("bn1.running_mean".into()),
        ]
    );
}

#[test]
fn a_tuple_nested_a_million_deep_is_an_error_naming_the_file() {
    let err = weights::read_state_dict(file("deep.pth")).unwrap_err();
    assert!(
        matches!(&err, WeightsError::Pickle { path, source: PickleError::TooDeep { limit, .. } }
            if path == &file("deep.pth") && *limit == 1000),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("deep.pth': its pickle nests tuples more than 1000 deep"),
        "{msg}"
    );
}

#[test]
fn the_neg_and_conj_bits_of_saved_views_are_applied() {
    let sd = weights::read_state_dict(file("neg-conj.pth")).unwrap();
    // `tensor([2., -4.])._neg_view()` and `tensor([1+2j, 3-4j]).conj().imag`: the records
    // hold 2, -4 (and 1, 2, 3, -4), the values are negated.
    assert_eq!(f64s(sd.get("neg_view").unwrap()), [-2.0, 4.0]);
    assert_eq!(f64s(sd.get("conj_imag").unwrap()), [-2.0, 4.0]);
    let conj = sd.get("conj").unwrap();
    assert_eq!(conj.kind(), Kind::ComplexFloat);
    assert_eq!(f64s(&conj.view_as_real()), [1.0, -2.0, 3.0, 4.0]);
}

/// A negated view of 2**33 elements over one stored element would take 32 GiB to apply:
/// refused, naming the tensor, as the file holds no such values.
#[test]
fn a_negated_view_larger_than_its_storage_is_refused() {
    let err = weights::read_state_dict(file("expanded-neg.pth")).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(
            "its view of [8589934592] elements over 1 stored ones is negated, conjugated or \
             cast, which would copy it whole"
        ),
        "{msg}"
    );
    assert!(msg.contains("'w'"), "{msg}");
}

/// A storage that a second tensor names with 2**31 - 1 elements, where its record and
/// the first tensor's say 1: the second is refused, as its checks went by the size it names.
#[test]
fn a_storage_named_with_two_sizes_is_refused() {
    let err = weights::read_state_dict(file("resized-storage.pth")).unwrap_err();
    assert!(
        matches!(&err, WeightsError::BadTensor { name, reason, .. } if name == "b"
            && reason == "its storage '0' has 2147483647 Float elements here and 1 where \
                another tensor names it"),
        "{err}"
    );
}

/// Ten negated views of one 20 MiB storage would copy 200 MiB: past the load's budget (4
/// times the file's records and 64 MiB more), the seventh is refused.
#[test]
fn copies_past_the_load_budget_are_refused() {
    let err = weights::read_state_dict(file("many-negations.pth")).unwrap_err();
    assert!(
        matches!(&err, WeightsError::BadTensor { name, reason, .. } if name == "n6"
            && reason.contains("(4 times the file's records, and 64 MiB more): records read \
                more than once, or copies of negated, conjugated or cast views")),
        "{err}"
    );
}

#[test]
fn a_safetensors_header_of_640_bytes_is_not_taken_for_a_legacy_pickle() {
    // 640 = 0x280: the file starts `80 02`, as a pickle of protocol 2 does.
    let mut header = br#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#.to_vec();
    header.resize(640, b' ');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    assert_eq!(bytes[..2], [0x80, 0x02]);
    bytes.extend(header);
    bytes.extend([1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()));
    let dir = ddp_testkit::temp_dir("ddp-model-st640");
    let path = dir.path().join("w.safetensors");
    std::fs::write(&path, &bytes).unwrap();
    let sd = weights::read_state_dict(&path).unwrap();
    assert_eq!(f64s(sd.get("w").unwrap()), [1.5, -2.0]);
    // A header length past the end of the file is no safetensors file.
    bytes[2] = 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let err = weights::read_state_dict(&path).unwrap_err();
    assert!(matches!(err, WeightsError::LegacyFormat { .. }), "{err:?}");
}

#[test]
fn a_key_for_a_plain_state_dict_says_none_is_needed_and_entries_are_capped() {
    let err = weights::read_state_dict_entry(file("convnet8.pth"), "model").unwrap_err();
    assert!(
        matches!(&err, WeightsError::NoEntry { entries, .. } if entries.is_empty()),
        "{err:?}"
    );
    assert!(
        err.to_string().ends_with(
            "has no entry 'model' (it has none: the file is one state_dict, read without a key)"
        ),
        "{err}"
    );
    let err = weights::read_state_dict_entry(file("many-entries.pth"), "model").unwrap_err();
    assert!(
        matches!(&err, WeightsError::NoEntry { entries, .. } if entries.len() == 20),
        "{err:?}"
    );
    assert!(
        err.to_string().ends_with(
            "(its entries: 'entry0', 'entry1', 'entry2', 'entry3', 'entry4', 'entry5', \
             'entry6', 'entry7', and 12 more)"
        ),
        "{err}"
    );
}

#[test]
fn a_checkpoint_with_its_arguments_is_refused_with_how_to_re_save_it() {
    let err = weights::read_state_dict_entry(file("namespace.pth"), "model").unwrap_err();
    assert!(
        matches!(&err, WeightsError::Pickle { source: PickleError::Forbidden(g), .. }
            if g == "argparse.Namespace"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("If you trust the file, re-save its state_dict alone in Python")
            && msg.contains(
                "torch.save(torch.load(path, weights_only=False)['state_dict'], new_path)"
            )
            && msg.ends_with("or torch.save(model.state_dict(), new_path)"),
        "{msg}"
    );
}

/// Asserts that `sd` holds convnet8.pth's names, in its order, and its tensors exactly.
fn assert_convnet8(sd: &StateDict) {
    let reference = weights::read_state_dict(file("convnet8.pth")).unwrap();
    assert_eq!(
        sd.names().collect::<Vec<_>>(),
        reference.names().collect::<Vec<_>>()
    );
    for (n, t) in reference.tensors() {
        let got = sd.get(n).unwrap();
        assert_eq!(got.kind(), t.kind(), "{n}");
        assert!(got.equal(t), "{n} differs from convnet8.pth");
    }
}

#[test]
fn records_without_a_crc_read_and_a_record_that_fails_its_crc_is_refused() {
    // `torch.serialization.set_crc32_options(False)`: every record's CRC is 0.
    assert_convnet8(&weights::read_state_dict(file("no-crc.pth")).unwrap());
    let err = weights::read_state_dict(file("bad-crc.pth")).unwrap_err();
    assert!(
        matches!(&err, WeightsError::Archive { reason, .. }
            if reason == "record 'convnet8/data/0': Invalid checksum"),
        "{err:?}"
    );
}

#[test]
fn a_state_dict_saved_from_an_xla_device_reads_as_its_cpu_copy() {
    let sd = weights::read_state_dict(file("xla.pth")).unwrap();
    assert_convnet8(&sd);
    assert!(sd.tensors().iter().all(|(_, t)| t.device() == Device::Cpu));
    // Saved as float32 values with the dtype float64: converted, as torch does.
    let sd = weights::read_state_dict(file("xla-f64.pth")).unwrap();
    let w = sd.get("w").unwrap();
    assert_eq!((w.kind(), f64s(w)), (Kind::Double, vec![1.5, -2.25]));
}

#[test]
fn a_checkpoint_whose_other_entries_hold_devices_counters_and_wide_ints_is_read() {
    // {"model": convnet8, "device": torch.device("cuda", 0), "counts": Counter(a=2),
    // "z": 1+2j, "buf": bytearray(b"x"), "big": [2**70, -2**70, 2**63], ...}.
    let sd = weights::read_state_dict(file("extras.pth")).unwrap();
    assert_eq!(sd.entry(), Some("model"));
    assert_convnet8(&sd);
    for (key, what) in [
        ("device", "a torch.device"),
        ("z", "a complex"),
        ("buf", "bytes"),
        (
            "counts",
            "a dict, but not of names to tensors: entry 'a' is an int, not a tensor",
        ),
    ] {
        let err = weights::read_state_dict_entry(file("extras.pth"), key).unwrap_err();
        assert!(
            matches!(&err, WeightsError::NotAStateDict { reason, .. }
                if *reason == format!("entry '{key}' is {what}")),
            "{key}: {err:?}"
        );
    }
}

#[test]
fn a_zip_whose_timestamp_field_is_damaged_is_an_archive_error_not_a_panic() {
    // Python's `zipfile` writing the record `archive/data.pkl` (b"x") with the extra field
    // b"UT\0\0\0": an extended timestamp ("UT") of length 0 followed by one byte, which
    // zip 4.6.1 reads by subtracting 1 from 0 (a panic where overflow is checked).
    const ZIP: &str = "504b0304140000000000000021008316dc8c010000000100000010000500617263686976\
                       652f646174612e706b6c555400000078504b01021403140000000000000021008316dc\
                       8c0100000001000000100005000000000000000000800100000000617263686976652f\
                       646174612e706b6c5554000000504b0506000000000100010043000000340000000000";
    let bytes: Vec<u8> = (0..ZIP.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&ZIP[i..i + 2], 16).unwrap())
        .collect();
    let dir = ddp_testkit::temp_dir("ddp-model-ut");
    let path = dir.path().join("ut.pth");
    std::fs::write(&path, &bytes).unwrap();
    let err = weights::read_state_dict(&path).unwrap_err();
    // Every profile builds zip without overflow checks (the workspace's Cargo.toml), so it
    // refuses the archive itself instead of panicking in its subtraction.
    assert!(
        matches!(&err, WeightsError::Archive { path: p, reason }
            if p == &path && reason.starts_with("invalid Zip archive")),
        "{err:?}"
    );
}

#[test]
fn a_compressed_record_is_refused_unread_and_sizes_are_those_declared() {
    // torch.save never compresses: a deflated record is refused before it inflates (here
    // 64 KiB to 64 MiB; a crafted file, 40 MB to 40 GB).
    let err = weights::read_state_dict(file("deflated.pth")).unwrap_err();
    assert!(
        matches!(&err, WeightsError::Archive { reason, .. }
            if reason == "record 'deflated/data/0' is compressed, but torch.save writes \
                          every record stored: save the file again with torch.save"),
        "{err:?}"
    );
    // A record is read no further than one byte past the size its headers declare.
    let err = weights::read_state_dict(file("long-record.pth")).unwrap_err();
    assert!(
        matches!(&err, WeightsError::Archive { reason, .. }
            if reason == "record 'long-record/data/0' holds more bytes than the 16 its header \
                          declares"),
        "{err:?}"
    );
    // The declared size is checked against the storage before the record is read.
    let err = weights::read_state_dict(file("declared-short.pth")).unwrap_err();
    assert!(
        matches!(&err, WeightsError::BadTensor { name, reason, .. }
            if name == "t" && reason == "record 'declared-short/data/0' has 8 bytes, but its \
                                         storage of 4 Float elements needs 16"),
        "{err:?}"
    );
}
