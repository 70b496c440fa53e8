//! The Rust ConvNet and the PyTorch definition compute the same function from the same
//! checkpoint, in both directions. Runs the Python that `cargo xtask setup` installed.

use std::collections::HashMap;
use std::path::Path;

use ddp_model::{checkpoint, ConvNet, ConvNetConfig};
use tch::{nn, Device, Kind, Tensor};

const TOLERANCE: f64 = 1e-4;

fn run_python(mode: &str, ckpt: &Path, io: &Path) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop.py");
    let out = ddp_testkit::setup_python()
        .arg(script)
        .args([mode, ckpt.to_str().unwrap(), io.to_str().unwrap()])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "interop.py {mode} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn pytorch_loads_a_rust_checkpoint_and_computes_the_same_outputs() {
    let tmp = ddp_testkit::temp_dir("ddp-model-interop-rust-to-torch");
    let dir = tmp.path();
    tch::manual_seed(42);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = ConvNet::new(&vs.root(), ConvNetConfig::default());
    // Move the BatchNorm running statistics away from their initial values, so eval mode
    // really exercises them.
    for _ in 0..3 {
        let _ = tch::no_grad(|| {
            net.forward_t(
                &(Tensor::rand([4, 3, 40, 40], (Kind::Float, Device::Cpu)) * 2.0 + 0.5),
                true,
            )
        });
    }
    let ckpt = dir.join("rust.safetensors");
    checkpoint::save(&vs, &ckpt, &HashMap::new()).unwrap();

    let input = Tensor::rand([3, 3, 48, 40], (Kind::Float, Device::Cpu));
    let output = tch::no_grad(|| net.forward_t(&input, false));
    let io = dir.join("io.safetensors");
    checkpoint::write_tensors([("input", input), ("output", output)], &HashMap::new(), &io)
        .unwrap();

    let stdout = run_python("check", &ckpt, &io);
    let diff: f64 = stdout
        .trim()
        .strip_prefix("max_abs_diff ")
        .unwrap()
        .parse()
        .unwrap();
    assert!(diff <= TOLERANCE, "max abs difference {diff}");
}

#[test]
fn rust_loads_a_pytorch_checkpoint_and_computes_the_same_outputs() {
    let tmp = ddp_testkit::temp_dir("ddp-model-interop-torch-to-rust");
    let dir = tmp.path();
    let ckpt = dir.join("torch.safetensors");
    let io = dir.join("io.safetensors");
    let stdout = run_python("export", &ckpt, &io);
    assert_eq!(stdout.trim(), "exported 26 tensors");

    let vs = nn::VarStore::new(Device::Cpu);
    let net = ConvNet::new(&vs.root(), ConvNetConfig::default());
    checkpoint::load(&vs, &ckpt).unwrap();
    assert_eq!(
        vs.variables()["features.1.num_batches_tracked"].int64_value(&[]),
        3
    );

    let io = checkpoint::read_tensors(&io).unwrap();
    let output = tch::no_grad(|| net.forward_t(&io.tensors["input"], false));
    let diff = (&output - &io.tensors["output"])
        .abs()
        .max()
        .double_value(&[]);
    assert!(diff <= TOLERANCE, "max abs difference {diff}");
    // The outputs are not trivially equal (e.g. all zeros): the model really computed.
    assert!(output.abs().sum(Kind::Double).double_value(&[]) > 1e-3);
}
