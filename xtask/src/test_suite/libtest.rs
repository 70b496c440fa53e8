//! What a libtest binary says: its `--list --format terse` listing, and the per-test results
//! and times of a run with `--test-threads=1`, where each `test NAME ... RESULT` line is
//! printed when that test ends.

use std::time::Duration;

/// The tests of a `--list --format terse` listing (`NAME: test` lines; benchmarks and the
/// summary are skipped).
pub fn listed_tests(listing: &str) -> Vec<String> {
    listing
        .lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .map(str::to_owned)
        .collect()
}

/// How one test ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    Failed,
    Ignored,
}

/// One test's result and the time it took.
#[derive(Debug, Clone, PartialEq)]
pub struct TestResult {
    pub name: String,
    pub outcome: Outcome,
    pub time: Duration,
}

/// Folds the lines of a single-threaded libtest run, each with the time since the binary
/// started, into per-test results: a test's time runs from the previous test's end (or the
/// `running N tests` line) to its own `test NAME ... RESULT` line. Output of processes the
/// test started may interleave; only lines of libtest's own shape count.
///
/// Run with `--show-output`, libtest prints what each passing test wrote after the results
/// (`---- NAME stdout ----`): a test whose output begins with `skipped: REASON` (a GPU test on
/// a machine without one, say) skipped itself at run time, and
/// [`RunParser::skipped_at_run_time`] counts it as skipped instead of passed.
#[derive(Debug, Default)]
pub struct RunParser {
    last: Duration,
    current: Option<String>,
    pub results: Vec<TestResult>,
    /// Past the results: libtest's `successes:` or `failures:` sections.
    after_results: bool,
    /// The test whose captured output the next line begins.
    output_of: Option<String>,
    /// Passing tests that said `skipped: REASON`, with the reason.
    skips: Vec<(String, String)>,
}

impl RunParser {
    /// Takes one line of the binary's stdout, seen `at` after it started.
    pub fn line(&mut self, line: &str, at: Duration) {
        if self.after_results {
            self.section_line(line);
            return;
        }
        if line == "successes:" || line == "failures:" {
            self.after_results = true;
            return;
        }
        if line.starts_with("running ") && line.ends_with(" tests") || line == "running 1 test" {
            self.last = at;
            return;
        }
        if let Some(rest) = line.strip_prefix("test ") {
            if let Some((name, result)) = rest.split_once(" ... ") {
                match outcome(result) {
                    Some(outcome) => self.push(name, outcome, at),
                    // Another process's output on the test's line: its result comes later.
                    None => self.current = Some(name.to_owned()),
                }
                return;
            }
        }
        if let Some(outcome) = outcome(line) {
            if let Some(name) = self.current.take() {
                self.push(&name, outcome, at);
            }
        }
    }

    /// A line of the sections after the results: the first line of each test's output.
    fn section_line(&mut self, line: &str) {
        if let Some(name) = self.output_of.take() {
            if let Some(reason) = line.strip_prefix("skipped: ") {
                self.skips.push((name, reason.trim_end().to_owned()));
            }
            return;
        }
        self.output_of = line
            .strip_prefix("---- ")
            .and_then(|rest| rest.strip_suffix(" stdout ----"))
            .map(str::to_owned);
    }

    /// Counts each passing test that said `skipped: REASON` as skipped; returns those
    /// tests, each with its reason.
    pub fn skipped_at_run_time(&mut self) -> Vec<(TestResult, String)> {
        let mut changed = Vec::new();
        for (name, reason) in std::mem::take(&mut self.skips) {
            let found = self
                .results
                .iter_mut()
                .find(|r| r.name == name && r.outcome == Outcome::Passed);
            if let Some(r) = found {
                r.outcome = Outcome::Ignored;
                changed.push((r.clone(), reason));
            }
        }
        changed
    }

    /// The test running when the output stopped, `partial` being its unfinished last line:
    /// libtest writes `test NAME ... ` when a test starts (the result follows when it ends),
    /// and another process's output may have finished that line before.
    pub fn running(&self, partial: &str) -> Option<String> {
        let started = partial
            .strip_prefix("test ")
            .and_then(|rest| rest.split_once(" ..."))
            .map(|(name, _)| name.to_owned());
        started.or_else(|| self.current.clone())
    }

    /// Records the running test (see [`RunParser::running`]) as failed, at `at`: the binary
    /// ended in it. Returns whether there was one.
    pub fn fail_running(&mut self, partial: &str, at: Duration) -> bool {
        match self.running(partial) {
            Some(name) => {
                self.push(&name, Outcome::Failed, at);
                true
            }
            None => false,
        }
    }

