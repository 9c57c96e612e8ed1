//! File names and writes that a kill cannot tear.
//!
//! Owns: turning names into file-name components and the write-then-rename idiom. Never
//! decides where a file goes (the caller does).

use std::io::Write;
use std::path::Path;

/// `name` as one file-name component: ASCII letters, digits, `-`, `_` and `.` kept, any
/// other character `_` (model names and episode ids become directory and file names).
pub fn safe_file_name(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Writes `bytes` to `path` so that a reader (or a restart after a kill) sees the old
/// file or the whole new one, never a part: a sibling `.tmp` file is written, synced, and
/// renamed over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}
