//! Circles between files: a file that uses an item of another file that uses one of its
//! own, directly or around a longer loop. Such files cannot be read, changed or tested
//! one at a time; the type they share belongs in a third file both use.
//!
//! The check follows `mod` declarations from a crate root to files (and inline `mod x {}`
//! scopes), reads every `use` tree and every path (`crate::`, `super::`, `self::`, a child
//! module, a name a `use` brought in), and resolves each to the file that *defines* the
//! item, following re-exports (`pub use node::SwarmConfig` forwards a name and makes no
//! edge of its own). Bare names count where a glob (`use super::*;`) may bring them in.
//! Test scopes (`#[cfg(test)]`, `mod tests`) are left out. Method calls are not seen:
//! an `impl` of a type split over two files is one type, not a circle. Then the graph's
//! strongly connected components of more than one file are the circles.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};

use super::code_only;

const ITEM_KW: [&str; 8] = [
    "fn", "struct", "enum", "trait", "type", "const", "static", "union",
];
const KEYWORDS: [&str; 22] = [
    "pub", "crate", "super", "self", "Self", "mod", "use", "impl", "unsafe", "async", "extern",
    "where", "for", "let", "mut", "ref", "move", "return", "if", "else", "match", "dyn",
];

fn is_keyword(t: &str) -> bool {
    ITEM_KW.contains(&t) || KEYWORDS.contains(&t) || ["while", "loop", "in", "as"].contains(&t)
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
}

/// Tokens with their line: identifiers, `::`, numbers, and single characters.
fn tokens(code: &str) -> Vec<(String, usize)> {
    let b = code.as_bytes();
    let (mut out, mut line, mut i) = (Vec::new(), 1, 0);
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_alphanumeric() || c == b'_' {
            let j = i + b[i..]
                .iter()
                .take_while(|x| x.is_ascii_alphanumeric() || **x == b'_')
                .count();
            out.push((code[i..j].to_string(), line));
            i = j;
        } else if code[i..].starts_with("::") {
            out.push(("::".into(), line));
            i += 2;
        } else {
            let ch = code[i..].chars().next().unwrap_or(' ');
            out.push((ch.to_string(), line));
            i += ch.len_utf8();
        }
    }
    out
}

type ModPath = Vec<String>;

#[derive(Debug, Clone, Copy, PartialEq)]
enum RefKind {
    Use,
    Reexport,
    Path,
    Bare,
}

/// One module: a file, or an inline `mod x { .. }` inside one.
#[derive(Debug, Default)]
struct Scope {
    path: ModPath,
    file: String,
    test: bool,
    children: BTreeMap<String, ModPath>,
    defs: BTreeSet<String>,
    uses: BTreeMap<String, Vec<String>>,
    globs: Vec<Vec<String>>,
    refs: Vec<(Vec<String>, usize, RefKind)>,
}

/// Every module scope of one crate, by module path.
struct Crate {
    scopes: BTreeMap<ModPath, Scope>,
}

/// A `use` tree from `toks[k]`: its leaves (segments, alias, glob) and the index after `;`.
fn use_tree(toks: &[(String, usize)], k: usize) -> (Vec<(Vec<String>, String, bool)>, usize) {
    fn tree(
        toks: &[(String, usize)],
        mut k: usize,
        prefix: &[String],
        leaves: &mut Vec<(Vec<String>, String, bool)>,
    ) -> usize {
        let mut segs = prefix.to_vec();
        loop {
            let t = toks[k].0.as_str();
            match t {
                "{" => {
                    k += 1;
                    while toks[k].0 != "}" && toks[k].0 != ";" {
                        k = tree(toks, k, &segs, leaves);
                        if toks[k].0 == "," {
                            k += 1;
                        }
                    }
                    return k + 1;
                }
                "*" => {
                    leaves.push((segs, "*".into(), true));
                    return k + 1;
                }
                "::" => k += 1,
                ";" | "}" | "," => return k,
                _ => {
                    segs.push(t.to_string());
                    k += 1;
                    if toks[k].0 == "::" {
                        k += 1;
                        continue;
                    }
                    let mut alias = t.to_string();
                    if toks[k].0 == "as" {
                        alias = toks[k + 1].0.clone();
                        k += 2;
                    }
                    if segs.last().is_some_and(|s| s == "self") {
                        segs.pop();
                        if alias == "self" {
                            alias = segs.last().cloned().unwrap_or_else(|| "self".into());
                        }
                    }
                    leaves.push((segs, alias, false));
                    return k;
                }
            }
        }
    }
    let mut leaves = Vec::new();
    let mut k = tree(toks, k, &[], &mut leaves);
    while toks[k].0 != ";" {
        k += 1;
    }
    (leaves, k + 1)
}

