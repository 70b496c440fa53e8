//! The models that `ddp-train` trains on ODIR-5K fundus photos, and their checkpoints.
//!
//! - [`ConvNet`]: four conv/BatchNorm/ReLU/max-pool blocks and a linear classifier, the
//!   same function, tensor for tensor, as the PyTorch definition shown on its docs, with
//!   PyTorch's state-dict names (`features.0.weight`, ..., `classifier.3.bias`).
//! - [`norm::BatchNorm2d`]: PyTorch's `BatchNorm2d` (names, running statistics), switchable
//!   to statistics over every rank (`SyncBatchNorm`) through a [`norm::StatsReducer`].
//! - [`vision`]: torchvision's `resnet18`, `resnet34`, `resnet50` and `efficientnet_b0`, the
//!   same functions with torchvision's state-dict names, so that its weights load by name.
//! - [`Model`]: any of them, chosen by a [`ModelKind`] (`convnet`, `resnet50`, ...).
//! - [`checkpoint`]: safetensors files that PyTorch reads with `safetensors.torch.load_file`
//!   and `load_state_dict(strict=True)`, written atomically and loaded all-or-nothing.
//!
//! Nothing here knows about ranks, devices other than the one of the `VarStore`, or data files.
//!
//! ```
//! use ddp_model::{checkpoint, ConvNet, ConvNetConfig};
//! use tch::{nn, Device, Kind, Tensor};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let net = ConvNet::new(&vs.root(), ConvNetConfig::default());
//! let images = Tensor::rand([2, 3, 64, 64], (Kind::Float, Device::Cpu));
//! let logits = net.forward_t(&images, false);
//! assert_eq!(logits.size(), [2, 8]);
//!
//! let dir = std::env::temp_dir().join(format!("ddp-model-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir)?;
//! let path = dir.join("model.safetensors");
//! checkpoint::save(&vs, &path, &Default::default())?;
//!
//! let restored = nn::VarStore::new(Device::Cpu);
//! let net2 = ConvNet::new(&restored.root(), ConvNetConfig::default());
//! checkpoint::load(&restored, &path)?;
//! assert!(net2.forward_t(&images, false).allclose(&logits, 1e-6, 1e-6, false));
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]

pub mod checkpoint;
mod convnet;
mod model;
pub mod norm;
pub mod vision;
pub mod weights;

pub use convnet::{ConvNet, ConvNetConfig, ODIR_CLASSES};
pub use model::{Model, ModelKind, UnknownModel};
