//! Running test jobs on a fixed number of slots: at most one job of the ranks group at a
//! time (its tests start several processes of their own that compute), at most one of the
//! waits group (several processes that mostly wait), the other slots for the rest; the
//! longest startable job first, ranks jobs before others since they form the longest chain.

use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc;

/// Which jobs may run beside each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// Tests that start several ranks that compute (trainings, collectives): one such job at
    /// a time, so that two never compete for the cores.
    Ranks,
    /// Tests that start several processes that mostly wait (for timeouts, signals, a peer
    /// that never comes): one such job at a time, beside a ranks job or others. Their
    /// processes use a fraction of a core, less than the single-process jobs that run
    /// beside a ranks job anyway.
    Waits,
    /// Everything else.
    Free,
}

/// Some tests of one binary, run by one process.
#[derive(Debug, Clone)]
pub struct Job {
    /// Index of the binary in the caller's list.
    pub binary: usize,
    pub label: String,
    pub group: Group,
    /// Expected seconds (the previous run's, or a guess).
    pub estimate: f64,
    pub tests: Vec<String>,
}

/// Runs every job through `work` on `slots` threads and returns each job with its result,
/// in the order they finished.
pub fn run<T: Send>(
    jobs: Vec<Job>,
    slots: usize,
    work: impl Fn(&Job) -> T + Sync,
) -> Vec<(Job, T)> {
    let mut waiting = jobs;
    let mut done = Vec::new();
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|scope| {
        // Running jobs: how many in all, and of the groups that run one at a time.
        let (mut running, mut alone) = (0usize, Vec::<Group>::new());
        loop {
            while running < slots.max(1) {
                let Some(i) = next(&waiting, &alone) else {
                    break;
                };
                let job = waiting.remove(i);
                if job.group != Group::Free {
                    alone.push(job.group);
                }
                running += 1;
                let (tx, work) = (tx.clone(), &work);
                scope.spawn(move || {
                    // A panic is carried to the caller's thread, which waits for every job.
                    let result = panic::catch_unwind(AssertUnwindSafe(|| work(&job)));
                    let _ = tx.send((job, result));
                });
            }
            if running == 0 {
                break;
            }
            let (job, result) = rx.recv().expect("every job thread reports");
            let result = result.unwrap_or_else(|p| panic::resume_unwind(p));
            running -= 1;
            alone.retain(|&g| g != job.group);
            done.push((job, result));
        }
    });
    done
}

/// The job to start next: the longest ranks job when none runs, else the longest other one
/// whose group does not run already (`alone` holds the one-at-a-time groups running).
fn next(waiting: &[Job], alone: &[Group]) -> Option<usize> {
    let startable = |group: Group| group == Group::Free || !alone.contains(&group);
    let longest = |ranks: bool| {
        waiting
            .iter()
            .enumerate()
            .filter(|(_, j)| (j.group == Group::Ranks) == ranks && startable(j.group))
            .max_by(|a, b| a.1.estimate.total_cmp(&b.1.estimate))
            .map(|(i, _)| i)
    };
    longest(true).or_else(|| longest(false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Duration;

    fn job(label: &str, group: Group, estimate: f64) -> Job {
        Job {
            binary: 0,
            label: label.into(),
            group,
            estimate,
            tests: vec![],
        }
    }

    #[test]
    fn ranks_jobs_never_overlap_and_the_longest_start_first() {
        let jobs = vec![
            job("free-short", Group::Free, 1.0),
            job("ranks-short", Group::Ranks, 2.0),
            job("free-long", Group::Free, 9.0),
            job("ranks-long", Group::Ranks, 5.0),
            job("ranks-mid", Group::Ranks, 3.0),
            job("waits-short", Group::Waits, 1.5),
            job("waits-long", Group::Waits, 4.0),
        ];
        let active = Mutex::new(Vec::<String>::new());
        let started = Mutex::new(Vec::<String>::new());
        let done = run(jobs, 2, |j| {
            {
                let mut a = active.lock().unwrap();
                for group in ["ranks", "waits"] {
                    assert!(
                        !(j.label.starts_with(group) && a.iter().any(|l| l.starts_with(group))),
                        "{} started beside {a:?}",
                        j.label
                    );
                }
                assert!(a.len() < 2, "{} started beside {a:?}", j.label);
                a.push(j.label.clone());
                started.lock().unwrap().push(j.label.clone());
            }
            std::thread::sleep(Duration::from_millis(20));
            active.lock().unwrap().retain(|l| l != &j.label);
            j.label.len()
        });
        assert_eq!(done.len(), 7);
        assert!(done.iter().all(|(j, n)| j.label.len() == *n));
        let started = started.into_inner().unwrap();
        // The first two: the longest ranks job and the longest other job.
        let mut first: Vec<_> = started[..2].to_vec();
        first.sort();
        assert_eq!(first, ["free-long", "ranks-long"]);
        let ranks: Vec<_> = started.iter().filter(|l| l.starts_with("ranks")).collect();
        assert_eq!(ranks, ["ranks-long", "ranks-mid", "ranks-short"]);
    }

    #[test]
    fn a_waits_job_runs_beside_a_ranks_job_but_not_beside_another_waits_job() {
        let jobs = [
            job("ranks", Group::Ranks, 5.0),
            job("waits-long", Group::Waits, 4.0),
            job("waits-short", Group::Waits, 3.0),
            job("free", Group::Free, 1.0),
        ];
        let label = |i: Option<usize>| i.map(|i| jobs[i].label.as_str());
        assert_eq!(label(next(&jobs, &[])), Some("ranks"));
        assert_eq!(label(next(&jobs, &[Group::Ranks])), Some("waits-long"));
        assert_eq!(label(next(&jobs, &[Group::Waits])), Some("ranks"));
        let both = [Group::Ranks, Group::Waits];
        assert_eq!(label(next(&jobs, &both)), Some("free"));
        assert_eq!(next(&jobs[..3], &both), None);
    }
}
