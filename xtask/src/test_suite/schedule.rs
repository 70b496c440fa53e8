//! Running test jobs on a fixed number of slots: at most one job of the ranks group at a
//! time (its tests start several processes of their own), the other slots for the rest;
//! the longest startable job first, ranks jobs before others since they form the longest
//! chain.

use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc;

/// Which jobs may run beside each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// Tests that start several ranks: one such job at a time.
    Ranks,
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
        let (mut running, mut ranks_running) = (0usize, false);
        loop {
            while running < slots.max(1) {
                let Some(i) = next(&waiting, ranks_running) else {
                    break;
                };
                let job = waiting.remove(i);
                ranks_running |= job.group == Group::Ranks;
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
            if job.group == Group::Ranks {
                ranks_running = false;
            }
            done.push((job, result));
        }
    });
    done
}

/// The job to start next: the longest ranks job when none runs, else the longest other one.
fn next(waiting: &[Job], ranks_running: bool) -> Option<usize> {
    let longest = |group| {
        waiting
            .iter()
            .enumerate()
            .filter(|(_, j)| j.group == group)
            .max_by(|a, b| a.1.estimate.total_cmp(&b.1.estimate))
            .map(|(i, _)| i)
    };
    (!ranks_running)
        .then(|| longest(Group::Ranks))
        .flatten()
        .or_else(|| longest(Group::Free))
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
        ];
        let active = Mutex::new(Vec::<String>::new());
        let started = Mutex::new(Vec::<String>::new());
        let done = run(jobs, 2, |j| {
            {
                let mut a = active.lock().unwrap();
                let ranks = a.iter().filter(|l| l.starts_with("ranks")).count();
                assert!(
                    !(j.group == Group::Ranks && ranks > 0),
                    "{} started beside {a:?}",
                    j.label
                );
                assert!(a.len() < 2, "{} started beside {a:?}", j.label);
                a.push(j.label.clone());
                started.lock().unwrap().push(j.label.clone());
            }
            std::thread::sleep(Duration::from_millis(20));
            active.lock().unwrap().retain(|l| l != &j.label);
            j.label.len()
        });
        assert_eq!(done.len(), 5);
        assert!(done.iter().all(|(j, n)| j.label.len() == *n));
        let started = started.into_inner().unwrap();
        // The first two: the longest ranks job and the longest other job.
        let mut first: Vec<_> = started[..2].to_vec();
        first.sort();
        assert_eq!(first, ["free-long", "ranks-long"]);
        let ranks: Vec<_> = started.iter().filter(|l| l.starts_with("ranks")).collect();
        assert_eq!(ranks, ["ranks-long", "ranks-mid", "ranks-short"]);
    }
}
