//! A study's arms (its explicit list, its space's grid, or draws from its space with the
//! study's seed: the same file gives the same arms) and each arm's command lines.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::spec::{Param, Range, Study, Target};
use crate::base::Rng;

/// One configuration the study runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Arm {
    pub id: usize,
    pub name: String,
    /// A value of every parameter of the study's space.
    pub values: BTreeMap<String, Value>,
}

/// What an arm's processes get beyond what the driver sets: the servers' and the
/// client's flags and the agent's environment.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ArmArgs {
    pub server: Vec<String>,
    pub client: Vec<String>,
    pub env: BTreeMap<String, String>,
}

/// The study's arms, in a fixed order (their ids). A researcher's study starts with its
/// explicit arms alone (none when it lists none): the researcher starts the rest.
pub fn arms(study: &Study) -> Vec<Arm> {
    let researcher = matches!(study.policy, super::spec::PolicyKind::Researcher(_));
    let values: Vec<BTreeMap<String, Value>> = if !study.arms.is_empty() || researcher {
        study.arms.iter().map(|a| a.values.clone()).collect()
    } else if let Some(n) = study.samples {
        let mut rng = Rng::seeded(study.seed);
        (0..n).map(|_| draw(&study.space, &mut rng)).collect()
    } else {
        grid(&study.space)
    };
    values
        .into_iter()
        .enumerate()
        .map(|(id, values)| {
            let name = study
                .arms
                .get(id)
                .and_then(|a| a.name.clone())
                .unwrap_or_else(|| default_name(&values));
            Arm { id, name, values }
        })
        .collect()
}

/// `lr=2e-5 temp=0.7` (`base` for an arm of no parameters).
pub(super) fn default_name(values: &BTreeMap<String, Value>) -> String {
    if values.is_empty() {
        return "base".into();
    }
    values
        .iter()
        .map(|(k, v)| format!("{k}={}", render(v)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Every combination of the parameters' values, the last parameter (by name) changing
/// fastest.
fn grid(space: &[Param]) -> Vec<BTreeMap<String, Value>> {
    let mut out = vec![BTreeMap::new()];
    for p in space {
        let vs = p.values.clone().unwrap_or_default();
        out = out
            .into_iter()
            .flat_map(|m| {
                vs.iter().map(move |v| {
                    let mut m = m.clone();
                    m.insert(p.name.clone(), v.clone());
                    m
                })
            })
            .collect();
    }
    out
}

fn draw(space: &[Param], rng: &mut Rng) -> BTreeMap<String, Value> {
    space
        .iter()
        .map(|p| (p.name.clone(), draw_one(p, rng)))
        .collect()
}

/// A value of `p` drawn with `rng`.
pub(super) fn draw_one(p: &Param, rng: &mut Rng) -> Value {
    match (&p.values, &p.range) {
        (Some(vs), _) if !vs.is_empty() => vs[(rng.next_u64() % vs.len() as u64) as usize].clone(),
        (_, Some(r)) => sample(r, rng.next_f64()),
        _ => Value::Null,
    }
}

/// A value of `r` at `u` in [0, 1): log-uniform or uniform, rounded to 4 significant
/// digits (or to an integer).
fn sample(r: &Range, u: f64) -> Value {
    let x = if r.log {
        (r.min.ln() + u * (r.max.ln() - r.min.ln())).exp()
    } else {
        r.min + u * (r.max - r.min)
    };
    fit(r, x)
}

/// `x` as a value of `r`: an integer, or a float rounded to 4 significant digits.
pub(super) fn fit(r: &Range, x: f64) -> Value {
    if r.integer {
        return Value::from(x.round() as i64);
    }
    let x: f64 = format!("{x:.3e}").parse().unwrap_or(x);
    serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)
}

/// A value as a command line or the environment takes it (a float in its shorter form:
/// `2e-5`, `0.7`).
pub fn render(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            let (plain, sci) = (format!("{x}"), format!("{x:e}"));
            if sci.len() < plain.len() {
                sci
            } else {
                plain
            }
        }
        other => other.to_string(),
    }
}

