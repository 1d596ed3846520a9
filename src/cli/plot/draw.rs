//! Drawing `oato plot`'s panels with plotters: one layout for PNG (encoded with the `png` crate) and
//! SVG, text in DejaVu Sans embedded in the binary (assets/fonts), so no system font is needed.

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::Panel;
use oato::error::{Error, Result};

/// DejaVu Sans 2.37 (Bitstream Vera licence, assets/fonts/DejaVuSans-LICENSE.txt).
static FONT: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";
const PANEL_W: u32 = 620;
const PANEL_H: u32 = 420;
const TITLE_H: u32 = 44;
const LINE_H: u32 = 20;
/// The figure's background: the tests count the pixels of any other colour in the plot areas.
pub const BACKGROUND: RGBColor = WHITE;

pub struct Figure<'a> {
    pub title: &'a str,
    pub panels: &'a [Panel],
    pub caption: &'a [String],
}

/// A policy's colour, the same in every figure.
pub fn colour(policy: &str, index: usize) -> RGBColor {
    const OTHERS: [RGBColor; 4] = [
        RGBColor(127, 127, 127),
        RGBColor(23, 190, 207),
        RGBColor(188, 189, 34),
        RGBColor(227, 119, 194),
    ];
    match policy {
        "oato" => RGBColor(31, 119, 180),
        "oato-paper" => RGBColor(255, 127, 14),
        "layer-split" => RGBColor(44, 160, 44),
        "flexgen" => RGBColor(214, 39, 40),
        "llama.cpp -ngl" => RGBColor(148, 103, 189),
        "llama.cpp -ngl -nopo" => RGBColor(140, 86, 75),
        _ => OTHERS[index % OTHERS.len()],
    }
}

fn register_font() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut res = Ok(());
    ONCE.call_once(|| {
        res = plotters::style::register_font(FAMILY, FontStyle::Normal, FONT)
            .map_err(|_| Error::Msg("the embedded font DejaVuSans.ttf does not parse".into()));
    });
    res
}

/// The figure's size and grid: (width, height, columns, rows).
pub fn layout(f: &Figure) -> (u32, u32, usize, usize) {
    let n = f.panels.len().max(1);
    let cols = match n {
        1 => 1,
        2 | 4 => 2,
        _ => 3,
    };
    let rows = n.div_ceil(cols);
    let w = (cols as u32 * PANEL_W).max(1000);
    let h = TITLE_H + rows as u32 * PANEL_H + LINE_H * f.caption.len() as u32 + 12;
    (w, h, cols, rows)
}

type DrawResult = std::result::Result<(), String>;

fn draw_on<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, f: &Figure) -> DrawResult {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let (_, _, cols, rows) = layout(f);
    root.fill(&BACKGROUND).map_err(e)?;
    let (top, rest) = root.split_vertically(TITLE_H);
    top.draw(&Text::new(f.title, (12, 10), (FAMILY, 22).into_font()))
        .map_err(e)?;
    let (body, cap) = rest.split_vertically(rows as u32 * PANEL_H);
    for (i, line) in f.caption.iter().enumerate() {
        let y = 4 + i as i32 * LINE_H as i32;
        cap.draw(&Text::new(line.as_str(), (12, y), (FAMILY, 14).into_font()))
            .map_err(e)?;
    }
    for (p, area) in f.panels.iter().zip(body.split_evenly((rows, cols))) {
        panel(&area, p)?;
    }
    root.present().map_err(e)
}

