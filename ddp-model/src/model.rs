//! [`Model`]: any of the crate's models behind one type, chosen by [`ModelKind`] (a command
//! line's `--model`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tch::nn::{self, ModuleT};
use tch::Tensor;

use crate::vision::{EfficientNet, ResNet, ResNetDepth};
use crate::weights::LoadReport;
use crate::{ConvNet, ConvNetConfig};

/// Which model to build: the crate's ConvNet or one of torchvision's backbones. Written and
/// parsed as its torchvision name (`resnet50`), in lower case, also by serde.
///
/// ```
/// use ddp_model::ModelKind;
///
/// let kind: ModelKind = "efficientnet_b0".parse()?;
/// assert_eq!(kind, ModelKind::EfficientNetB0);
/// assert_eq!(kind.to_string(), "efficientnet_b0");
/// let error = "resnet101".parse::<ModelKind>().unwrap_err();
/// assert_eq!(
///     error.to_string(),
///     "unknown model 'resnet101': choose one of convnet, resnet18, resnet34, resnet50, efficientnet_b0"
/// );
/// # Ok::<(), ddp_model::UnknownModel>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// [`ConvNet`], trained from scratch.
    #[default]
    Convnet,
    /// torchvision's `resnet18`.
    Resnet18,
    /// torchvision's `resnet34`.
    Resnet34,
    /// torchvision's `resnet50`.
    Resnet50,
    /// torchvision's `efficientnet_b0`.
    #[serde(rename = "efficientnet_b0")]
    EfficientNetB0,
}

impl ModelKind {
    /// Every kind, in the order the choices are listed.
    pub const ALL: [ModelKind; 5] = [
        Self::Convnet,
        Self::Resnet18,
        Self::Resnet34,
        Self::Resnet50,
        Self::EfficientNetB0,
    ];

    /// The kind whose state_dict has exactly these tensor names (as a model's own, without
    /// DDP's `module.` prefix; BatchNorm's `num_batches_tracked` counters aside), if one has:
    /// tells which model a file holds. Builds each
    /// model once on the CPU to list its names, so it is meant for error paths.
    pub fn holding<'a>(names: impl IntoIterator<Item = &'a str>) -> Option<ModelKind> {
        // torchvision's ImageNet files predate BatchNorm's counters: they are no difference.
        let counter = |name: &str| name.ends_with("num_batches_tracked");
        let mut names: Vec<&str> = names.into_iter().filter(|n| !counter(n)).collect();
        names.sort_unstable();
        names.dedup();
        Self::ALL.into_iter().find(|&kind| {
            let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            let _model = Model::new(&vs.root(), kind, 8, None);
            let mut own: Vec<String> = crate::checkpoint::named_tensors(&vs)
                .into_iter()
                .map(|(n, _)| n)
                .filter(|n| !counter(n))
                .collect();
            own.sort_unstable();
            own.len() == names.len() && own.iter().zip(&names).all(|(a, b)| a == b)
        })
    }

    /// The kind's name: torchvision's function name, or `convnet`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Convnet => "convnet",
            Self::Resnet18 => "resnet18",
            Self::Resnet34 => "resnet34",
            Self::Resnet50 => "resnet50",
            Self::EfficientNetB0 => "efficientnet_b0",
        }
    }

    /// The dropout the architecture applies before its classifier when none is given:
    /// [`ConvNetConfig`]'s 0.5, torchvision's 0.2 for EfficientNet-B0; `None` for the
    /// ResNets, which have no dropout.
    pub fn default_dropout(self) -> Option<f64> {
        match self {
            Self::Convnet => Some(ConvNetConfig::default().dropout),
            Self::EfficientNetB0 => Some(crate::vision::B0_DROPOUT),
            Self::Resnet18 | Self::Resnet34 | Self::Resnet50 => None,
        }
    }

    /// The smallest square input side the model accepts (the ConvNet's four unpadded 2x
    /// poolings need 16 pixels; the others pad every pooling).
    pub fn min_image_size(self) -> i64 {
        match self {
            Self::Convnet => ConvNet::MIN_IMAGE_SIZE,
            _ => 1,
        }
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A model name that [`ModelKind`] does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown model '{0}': choose one of convnet, resnet18, resnet34, resnet50, efficientnet_b0"
)]
pub struct UnknownModel(pub String);

