//! File names and writes that a kill, or a power cut, cannot tear or lose.
//!
//! Owns: turning names into file-name components, and the durable-write idioms (write a
//! fresh temporary file, sync it, rename it over the target, sync the directory; append
//! and sync). What these return `Ok` for is on disk: a caller may acknowledge it. Never
//! decides where a file goes (the caller does).

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// `name` as one file-name component: ASCII letters, digits, `-`, `_` and `.` kept, any
/// other character `_` (model names and episode ids become directory and file names). The
/// empty name and names of dots only (`.`, `..`), which would name the directory itself or
/// its parent, get a leading `_`.
pub fn safe_file_name(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.chars().all(|c| c == '.') {
        format!("_{s}")
    } else {
        s
    }
}

/// Writes `bytes` to `path` so that a reader (or a restart after a kill or a power cut)
/// sees the old file or the whole new one, never a part, and so that the new one is on
/// disk when this returns: a sibling temporary file of its own (no two writers share one)
/// is written and synced, renamed over `path`, and the directory is synced.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    replace(path, bytes, false)
}

/// [`write_atomic`] for a secret (a key): the file is created readable and writable by
/// its owner only (0600 on Unix) before a byte is written, so no other user can ever read
/// it, not even for a moment.
pub fn write_secret(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    replace(path, bytes, true)
}

fn replace(path: &Path, bytes: &[u8], secret: bool) -> std::io::Result<()> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    // A file of this name is a leftover of a killed process that had this pid (no live
    // process makes this name but this one): stale.
    let _ = std::fs::remove_file(&tmp);
    let written = (|| {
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        if secret {
            std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
        }
        #[cfg(not(unix))]
        let _ = secret;
        let mut f = o.open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    sync_parent(path)
}

/// Appends `bytes` (whole lines) to the file of lines `path` (created when missing) and
/// syncs it before returning; a new file's directory entry is synced too. A kill
/// mid-append can leave a torn last line (no newline): readers ignore it, and the next
/// append cuts it first, so it is never glued to a new line.
pub fn append_durable(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let existed = path.exists();
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)?;
    let len = f.metadata()?.len();
    if len > 0 {
        let mut last = [0u8; 1];
        f.seek(SeekFrom::End(-1))?;
        f.read_exact(&mut last)?;
        if last[0] != b'\n' {
            let mut all = Vec::new();
            f.seek(SeekFrom::Start(0))?;
            f.read_to_end(&mut all)?;
            let keep = all.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            f.set_len(keep as u64)?;
        }
    }
    f.write_all(bytes)?;
    f.sync_data()?;
    if !existed {
        sync_parent(path)?;
    }
    Ok(())
}

/// The whole lines of the text of a file of lines: all up to its last newline. What
/// follows it is a torn last line (a kill mid-append), which readers ignore.
pub fn whole_lines(text: &str) -> &str {
    &text[..text.rfind('\n').map_or(0, |i| i + 1)]
}

/// Syncs a directory, so that the entries created, renamed or removed in it survive a
/// power cut.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Syncs every file and directory under `dir` (itself included), deepest first: a tree
/// written with plain writes is then on disk, ready to be renamed into place.
pub fn sync_tree(dir: &Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let ty = e.file_type()?;
        if ty.is_dir() {
            sync_tree(&e.path())?;
        } else if ty.is_file() {
            std::fs::File::open(e.path())?.sync_all()?;
        }
    }
    sync_dir(dir)
}

/// Syncs the directory holding `path`.
fn sync_parent(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => sync_dir(p),
        _ => sync_dir(Path::new(".")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_dots_or_nothing_never_name_a_directory_itself() {
        assert_eq!(safe_file_name(""), "_");
        assert_eq!(safe_file_name("."), "_.");
        assert_eq!(safe_file_name(".."), "_..");
        assert_eq!(safe_file_name("../etc/passwd"), ".._etc_passwd");
        assert_eq!(safe_file_name("a b\nc"), "a_b_c");
        assert_eq!(safe_file_name("SmolLM2-135M.v1"), "SmolLM2-135M.v1");
    }

    #[test]
    fn atomic_writes_replace_whole_files_and_leave_no_temporary_behind() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two, longer").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two, longer");
        append_durable(&dir.path().join("log"), b"a\n").unwrap();
        append_durable(&dir.path().join("log"), b"b\n").unwrap();
        assert_eq!(std::fs::read(dir.path().join("log")).unwrap(), b"a\nb\n");
        // A torn last line (a kill mid-append) is cut before the next line goes on.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.path().join("log"))
            .unwrap();
        f.write_all(b"tor").unwrap();
        drop(f);
        append_durable(&dir.path().join("log"), b"c\n").unwrap();
        assert_eq!(std::fs::read(dir.path().join("log")).unwrap(), b"a\nb\nc\n");
        assert_eq!(whole_lines("a\nb\ntor"), "a\nb\n");
        assert_eq!(whole_lines("tor"), "");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        // A write into a directory that is gone fails and leaves nothing.
        assert!(write_atomic(&dir.path().join("no/such/f"), b"x").is_err());
        sync_tree(dir.path()).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn secrets_are_readable_by_their_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("run.key");
        write_secret(&p, b"k").unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(std::fs::read(&p).unwrap(), b"k");
    }
}
