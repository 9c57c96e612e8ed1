//! Generation without the engine thread: one prompt ([`generate`], what
//! `agentjet-peer generate` runs) or a fixed set of prompts decoded together
//! ([`generate_batch`]). The engine thread reuses the same steps.

use std::time::Instant;

use tch::{Kind, Tensor};

use super::{sampling, FinishReason, GenerateRequest, Generation, RequestError};
use crate::base::{cores, Rng};
use crate::model::llama::{Llama, Logits};
use crate::model::ModelError;

pub(crate) fn row_to_vec(logits: &Tensor) -> Result<Vec<f32>, ModelError> {
    let t = logits
        .f_to_device(tch::Device::Cpu)?
        .f_to_kind(Kind::Float)?
        .f_contiguous()?;
    let n = t.numel();
    let mut v = vec![0f32; n];
    t.f_copy_data(&mut v, n)?;
    Ok(v)
}

/// Why `req` cannot run on `model`, if it cannot: bad sampling parameters, a prompt that
/// is empty or leaves no room in the context, or a token outside the vocabulary. (The
/// engine thread and both direct paths share this.)
pub(crate) fn check_request(model: &Llama, req: &GenerateRequest) -> Result<(), RequestError> {
    req.sampling.validate()?;
    let limit = model.max_positions();
    if req.prompt.is_empty() || req.prompt.len() >= limit {
        return Err(RequestError::PromptSize {
            len: req.prompt.len(),
            limit,
        });
    }
    let vocab = model.config.vocab_size as u32;
    if let Some(&id) = req.prompt.iter().find(|&&t| t >= vocab) {
        return Err(RequestError::OutOfVocab { id, vocab });
    }
    if let Some(asked) = req.adapter.filter(|&i| i >= model.served_adapters()) {
        return Err(RequestError::UnknownAdapter {
            asked,
            served: model.served_adapters(),
        });
    }
    Ok(())
}

fn no_constraint(req: &GenerateRequest) -> Result<(), ModelError> {
    match &req.constraint {
        Some(c) => Err(ModelError::Invalid(format!(
            "constrained decoding ({}) runs in the engine thread (`spawn_engine`, `serve`), not in direct generation",
            c.describe
        ))),
        None => Ok(()),
    }
}

/// Generates from one prompt with a KV cache. `on_token(id, logprob)` runs after each
/// token; returning `false` stops generation (finish reason `Cancelled`).
pub fn generate(
    model: &Llama,
    req: &GenerateRequest,
    on_token: impl FnMut(u32, f64) -> bool,
) -> Result<Generation, ModelError> {
    check_request(model, req).map_err(|e| ModelError::Invalid(e.to_string()))?;
    no_constraint(req)?;
    model.with_served_adapter(req.adapter, || generate_checked(model, req, on_token))
}

fn generate_checked(
    model: &Llama,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32, f64) -> bool,
) -> Result<Generation, ModelError> {
    let limit = model.max_positions();
    let _guard = tch::no_grad_guard();
    model.prepare_thread();
    let capacity = (req.prompt.len() + req.max_tokens).min(limit);
    let mut cache = model.new_cache(1, capacity)?;
    let mut rng = match req.seed {
        Some(s) => Rng::seeded(s),
        None => Rng::from_entropy(),
    };
    let device = model.device();
    let ids: Vec<i64> = req.prompt.iter().map(|&t| t as i64).collect();
    let t0 = Instant::now();
    let input = Tensor::f_from_slice(&ids)?
        .f_view([1, -1])?
        .f_to_device(device)?;
    model.fit_threads(cores().available());
    let mut logits = model.forward(&input, &mut cache, Logits::Last)?;
    let prefill_time = t0.elapsed();
    let t1 = Instant::now();
    let mut out = Generation::started(prefill_time);
    while out.tokens.len() < req.max_tokens {
        let row = row_to_vec(&logits.f_select(0, 0)?)?;
        let picked = sampling::sample(&row, &req.sampling, &mut rng, &req.prompt, &out.tokens);
        let (id, lp) = (picked.id, picked.logprob);
        out.tokens.push(id);
        out.logprobs.push(lp);
        if !on_token(id, lp) {
            out.finish_reason = FinishReason::Cancelled;
            break;
        }
        if req.stop_token_ids.contains(&id) {
            out.finish_reason = FinishReason::Stop;
            break;
        }
        if out.tokens.len() >= req.max_tokens || cache.len() >= cache.capacity() {
            break;
        }
        let next = Tensor::f_from_slice(&[id as i64])?
            .f_view([1, 1])?
            .f_to_device(device)?;
        model.fit_threads(cores().available());
        logits = model.forward(&next, &mut cache, Logits::Last)?;
    }
    out.decode_time = t1.elapsed();
    Ok(out)
}

