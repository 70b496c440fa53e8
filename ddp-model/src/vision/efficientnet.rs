//! [`EfficientNet`]: torchvision's `efficientnet_b0` (MBConv blocks with squeeze-and-
//! excitation, SiLU, stochastic depth).

use tch::nn::{self, Init, ModuleT};
use tch::Tensor;

use super::conv;
use crate::norm::BatchNorm2d;
use crate::weights::LoadReport;

/// One stage of B0 (the EfficientNet paper's Table 1, torchvision's `bneck_conf`):
/// expansion ratio, kernel, stride of the first block, input and output channels, blocks.
const B0_STAGES: [(i64, i64, i64, i64, i64, usize); 7] = [
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
];

/// Stochastic depth's largest drop probability (torchvision's `stochastic_depth_prob`),
/// reached by the last block; block `k` of `n` drops with `0.2 * k / n`.
const STOCHASTIC_DEPTH: f64 = 0.2;

/// torchvision's classifier dropout for B0.
pub(crate) const B0_DROPOUT: f64 = 0.2;

/// torchvision's `_make_divisible(v, 8)`: the nearest multiple of 8, at least 8, and not
/// below 90% of `v`.
fn make_divisible(v: f64) -> i64 {
    let divisor = 8i64;
    let mut new_v = divisor.max(((v + divisor as f64 / 2.0) as i64) / divisor * divisor);
    if (new_v as f64) < 0.9 * v {
        new_v += divisor;
    }
    new_v
}

/// `Conv2dNormActivation`: convolution (no bias), BatchNorm, and SiLU unless `act` is off;
/// names `<path>.0.weight` and `<path>.1.*`.
#[derive(Debug)]
struct ConvBn {
    conv: nn::Conv2D,
    bn: BatchNorm2d,
    act: bool,
}

impl ConvBn {
    fn new(p: nn::Path, c_in: i64, c_out: i64, kernel: i64, stride: i64, groups: i64) -> Self {
        Self {
            conv: conv(&p / 0, c_in, c_out, kernel, stride, groups, false),
            bn: BatchNorm2d::new(&p / 1, c_out),
            act: true,
        }
    }

    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let y = self.bn.forward_t(&x.apply(&self.conv), train);
        if self.act {
            y.silu()
        } else {
            y
        }
    }
}

/// `SqueezeExcitation(channels, squeeze, activation=SiLU)`: `fc1` and `fc2` are 1x1
/// convolutions with biases.
#[derive(Debug)]
struct SqueezeExcitation {
    fc1: nn::Conv2D,
    fc2: nn::Conv2D,
}

impl SqueezeExcitation {
    fn forward(&self, x: &Tensor) -> Tensor {
        let scale = x
            .adaptive_avg_pool2d([1, 1])
            .apply(&self.fc1)
            .silu()
            .apply(&self.fc2)
            .sigmoid();
        scale * x
    }
}

/// One `MBConv` block: `block.0` the 1x1 expansion (absent at ratio 1), then the depthwise
/// convolution, squeeze-and-excitation and the 1x1 projection (no activation); a residual
/// connection with stochastic depth when the shape is unchanged.
#[derive(Debug)]
struct MbConv {
    expand: Option<ConvBn>,
    depthwise: ConvBn,
    se: SqueezeExcitation,
    project: ConvBn,
    residual: bool,
    drop_prob: f64,
}

impl MbConv {
    fn new(p: nn::Path, spec: (i64, i64, i64, i64, i64), drop_prob: f64) -> Self {
        let (ratio, kernel, stride, c_in, c_out) = spec;
        let block = &p / "block";
        let expanded = make_divisible((c_in * ratio) as f64);
        let mut next = 0;
        let mut index = || {
            next += 1;
            &block / (next - 1)
        };
        let expand = (expanded != c_in).then(|| ConvBn::new(index(), c_in, expanded, 1, 1, 1));
        let depthwise = ConvBn::new(index(), expanded, expanded, kernel, stride, expanded);
        let squeeze = (c_in / 4).max(1);
        let se_path = index();
        let se = SqueezeExcitation {
            fc1: conv(&se_path / "fc1", expanded, squeeze, 1, 1, 1, true),
            fc2: conv(&se_path / "fc2", squeeze, expanded, 1, 1, 1, true),
        };
        let mut project = ConvBn::new(index(), expanded, c_out, 1, 1, 1);
        project.act = false;
        Self {
            expand,
            depthwise,
            se,
            project,
            residual: stride == 1 && c_in == c_out,
            drop_prob,
        }
    }

    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let mut y = match &self.expand {
            Some(e) => e.forward_t(x, train),
            None => x.shallow_clone(),
        };
        y = self.depthwise.forward_t(&y, train);
        y = self.se.forward(&y);
        y = self.project.forward_t(&y, train);
        if !self.residual {
            return y;
        }
        stochastic_depth(&y, self.drop_prob, train) + x
    }
}

/// torchvision's `stochastic_depth(mode="row")`: in training, each sample's branch is zeroed
/// with probability `p` and the others scaled by `1 / (1 - p)`.
fn stochastic_depth(x: &Tensor, p: f64, train: bool) -> Tensor {
    if !train || p == 0.0 {
        return x.shallow_clone();
    }
    let survival = 1.0 - p;
    let mut shape = vec![1i64; x.dim()];
    shape[0] = x.size()[0];
    let mut noise = Tensor::empty(shape.as_slice(), (x.kind(), x.device()));
    let _ = noise.bernoulli_float_(survival);
    if survival > 0.0 {
        noise /= survival;
    }
    x * noise
}

