//! Several LoRA adapters served at once on one base (S-LoRA/Punica's batched serving): the
//! model holds a bank of served adapters besides its own (attached) one, and a forward
//! pass may give each activation row its adapter. Rows of one adapter are gathered into a
//! run and multiplied by that adapter's stacked A and B (two products per fused layer and
//! run), then scattered back; rows of the base get no low-rank term. A pass whose rows all
//! have one adapter runs that adapter's products directly, with no gather.
//!
//! Owns: the bank and the per-row routing of one forward pass. Never schedules: the
//! engine says which row has which adapter ([`Llama::with_adapter_rows`]).

use tch::Tensor;

use super::lora::{Adapter, Target};
use super::Llama;
use crate::model::ModelError;

/// Where a row's low-rank terms come from: `None` is the model's own adapter if it has one
/// (else the base alone), `Some(i)` the bank's adapter `i`.
pub type Source = Option<usize>;

/// The adapters of one forward pass's rows.
pub(super) enum Route {
    /// Every row from one source.
    All(Source),
    /// Rows in runs by source: `perm` gathers the rows into runs (absent: they already
    /// are), `inv` puts them back.
    Runs {
        perm: Option<(Tensor, Tensor)>,
        runs: Vec<(Source, i64, i64)>,
        rows: i64,
    },
}

/// Token ids at or above this cannot be served with a bank adapter: the prefix cache tags
/// a bank adapter's prompts in the bits above (see the engine's cache keys).
pub const MAX_BANK_VOCAB: usize = 1 << 24;
/// Adapters one bank holds at most (the tag above takes 8 bits).
pub const MAX_BANK_ADAPTERS: usize = 255;

impl Llama {
    /// Adds `a` to the bank of served adapters; returns its index (a request's adapter).
    /// The adapter serves from stacked copies of its values: after changing them in place,
    /// call [`Adapter::changed`].
    pub fn add_served_adapter(&mut self, a: Adapter) -> Result<usize, ModelError> {
        if self.config.vocab_size >= MAX_BANK_VOCAB {
            return Err(ModelError::Invalid(format!(
                "a vocabulary of {} tokens is too large to serve bank adapters (at most {})",
                self.config.vocab_size, MAX_BANK_VOCAB
            )));
        }
        if self.bank.len() >= MAX_BANK_ADAPTERS {
            return Err(ModelError::Invalid(format!(
                "at most {MAX_BANK_ADAPTERS} adapters are served by one model"
            )));
        }
        if a.tensors().iter().any(|t| t.device() != self.device) {
            return Err(ModelError::Invalid(
                "the adapter's tensors are not on the model's device".into(),
            ));
        }
        for mut t in a.tensors() {
            let _ = t.requires_grad_(false);
        }
        a.set_serving();
        self.bank.push(a);
        Ok(self.bank.len() - 1)
    }

    /// The number of adapters in the bank.
    pub fn served_adapters(&self) -> usize {
        self.bank.len()
    }

    /// Bank adapter `i`.
    pub fn served_adapter(&self, i: usize) -> Option<&Adapter> {
        self.bank.get(i)
    }

    /// Runs `f` (one or more forward passes) with every activation row taking its low-rank
    /// terms from `source`.
    pub fn with_served_adapter<R>(
        &self,
        source: Source,
        f: impl FnOnce() -> Result<R, ModelError>,
    ) -> Result<R, ModelError> {
        self.check_source(source)?;
        self.routed(Route::All(source), f)
    }

