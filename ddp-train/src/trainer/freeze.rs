//! Frozen parameters ([`crate::FreezeSettings`]): which parameters a prefix names, switching
//! their `requires_grad`, and the change at the unfreeze epoch (DDP rebuilt, the optimizer
//! given the new parameter set).

use std::collections::BTreeSet;
use std::path::Path;

use tch::nn;

use super::startup::trainable;
use super::Trainer;
use crate::error::{SettingError, TrainError};
use crate::settings::{prefix_matches, FreezeSettings};
use crate::task::Task;

/// The names of the model's parameters (its variables that require a gradient when built),
/// in DDP order, every name of a tied weight: a prefix may name it by any of them, as
/// PyTorch's `requires_grad_(False)` on either module freezes it.
pub(super) fn declared_parameters(vs: &nn::VarStore) -> Vec<String> {
    let mut names: Vec<String> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .map(|(n, _)| n)
        .collect();
    names.sort_by(|a, b| ddp_model::checkpoint::natural_cmp(a, b));
    names
}

/// The parameters `freeze`'s prefixes name, in `parameters`' order; an error names the first
/// prefix that names none.
pub(super) fn freezable(
    parameters: &[String],
    freeze: &FreezeSettings,
) -> Result<Vec<String>, SettingError> {
    if let Some(p) = freeze
        .prefixes
        .iter()
        .find(|p| !parameters.iter().any(|n| prefix_matches(p, n)))
    {
        let mut roots: Vec<&str> = parameters
            .iter()
            .map(|n| n.split('.').next().unwrap_or(n))
            .collect();
        roots.dedup();
        return Err(SettingError::new(
            "freeze.prefixes",
            format!(
                ": '{p}' names no parameter of the model (a prefix is a whole name or its \
                 first dotted components; the model's top-level names: {})",
                roots.join(", ")
            ),
        ));
    }
    Ok(parameters
        .iter()
        .filter(|n| freeze.matches(n))
        .cloned()
        .collect())
}

/// The frozen parameters a checkpoint recorded, in `parameters`' order; an error when it
/// names one the model does not have.
pub(super) fn recorded(
    parameters: &[String],
    frozen: &[String],
    file: &Path,
) -> Result<Vec<String>, TrainError> {
    let known: BTreeSet<&str> = parameters.iter().map(String::as_str).collect();
    if let Some(unknown) = frozen.iter().find(|n| !known.contains(n.as_str())) {
        return Err(TrainError::Invalid(format!(
            "{} records '{unknown}' as frozen, but the model has no such parameter: resume \
             with the model the checkpoint was written with",
            file.display()
        )));
    }
    let frozen: BTreeSet<&str> = frozen.iter().map(String::as_str).collect();
    Ok(parameters
        .iter()
        .filter(|n| frozen.contains(n.as_str()))
        .cloned()
        .collect())
}

/// Turns `requires_grad` off for the `frozen` ones among `parameters`, on for the others. A
/// tied weight is one tensor: frozen when any of its names is.
pub(super) fn set_frozen(vs: &nn::VarStore, parameters: &[String], frozen: &[String]) {
    let variables = vs.variables();
    let frozen: BTreeSet<usize> = frozen
        .iter()
        .filter_map(|n| variables.get(n))
        .map(tch_ext::tensor_id)
        .collect();
    for name in parameters {
        if let Some(t) = variables.get(name) {
            let _ = t.set_requires_grad(!frozen.contains(&tch_ext::tensor_id(t)));
        }
    }
}

impl<T: Task> Trainer<T> {
    /// Before epoch `epoch`: the parameters [`crate::Settings::freeze`] freezes in it. When
    /// they differ from those frozen now, switches them, wraps the model in DDP again over
    /// the new parameter set and hands it to the optimizer (new parameters start with fresh
    /// state, as after PyTorch's `add_param_group`). Every rank does the same at the same
    /// epoch.
    pub(super) fn freeze_for_epoch(&mut self, epoch: u64) -> Result<(), TrainError> {
        let wanted = if self.settings.freeze.frozen_in(epoch) {
            freezable(&self.parameters, &self.settings.freeze)?
        } else {
            Vec::new()
        };
        if wanted == self.frozen {
            return Ok(());
        }
        set_frozen(&self.vs, &self.parameters, &wanted);
        self.ddp.rebuild(&self.vs)?;
        self.optimizer.set_params(trainable(&self.vs));
        let (before, now) = (self.frozen.len(), wanted.len());
        self.frozen = wanted;
        if self.pg.rank() == 0 {
            self.log.say(&format!(
                "epoch {epoch}: {} parameters train, {now} frozen (were {before}); DDP wraps \
                 the model again",
                self.parameters.len() - now
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tied weight is frozen by either of its names, and a checkpoint that recorded the
    /// second name resumes.
    #[test]
    fn a_tied_weight_is_frozen_by_any_of_its_names() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().var("embed", &[2], nn::Init::Const(5.0));
        let _tied = vs.root().sub("head").add("weight", w.shallow_clone(), true);
        let other = vs.root().var("out", &[1], nn::Init::Const(1.0));
        let parameters = declared_parameters(&vs);
        assert_eq!(parameters, ["embed", "head.weight", "out"]);
        let freeze = FreezeSettings::default().prefixes(vec!["head".into()]);
        let frozen = freezable(&parameters, &freeze).unwrap();
        assert_eq!(frozen, ["head.weight"]);
        set_frozen(&vs, &parameters, &frozen);
        assert!(!w.requires_grad());
        assert!(other.requires_grad());
        assert_eq!(trainable(&vs).len(), 1);
        let file = Path::new("epoch-0001.safetensors");
        assert_eq!(
            recorded(&parameters, &["head.weight".into()], file).unwrap(),
            ["head.weight"]
        );
        set_frozen(&vs, &parameters, &[]);
        assert!(w.requires_grad());
    }

    #[test]
    fn a_prefix_that_names_nothing_is_an_error_naming_it() {
        let parameters: Vec<String> = ["conv1.weight", "layer1.0.conv1.weight", "fc.bias"]
            .map(String::from)
            .to_vec();
        let f = FreezeSettings::default().prefixes(vec!["conv1".into(), "layer1".into()]);
        assert_eq!(
            freezable(&parameters, &f).unwrap(),
            ["conv1.weight", "layer1.0.conv1.weight"]
        );
        let f = FreezeSettings::default().prefixes(vec!["layer".into()]);
        let e = freezable(&parameters, &f).unwrap_err();
        assert_eq!(
            e.to_string(),
            "freeze.prefixes: 'layer' names no parameter of the model (a prefix is a whole \
             name or its first dotted components; the model's top-level names: conv1, layer1, \
             fc)"
        );
        let e = recorded(&parameters, &["fc.weight".into()], Path::new("c")).unwrap_err();
        assert!(e.to_string().contains("'fc.weight' as frozen"), "{e}");
    }
}
