//! The four forward paths, each an attention strategy over the shared layer loop
//! ([`Llama::run_layers`]):
//!
//! - [`Llama::forward`]: rows of a batch with a [`KvCache`] (direct generation);
//! - [`Llama::forward_row`]: one packed training row of sequences or a prefix tree,
//!   attention per segment over its ancestors (no cache, differentiable);
//! - [`Llama::prefill_slots`]: several prompts packed into one row, each into its own KV
//!   slot (the engine's admission);
//! - [`Llama::decode_slots`]: one token for every running slot (the engine's step).

use tch::{Device, Kind, Tensor};

use super::parts::Qkv;
use super::{KvCache, Llama, Logits, SlotCache};
use crate::model::ModelError;

impl Llama {
    /// Runs `ids` ([batch, seq], int64) through the decoder, appending their keys and
    /// values to `cache` (whose filled length is their starting position), and returns
    /// float32 logits.
    pub fn forward(
        &self,
        ids: &Tensor,
        cache: &mut KvCache,
        which: Logits,
    ) -> Result<Tensor, ModelError> {
        let size = ids.size();
        let [b, t] = size[..] else {
            return Err(ModelError::Invalid(format!(
                "forward wants ids of shape [batch, seq], got {size:?}"
            )));
        };
        if b as usize != cache.batch {
            return Err(ModelError::Invalid(format!(
                "batch of {b} rows does not match a cache of {}",
                cache.batch
            )));
        }
        let start = cache.len as i64;
        let end = start + t;
        if t == 0 || end as usize > cache.capacity {
            return Err(ModelError::Invalid(format!(
                "{t} new positions after {start} exceed the cache capacity of {} (model limit {})",
                cache.capacity,
                self.max_positions()
            )));
        }
        let c = &self.config;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let rope = self.rope.f_narrow(0, start, t)?.f_unsqueeze(1)?;
        // Queries attend to every cached position and causally among themselves.
        let mask = if t > 1 && start > 0 {
            let q_pos =
                Tensor::f_arange_start(start, end, (Kind::Int64, self.device))?.f_unsqueeze(1)?;
            let k_pos = Tensor::f_arange(end, (Kind::Int64, self.device))?.f_unsqueeze(0)?;
            Some(k_pos.f_le_tensor(&q_pos)?)
        } else {
            None
        };
        let is_causal = t > 1 && start == 0;
        let h = c.hidden_size as i64;
        let x = self.embed(ids)?;
        // Linear-attention layers: each row one sequence, from its state in the cache.
        let rows: Vec<i64> = (0..b).collect();
        let mut recurrent = self
            .has_linear_layers()
            .then(|| {
                cache.states.gather(
                    &rows,
                    &vec![start == 0; b as usize],
                    rows.iter().map(|&i| (i * t, t)).collect(),
                )
            })
            .transpose()?;
        // Attention strategy: append to the cache, attend over it.
        let x = self.run_layers(
            x,
            &rope,
            &[b, t],
            recurrent.as_mut(),
            |l, Qkv { q, k, v }| {
                let (q, k, v) = (
                    q.f_transpose(1, 2)?,
                    k.f_transpose(1, 2)?,
                    v.f_transpose(1, 2)?,
                );
                cache.k[l].f_narrow(2, start, t)?.f_copy_(&k)?;
                cache.v[l].f_narrow(2, start, t)?.f_copy_(&v)?;
                let (kk, vv) = if start == 0 {
                    (k, v)
                } else {
                    (
                        cache.k[l].f_narrow(2, 0, end)?,
                        cache.v[l].f_narrow(2, 0, end)?,
                    )
                };
                let attn = Tensor::f_scaled_dot_product_attention(
                    &q,
                    &kk,
                    &vv,
                    mask.as_ref(),
                    0.0,
                    is_causal,
                    None,
                    nkv != nh,
                )?;
                Ok(attn.f_transpose(1, 2)?.f_reshape([b * t, nh * hd])?)
            },
        )?;
        if let Some(r) = &recurrent {
            cache.states.scatter(&rows, r)?;
        }
        let x = x.f_view([b, t, h])?;
        cache.len = end as usize;
        let x = match which {
            Logits::Last => x.f_select(1, t - 1)?,
            Logits::All => x,
        };
        self.head(&x)
    }

