//! The walls of the house, checked: every `crate::` path in `src/` against the layer table
//! of docs/ARCHITECTURE.md (a module may use only modules of lower layers), no circle
//! between files ([`circles`]), and every link of README.md and docs/ against the
//! repository (none may point outside it).

mod circles;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The layer table: module name → layer (0 = bottom), from the ```layers block.
fn layers(architecture: &str) -> BTreeMap<String, usize> {
    let block = architecture
        .split("```layers")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("docs/ARCHITECTURE.md has a ```layers block");
    let rows: Vec<&str> = block.lines().filter(|l| l.contains(':')).collect();
    let n = rows.len();
    let mut out = BTreeMap::new();
    for (i, row) in rows.iter().enumerate() {
        let (_, mods) = row.split_once(':').unwrap();
        for m in mods.split_whitespace() {
            assert!(
                out.insert(m.to_string(), n - 1 - i).is_none(),
                "{m} is in two layers"
            );
        }
    }
    out
}

/// The source with comments, string and char literals blanked out.
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            }
            b'r' if b.get(i + 1) == Some(&b'#') || b.get(i + 1) == Some(&b'"') => {
                // A raw string r"..." / r#"..."#.
                let mut j = i + 1;
                let mut hashes = 0;
                while b.get(j) == Some(&b'#') {
                    hashes += 1;
                    j += 1;
                }
                if b.get(j) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                j += 1;
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                while j < b.len() && !b[j..].starts_with(&close) {
                    j += 1;
                }
                i = j + close.len();
                out.push_str("\"\"");
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    if b[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
                out.push_str("\"\"");
            }
            b'\'' => {
                // A char literal ('a', '\n', '\u{..}') or a lifetime ('a): skip only
                // the former.
                let rest = &src[i..];
                let lit = match rest.strip_prefix("'\\") {
                    Some(esc) => esc.find('\'').map(|e| e + 3),
                    None => rest
                        .char_indices()
                        .nth(2)
                        .filter(|(_, c)| *c == '\'')
                        .map(|(k, _)| k + 1),
                };
                match lit {
                    Some(len) => {
                        out.push_str("' '");
                        i += len;
                    }
                    None => {
                        out.push('\'');
                        i += 1;
                    }
                }
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The top-level modules a file's code names through `crate::` (with the line of each).
fn crate_uses(src: &str) -> Vec<(String, usize)> {
    let code = code_only(src);
    let mut out = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let mut rest = line;
        while let Some(p) = rest.find("crate::") {
            let before = rest[..p].chars().last();
            rest = &rest[p + "crate::".len()..];
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue; // `$crate::` or a longer identifier
            }
            if let Some(group) = rest.strip_prefix('{') {
                // `crate::{a::X, b}`: each entry's first name, at the top level only.
                let mut depth = 0;
                let mut entry_start = true;
                for (k, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => entry_start = true,
                        c if entry_start && !c.is_whitespace() => {
                            entry_start = false;
                            let name = ident(&group[k..]);
                            if !name.is_empty() {
                                out.push((name, n + 1));
                            }
                        }
                        _ => {}
                    }
                }
            } else {
                let name = ident(rest);
                if !name.is_empty() {
                    out.push((name, n + 1));
                }
            }
        }
    }
    out
}

/// The layer violations of one file of module `module` (`file` only names it).
fn violations(table: &BTreeMap<String, usize>, module: &str, file: &str, src: &str) -> Vec<String> {
    let Some(&mine) = table.get(module) else {
        return vec![format!(
            "{file}: module `{module}` is not in the layer table of docs/ARCHITECTURE.md"
        )];
    };
    crate_uses(src)
        .into_iter()
        .filter_map(|(used, line)| {
            if used == module {
                return None;
            }
            match table.get(&used) {
                None => Some(format!(
                    "{file}:{line}: `crate::{used}` is not in the layer table"
                )),
                Some(&theirs) if theirs >= mine => Some(format!(
                    "{file}:{line}: `{module}` (layer {mine}) uses `crate::{used}` (layer \
                     {theirs}): arrows point down, to lower layers only"
                )),
                Some(_) => None,
            }
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_module_uses_only_lower_layers() {
    let table = layers(&std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).unwrap());
    let src = root().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut problems = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        // The binary is above every layer; lib.rs only declares the modules.
        if first == "bin" || first == "lib.rs" {
            continue;
        }
        let module = first.trim_end_matches(".rs").to_string();
        seen.insert(module.clone());
        let text = std::fs::read_to_string(f).unwrap();
        problems.extend(violations(
            &table,
            &module,
            &rel.display().to_string(),
            &text,
        ));
    }
    for m in table.keys() {
        if !seen.contains(m) {
            problems.push(format!(
                "the layer table names `{m}`, which is not a module of src/"
            ));
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
    assert!(seen.len() >= 10, "only {} modules found", seen.len());
}

#[test]
fn an_upward_import_fails_the_check() {
    let table = layers(&std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).unwrap());
    // A deliberate upward import (the model layer reaching for a role), in each form.
    for src in [
        "use crate::server::ServedModel;\n",
        "use crate::{base::lock, client::Client};\n",
        "fn f() { let _ = crate::facade::server::router; }\n",
    ] {
        let v = violations(&table, "model", "src/model/fake.rs", src);
        assert_eq!(v.len(), 1, "{src:?} gave {v:?}");
        assert!(v[0].contains("arrows point down"), "{v:?}");
    }
    // The swarm may not name what it carries: a same-layer or upward import fails too.
    let v = violations(
        &table,
        "swarm",
        "src/swarm/x.rs",
        "use crate::model::ModelCard;",
    );
    assert_eq!(v.len(), 1, "{v:?}");
    let v = violations(
        &table,
        "swarm",
        "src/swarm/x.rs",
        "use crate::timeline::Call;",
    );
    assert_eq!(v.len(), 1, "{v:?}");
    // Downward imports, own-module paths, comments and strings are fine.
    let ok = "use crate::base::Rng; // crate::server is above\n\
              use crate::model::{ModelCard, TokenBytes};\n\
              const S: &str = \"crate::client\";\n\
              /* crate::facade */ fn f() -> crate::engine::EngineError { todo!() }\n";
    assert_eq!(
        violations(&table, "facade", "src/facade/x.rs", ok),
        Vec::<String>::new()
    );
    // A module missing from the table fails.
    assert_eq!(
        violations(&table, "newthing", "src/newthing/mod.rs", "").len(),
        1
    );
}

/// Every markdown link target and every `../` path in `file` (relative to its folder)
/// that leaves the repository or does not exist.
fn bad_links(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap();
    let dir = file.parent().unwrap();
    let repo = root().canonicalize().unwrap();
    let mut out = Vec::new();
    let mut targets: Vec<String> = Vec::new();
    let mut rest = text.as_str();
    while let Some(p) = rest.find("](") {
        rest = &rest[p + 2..];
        if let Some(end) = rest.find(')') {
            targets.push(rest[..end].to_string());
        }
    }
    for word in text.split(|c: char| c.is_whitespace() || "`'\"(),".contains(c)) {
        if word.starts_with("../") {
            targets.push(word.to_string());
        }
    }
    targets.sort();
    targets.dedup();
    for t in targets {
        let path = t.split('#').next().unwrap_or("");
        if path.is_empty() {
            continue; // an anchor on the same page
        }
        if path.contains("://") || path.starts_with("mailto:") {
            out.push(format!(
                "{}: {t} points outside the repository",
                file.display()
            ));
            continue;
        }
        match dir.join(path).canonicalize() {
            Ok(p) if p.starts_with(&repo) => {}
            Ok(_) => out.push(format!(
                "{}: {t} points outside the repository",
                file.display()
            )),
            Err(_) => out.push(format!("{}: {t} does not exist", file.display())),
        }
    }
    out
}

#[test]
fn readme_and_docs_link_only_inside_the_repository() {
    let mut files = vec![root().join("README.md")];
    for e in std::fs::read_dir(root().join("docs")).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "md") {
            files.push(e.path());
        }
    }
    let problems: Vec<String> = files.iter().flat_map(|f| bad_links(f)).collect();
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
    // The check itself: a link out of the repository is caught.
    let tmp = root().join("target").join("layering-link-check.md");
    std::fs::create_dir_all(tmp.parent().unwrap()).unwrap();
    std::fs::write(
        &tmp,
        "See [the plan](../../shared/DESIGN.md) and `../../x`.\n",
    )
    .unwrap();
    let caught = bad_links(&tmp);
    let _ = std::fs::remove_file(&tmp);
    assert_eq!(caught.len(), 2, "{caught:?}");
}
