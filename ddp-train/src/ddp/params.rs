//! The store's tensors as DDP sees them: each tensor object once, a tied weight (one tensor
//! registered under several names) under its first name, as PyTorch's DDP and
//! `module.parameters()` take each parameter object once; split into the parameters that
//! train, frozen parameters and buffers; and the description every rank compares with rank
//! 0's.

use std::collections::hash_map::{Entry, HashMap};
use std::collections::HashSet;

use ddp_comm::ProcessGroup;
use ddp_model::checkpoint::natural_cmp;
use tch::nn::VarStore;
use tch::Tensor;
use tch_ext::tensor_id;

use super::{DdpError, Named};

/// The store's tensors, each once, in DDP order (by name, numbers compared as numbers).
pub(super) struct Split {
    /// The parameters that train (require a gradient).
    pub(super) params: Named,
    /// Frozen parameters: variables the store holds as trainable (created with `var`) whose
    /// `requires_grad` is off.
    pub(super) frozen: Named,
    /// The other tensors (BatchNorm statistics, ...).
    pub(super) buffers: Named,
    /// (a name left out, the name its tensor is kept under).
    pub(super) aliases: Vec<(String, String)>,
}

/// The store's variables in DDP order, each tensor object once under its first name, and
/// the names left out as (alias, the name kept).
fn distinct_variables(vs: &VarStore) -> (Named, Vec<(String, String)>) {
    let mut all: Named = vs.variables().into_iter().collect();
    all.sort_by(|a, b| natural_cmp(&a.0, &b.0));
    let mut first: HashMap<usize, String> = HashMap::new();
    let (mut named, mut aliases) = (Vec::new(), Vec::new());
    for (name, t) in all {
        match first.entry(tensor_id(&t)) {
            Entry::Occupied(kept) => aliases.push((name, kept.get().clone())),
            Entry::Vacant(slot) => {
                slot.insert(name.clone());
                named.push((name, t));
            }
        }
    }
    (named, aliases)
}

/// The parameters that train (require a gradient) in DDP order, a tied weight once under its
/// first name: what an optimizer takes (PyTorch's `model.parameters()`), and
/// [`DistributedDataParallel::parameters`](super::DistributedDataParallel::parameters).
pub(crate) fn trainable_parameters(vs: &VarStore) -> Named {
    let (all, _) = distinct_variables(vs);
    all.into_iter().filter(|(_, t)| t.requires_grad()).collect()
}

/// Splits the store into parameters that train, frozen parameters and buffers.
pub(super) fn split_named(vs: &VarStore) -> Split {
    let (all, aliases) = distinct_variables(vs);
    let declared: HashSet<usize> = vs.trainable_variables().iter().map(tensor_id).collect();
    let (params, rest): (Named, Named) = all.into_iter().partition(|(_, t)| t.requires_grad());
    let (frozen, buffers) = rest
        .into_iter()
        .partition(|(_, t)| declared.contains(&tensor_id(t)));
    Split {
        params,
        frozen,
        buffers,
        aliases,
    }
}

fn describe(kind: &str, named: &[(String, Tensor)]) -> Vec<String> {
    named
        .iter()
        .map(|(n, t)| format!("{kind} '{n}' shape {:?} dtype {:?}", t.size(), t.kind()))
        .collect()
}

/// Compares every rank's model with rank 0's: the tensors' names, shapes and dtypes, the
/// names that share a tensor, and the first parameter that already has a hook, if any.
pub(super) fn verify_same_model(
    pg: &ProcessGroup,
    split: &Split,
    hooked: Option<&str>,
) -> Result<(), DdpError> {
    let mut mine = describe("parameter", &split.params);
    mine.extend(describe("frozen parameter", &split.frozen));
    mine.extend(describe("buffer", &split.buffers));
    mine.extend(
        split
            .aliases
            .iter()
            .map(|(alias, kept)| format!("'{alias}', the same tensor as '{kept}'")),
    );
    mine.extend(hooked.map(|n| format!("parameter '{n}' with a post-accumulate-grad hook")));
    let gathered = pg.all_gather_bytes(mine.join("\n").as_bytes())?;
    let reference: Vec<&str> = std::str::from_utf8(&gathered[0])
        .unwrap_or("")
        .lines()
        .collect();
    for (rank, bytes) in gathered.iter().enumerate().skip(1) {
        let theirs: Vec<&str> = std::str::from_utf8(bytes).unwrap_or("").lines().collect();
        if theirs == reference {
            continue;
        }
        let detail = match reference.iter().zip(&theirs).find(|(a, b)| a != b) {
            Some((a, b)) => format!("{b} (rank 0 has {a})"),
            None if theirs.len() > reference.len() => {
                format!("{} (absent on rank 0)", theirs[reference.len()])
            }
            None => format!("{} (absent on rank {rank})", reference[theirs.len()]),
        };
        return Err(DdpError::ModelMismatch { rank, detail });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tch::nn::Init;

    /// A tie on one rank only (the others hold two tensors) is a difference between the
    /// models, named on every rank: not two ranks bucketing different parameters.
    #[test]
    fn a_tie_on_one_rank_only_is_a_model_difference() {
        let port = ddp_testkit::free_port();
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                std::thread::spawn(move || {
                    let options = ddp_comm::Options::new(rank, 2, "127.0.0.1", port);
                    let pg = Arc::new(ProcessGroup::new(options).unwrap());
                    let vs = VarStore::new(tch::Device::Cpu);
                    let w = vs.root().var("embed", &[2], Init::Const(1.0));
                    let head = vs.root().sub("head");
                    let _ = match rank {
                        0 => head.add("weight", w.shallow_clone(), true),
                        _ => head.var("weight", &[2], Init::Const(1.0)),
                    };
                    let split = split_named(&vs);
                    verify_same_model(&pg, &split, None).map_err(|e| e.to_string())
                })
            })
            .collect();
        let want = "rank 1's model differs from rank 0's at tensor parameter 'head.weight' shape \
                    [2] dtype Float (rank 0 has 'head.weight', the same tensor as 'embed')";
        for rank in ranks {
            assert_eq!(rank.join().unwrap(), Err(want.to_string()));
        }
    }
}
