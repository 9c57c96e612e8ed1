//! Task sources: JSONL files (or directories of them), one task per line:
//! `{"id": "t1", "data": <anything>, "grader": "optional command"}`. `id` is required and
//! unique within a source; `data` is handed to the agent as it is.
//!
//! Several sources mix by weight (`--tasks a.jsonl:3 --tasks b.jsonl:1`): the schedule is
//! smooth weighted round-robin, so over any stretch of groups each source's share is
//! within one group of its weight's share. Each source cycles through its tasks in file
//! order and wraps around when it runs out.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Why task sources could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("--tasks {0}: the weight must be a positive number")]
    BadWeight(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} line {line}: {problem}", path.display())]
    BadLine {
        path: PathBuf,
        line: usize,
        problem: String,
    },
    #[error("{}: no tasks", .0.display())]
    Empty(PathBuf),
    #[error("{}: task id {id:?} appears twice", path.display())]
    Duplicate { path: PathBuf, id: String },
    #[error("no task source (--tasks FILE)")]
    NoSource,
}

/// One task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    pub id: String,
    #[serde(default)]
    pub data: serde_json::Value,
    /// A grader command for this task (overrides `--grader`).
    #[serde(default)]
    pub grader: Option<String>,
}

/// One source of tasks and its weight.
#[derive(Debug, Clone)]
pub struct TaskSource {
    pub name: String,
    pub weight: f64,
    pub tasks: Vec<Task>,
}

/// Parses `PATH[:WEIGHT]` (a weight is a positive number after the last colon).
pub fn parse_spec(spec: &str) -> Result<(PathBuf, f64), TaskError> {
    if let Some((p, w)) = spec.rsplit_once(':') {
        if let Ok(w) = w.parse::<f64>() {
            if !(w.is_finite() && w > 0.0) {
                return Err(TaskError::BadWeight(spec.to_string()));
            }
            return Ok((PathBuf::from(p), w));
        }
    }
    Ok((PathBuf::from(spec), 1.0))
}

fn io(path: &Path, source: std::io::Error) -> TaskError {
    TaskError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn read_jsonl(path: &Path, out: &mut Vec<Task>) -> Result<(), TaskError> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with("//") {
            continue;
        }
        let bad = |problem: String| TaskError::BadLine {
            path: path.to_path_buf(),
            line: i + 1,
            problem,
        };
        let t: Task = serde_json::from_str(line).map_err(|e| bad(format!("not a task ({e})")))?;
        if t.id.is_empty() {
            return Err(bad("empty task id".into()));
        }
        out.push(t);
    }
    Ok(())
}

/// Loads a source: a JSONL file, or every `*.jsonl` in a directory (sorted by name).
pub fn load_source(spec: &str) -> Result<TaskSource, TaskError> {
    let (path, weight) = parse_spec(spec)?;
    let mut tasks = Vec::new();
    if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&path)
            .map_err(|e| io(&path, e))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
            .collect();
        files.sort();
        for f in files {
            read_jsonl(&f, &mut tasks)?;
        }
    } else {
        read_jsonl(&path, &mut tasks)?;
    }
    if tasks.is_empty() {
        return Err(TaskError::Empty(path));
    }
    let mut seen = std::collections::HashSet::new();
    for t in &tasks {
        if !seen.insert(t.id.as_str()) {
            return Err(TaskError::Duplicate {
                path: path.clone(),
                id: t.id.clone(),
            });
        }
    }
    Ok(TaskSource {
        name: path.display().to_string(),
        weight,
        tasks,
    })
}

/// Draws tasks from the sources in proportion to their weights.
#[derive(Debug, Clone)]
pub struct Schedule {
    sources: Vec<TaskSource>,
    credit: Vec<f64>,
    next: Vec<usize>,
}

