//! Writes a synthetic ODIR sample: `cargo run -p ddp-data --example gen_sample -- OUT [IMAGES] [SIZE] [SEED]`.

use ddp_data::synthetic::{generate, SyntheticConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = args
        .next()
        .ok_or("usage: gen_sample OUT [IMAGES] [SIZE] [SEED]")?;
    let defaults = SyntheticConfig::default();
    let config = SyntheticConfig {
        images: args
            .next()
            .map(|a| a.parse())
            .transpose()?
            .unwrap_or(defaults.images),
        size: args
            .next()
            .map(|a| a.parse())
            .transpose()?
            .unwrap_or(defaults.size),
        seed: args
            .next()
            .map(|a| a.parse())
            .transpose()?
            .unwrap_or(defaults.seed),
        ..defaults
    };
    let start = std::time::Instant::now();
    let summary = generate(out.as_ref(), &config)?;
    println!(
        "wrote {} images of {} patients to {} in {:.2}s; label counts N..O: {:?}",
        summary.images,
        summary.patients,
        summary.root.display(),
        start.elapsed().as_secs_f64(),
        summary.label_counts
    );
    Ok(())
}
