//! `curves.png`: training and validation loss, and the monitored metrics, per epoch.

use std::path::Path;
use std::sync::OnceLock;

use image::ImageEncoder;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::error::TrainError;
use crate::report::EpochReport;

/// Font files tried for the labels, in order (plotters draws text only with a registered
/// font; these ship with common Linux distributions).
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

/// Registers the first font found as "sans-serif"; false if none exists (then the plot is
/// drawn without text).
fn font_available() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        for path in FONT_CANDIDATES {
            if let Ok(bytes) = std::fs::read(path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

/// Width and height of `curves.png`.
const SIZE: (u32, u32) = (1000, 420);

/// Draws the curves of `reports` into `path` (PNG, 1000x420): losses on the left, the
/// `metrics` named (each a number in the reports) on the right. Drawn in memory and written
/// with [`ddp_model::checkpoint::write_atomic`], so readers never see half a picture.
pub fn draw_curves(
    reports: &[EpochReport],
    metrics: &[String],
    path: &Path,
) -> Result<(), TrainError> {
    let cannot_draw =
        |e: String| TrainError::Invalid(format!("cannot draw {}: {e}", path.display()));
    let mut rgb = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
    draw(reports, metrics, &mut rgb).map_err(|e| cannot_draw(e.to_string()))?;
    let mut png = Vec::new();
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(&rgb, SIZE.0, SIZE.1, image::ExtendedColorType::Rgb8)
        .map_err(|e| cannot_draw(e.to_string()))?;
    ddp_model::checkpoint::write_atomic(path, &png)
        .map_err(|e| TrainError::io(format!("cannot write {}", path.display()), e))
}

const COLOURS: [RGBColor; 6] = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];

/// What a curve is called and where its values come from.
type Curve = (String, Vec<(f64, f64)>);

fn curve(reports: &[EpochReport], label: &str, metric: &str) -> Curve {
    let points = reports
        .iter()
        .filter_map(|r| Some((r.epoch as f64, r.metric(metric)?)))
        .filter(|(_, v)| v.is_finite())
        .collect();
    (label.to_owned(), points)
}

fn draw<'a>(
    reports: &[EpochReport],
    metrics: &[String],
    rgb: &'a mut [u8],
) -> Result<(), Box<dyn std::error::Error + 'a>> {
    let text = font_available();
    let root = BitMapBackend::with_buffer(rgb, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(500);
    let last_epoch = reports.iter().map(|p| p.epoch).max().unwrap_or(1).max(1) as f64;
    let first_epoch = reports.iter().map(|p| p.epoch).min().unwrap_or(0) as f64;
    let x_range = first_epoch..last_epoch.max(first_epoch + 1.0);

    let losses = vec![
        curve(reports, "train loss", "train_loss"),
        curve(reports, "validation loss", "val_loss"),
    ];
    let others: Vec<Curve> = metrics.iter().map(|m| curve(reports, m, m)).collect();
    let top = |curves: &[Curve], floor: f64| {
        curves
            .iter()
            .flat_map(|(_, p)| p.iter().map(|&(_, v)| v))
            .fold(floor, f64::max)
            * 1.1
    };
    let panels = [
        (left, "loss", top(&losses, 1e-3), losses),
        (right, "metrics", top(&others, 1.0 / 1.1), others),
    ];
    for (area, title, y_max, curves) in panels {
        let mut builder = ChartBuilder::on(&area);
        builder
            .margin(12)
            .x_label_area_size(if text { 30 } else { 5 })
            .y_label_area_size(if text { 50 } else { 5 });
        if text {
            builder.caption(title, ("sans-serif", 20));
        }
        let mut chart = builder.build_cartesian_2d(x_range.clone(), 0.0..y_max)?;
        let mut mesh = chart.configure_mesh();
        if text {
            mesh.x_desc("epoch");
        } else {
            mesh.disable_x_mesh()
                .disable_y_mesh()
                .x_labels(0)
                .y_labels(0);
        }
        mesh.draw()?;
        let labelled = text && curves.iter().any(|(_, p)| !p.is_empty());
        for (k, (name, points)) in curves.into_iter().enumerate() {
            let colour = COLOURS[k % COLOURS.len()];
            let drawn =
                chart.draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))?;
            if labelled {
                drawn.label(name).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2))
                });
            }
            chart.draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, colour.filled())),
            )?;
        }
        if labelled {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_png_of_the_right_size() {
        let dir = std::env::temp_dir().join(format!("ddp-train-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("curves.png");
        let points: Vec<EpochReport> = (1..=4)
            .map(|e| EpochReport {
                epoch: e,
                train_loss: 1.0 / e as f64,
                val_loss: Some(1.2 / e as f64),
                metrics: serde_json::json!({"val_f1": 0.2 * e as f64})
                    .as_object()
                    .unwrap()
                    .clone(),
                lr: 1e-3,
                grad_norm: None,
                skipped_steps: None,
                images_per_sec: 10.0,
                epoch_seconds: 1.0,
                steps: 3,
                world_size: 2,
                allocation_change: None,
            })
            .collect();
        let metrics = ["val_f1".to_string()];
        draw_curves(&points, &metrics, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        // IHDR: width and height, big-endian, at bytes 16..24.
        assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().unwrap()), 1000);
        assert_eq!(u32::from_be_bytes(bytes[20..24].try_into().unwrap()), 420);
        // A single point (the first epoch) draws too.
        draw_curves(&points[..1], &metrics, &path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