    /// Runs `f` (one forward pass whose activations have `rows.len()` rows, e.g. the
    /// packed tokens of a prefill or the sequences of a decode step) with row `r` taking
    /// its low-rank terms from `rows[r]`.
    pub fn with_adapter_rows<R>(
        &self,
        rows: &[Source],
        f: impl FnOnce() -> Result<R, ModelError>,
    ) -> Result<R, ModelError> {
        for &s in rows {
            self.check_source(s)?;
        }
        let route = match rows.first() {
            None => Route::All(None),
            Some(&first) if rows.iter().all(|&s| s == first) => Route::All(first),
            Some(_) => {
                // A stable sort by source keeps each source's rows in order.
                let mut order: Vec<usize> = (0..rows.len()).collect();
                order.sort_by_key(|&r| rows[r].map_or(0, |i| i + 1));
                let mut runs: Vec<(Source, i64, i64)> = Vec::new();
                for (at, &r) in order.iter().enumerate() {
                    match runs.last_mut() {
                        Some((s, _, n)) if *s == rows[r] => *n += 1,
                        _ => runs.push((rows[r], at as i64, 1)),
                    }
                }
                let perm = if order.iter().enumerate().all(|(a, &r)| a == r) {
                    None
                } else {
                    let mut inv = vec![0i64; rows.len()];
                    for (at, &r) in order.iter().enumerate() {
                        inv[r] = at as i64;
                    }
                    let order: Vec<i64> = order.iter().map(|&r| r as i64).collect();
                    Some((
                        Tensor::f_from_slice(&order)?.f_to_device(self.device)?,
                        Tensor::f_from_slice(&inv)?.f_to_device(self.device)?,
                    ))
                };
                Route::Runs {
                    perm,
                    runs,
                    rows: rows.len() as i64,
                }
            }
        };
        self.routed(route, f)
    }

    fn check_source(&self, s: Source) -> Result<(), ModelError> {
        match s {
            Some(i) if i >= self.bank.len() => Err(ModelError::Invalid(format!(
                "adapter {i} is not served ({} in the bank)",
                self.bank.len()
            ))),
            _ => Ok(()),
        }
    }

    fn routed<R>(
        &self,
        route: Route,
        f: impl FnOnce() -> Result<R, ModelError>,
    ) -> Result<R, ModelError> {
        let before = self.route.replace(Some(route));
        let r = f();
        self.route.replace(before);
        r
    }

    /// The low-rank term of `targets` from `source` for `x`.
    fn source_delta(
        &self,
        source: Source,
        l: usize,
        targets: &[Target],
        x: &Tensor,
    ) -> Result<Option<Tensor>, ModelError> {
        match source {
            None => match &self.adapter {
                None => Ok(None),
                Some(a) => a.delta(l, targets, x, &self.config),
            },
            Some(i) => self.bank[i].delta(l, targets, x, &self.config),
        }
    }

    /// The low-rank term of layer `l`'s `targets` for `x` [rows, in] under the current
    /// route (none: the model's own adapter).
    pub(super) fn lora(
        &self,
        l: usize,
        targets: &[Target],
        x: &Tensor,
    ) -> Result<Option<Tensor>, ModelError> {
        let route = self.route.borrow();
        let (perm, runs, rows) = match route.as_ref() {
            None => return self.source_delta(None, l, targets, x),
            Some(Route::All(s)) => return self.source_delta(*s, l, targets, x),
            Some(Route::Runs { perm, runs, rows }) => (perm, runs, *rows),
        };
        if x.dim() != 2 || x.size()[0] != rows {
            return Err(ModelError::Invalid(format!(
                "adapters were given for {rows} rows, the activations are {:?}",
                x.size()
            )));
        }
        let xs = match perm {
            Some((order, _)) => x.f_index_select(0, order)?,
            None => x.shallow_clone(),
        };
        let out: i64 = targets.iter().map(|t| t.dims(&self.config).1).sum();
        let mut pieces = Vec::with_capacity(runs.len());
        let mut any = false;
        for &(source, start, n) in runs {
            match self.source_delta(source, l, targets, &xs.f_narrow(0, start, n)?)? {
                Some(d) => {
                    any = true;
                    pieces.push(d);
                }
                None => pieces.push(Tensor::f_zeros([n, out], (x.kind(), x.device()))?),
            }
        }
        if !any {
            return Ok(None);
        }
        let d = Tensor::f_cat(&pieces, 0)?;
        Ok(Some(match perm {
            Some((_, inv)) => d.f_index_select(0, inv)?,
            None => d,
        }))
    }
}
