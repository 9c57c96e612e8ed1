//! What a member loop drives: a [`Learner`] (the server's trainer, netsim's stand-in).
//!
//! The loop owns the protocol (epochs, rounds, the recovery rule, state transfer); the
//! learner owns the numbers and its inputs. Only flat `f32` values, hashes and state bytes
//! cross: the loop never sees a tensor.

use std::time::Duration;

use crate::base::StopMode;
use crate::collective::RoundStats;

/// How [`Learner::feed`] waits for inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Takes inputs for the whole wait (a ring member waits a heartbeat for episodes).
    Full,
    /// Returns at the first input (a group of one starts its step at once).
    UntilInput,
}

/// One member's share of a synchronous step, summed across the ring.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Contribution {
    /// The flat, unnormalised gradient ([`Learner::values`] long).
    pub values: Vec<f32>,
    /// Its statistics' sums (the same length at every member; summed exactly in f32).
    pub stats: Vec<f32>,
}

/// Where a step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCtx {
    pub epoch: u64,
    pub members: usize,
}

/// What made the sums being applied.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Applied {
    pub members: usize,
    /// The value round (none: a group of one's own step).
    pub round: Option<RoundStats>,
}

/// What a group member trains.
///
/// Counters: in sync mode the group step is [`Learner::steps`]; in DiLoCo mode it is
/// [`Learner::version`] (outer steps), `steps` counts inner steps, and after an outer step
/// (or an import) `steps == version * H` (the loop checks it).
///
/// [`Learner::hash`] is what the group agrees on (sync: the parameters; DiLoCo: the
/// anchor, and the outer momentum where the learner keeps it in its state). It is called
/// often: cache it and recompute it on every change.
///
/// Errors are fatal (the loop leaves the group and returns them), except those of
/// [`Learner::export`] and [`Learner::import`], which fail only the epoch's state transfer.
pub trait Learner {
    /// A synchronous step computed here and not applied yet.
    type Step;
    type Error: std::fmt::Display + std::fmt::Debug;

    /// Parameter values (members of another shape are another group).
    fn values(&self) -> u64;
    fn steps(&self) -> u64;
    fn version(&self) -> u64;
    fn hash(&self) -> [u8; 32];

    /// Takes the inputs that arrived, waiting up to `wait` (zero: what is there).
    fn feed(&mut self, wait: Duration, how: Wait);
    /// Moves what became trainable to the groups at hand.
    fn take_ready(&mut self) {}
    /// Groups at hand: the heartbeat sums them, and a step needs
    /// [`super::LoopConfig::groups_per_step`].
    fn ready(&self) -> usize;
    /// The role's stop, once asked (an abort overrides a drain).
    fn stop(&self) -> Option<StopMode>;

    /// Prepares the next synchronous step on the groups at hand (possibly none: the
    /// group as a whole has enough) and computes this member's contribution.
    fn local_step(&mut self, at: StepCtx) -> Result<(Self::Step, Contribution), Self::Error>;
    /// Applies the group's sums to `step`: [`Learner::steps`] grows by one.
    fn apply(
        &mut self,
        step: Self::Step,
        sum: &[f32],
        stats: &[f32],
        by: Applied,
    ) -> Result<(), Self::Error>;
    /// A group of one's whole step (a learner whose step is several updates must do it
    /// here: there is nobody to sum with).
    fn solo_step(&mut self, at: StepCtx) -> Result<(), Self::Error> {
        let (step, c) = self.local_step(at)?;
        let by = Applied {
            members: 1,
            round: None,
        };
        self.apply(step, &c.values, &c.stats, by)
    }
    /// A step given up because this member syncs to the group's state (its inputs go back).
    fn give_back(&mut self, _step: Self::Step) {}

    /// DiLoCo: one inner step on the groups at hand (this member's own).
    fn inner_step(&mut self, at: StepCtx) -> Result<(), Self::Error>;
    /// DiLoCo: this member's flat delta from the anchor ([`Learner::values`] long).
    fn delta(&mut self) -> Result<Vec<f32>, Self::Error>;
    /// DiLoCo: the outer step on the summed deltas of `contributors` members (0 when none
    /// trained). Sets `version += 1` and `steps = version * H`.
    fn outer_step(
        &mut self,
        sum: &[f32],
        contributors: usize,
        by: Applied,
    ) -> Result<(), Self::Error>;

    /// The state a joiner installs (counters, parameters, optimizer and outer state).
    fn export(&self) -> Result<Vec<u8>, Self::Error>;
    /// Installs another member's [`Learner::export`] if it holds the group's state: step
    /// count `steps` and parameter hash `hash` (what the proposer's Start says). Anything
    /// else is refused with nothing changed: a peer that offers a poisoned state cannot
    /// reach the parameters (or the checkpoint).
    fn import(&mut self, bytes: &[u8], steps: u64, hash: &[u8; 32]) -> Result<(), Self::Error>;

    /// An epoch stands, its catch-up done.
    fn formed(&mut self, _epoch: u64, _members: usize) -> Result<(), Self::Error> {
        Ok(())
    }
    /// The loop ends at a stop (after it left the group).
    fn finish(&mut self, mode: StopMode) -> Result<(), Self::Error>;
}
