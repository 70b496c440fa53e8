//! `curves.png`: training and validation loss, and validation macro/micro F1, per epoch.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

/// A curve: its legend, colour and the value it plots.
type Series = (&'static str, RGBColor, fn(&EpochPoint) -> f64);

/// One epoch's numbers, as plotted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpochPoint {
    /// Epoch number.
    pub epoch: u64,
    /// Mean training loss.
    pub train_loss: f64,
    /// Mean validation loss.
    pub val_loss: f64,
    /// Validation macro-F1.
    pub macro_f1: f64,
    /// Validation micro-F1.
    pub micro_f1: f64,
}

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

/// Draws the curves of `points` into `path` (PNG, 1000x420): losses on the left, F1 on the
/// right. Written to a temporary file and renamed, so readers never see half a picture.
pub fn draw_curves(points: &[EpochPoint], path: &Path) -> Result<(), String> {
    let tmp = path.with_extension("png.tmp.png");
    draw(points, &tmp).map_err(|e| format!("cannot draw {}: {e}", path.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn draw(points: &[EpochPoint], path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let text = font_available();
    let root = BitMapBackend::new(path, (1000, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(500);
    let last_epoch = points.iter().map(|p| p.epoch).max().unwrap_or(1).max(1) as f64;
    let first_epoch = points.iter().map(|p| p.epoch).min().unwrap_or(0) as f64;
    let x_range = first_epoch..last_epoch.max(first_epoch + 1.0);

    let losses = points
        .iter()
        .flat_map(|p| [p.train_loss, p.val_loss])
        .filter(|v| v.is_finite());
    let max_loss = losses.fold(0.0f64, f64::max).max(1e-3) * 1.1;
    let series_loss: [Series; 2] = [
        ("train loss", BLUE, |p| p.train_loss),
        ("validation loss", RED, |p| p.val_loss),
    ];
    let series_f1: [Series; 2] = [
        ("validation macro-F1", GREEN, |p| p.macro_f1),
        ("validation micro-F1", MAGENTA, |p| p.micro_f1),
    ];

    for (area, title, y_max, series) in [
        (left, "loss", max_loss, series_loss),
        (right, "F1", 1.0, series_f1),
    ] {
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
        for (name, colour, value) in series {
            let line = points.iter().map(|p| (p.epoch as f64, value(p)));
            let drawn = chart.draw_series(LineSeries::new(line, colour.stroke_width(2)))?;
            if text {
                drawn.label(name).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2))
                });
            }
            chart.draw_series(
                points
                    .iter()
                    .map(|p| Circle::new((p.epoch as f64, value(p)), 3, colour.filled())),
            )?;
        }
        if text {
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
        let points: Vec<EpochPoint> = (1..=4)
            .map(|e| EpochPoint {
                epoch: e,
                train_loss: 1.0 / e as f64,
                val_loss: 1.2 / e as f64,
                macro_f1: 0.2 * e as f64,
                micro_f1: 0.15 * e as f64,
            })
            .collect();
        draw_curves(&points, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        // IHDR: width and height, big-endian, at bytes 16..24.
        assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().unwrap()), 1000);
        assert_eq!(u32::from_be_bytes(bytes[20..24].try_into().unwrap()), 420);
        // A single point (the first epoch) draws too.
        draw_curves(&points[..1], &path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
