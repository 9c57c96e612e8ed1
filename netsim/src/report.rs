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

/// CPU seconds this process has used (user + system; Linux, 0 elsewhere).
pub fn cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the command name (which may hold spaces) in parentheses.
            let rest = &s[s.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(ticks / 100.0)
        })
        .unwrap_or(0.0)
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

pub use agentjet::base::plot::{svg_plot, Series};

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
