//! Figures out of a scenario: percentiles, a markdown table, an SVG line plot, and the
//! results folder (`<out>/<scenario>.md`, `.json`, `.svg`).

use std::path::Path;
use std::time::Duration;

/// The `q` quantile (0..=1) of `v` by the nearest-rank method; 0 for an empty slice.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q.clamp(0.0, 1.0) * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

pub fn secs(d: &[Duration]) -> Vec<f64> {
    d.iter().map(Duration::as_secs_f64).collect()
}

/// The resident memory of this process, bytes (Linux; 0 elsewhere).
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// A markdown table.
pub struct Table {
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn markdown(&self) -> String {
        let mut s = format!(
            "| {} |\n|{}\n",
            self.header.join(" | "),
            "---|".repeat(self.header.len())
        );
        for r in &self.rows {
            s.push_str(&format!("| {} |\n", r.join(" | ")));
        }
        s
    }
}

/// One line of a plot: a name and its (x, y) points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [&str; 5] = ["steelblue", "darkorange", "seagreen", "purple", "firebrick"];

/// An SVG plot of `series` against one pair of axes (from 0 to the largest value).
pub fn svg_plot(title: &str, xlabel: &str, ylabel: &str, series: &[Series]) -> String {
    let (w, h, pad) = (720.0, 400.0, 56.0);
    let all = series.iter().flat_map(|s| s.points.iter());
    let (mut xmax, mut ymax) = (0.0f64, 0.0f64);
    for &(x, y) in all {
        xmax = xmax.max(x);
        ymax = ymax.max(y);
    }
    let (xmax, ymax) = (xmax.max(1e-9) * 1.05, ymax.max(1e-9) * 1.1);
    let px = |x: f64| pad + (w - 2.0 * pad) * x / xmax;
    let py = |y: f64| h - pad - (h - 2.0 * pad) * y / ymax;
    let esc = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{pad}\" y=\"22\" font-size=\"14\">{}</text>\n\
         <line x1=\"{pad}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <text x=\"{r}\" y=\"{lb}\" text-anchor=\"end\">{}</text>\n\
         <text x=\"14\" y=\"{pad}\" transform=\"rotate(-90 14 {pad})\" text-anchor=\"end\">{}</text>\n",
        esc(title),
        esc(xlabel),
        esc(ylabel),
        b = h - pad,
        r = w - pad,
        lb = h - 12.0,
    );
    for i in 0..=4 {
        let (xv, yv) = (xmax * i as f64 / 4.0, ymax * i as f64 / 4.0);
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
    for (k, s) in series.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let pts: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        svg.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n",
            pts.join(" ")
        ));
        for p in &pts {
            let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
            svg.push_str(&format!(
                "<circle cx=\"{x}\" cy=\"{y}\" r=\"3\" fill=\"{color}\"/>\n"
            ));
        }
        svg.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\" fill=\"{color}\">{}</text>\n",
            w - pad,
            pad + 16.0 * k as f64,
            esc(&s.name)
        ));
    }
    svg.push_str("</svg>\n");
    svg
}

fn short(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Writes `<out>/<name>.md` (the table and notes), `.json` and, when given, `.svg`.
pub fn write_results(
    out: &Path,
    name: &str,
    markdown: &str,
    json: &serde_json::Value,
    svg: Option<&str>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join(format!("{name}.md")), markdown)?;
    std::fs::write(
        out.join(format!("{name}.json")),
        serde_json::to_string_pretty(json)?,
    )?;
    if let Some(svg) = svg {
        std::fs::write(out.join(format!("{name}.svg")), svg)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&[3.0], 0.99), 3.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn a_plot_has_a_line_and_points_per_series() {
        let s = vec![
            Series {
                name: "a<b".into(),
                points: vec![(1.0, 2.0), (2.0, 3.0)],
            },
            Series {
                name: "c".into(),
                points: vec![(1.0, 1.0)],
            },
        ];
        let svg = svg_plot("t", "x", "y", &s);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 3);
        assert!(svg.contains("a&lt;b"));
    }
}
