//! What the driver reads of a running arm: its server's steps (`metrics.jsonl` of the
//! server's run directory, one line per training step), the arm's score at a target, and
//! the usual failures: a non-finite loss, a reward that stays flat, an entropy that
//! collapsed.

use std::path::Path;

use serde_json::Value;

use super::spec::Watch;

/// One training step's line, as the driver needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub step: u64,
    pub trained: bool,
    pub line: Value,
}

impl Step {
    /// A figure of the step (`null` and absent read as NaN: JSON has no NaN).
    pub fn get(&self, name: &str) -> f64 {
        self.line
            .get(name)
            .and_then(Value::as_f64)
            .unwrap_or(f64::NAN)
    }
}

/// The whole lines of a server's `metrics.jsonl` (none yet when it has no file); lines
/// that do not parse are left out.
pub fn steps(path: &Path) -> Vec<Step> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    crate::base::files::whole_lines(&text)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|line| {
            Some(Step {
                step: line.get("step")?.as_u64()?,
                trained: line
                    .get("trained")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
                line,
            })
        })
        .collect()
}

/// The arm's score at `target`: the mean of `metric` over its last `window` steps up to
/// `target` (the steps without the figure left out); none when no step had it.
pub fn score(steps: &[Step], metric: &str, target: u64, window: usize) -> Option<f64> {
    let upto: Vec<f64> = steps
        .iter()
        .filter(|s| s.step <= target)
        .map(|s| s.get(metric))
        .collect();
    let last: Vec<f64> = upto
        .iter()
        .rev()
        .take(window)
        .copied()
        .filter(|x| x.is_finite())
        .collect();
    (!last.is_empty()).then(|| last.iter().sum::<f64>() / last.len() as f64)
}

/// The first failure `steps` show, as (kind, detail).
pub fn failure(steps: &[Step], w: &Watch) -> Option<(String, String)> {
    if w.nonfinite {
        if let Some(s) = steps
            .iter()
            .find(|s| s.trained && !s.get("loss").is_finite())
        {
            return Some((
                "nonfinite_loss".into(),
                format!("step {}: the loss is not finite", s.step),
            ));
        }
        // The trainer refuses a non-finite update by itself; a step of which it refused
        // every one has diverged.
        if let Some(s) = steps.iter().find(|s| {
            let bad = s.get("nonfinite_updates");
            bad > 0.0 && bad >= s.get("updates")
        }) {
            return Some((
                "nonfinite_loss".into(),
                format!(
                    "step {}: all {} updates refused for a non-finite loss or gradient",
                    s.step,
                    s.get("nonfinite_updates")
                ),
            ));
        }
    }
    if w.flat_steps >= 2 && steps.len() >= w.flat_steps {
        let last = &steps[steps.len() - w.flat_steps..];
        let r: Vec<f64> = last.iter().map(|s| s.get("reward_mean")).collect();
        if r.iter().all(|x| x.is_finite()) {
            let (lo, hi) = r
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
                    (lo.min(x), hi.max(x))
                });
            if hi - lo < 1e-9 {
                return Some((
                    "flat_reward".into(),
                    format!(
                        "the mean reward stayed {lo:.4} over steps {} to {}",
                        last[0].step,
                        last[last.len() - 1].step
                    ),
                ));
            }
        }
    }
    if w.min_entropy > 0.0 {
        if let Some(s) = steps.iter().rev().find(|s| s.trained) {
            let e = s.get("entropy");
            if e.is_finite() && e < w.min_entropy {
                return Some((
                    "entropy_collapsed".into(),
                    format!("step {}: entropy {e:.4} is below {}", s.step, w.min_entropy),
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(lines: &[&str]) -> (tempfile::TempDir, Vec<Step>) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.jsonl");
        std::fs::write(&p, lines.join("\n")).unwrap();
        let s = steps(&p);
        (dir, s)
    }

    fn watch() -> Watch {
        Watch {
            nonfinite: true,
            flat_steps: 3,
            min_entropy: 0.1,
            stall_seconds: 60.0,
            restarts: 1,
        }
    }

    #[test]
    fn the_score_is_the_mean_of_the_last_steps_up_to_the_target() {
        let (_d, s) = write(&[
            r#"{"step":1,"trained":true,"reward_mean":0.1,"loss":1,"entropy":1}"#,
            r#"{"step":2,"trained":true,"reward_mean":0.3,"loss":1,"entropy":1}"#,
            r#"{"step":3,"trained":true,"reward_mean":null,"loss":1,"entropy":1}"#,
            r#"{"step":4,"trained":true,"reward_mean":0.9,"loss":1,"entropy":1}"#,
            // torn: no newline after it
            r#"{"step":5,"trained":true,"reward_mean":5"#,
        ]);
        assert_eq!(s.len(), 4);
        assert_eq!(score(&s, "reward_mean", 3, 2), Some(0.3));
        assert!((score(&s, "reward_mean", 4, 3).unwrap() - 0.6).abs() < 1e-12);
        assert_eq!(score(&s, "accuracy", 4, 3), None);
        assert_eq!(failure(&s, &watch()), None);
    }

    #[test]
    fn each_failure_is_named() {
        let ok = r#"{"step":1,"trained":true,"reward_mean":0.1,"loss":1,"entropy":1}"#;
        let (_d, s) = write(&[
            ok,
            r#"{"step":2,"trained":true,"reward_mean":0.2,"loss":null,"entropy":1}"#,
            "",
        ]);
        assert_eq!(failure(&s, &watch()).unwrap().0, "nonfinite_loss");
        let (_d, s) = write(&[
            ok,
            r#"{"step":2,"trained":true,"reward_mean":0.2,"loss":1,"entropy":1,"updates":2,"nonfinite_updates":1}"#,
            "",
        ]);
        assert_eq!(failure(&s, &watch()), None, "one update of two refused");
        let (_d, s) = write(&[
            ok,
            r#"{"step":2,"trained":true,"reward_mean":0.2,"loss":1,"entropy":1,"updates":2,"nonfinite_updates":2}"#,
            "",
        ]);
        assert_eq!(failure(&s, &watch()).unwrap().0, "nonfinite_loss");
        let (_d, s) = write(&[
            ok,
            r#"{"step":2,"trained":true,"reward_mean":0.5,"loss":1,"entropy":1}"#,
            r#"{"step":3,"trained":true,"reward_mean":0.5,"loss":1,"entropy":1}"#,
            r#"{"step":4,"trained":true,"reward_mean":0.5,"loss":1,"entropy":1}"#,
            "",
        ]);
        let (kind, detail) = failure(&s, &watch()).unwrap();
        assert_eq!(kind, "flat_reward");
        assert!(detail.contains("steps 2 to 4"), "{detail}");
        let (_d, s) = write(&[
            ok,
            r#"{"step":2,"trained":true,"reward_mean":0.3,"loss":1,"entropy":0.05}"#,
            "",
        ]);
        assert_eq!(failure(&s, &watch()).unwrap().0, "entropy_collapsed");
    }
}
