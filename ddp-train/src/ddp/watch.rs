//! [`StoreWatch`]: notices that the store changed after DDP wrapped it, where only
//! [`rebuild`](super::DistributedDataParallel::rebuild) takes the change in. A variable added
//! since (a new head) has no hook, no bucket and no first broadcast: its gradient would stay
//! local while `sync_gradients` succeeds, and tch's optimizer steps it all the same.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use ddp_model::checkpoint::natural_cmp;
use tch::nn::{VarStore, Variables};
use tch::Tensor;
use tch_ext::tensor_id;

use super::{lock, Named};

/// What DDP wrapped of a store: its variables' counts, and the frozen parameters.
#[derive(Debug)]
pub(super) struct StoreWatch {
    variables: Arc<Mutex<Variables>>,
    /// The store's trainable variables (a tied weight once per name) when wrapped.
    pub(super) trainable: usize,
    /// All its variables, buffers included.
    named: usize,
    /// The parameters wrapped frozen, which must stay frozen.
    frozen: Named,
}

impl StoreWatch {
    pub(super) fn new(vs: &VarStore, frozen: Named) -> Self {
        let (trainable, named) = {
            let v = lock(&vs.variables_);
            (v.trainable_variables.len(), v.named_variables.len())
        };
        StoreWatch {
            variables: vs.variables_.clone(),
            trainable,
            named,
            frozen,
        }
    }

    /// The change that makes [`ModelChanged`](super::DdpError::ModelChanged) (the variable and what happened to
    /// it), if any: a parameter wrapped frozen is trainable now, or the store holds a
    /// trainable variable it did not hold when wrapped; with `with_buffers`, a buffer too. A
    /// wrapped parameter frozen since is no change: it gets no gradient, so DDP counts it
    /// unused, as PyTorch's does. No allocation unless the store holds more variables than
    /// last time; new names of wrapped tensors (a tie) are then taken as the new counts.
    pub(super) fn check(
        &mut self,
        params: &[(String, Tensor)],
        buffers: &[(String, Tensor)],
        with_buffers: bool,
    ) -> Option<(String, &'static str)> {
        if let Some((name, _)) = self.frozen.iter().find(|(_, p)| p.requires_grad()) {
            return Some((name.clone(), "unfrozen"));
        }
        let variables = lock(&self.variables);
        let (trainable, named) = (
            variables.trainable_variables.len(),
            variables.named_variables.len(),
        );
        let grew = trainable != self.trainable || (with_buffers && named != self.named);
        if !grew {
            return None;
        }
        let known: HashSet<usize> = params
            .iter()
            .chain(&self.frozen)
            .chain(buffers)
            .map(|(_, t)| tensor_id(t))
            .collect();
        // The first new one by name, a trainable one before a buffer.
        let added = variables
            .named_variables
            .iter()
            .filter(|(_, t)| with_buffers || t.requires_grad())
            .filter(|(_, t)| !known.contains(&tensor_id(t)))
            .min_by(|a, b| {
                (!a.1.requires_grad())
                    .cmp(&!b.1.requires_grad())
                    .then_with(|| natural_cmp(a.0, b.0))
            });
        if let Some((name, _)) = added {
            return Some((name.clone(), "added to the store"));
        }
        // New names of wrapped tensors (a tie), or fewer variables: nothing DDP misses.
        drop(variables);
        self.trainable = trainable;
        if with_buffers {
            self.named = named;
        }
        None
    }
}
