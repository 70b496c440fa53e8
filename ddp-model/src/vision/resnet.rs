//! [`ResNet`]: torchvision's `resnet18`, `resnet34` and `resnet50` (ResNet v1.5: a
//! bottleneck's stride is on its 3x3 convolution).

use tch::nn::{self, Init, ModuleT};
use tch::Tensor;

use super::conv;
use crate::norm::BatchNorm2d;

/// Which ResNet: the block and the number of blocks per stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResNetDepth {
    /// `resnet18`: basic blocks `[2, 2, 2, 2]`.
    R18,
    /// `resnet34`: basic blocks `[3, 4, 6, 3]`.
    R34,
    /// `resnet50`: bottlenecks `[3, 4, 6, 3]`.
    R50,
}

impl ResNetDepth {
    fn blocks(self) -> [usize; 4] {
        match self {
            Self::R18 => [2, 2, 2, 2],
            Self::R34 | Self::R50 => [3, 4, 6, 3],
        }
    }

    /// Output channels over a stage's width (`expansion` in torchvision).
    fn expansion(self) -> i64 {
        match self {
            Self::R18 | Self::R34 => 1,
            Self::R50 => 4,
        }
    }
}

/// A residual block's convolutions and BatchNorms (`conv1`, `bn1`, ...), and `downsample`
/// (`downsample.0` conv 1x1, `downsample.1` BatchNorm) when the shape changes.
#[derive(Debug)]
struct Block {
    /// `(conv, bn)` pairs in order: two for a basic block, three for a bottleneck.
    convs: Vec<(nn::Conv2D, BatchNorm2d)>,
    downsample: Option<(nn::Conv2D, BatchNorm2d)>,
}

impl Block {
    fn new(p: nn::Path, depth: ResNetDepth, c_in: i64, width: i64, stride: i64) -> Self {
        let c_out = width * depth.expansion();
        // (in, out, kernel, stride) of conv1.., as torchvision builds them.
        let shapes: Vec<(i64, i64, i64, i64)> = match depth {
            ResNetDepth::R18 | ResNetDepth::R34 => {
                vec![(c_in, width, 3, stride), (width, width, 3, 1)]
            }
            ResNetDepth::R50 => vec![
                (c_in, width, 1, 1),
                (width, width, 3, stride),
                (width, c_out, 1, 1),
            ],
        };
        let convs = shapes
            .into_iter()
            .enumerate()
            .map(|(i, (a, b, k, s))| {
                let c = conv(&p / format!("conv{}", i + 1), a, b, k, s, 1, false);
                let bn = BatchNorm2d::new(&p / format!("bn{}", i + 1), b);
                (c, bn)
            })
            .collect();
        let downsample = (stride != 1 || c_in != c_out).then(|| {
            let d = &p / "downsample";
            (
                conv(&d / 0, c_in, c_out, 1, stride, 1, false),
                BatchNorm2d::new(&d / 1, c_out),
            )
        });
        Self { convs, downsample }
    }

    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let last = self.convs.len() - 1;
        let mut out = x.shallow_clone();
        // In place where torchvision's blocks are (`ReLU(inplace=True)`, `out += identity`):
        // BatchNorm's and the sum's backward do not read their outputs, and ReLU's reads
        // only its own, so this saves an allocation per operation and changes no value.
        for (i, (c, bn)) in self.convs.iter().enumerate() {
            out = bn.forward_t(&out.apply(c), train);
            if i != last {
                out = out.relu_();
            }
        }
        let identity = match &self.downsample {
            Some((c, bn)) => bn.forward_t(&x.apply(c), train),
            None => x.shallow_clone(),
        };
        let _ = out.g_add_(&identity);
        out.relu_()
    }
}

/// torchvision's `ResNet` with `zero_init_residual=False`, `groups=1`, `width_per_group=64`
/// and no dilation: `conv1` 7x7/2, `bn1`, ReLU, max-pool 3x3/2, `layer1`..`layer4` (widths
/// 64, 128, 256, 512, the first block of layers 2-4 with stride 2), global average pool,
/// `fc`. State-dict names as torchvision's: `conv1.weight`, `bn1.running_mean`,
/// `layer2.0.downsample.0.weight`, `layer3.1.bn2.num_batches_tracked`, `fc.bias`, ...
///
/// Initialisation as torchvision's: convolutions `kaiming_normal_(fan_out, relu)`,
/// BatchNorm weight 1 and bias 0, `fc` as `nn.Linear` (uniform in ±1/√fan_in, bias too).
/// There is no dropout.
#[derive(Debug)]
pub struct ResNet {
    conv1: nn::Conv2D,
    bn1: BatchNorm2d,
    layers: Vec<Vec<Block>>,
    fc: nn::Linear,
    depth: ResNetDepth,
}

impl ResNet {
    /// Creates the model's variables under `root` (normally `vs.root()`).
    pub fn new(root: &nn::Path, depth: ResNetDepth, num_classes: i64) -> Self {
        let conv1 = conv(root / "conv1", 3, 64, 7, 2, 1, false);
        let bn1 = BatchNorm2d::new(root / "bn1", 64);
        let mut c_in = 64;
        let layers = [64i64, 128, 256, 512]
            .into_iter()
            .zip(depth.blocks())
            .enumerate()
            .map(|(l, (width, n))| {
                let stage = root / format!("layer{}", l + 1);
                (0..n)
                    .map(|b| {
                        let stride = if l > 0 && b == 0 { 2 } else { 1 };
                        let block = Block::new(&stage / b, depth, c_in, width, stride);
                        c_in = width * depth.expansion();
                        block
                    })
                    .collect()
            })
            .collect();
        let bound = 1.0 / (c_in as f64).sqrt();
        let uniform = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let fc = nn::linear(
            root / "fc",
            c_in,
            num_classes,
            nn::LinearConfig {
                ws_init: uniform,
                bs_init: Some(uniform),
                bias: true,
            },
        );
        Self {
            conv1,
            bn1,
            layers,
            fc,
            depth,
        }
    }

    /// Which ResNet this is.
    pub fn depth(&self) -> ResNetDepth {
        self.depth
    }

    /// Logits `[B, num_classes]` for images `[B, 3, H, W]`; `train` selects BatchNorm's
    /// batch statistics (updating the running ones), as `model.train()` does.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut x = self
            .bn1
            .forward_t(&xs.apply(&self.conv1), train)
            .relu_()
            .max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false);
        for block in self.layers.iter().flatten() {
            x = block.forward_t(&x, train);
        }
        x.adaptive_avg_pool2d([1, 1]).flatten(1, -1).apply(&self.fc)
    }
}

impl ModuleT for ResNet {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        ResNet::forward_t(self, xs, train)
    }
}
