//! Trains the ConvNet for a few single-process Adam steps on random tensors and prints the
//! loss. A smoke run of the model and libtorch, not a training of anything meaningful: the
//! labels are a fixed random multi-hot batch, so the loss falls as the model memorises it.

use ddp_model::{ConvNet, ConvNetConfig};
use tch::nn::OptimizerConfig;
use tch::{nn, Device, Kind, Reduction, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = ConvNet::new(&vs.root(), ConvNetConfig::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    let images = Tensor::rand([8, 3, 64, 64], (Kind::Float, Device::Cpu));
    let labels = Tensor::rand([8, 8], (Kind::Float, Device::Cpu)).round();
    for step in 1..=10 {
        let logits = net.forward_t(&images, true);
        let loss =
            logits.binary_cross_entropy_with_logits::<Tensor>(&labels, None, None, Reduction::Mean);
        opt.backward_step(&loss);
        println!("step {step:2}  loss {:.4}", loss.double_value(&[]));
    }
    println!("random_steps: 10 Adam steps of the ConvNet on random tensors (batch 8, 64x64)");
    Ok(())
}
