//! The ODIR challenge's metrics equal scikit-learn's (the organisers' evaluation script) on
//! the same predictions, within 1e-9, on random and on tied probabilities, when every rank
//! holds only its shard and the scores are gathered across 1, 2 and 3 real rank processes
//! (this test binary re-invoked as ranks); and every world size gives the same numbers, bit
//! for bit.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use ddp_comm::ProcessGroup;
use ddp_data::odir::Sample;
use ddp_sampler::{DistributedSampler, Partition};
use ddp_train::odir::{EyeCombine, OdirStats, Patients};
use ddp_train::{gather_rows, Rows, Stats};
use serde_json::{json, Value};

const OUT_ENV: &str = "DDP_TEST_OUT";
const CASE_ENV: &str = "DDP_TEST_CASE";
const PATIENTS: u64 = 41;

/// A small deterministic generator (the test needs no random crate).
struct Lcg(u64);

impl Lcg {
    fn unit(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The case's images (patient and labels) and each image's probabilities: `random`, or `tied`
/// (every probability one of 0.1, 0.3, 0.5, 0.7, 0.9, so ties within and across classes, and
/// 0.5 itself, which is not above the threshold). Every fifth patient has one eye only;
/// patient IDs are not in image order.
fn case(name: &str) -> (Vec<Sample>, Vec<[f64; 8]>) {
    let mut rng = Lcg(if name == "tied" { 7 } else { 3 });
    let (mut samples, mut probs) = (Vec::new(), Vec::new());
    for p in 0..PATIENTS {
        let id = (p * 17) % PATIENTS + 100;
        let mut truth = [0f32; 8];
        for t in truth.iter_mut() {
            *t = f32::from(u8::from(rng.unit() < 0.3));
        }
        let eyes = if p % 5 == 0 { 1 } else { 2 };
        for eye in 0..eyes {
            samples.push(Sample {
                path: PathBuf::from(format!("{id}_{eye}.jpg")),
                patient_id: id,
                labels: truth,
                patient_labels: Some(truth),
            });
            let mut row = [0.0; 8];
            for (k, v) in row.iter_mut().enumerate() {
                // Probabilities lean towards the truth, so the scores are far from trivial.
                let lean = if truth[k] > 0.5 { 0.25 } else { 0.0 };
                *v = if name == "tied" {
                    [0.1, 0.3, 0.5, 0.7, 0.9][((rng.unit() + lean) * 4.0).min(4.0) as usize]
                } else {
                    (rng.unit() * 0.75 + lean).min(1.0)
                };
            }
            probs.push(row);
        }
    }
    (samples, probs)
}

fn combine_of(name: &str) -> EyeCombine {
    if name == "tied" {
        EyeCombine::Mean
    } else {
        EyeCombine::Max
    }
}

/// One rank: the rows of its exact shard only, gathered, then scored.
#[test]
#[ignore = "a rank of the challenge-metric test; run by it"]
fn worker_challenge_metrics() {
    let out = PathBuf::from(std::env::var(OUT_ENV).unwrap());
    let name = std::env::var(CASE_ENV).unwrap();
    let (samples, probs) = case(&name);
    let pg = ProcessGroup::from_env().unwrap();
    let shard = DistributedSampler::builder(samples.len(), pg.world_size(), pg.rank())
        .shuffle(false)
        .partition(Partition::Exact)
        .build()
        .unwrap();
    let mut rows = Rows::new(8);
    // Each rank's rows in reverse, to show the order comes from the keys.
    let mine: Vec<usize> = shard.iter().collect();
    for &i in mine.iter().rev() {
        rows.push(i as u64, &probs[i]);
    }
    let all = gather_rows(&pg, &rows).unwrap();
    assert_eq!(all.len(), samples.len());
    let mut stats = OdirStats::new(
        std::sync::Arc::new(Patients::new(&samples)),
        combine_of(&name),
        false,
    );
    stats.set_rows(all);
    let report = Value::Object(stats.report().into_map());
    std::fs::write(
        out.join(format!("{name}-{}-rank{}.json", pg.world_size(), pg.rank())),
        report.to_string(),
    )
    .unwrap();
}

/// sklearn's numbers for the case, from the setup's Python.
fn sklearn(name: &str, dir: &Path) -> Value {
    let (samples, probs) = case(name);
    let input = json!({
        "combine": combine_of(name).as_str(),
        "images": samples.iter().zip(&probs).map(|(s, p)| json!([s.patient_id, p])).collect::<Vec<_>>(),
        "truth": samples.iter().map(|s| json!([s.patient_id, s.patient_labels])).collect::<Vec<_>>(),
    });
    let file = dir.join(format!("{name}-input.json"));
    std::fs::write(&file, input.to_string()).unwrap();
    let script = r#"
import json, sys, warnings
import numpy as np
from sklearn.metrics import cohen_kappa_score, f1_score, roc_auc_score
d = json.load(open(sys.argv[1]))
by = {}
for pid, p in d["images"]:
    by.setdefault(pid, []).append(p)
truth = {pid: t for pid, t in d["truth"]}
ids = sorted(by)
def combine(eyes):
    if d["combine"] == "mean":
        return eyes.mean(axis=0)
    # Each disease's larger probability; N's smaller (normal only when both eyes are).
    return np.concatenate([eyes[:, :1].min(axis=0), eyes[:, 1:].max(axis=0)])
pr = np.array([combine(np.array(by[i])) for i in ids])
gt = np.array([truth[i] for i in ids], dtype=int)
g, p = gt.flatten(), pr.flatten()
kappa = cohen_kappa_score(g, p > 0.5)
f1 = f1_score(g, p > 0.5, average="micro")
auc = roc_auc_score(g, p)
per = [roc_auc_score(gt[:, k], pr[:, k]) if 0 < gt[:, k].sum() < len(gt) else None for k in range(8)]
print(json.dumps({"odir_kappa": kappa, "odir_f1": f1, "odir_auc": auc,
                  "odir_score": (kappa + f1 + auc) / 3, "odir_auc_per_class": per,
                  "patients": len(ids), "ties": int(len(p) - len(np.unique(p)))}))
"#;
    let out = ddp_testkit::setup_python()
        .args(["-c", script])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn close(ours: &Value, theirs: &Value, what: &str) {
    match (ours.as_f64(), theirs.as_f64()) {
        (Some(a), Some(b)) => assert!((a - b).abs() < 1e-9, "{what}: ours {a}, sklearn {b}"),
        // An undefined per-class AUC: NaN, written as null, on both sides.
        _ => assert!(
            ours.is_null() && theirs.is_null(),
            "{what}: {ours} vs {theirs}"
        ),
    }
}

#[test]
fn challenge_metrics_equal_sklearn_on_1_2_and_3_ranks() {
    let tmp = common::temp_dir("ddp-train-challenge");
    let dir = tmp.path();
    for name in ["random", "tied"] {
        let reference = sklearn(name, dir);
        assert_eq!(reference["patients"], PATIENTS);
        if name == "tied" {
            assert!(reference["ties"].as_u64().unwrap() > 300, "{reference}");
        }
        let mut first: Option<Value> = None;
        for world in [1, 2, 3] {
            let children =
                common::spawn_worker_ranks("worker_challenge_metrics", world, |_, cmd| {
                    cmd.env(OUT_ENV, dir)
                        .env(CASE_ENV, name)
                        .stdout(Stdio::null())
                        .stderr(Stdio::piped());
                });
            for (r, o) in common::wait_all(children, Duration::from_secs(120))
                .iter()
                .enumerate()
            {
                assert!(
                    o.status.success(),
                    "rank {r} of {world}: {}",
                    common::text(o)
                );
            }
            for rank in 0..world {
                let text =
                    std::fs::read_to_string(dir.join(format!("{name}-{world}-rank{rank}.json")))
                        .unwrap();
                let ours: Value = serde_json::from_str(&text).unwrap();
                for key in ["odir_kappa", "odir_f1", "odir_auc", "odir_score"] {
                    close(
                        &ours[key],
                        &reference[key],
                        &format!("{name} {key} on {world} ranks"),
                    );
                }
                for k in 0..8 {
                    close(
                        &ours["odir_auc_per_class"][k],
                        &reference["odir_auc_per_class"][k],
                        &format!("{name} AUC of class {k} on {world} ranks"),
                    );
                }
                // Every rank and every world size: the same numbers, bit for bit.
                match &first {
                    None => first = Some(ours),
                    Some(f) => assert_eq!(f, &ours, "{name}: {world} ranks, rank {rank}"),
                }
            }
        }
    }
}
