//! A bench's `--name value` flags (benches run with `harness = false` and parse their own
//! arguments).

/// The value after `name`, if given.
pub fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// `name`'s value parsed, or `default` when it is not given.
pub fn parse<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> anyhow::Result<T> {
    match flag(args, name) {
        None => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|_| anyhow::anyhow!("{name}: cannot parse {v:?}")),
    }
}
