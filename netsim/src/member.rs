//! A training-group member for the simulation: the project's own group code
//! (`agentjet::collective::group::GroupNode`: ballots and epochs, heartbeat rounds, a
//! step's stats, values and commit rounds, the hash round, the recovery rule, state
//! transfer to joiners; `collective::ring` over sealed links) driven in the order
//! `agentjet::server::group_loop` drives it, with a stand-in for the trainer.
//!
//! Why a stand-in: the server's loop owns a LibTorch trainer, an engine and stored
//! episodes, which dozens of members in one two-core process cannot hold. The stand-in
//! keeps what the group sees: `values` f32 parameters, a gradient per step (drawn from the
//! member's seed and the step, so members differ) that takes `compute` to make (a sleep:
//! the GPU's time), the synchronous update (the summed gradient over the members) and
//! DiLoCo's (H plain SGD inner steps on the member's own gradients, then the summed
//! deltas and the same Nesterov outer step as `train::outer`, lr 0.7, momentum 0.9).
//! Every member always has a batch ready (the clients keep up).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentjet::base::Rng;
use agentjet::collective::group::{Action, GroupError, GroupNode, MemberState, Membership, Start};
use agentjet::collective::{BeatPacer, Wire};

/// How the group trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
}

/// A member's settings.
#[derive(Debug, Clone)]
pub struct MemberConfig {
    pub values: usize,
    pub compute: Duration,
    pub mode: Mode,
    pub wire: Wire,
    /// Every this many group steps the members compare parameter hashes (0: never).
    pub hash_every: u64,
    pub heartbeat: Duration,
    /// A round's bound (the group's): DiLoCo's heartbeat period stays under a quarter.
    pub timeout: Duration,
    pub lr: f32,
}

/// What a member did, read by the scenario while it runs.
#[derive(Debug, Default)]
pub struct Progress {
    /// Optimizer steps on this member's parameters (DiLoCo: inner steps, counted again
    /// from the outer step after a re-sync).
    pub steps: AtomicU64,
    /// Group steps (sync: steps; DiLoCo: outer steps).
    pub group_steps: AtomicU64,
    /// Bytes this member's links sent and received in value rounds.
    pub value_bytes: AtomicU64,
    /// Seconds spent in value rounds, in microseconds, and the rounds completed.
    pub value_micros: AtomicU64,
    pub value_rounds: AtomicU64,
    pub epochs: AtomicU64,
    /// Heartbeat rounds and their time, in microseconds.
    pub beats: AtomicU64,
    pub beat_micros: AtomicU64,
    /// Members of the ring it is in (0 before the first).
    pub ring_size: AtomicU64,
    pub failed_rounds: AtomicU64,
    pub syncs: AtomicU64,
    /// The member's loop ended with an error (its text is printed).
    pub failed: AtomicBool,
}

/// The trainer's stand-in: parameters, counters and (DiLoCo) the outer state.
struct Learner {
    params: Vec<f32>,
    /// DiLoCo: the parameters at the last outer step, and the outer momentum.
    anchor: Vec<f32>,
    momentum: Option<Vec<f32>>,
    steps: u64,
    /// `steps` at the anchor.
    anchor_steps: u64,
    version: u64,
    seed: u64,
}

const OUTER_LR: f32 = 0.7;
const OUTER_MOMENTUM: f32 = 0.9;

impl Learner {
    fn new(values: usize, seed: u64) -> Learner {
        // Every member starts from the same parameters (one model, one initialisation).
        let mut rng = Rng::seeded(0x5eed);
        let params: Vec<f32> = (0..values).map(|_| rng.next_f64() as f32 - 0.5).collect();
        Learner {
            anchor: params.clone(),
            params,
            momentum: None,
            steps: 0,
            anchor_steps: 0,
            version: 0,
            seed,
        }
    }

    /// This member's gradient of its next step (drawn from its seed and the step).
    fn gradient(&self, compute: Duration) -> Vec<f32> {
        let t0 = Instant::now();
        let mut rng = Rng::seeded(self.seed ^ (self.steps + 1).wrapping_mul(0x9E37_79B9));
        let g = (0..self.params.len())
            .map(|_| (rng.next_f64() as f32 - 0.5) * 1e-2)
            .collect();
        std::thread::sleep(compute.saturating_sub(t0.elapsed()));
        g
    }

