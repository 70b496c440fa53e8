//! [`FreezeSettings`]: parameters that do not train for the first epochs of a fine-tuning
//! run (`--freeze`, `--unfreeze-at`).

use serde::{Deserialize, Serialize};

use crate::error::SettingError;

/// Parameters that do not train, until an epoch from which they do: a pretrained backbone
/// kept fixed while a new head learns, then fine-tuned as a whole.
///
/// A prefix names the parameters whose name equals it or starts with it and a dot
/// (`layer1` freezes `layer1.0.conv1.weight`, not `layer10.*`). Frozen parameters get no
/// gradient, are not in DDP's buckets, and have no optimizer state (PyTorch's
/// `requires_grad_(False)` before building DDP and the optimizer); BatchNorm layers still
/// update their running statistics in training, as PyTorch's do. From `unfreeze_at` on
/// they train: DDP is rebuilt over the new parameter set and the optimizer takes them with
/// fresh state. Each checkpoint records which parameters were frozen, so a resume continues
/// exactly.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(default)]
#[non_exhaustive]
pub struct FreezeSettings {
    /// Prefixes of the parameter names to freeze; empty: none.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "freeze.prefixes",
            long = "freeze",
            value_name = "PREFIX",
            num_args = 1..,
            value_delimiter = ',',
            help = "Freeze the parameters whose name is PREFIX or starts with `PREFIX.` \
                    (`--freeze conv1 bn1 layer1`): no gradient, no optimizer state, not in \
                    DDP's buckets"
        )
    )]
    pub prefixes: Vec<String>,
    /// The first epoch in which the frozen parameters train; `None`: never.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "freeze.unfreeze_at",
            long = "unfreeze-at",
            value_name = "EPOCH",
            help = "Train the --freeze parameters from this epoch on (DDP is rebuilt over them, \
                    the optimizer takes them with fresh state)"
        )
    )]
    pub unfreeze_at: Option<u64>,
}

builder!(FreezeSettings {
    prefixes: Vec<String>,
    unfreeze_at: Option<u64>,
});

impl FreezeSettings {
    /// Whether the parameters of [`FreezeSettings::prefixes`] are frozen in `epoch`.
    pub fn frozen_in(&self, epoch: u64) -> bool {
        !self.prefixes.is_empty() && self.unfreeze_at.is_none_or(|at| epoch < at)
    }

    /// Whether `name` is one of the parameters a prefix names.
    pub fn matches(&self, name: &str) -> bool {
        self.prefixes.iter().any(|p| prefix_matches(p, name))
    }

    /// The refusal of prefixes that freeze all `parameters` of the model from the first
    /// epoch (a training run would train nothing, and DDP refuses a model without a
    /// parameter that trains, as PyTorch's does).
    pub(crate) fn nothing_to_train(&self, parameters: usize) -> SettingError {
        SettingError::new(
            "freeze.prefixes",
            format!(
                " ({}) freeze all {} parameters of the model, which leaves nothing to train: \
                 leave some parameters out",
                self.prefixes.join(", "),
                parameters
            ),
        )
    }

    pub(super) fn validate(&self) -> Result<(), SettingError> {
        if self.prefixes.iter().any(|p| p.is_empty()) {
            return Err(SettingError::new(
                "freeze.prefixes",
                " has an empty prefix: give parameter name prefixes such as layer1",
            ));
        }
        match self.unfreeze_at {
            Some(0) => Err(SettingError::new(
                "freeze.unfreeze_at",
                " must be at least 1 (epochs count from 1)",
            )),
            Some(_) if self.prefixes.is_empty() => {
                Err(SettingError::new("freeze.unfreeze_at", " needs ")
                    .setting("freeze.prefixes")
                    .text(" (the parameters to unfreeze)"))
            }
            _ => Ok(()),
        }
    }
}

/// `name` is `prefix` or starts with `prefix.`.
pub(crate) fn prefix_matches(prefix: &str, name: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_names_whole_components() {
        let f = FreezeSettings::default().prefixes(vec!["layer1".into(), "fc.bias".into()]);
        assert!(f.matches("layer1.0.conv1.weight"));
        assert!(f.matches("fc.bias"));
        assert!(!f.matches("layer10.weight"));
        assert!(!f.matches("fc.weight"));
        assert!(f.frozen_in(7));
        let f = f.unfreeze_at(Some(3));
        assert!(f.frozen_in(2) && !f.frozen_in(3));
        assert!(!FreezeSettings::default().frozen_in(1));
    }

    #[test]
    fn prefixes_that_freeze_everything_are_refused() {
        let all = FreezeSettings::default().prefixes(vec!["conv1".into(), "fc".into()]);
        let e = all.nothing_to_train(3);
        assert_eq!(e.field(), "freeze.prefixes");
        assert_eq!(
            e.to_string(),
            "freeze.prefixes (conv1, fc) freeze all 3 parameters of the model, which leaves \
             nothing to train: leave some parameters out"
        );
    }

    #[test]
    fn validation_names_the_setting() {
        let e = FreezeSettings::default().unfreeze_at(Some(2)).validate();
        assert_eq!(
            e.unwrap_err().to_string(),
            "freeze.unfreeze_at needs freeze.prefixes (the parameters to unfreeze)"
        );
        let e = FreezeSettings::default()
            .prefixes(vec!["a".into()])
            .unfreeze_at(Some(0))
            .validate();
        assert_eq!(
            e.unwrap_err().to_string(),
            "freeze.unfreeze_at must be at least 1 (epochs count from 1)"
        );
    }
}
