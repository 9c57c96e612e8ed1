//! Run directories as the dashboard and `agentjet-peer runs` read them.
//!
//! A server trains each model in `<data-dir>/runs/<model>/` (`metrics.jsonl`: one line per
//! step); a client runs a job in `<data-dir>/runs/<run id>/` or its `--run-dir`
//! (`episodes.jsonl`: one line per episode, and `episodes/`: the agents' logs). Either has
//! `config.json` (the effective configuration) and `plots/` (an SVG per curve, written by
//! [`write_plots`]).
//!
//! Owns: reading those files within bounds. Never writes a run's data files (their
//! owners do) and never serves a file outside a run's `episodes/` directory.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{json, Value};

use crate::base::plot::{svg_plot, Series};

/// What a run directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RunKind {
    /// A server's training of one model (`metrics.jsonl`).
    Train,
    /// A client's job (`episodes.jsonl`).
    Episodes,
}

impl RunKind {
    /// The file of one line per point.
    pub fn points_file(self) -> &'static str {
        match self {
            RunKind::Train => "metrics.jsonl",
            RunKind::Episodes => "episodes.jsonl",
        }
    }

    /// The kind of run `dir` holds, if any.
    pub fn of_dir(dir: &Path) -> Option<RunKind> {
        [RunKind::Train, RunKind::Episodes]
            .into_iter()
            .find(|k| dir.join(k.points_file()).is_file())
    }
}

/// A run a peer shows.
#[derive(Debug, Clone, Serialize)]
pub struct RunRef {
    /// Unique among the peer's runs: the directory's name.
    pub name: String,
    pub kind: RunKind,
    #[serde(skip)]
    pub dir: PathBuf,
}

impl RunRef {
    pub fn new(dir: &Path, kind: RunKind) -> RunRef {
        RunRef {
            name: dir
                .file_name()
                .map_or("run".into(), |n| n.to_string_lossy().into_owned()),
            kind,
            dir: dir.to_path_buf(),
        }
    }

    pub fn points_path(&self) -> PathBuf {
        self.dir.join(self.kind.points_file())
    }
}

/// Every run under `<data_dir>/runs/`, by name.
pub fn scan(data_dir: &Path) -> Vec<RunRef> {
    let mut out: Vec<RunRef> = std::fs::read_dir(data_dir.join("runs"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let dir = e.path();
            RunKind::of_dir(&dir).map(|k| RunRef::new(&dir, k))
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// `own` runs first, then every other run under `<data_dir>/runs/` (a name once).
pub fn with_scanned(mut own: Vec<RunRef>, data_dir: &Path) -> Vec<RunRef> {
    for r in scan(data_dir) {
        if !own.iter().any(|o| o.name == r.name) {
            own.push(r);
        }
    }
    own
}

/// Complete lines of a points file read from byte `from`: the parsed lines, the offset
/// after the last complete one, and whether the file was cut back (a resumed run rewinds
/// `metrics.jsonl`; then the lines are from the start). At most `max_bytes` are read; a
/// first read (`from` 0) of a longer file starts at its last `max_bytes`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Lines {
    pub points: Vec<Value>,
    pub next: u64,
    pub reset: bool,
}

pub fn read_lines(path: &Path, from: u64, max_bytes: usize) -> std::io::Result<Lines> {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Lines {
                reset: from > 0,
                ..Default::default()
            })
        }
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    let reset = from > len;
    let mut start = if reset { 0 } else { from };
    let tail = start == 0 && len > max_bytes as u64;
    if tail {
        start = len - max_bytes as u64;
    }
    f.seek(SeekFrom::Start(start))?;
    let mut buf = Vec::new();
    f.take(max_bytes as u64).read_to_end(&mut buf)?;
    let mut skip = 0;
    if tail {
        // Mid-line: from the next line on.
        skip = buf
            .iter()
            .position(|&b| b == b'\n')
            .map_or(buf.len(), |i| i + 1);
    }
    let end = buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let body = if end > skip { &buf[skip..end] } else { &[][..] };
    let points = String::from_utf8_lossy(body)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    Ok(Lines {
        points,
        next: start + end.max(skip) as u64,
        reset,
    })
}

/// Why a log file is not served.
#[derive(Debug, PartialEq, Eq)]
pub enum LogRefusal {
    /// Not a plain file name (a path, `..`, a hidden file, odd characters): 400.
    BadName,
    /// No such log in the run: 404.
    Missing,
}

/// The path of agent log `name` of `run` (`<run>/episodes/<name>`), refused unless `name`
/// is a plain file name of letters, digits, `.`, `_` and `-` that does not start with
/// a dot.
pub fn log_path(run: &RunRef, name: &str) -> Result<PathBuf, LogRefusal> {
    let plain = !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !plain || run.kind != RunKind::Episodes {
        return Err(if plain {
            LogRefusal::Missing
        } else {
            LogRefusal::BadName
        });
    }
    let p = run.dir.join("episodes").join(name);
    match std::fs::symlink_metadata(&p) {
        Ok(m) if m.is_file() => Ok(p),
        _ => Err(LogRefusal::Missing),
    }
}