    /// blake3 of what the group agrees on: the parameters at the last group step (the
    /// anchor; in sync mode the parameters themselves) and the outer momentum.
    fn hash(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        for v in self.anchor.iter().chain(self.momentum.iter().flatten()) {
            h.update(&v.to_le_bytes());
        }
        *h.finalize().as_bytes()
    }

    /// The group's state a joiner fetches: the counters at the anchor, the anchor, the
    /// momentum.
    fn state_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(17 + 8 * self.anchor.len());
        b.extend(self.anchor_steps.to_le_bytes());
        b.extend(self.version.to_le_bytes());
        b.push(self.momentum.is_some() as u8);
        for v in self.anchor.iter().chain(self.momentum.iter().flatten()) {
            b.extend(v.to_le_bytes());
        }
        b
    }

    fn install(&mut self, b: &[u8]) -> Result<(), String> {
        let n = self.params.len();
        let f32s = |at: usize| -> Vec<f32> {
            b[at..at + 4 * n]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let has_m = *b.get(16).ok_or("a state of under 17 bytes")? == 1;
        let want = 17 + 4 * n * (1 + has_m as usize);
        if b.len() != want {
            return Err(format!("a state of {} bytes, {want} expected", b.len()));
        }
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]));
        self.steps = word(0);
        self.anchor_steps = self.steps;
        self.version = word(8);
        self.params = f32s(17);
        self.anchor = self.params.clone();
        self.momentum = has_m.then(|| f32s(17 + 4 * n));
        Ok(())
    }
}

/// A member: its group node, its learner and where the round stands.
pub struct Member {
    node: GroupNode,
    cfg: MemberConfig,
    learner: Learner,
    /// Its own gradient (sync) or delta (DiLoCo) of the next group step, until applied.
    held: Option<Vec<f32>>,
    /// The group's sums of the next group step whose commit it did not see finish.
    pending: Option<(Vec<f32>, Vec<f32>)>,
    hash: [u8; 32],
    stop: Arc<AtomicBool>,
    progress: Arc<Progress>,
}

/// How a ring ended.
enum Ended {
    Dissolved,
    Failed(GroupError),
}

impl Member {
    pub fn new(
        node: GroupNode,
        cfg: MemberConfig,
        seed: u64,
        stop: Arc<AtomicBool>,
        progress: Arc<Progress>,
    ) -> Member {
        let learner = Learner::new(cfg.values, seed);
        Member {
            hash: learner.hash(),
            node,
            cfg,
            learner,
            held: None,
            pending: None,
            stop,
            progress,
        }
    }

    fn every(&self) -> u64 {
        match self.cfg.mode {
            Mode::Sync => 1,
            Mode::Diloco { every } => every.max(1),
        }
    }

    fn group_steps(&self) -> u64 {
        match self.cfg.mode {
            Mode::Sync => self.learner.steps,
            Mode::Diloco { .. } => self.learner.version,
        }
    }

    fn inner_done(&self) -> u64 {
        self.learner
            .steps
            .saturating_sub(self.learner.version * self.every())
    }

    /// The parameters the group agrees on (the members' are bit-identical at the end).
    pub fn agreed_hash(&self) -> [u8; 32] {
        self.hash
    }

