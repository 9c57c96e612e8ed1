//! Key/value storage: [`KvCache`] (rows of one batch, direct generation), [`SlotCache`]
//! (the engine's running sequences, one slot each, grown and shrunk as they need) and
//! [`KvBlock`] (a copy of some positions of one sequence, what the engine's prefix cache
//! keeps). Keys and values are held for the attention layers only; a model with
//! linear-attention layers (Qwen3.5) also holds each row's or slot's states of those
//! layers (see `linear`), which every operation here keeps with its sequence.
//!
//! Why slots and copies rather than pages: a decode step attends over one view of the
//! first `n` slots with a length mask, one attention call per layer for the whole batch.
//! Pages would need a gather of every sequence's keys per layer per step (LibTorch has no
//! paged attention on the CPU), which costs more than the attention itself; a prefix
//! reused from the cache is instead copied into the slot once at admission, a memory copy
//! that is about a hundredth of the prefill it saves (measured in `cargo bench --bench
//! rollout`).

use tch::{Device, Kind, Tensor};

use super::linear::Recurrent;
use super::Llama;
use crate::model::ModelError;

/// Per-layer key/value tensors of shape [batch, kv_heads, capacity, head_dim]; the first
/// `len` positions are filled.
pub struct KvCache {
    pub(super) k: Vec<Tensor>,
    pub(super) v: Vec<Tensor>,
    pub(super) states: States,
    pub(super) len: usize,
    pub(super) capacity: usize,
    pub(super) batch: usize,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn batch(&self) -> usize {
        self.batch
    }
}

/// Per linear-attention layer, each row's (or slot's) convolution state [rows, channels,
/// kernel - 1] and recurrent state [rows, value_heads, key_head_dim, value_head_dim]
/// (float32). Empty for a model without such layers.
#[derive(Default)]
pub(super) struct States {
    pub conv: Vec<Tensor>,
    pub rec: Vec<Tensor>,
}

impl States {
    /// Every state tensor.
    fn all(&self) -> impl Iterator<Item = &Tensor> {
        self.conv.iter().chain(self.rec.iter())
    }

    /// Copies row `from`'s states to row `to`.
    pub(super) fn copy_row(&self, from: i64, to: i64) -> Result<(), ModelError> {
        for t in self.all() {
            t.f_narrow(0, to, 1)?.f_copy_(&t.f_narrow(0, from, 1)?)?;
        }
        Ok(())
    }

    /// The states of rows `rows` (fresh zeros where `fresh`), for a pass over those
    /// sequences whose pieces are `pieces`.
    pub(super) fn gather(
        &self,
        rows: &[i64],
        fresh: &[bool],
        pieces: Vec<(i64, i64)>,
    ) -> Result<Recurrent, ModelError> {
        let device = self.conv.first().map(|t| t.device()).unwrap_or(Device::Cpu);
        let idx = Tensor::f_from_slice(rows)?.f_to_device(device)?;
        let fresh: Vec<i64> = (0..rows.len() as i64)
            .filter(|&i| fresh[i as usize])
            .collect();
        let fresh = Tensor::f_from_slice(&fresh)?.f_to_device(device)?;
        // Fresh rows are set to zero (not multiplied by it: a slot's earlier NaN stays out).
        let pick = |t: &Tensor| -> Result<Tensor, ModelError> {
            Ok(t.f_index_select(0, &idx)?.f_index_fill(0, &fresh, 0.0)?)
        };
        Ok(Recurrent {
            pieces,
            conv: self.conv.iter().map(pick).collect::<Result<_, _>>()?,
            rec: self.rec.iter().map(pick).collect::<Result<_, _>>()?,
        })
    }

    /// The states of rows `0..n` as they are (views, no copy), for a decode step of the
    /// first `n` rows.
    pub(super) fn first(&self, n: i64) -> Result<Recurrent, ModelError> {
        let view = |t: &Tensor| t.f_narrow(0, 0, n);
        Ok(Recurrent {
            pieces: (0..n).map(|i| (i, 1)).collect(),
            conv: self.conv.iter().map(view).collect::<Result<_, _>>()?,
            rec: self.rec.iter().map(view).collect::<Result<_, _>>()?,
        })
    }