/// The last `max_bytes` of a file, as text.
pub fn tail_text(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(max_bytes)))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// The curves of a training run: (file stem, title, the metrics.jsonl field).
pub const TRAIN_CURVES: &[(&str, &str, &str)] = &[
    ("reward", "mean reward", "reward_mean"),
    ("accuracy", "held-out accuracy", "accuracy"),
    ("loss", "loss", "loss"),
    ("kl", "KL to the reference", "kl"),
    (
        "entropy",
        "entropy of the trained tokens (nats/token)",
        "entropy",
    ),
    ("clip_frac", "clip fraction", "clip_frac"),
    ("grad_norm", "gradient norm", "grad_norm"),
    ("tokens_per_s", "trained tokens per second", "tokens_per_s"),
    (
        "skipped_groups",
        "groups skipped (all rewards equal)",
        "skipped_groups",
    ),
];

/// A client run's curves, by episode in order of ending: mean reward over a window, per
/// model, and the agent's seconds per episode; and episodes ended per minute.
fn episode_series(lines: &[Value]) -> Vec<(&'static str, String, Vec<Series>)> {
    let mut rewards: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut seconds = Vec::new();
    let mut ends = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if l["status"] == "finished" {
            if let Some(r) = l["reward"].as_f64() {
                rewards.entry("reward".into()).or_default().push(r);
            }
            if let Some(m) = l["rewards"].as_object() {
                for (k, v) in m {
                    if let Some(r) = v.as_f64() {
                        rewards.entry(k.clone()).or_default().push(r);
                    }
                }
            }
        }
        if let Some(s) = l["seconds"].as_f64() {
            seconds.push((i as f64 + 1.0, s));
        }
        if let Some(t) = l["ended_unix_ms"].as_f64() {
            ends.push(t);
        }
    }
    let window = 16;
    let reward: Vec<Series> = rewards
        .into_iter()
        .map(|(name, v)| Series {
            name: format!("{name} (mean of last {window})"),
            points: (0..v.len())
                .map(|i| {
                    let w = &v[(i + 1).saturating_sub(window)..=i];
                    (i as f64 + 1.0, w.iter().sum::<f64>() / w.len() as f64)
                })
                .collect(),
        })
        .collect();
    let mut per_minute = Vec::new();
    if let Some(&t0) = ends.iter().min_by(|a, b| a.total_cmp(b)) {
        let mut bins: BTreeMap<u64, f64> = BTreeMap::new();
        for t in &ends {
            *bins.entry(((t - t0) / 60_000.0) as u64).or_default() += 1.0;
        }
        let last = bins.keys().last().copied().unwrap_or(0);
        per_minute = (0..=last)
            .map(|m| (m as f64 + 1.0, bins.get(&m).copied().unwrap_or(0.0)))
            .collect();
    }
    vec![
        (
            "reward",
            "episode reward, by order of ending".into(),
            reward,
        ),
        (
            "episode_seconds",
            "seconds per episode, by order of ending".into(),
            vec![Series {
                name: "seconds".into(),
                points: seconds,
            }],
        ),
        (
            "episodes_per_minute",
            "episodes ended per minute of the run".into(),
            vec![Series {
                name: "episodes".into(),
                points: per_minute,
            }],
        ),
    ]
}

/// Writes `<run>/plots/<curve>.svg` for every curve of the run's points file (a curve
/// with no point is left out); returns the files written.
pub fn write_plots(run: &RunRef) -> std::io::Result<Vec<PathBuf>> {
    let lines = read_lines(&run.points_path(), 0, 64 << 20)?.points;
    let plots: Vec<(&str, String, String, Vec<Series>)> = match run.kind {
        RunKind::Train => TRAIN_CURVES
            .iter()
            .map(|(stem, title, field)| {
                let points: Vec<(f64, f64)> = lines
                    .iter()
                    .filter_map(|l| Some((l["step"].as_f64()?, l[*field].as_f64()?)))
                    .collect();
                (
                    *stem,
                    title.to_string(),
                    "step".to_string(),
                    vec![Series {
                        name: field.to_string(),
                        points,
                    }],
                )
            })
            .collect(),
        RunKind::Episodes => episode_series(&lines)
            .into_iter()
            .map(|(stem, title, s)| {
                let x = if stem == "episodes_per_minute" {
                    "minute"
                } else {
                    "episode"
                };
                (stem, title, x.to_string(), s)
            })
            .collect(),
    };
    let dir = run.dir.join("plots");
    std::fs::create_dir_all(&dir)?;
    let mut written = Vec::new();
    for (stem, title, xlabel, series) in plots {
        if series.iter().all(|s| s.points.is_empty()) {
            continue;
        }
        let path = dir.join(format!("{stem}.svg"));
        let svg = svg_plot(&format!("{}: {title}", run.name), &xlabel, "", &series);
        crate::base::files::write_atomic(&path, svg.as_bytes())?;
        written.push(path);
    }
    Ok(written)
}

