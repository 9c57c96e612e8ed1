//! A reward curve as a small self-contained SVG (no plotting dependency): the mean
//! training reward per step, where a step has one the evaluation accuracy, and the mean
//! entropy of the trained tokens (dashed, scaled to its own maximum, named at the top).

use super::trainer::StepMetrics;

/// The curve of `metrics`; `before` is an accuracy measured before step 1 (drawn at 0).
pub fn reward_svg(title: &str, metrics: &[StepMetrics], before: Option<f64>) -> String {
    let (w, h, pad) = (720.0, 360.0, 40.0);
    let last = metrics.last().map_or(1, |m| m.step.max(1)) as f64;
    let x = |s: u64| pad + (w - 2.0 * pad) * s as f64 / last;
    let y = |v: f64| h - pad - (h - 2.0 * pad) * v.clamp(0.0, 1.0);
    let reward: Vec<String> = metrics
        .iter()
        .map(|m| format!("{:.1},{:.1}", x(m.step), y(m.reward_mean)))
        .collect();
    let acc: Vec<String> = before
        .map(|b| format!("{:.1},{:.1}", x(0), y(b)))
        .into_iter()
        .chain(
            metrics
                .iter()
                .filter_map(|m| m.accuracy.map(|a| format!("{:.1},{:.1}", x(m.step), y(a)))),
        )
        .collect();
    let title = title
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{pad}\" y=\"20\">{title}</text>\n\
         <line x1=\"{pad}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <text x=\"5\" y=\"{b}\">0</text><text x=\"5\" y=\"{t}\">1</text>\n\
         <text x=\"{r}\" y=\"{lb}\" text-anchor=\"end\">step {last}</text>\n",
        b = h - pad,
        r = w - pad,
        t = pad + 4.0,
        lb = h - 10.0,
    );
    svg.push_str(&format!(
        "<polyline fill=\"none\" stroke=\"steelblue\" stroke-width=\"1.5\" points=\"{}\"/>\n",
        reward.join(" ")
    ));
    let trained: Vec<&StepMetrics> = metrics.iter().filter(|m| m.trained).collect();
    let top = trained.iter().map(|m| m.entropy).fold(0.0, f64::max);
    if top > 0.0 {
        let ent: Vec<String> = trained
            .iter()
            .map(|m| format!("{:.1},{:.1}", x(m.step), y(m.entropy / top)))
            .collect();
        svg.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"seagreen\" stroke-width=\"1.2\" stroke-dasharray=\"4 3\" points=\"{}\"/>\n\
             <text x=\"{r}\" y=\"{t}\" text-anchor=\"end\" fill=\"seagreen\">entropy (top = {top:.3} nats/token)</text>\n",
            ent.join(" "),
            r = w - pad,
            t = pad - 6.0,
        ));
    }
    if !acc.is_empty() {
        svg.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"crimson\" stroke-width=\"2\" points=\"{}\"/>\n",
            acc.join(" ")
        ));
    }
    for p in &acc {
        let (px, py) = p.split_once(',').unwrap_or(("0", "0"));
        svg.push_str(&format!(
            "<circle cx=\"{px}\" cy=\"{py}\" r=\"3\" fill=\"crimson\"/>\n"
        ));
    }
    svg.push_str("</svg>\n");
    svg
}