    /// The training forward of one packed row (see `timeline::layout`): `ids` and
    /// `positions` are `[n]` int64; `parent[i]` is the row index of token i's predecessor in
    /// its sequence (-1 for a first token). Sequences packed side by side, or sharing
    /// prefixes as a tree, each see only their own tokens, at their own positions.
    ///
    /// Attention runs per segment (a maximal run of tokens each following the one before
    /// it): a segment's queries attend to its ancestors' tokens and causally within
    /// itself, so the cost is that of the sequences, not of the row squared. (A segment
    /// with ancestors recomputes its ancestors' attention rows to stay on the causal
    /// kernel; their projections and MLPs are not recomputed.) No KV cache;
    /// differentiable. Returns float32 logits of the row indices in `rows` (`[m]`, int64;
    /// repeats allowed), or of every token: [m or n, vocab].
    pub fn forward_row(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        parent: &[i32],
        rows: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let h = self.forward_row_hidden(ids, positions, parent, rows)?;
        Ok(self
            .linear(&h, self.output_weight(), None)?
            .f_to_kind(Kind::Float)?)
    }

    /// [`Llama::forward_row`] up to the output layer: the final-normed hidden states (the
    /// head's input, [rows or n, hidden], float32 on CPU) at `rows`, for a chunked
    /// log-probability kernel that never forms [tokens x vocabulary] logits at once.
    pub fn forward_row_hidden(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        parent: &[i32],
        rows: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let x = self.row_states(ids, positions, parent)?;
        let x = match rows {
            Some(r) => x.f_index_select(0, r)?,
            None => x,
        };
        self.rms_norm(&x, &self.norm)
    }

    fn row_states(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        parent: &[i32],
    ) -> Result<Tensor, ModelError> {
        let n = ids.size().first().copied().unwrap_or(0);
        if ids.dim() != 1 || positions.size() != [n] || parent.len() as i64 != n || n == 0 {
            return Err(ModelError::Invalid(format!(
                "forward_row wants ids [n], positions [n] and n parents; got {:?}, {:?}, {}",
                ids.size(),
                positions.size(),
                parent.len()
            )));
        }
        let segments = row_segments(parent, self.device, self.act)?;
        let c = &self.config;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let rope = self.rope.f_index_select(0, positions)?.f_unsqueeze(1)?;
        let x = self.embed(ids)?;
        let mut parts = Vec::with_capacity(segments.len());
        // Linear-attention layers: each segment a sequence of its own from a zero state
        // (the linear layout; a segment continuing an ancestor would need its state).
        let mut recurrent = if self.has_linear_layers() {
            if segments.iter().any(|s| s.keys.is_some()) {
                return Err(ModelError::Invalid(
                    "a packed row with shared prefixes (the tree layout) is not supported for \
                     models with linear-attention layers: use the linear layout"
                        .into(),
                ));
            }
            Some(self.fresh_states(segments.iter().map(|s| (s.start, s.len)).collect())?)
        } else {
            None
        };
        // Attention strategy: per segment, over its ancestors and itself.
        self.run_layers(x, &rope, &[n], recurrent.as_mut(), |_, Qkv { q, k, v }| {
            parts.clear();
            for seg in &segments {
                let heads_first = |t: Tensor| -> Result<Tensor, ModelError> {
                    Ok(t.f_transpose(0, 1)?.f_unsqueeze(0)?)
                };
                // A segment with ancestors: its queries against its ancestors' keys and
                // its own, causal (bottom-right aligned) through an additive mask; alone:
                // the causal kernel. (Measured fwd+bwd for 480 queries over 600 ancestors,
                // 9 heads: 31 ms with the mask vs 61 ms rerunning the ancestors causally.)
                let qs = heads_first(q.f_narrow(0, seg.start, seg.len)?)?;
                let (ks, vs) = match &seg.keys {
                    None => (
                        heads_first(k.f_narrow(0, seg.start, seg.len)?)?,
                        heads_first(v.f_narrow(0, seg.start, seg.len)?)?,
                    ),
                    Some((idx, _)) => (
                        heads_first(k.f_index_select(0, idx)?)?,
                        heads_first(v.f_index_select(0, idx)?)?,
                    ),
                };
                let attn = Tensor::f_scaled_dot_product_attention(
                    &qs,
                    &ks,
                    &vs,
                    seg.keys.as_ref().map(|(_, mask)| mask),
                    0.0,
                    seg.keys.is_none() && seg.len > 1,
                    None,
                    nkv != nh,
                )?;
                parts.push(
                    attn.f_squeeze_dim(0)?
                        .f_transpose(0, 1)?
                        .f_reshape([seg.len, nh * hd])?,
                );
            }
            Ok(if parts.len() == 1 {
                parts[0].shallow_clone()
            } else {
                Tensor::f_cat(&parts, 0)?
            })
        })
    }

