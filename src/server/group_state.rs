//! A trainer's whole state as bytes, for a joiner: what the group members offer and a
//! joiner installs. Layout (little-endian): step count, policy version, optimizer step
//! count and the number of outer-momentum sets (0 or 1; 8 bytes each), then every
//! parameter's float32 values, then AdamW's first moments, then its second moments, then
//! (DiLoCo) the outer momentum, each in [`crate::model::llama::Llama::parameters`] order.
//! Both sides hold the same model shape (the group checked it).

use tch::{Kind, Tensor};

use crate::train::outer::Outer;
use crate::train::trainer::Trainer;
use crate::train::{flat_f32, TrainError};

fn put(out: &mut Vec<u8>, tensors: &[Tensor]) -> Result<(), TrainError> {
    out.extend_from_slice(bytemuck::cast_slice(&flat_f32(tensors)?));
    Ok(())
}

/// blake3 of `params`' float32 bytes (as [`state_bytes`] lays them out).
pub fn hash_of(params: &[Tensor]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    for p in params {
        let flat = p
            .detach()
            .to_kind(Kind::Float)
            .to_device(tch::Device::Cpu)
            .contiguous();
        let n = flat.numel();
        // SAFETY: `flat` is a contiguous float32 CPU tensor of `n` values that lives to
        // the end of this iteration; its bytes are read only.
        let bytes = unsafe { std::slice::from_raw_parts(flat.data_ptr() as *const u8, n * 4) };
        h.update(bytes);
    }
    *h.finalize().as_bytes()
}

/// blake3 of the group's parameters at this member: the trainer's, or in DiLoCo mode the
/// outer optimizer's anchor (the trainer's drift between outer steps is its own).
pub fn parameter_hash(t: &Trainer, outer: Option<&Outer>) -> Result<[u8; 32], TrainError> {
    Ok(match outer {
        Some(o) => hash_of(o.anchor()),
        None => hash_of(&t.model.parameters()),
    })
}

/// The group's state at this member as bytes (see the module docs). In DiLoCo mode the
/// parameters are the anchor, the step count the one of the last outer step (`version x
/// H`: every member takes H inner steps per outer step), and the outer momentum follows.
pub fn state_bytes(t: &Trainer, outer: Option<&Outer>) -> Result<Vec<u8>, TrainError> {
    let mut out = Vec::new();
    let (steps, params) = match outer {
        Some(o) => (
            t.version() * o.cfg.every,
            o.anchor().iter().map(Tensor::shallow_clone).collect(),
        ),
        None => (t.steps(), t.model.parameters()),
    };
    let momentum = outer.and_then(Outer::momentum);
    out.extend_from_slice(&steps.to_le_bytes());
    out.extend_from_slice(&t.version().to_le_bytes());
    out.extend_from_slice(&t.opt.steps().to_le_bytes());
    out.extend_from_slice(&(momentum.is_some() as u64).to_le_bytes());
    put(&mut out, &params)?;
    let (m, v) = t.opt.moments();
    put(&mut out, &m)?;
    put(&mut out, &v)?;
    if let Some(b) = momentum {
        put(&mut out, b)?;
    }
    Ok(out)
}

/// The largest step count or version a state may carry (far above any real run; later
/// arithmetic on them cannot overflow).
pub const MAX_COUNTER: u64 = 1 << 48;

/// Installs `bytes` (from [`state_bytes`] of a trainer of the same shape) when they hold
/// the group's state: group step `group_steps` (the step count; in DiLoCo mode, `every`
/// inner steps per outer step, the version), parameters hashing to `hash`, every value
/// finite. Anything else is refused before the trainer is touched. Returns the outer
/// momentum they carry, if any.
pub fn install_state(
    t: &mut Trainer,
    bytes: &[u8],
    group_steps: u64,
    every: Option<u64>,
    hash: &[u8; 32],
) -> Result<Option<Vec<Tensor>>, TrainError> {
    let params = t.model.parameters();
    let values: usize = params.iter().map(Tensor::numel).sum();
    let word = |i: usize| {
        bytes
            .get(i * 8..i * 8 + 8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    };
    let (steps, version, opt_steps, sets) = (word(0), word(1), word(2) as i64, word(3));
    let want = 32 + (3 + sets.min(1) as usize) * values * 4;
    if bytes.len() != want || sets > 1 {
        return Err(TrainError::Invalid(format!(
            "a state of {} bytes for a model whose state is {want}",
            bytes.len()
        )));
    }
    let at_group_step = match every {
        Some(h) => version == group_steps && Some(steps) == version.checked_mul(h),
        None => steps == group_steps,
    };
    if !at_group_step || steps > MAX_COUNTER || version > MAX_COUNTER {
        return Err(TrainError::Invalid(format!(
            "a state of step {steps}, version {version}: the group's step is {group_steps}"
        )));
    }
    // The parameters are hashed as laid out here (the anchor's, in DiLoCo mode).
    let got = *blake3::hash(&bytes[32..32 + values * 4]).as_bytes();
    if got != *hash {
        return Err(TrainError::Invalid(
            "a state whose parameters are not the group's (their hash differs)".into(),
        ));
    }
    // The float32 values, copied out (the byte slice need not be aligned).
    let floats: Vec<f32> = bytes[32..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if let Some(i) = floats.iter().position(|x| !x.is_finite()) {
        return Err(TrainError::Invalid(format!(
            "a state with a non-finite value (value {i})"
        )));
    }
    // What AdamW divides by must be sound too: a negative second moment or step count
    // would turn the next update into NaNs.
    if opt_steps < 0 || opt_steps as u64 > MAX_COUNTER {
        return Err(TrainError::Invalid(format!(
            "a state with {opt_steps} optimizer steps"
        )));
    }
    if floats[2 * values..3 * values].iter().any(|v| *v < 0.0) {
        return Err(TrainError::Invalid(
            "a state with a negative second moment".into(),
        ));
    }
    let take = |at: &mut usize, like: &Tensor| {
        let n = like.numel();
        let t = Tensor::from_slice(&floats[*at..*at + n])
            .view(like.size().as_slice())
            .to_device(like.device());
        *at += n;
        t
    };
    let mut at = 0;
    let new_params: Vec<Tensor> = params.iter().map(|p| take(&mut at, p)).collect();
    let m: Vec<Tensor> = params.iter().map(|p| take(&mut at, p)).collect();
    let v: Vec<Tensor> = params.iter().map(|p| take(&mut at, p)).collect();
    let momentum: Option<Vec<Tensor>> =
        (sets == 1).then(|| params.iter().map(|p| take(&mut at, p)).collect());
    tch::no_grad(|| -> Result<(), TrainError> {
        for (p, src) in params.iter().zip(&new_params) {
            p.shallow_clone().f_copy_(src)?;
        }
        Ok(())
    })?;
    t.opt.restore(&m, &v, opt_steps)?;
    t.set_counters(steps, version);
    Ok(momentum)
}
