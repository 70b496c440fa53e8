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

use super::{lock, DdpError, Named};

/// What DDP wrapped of a store: its variables' counts, and the frozen parameters.
#[derive(Debug)]
pub(super) struct StoreWatch {
    variables: Arc<Mutex<Variables>>,
    /// The store's trainable variables (a tied weight once per name) when wrapped.
    trainable: usize,
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

    /// [`DdpError::ModelChanged`] when one of `params` was frozen or a frozen one unfrozen,
    /// or the store holds a trainable variable it did not hold when wrapped; with
    /// `with_buffers`, a buffer too. No allocation unless something changed.
    pub(super) fn check(
        &self,
        rank: usize,
        params: &[(String, Tensor)],
        buffers: &[(String, Tensor)],
        with_buffers: bool,
    ) -> Result<(), DdpError> {
        let changed = |variable: &str, change| DdpError::ModelChanged {
            rank,
            variable: variable.to_string(),
            change,
        };
        if let Some((name, _)) = params.iter().find(|(_, p)| !p.requires_grad()) {
            return Err(changed(name, "frozen"));
        }
        if let Some((name, _)) = self.frozen.iter().find(|(_, p)| p.requires_grad()) {
            return Err(changed(name, "unfrozen"));
        }
        let variables = lock(&self.variables);
        let grew = variables.trainable_variables.len() != self.trainable
            || (with_buffers && variables.named_variables.len() != self.named);
        if !grew {
            return Ok(());
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
            .filter(|(_, t)| !known.contains(&tensor_id(t)))
            .min_by(|a, b| {
                (!a.1.requires_grad())
                    .cmp(&!b.1.requires_grad())
                    .then_with(|| natural_cmp(a.0, b.0))
            });
        match added {
            Some((name, _)) => Err(changed(name, "added to the store")),
            // New names of wrapped tensors (a tie), or fewer variables: nothing DDP misses.
            None => Ok(()),
        }
    }
}