    /// Prefills several prompts at once, each `(slot, start, ids)` into its own slot at
    /// positions `start..start + ids.len()`, after the `start` positions the slot already
    /// holds (a prefix taken from the engine's prefix cache; 0: none): the new tokens are
    /// packed into one row so every matrix runs once for all of them, while each prompt's
    /// queries attend to its slot's earlier positions and causally among themselves.
    /// Returns float32 logits of each prompt's last position, [prompts, vocab], in the
    /// order given.
    pub fn prefill_slots(
        &self,
        seqs: &[(usize, usize, &[u32])],
        cache: &SlotCache,
    ) -> Result<Tensor, ModelError> {
        if seqs.is_empty() {
            return Err(ModelError::Invalid("prefill_slots: no prompts".into()));
        }
        let vocab = self.config.vocab_size as u32;
        let mut used = vec![false; cache.slots];
        let mut tok: Vec<i64> = Vec::new();
        let mut pos: Vec<i64> = Vec::new();
        let mut last: Vec<i64> = Vec::with_capacity(seqs.len());
        for (i, &(slot, start, ids)) in seqs.iter().enumerate() {
            if slot >= cache.slots || std::mem::replace(&mut used[slot], true) {
                return Err(ModelError::Invalid(format!(
                    "prompt {i}: slot {slot} is out of range or used twice ({} slots)",
                    cache.slots
                )));
            }
            if ids.is_empty() || start + ids.len() > cache.capacity {
                return Err(ModelError::Invalid(format!(
                    "prompt {i}: {} tokens after {start} do not fit a slot of {} positions",
                    ids.len(),
                    cache.capacity
                )));
            }
            if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
                return Err(ModelError::Invalid(format!(
                    "prompt {i}: token id {bad} is outside the vocabulary of {vocab}"
                )));
            }
            tok.extend(ids.iter().map(|&t| t as i64));
            pos.extend(start as i64..(start + ids.len()) as i64);
            last.push(tok.len() as i64 - 1);
        }
        let c = &self.config;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let dev = self.device;
        let total = tok.len() as i64;
        let tok = Tensor::f_from_slice(&tok)?.f_to_device(dev)?;
        let pos_t = Tensor::f_from_slice(&pos)?.f_to_device(dev)?;
        let rope = self.rope.f_index_select(0, &pos_t)?.f_unsqueeze(1)?;
        let x = self.embed(&tok)?;
        let mut parts = Vec::with_capacity(seqs.len());
        // Where a prompt continues a cached prefix, its queries see every earlier position
        // of the slot and causally among themselves: [t, start + t], true = visible.
        let masks = seqs
            .iter()
            .map(|&(_, start, ids)| {
                if start == 0 {
                    return Ok(None);
                }
                let (s, t) = (start as i64, ids.len() as i64);
                let q = Tensor::f_arange_start(s, s + t, (Kind::Int64, dev))?.f_unsqueeze(1)?;
                let k = Tensor::f_arange(s + t, (Kind::Int64, dev))?.f_unsqueeze(0)?;
                Ok(Some(k.f_le_tensor(&q)?))
            })
            .collect::<Result<Vec<Option<Tensor>>, ModelError>>()?;
        // Linear-attention layers: each prompt from its slot's state (fresh when it starts
        // at 0), the state after it back into the slot.
        let slots: Vec<i64> = seqs.iter().map(|&(slot, _, _)| slot as i64).collect();
        let mut recurrent = self
            .has_linear_layers()
            .then(|| {
                let mut at = 0i64;
                let pieces = seqs
                    .iter()
                    .map(|&(_, _, ids)| {
                        at += ids.len() as i64;
                        (at - ids.len() as i64, ids.len() as i64)
                    })
                    .collect();
                let fresh: Vec<bool> = seqs.iter().map(|&(_, start, _)| start == 0).collect();
                cache.states.gather(&slots, &fresh, pieces)
            })
            .transpose()?;
        // Attention strategy: each prompt on its own over its slot, its keys into the slot.
        let x = self.run_layers(
            x,
            &rope,
            &[total],
            recurrent.as_mut(),
            |l, Qkv { q, k, v }| {
                parts.clear();
                let mut off = 0i64;
                for (&(slot, start, ids), mask) in seqs.iter().zip(&masks) {
                    let (s, t) = (start as i64, ids.len() as i64);
                    // [1, heads, t, hd]
                    let head_major = |x: &Tensor| -> Result<Tensor, ModelError> {
                        Ok(x.f_narrow(0, off, t)?.f_transpose(0, 1)?.f_unsqueeze(0)?)
                    };
                    let q = head_major(&q)?;
                    let k = head_major(&k)?;
                    let vv = head_major(&v)?;
                    let k_slot = cache.k[l].f_narrow(0, slot as i64, 1)?;
                    let v_slot = cache.v[l].f_narrow(0, slot as i64, 1)?;
                    k_slot.f_narrow(2, s, t)?.f_copy_(&k)?;
                    v_slot.f_narrow(2, s, t)?.f_copy_(&vv)?;
                    let attn = match mask {
                        None => Tensor::f_scaled_dot_product_attention(
                            &q,
                            &k,
                            &vv,
                            None::<&Tensor>,
                            0.0,
                            t > 1,
                            None,
                            nkv != nh,
                        )?,
                        Some(mask) => Tensor::f_scaled_dot_product_attention(
                            &q,
                            &k_slot.f_narrow(2, 0, s + t)?,
                            &v_slot.f_narrow(2, 0, s + t)?,
                            Some(mask),
                            0.0,
                            false,
                            None,
                            nkv != nh,
                        )?,
                    };
                    parts.push(
                        attn.f_squeeze_dim(0)?
                            .f_transpose(0, 1)?
                            .f_reshape([t, nh * hd])?,
                    );
                    off += t;
                }
                Ok(Tensor::f_cat(&parts, 0)?)
            },
        )?;
        if let Some(r) = &recurrent {
            cache.states.scatter(&slots, r)?;
        }
        let last = Tensor::f_from_slice(&last)?.f_to_device(dev)?;
        self.head(&x.f_index_select(0, &last)?)
    }

    /// One decode step for the sequences in slots `0..ids.len()` of `cache`: row `i`
    /// appends `ids[i]` at position `lens[i]` (then `lens[i]` grows by one) and gets that
    /// sequence's next-token logits, float32 [rows, vocab]. Matrices and attention each
    /// run once for the whole batch (attention over the longest row, masked per row).
    pub fn decode_slots(
        &self,
        ids: &[u32],
        lens: &mut [usize],
        cache: &SlotCache,
    ) -> Result<Tensor, ModelError> {
        let b = ids.len();
        if b == 0 || lens.len() != b || b > cache.slots {
            return Err(ModelError::Invalid(format!(
                "decode_slots: {b} tokens, {} lengths, {} slots",
                lens.len(),
                cache.slots
            )));
        }
        if let Some(i) = lens.iter().position(|&l| l >= cache.capacity) {
            return Err(ModelError::Invalid(format!(
                "row {i}: slot is full ({} positions)",
                cache.capacity
            )));
        }
        let vocab = self.config.vocab_size as u32;
        if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
            return Err(ModelError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let c = &self.config;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let bi = b as i64;
        let dev = self.device;
        let tok: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let pos: Vec<i64> = lens.iter().map(|&l| l as i64).collect();
        let max_len = pos.iter().copied().max().unwrap_or(0) + 1;
        let tok = Tensor::f_from_slice(&tok)?.f_to_device(dev)?;
        let pos_t = Tensor::f_from_slice(&pos)?.f_to_device(dev)?;
        let rows_t = Tensor::f_arange(bi, (Kind::Int64, dev))?;
        let rope = self.rope.f_index_select(0, &pos_t)?.f_unsqueeze(1)?;
        // not_mask[i, 0, 0, j] = j > pos[i]: positions row i must not see.
        let not_mask = Tensor::f_arange(max_len, (Kind::Int64, dev))?
            .f_unsqueeze(0)?
            .f_gt_tensor(&pos_t.f_unsqueeze(1)?)?
            .f_view([bi, 1, 1, max_len])?;
        let group = nh / nkv;
        let scale = 1.0 / (hd as f64).sqrt();
        let x = self.embed(&tok)?;
        // Linear-attention layers: one token of each running slot, from its state.
        let mut recurrent = self
            .has_linear_layers()
            .then(|| cache.states.first(bi))
            .transpose()?;
        // Attention strategy: one masked grouped-query attention over every slot's cache.
        let x = self.run_layers(x, &rope, &[bi], recurrent.as_mut(), |l, Qkv { q, k, v }| {
            let q = q.f_unsqueeze(2)?;
            let idx = [
                Some(rows_t.shallow_clone()),
                None,
                Some(pos_t.shallow_clone()),
            ];
            let mut kc = cache.k[l].shallow_clone();
            let mut vc = cache.v[l].shallow_clone();
            let _ = kc.f_index_put_(&idx, &k, false)?;
            let _ = vc.f_index_put_(&idx, &v, false)?;
            let kk = cache.k[l].f_narrow(0, 0, bi)?.f_narrow(2, 0, max_len)?;
            let vv = cache.v[l].f_narrow(0, 0, bi)?.f_narrow(2, 0, max_len)?;
            // Grouped-query attention as two batched matmuls: the `group` query heads of a
            // KV head are the rows of one small GEMM, so each key and value is read once
            // per KV head (not once per query head, as sdpa's decode path does).
            // The cache views merge (slot, head) without a copy: [b * nkv, len, hd] with
            // each slot's positions contiguous, so bmm reads them in place.
            let qg = q.f_reshape([bi * nkv, group, hd])?;
            let k3 = kk.f_view([bi * nkv, max_len, hd])?;
            let v3 = vv.f_view([bi * nkv, max_len, hd])?;
            let scores = qg
                .f_bmm(&k3.f_transpose(1, 2)?)?
                .f_view([bi, nkv, group, max_len])?
                .f_to_kind(Kind::Float)?
                .f_mul_scalar(scale)?
                .f_masked_fill(&not_mask, f64::NEG_INFINITY)?;
            let probs = scores
                .f_softmax(-1, Kind::Float)?
                .f_to_kind(v3.kind())?
                .f_view([bi * nkv, group, max_len])?;
            Ok(probs.f_bmm(&v3)?.f_reshape([bi, nh * hd])?)
        })?;
        if let Some(r) = &recurrent {
            cache.states.put_first(r)?;
        }
        for l in lens.iter_mut() {
            *l += 1;
        }
        self.head(&x)
    }
}