impl FromStr for ModelKind {
    type Err = UnknownModel;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownModel(s.to_string()))
    }
}

/// One of the crate's models, built by [`Model::new`] from a [`ModelKind`].
///
/// ```
/// use ddp_model::{Model, ModelKind};
/// use tch::{nn, Device, Kind, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let model = Model::new(&vs.root(), ModelKind::Resnet18, 8, None);
/// assert_eq!(vs.variables()["layer2.0.downsample.0.weight"].size(), [128, 64, 1, 1]);
/// let logits = model.forward_t(&Tensor::rand([2, 3, 32, 32], (Kind::Float, Device::Cpu)), false);
/// assert_eq!(logits.size(), [2, 8]);
/// ```
#[derive(Debug)]
pub enum Model {
    /// [`ConvNet`].
    ConvNet(ConvNet),
    /// A torchvision ResNet (boxed: the variants' sizes differ by hundreds of bytes).
    ResNet(Box<ResNet>),
    /// A torchvision EfficientNet.
    EfficientNet(Box<EfficientNet>),
}

impl Model {
    /// Builds `kind` with `num_classes` outputs under `root` (normally `vs.root()`).
    ///
    /// `dropout` is the probability of the dropout before the classifier, where the
    /// architecture has one: the ConvNet's (on its pooled features), EfficientNet's
    /// `classifier.0`. `None` takes [`ModelKind::default_dropout`]. The ResNets have no
    /// dropout and ignore it.
    pub fn new(root: &nn::Path, kind: ModelKind, num_classes: i64, dropout: Option<f64>) -> Self {
        let dropout = dropout.or(kind.default_dropout()).unwrap_or(0.0);
        let resnet = |depth| Self::ResNet(Box::new(ResNet::new(root, depth, num_classes)));
        match kind {
            ModelKind::Convnet => Self::ConvNet(ConvNet::new(
                root,
                ConvNetConfig {
                    num_classes,
                    dropout,
                },
            )),
            ModelKind::Resnet18 => resnet(ResNetDepth::R18),
            ModelKind::Resnet34 => resnet(ResNetDepth::R34),
            ModelKind::Resnet50 => resnet(ResNetDepth::R50),
            ModelKind::EfficientNetB0 => {
                Self::EfficientNet(Box::new(EfficientNet::b0(root, num_classes, dropout)))
            }
        }
    }

    /// Which kind this is.
    pub fn kind(&self) -> ModelKind {
        match self {
            Self::ConvNet(_) => ModelKind::Convnet,
            Self::ResNet(r) => match r.depth() {
                ResNetDepth::R18 => ModelKind::Resnet18,
                ResNetDepth::R34 => ModelKind::Resnet34,
                ResNetDepth::R50 => ModelKind::Resnet50,
            },
            Self::EfficientNet(_) => ModelKind::EfficientNetB0,
        }
    }

    /// Gives the tensors that `report`, a partial load of pretrained weights into this
    /// model's `VarStore`, left out their fine-tuning initialisation, where it differs from
    /// training from scratch: EfficientNet's classifier that of a new `nn.Linear`
    /// ([`EfficientNet::init_unloaded`]). The ResNets' `fc` and the ConvNet's classifier are
    /// initialised as `nn.Linear` already. Returns the names of the tensors drawn anew.
    pub fn init_unloaded(&self, report: &LoadReport) -> Vec<String> {
        match self {
            Self::EfficientNet(m) => m.init_unloaded(report),
            Self::ConvNet(_) | Self::ResNet(_) => Vec::new(),
        }
    }

    /// Logits `[B, num_classes]` for images `[B, 3, H, W]`; `train` selects the training
    /// behaviour (BatchNorm's batch statistics, dropout, stochastic depth), as
    /// `model.train()` does.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        match self {
            Self::ConvNet(m) => m.forward_t(xs, train),
            Self::ResNet(m) => m.forward_t(xs, train),
            Self::EfficientNet(m) => m.forward_t(xs, train),
        }
    }
}

impl ModuleT for Model {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        Model::forward_t(self, xs, train)
    }
}
