//! A trainer's whole state as bytes, for a joiner: what the group members offer and a
//! joiner installs. Layout (little-endian): step count, policy version, optimizer step
//! count (8 bytes each), then every parameter's float32 values, then AdamW's first
//! moments, then its second moments, each in [`crate::model::llama::Llama::parameters`]
//! order. Both sides hold the same model shape (the group checked it).

use tch::{Kind, Tensor};

use crate::train::trainer::Trainer;
use crate::train::TrainError;

fn put(out: &mut Vec<u8>, tensors: &[Tensor]) -> Result<(), TrainError> {
    for t in tensors {
        let flat = t
            .detach()
            .to_kind(Kind::Float)
            .to_device(tch::Device::Cpu)
            .contiguous()
            .view([-1]);
        let v = Vec::<f32>::try_from(&flat)?;
        out.extend_from_slice(bytemuck::cast_slice(&v));
    }
    Ok(())
}

/// blake3 of the parameters' float32 bytes (as [`state_bytes`] lays them out).
pub fn parameter_hash(t: &Trainer) -> Result<[u8; 32], TrainError> {
    let mut h = blake3::Hasher::new();
    for p in t.model.parameters() {
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
    Ok(*h.finalize().as_bytes())
}

/// The trainer's state as bytes (see the module docs).
pub fn state_bytes(t: &Trainer) -> Result<Vec<u8>, TrainError> {
    let mut out = Vec::new();
    out.extend_from_slice(&t.steps().to_le_bytes());
    out.extend_from_slice(&t.version().to_le_bytes());
    out.extend_from_slice(&t.opt.steps().to_le_bytes());
    put(&mut out, &t.model.parameters())?;
    let (m, v) = t.opt.moments();
    put(&mut out, m)?;
    put(&mut out, v)?;
    Ok(out)
}

/// Installs `bytes` (from [`state_bytes`] of a trainer of the same shape).
pub fn install_state(t: &mut Trainer, bytes: &[u8]) -> Result<(), TrainError> {
    let params = t.model.parameters();
    let values: usize = params.iter().map(Tensor::numel).sum();
    let want = 24 + 3 * values * 4;
    if bytes.len() != want {
        return Err(TrainError::Invalid(format!(
            "a state of {} bytes for a model whose state is {want}",
            bytes.len()
        )));
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    let (steps, version, opt_steps) = (word(0), word(1), word(2) as i64);
    // The float32 values, copied out (the byte slice need not be aligned).
    let floats: Vec<f32> = bytes[24..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
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
    tch::no_grad(|| -> Result<(), TrainError> {
        for (p, src) in params.iter().zip(&new_params) {
            p.shallow_clone().f_copy_(src)?;
        }
        Ok(())
    })?;
    t.opt.restore(&m, &v, opt_steps)?;
    t.set_counters(steps, version);
    Ok(())
}
