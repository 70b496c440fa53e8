//! The ConvNet: four conv/BatchNorm/ReLU/max-pool blocks and a linear classifier.

use tch::nn::{self, ModuleT};
use tch::Tensor;

use crate::norm::{BatchNorm2d, BatchNormConfig};

/// The ODIR-5K labels in the order of the model's outputs.
pub const ODIR_CLASSES: [&str; 8] = ["N", "D", "G", "C", "A", "H", "M", "O"];

/// Channels of the four feature blocks; the classifier sees the last one.
const CHANNELS: [i64; 4] = [32, 64, 128, 256];

/// Input channels (RGB).
const IN_CHANNELS: i64 = 3;

/// Hyper-parameters of [`ConvNet`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConvNetConfig {
    /// Number of outputs (8 for ODIR's N D G C A H M O).
    pub num_classes: i64,
    /// Dropout probability before the linear layer, in `[0, 1)`.
    pub dropout: f64,
}

impl Default for ConvNetConfig {
    fn default() -> Self {
        Self {
            num_classes: ODIR_CLASSES.len() as i64,
            dropout: 0.5,
        }
    }
}

/// One conv/BatchNorm/ReLU/max-pool block, `features.{4k}` and `features.{4k+1}` in PyTorch.
#[derive(Debug)]
struct Block {
    conv: nn::Conv2D,
    bn: BatchNorm2d,
}

/// The ConvNet of the PyTorch definition
///
/// ```text
/// features   = Sequential(Conv2d(3,32,3,padding=1,bias=False), BatchNorm2d(32), ReLU(), MaxPool2d(2),
///                         Conv2d(32,64,3,padding=1,bias=False), BatchNorm2d(64), ReLU(), MaxPool2d(2),
///                         Conv2d(64,128,3,padding=1,bias=False), BatchNorm2d(128), ReLU(), MaxPool2d(2),
///                         Conv2d(128,256,3,padding=1,bias=False), BatchNorm2d(256), ReLU(), MaxPool2d(2))
/// classifier = Sequential(AdaptiveAvgPool2d(1), Flatten(), Dropout(p), Linear(256, num_classes))
/// ```
///
/// with the same state-dict names (`features.0.weight`, `features.1.running_mean`, ...,
/// `classifier.3.bias`). The variables live in the [`nn::VarStore`] given to [`ConvNet::new`].
#[derive(Debug)]
pub struct ConvNet {
    blocks: Vec<Block>,
    linear: nn::Linear,
    config: ConvNetConfig,
}

impl ConvNet {
    /// Creates the model's variables under `root` (normally `vs.root()`).
    pub fn new(root: &nn::Path, config: ConvNetConfig) -> Self {
        let features = root / "features";
        let mut in_channels = IN_CHANNELS;
        let blocks = CHANNELS
            .iter()
            .enumerate()
            .map(|(k, &out_channels)| {
                let conv_cfg = nn::ConvConfig {
                    padding: 1,
                    bias: false,
                    ..Default::default()
                };
                let conv = nn::conv2d(&features / (4 * k), in_channels, out_channels, 3, conv_cfg);
                // tch's `nn::batch_norm2d` initial weights (uniform in [0, 1), not PyTorch's
                // ones), kept so that a seed gives the ConvNet the weights it always had.
                let config = BatchNormConfig {
                    weight_init: nn::Init::Uniform { lo: 0.0, up: 1.0 },
                    ..Default::default()
                };
                let bn = BatchNorm2d::with_config(&features / (4 * k + 1), out_channels, config);
                in_channels = out_channels;
                Block { conv, bn }
            })
            .collect();
        let linear = nn::linear(
            root / "classifier" / 3,
            in_channels,
            config.num_classes,
            Default::default(),
        );
        Self {
            blocks,
            linear,
            config,
        }
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> ConvNetConfig {
        self.config
    }

    /// Logits `[B, num_classes]` for images `[B, 3, H, W]`. `train` selects BatchNorm batch
    /// statistics (updating the running ones) and active dropout, as `model.train()` does.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut xs = xs.shallow_clone();
        for block in &self.blocks {
            xs = block
                .bn
                .forward_t(&xs.apply(&block.conv), train)
                .relu()
                .max_pool2d_default(2);
        }
        xs.adaptive_avg_pool2d([1, 1])
            .flatten(1, -1)
            .dropout(self.config.dropout, train)
            .apply(&self.linear)
    }

    /// The smallest square input side the model accepts: four 2x max-pools need 16 pixels.
    pub const MIN_IMAGE_SIZE: i64 = 16;
}

impl ModuleT for ConvNet {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        ConvNet::forward_t(self, xs, train)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn names_and_shapes(vs: &nn::VarStore) -> Vec<(String, Vec<i64>)> {
        let mut v: Vec<_> = vs
            .variables()
            .into_iter()
            .map(|(n, t)| (n, t.size()))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn state_dict_names_and_shapes_match_pytorch() {
        let vs = nn::VarStore::new(Device::Cpu);
        let _net = ConvNet::new(&vs.root(), ConvNetConfig::default());
        let got = names_and_shapes(&vs);
        let mut want: Vec<(String, Vec<i64>)> = Vec::new();
        let mut cin = 3;
        for (k, c) in [32i64, 64, 128, 256].into_iter().enumerate() {
            want.push((format!("features.{}.weight", 4 * k), vec![c, cin, 3, 3]));
            for buf in ["weight", "bias", "running_mean", "running_var"] {
                want.push((format!("features.{}.{buf}", 4 * k + 1), vec![c]));
            }
            want.push((
                format!("features.{}.num_batches_tracked", 4 * k + 1),
                vec![],
            ));
            cin = c;
        }
        want.push(("classifier.3.weight".into(), vec![8, 256]));
        want.push(("classifier.3.bias".into(), vec![8]));
        want.sort();
        assert_eq!(got, want);
        assert_eq!(vs.trainable_variables().len(), 4 + 8 + 2);
    }

    #[test]
    fn forward_gives_one_logit_per_class_and_counts_batches() {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = ConvNet::new(
            &vs.root(),
            ConvNetConfig {
                num_classes: 5,
                dropout: 0.0,
            },
        );
        let xs = Tensor::rand([2, 3, 32, 48], (Kind::Float, Device::Cpu));
        assert_eq!(net.forward_t(&xs, false).size(), vec![2, 5]);
        let nbt = vs.variables()["features.1.num_batches_tracked"].shallow_clone();
        assert_eq!(nbt.int64_value(&[]), 0);
        let _ = net.forward_t(&xs, true);
        let _ = net.forward_t(&xs, true);
        assert_eq!(nbt.int64_value(&[]), 2);
    }

    #[test]
    fn eval_mode_is_deterministic_and_train_mode_updates_running_stats() {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = ConvNet::new(&vs.root(), ConvNetConfig::default());
        let xs = Tensor::rand([4, 3, 16, 16], (Kind::Float, Device::Cpu)) * 3.0 + 1.0;
        let a = net.forward_t(&xs, false);
        let b = net.forward_t(&xs, false);
        assert!(a.equal(&b));
        let mean = vs.variables()["features.1.running_mean"].shallow_clone();
        assert_eq!(mean.abs().sum(Kind::Float).double_value(&[]), 0.0);
        let _ = net.forward_t(&xs, true);
        assert!(mean.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    }
}