    /// Writes a decode step's states back into rows `0..n`.
    pub(super) fn put_first(&self, r: &Recurrent) -> Result<(), ModelError> {
        for (dst, src) in self
            .conv
            .iter()
            .zip(&r.conv)
            .chain(self.rec.iter().zip(&r.rec))
        {
            let n = src.size()[0];
            dst.f_narrow(0, 0, n)?.f_copy_(src)?;
        }
        Ok(())
    }

    /// Writes a pass's final states back into rows `rows`.
    pub(super) fn scatter(&self, rows: &[i64], r: &Recurrent) -> Result<(), ModelError> {
        let device = self.conv.first().map(|t| t.device()).unwrap_or(Device::Cpu);
        let idx = Tensor::f_from_slice(rows)?.f_to_device(device)?;
        for (dst, src) in self
            .conv
            .iter()
            .zip(&r.conv)
            .chain(self.rec.iter().zip(&r.rec))
        {
            let mut dst = dst.shallow_clone();
            let _ = dst.f_index_copy_(0, &idx, &src.f_to_kind(dst.kind())?)?;
        }
        Ok(())
    }
}

/// What one KV tensor looks like, to allocate more of them.
#[derive(Clone)]
struct Shape {
    /// Attention layers (the others, if any, are linear attention).
    layers: usize,
    /// Linear-attention layers and one sequence's state shapes in each.
    linear: Option<(usize, [i64; 2], [i64; 3])>,
    kv_heads: i64,
    head_dim: i64,
    kind: Kind,
    device: Device,
    /// The model's context: no slot holds more positions.
    limit: usize,
}

impl Shape {
    fn zeros(
        &self,
        rows: usize,
        capacity: usize,
    ) -> Result<(Vec<Tensor>, Vec<Tensor>), ModelError> {
        let shape = [rows as i64, self.kv_heads, capacity as i64, self.head_dim];
        let opts = (self.kind, self.device);
        let mut k = Vec::with_capacity(self.layers);
        let mut v = Vec::with_capacity(self.layers);
        for _ in 0..self.layers {
            k.push(Tensor::f_zeros(shape, opts)?);
            v.push(Tensor::f_zeros(shape, opts)?);
        }
        Ok((k, v))
    }

    fn bytes_per_position(&self) -> usize {
        2 * self.layers * (self.kv_heads * self.head_dim) as usize * self.kind.elt_size_in_bytes()
    }

    /// Zero linear-attention states for `rows` sequences.
    fn states(&self, rows: usize) -> Result<States, ModelError> {
        let Some((layers, conv, rec)) = self.linear else {
            return Ok(States::default());
        };
        let r = rows as i64;
        let mut s = States::default();
        for _ in 0..layers {
            s.conv.push(Tensor::f_zeros(
                [r, conv[0], conv[1]],
                (self.kind, self.device),
            )?);
            s.rec.push(Tensor::f_zeros(
                [r, rec[0], rec[1], rec[2]],
                (Kind::Float, self.device),
            )?);
        }
        Ok(s)
    }

    /// Bytes of one sequence's linear-attention states.
    fn bytes_per_sequence(&self) -> usize {
        self.linear.map_or(0, |(layers, conv, rec)| {
            layers
                * ((conv[0] * conv[1]) as usize * self.kind.elt_size_in_bytes()
                    + (rec[0] * rec[1] * rec[2]) as usize * 4)
        })
    }
}

/// Key/value storage for many sequences at once: per layer one tensor
/// [slots, kv_heads, capacity, head_dim]. Running sequences occupy slots `0..n`, so a decode
/// step attends over one view of the first `n` slots with a length mask: one attention call
/// per layer for the whole batch. [`SlotCache::resize`] reallocates it (keeping the live
/// positions), so the engine holds only what its sequences need.
pub struct SlotCache {
    pub(super) k: Vec<Tensor>,
    pub(super) v: Vec<Tensor>,
    pub(super) states: States,
    pub(super) slots: usize,
    pub(super) capacity: usize,
    shape: Shape,
}

