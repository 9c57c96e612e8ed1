//! Line plots as small self-contained SVG files (no plotting dependency, nothing loaded
//! from elsewhere): the run directories' curves, netsim's results.

/// One line of a plot: a name and its (x, y) points (non-finite points are left out).
#[derive(Debug, Clone, Default)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [&str; 5] = ["steelblue", "darkorange", "seagreen", "purple", "firebrick"];

/// Points are marked with a dot up to this many per series.
const MAX_DOTS: usize = 60;

/// Escapes text for SVG or HTML.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// An SVG plot of `series` against one pair of axes. The x axis starts at 0; the y axis
/// at 0 too unless a value is negative.
pub fn svg_plot(title: &str, xlabel: &str, ylabel: &str, series: &[Series]) -> String {
    let (w, h, pad) = (720.0, 400.0, 56.0);
    let finite = |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite();
    let (mut xmax, mut ymin, mut ymax) = (0.0f64, 0.0f64, 0.0f64);
    for &(x, y) in series.iter().flat_map(|s| s.points.iter().filter(finite)) {
        xmax = xmax.max(x);
        ymin = ymin.min(y);
        ymax = ymax.max(y);
    }
    let xmax = xmax.max(1e-9) * 1.05;
    let span = (ymax - ymin).max(1e-9);
    let (ymin, ymax) = (
        if ymin < 0.0 { ymin - 0.05 * span } else { 0.0 },
        ymax + 0.1 * span,
    );
    let px = |x: f64| pad + (w - 2.0 * pad) * x / xmax;
    let py = |y: f64| h - pad - (h - 2.0 * pad) * (y - ymin) / (ymax - ymin);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{pad}\" y=\"22\" font-size=\"14\">{}</text>\n\
         <line x1=\"{pad}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <text x=\"{r}\" y=\"{lb}\" text-anchor=\"end\">{}</text>\n\
         <text x=\"14\" y=\"{pad}\" transform=\"rotate(-90 14 {pad})\" text-anchor=\"end\">{}</text>\n",
        escape(title),
        escape(xlabel),
        escape(ylabel),
        b = h - pad,
        r = w - pad,
        lb = h - 12.0,
    );
    for i in 0..=4 {
        let xv = xmax * i as f64 / 4.0;
        let yv = ymin + (ymax - ymin) * i as f64 / 4.0;
        svg.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            px(xv),
            h - pad + 16.0,
            short(xv),
            pad - 4.0,
            py(yv) + 4.0,
            short(yv)
        ));
    }
    if ymin < 0.0 {
        svg.push_str(&format!(
            "<line x1=\"{pad}\" y1=\"{y:.1}\" x2=\"{r}\" y2=\"{y:.1}\" stroke=\"#bbb\" stroke-dasharray=\"4 3\"/>\n",
            y = py(0.0),
            r = w - pad
        ));
    }
    for (k, s) in series.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(finite)
            .map(|&(x, y)| (px(x), py(y)))
            .collect();
        let line: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        svg.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n",
            line.join(" ")
        ));
        if pts.len() <= MAX_DOTS {
            for (x, y) in &pts {
                svg.push_str(&format!(
                    "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{color}\"/>\n"
                ));
            }
        }
        svg.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\" fill=\"{color}\">{}</text>\n",
            w - pad,
            pad + 16.0 * k as f64,
            escape(&s.name)
        ));
    }
    svg.push_str("</svg>\n");
    svg
}

/// A tick label: fewer decimals for larger values.
fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else if a >= 0.01 || a == 0.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.1e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plot_has_one_line_per_series_and_escapes_its_text() {
        let s = vec![
            Series {
                name: "loss <mean>".into(),
                points: vec![(1.0, -0.5), (2.0, 0.25), (3.0, f64::NAN)],
            },
            Series {
                name: "kl".into(),
                points: vec![(1.0, 0.01)],
            },
        ];
        let svg = svg_plot("a & b", "step", "value", &s);
        assert_eq!(svg.matches("<polyline").count(), 2);
        // The NaN point is left out: two dots, then one.
        assert_eq!(svg.matches("<circle").count(), 3);
        assert!(svg.contains("a &amp; b") && svg.contains("loss &lt;mean&gt;"));
        // A negative value: the zero line is drawn.
        assert!(svg.contains("stroke-dasharray"));
        assert!(!svg.contains("NaN"));
    }
}