impl Schedule {
    pub fn new(sources: Vec<TaskSource>) -> Result<Schedule, TaskError> {
        if sources.is_empty() {
            return Err(TaskError::NoSource);
        }
        let n = sources.len();
        Ok(Schedule {
            sources,
            credit: vec![0.0; n],
            next: vec![0; n],
        })
    }

    /// Tasks in all sources.
    pub fn total_tasks(&self) -> usize {
        self.sources.iter().map(|s| s.tasks.len()).sum()
    }

    pub fn sources(&self) -> &[TaskSource] {
        &self.sources
    }

    /// The next task and the index of its source (smooth weighted round-robin).
    pub fn next_task(&mut self) -> (usize, Task) {
        let total: f64 = self.sources.iter().map(|s| s.weight).sum();
        for (c, s) in self.credit.iter_mut().zip(&self.sources) {
            *c += s.weight;
        }
        let i = (0..self.sources.len())
            .max_by(|&a, &b| self.credit[a].total_cmp(&self.credit[b]).then(b.cmp(&a)))
            .expect("at least one source");
        self.credit[i] -= total;
        let src = &self.sources[i];
        let t = src.tasks[self.next[i] % src.tasks.len()].clone();
        self.next[i] += 1;
        (i, t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(name: &str, w: f64, n: usize) -> TaskSource {
        TaskSource {
            name: name.into(),
            weight: w,
            tasks: (0..n)
                .map(|i| Task {
                    id: format!("{name}{i}"),
                    data: serde_json::Value::Null,
                    grader: None,
                })
                .collect(),
        }
    }

    #[test]
    fn sources_mix_in_their_ratio_and_cycle() {
        let mut s = Schedule::new(vec![src("a", 3.0, 2), src("b", 1.0, 5)]).unwrap();
        let drawn: Vec<(usize, Task)> = (0..40).map(|_| s.next_task()).collect();
        let a = drawn.iter().filter(|d| d.0 == 0).count();
        assert_eq!(a, 30);
        // Every prefix is within one of the ratio.
        for k in 1..=40 {
            let a = drawn[..k].iter().filter(|d| d.0 == 0).count() as f64;
            assert!((a - 0.75 * k as f64).abs() <= 1.0, "prefix {k}: {a}");
        }
        // Source a cycles a0, a1, a0, ...
        let a_ids: Vec<&str> = drawn
            .iter()
            .filter(|d| d.0 == 0)
            .map(|d| d.1.id.as_str())
            .take(4)
            .collect();
        assert_eq!(a_ids, ["a0", "a1", "a0", "a1"]);
    }

    #[test]
    fn specs_and_files_are_checked() {
        assert_eq!(
            parse_spec("x/tasks.jsonl:2.5").unwrap(),
            (PathBuf::from("x/tasks.jsonl"), 2.5)
        );
        assert_eq!(
            parse_spec("t.jsonl").unwrap(),
            (PathBuf::from("t.jsonl"), 1.0)
        );
        assert!(parse_spec("t.jsonl:0").is_err());
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("t.jsonl");
        std::fs::write(
            &f,
            "{\"id\": \"1\", \"data\": {\"q\": 1}}\n\n{\"id\": \"2\"}\n",
        )
        .unwrap();
        let s = load_source(f.to_str().unwrap()).unwrap();
        assert_eq!(s.tasks.len(), 2);
        assert_eq!(s.tasks[0].data["q"], 1);
        std::fs::write(&f, "{\"id\": \"1\"}\n{\"id\": \"1\"}\n").unwrap();
        let e = load_source(f.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("appears twice"), "{e}");
        std::fs::write(&f, "{\"data\": 1}\n").unwrap();
        let e = load_source(f.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
        // A directory: every .jsonl in it.
        std::fs::write(&f, "{\"id\": \"1\"}\n").unwrap();
        std::fs::write(dir.path().join("u.jsonl"), "{\"id\": \"2\"}\n").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "x").unwrap();
        let s = load_source(dir.path().to_str().unwrap()).unwrap();
        assert_eq!(s.tasks.len(), 2);
    }
}
