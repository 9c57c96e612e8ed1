//! How a member loop trains: the mode (synchronous or DiLoCo) and the step's settings.

use std::time::Duration;

use crate::collective::Wire;

/// How the group trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// A step: every member's gradient summed, every member applies the sum.
    Sync,
    /// DiLoCo: `every` inner steps alone, then an outer step on the summed deltas.
    Diloco { every: u64 },
}

impl Mode {
    /// As the swarm's status names it (`sync`, `diloco/H`): members of another mode are
    /// another group.
    pub fn name(&self) -> String {
        match self {
            Mode::Sync => "sync".into(),
            Mode::Diloco { every } => format!("diloco/{every}"),
        }
    }

    /// Steps per group step: 1, or DiLoCo's inner steps per outer step.
    pub fn every(&self) -> u64 {
        match self {
            Mode::Sync => 1,
            Mode::Diloco { every } => (*every).max(1),
        }
    }
}

/// `sync` or `diloco/H` (H at least 1).
impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        if s == "sync" {
            return Ok(Mode::Sync);
        }
        match s.strip_prefix("diloco/").map(str::parse::<u64>) {
            Some(Ok(every)) if every >= 1 => Ok(Mode::Diloco { every }),
            _ => Err(format!(
                "{s:?}: expected sync or diloco/H with H at least 1"
            )),
        }
    }
}

/// What the loop needs beyond the group's own config (round timeout and heartbeat live in
/// [`crate::collective::group::GroupConfig`]).
#[derive(Debug, Clone)]
pub struct LoopConfig {
    pub mode: Mode,
    /// Ready groups, summed over the ring, that a synchronous step needs; the groups at
    /// hand an inner step needs (DiLoCo).
    pub groups_per_step: usize,
    /// How the values (gradients, deltas) travel.
    pub wire: Wire,
    /// The members compare parameter hashes every this many group steps (0: never).
    pub hash_every: u64,
    /// Tests only: hold every value round this long between its reduce-scatter and its
    /// all-gather (to kill a member mid-round).
    pub midway_pause: Option<Duration>,
    /// Tests only: from this group step on, this member sends NaN values in every value
    /// round, past its own finiteness check (a rogue member, for the rogue-peer harness).
    pub send_nan_from: Option<u64>,
}

impl Default for LoopConfig {
    fn default() -> Self {
        LoopConfig {
            mode: Mode::Sync,
            groups_per_step: 1,
            wire: Wire::F32,
            hash_every: 10,
            midway_pause: None,
            send_nan_from: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_round_trip_through_their_names_and_bad_ones_say_why() {
        for m in [
            Mode::Sync,
            Mode::Diloco { every: 1 },
            Mode::Diloco { every: 32 },
        ] {
            assert_eq!(m.name().parse::<Mode>(), Ok(m));
        }
        for bad in ["", "diloco/0", "diloco/x", "Sync", "diloco"] {
            let e = bad.parse::<Mode>().unwrap_err();
            assert!(e.contains("expected sync or diloco/H"), "{bad}: {e}");
        }
        assert_eq!(Mode::Diloco { every: 0 }.every(), 1);
    }
}
