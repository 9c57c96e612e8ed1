//! The ledger of consumed episodes in a run directory (`consumed.log`): one
//! `STEP<TAB>EPISODE ID` line per episode a step took out of the group buffer (trained,
//! skipped or dropped), appended after each step. With the checkpoint it says which stored
//! episodes a restarted server has not trained on yet.

use std::collections::HashSet;
use std::path::Path;

use tracing::warn;

use super::served::ServedModel;
use super::stored::StoredEpisode;
use crate::train::TrainError;

/// The ledger's file in a run directory.
const CONSUMED: &str = "consumed.log";

/// The ids consumed by steps `1..=step` (the checkpoint's), cutting off later lines: their
/// steps are lost with the restart, so their episodes are trained again.
pub(super) fn consumed_upto(run_dir: &Path, step: u64) -> Result<HashSet<String>, TrainError> {
    let path = run_dir.join(CONSUMED);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashSet::new()),
        Err(e) => return Err(TrainError::file(&path, e)),
    };
    let mut kept = String::new();
    let mut ids = HashSet::new();
    // A torn last line (a kill mid-append; no newline) may hold a cut-off id: dropped.
    let whole = crate::base::files::whole_lines(&text);
    let mut cut = whole.len() < text.len();
    for line in whole.lines() {
        // A torn last line (a kill mid-append) has no tab or no valid step: dropped.
        let Some((st, id)) = line.split_once('\t') else {
            cut = true;
            continue;
        };
        match st.parse::<u64>() {
            Ok(n) if n <= step => {
                ids.insert(id.to_string());
                kept.push_str(line);
                kept.push('\n');
            }
            _ => cut = true,
        }
    }
    if cut {
        crate::base::files::write_atomic(&path, kept.as_bytes())
            .map_err(|e| TrainError::file(&path, e))?;
    }
    Ok(ids)
}

/// Appends step `step`'s consumed ids and syncs them. An id with a control character (a
/// newline would forge another line) is refused: submission checks ids before they are
/// stored, so one here is a bug, not an attack to tolerate.
pub(super) fn append_consumed(run_dir: &Path, step: u64, ids: &[String]) -> Result<(), TrainError> {
    let path = run_dir.join(CONSUMED);
    if let Some(bad) = ids.iter().find(|id| !valid_episode_id(id)) {
        return Err(TrainError::file(
            &path,
            format!("episode id {bad:?} is not a valid id"),
        ));
    }
    let text: String = ids.iter().map(|id| format!("{step}\t{id}\n")).collect();
    crate::base::files::append_durable(&path, text.as_bytes())
        .map_err(|e| TrainError::file(&path, e))
}

/// What an episode id may be: 1 to 256 bytes of UTF-8 with no control character (no
/// newline, tab or NUL: ids are lines of `consumed.log` and keys of the ledger).
pub fn valid_episode_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 256 && !id.chars().any(char::is_control)
}

/// Stored episodes of `served` that the resumed trainer has not consumed, oldest first.
pub(super) fn unconsumed_episodes(
    served: &ServedModel,
    consumed: &HashSet<String>,
) -> Result<Vec<StoredEpisode>, TrainError> {
    let consumed_files: HashSet<String> = consumed
        .iter()
        .map(|id| ServedModel::episode_file_name(id))
        .collect();
    let dir = served.episodes_dir();
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir)
        .map_err(|e| TrainError::file(dir, e))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".episode") && !consumed_files.contains(&name) {
            let t = e.metadata().and_then(|m| m.modified()).ok();
            files.push((t, e.path()));
        }
    }
    files.sort();
    let mut out = Vec::new();
    for (_, p) in files {
        let b = std::fs::read(&p).map_err(|e| TrainError::file(&p, e))?;
        match StoredEpisode::decode(&b) {
            // Stored before ids were checked at submission: it could not be recorded in
            // the ledger, so it is not trained.
            Ok(ep) if !valid_episode_id(&ep.manifest.episode_id) => warn!(
                "{}: episode id {:?} has a control character; not trained",
                p.display(),
                ep.manifest.episode_id
            ),
            Ok(ep) => out.push(ep),
            Err(e) => warn!("{}: not an episode ({e}); not trained", p.display()),
        }
    }
    Ok(out)
}