/// A run in brief: its last line's figures (training) or its episode counts (client).
pub fn summary(run: &RunRef) -> Value {
    let lines = read_lines(&run.points_path(), 0, 16 << 20)
        .map(|l| l.points)
        .unwrap_or_default();
    let updated = std::fs::metadata(run.points_path())
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs());
    let last = lines.last().cloned().unwrap_or(Value::Null);
    match run.kind {
        RunKind::Train => json!({
            "run": run.name, "kind": run.kind, "updated_unix": updated,
            "steps": last["step"], "version": last["version"],
            "reward_mean": last["reward_mean"], "loss": last["loss"],
            "entropy": last["entropy"], "kl": last["kl"],
            "accuracy": lines.iter().rev().find_map(|l| l["accuracy"].as_f64()),
        }),
        RunKind::Episodes => {
            let aborted = lines.iter().filter(|l| l["status"] == "aborted").count();
            let rewards: Vec<f64> = lines
                .iter()
                .rev()
                .filter(|l| l["status"] == "finished")
                .filter_map(|l| l["reward"].as_f64())
                .take(32)
                .collect();
            json!({
                "run": run.name, "kind": run.kind, "updated_unix": updated,
                "episodes": lines.len(), "aborted": aborted,
                "reward_recent": (!rewards.is_empty())
                    .then(|| rewards.iter().sum::<f64>() / rewards.len() as f64),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_with(lines: &str, kind: RunKind) -> (tempfile::TempDir, RunRef) {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("runs").join("m1");
        std::fs::create_dir_all(dir.join("episodes")).unwrap();
        std::fs::write(dir.join(kind.points_file()), lines).unwrap();
        (d, RunRef::new(&dir, kind))
    }

    #[test]
    fn lines_are_read_whole_from_an_offset_and_a_cut_back_file_starts_over() {
        let (_d, run) = run_with("{\"step\":1}\n{\"step\":2}\n{\"step\":", RunKind::Train);
        let a = read_lines(&run.points_path(), 0, 1 << 20).unwrap();
        assert_eq!(a.points.len(), 2, "the half-written line waits");
        assert!(!a.reset);
        std::fs::write(
            run.points_path(),
            "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n",
        )
        .unwrap();
        let b = read_lines(&run.points_path(), a.next, 1 << 20).unwrap();
        assert_eq!(b.points, vec![json!({"step": 3})]);
        std::fs::write(run.points_path(), "{\"step\":1}\n").unwrap();
        let c = read_lines(&run.points_path(), b.next, 1 << 20).unwrap();
        assert!(c.reset);
        assert_eq!(c.points, vec![json!({"step": 1})]);
        // A first read of a long file: its tail, from a line start.
        let long: String = (0..1000).map(|i| format!("{{\"step\":{i}}}\n")).collect();
        std::fs::write(run.points_path(), &long).unwrap();
        let t = read_lines(&run.points_path(), 0, 100).unwrap();
        assert!(!t.points.is_empty() && t.points.len() < 10);
        assert_eq!(t.points.last().unwrap()["step"], 999);
        assert_eq!(t.next, long.len() as u64);
    }

    #[test]
    fn only_plain_names_of_existing_logs_are_served() {
        let (_d, run) = run_with("", RunKind::Episodes);
        std::fs::write(run.dir.join("episodes/r1-g0-e0.stdout"), "hi").unwrap();
        std::fs::write(run.dir.join("secret"), "no").unwrap();
        assert!(log_path(&run, "r1-g0-e0.stdout").is_ok());
        for bad in ["../secret", "..", ".hidden", "a/b", "", "a\\b", "%2e%2e"] {
            assert_eq!(log_path(&run, bad), Err(LogRefusal::BadName), "{bad}");
        }
        assert_eq!(log_path(&run, "nope.stdout"), Err(LogRefusal::Missing));
    }

    #[test]
    fn every_curve_with_points_gets_a_plot() {
        let (d, run) = run_with(
            "{\"step\":1,\"reward_mean\":0.5,\"loss\":-0.1,\"kl\":null}\n{\"step\":2,\"reward_mean\":0.75,\"loss\":0.2,\"kl\":null}\n",
            RunKind::Train,
        );
        let written = write_plots(&run).unwrap();
        let names: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["reward.svg", "loss.svg"]);
        let svg = std::fs::read_to_string(&written[0]).unwrap();
        assert_eq!(svg.matches("<circle").count(), 2);
        assert_eq!(summary(&run)["steps"], 2);
        assert_eq!(scan(d.path()).len(), 1);
    }
}