/// A run of row tokens `start..start + len`, each following the one before it, and what
/// its queries attend to.
struct RowSegment {
    start: i64,
    len: i64,
    /// When the segment has ancestors: the row indices of the ancestors by depth, then of
    /// the segment, and the additive attention mask [len, ancestors + len] that lets query
    /// i see keys 0..=ancestors + i. `None`: the segment alone.
    keys: Option<(Tensor, Tensor)>,
}

/// The segments of a packed row given each token's parent (see `Llama::forward_row`).
fn row_segments(parent: &[i32], device: Device, kind: Kind) -> Result<Vec<RowSegment>, ModelError> {
    let n = parent.len();
    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        let p = parent[i];
        if p >= i as i32 || p < -1 {
            return Err(ModelError::Invalid(format!(
                "token {i} has parent {p}: parents must come before their children"
            )));
        }
        let mut j = i + 1;
        while j < n && parent[j] == j as i32 - 1 {
            j += 1;
        }
        let len = (j - i) as i64;
        let keys = if p < 0 {
            None
        } else {
            let mut anc = Vec::new();
            let mut a = p;
            while a >= 0 {
                anc.push(a as i64);
                a = parent[a as usize];
            }
            anc.reverse();
            let a_len = anc.len() as i64;
            anc.extend(i as i64..j as i64);
            let keys = Tensor::f_from_slice(&anc)?.f_to_device(device)?;
            let q = Tensor::f_arange(len, (Kind::Int64, device))?.f_unsqueeze(1)?;
            let k = Tensor::f_arange(a_len + len, (Kind::Int64, device))?.f_unsqueeze(0)?;
            let hidden = k.f_gt_tensor(&q.f_add_scalar(a_len)?)?;
            let mask = Tensor::f_zeros([len, a_len + len], (kind, device))?
                .f_masked_fill(&hidden, f64::NEG_INFINITY)?;
            Some((keys, mask))
        };
        out.push(RowSegment {
            start: i as i64,
            len,
            keys,
        });
        i = j;
    }
    Ok(out)
}