impl SlotCache {
    pub fn slots(&self) -> usize {
        self.slots
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// The model's context, the largest capacity a slot can have.
    pub fn limit(&self) -> usize {
        self.shape.limit
    }
    /// Bytes one position of one sequence takes (keys and values of every layer).
    pub fn bytes_per_position(&self) -> usize {
        self.shape.bytes_per_position()
    }
    /// Bytes of one sequence's linear-attention states (Qwen3.5; 0 for other models),
    /// held per slot whatever its length.
    pub fn bytes_per_sequence(&self) -> usize {
        self.shape.bytes_per_sequence()
    }
    /// Bytes held now (`slots x capacity` positions, and each slot's states).
    pub fn bytes(&self) -> usize {
        self.slots * (self.capacity * self.bytes_per_position() + self.bytes_per_sequence())
    }
    /// Whether sequences carry linear-attention states (which the prefix cache's blocks
    /// do not hold).
    pub fn has_states(&self) -> bool {
        self.shape.linear.is_some()
    }

    /// Reallocates to `slots` slots of `capacity` positions (capped at the model's
    /// context), keeping the first `live[i]` positions of slot `i` for every `i` in
    /// `live` (which must fit the new shape). Zero slots or zero capacity holds nothing.
    pub fn resize(
        &mut self,
        slots: usize,
        capacity: usize,
        live: &[usize],
    ) -> Result<(), ModelError> {
        let capacity = capacity.min(self.shape.limit);
        if slots == self.slots && capacity == self.capacity {
            return Ok(());
        }
        if live.len() > slots || live.iter().any(|&l| l > capacity || l > self.capacity) {
            return Err(ModelError::Invalid(format!(
                "resizing KV slots to {slots} x {capacity} would lose live positions {live:?}"
            )));
        }
        let (k, v) = self.shape.zeros(slots, capacity)?;
        let states = self.shape.states(slots)?;
        for (new, old) in states.all().zip(self.states.all()) {
            for (i, &len) in live.iter().enumerate() {
                if len > 0 {
                    new.f_narrow(0, i as i64, 1)?
                        .f_copy_(&old.f_narrow(0, i as i64, 1)?)?;
                }
            }
        }
        for (new, old) in k.iter().zip(&self.k).chain(v.iter().zip(&self.v)) {
            for (i, &len) in live.iter().enumerate() {
                if len == 0 {
                    continue;
                }
                new.f_narrow(0, i as i64, 1)?
                    .f_narrow(2, 0, len as i64)?
                    .f_copy_(&old.f_narrow(0, i as i64, 1)?.f_narrow(2, 0, len as i64)?)?;
            }
        }
        self.k = k;
        self.v = v;
        self.states = states;
        self.slots = slots;
        self.capacity = capacity;
        Ok(())
    }

    /// Copies the first `len` positions of slot `from` into slot `to` (compaction, and
    /// forking one prefilled prompt into several sequences).
    pub fn copy_slot(&mut self, from: usize, to: usize, len: usize) -> Result<(), ModelError> {
        if from == to || len == 0 {
            return Ok(());
        }
        self.states.copy_row(from as i64, to as i64)?;
        for t in self.k.iter().chain(self.v.iter()) {
            let src = t.f_narrow(0, from as i64, 1)?.f_narrow(2, 0, len as i64)?;
            t.f_narrow(0, to as i64, 1)?
                .f_narrow(2, 0, len as i64)?
                .f_copy_(&src)?;
        }
        Ok(())
    }

    /// A copy of positions `start..start + len` of slot `slot`.
    ///
    /// With linear-attention layers the block also keeps the slot's states as they are
    /// now, which the caller vouches are those after position `start + len` (the slot has
    /// computed exactly that many): a sequence may resume there and nowhere else in it.
    pub fn extract(&self, slot: usize, start: usize, len: usize) -> Result<KvBlock, ModelError> {
        if slot >= self.slots || start + len > self.capacity || len == 0 {
            return Err(ModelError::Invalid(format!(
                "KV positions {start}..{} of slot {slot} are outside {} x {}",
                start + len,
                self.slots,
                self.capacity
            )));
        }
        let parts = self
            .k
            .iter()
            .chain(self.v.iter())
            .map(|t| {
                t.f_narrow(0, slot as i64, 1)?
                    .f_narrow(2, start as i64, len as i64)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let end = if self.has_states() {
            Some(
                self.states
                    .all()
                    .map(|t| {
                        Ok(t.f_narrow(0, slot as i64, 1)?
                            .f_contiguous()?
                            .f_detach_copy()?)
                    })
                    .collect::<Result<Vec<_>, ModelError>>()?,
            )
        } else {
            None
        };
        Ok(KvBlock {
            t: Tensor::f_cat(&parts, 0)?,
            len,
            states: self.has_states(),
            end,
        })
    }

    /// Writes the first `len` positions of `block` into slot `slot` at position `at`.
    pub fn load(
        &mut self,
        slot: usize,
        at: usize,
        block: &KvBlock,
        len: usize,
    ) -> Result<(), ModelError> {
        if slot >= self.slots || at + len > self.capacity || len > block.len {
            return Err(ModelError::Invalid(format!(
                "{len} cached KV positions do not fit slot {slot} at {at} ({} x {})",
                self.slots, self.capacity
            )));
        }
        if len == 0 {
            return Ok(());
        }
        // Linear-attention states: those after the block's end, when all of it is taken.
        if let (Some(end), true) = (&block.end, len == block.len) {
            for (t, e) in self.states.all().zip(end) {
                t.f_narrow(0, slot as i64, 1)?.f_copy_(e)?;
            }
        }
        for (i, t) in self.k.iter().chain(self.v.iter()).enumerate() {
            t.f_narrow(0, slot as i64, 1)?
                .f_narrow(2, at as i64, len as i64)?
                .f_copy_(
                    &block
                        .t
                        .f_narrow(0, i as i64, 1)?
                        .f_narrow(2, 0, len as i64)?,
                )?;
        }
        Ok(())
    }
}

/// Keys and values of `len` consecutive positions of one sequence, every attention layer,
/// in one tensor [2 x layers, kv_heads, len, head_dim] (keys of each layer, then values);
/// for a model with linear-attention layers, also their states after the last position.
pub struct KvBlock {
    t: Tensor,
    len: usize,
    /// The model has linear-attention layers: a sequence can resume only where a block
    /// has its `end` states.
    states: bool,
    /// Each state tensor of the sequence after position `len` ([1, ..] each).
    end: Option<Vec<Tensor>>,
}

impl KvBlock {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        let size = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        size(&self.t) + self.end.iter().flatten().map(size).sum::<usize>()
    }

    /// Whether a sequence can continue after the first `take` positions of this block:
    /// anywhere for attention alone, only after all of it (where its states were taken)
    /// with linear-attention layers.
    pub fn resumable(&self, take: usize) -> bool {
        !self.states || (take == self.len && self.end.is_some())
    }
    /// Keeps positions `0..at` and returns `at..`, each in its own storage (so dropping
    /// one gives its bytes back).
    pub fn split_off(&mut self, at: usize) -> Result<KvBlock, ModelError> {
        if at == 0 || at >= self.len {
            return Err(ModelError::Invalid(format!(
                "cannot split a KV block of {} positions at {at}",
                self.len
            )));
        }
        let tail = self
            .t
            .f_narrow(2, at as i64, (self.len - at) as i64)?
            .f_contiguous()?;
        let head = self.t.f_narrow(2, 0, at as i64)?.f_contiguous()?;
        // The states after the end go with the tail; the head ends where none were kept.
        let tail = KvBlock {
            t: tail,
            len: self.len - at,
            states: self.states,
            end: self.end.take(),
        };
        self.t = head;
        self.len = at;
        Ok(tail)
    }
}

impl Llama {
    fn kv_shape(&self) -> Shape {
        let linear = self.config.linear.as_ref().map(|h| {
            let (conv, rec) = super::linear::state_shapes(h);
            (h.layers.iter().filter(|&&l| l).count(), conv, rec)
        });
        Shape {
            layers: self.layers.len() - linear.map_or(0, |(n, _, _)| n),
            linear,
            kv_heads: self.config.num_key_value_heads as i64,
            head_dim: self.config.head_dim as i64,
            kind: self.act,
            device: self.device,
            limit: self.max_positions(),
        }
    }

    /// An empty cache for `batch` rows of up to `capacity` positions.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache, ModelError> {
        let shape = self.kv_shape();
        let capacity = capacity.min(shape.limit);
        let (k, v) = shape.zeros(batch, capacity)?;
        Ok(KvCache {
            k,
            v,
            states: shape.states(batch)?,
            len: 0,
            capacity,
            batch,
        })
    }

    /// Storage for `slots` sequences of up to `capacity` positions each (zeroed; capped at
    /// the model's context). [`SlotCache::resize`] changes both later.
    pub fn new_slot_cache(&self, slots: usize, capacity: usize) -> Result<SlotCache, ModelError> {
        let shape = self.kv_shape();
        let capacity = capacity.min(shape.limit);
        let (k, v) = shape.zeros(slots, capacity)?;
        Ok(SlotCache {
            k,
            v,
            states: shape.states(slots)?,
            slots,
            capacity,
            shape,
        })
    }
}