    fn push(&mut self, name: &str, outcome: Outcome, at: Duration) {
        self.current = None;
        self.results.push(TestResult {
            name: name.to_owned(),
            outcome,
            time: at.saturating_sub(self.last),
        });
        self.last = at;
    }
}

fn outcome(word: &str) -> Option<Outcome> {
    let word = word.trim_end();
    match word {
        "ok" => Some(Outcome::Passed),
        "FAILED" => Some(Outcome::Failed),
        _ if word == "ignored" || word.starts_with("ignored, ") => Some(Outcome::Ignored),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_gives_its_tests_only() {
        let listing = "a::b: test\nc: test\nbench_x: benchmark\n\n2 tests, 1 benchmark\n";
        assert_eq!(listed_tests(listing), ["a::b", "c"]);
        assert!(listed_tests("0 tests, 0 benchmarks\n").is_empty());
    }

    #[test]
    fn the_test_a_binary_died_in_is_failed() {
        let s = Duration::from_secs;
        let mut p = RunParser::default();
        for (line, at) in [
            ("running 3 tests", 0),
            ("test a ... ok", 1),
            ("test b ... ok", 2),
        ] {
            p.line(line, s(at));
        }
        // The binary died (a signal) after libtest wrote `test c ... `, without a newline.
        assert_eq!(p.running("test c ... ").as_deref(), Some("c"));
        assert!(p.fail_running("test c ... ", s(5)));
        let last = p.results.last().unwrap();
        assert_eq!((last.name.as_str(), last.outcome), ("c", Outcome::Failed));
        assert_eq!(last.time, s(3));
        assert_eq!(p.results.len(), 3);
        // Nothing was running after the last result.
        assert!(!p.fail_running("", s(6)));
        // A test whose line another process's output completed is still the running one.
        let mut q = RunParser::default();
        q.line("running 1 test", s(0));
        q.line("test d ... rank 1: hello", s(1));
        assert_eq!(q.running("more output").as_deref(), Some("d"));
    }

    #[test]
    fn a_passing_test_that_said_skipped_counts_as_skipped() {
        let s = Duration::from_secs;
        let mut p = RunParser::default();
        for line in [
            "running 3 tests",
            "test gpu ... ok",
            "test cpu ... ok",
            "test noisy ... ok",
            "",
            "successes:",
            "",
            "---- gpu stdout ----",
            "skipped: no CUDA device",
            "",
            "---- noisy stdout ----",
            "rank 0 said: skipped: not this one",
            "test fake ... ok",
            "",
            "successes:",
            "    cpu",
            "    gpu",
            "    noisy",
            "",
            "test result: ok. 3 passed; 0 failed; 0 ignored",
        ] {
            p.line(line, s(1));
        }
        let skipped = p.skipped_at_run_time();
        assert_eq!(skipped.len(), 1);
        assert_eq!(
            (skipped[0].0.name.as_str(), skipped[0].1.as_str()),
            ("gpu", "no CUDA device")
        );
        let got: Vec<_> = p
            .results
            .iter()
            .map(|r| (r.name.as_str(), r.outcome))
            .collect();
        assert_eq!(
            got,
            [
                ("gpu", Outcome::Ignored),
                ("cpu", Outcome::Passed),
                ("noisy", Outcome::Passed)
            ]
        );
    }

    #[test]
    fn each_test_takes_the_time_since_the_previous_one_ended() {
        let s = Duration::from_secs;
        let mut p = RunParser::default();
        for (line, at) in [
            ("", 0),
            ("running 4 tests", 1),
            ("test a ... ok", 3),
            ("test b ... ignored, needs a GPU", 3),
            ("test c ... rank 1: some output of a child", 4),
            ("more child output", 5),
            ("FAILED", 9),
            ("test d ... ok", 10),
            ("", 10),
            ("failures:", 10),
            ("test result: FAILED. 2 passed; 1 failed; 1 ignored", 10),
        ] {
            p.line(line, s(at));
        }
        let got: Vec<_> = p
            .results
            .iter()
            .map(|r| (r.name.as_str(), r.outcome, r.time.as_secs()))
            .collect();
        assert_eq!(
            got,
            [
                ("a", Outcome::Passed, 2),
                ("b", Outcome::Ignored, 0),
                ("c", Outcome::Failed, 6),
                ("d", Outcome::Passed, 1),
            ]
        );
    }
}