/// The flags and environment of `arm`: the base's, then each parameter's.
pub fn arm_args(study: &Study, arm: &Arm) -> ArmArgs {
    let mut a = ArmArgs {
        server: study.base.server.clone(),
        client: study.base.client.clone(),
        env: study.base.env.clone(),
    };
    for p in &study.space {
        let Some(v) = arm.values.get(&p.name) else {
            continue;
        };
        match &p.target {
            Target::Server(f) => push_flag(&mut a.server, f, v),
            Target::Client(f) => push_flag(&mut a.client, f, v),
            Target::Env(name) => {
                a.env.insert(name.clone(), render(v));
            }
        }
    }
    a
}

/// `--flag value`; a boolean is the flag alone (true) or nothing (false).
fn push_flag(args: &mut Vec<String>, flag: &str, v: &Value) {
    match v {
        Value::Bool(true) => args.push(flag.to_string()),
        Value::Bool(false) => {}
        v => {
            args.push(flag.to_string());
            args.push(render(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const FILE: &str = r#"
name = "t"
seed = 11
policy = "grid"
[base]
model = "m"
server = ["--ppo-epochs", "2"]
client = ["--agent", "sh a.sh", "--tasks", "t.jsonl"]
env = { A = "1" }
[budget]
steps = 4
[space.lr]
server = "--learning-rate"
values = [1e-5, 2e-5]
[space.temp]
env = "AGENT_TEMPERATURE"
values = [0.7, 1.0, 1.3]
[space.warm]
server = "--rslora"
values = [true]
"#;

    #[test]
    fn a_grid_is_every_combination_and_each_arm_gets_its_flags() {
        let s = Study::parse(Path::new("s.toml"), FILE).unwrap();
        let a = arms(&s);
        assert_eq!(a.len(), 6);
        assert_eq!(a[0].name, "lr=1e-5 temp=0.7 warm=true");
        assert_eq!(a[5].name, "lr=2e-5 temp=1.3 warm=true");
        let args = arm_args(&s, &a[4]);
        assert_eq!(
            args.server,
            ["--ppo-epochs", "2", "--learning-rate", "2e-5", "--rslora"]
        );
        assert_eq!(args.client, s.base.client);
        assert_eq!(args.env["A"], "1");
        assert_eq!(args.env["AGENT_TEMPERATURE"], "1");
    }

    #[test]
    fn drawn_arms_follow_the_seed_and_stay_in_their_ranges() {
        let text = FILE
            .replace("policy = \"grid\"", "policy = \"asha\"")
            .replace(
                "values = [1e-5, 2e-5]",
                "min = 1e-6\nmax = 1e-3\nlog = true",
            )
            + "[asha]\nmin_steps = 1\nsamples = 40\n";
        let s = Study::parse(Path::new("s.toml"), &text).unwrap();
        let a = arms(&s);
        assert_eq!(a.len(), 40);
        assert_eq!(a, arms(&s), "the same seed draws the same arms");
        let lrs: Vec<f64> = a.iter().map(|x| x.values["lr"].as_f64().unwrap()).collect();
        assert!(lrs.iter().all(|&x| (1e-6..=1e-3).contains(&x)), "{lrs:?}");
        // Log-uniform: about a third in each decade.
        let low = lrs.iter().filter(|&&x| x < 1e-5).count();
        assert!((5..=22).contains(&low), "{low} of 40 below 1e-5");
        let other =
            Study::parse(Path::new("s.toml"), &text.replace("seed = 11", "seed = 12")).unwrap();
        assert_ne!(arms(&other), a, "another seed draws other arms");
    }

    #[test]
    fn explicit_arms_keep_their_names_and_order() {
        let text = FILE.to_string()
            + "[[arms]]\nname = \"slow\"\nlr = 1e-6\ntemp = 1.0\nwarm = false\n\
               [[arms]]\nlr = 1e-4\ntemp = 0.5\nwarm = true\n";
        let s = Study::parse(Path::new("s.toml"), &text).unwrap();
        let a = arms(&s);
        assert_eq!(a.len(), 2);
        assert_eq!(a[0].name, "slow");
        assert_eq!(a[1].name, "lr=1e-4 temp=0.5 warm=true");
        assert_eq!(
            arm_args(&s, &a[0]).server,
            ["--ppo-epochs", "2", "--learning-rate", "1e-6"]
        );
    }
}
