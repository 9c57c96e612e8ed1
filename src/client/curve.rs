//! The client's reward curve: a small self-contained SVG of every trainable model's episode
//! rewards in the order the episodes ended (the mean of each window of `window` episodes,
//! and each quarter's mean as a flat segment), written into the run directory at the end
//! of a run. What a user looks at to see whether the agent improved over the run.
//!
//! Owns: the drawing. Never reads the journal (the caller passes the rewards).

use std::collections::BTreeMap;

const COLORS: [&str; 4] = ["steelblue", "darkorange", "seagreen", "purple"];

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// The SVG of `rewards` (per model, in episode order), with windows of `window` episodes.
pub fn rewards_svg(title: &str, rewards: &BTreeMap<String, Vec<f64>>, window: usize) -> String {
    let (w, h, pad) = (720.0, 360.0, 40.0);
    let window = window.max(1);
    let n = rewards.values().map(Vec::len).max().unwrap_or(0).max(1) as f64;
    let lo = rewards.values().flatten().copied().fold(0.0f64, f64::min);
    let hi = rewards.values().flatten().copied().fold(1.0f64, f64::max);
    let x = |i: f64| pad + (w - 2.0 * pad) * i / n;
    let y = |v: f64| h - pad - (h - 2.0 * pad) * (v - lo) / (hi - lo).max(1e-9);
    let esc = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{pad}\" y=\"20\">{}</text>\n\
         <line x1=\"{pad}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <text x=\"5\" y=\"{b}\">{lo}</text><text x=\"5\" y=\"{t}\">{hi}</text>\n\
         <text x=\"{r}\" y=\"{lb}\" text-anchor=\"end\">episode {n}</text>\n",
        esc(title),
        b = h - pad,
        r = w - pad,
        t = pad + 4.0,
        lb = h - 10.0,
    );
    for (k, (model, r)) in rewards.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let points: Vec<String> = r
            .chunks(window)
            .enumerate()
            .map(|(i, c)| {
                let mid = (i * window) as f64 + c.len() as f64 / 2.0;
                format!("{:.1},{:.1}", x(mid), y(mean(c)))
            })
            .collect();
        svg.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
            points.join(" ")
        ));
        let len = r.len();
        for q in 0..4 {
            let (a, b) = (q * len / 4, (q + 1) * len / 4);
            if a < b {
                let v = y(mean(&r[a..b]));
                svg.push_str(&format!(
                    "<line x1=\"{:.1}\" y1=\"{v:.1}\" x2=\"{:.1}\" y2=\"{v:.1}\" stroke=\"{color}\" stroke-width=\"3\" opacity=\"0.4\"/>\n",
                    x(a as f64),
                    x(b as f64)
                ));
            }
        }
        svg.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\" fill=\"{color}\">{} (window {window}; bands: quarter means)</text>\n",
            w - pad,
            pad + 14.0 * k as f64,
            esc(model)
        ));
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_polyline_and_four_quarter_bands_per_model() {
        let mut r = BTreeMap::new();
        r.insert("m".to_string(), (0..40).map(|i| (i % 2) as f64).collect());
        let svg = rewards_svg("t <x>", &r, 8);
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert_eq!(svg.matches("opacity=\"0.4\"").count(), 4);
        assert!(svg.contains("t &lt;x&gt;"));
        // Five windows of 8 episodes: five points.
        let pts = svg
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(pts.split(' ').count(), 5);
    }
}
