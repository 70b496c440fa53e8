//! Readers of what the benches and the Python references print: `key=value` words, the
//! `RESULT <tag> key=value ...` lines most benches print (one reader for all of them), the
//! collectives' `RESULT <label>|<seconds>|<value>` lines, the pipeline reference's
//! `<mode> <width> <img/s>` lines, and criterion's `estimates.json`.

/// The value of `key=value` in a whitespace-separated line.
pub(super) fn kv<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// [`kv`] as a number.
pub(super) fn kv_f64(line: &str, key: &str) -> Option<f64> {
    kv(line, key)?.parse().ok()
}

/// The lines of `text` that start `RESULT <tag> `.
pub(super) fn tagged<'a>(text: &'a str, tag: &str) -> impl Iterator<Item = &'a str> {
    let prefix = format!("RESULT {tag} ");
    text.lines().filter(move |l| l.starts_with(&prefix))
}

/// `key` of the first of `lines` whose words hold every `key=value` of `selectors`; `None`
/// when no line matches or that line lacks `key`.
pub(super) fn value_where<'a>(
    lines: impl IntoIterator<Item = &'a str>,
    selectors: &[(&str, &str)],
    key: &str,
) -> Option<f64> {
    lines
        .into_iter()
        .find(|l| selectors.iter().all(|(k, v)| kv(l, k) == Some(*v)))
        .and_then(|l| kv_f64(l, key))
}

/// `key` of rank 0's `RESULT <tag> config=<config> ...` line.
pub(super) fn overlap_value(text: &str, tag: &str, config: &str, key: &str) -> Option<f64> {
    value_where(tagged(text, tag), &[("config", config), ("rank", "0")], key)
}

/// One world size's result of `ddp_steps` or `reference_ddp.py`: the `RESULT` lines of all
/// its ranks.
#[derive(Debug)]
pub(super) struct Run {
    lines: Vec<String>,
}

impl Run {
    /// `key` of rank 0's line.
    pub(super) fn rank0(&self, key: &str) -> Option<f64> {
        value_where(self.lines.iter().map(String::as_str), &[("rank", "0")], key)
    }

    /// Medians of (buffer broadcast + gradient sync, broadcast, sync) per step, each step's
    /// time taken on the rank that reached the collective last: it waited least, so its
    /// time is the cost rather than the wait for a slower peer (the bench computes this).
    pub(super) fn ddp_overhead(&self) -> Option<(f64, f64, f64)> {
        Some((
            self.rank0("ddp_overhead_median_s")?,
            self.rank0("bcast_cost_median_s")?,
            self.rank0("sync_cost_median_s")?,
        ))
    }
}

/// `RESULT <tag> ...` lines grouped by world size.
pub(super) fn runs_by_world(text: &str, tag: &str) -> Vec<(usize, Run)> {
    let mut runs: Vec<(usize, Run)> = Vec::new();
    for line in tagged(text, tag) {
        let Some(world) = kv(line, "world").and_then(|w| w.parse().ok()) else {
            continue;
        };
        match runs.iter_mut().find(|(w, _)| *w == world) {
            Some((_, run)) => run.lines.push(line.to_string()),
            None => runs.push((
                world,
                Run {
                    lines: vec![line.to_string()],
                },
            )),
        }
    }
    runs
}

/// The run of `world` ranks in `runs`.
pub(super) fn run_of(runs: &[(usize, Run)], world: usize) -> Option<&Run> {
    runs.iter().find(|(w, _)| *w == world).map(|(_, r)| r)
}

/// `RESULT <label>|<seconds>|<value>` lines (the collectives bench's and Gloo's format).
pub(super) fn result_lines(text: &str) -> Vec<(String, f64, f64)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("RESULT "))
        .filter_map(|l| {
            let mut parts = l.split('|');
            Some((
                parts.next()?.to_string(),
                parts.next()?.trim().parse().ok()?,
                parts.next()?.trim().parse().ok()?,
            ))
        })
        .collect()
}

/// Images/s of `reference_pipeline.py`'s `<mode> <width> <img_per_s>` line for `mode` and
/// `size`.
pub(super) fn pipeline_rate(text: &str, mode: &str, size: u32) -> Option<f64> {
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() == 3 && f[0] == mode && f[1] == size.to_string())
            .then(|| f[2].parse().ok())
            .flatten()
    })
}

/// Our images per CPU-second of the working thread, as the pipeline bench prints them
/// (`RESULT pipeline size=<size> decode=full|reduced img_per_cpu_s=<rate>`).
pub(super) fn pipeline_ours(text: &str, decode: &str, size: u32) -> Option<f64> {
    let size = size.to_string();
    value_where(
        tagged(text, "pipeline"),
        &[("size", &size), ("decode", decode)],
        "img_per_cpu_s",
    )
}