/// torchvision's `efficientnet_b0`: `features.0` a 3x3/2 stem (32 channels), `features.1` to
/// `features.7` the seven MBConv stages, `features.8` a 1x1 convolution to 1280 channels,
/// global average pool, `classifier.0` dropout and `classifier.1` the linear layer.
/// State-dict names as torchvision's (`features.2.0.block.1.0.weight`,
/// `features.3.1.block.2.fc1.bias`, `classifier.1.weight`, ...); BatchNorm with PyTorch's
/// defaults (eps 1e-5, momentum 0.1), as torchvision's B0 has.
///
/// In training, block `k` of the 16 keeps its residual branch per sample with probability
/// `1 - 0.2 k / 16` (stochastic depth) and the classifier drops features with probability
/// `dropout` (torchvision's default 0.2). Initialisation as torchvision's for training from
/// scratch: convolutions `kaiming_normal_(fan_out)` with zero biases, BatchNorm weight 1 and
/// bias 0, the linear weight uniform in ±1/√num_classes with a zero bias.
///
/// Fine-tuning gives the classifier another initialisation: torchvision refuses
/// `efficientnet_b0(weights=..., num_classes=8)`, so its recipe loads the weights and then
/// replaces the head, `model.classifier[1] = nn.Linear(1280, 8)`, whose default draws weight
/// and bias uniformly in ±1/√1280, about 13 times narrower than ±1/√8.
/// [`EfficientNet::init_unloaded`] does that for a classifier that a partial load left out.
#[derive(Debug)]
pub struct EfficientNet {
    stem: ConvBn,
    blocks: Vec<MbConv>,
    head: ConvBn,
    linear: nn::Linear,
    /// The state-dict names of `linear`'s weight and bias (`classifier.1.weight`, ...).
    linear_names: [String; 2],
    /// `linear`'s input features (1280).
    linear_in: i64,
    dropout: f64,
}

impl EfficientNet {
    /// B0's variables under `root` (normally `vs.root()`), with classifier dropout
    /// `dropout` (torchvision's: 0.2).
    pub fn b0(root: &nn::Path, num_classes: i64, dropout: f64) -> Self {
        let features = root / "features";
        let stem = ConvBn::new(&features / 0, 3, 32, 3, 2, 1);
        let total: usize = B0_STAGES.iter().map(|s| s.5).sum();
        let mut blocks = Vec::with_capacity(total);
        for (s, &(ratio, kernel, stride, c_in, c_out, n)) in B0_STAGES.iter().enumerate() {
            let stage = &features / (s + 1);
            for b in 0..n {
                let (c_in, stride) = if b == 0 { (c_in, stride) } else { (c_out, 1) };
                let drop_prob = STOCHASTIC_DEPTH * blocks.len() as f64 / total as f64;
                let spec = (ratio, kernel, stride, c_in, c_out);
                blocks.push(MbConv::new(&stage / b, spec, drop_prob));
            }
        }
        let last_in = B0_STAGES[B0_STAGES.len() - 1].4;
        let last_out = 4 * last_in;
        let head = ConvBn::new(
            &features / (B0_STAGES.len() + 1),
            last_in,
            last_out,
            1,
            1,
            1,
        );
        let bound = 1.0 / (num_classes as f64).sqrt();
        let classifier = root / "classifier" / 1;
        let linear_names = [classifier.path("weight"), classifier.path("bias")];
        let linear = nn::linear(
            classifier,
            last_out,
            num_classes,
            nn::LinearConfig {
                ws_init: Init::Uniform {
                    lo: -bound,
                    up: bound,
                },
                bs_init: Some(Init::Const(0.0)),
                bias: true,
            },
        );
        Self {
            stem,
            blocks,
            head,
            linear,
            linear_names,
            linear_in: last_out,
            dropout,
        }
    }

    /// Gives the classifier's weight and bias, each unless `report` (a load into this model's
    /// `VarStore`) loaded it, their fine-tuning initialisation: `nn.Linear`'s default, uniform
    /// in ±1/√1280 (`kaiming_uniform_(a=√5)` for the weight), as torchvision's recipe of
    /// replacing the pretrained head with a new `nn.Linear` gives. Returns the names of the
    /// tensors drawn anew. Every other tensor keeps its value.
    pub fn init_unloaded(&self, report: &LoadReport) -> Vec<String> {
        let bound = 1.0 / (self.linear_in as f64).sqrt();
        let tensors = [Some(&self.linear.ws), self.linear.bs.as_ref()];
        let mut drawn = Vec::new();
        tch::no_grad(|| {
            for (name, tensor) in self.linear_names.iter().zip(tensors) {
                let Some(tensor) = tensor else { continue };
                if report.loaded.contains(name) {
                    continue;
                }
                let _ = tensor.shallow_clone().uniform_(-bound, bound);
                drawn.push(name.clone());
            }
        });
        drawn
    }

    /// The classifier's dropout probability.
    pub fn dropout(&self) -> f64 {
        self.dropout
    }

    /// Logits `[B, num_classes]` for images `[B, 3, H, W]`; `train` selects BatchNorm's batch
    /// statistics, stochastic depth and dropout, as `model.train()` does.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut x = self.stem.forward_t(xs, train);
        for block in &self.blocks {
            x = block.forward_t(&x, train);
        }
        self.head
            .forward_t(&x, train)
            .adaptive_avg_pool2d([1, 1])
            .flatten(1, -1)
            .dropout(self.dropout, train)
            .apply(&self.linear)
    }
}

impl ModuleT for EfficientNet {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        EfficientNet::forward_t(self, xs, train)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_rounding_is_torchvisions() {
        assert_eq!(make_divisible(96.0), 96);
        assert_eq!(make_divisible(3.0), 8);
        assert_eq!(make_divisible(20.0), 24);
        assert_eq!(make_divisible(13.0), 16);
    }
}
