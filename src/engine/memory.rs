//! The engine's KV memory under one budget: the running sequences' slots (grown as the
//! longest sequence grows, given back when the batch empties) and the prefix cache (a
//! [`PrefixTree`] of [`KvBlock`]s, holding what the slots leave of the budget, at most
//! `prefix_cache_bytes`).
//!
//! Owns: where keys and values live between requests. Never schedules.

use super::handle::EngineStats;
use super::prefix::{Piece, PrefixTree, Span};
use crate::model::llama::{KvBlock, SlotCache};
use crate::model::ModelError;
use std::sync::atomic::Ordering::Relaxed;

/// Slot capacity grows in steps of this many positions (each growth copies the live
/// positions once).
const GROW_POSITIONS: usize = 256;
/// Cached prefixes shorter than this are not worth a lookup's copies.
pub const MIN_REUSE: usize = 16;

impl Span for KvBlock {
    type Error = ModelError;
    fn bytes(&self) -> usize {
        KvBlock::bytes(self)
    }
    fn split_off(&mut self, at: usize) -> Result<KvBlock, ModelError> {
        KvBlock::split_off(self, at)
    }
    fn resumable(&self, take: usize) -> bool {
        KvBlock::resumable(self, take)
    }
}

pub struct KvMemory {
    pub slots: SlotCache,
    tree: PrefixTree<KvBlock>,
    /// Bytes for slots and cache together.
    budget: usize,
    prefix_cap: usize,
    max_slots: usize,
    /// Bumped by every weight update: a sequence started in an older epoch holds keys of
    /// old weights and is not cached.
    pub epoch: u64,
}

impl KvMemory {
    /// `slots` is the (empty) slot storage; `budget_positions` KV positions in all, at most
    /// `prefix_cache_bytes` of them for the prefix cache; `max_slots` sequences at once.
    pub fn new(
        slots: SlotCache,
        budget_positions: usize,
        prefix_cache_bytes: usize,
        max_slots: usize,
    ) -> KvMemory {
        let budget = budget_positions.saturating_mul(slots.bytes_per_position());
        let prefix_cap = prefix_cache_bytes.min(budget);
        KvMemory {
            slots,
            tree: PrefixTree::new(prefix_cap),
            budget,
            prefix_cap,
            max_slots,
            epoch: 0,
        }
    }

    /// Positions one request may hold: the budget shared by the full batch, within the
    /// model's context.
    pub fn per_request(budget_positions: usize, max_slots: usize, limit: usize) -> usize {
        (budget_positions / max_slots.max(1)).max(2).min(limit)
    }

    /// Makes the slots hold at least `n` sequences of `need` positions, keeping the live
    /// ones (`live[i]` positions of slot `i`); the prefix cache gives way.
    pub fn fit(&mut self, n: usize, need: usize, live: &[usize]) -> Result<(), ModelError> {
        let (have_n, have_cap) = (self.slots.slots(), self.slots.capacity());
        if n <= have_n && need <= have_cap {
            return Ok(());
        }
        let slots = n.max(have_n).next_multiple_of(4).min(self.max_slots).max(n);
        let capacity = need
            .max(have_cap)
            .next_multiple_of(GROW_POSITIONS)
            .min(self.slots.limit())
            .max(need);
        self.reshape(slots, capacity, live)
    }

    /// Gives back what the batch no longer needs: everything when it is empty, else the
    /// slots and positions beyond twice what it holds.
    pub fn trim(&mut self, live: &[usize]) -> Result<(), ModelError> {
        if live.is_empty() {
            return self.reshape(0, 0, &[]);
        }
        let longest = live.iter().copied().max().unwrap_or(0) + 1;
        let want_cap = longest
            .next_multiple_of(GROW_POSITIONS)
            .min(self.slots.limit());
        let want_n = live.len().next_multiple_of(4).min(self.max_slots);
        if self.slots.capacity() > 2 * want_cap || self.slots.slots() > 2 * want_n {
            return self.reshape(want_n, want_cap, live);
        }
        Ok(())
    }

    fn reshape(&mut self, slots: usize, capacity: usize, live: &[usize]) -> Result<(), ModelError> {
        let bpp = self.slots.bytes_per_position();
        let slot_bytes =
            slots * (capacity.min(self.slots.limit()) * bpp + self.slots.bytes_per_sequence());
        // The cache first makes room, so slots plus cache never exceed the budget.
        self.tree
            .set_budget(self.prefix_cap.min(self.budget.saturating_sub(slot_bytes)));
        self.slots.resize(slots, capacity, live)
    }

    /// Whether the prefix cache may hold anything.
    pub fn caching(&self) -> bool {
        self.prefix_cap > 0
    }

    /// Copies the longest cached prefix of `prompt` (leaving at least its last token to
    /// compute) into `slot`; returns its length (0: none worth taking).
    pub fn reuse(&mut self, slot: usize, prompt: &[u32]) -> Result<usize, ModelError> {
        let pieces = self.resumable(prompt);
        let total: usize = pieces.iter().map(|p| p.take).sum();
        if total < MIN_REUSE {
            return Ok(0);
        }
        let mut at = 0;
        for p in pieces {
            let block = self
                .tree
                .span(p.node)
                .ok_or_else(|| ModelError::Invalid("prefix cache lost a node".into()))?;
            self.slots.load(slot, at, block, p.take)?;
            at += p.take;
        }
        Ok(total)
    }

    /// The length of `prompt`'s cached prefix (without marking it used), for admission.
    pub fn cached(&mut self, prompt: &[u32]) -> usize {
        self.resumable(prompt).iter().map(|p| p.take).sum()
    }

    /// The cached prefix of `prompt` up to where a sequence can resume (for a model with
    /// linear-attention layers, the end of a block that kept their states).
    fn resumable(&mut self, prompt: &[u32]) -> Vec<Piece> {
        let mut pieces = self.tree.lookup(prompt, prompt.len().saturating_sub(1));
        let keep = pieces
            .iter()
            .rposition(|p| self.tree.span(p.node).is_some_and(|s| s.resumable(p.take)))
            .map_or(0, |i| i + 1);
        pieces.truncate(keep);
        pieces
    }

    /// Stores the keys and values of `tokens`, the first `tokens.len()` positions of
    /// `slot`, computed in epoch `epoch` (not stored when the weights changed since).
    pub fn remember(&mut self, slot: usize, tokens: &[u32], epoch: u64) {
        if epoch != self.epoch || self.tree.budget() == 0 || tokens.len() < MIN_REUSE {
            return;
        }
        let slots = &self.slots;
        if let Err(e) = self
            .tree
            .insert(tokens, |start, len| slots.extract(slot, start, len))
        {
            tracing::warn!("caching a prefix failed (it is recomputed next time): {e}");
        }
    }

    /// A weight update: nothing cached so far may be reused.
    pub fn invalidate(&mut self, stats: &EngineStats) {
        stats
            .prefix_invalidated_positions
            .fetch_add(self.tree.positions() as u64, Relaxed);
        self.tree.clear();
        self.epoch += 1;
    }

    pub fn publish(&self, stats: &EngineStats) {
        stats
            .kv_allocated_bytes
            .store(self.slots.bytes() + self.tree.bytes(), Relaxed);
        stats.prefix_bytes.store(self.tree.bytes(), Relaxed);
        stats
            .prefix_evictions
            .store(self.tree.counters().evicted_nodes, Relaxed);
    }
}
