//! Server-side SVG charts: a line chart with one marked point per step (and an optional
//! min–max band) and a stacked bar chart. Plain SVG, styled by the page's CSS; every value
//! also goes into a `<title>` so hovering shows it.

use std::fmt::Write;

const W: f64 = 640.0;
const H: f64 = 220.0;
const PAD_L: f64 = 56.0;
const PAD_R: f64 = 16.0;
const PAD_T: f64 = 28.0;
const PAD_B: f64 = 32.0;

const COLORS: [&str; 6] = [
    "#3b6fd8", "#e0892b", "#3aa676", "#c9473e", "#8a5bd6", "#6b7280",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Axis ticks at 1, 2 or 5 × 10^k apart, at most about `max` of them, covering `lo..=hi`
/// (the first tick at or below `lo`, the last at or above `hi`). `whole`: the step is a
/// whole number (a step axis never reads 0.5). Returns the ticks and their step.
pub fn nice_ticks(lo: f64, hi: f64, max: usize, whole: bool) -> (Vec<f64>, f64) {
    let (lo, hi) = if lo.is_finite() && hi.is_finite() {
        (lo.min(hi), lo.max(hi))
    } else {
        (0.0, 1.0)
    };
    // One value (every reward 0, one step): an axis from 0 to it, or 0..1 for 0 itself.
    let (lo, hi) = match () {
        _ if hi > lo => (lo, hi),
        _ if lo == 0.0 => (0.0, 1.0),
        _ if lo > 0.0 => (0.0, lo),
        _ => (lo, 0.0),
    };
    let raw = (hi - lo) / max.saturating_sub(1).max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let mut step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * mag);
    if whole {
        step = step.max(1.0).round();
    }
    let first = (lo / step + 1e-9).floor() as i64;
    let last = (hi / step - 1e-9).ceil() as i64;
    let ticks = (first..=last.max(first + 1))
        .map(|i| {
            let v = i as f64 * step;
            // No "-0": a tick that is zero reads 0.
            if v.abs() < step * 1e-9 { 0.0 } else { v }
        })
        .collect();
    (ticks, step)
}

/// A tick's label: as many decimals as its step needs (a 0.5 step reads "1.5", a 0.05 step
/// "0.15", a whole step none), thousands as "k" and millions as "M" where the step is
/// that coarse.
pub fn tick_label(v: f64, step: f64) -> String {
    let v = if v.abs() < step.abs() * 1e-9 { 0.0 } else { v };
    if step >= 1e6 && (v / 1e6).fract() == 0.0 {
        return format!("{}M", v / 1e6);
    }
    if step >= 1e3 && (v / 1e3).fract() == 0.0 && v.abs() >= 1e4 {
        return format!("{}k", v / 1e3);
    }
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    format!("{v:.decimals$}")
}

/// A value in a tooltip: at most 4 significant digits after the point, trailing zeros cut.
fn short(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        return format!("{v:.0}");
    }
    let s = if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.4}")
    };
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}

struct Scale {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
    xticks: (Vec<f64>, f64),
    yticks: (Vec<f64>, f64),
}

impl Scale {
    /// `xs` are steps (whole numbers: integer ticks); the y range is widened to whole ticks.
    fn new(xs: &[f64], lo: f64, hi: f64) -> Scale {
        let x0 = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let x1 = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let (x0, x1) = if x0.is_finite() && x1 > x0 {
            (x0, x1)
        } else if x0.is_finite() {
            (x0 - 0.5, x0 + 0.5)
        } else {
            (0.0, 1.0)
        };
        let (all, xstep) = nice_ticks(x0, x1, 8, true);
        let xticks: Vec<f64> = all
            .into_iter()
            .filter(|t| *t >= x0 - 1e-9 && *t <= x1 + 1e-9)
            .collect();
        let yticks = nice_ticks(lo, hi, 5, false);
        let y0 = yticks.0.first().copied().unwrap_or(0.0);
        let y1 = yticks.0.last().copied().unwrap_or(1.0);
        Scale {
            x0,
            x1,
            y0,
            y1,
            xticks: (xticks, xstep),
            yticks,
        }
    }
    fn x(&self, v: f64) -> f64 {
        PAD_L + (v - self.x0) / (self.x1 - self.x0) * (W - PAD_L - PAD_R)
    }
    fn y(&self, v: f64) -> f64 {
        H - PAD_B - (v - self.y0) / (self.y1 - self.y0) * (H - PAD_T - PAD_B)
    }
}

