//! The store's tensors as DDP sees them: each tensor object once, a tied weight (one tensor
//! registered under several names) under its first name, as PyTorch's DDP and
//! `module.parameters()` take each parameter object once; split into the parameters that
//! train, frozen parameters and buffers; and the description every rank compares with rank
//! 0's.

use std::collections::hash_map::{Entry, HashMap};
use std::collections::HashSet;

use ddp_comm::ProcessGroup;
use ddp_model::checkpoint::natural_cmp;
use sha2::{Digest, Sha256};
use tch::nn::VarStore;
use tch::{Device, Tensor};
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

/// The type of `device` without its index (which differs from rank to rank by design): what
/// the ranks' devices must agree on, as NCCL carries CUDA tensors and the CPU ring the others.
pub(crate) fn device_type(device: Device) -> &'static str {
    match device {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
        Device::Mps => "mps",
        Device::Vulkan => "vulkan",
    }
}

/// What [`verify_same_model`] compares: a first line with the types of the devices the
/// tensors are on (empty for no tensor), then each tensor, tie and hook.
fn describe_model(split: &Split, hooked: Option<&str>) -> Vec<String> {
    let all = split
        .params
        .iter()
        .chain(&split.frozen)
        .chain(&split.buffers);
    let mut types: Vec<&str> = all.map(|(_, t)| device_type(t.device())).collect();
    types.sort_unstable();
    types.dedup();
    let mut mine = vec![types.join(" and ")];
    mine.extend(describe("parameter", &split.params));
    mine.extend(describe("frozen parameter", &split.frozen));
    mine.extend(describe("buffer", &split.buffers));
    mine.extend(
        split
            .aliases
            .iter()
            .map(|(alias, kept)| format!("'{alias}', the same tensor as '{kept}'")),
    );
    mine.extend(hooked.map(|n| format!("parameter '{n}' with a post-accumulate-grad hook")));
    mine
}

/// Compares every rank's model with rank 0's: the types of the devices its tensors are on,
/// the tensors' names, shapes and dtypes, the names that share a tensor, and the first
/// parameter that already has a hook, if any. The ranks gather the SHA-256 digests of their
/// descriptions, 32 bytes each whatever the model; where one differs from rank 0's, rank 0
/// and the first such rank send their descriptions too, which name the difference. These
/// travel over the CPU links, which every group has, whatever its devices (a CUDA rank would
/// start NCCL's initialisation at its first CUDA collective, and a CPU rank never).
pub(super) fn verify_same_model(
    pg: &ProcessGroup,
    split: &Split,
    hooked: Option<&str>,
) -> Result<(), DdpError> {
    let mine = describe_model(split, hooked).join("\n").into_bytes();
    let digests = pg.all_gather_bytes(&Sha256::digest(&mine))?;
    // The same on every rank: every rank holds the same digests.
    let Some(rank) = digests.iter().position(|d| Some(d) != digests.first()) else {
        return Ok(());
    };
    let sent: &[u8] = if pg.rank() == 0 || pg.rank() == rank {
        &mine
    } else {
        &[]
    };
    let gathered = pg.all_gather_bytes(sent)?;
    compare_model(&gathered[0], rank, &gathered[rank])
}

/// The same error on every rank, naming `rank`, whose description (from [`describe_model`])
/// differs from rank 0's: its devices before its tensors.
fn compare_model(reference: &[u8], rank: usize, theirs: &[u8]) -> Result<(), DdpError> {
    // (devices, tensors); not `lines`, which drops the empty first line of no tensors.
    let split = |b: &[u8]| -> (String, Vec<String>) {
        let text = String::from_utf8_lossy(b);
        let mut lines = text.split('\n').map(str::to_string);
        (lines.next().unwrap_or_default(), lines.collect())
    };
    let (reference_devices, reference) = split(reference);
    let (devices, tensors) = split(theirs);
    if (&devices, &tensors) == (&reference_devices, &reference) {
        return Ok(());
    }
    // A model without tensors differs in its tensors, not its device.
    let both_placed = !devices.is_empty() && !reference_devices.is_empty();
    if devices != reference_devices && (both_placed || tensors == reference) {
        return Err(DdpError::DeviceMismatch {
            rank,
            theirs: devices,
            reference: reference_devices,
        });
    }
    let detail = match reference.iter().zip(&tensors).find(|(a, b)| a != b) {
        Some((a, b)) => format!("{b} (rank 0 has {a})"),
        None if tensors.len() > reference.len() => {
            format!("{} (absent on rank 0)", tensors[reference.len()])
        }
        None => format!("{} (absent on rank {rank})", reference[tensors.len()]),
    };
    Err(DdpError::ModelMismatch { rank, detail })
}

#[cfg(test)]
mod tests {
    use super::super::tests::on_ranks;
    use super::*;
    use tch::nn::Init;

