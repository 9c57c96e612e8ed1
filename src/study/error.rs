//! What can go wrong in a study: a bad study file (the field named), a file of the study
//! directory, an arm's processes.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum StudyError {
    /// The study file is not valid TOML.
    #[error("{file}: {msg}")]
    Syntax { file: PathBuf, msg: String },
    /// A field of the study file is missing, of the wrong type or out of range.
    #[error("{file}: {field}: {msg}")]
    Field {
        file: PathBuf,
        field: String,
        msg: String,
    },
    #[error("{path}: {msg}")]
    Io { path: PathBuf, msg: String },
    /// The journal does not belong to this study file, or cannot be read back.
    #[error("journal {path}: {msg}")]
    Journal { path: PathBuf, msg: String },
    /// An arm's server or client could not be started.
    #[error("arm {arm}: {msg}")]
    Launch { arm: String, msg: String },
    /// The researcher's model could not be reached or set up.
    #[error("the researcher: {0}")]
    Researcher(String),
}

impl StudyError {
    pub fn io(path: &Path, e: impl std::fmt::Display) -> StudyError {
        StudyError::Io {
            path: path.to_path_buf(),
            msg: e.to_string(),
        }
    }

    pub fn field(file: &Path, field: impl Into<String>, msg: impl Into<String>) -> StudyError {
        StudyError::Field {
            file: file.to_path_buf(),
            field: field.into(),
            msg: msg.into(),
        }
    }
}