/// Generates for several prompts at once: all are prefilled together in one packed pass
/// ([`Llama::prefill_slots`]), then all unfinished sequences advance together, one batched decode step per token
/// ([`Llama::decode_slots`]); a sequence leaves the batch as soon as it finishes. Results
/// are in request order, each as `generate` would give it (same seeds, same stops).
pub fn generate_batch(
    model: &Llama,
    reqs: &[GenerateRequest],
) -> Result<Vec<Generation>, ModelError> {
    let _guard = tch::no_grad_guard();
    model.prepare_thread();
    let limit = model.max_positions();
    for (i, req) in reqs.iter().enumerate() {
        check_request(model, req).map_err(|e| ModelError::Invalid(format!("request {i}: {e}")))?;
        no_constraint(req)?;
    }
    if reqs.is_empty() {
        return Ok(Vec::new());
    }
    let capacity = reqs
        .iter()
        .map(|r| r.prompt.len() + r.max_tokens)
        .max()
        .unwrap_or(1)
        .min(limit);
    let mut slots = model.new_slot_cache(reqs.len(), capacity)?;
    struct Seq {
        req: usize,
        len: usize,
        rng: Rng,
        last: u32,
    }
    let mut outs: Vec<Generation> = Vec::with_capacity(reqs.len());
    // `active[r]` lives in slot r.
    let mut active: Vec<Seq> = Vec::new();
    let done = |req: &GenerateRequest, out: &mut Generation, id: u32, len: usize| {
        if req.stop_token_ids.contains(&id) {
            out.finish_reason = FinishReason::Stop;
            true
        } else {
            out.tokens.len() >= req.max_tokens || len >= capacity
        }
    };
    // Every prompt is prefilled in one packed pass, into slot i for request i.
    let t0 = Instant::now();
    let todo: Vec<usize> = (0..reqs.len())
        .filter(|&i| reqs[i].max_tokens > 0)
        .collect();
    let seqs: Vec<(usize, usize, &[u32])> =
        todo.iter().map(|&i| (i, 0, &reqs[i].prompt[..])).collect();
    let logits = if seqs.is_empty() {
        None
    } else {
        // Each packed token takes its request's adapter.
        let rows: Vec<Option<usize>> = todo
            .iter()
            .flat_map(|&i| std::iter::repeat_n(reqs[i].adapter, reqs[i].prompt.len()))
            .collect();
        Some(
            model
                .with_adapter_rows(&rows, || model.prefill_slots(&seqs, &slots))?
                .f_to_device(tch::Device::Cpu)?
                .f_contiguous()?,
        )
    };
    let prefill_time = t0.elapsed();
    let mut row_of = vec![None; reqs.len()];
    for (row, &i) in todo.iter().enumerate() {
        row_of[i] = Some(row);
    }
    for (i, req) in reqs.iter().enumerate() {
        let mut out = Generation::started(prefill_time);
        let (Some(row), Some(logits)) = (row_of[i], logits.as_ref()) else {
            outs.push(out);
            continue;
        };
        let mut rng = match req.seed {
            Some(s) => Rng::seeded(s),
            None => Rng::from_entropy(),
        };
        let row = row_to_vec(&logits.f_get(row as i64)?)?;
        let picked = sampling::sample(&row, &req.sampling, &mut rng, &req.prompt, &[]);
        let (id, lp) = (picked.id, picked.logprob);
        out.tokens.push(id);
        out.logprobs.push(lp);
        let finished = done(req, &mut out, id, req.prompt.len());
        outs.push(out);
        if !finished {
            // Slots 0..active.len() stay occupied: this prompt's keys move down.
            slots.copy_slot(i, active.len(), req.prompt.len())?;
            active.push(Seq {
                req: i,
                len: req.prompt.len(),
                rng,
                last: id,
            });
        }
    }
    let t1 = Instant::now();
    while !active.is_empty() {
        let ids: Vec<u32> = active.iter().map(|s| s.last).collect();
        let mut lens: Vec<usize> = active.iter().map(|s| s.len).collect();
        model.fit_threads(cores().available());
        let rows: Vec<Option<usize>> = active.iter().map(|s| reqs[s.req].adapter).collect();
        let logits = model
            .with_adapter_rows(&rows, || model.decode_slots(&ids, &mut lens, &slots))?
            .f_to_device(tch::Device::Cpu)?
            .f_contiguous()?;
        let mut finished = Vec::new();
        for (r, seq) in active.iter_mut().enumerate() {
            seq.len = lens[r];
            let req = &reqs[seq.req];
            let out = &mut outs[seq.req];
            let row = row_to_vec(&logits.f_get(r as i64)?)?;
            let picked =
                sampling::sample(&row, &req.sampling, &mut seq.rng, &req.prompt, &out.tokens);
            let (id, lp) = (picked.id, picked.logprob);
            out.tokens.push(id);
            out.logprobs.push(lp);
            seq.last = id;
            if done(req, out, id, seq.len) {
                out.decode_time = t1.elapsed();
                finished.push(r);
            }
        }
        // Keep slots 0..n occupied: the last sequence moves into each freed slot.
        for r in finished.into_iter().rev() {
            let last = active.len() - 1;
            if r != last {
                slots.copy_slot(last, r, active[last].len)?;
            }
            active.swap_remove(r);
        }
    }
    Ok(outs)
}