    /// A tie on one rank only (the others hold two tensors) is a difference between the
    /// models, named on every rank: not two ranks bucketing different parameters.
    #[test]
    fn a_tie_on_one_rank_only_is_a_model_difference() {
        let results = on_ranks(2, |rank, pg| {
            let vs = VarStore::new(tch::Device::Cpu);
            let w = vs.root().var("embed", &[2], Init::Const(1.0));
            let head = vs.root().sub("head");
            let _ = match rank {
                0 => head.add("weight", w.shallow_clone(), true),
                _ => head.var("weight", &[2], Init::Const(1.0)),
            };
            let split = split_named(&vs);
            verify_same_model(&pg, &split, None).map_err(|e| e.to_string())
        });
        let want = "rank 1's model differs from rank 0's at tensor parameter 'head.weight' shape \
                    [2] dtype Float (rank 0 has 'head.weight', the same tensor as 'embed')";
        assert_eq!(results, [Err(want.to_string()), Err(want.to_string())]);
    }

    /// Where ranks 0 and 1 agree and rank 2 differs, every rank names rank 2 and its tensor:
    /// rank 1 sends no description.
    #[test]
    fn the_first_rank_that_differs_is_named_on_every_rank() {
        let results = on_ranks(3, |rank, pg| {
            let vs = VarStore::new(tch::Device::Cpu);
            let _ = vs
                .root()
                .var("w", &[if rank == 2 { 3 } else { 2 }], Init::Const(1.0));
            verify_same_model(&pg, &split_named(&vs), None).map_err(|e| e.to_string())
        });
        let want = "rank 2's model differs from rank 0's at tensor parameter 'w' shape [3] \
                    dtype Float (rank 0 has parameter 'w' shape [2] dtype Float)";
        assert_eq!(results, vec![Err(want.to_string()); 3]);
    }

    /// Models whose descriptions pass the gather limit (1024 bytes here, for 2 ranks of a
    /// model of 60 tensors) are compared all the same: only their digests are gathered.
    #[test]
    fn a_description_longer_than_the_gather_limit_is_compared() {
        let results = on_ranks(2, |_, pg| {
            pg.set_max_gather_bytes(1024);
            let vs = VarStore::new(tch::Device::Cpu);
            for layer in 0..60 {
                let path = vs.root().sub(format!("layer{layer}"));
                let _ = path.var("weight", &[4], Init::Const(1.0));
            }
            let split = split_named(&vs);
            let length = describe_model(&split, None).join("\n").len();
            let verdict = verify_same_model(&pg, &split, None).map_err(|e| e.to_string());
            (length > 1024, verdict)
        });
        assert_eq!(results, [(true, Ok(())), (true, Ok(()))]);
    }

    /// A rank on CUDA and one on the CPU (`--device auto` where one host has no usable GPU)
    /// hold the same tensors; their descriptions differ in the device type alone, and the
    /// error names the rank, both devices and the setting to change: not the mismatched
    /// collectives (NCCL's initialisation against a CPU broadcast) that would follow.
    #[test]
    fn ranks_on_different_device_types_are_named_with_the_devices() {
        let vs = VarStore::new(tch::Device::Cpu);
        let _ = vs.root().var("w", &[2], Init::Const(1.0));
        let cpu = describe_model(&split_named(&vs), None);
        assert_eq!(cpu, ["cpu", "parameter 'w' shape [2] dtype Float"]);
        // A CUDA rank's description, built without a GPU: its tensors on `cuda:1`.
        let mut cuda = cpu.clone();
        cuda[0] = device_type(tch::Device::Cuda(1)).to_string();
        let bytes = |d: &[String]| d.join("\n").into_bytes();
        // As `verify_same_model` compares them: the first rank that differs from rank 0.
        let e = |d: &[&[String]]| {
            let gathered: Vec<_> = d.iter().map(|d| bytes(d)).collect();
            let mut ranks = gathered.iter().enumerate().skip(1);
            ranks
                .try_for_each(|(rank, theirs)| compare_model(&gathered[0], rank, theirs))
                .map_err(|e| e.to_string())
        };
        assert_eq!(e(&[&cpu, &cpu, &cpu]), Ok(()));
        // Another index of the same type is no difference: each rank has its own GPU.
        let mut cuda0 = cuda.clone();
        cuda0[0] = device_type(tch::Device::Cuda(0)).to_string();
        assert_eq!(e(&[&cuda0, &cuda]), Ok(()));
        let hint = "every rank must train on the same type of device; give every rank the \
                    same --device (--device cuda fails where CUDA is missing instead of \
                    training on the CPU)";
        assert_eq!(
            e(&[&cpu, &cpu, &cuda]),
            Err(format!(
                "rank 2's model is on cuda, rank 0's on cpu: {hint}"
            ))
        );
        assert_eq!(
            e(&[&cuda, &cpu]),
            Err(format!(
                "rank 1's model is on cpu, rank 0's on cuda: {hint}"
            ))
        );
        // A model without tensors differs in its tensors.
        assert_eq!(
            e(&[&cpu, &[String::new()]]),
            Err(
                "rank 1's model differs from rank 0's at tensor parameter 'w' shape [2] dtype \
                 Float (absent on rank 1)"
                    .to_string()
            )
        );
    }
}