/// Parses `file` (relative to `repo`) as module `path`; queues the file modules it declares.
fn parse_file(
    repo: &Path,
    c: &mut Crate,
    file: &str,
    path: ModPath,
    test: bool,
    pending: &mut Vec<(String, ModPath, bool)>,
) {
    let text = std::fs::read_to_string(repo.join(file)).unwrap_or_default();
    let mut toks = tokens(&code_only(&text));
    toks.extend([
        (";".to_string(), 0),
        ("}".to_string(), 0),
        (";".to_string(), 0),
    ]);
    let mut stack: Vec<(ModPath, usize)> = vec![(path.clone(), 0)];
    c.scopes.insert(
        path.clone(),
        Scope {
            path,
            file: file.to_string(),
            test,
            ..Scope::default()
        },
    );
    let (mut depth, mut k) = (0usize, 0usize);
    let mut attrs: Vec<String> = Vec::new();
    while k + 3 < toks.len() {
        let (t, line) = (toks[k].0.clone(), toks[k].1);
        let (cur, base) = stack.last().cloned().unwrap_or_default();
        let prev = if k > 0 { toks[k - 1].0.as_str() } else { "" };
        if t == "#" && (toks[k + 1].0 == "[" || toks[k + 1].0 == "!") {
            let mut j = if toks[k + 1].0 == "[" { k + 1 } else { k + 2 };
            let mut d = 0;
            loop {
                match toks[j].0.as_str() {
                    "[" => d += 1,
                    "]" => {
                        d -= 1;
                        if d == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                j += 1;
                if j >= toks.len() {
                    break;
                }
            }
            attrs.extend(toks[k..=j.min(toks.len() - 1)].iter().map(|x| x.0.clone()));
            k = j + 1;
            continue;
        }
        let scope_test = c.scopes[&cur].test;
        match t.as_str() {
            "{" => {
                depth += 1;
                attrs.clear();
            }
            "}" => {
                depth = depth.saturating_sub(1);
                attrs.clear();
                if stack.len() > 1 && depth < stack[stack.len() - 1].1 {
                    stack.pop();
                }
            }
            ";" => attrs.clear(),
            "mod" if toks[k + 1].0 != "::" && is_ident(&toks[k + 1].0) => {
                let name = toks[k + 1].0.clone();
                let has = |a: &str| attrs.iter().any(|x| x == a);
                let is_test =
                    scope_test || name == "tests" || (has("cfg") && has("test") && !has("not"));
                let mut child = cur.clone();
                child.push(name.clone());
                if let Some(s) = c.scopes.get_mut(&cur) {
                    s.children.insert(name.clone(), child.clone());
                }
                if toks[k + 2].0 == "{" {
                    c.scopes.insert(
                        child.clone(),
                        Scope {
                            path: child.clone(),
                            file: file.to_string(),
                            test: is_test,
                            ..Scope::default()
                        },
                    );
                    depth += 1;
                    stack.push((child, depth));
                    attrs.clear();
                    k += 3;
                    continue;
                }
                // A file module: beside a mod.rs / lib.rs / main.rs, or in a folder named
                // after a non-mod file, below the inline modules it is declared in.
                let f = Path::new(file);
                let mut dir = f.parent().map(Path::to_path_buf).unwrap_or_default();
                let stem = f.file_stem().map(|s| s.to_string_lossy().into_owned());
                let stem = stem.unwrap_or_default();
                if !["mod", "lib", "main"].contains(&stem.as_str()) {
                    dir = dir.join(&stem);
                }
                for (inline, _) in &stack[1..] {
                    if let Some(last) = inline.last() {
                        dir = dir.join(last);
                    }
                }
                let found = [
                    dir.join(format!("{name}.rs")),
                    dir.join(&name).join("mod.rs"),
                ]
                .into_iter()
                .find(|p| repo.join(p).exists());
                if let Some(p) = found {
                    pending.push((p.to_string_lossy().into_owned(), child, is_test));
                }
                attrs.clear();
                k += 3;
                continue;
            }
            "use" if depth >= base => {
                let is_pub = prev == "pub" || prev == ")";
                let (leaves, next) = use_tree(&toks, k + 1);
                if let Some(s) = c.scopes.get_mut(&cur) {
                    for (segs, alias, glob) in leaves {
                        if glob {
                            s.globs.push(segs);
                            continue;
                        }
                        let kind = if is_pub && depth == base {
                            RefKind::Reexport
                        } else {
                            RefKind::Use
                        };
                        if depth == base {
                            s.uses.insert(alias, segs.clone());
                        }
                        s.refs.push((segs, line, kind));
                    }
                }
                attrs.clear();
                k = next;
                continue;
            }
            _ if ITEM_KW.contains(&t.as_str()) && depth == base && prev != "'" => {
                let next = &toks[k + 1].0;
                if is_ident(next) && !is_keyword(next) && next != "_" {
                    if let Some(s) = c.scopes.get_mut(&cur) {
                        s.defs.insert(next.clone());
                    }
                }
            }
            _ if is_ident(&t) && toks[k + 1].0 == "::" && prev != "::" && prev != "$" => {
                let mut segs = vec![t.clone()];
                let mut j = k + 1;
                while toks[j].0 == "::" && is_ident(&toks[j + 1].0) {
                    segs.push(toks[j + 1].0.clone());
                    j += 2;
                }
                if segs.len() > 1 {
                    if let Some(s) = c.scopes.get_mut(&cur) {
                        s.refs.push((segs, line, RefKind::Path));
                    }
                }
                k = j;
                continue;
            }
            _ if is_ident(&t)
                && !is_keyword(&t)
                && ![".", "::", "'", "$"].contains(&prev)
                && (t.starts_with(|c: char| c.is_ascii_uppercase()) || toks[k + 1].0 == "(") =>
            {
                if let Some(s) = c.scopes.get_mut(&cur) {
                    s.refs.push((vec![t.clone()], line, RefKind::Bare));
                }
            }
            _ => {}
        }
        k += 1;
    }
}

fn load(repo: &Path, root: &str) -> Crate {
    let mut c = Crate {
        scopes: BTreeMap::new(),
    };
    let mut pending = vec![(root.to_string(), Vec::new(), false)];
    while let Some((f, path, test)) = pending.pop() {
        parse_file(repo, &mut c, &f, path, test, &mut pending);
    }
    c
}

/// What a path names: an item and the file defining it, or a module (no edge).
enum Found {
    Item(String),
    Module,
}

type Seen = HashSet<(ModPath, Vec<String>)>;

fn resolve(c: &Crate, scope: &ModPath, segs: &[String], seen: &mut Seen) -> Option<Found> {
    if seen.len() > 64 {
        return None;
    }
    let Some(first) = segs.first() else {
        return Some(Found::Module);
    };
    match first.as_str() {
        "crate" => walk(c, Vec::new(), &segs[1..], seen),
        "super" => {
            let mut p = scope.clone();
            let mut rest = segs;
            while rest.first().is_some_and(|s| s == "super") {
                p.pop();
                rest = &rest[1..];
            }
            walk(c, p, rest, seen)
        }
        "self" => walk(c, scope.clone(), &segs[1..], seen),
        _ => walk(c, scope.clone(), segs, seen),
    }
}

fn walk(c: &Crate, mut at: ModPath, mut segs: &[String], seen: &mut Seen) -> Option<Found> {
    loop {
        let Some((s, rest)) = segs.split_first() else {
            return Some(Found::Module);
        };
        let sc = c.scopes.get(&at)?;
        if !seen.insert((at.clone(), segs.to_vec())) {
            return None;
        }
        if let Some(child) = sc.children.get(s) {
            at = child.clone();
            segs = rest;
            continue;
        }
        if sc.defs.contains(s) {
            return Some(Found::Item(sc.file.clone()));
        }
        if let Some(target) = sc.uses.get(s) {
            let full: Vec<String> = target.iter().chain(rest).cloned().collect();
            return resolve(c, &at, &full, seen);
        }
        for g in &sc.globs {
            let full: Vec<String> = g.iter().chain(segs).cloned().collect();
            if let Some(f) = resolve(c, &at, &full, seen) {
                return Some(f);
            }
        }
        return None;
    }
}

/// File -> file -> the items (name, line) behind the edge.
pub type Edges = BTreeMap<String, BTreeMap<String, BTreeSet<(String, usize)>>>;

/// The file graph of the crates rooted at `roots` (paths relative to `repo`).
pub fn edges(repo: &Path, roots: &[&str]) -> Edges {
    let mut out = Edges::new();
    for root in roots {
        let c = load(repo, root);
        for sc in c.scopes.values().filter(|s| !s.test) {
            for (segs, line, kind) in &sc.refs {
                if *kind == RefKind::Reexport {
                    continue;
                }
                if *kind == RefKind::Bare {
                    let n = &segs[0];
                    let local = sc.defs.contains(n)
                        || sc.uses.contains_key(n)
                        || sc.children.contains_key(n);
                    if sc.globs.is_empty() || local {
                        continue;
                    }
                }
                let mut seen = Seen::new();
                if let Some(Found::Item(file)) = resolve(&c, &sc.path, segs, &mut seen) {
                    if file != sc.file {
                        out.entry(sc.file.clone())
                            .or_default()
                            .entry(file)
                            .or_default()
                            .insert((segs.join("::"), *line));
                    }
                }
            }
        }
    }
    out
}

/// Strongly connected components of more than one file (Tarjan's), sorted.
pub fn circles(e: &Edges) -> Vec<Vec<String>> {
    struct T<'a> {
        e: &'a Edges,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        on: BTreeSet<&'a str>,
        stack: Vec<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        if let Some(next) = t.e.get(v) {
            for w in next.keys() {
                let w = w.as_str();
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let lw = t.low[w];
                    let lv = t.low[v];
                    t.low.insert(v, lv.min(lw));
                } else if t.on.contains(w) {
                    let iw = t.index[w];
                    let lv = t.low[v];
                    t.low.insert(v, lv.min(iw));
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        e,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        on: BTreeSet::new(),
        stack: Vec::new(),
        out: Vec::new(),
    };
    let nodes: BTreeSet<&str> = e
        .iter()
        .flat_map(|(a, bs)| std::iter::once(a.as_str()).chain(bs.keys().map(String::as_str)))
        .collect();
    for v in nodes {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out.sort();
    t.out
}

/// Each circle with the edges inside it, as a developer reads them.
pub fn report(e: &Edges, cs: &[Vec<String>]) -> String {
    let mut s = String::new();
    for c in cs {
        s.push_str(&format!("circle of {} files:\n", c.len()));
        for a in c {
            for (b, items) in e.get(a).into_iter().flatten() {
                if c.contains(b) {
                    let what: Vec<String> =
                        items.iter().map(|(n, l)| format!("{n} (l.{l})")).collect();
                    s.push_str(&format!("  {a} -> {b}: {}\n", what.join(", ")));
                }
            }
        }
    }
    s
}

/// The crate roots the check covers.
pub const ROOTS: [&str; 4] = [
    "src/lib.rs",
    "src/bin/agentjet-peer/main.rs",
    "netsim/src/lib.rs",
    "netsim/src/main.rs",
];

#[test]
fn no_file_of_the_workspace_is_in_a_circle() {
    let repo = super::root();
    let e = edges(&repo, &ROOTS);
    let files: BTreeSet<&String> = e.keys().chain(e.values().flat_map(|m| m.keys())).collect();
    assert!(files.len() > 100, "only {} files in the graph", files.len());
    let cs = circles(&e);
    assert!(cs.is_empty(), "\n{}", report(&e, &cs));
}

/// Writes `files` (path, text) under a fresh folder and returns it.
fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (p, text) in files {
        let p: PathBuf = dir.path().join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    dir
}

#[test]
fn the_check_finds_a_circle_through_uses_reexports_and_globs_and_nothing_else() {
    // a <-> b through `use crate::b::Bee` and `super::a::Aye`; d/mod.rs <-> d/x.rs through
    // a re-export followed to its file and a glob; comments, strings, tests and a module
    // name alone make no edge.
    let t = tree(&[
        (
            "src/lib.rs",
            "mod a;\nmod b;\nmod c;\nmod d;\npub use d::Dee;\n",
        ),
        (
            "src/a.rs",
            "use crate::b::Bee;\npub struct Aye;\nfn f(_: Bee) {}\n",
        ),
        (
            "src/b.rs",
            "pub struct Bee;\nfn g() -> super::a::Aye { super::a::Aye }\n",
        ),
        (
            "src/c.rs",
            "// crate::a::Aye in a comment\nconst S: &str = \"crate::b::Bee\";\nuse crate::b;\n\
             #[cfg(test)]\nmod tests { use crate::a::Aye; }\npub fn h() -> crate::d::Dee { todo!() }\n",
        ),
        (
            "src/d/mod.rs",
            "mod x;\npub use x::Dee;\npub struct Shared;\nfn make() -> x::Dee { todo!() }\n",
        ),
        ("src/d/x.rs", "use super::*;\npub struct Dee(Shared);\n"),
    ]);
    let e = edges(t.path(), &["src/lib.rs"]);
    let cs = circles(&e);
    assert_eq!(
        cs,
        vec![
            vec!["src/a.rs".to_string(), "src/b.rs".to_string()],
            vec!["src/d/mod.rs".to_string(), "src/d/x.rs".to_string()],
        ],
        "{e:#?}"
    );
    // c.rs names d's item through d/mod.rs's re-export: the edge goes to x.rs.
    assert!(e["src/c.rs"].contains_key("src/d/x.rs"), "{e:#?}");
    assert!(
        !e["src/c.rs"].contains_key("src/a.rs"),
        "comments and tests make no edge"
    );
    assert!(report(&e, &cs).contains("src/a.rs -> src/b.rs: crate::b::Bee (l.1)"));

    // The shared type moved to a third file: no circle left.
    let fixed = tree(&[
        ("src/lib.rs", "mod a;\nmod b;\nmod shared;\n"),
        ("src/shared.rs", "pub struct Aye;\npub struct Bee;\n"),
        (
            "src/a.rs",
            "use crate::shared::{Aye, Bee};\nfn f(_: Bee, _: Aye) {}\n",
        ),
        ("src/b.rs", "use crate::shared::Bee;\nfn g(_: Bee) {}\n"),
    ]);
    assert!(circles(&edges(fixed.path(), &["src/lib.rs"])).is_empty());
}