fn frame(out: &mut String, title: &str, s: &Scale, x_label: &str) {
    let _ = write!(
        out,
        r#"<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" role="img" aria-label="{t}"><text class="title" x="{PAD_L}" y="16">{t}</text>"#,
        t = esc(title)
    );
    let (bx, by) = (PAD_L, H - PAD_B);
    let (yt, ystep) = &s.yticks;
    for v in yt {
        let y = s.y(*v);
        let _ = write!(
            out,
            r#"<line class="grid" x1="{bx}" y1="{y:.1}" x2="{}" y2="{y:.1}"/><text class="tick ytick" x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            W - PAD_R,
            PAD_L - 4.0,
            y + 4.0,
            tick_label(*v, *ystep)
        );
    }
    let (xt, xstep) = &s.xticks;
    for v in xt {
        let x = s.x(*v);
        let _ = write!(
            out,
            r#"<line class="axis" x1="{x:.1}" y1="{by}" x2="{x:.1}" y2="{}"/><text class="tick xtick" x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#,
            by + 4.0,
            H - 16.0,
            tick_label(*v, *xstep)
        );
    }
    let _ = write!(
        out,
        r#"<line class="axis" x1="{bx}" y1="{by}" x2="{}" y2="{by}"/><line class="axis" x1="{bx}" y1="{PAD_T}" x2="{bx}" y2="{by}"/><text class="tick" x="{}" y="{}" text-anchor="middle">{}</text>"#,
        W - PAD_R,
        (W + PAD_L) / 2.0,
        H - 2.0,
        esc(x_label)
    );
}

/// One line of a [`line_chart`]: (x, y) points, `None` where a step has no value.
pub struct Series<'a> {
    pub name: &'a str,
    pub points: Vec<(f64, Option<f64>)>,
    /// Optional (lo, hi) per point, drawn as a band.
    pub band: Option<Vec<Option<(f64, f64)>>>,
}

/// A line chart; each point with a value is a `<circle class="point">` (one per step).
pub fn line_chart(title: &str, x_label: &str, series: &[Series]) -> String {
    let xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    let mut ys: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().filter_map(|p| p.1))
        .collect();
    for s in series {
        for (lo, hi) in s.band.iter().flatten().flatten() {
            ys.push(*lo);
            ys.push(*hi);
        }
    }
    let lo = ys.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ys.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let s = Scale::new(&xs, lo.min(0.0), hi);
    let mut out = String::new();
    frame(&mut out, title, &s, x_label);
    for (i, ser) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        if let Some(band) = &ser.band {
            for (p, b) in ser.points.iter().zip(band) {
                if let Some((blo, bhi)) = b {
                    let _ = write!(
                        out,
                        r#"<line class="band" x1="{x}" x2="{x}" y1="{}" y2="{}" stroke="{color}"/>"#,
                        s.y(*blo),
                        s.y(*bhi),
                        x = s.x(p.0)
                    );
                }
            }
        }
        let path: Vec<String> = ser
            .points
            .iter()
            .filter_map(|(x, y)| y.map(|y| format!("{:.1},{:.1}", s.x(*x), s.y(y))))
            .collect();
        let _ = write!(
            out,
            r#"<polyline class="line" fill="none" stroke="{color}" points="{}"/>"#,
            path.join(" ")
        );
        for (x, y) in &ser.points {
            if let Some(y) = y {
                let _ = write!(
                    out,
                    r#"<circle class="point" data-series="{n}" data-x="{x}" cx="{:.1}" cy="{:.1}" r="3" fill="{color}"><title>{n} @ {x}: {}</title></circle>"#,
                    s.x(*x),
                    s.y(*y),
                    short(*y),
                    n = esc(ser.name)
                );
            }
        }
    }
    legend(&mut out, series.iter().map(|s| s.name));
    out.push_str("</svg>");
    out
}