/// The median's point estimate in criterion's `estimates.json` (nanoseconds).
pub(super) fn median_point_estimate(estimates: &str) -> Option<f64> {
    let v: serde_json::Value = serde_json::from_str(estimates).ok()?;
    v["median"]["point_estimate"].as_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_key_values_and_json_numbers() {
        let line = "RESULT ddp_steps world=2 rank=1 images_per_sec=17.25 loss=0.5";
        assert_eq!(kv(line, "rank"), Some("1"));
        assert_eq!(kv_f64(line, "images_per_sec"), Some(17.25));
        assert_eq!(kv(line, "images"), None);
    }

    #[test]
    fn finds_the_first_matching_line_of_a_tag() {
        // As the loader bench and the sampler reference print them.
        let text = "loader bench: 64 JPEGs of 512x512 in /t, batch 64, crops 224, 16 batches\n\
            RESULT loader metric=handoff_f32_s value=0.000112000 unit=s\n\
            RESULT loaders metric=handoff_f32_s value=9 unit=s\n\
            RESULT loader metric=throughput_f32_1_threads value=405.500000000 unit=img/s\n\
            RESULT loader metric=throughput_f32_1_threads value=1.000000000 unit=img/s\n\
            reference_sampler n=1000000 replicas=8 runs=7 median_s=0.093200 min_s=0.091000 \
            torch=2.13.0\n";
        let metric = |m| value_where(tagged(text, "loader"), &[("metric", m)], "value");
        assert_eq!(metric("handoff_f32_s"), Some(0.000112));
        assert_eq!(metric("throughput_f32_1_threads"), Some(405.5));
        assert_eq!(metric("throughput_u8_1_threads"), None);
        assert_eq!(
            value_where(
                tagged(text, "loaders"),
                &[("metric", "handoff_f32_s")],
                "value"
            ),
            Some(9.0)
        );
        // The sampler reference's lines carry no RESULT tag.
        assert_eq!(
            value_where(text.lines(), &[("n", "1000000")], "median_s"),
            Some(0.0932)
        );
        // The first matching line decides, even when it lacks the key.
        assert_eq!(
            value_where(text.lines(), &[("metric", "handoff_f32_s")], "median_s"),
            None
        );
    }

    #[test]
    fn reads_the_median_of_criterions_estimates() {
        // A real target/criterion/<id>/new/estimates.json (ddp-data's pipeline bench).
        let est = r#"{"mean":{"confidence_interval":{"confidence_level":0.95,"lower_bound":2088834.874524359,"upper_bound":2288911.6957277},"point_estimate":2193771.5949371606,"standard_error":51360.55027308042},"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":2121140.476388889,"upper_bound":2363594.354166667},"point_estimate":2311712.284722222,"standard_error":79535.25508928086},"median_abs_dev":{"confidence_interval":{"confidence_level":0.95,"lower_bound":42280.83752853179,"upper_bound":353724.12491487834},"point_estimate":160025.01221353372,"standard_error":88667.10887949423},"slope":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1956673.8867580288,"upper_bound":2226308.3223324213},"point_estimate":2094645.6584785134,"standard_error":69091.05081165876},"std_dev":{"confidence_interval":{"confidence_level":0.95,"lower_bound":148913.72526702748,"upper_bound":286715.9272199052},"point_estimate":235334.55434624478,"standard_error":35137.58363691713}}"#;
        assert_eq!(median_point_estimate(est), Some(2311712.284722222));
        // Whitespace and key order do not matter; an integer is a number too.
        assert_eq!(
            median_point_estimate("{ \"median\" : { \"point_estimate\" : 12 },\n \"mean\": {} }"),
            Some(12.0)
        );
        assert_eq!(
            median_point_estimate(r#"{"mean":{"point_estimate":2.0}}"#),
            None
        );
        assert_eq!(median_point_estimate("not json"), None);
    }

    #[test]
    fn groups_results_by_world_and_finds_the_ddp_cost() {
        let text = "noise\n\
            RESULT ddp_steps world=1 rank=0 images_per_sec=9.0\n\
            RESULT ddp_steps world=2 rank=0 images_per_sec=17.0 ddp_overhead_median_s=0.006 \
            bcast_cost_median_s=0.004 sync_cost_median_s=0.002\n\
            RESULT ddp_steps world=2 rank=1 images_per_sec=17.1\n";
        let runs = runs_by_world(text, "ddp_steps");
        assert_eq!(runs.len(), 2);
        let two = run_of(&runs, 2).unwrap();
        assert_eq!(two.rank0("images_per_sec"), Some(17.0));
        let (total, bcast, sync) = two.ddp_overhead().unwrap();
        assert!((total - 0.006).abs() < 1e-12 && bcast == 0.004 && sync == 0.002);
        assert!(run_of(&runs, 4).is_none());
    }

    #[test]
    fn reads_result_lines_with_bars() {
        // As the collectives bench and reference_gloo.py print them.
        let text = "warming up\nRESULT all_reduce 4 KiB|0.0000087|0\n\
            RESULT broadcast flat|0.0004|1560000\nRESULT torn|1\n";
        assert_eq!(
            result_lines(text),
            [
                ("all_reduce 4 KiB".to_string(), 0.0000087, 0.0),
                ("broadcast flat".to_string(), 0.0004, 1560000.0)
            ]
        );
    }

    #[test]
    fn reads_the_pipeline_references_rates() {
        let text = "default 512 247.5\ndraft 512 304.0\ndefault 2048 32.1\n";
        assert_eq!(pipeline_rate(text, "default", 512), Some(247.5));
        assert_eq!(pipeline_rate(text, "draft", 512), Some(304.0));
        assert_eq!(pipeline_rate(text, "draft", 2048), None);
    }

    #[test]
    fn reads_our_pipeline_rates_per_cpu_second() {
        // As the pipeline bench prints them after criterion's report.
        let text = "decode_crop_resize_to_tensor/512x512 time: [2.1 ms 2.2 ms 2.3 ms]\n\
            RESULT pipeline size=512 decode=full img_per_cpu_s=812.50\n\
            RESULT pipeline size=512 decode=reduced img_per_cpu_s=1130.00\n\
            RESULT pipeline size=2048 decode=full img_per_cpu_s=61.25\n";
        assert_eq!(pipeline_ours(text, "full", 512), Some(812.5));
        assert_eq!(pipeline_ours(text, "reduced", 512), Some(1130.0));
        assert_eq!(pipeline_ours(text, "full", 2048), Some(61.25));
        assert_eq!(pipeline_ours(text, "reduced", 2048), None);
    }
}