    fn state(&self) -> MemberState {
        MemberState {
            steps: self.group_steps(),
            version: self.learner.version,
            hash: self.hash,
            values: self.cfg.values as u64,
            pending: self.pending.is_some(),
            held: self.held.is_some(),
        }
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Runs until `stop` is set; the member's last agreed state.
    pub fn run(mut self) -> Result<Member, GroupError> {
        loop {
            if self.stopping() {
                self.node.leave();
                return Ok(self);
            }
            let state = self.state();
            let stop = self.stop.clone();
            let start = match self
                .node
                .agree(&state, &mut || stop.load(Ordering::Relaxed))
            {
                Ok(s) => s,
                Err(GroupError::Stopped) => continue,
                Err(e @ GroupError::Refused(_)) => return Err(e),
                Err(_) => continue,
            };
            if let Err(e) = self.sync_or_offer(&start) {
                tracing::warn!("state transfer: {e}");
                continue;
            }
            let mut m = match self.node.build(start) {
                Ok(m) => m,
                Err(e) => {
                    tracing::info!("building the ring: {e}");
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
            };
            self.catch_up(&m)?;
            self.progress.epochs.fetch_add(1, Ordering::Relaxed);
            self.progress
                .ring_size
                .store(m.size() as u64, Ordering::Relaxed);
            let ended = if m.start.retry {
                match self.step_round(&mut m) {
                    Ok(()) => self.ring_loop(&mut m),
                    Err(e) => Ended::Failed(e),
                }
            } else {
                self.ring_loop(&mut m)
            };
            match ended {
                Ended::Dissolved => {}
                Ended::Failed(GroupError::Ring(e)) => {
                    tracing::info!("a round of epoch {} failed: {e}", m.epoch());
                    self.progress.failed_rounds.fetch_add(1, Ordering::Relaxed);
                }
                Ended::Failed(e) => return Err(e),
            }
        }
    }

    fn sync_or_offer(&mut self, start: &Start) -> Result<(), GroupError> {
        let syncing = start.actions.contains(&Action::Sync);
        match self.node.action_in(start) {
            Some(Action::Sync) => {
                let bytes = self.node.fetch_state(start)?;
                self.held = None;
                self.pending = None;
                self.learner.install(&bytes).map_err(GroupError::Refused)?;
                self.hash = self.learner.hash();
                if self.hash != start.hash || self.group_steps() != start.steps {
                    return Err(GroupError::Refused(format!(
                        "the fetched state is at step {}, the group's at {}",
                        self.group_steps(),
                        start.steps
                    )));
                }
                self.progress.syncs.fetch_add(1, Ordering::Relaxed);
                self.publish_steps();
            }
            Some(_) if syncing => {
                self.node
                    .offer_state(self.learner.state_bytes(), self.group_steps(), self.hash);
            }
            _ => {}
        }
        Ok(())
    }

    fn catch_up(&mut self, m: &Membership) -> Result<(), GroupError> {
        match m.action() {
            Action::ApplyPending => {
                let (sum, stats) = self.pending.take().ok_or_else(|| {
                    GroupError::Refused("told to apply a pending sum it does not hold".into())
                })?;
                self.apply(&sum, &stats);
            }
            Action::Sync => {}
            Action::Ready => self.pending = None,
        }
        if self.group_steps() != m.start.steps || self.hash != m.start.hash {
            return Err(GroupError::Refused(format!(
                "after catching up at step {} the parameters differ from the group's at step {}",
                self.group_steps(),
                m.start.steps
            )));
        }
        Ok(())
    }

    fn ring_loop(&mut self, m: &mut Membership) -> Ended {
        let mut pacer = BeatPacer::new(self.cfg.heartbeat, self.cfg.timeout, Instant::now());
        loop {
            let every = self.every();
            let diloco = matches!(self.cfg.mode, Mode::Diloco { .. });
            let can_step = diloco && self.inner_done() < every;
            // The server waits a heartbeat for episodes unless it can step now; alone,
            // a step starts as soon as its batch is there (always, here).
            if !can_step && m.size() > 1 {
                std::thread::sleep(self.cfg.heartbeat);
            }
            if can_step {
                self.inner_step();
            }
            // DiLoCo between outer steps: heartbeats spaced as the server spaces them.
            let more = diloco && self.inner_done() < every && !self.stopping();
            if diloco && !pacer.due(more, Instant::now()) {
                continue;
            }
            let ready = if diloco {
                (self.inner_done() >= every) as usize
            } else {
                1
            };
            let t0 = Instant::now();
            let beat = match self.node.heartbeat(m, ready, self.stopping()) {
                Ok(b) => b,
                Err(e) => return Ended::Failed(e),
            };
            pacer.beat(t0, Instant::now());
            self.progress.beats.fetch_add(1, Ordering::Relaxed);
            self.progress
                .beat_micros
                .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
            if beat.dissolve {
                return Ended::Dissolved;
            }
            let due = if diloco {
                beat.ready as usize >= m.size()
            } else {
                beat.ready >= 1.0
            };
            if due {
                let before = self.group_steps();
                if let Err(e) = self.step_round(m) {
                    return Ended::Failed(e);
                }
                if let Some(end) = self.check_hashes(m, before) {
                    return end;
                }
            }
        }
    }

    fn check_hashes(&mut self, m: &mut Membership, before: u64) -> Option<Ended> {
        let (every, now) = (self.cfg.hash_every, self.group_steps());
        if every == 0 || now == before || now % every != 0 || m.size() < 2 {
            return None;
        }
        match self.node.hashes_agree(m, &self.hash) {
            Ok(true) => None,
            Ok(false) => Some(Ended::Dissolved),
            Err(e) => Some(Ended::Failed(e)),
        }
    }

    fn inner_step(&mut self) {
        let g = self.learner.gradient(self.cfg.compute);
        for (p, g) in self.learner.params.iter_mut().zip(&g) {
            *p -= self.cfg.lr * g;
        }
        self.learner.steps += 1;
        self.progress.steps.fetch_add(1, Ordering::Relaxed);
    }

    /// One group step: the gradient (or delta) held, or a new one; the stats, values and
    /// commit rounds; applied when every member commits.
    fn step_round(&mut self, m: &mut Membership) -> Result<(), GroupError> {
        let values = match (self.held.take(), self.cfg.mode) {
            (Some(v), _) => v,
            (None, Mode::Sync) => self.learner.gradient(self.cfg.compute),
            (None, Mode::Diloco { .. }) => self
                .learner
                .anchor
                .iter()
                .zip(&self.learner.params)
                .map(|(a, p)| a - p)
                .collect(),
        };
        let contributes = match self.cfg.mode {
            Mode::Sync => 1.0,
            Mode::Diloco { .. } => (self.inner_done() > 0) as u8 as f32,
        };
        let mut stats = vec![contributes];
        let mut sum = values.clone();
        self.held = Some(values);
        self.node.sum(m, &mut stats, Wire::F32)?;
        let round = self.node.sum(m, &mut sum, self.cfg.wire)?;
        self.progress
            .value_bytes
            .fetch_add(round.bytes_sent + round.bytes_received, Ordering::Relaxed);
        self.progress
            .value_micros
            .fetch_add((round.seconds * 1e6) as u64, Ordering::Relaxed);
        self.progress.value_rounds.fetch_add(1, Ordering::Relaxed);
        match self.node.commit(m) {
            Ok(true) => {
                self.apply(&sum, &stats);
                Ok(())
            }
            Ok(false) => Ok(()),
            Err(e) => {
                self.pending = Some((sum, stats));
                Err(e)
            }
        }
    }

    fn apply(&mut self, sum: &[f32], stats: &[f32]) {
        let contributors = stats.first().copied().unwrap_or(0.0).max(1.0);
        let l = &mut self.learner;
        match self.cfg.mode {
            Mode::Sync => {
                let lr = self.cfg.lr / contributors;
                for (p, g) in l.params.iter_mut().zip(sum) {
                    *p -= lr * g;
                }
                l.steps += 1;
                l.version += 1;
                l.anchor.copy_from_slice(&l.params);
                l.anchor_steps = l.steps;
                self.progress.steps.fetch_add(1, Ordering::Relaxed);
            }
            Mode::Diloco { every } => {
                let mut momentum = l.momentum.take().unwrap_or_else(|| vec![0.0; sum.len()]);
                for ((a, b), s) in l.anchor.iter_mut().zip(&mut momentum).zip(sum) {
                    let avg = s / contributors;
                    *b = *b * OUTER_MOMENTUM + avg;
                    *a -= OUTER_LR * (avg + *b * OUTER_MOMENTUM);
                }
                l.momentum = Some(momentum);
                l.params.copy_from_slice(&l.anchor);
                l.version += 1;
                l.steps = l.version * every.max(1);
                l.anchor_steps = l.steps;
            }
        }
        self.held = None;
        self.hash = self.learner.hash();
        self.publish_steps();
    }

    fn publish_steps(&self) {
        self.progress
            .group_steps
            .store(self.group_steps(), Ordering::Relaxed);
    }
}
