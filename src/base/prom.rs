//! Prometheus text exposition (format 0.0.4), written one metric family at a time: a
//! family's `# HELP` and `# TYPE` once, then its samples, label values escaped. Families
//! are kept in order of first use, so two models' samples of one family stay together
//! (a scraper rejects a family declared twice).

use std::collections::BTreeMap;

/// A metric family's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

#[derive(Debug, Default)]
struct Family {
    help: String,
    kind: Option<Kind>,
    samples: Vec<String>,
}

/// A page of metrics under construction.
#[derive(Debug, Default)]
pub struct Prom {
    order: Vec<String>,
    families: BTreeMap<String, Family>,
}

/// A label value as the text format wants it: backslash, quote and newline escaped.
pub fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A sample value as the text format writes it (`NaN`, `+Inf`, `-Inf` included).
fn value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}

impl Prom {
    pub fn new() -> Prom {
        Prom::default()
    }

    /// One sample of family `name` (declared with `help` and `kind` on first use).
    pub fn sample(&mut self, name: &str, kind: Kind, help: &str, labels: &[(&str, &str)], v: f64) {
        if !self.families.contains_key(name) {
            self.order.push(name.to_string());
        }
        let f = self.families.entry(name.to_string()).or_default();
        if f.kind.is_none() {
            f.kind = Some(kind);
            f.help = help.replace('\n', " ");
        }
        let labels = if labels.is_empty() {
            String::new()
        } else {
            let l: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
                .collect();
            format!("{{{}}}", l.join(","))
        };
        f.samples.push(format!("{name}{labels} {}", value(v)));
    }

    pub fn counter(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: f64) {
        self.sample(name, Kind::Counter, help, labels, v);
    }

    pub fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, &str)], v: f64) {
        self.sample(name, Kind::Gauge, help, labels, v);
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for name in &self.order {
            let f = &self.families[name];
            let kind = match f.kind {
                Some(Kind::Counter) => "counter",
                _ => "gauge",
            };
            out.push_str(&format!("# HELP {name} {}\n# TYPE {name} {kind}\n", f.help));
            for s in &f.samples {
                out.push_str(s);
                out.push('\n');
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_family_is_declared_once_with_its_samples_together_and_labels_escaped() {
        let mut p = Prom::new();
        p.gauge("a_version", "policy version", &[("model", "m\"1")], 3.0);
        p.counter("b_total", "things", &[], 7.0);
        p.gauge(
            "a_version",
            "policy version",
            &[("model", "m2\\x")],
            f64::NAN,
        );
        let t = p.render();
        assert_eq!(t.matches("# TYPE a_version gauge").count(), 1);
        assert_eq!(
            t,
            "# HELP a_version policy version\n# TYPE a_version gauge\n\
             a_version{model=\"m\\\"1\"} 3\na_version{model=\"m2\\\\x\"} NaN\n\
             # HELP b_total things\n# TYPE b_total counter\nb_total 7\n"
        );
    }
}