fn panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &Panel) -> DrawResult {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let n = p.groups.len().max(1);
    let top = p
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().flatten().map(|s| s.max))
        .chain(
            p.reference
                .iter()
                .flat_map(|(_, v)| v.iter().flatten().copied()),
        )
        .fold(0.0f64, f64::max);
    // Head room for the legend above the tallest mark.
    let y_max = if top > 0.0 { top * 1.5 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, (FAMILY, 16))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..n as f64, 0f64..y_max)
        .map_err(e)?;
    let groups = &p.groups;
    let x_label = |x: &f64| {
        let i = x.floor();
        match groups.get(i as usize) {
            Some(g) if (x - i - 0.5).abs() < 1e-6 => g.clone(),
            _ => String::new(),
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(2 * n + 1)
        .x_label_formatter(&x_label)
        .y_labels(8)
        .x_desc(p.x_label.as_str())
        .y_desc(p.metric.label())
        .label_style((FAMILY, 13))
        .axis_desc_style((FAMILY, 14))
        .draw()
        .map_err(e)?;
    let k = p.series.len().max(1) as f64;
    // Where series `si`'s mark sits in group `g`, and its half-width.
    let bar_w = 0.8 / k;
    let pos = |g: usize, si: usize| -> (f64, f64) {
        if p.lines {
            // Side by side, so that equal values still show every series' marks.
            (g as f64 + 0.5 + (si as f64 - (k - 1.0) / 2.0) * 0.06, 0.02)
        } else {
            (g as f64 + 0.1 + (si as f64 + 0.5) * bar_w, bar_w * 0.45)
        }
    };
    for (si, (name, stats)) in p.series.iter().enumerate() {
        let c = colour(name, si);
        let marks: Vec<(usize, super::Stat)> = stats
            .iter()
            .enumerate()
            .filter_map(|(g, s)| s.map(|s| (g, s)))
            .collect();
        if p.lines {
            let pts: Vec<(f64, f64)> = marks
                .iter()
                .map(|&(g, s)| (pos(g, si).0, s.median))
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(e)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2))
                });
            chart
                .draw_series(pts.iter().map(|&xy| Circle::new(xy, 5, c.filled())))
                .map_err(e)?;
        } else {
            chart
                .draw_series(marks.iter().map(|&(g, s)| {
                    let (x, hw) = pos(g, si);
                    Rectangle::new([(x - hw, 0.0), (x + hw, s.median)], c.filled())
                }))
                .map_err(e)?
                .label(name.as_str())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
        }
        // Error bars: min to max, with caps.
        for &(g, s) in &marks {
            let (x, hw) = pos(g, si);
            let cap = hw.min(0.06) * 0.6;
            let bar = [
                vec![(x, s.min), (x, s.max)],
                vec![(x - cap, s.min), (x + cap, s.min)],
                vec![(x - cap, s.max), (x + cap, s.max)],
            ];
            chart
                .draw_series(
                    bar.into_iter()
                        .map(|v| PathElement::new(v, BLACK.stroke_width(1))),
                )
                .map_err(e)?;
        }
    }
    // The paper's claims, at oato's mark.
    let oato = p.series.iter().position(|(n, _)| n == "oato").unwrap_or(0);
    for (ri, (label, vals)) in p.reference.iter().enumerate() {
        let shade = RGBColor(0, 0, 0).mix(1.0 - 0.3 * (ri % 3) as f64);
        let style = ShapeStyle::from(&shade).stroke_width(2);
        chart
            .draw_series(
                vals.iter()
                    .enumerate()
                    .filter_map(|(g, v)| v.map(|v| Cross::new((pos(g, oato).0, v), 7, style))),
            )
            .map_err(e)?
            .label(label.as_str())
            .legend(move |(x, y)| Cross::new((x + 6, y), 5, style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font((FAMILY, 12))
        .draw()
        .map_err(e)
}

/// Writes the figure as a PNG.
pub fn png(f: &Figure, path: &Path) -> Result<()> {
    register_font()?;
    let (w, h, _, _) = layout(f);
    let mut buf = vec![0u8; w as usize * h as usize * 3];
    draw_on(
        BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area(),
        f,
    )
    .map_err(|m| Error::Msg(format!("{}: drawing: {m}", path.display())))?;
    let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let png_err = |e: png::EncodingError| Error::Msg(format!("{}: {e}", path.display()));
    let mut writer = enc.write_header().map_err(png_err)?;
    writer.write_image_data(&buf).map_err(png_err)?;
    writer.finish().map_err(png_err)
}

/// Writes the figure as an SVG.
pub fn svg(f: &Figure, path: &Path) -> Result<()> {
    register_font()?;
    let (w, h, _, _) = layout(f);
    draw_on(SVGBackend::new(path, (w, h)).into_drawing_area(), f)
        .map_err(|m| Error::Msg(format!("{}: drawing: {m}", path.display())))
}
