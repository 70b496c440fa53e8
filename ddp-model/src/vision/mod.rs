//! torchvision's ImageNet backbones with torchvision's `state_dict()` names, so that a
//! torchvision checkpoint loads by name: [`ResNet`] (`resnet18`, `resnet34`, `resnet50`) and
//! [`EfficientNet`] (`efficientnet_b0`).
//!
//! Each is the same function as torchvision 0.28's model of that name: the same blocks,
//! strides, paddings and activations, BatchNorm with torchvision's `eps` and `momentum`
//! (PyTorch's 1e-5 and 0.1 for these four), and in training the same stochastic depth and
//! dropout. The initial weights are drawn from the distributions torchvision uses (libtorch's
//! random numbers, seeded by the caller, so not torchvision's values). Every BatchNorm is a
//! [`crate::norm::BatchNorm2d`], so [`crate::norm::BatchNormLayers::collect`] finds them and
//! they can take their statistics over every rank.

mod efficientnet;
mod resnet;

pub use efficientnet::EfficientNet;
pub(crate) use efficientnet::B0_DROPOUT;
pub use resnet::{ResNet, ResNetDepth};

use tch::nn::{self, init::FanInOut, init::NonLinearity, init::NormalOrUniform, Init};

/// torchvision's convolution initialisation in both families:
/// `kaiming_normal_(mode="fan_out", nonlinearity="relu")` (EfficientNet's default
/// `leaky_relu` with slope 0 has the same gain, √2), biases zero.
const CONV_INIT: Init = Init::Kaiming {
    dist: NormalOrUniform::Normal,
    fan: FanInOut::FanOut,
    non_linearity: NonLinearity::ReLU,
};

/// A `Conv2d` under `path` with torchvision's initialisation and its "same" padding
/// (`(kernel - 1) / 2`, what both families use).
fn conv(
    path: nn::Path,
    c_in: i64,
    c_out: i64,
    kernel: i64,
    stride: i64,
    groups: i64,
    bias: bool,
) -> nn::Conv2D {
    let config = nn::ConvConfig {
        stride,
        padding: (kernel - 1) / 2,
        groups,
        bias,
        ws_init: CONV_INIT,
        bs_init: Init::Const(0.0),
        ..Default::default()
    };
    nn::conv2d(path, c_in, c_out, kernel, config)
}
