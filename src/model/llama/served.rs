//! The model's side of serving several adapters (see [`super::bank`]): adding adapters to
//! the bank, giving a forward pass's rows their adapters, and the low-rank terms the
//! decoder adds after each fused product.

use tch::Tensor;

use super::bank::{Route, Source, MAX_BANK_ADAPTERS, MAX_BANK_VOCAB};
use super::lora::{Adapter, Target, PRODUCTS};
use super::Llama;
use crate::model::ModelError;

impl Llama {
    /// Adds `a` to the bank of served adapters; returns its index (a request's adapter).
    /// The adapter serves from stacked copies of its values: after changing them in place,
    /// call [`Adapter::changed`].
    pub fn add_served_adapter(&mut self, a: Adapter) -> Result<usize, ModelError> {
        if self.adapter.as_ref().is_some_and(Adapter::is_merged) {
            return Err(ModelError::Invalid(
                "this model serves its own adapter merged: it serves no other adapters".into(),
            ));
        }
        if self.config.vocab_size >= MAX_BANK_VOCAB {
            return Err(ModelError::Invalid(format!(
                "a vocabulary of {} tokens is too large to serve bank adapters (at most {})",
                self.config.vocab_size, MAX_BANK_VOCAB
            )));
        }
        if self.bank.adapters.len() >= MAX_BANK_ADAPTERS {
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
        self.bank.adapters.push(a);
        Ok(self.bank.adapters.len() - 1)
    }

    /// The number of adapters in the bank.
    pub fn served_adapters(&self) -> usize {
        self.bank.adapters.len()
    }

    /// Bank adapter `i`.
    pub fn served_adapter(&self, i: usize) -> Option<&Adapter> {
        self.bank.adapters.get(i)
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
        let route = self.bank.route(rows, self.adapter.is_some(), self.device)?;
        self.routed(route, f)
    }

    fn check_source(&self, s: Source) -> Result<(), ModelError> {
        match s {
            Some(i) if i >= self.bank.adapters.len() => Err(ModelError::Invalid(format!(
                "adapter {i} is not served ({} in the bank)",
                self.bank.adapters.len()
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
            Some(i) => self.bank.adapters[i].delta(l, targets, x, &self.config),
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
        let (perm, runs, rows, gathered) = match route.as_ref() {
            None => return self.source_delta(None, l, targets, x),
            Some(Route::All(s)) => return self.source_delta(*s, l, targets, x),
            Some(Route::Runs {
                perm,
                runs,
                rows,
                gathered,
            }) => (perm, runs, *rows, gathered),
        };
        if x.dim() != 2 || x.size()[0] != rows {
            return Err(ModelError::Invalid(format!(
                "adapters were given for {rows} rows, the activations are {:?}",
                x.size()
            )));
        }
        let out: i64 = targets.iter().map(|t| t.dims(&self.config).1).sum();
        if let (Some(g), Some(p)) = (gathered, PRODUCTS.iter().position(|&t| t == targets)) {
            return self.bank.gathered_delta(g, l, p, x, out, &self.config);
        }
        let xs = match perm {
            Some((order, _)) => x.f_index_select(0, order)?,
            None => x.shallow_clone(),
        };
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