fn legend<'a>(out: &mut String, names: impl Iterator<Item = &'a str>) {
    let mut x = W - PAD_R;
    let items: Vec<&str> = names.collect();
    for (i, n) in items.iter().enumerate().rev() {
        x -= 14.0 + 7.0 * n.chars().count() as f64;
        let _ = write!(
            out,
            r#"<rect x="{x}" y="8" width="10" height="10" fill="{}"/><text class="tick" x="{}" y="17">{}</text>"#,
            COLORS[i % COLORS.len()],
            x + 12.0,
            esc(n)
        );
    }
}

/// Stacked bars: one bar per x, one layer per (name, values).
pub fn stacked_bars(title: &str, x_label: &str, xs: &[f64], layers: &[(&str, Vec<f64>)]) -> String {
    let totals: Vec<f64> = (0..xs.len())
        .map(|i| {
            layers
                .iter()
                .map(|(_, v)| v.get(i).copied().unwrap_or(0.0))
                .sum()
        })
        .collect();
    let hi = totals.iter().copied().fold(0.0, f64::max);
    let mut padded = xs.to_vec();
    if let (Some(first), Some(last)) = (xs.first(), xs.last()) {
        padded.push(first - 0.5);
        padded.push(last + 0.5);
    }
    let s = Scale::new(&padded, 0.0, hi);
    let bw = ((W - PAD_L - PAD_R) / (xs.len().max(1) as f64 + 1.0) * 0.7).max(1.0);
    let mut out = String::new();
    frame(&mut out, title, &s, x_label);
    for (i, x) in xs.iter().enumerate() {
        let mut base = 0.0;
        for (j, (name, v)) in layers.iter().enumerate() {
            let h = v.get(i).copied().unwrap_or(0.0);
            if h <= 0.0 {
                continue;
            }
            let (y_top, y_bot) = (s.y(base + h), s.y(base));
            let _ = write!(
                out,
                r#"<rect class="bar" data-x="{x}" x="{:.1}" y="{y_top:.1}" width="{bw:.1}" height="{:.1}" fill="{}"><title>{} @ {x}: {}</title></rect>"#,
                s.x(*x) - bw / 2.0,
                (y_bot - y_top).max(0.5),
                COLORS[j % COLORS.len()],
                esc(name),
                short(h)
            );
            base += h;
        }
    }
    legend(&mut out, layers.iter().map(|(n, _)| *n));
    out.push_str("</svg>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_point_per_value_and_none_is_skipped() {
        let svg = line_chart(
            "r",
            "step",
            &[Series {
                name: "mean",
                points: vec![(0.0, Some(0.1)), (1.0, None), (2.0, Some(0.7))],
                band: Some(vec![Some((0.0, 0.2)), None, Some((0.5, 1.0))]),
            }],
        );
        assert_eq!(svg.matches("<circle class=\"point\"").count(), 2);
        assert_eq!(svg.matches("class=\"band\"").count(), 2);
        let bars = stacked_bars(
            "t",
            "step",
            &[0.0, 1.0],
            &[("a", vec![1.0, 2.0]), ("b<", vec![0.5, 0.0])],
        );
        assert_eq!(bars.matches("<rect class=\"bar\"").count(), 3);
        assert!(bars.contains("b&lt;") && !bars.contains("b<"));
    }
}
