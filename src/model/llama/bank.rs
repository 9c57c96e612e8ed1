//! Several LoRA adapters served at once on one base (S-LoRA/Punica's batched serving): the
//! model holds a bank of served adapters besides its own (attached) one, and a forward
//! pass may give each activation row its adapter. Rows of one adapter are gathered into a
//! run and multiplied by that adapter's stacked A and B (two products per fused layer and
//! run), then scattered back; rows of the base get no low-rank term. A pass whose rows all
//! have one adapter runs that adapter's products directly, with no gather.
//!
//! Without an adapter of the model's own, a pass that mixes adapters runs every adapter's
//! rows in two batched products per fused layer (Punica's gathered BGMV on LibTorch's
//! `bmm`): the rows are gathered into `[adapters, widest run, in]` (shorter runs padded;
//! the padding's outputs are dropped), multiplied by the bank's A and B stacked `[adapters, ..]` (ranks
//! padded to the largest with zeros), and scattered back. A pass with the model's own
//! adapter runs one pair of products per run instead.
//!
//! Owns: the bank and the per-row routing of one forward pass (the model's side, `impl
//! Llama`, is in `served`). Never schedules: the engine says which row has which adapter
//! (`Llama::with_adapter_rows`).

use std::cell::RefCell;

use tch::{Device, Kind, Tensor};

use super::lora::Adapter;
use crate::model::config::LlamaConfig;
use crate::model::ModelError;

/// The served adapters and their products stacked for the batched path.
#[derive(Default)]
pub(super) struct Bank {
    pub(super) adapters: Vec<Adapter>,
    stacks: RefCell<Option<Stacks>>,
}

/// Per layer and product: every bank adapter's A transposed `[adapters, in, R]` and scaled
/// B transposed `[adapters, R, out]` (R the largest stacked rank; zero padded), in `kind`,
/// as of the adapters' `generations`.
struct Stacks {
    kind: Kind,
    generations: Vec<u64>,
    per: Vec<LayerStacks>,
}

/// One layer's stacked `(Aᵀ, Bᵀ)` by product.
type LayerStacks = [Option<(Tensor, Tensor)>; 4];

/// A mixed pass's gather and scatter for the batched path.
pub(super) struct Gathered {
    /// The row of `x` for each of the `n · width` padded positions (a padding position
    /// takes row 0: its output is never read).
    gather: Tensor,
    /// Each row's position among the padded outputs (`n · width`: a zero row, for the
    /// base's rows).
    scatter: Tensor,
    /// Whether some row has no adapter (then the outputs get the zero row).
    base_rows: bool,
    /// The bank indices of the runs' adapters, when they are not the whole bank in order.
    used: Option<Tensor>,
    n: i64,
    width: i64,
}

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
        gathered: Option<Gathered>,
    },
}

/// Token ids at or above this cannot be served with a bank adapter: the prefix cache tags
/// a bank adapter's prompts in the bits above (see the engine's cache keys).
pub const MAX_BANK_VOCAB: usize = 1 << 24;
/// Adapters one bank holds at most (the tag above takes 8 bits).
pub const MAX_BANK_ADAPTERS: usize = 255;

impl Bank {
    /// The route of a pass whose row `r` takes `rows[r]` (see
    /// `Llama::with_adapter_rows`); `own_adapter`: the model has one.
    pub(super) fn route(
        &self,
        rows: &[Source],
        own_adapter: bool,
        device: Device,
    ) -> Result<Route, ModelError> {
        Ok(match rows.first() {
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
                        Tensor::f_from_slice(&order)?.f_to_device(device)?,
                        Tensor::f_from_slice(&inv)?.f_to_device(device)?,
                    ))
                };
                // Batched unless the model has its own adapter, or the runs are so uneven
                // (a long prompt beside short ones) that padding them to the widest would
                // more than double the rows.
                let widest = runs.iter().filter(|r| r.0.is_some()).map(|r| r.2).max();
                let banked = runs.iter().filter(|r| r.0.is_some()).count();
                let even = widest.is_some_and(|w| w as usize * banked <= 2 * rows.len());
                let gathered = match (own_adapter, even) {
                    (false, true) => Some(self.gathered(rows, &order, &runs, device)?),
                    _ => None,
                };
                Route::Runs {
                    perm,
                    runs,
                    rows: rows.len() as i64,
                    gathered,
                }
            }
        })
    }

    /// The batched path's indices for `rows` sorted by `order` into `runs`.
    fn gathered(
        &self,
        rows: &[Source],
        order: &[usize],
        runs: &[(Source, i64, i64)],
        device: Device,
    ) -> Result<Gathered, ModelError> {
        let banked: Vec<(usize, i64, i64)> = runs
            .iter()
            .filter_map(|&(s, start, n)| s.map(|i| (i, start, n)))
            .collect();
        let n = banked.len() as i64;
        let width = banked.iter().map(|r| r.2).max().unwrap_or(0);
        let zero_out = n * width;
        let mut gather = vec![0i64; (n * width) as usize];
        let mut scatter = vec![zero_out; rows.len()];
        for (k, &(_, start, len)) in banked.iter().enumerate() {
            for j in 0..len {
                let row = order[(start + j) as usize] as i64;
                let at = k as i64 * width + j;
                gather[at as usize] = row;
                scatter[row as usize] = at;
            }
        }
        let in_order =
            banked.len() == self.adapters.len() && banked.iter().enumerate().all(|(k, r)| r.0 == k);
        let used = if in_order {
            None
        } else {
            let ids: Vec<i64> = banked.iter().map(|r| r.0 as i64).collect();
            Some(Tensor::f_from_slice(&ids)?.f_to_device(device)?)
        };
        let dev = device;
        Ok(Gathered {
            gather: Tensor::f_from_slice(&gather)?.f_to_device(dev)?,
            scatter: Tensor::f_from_slice(&scatter)?.f_to_device(dev)?,
            used,
            n,
            width,
            base_rows: rows.iter().any(Option::is_none),
        })
    }

    /// The batched low-rank term of product `p` of layer `l` for `x` [rows, in].
    pub(super) fn gathered_delta(
        &self,
        g: &Gathered,
        l: usize,
        p: usize,
        x: &Tensor,
        out: i64,
        c: &LlamaConfig,
    ) -> Result<Option<Tensor>, ModelError> {
        if g.n == 0 {
            return Ok(None);
        }
        let kind = x.kind();
        let mut st = self.stacks.borrow_mut();
        let generations: Vec<u64> = self.adapters.iter().map(Adapter::generation).collect();
        if st
            .as_ref()
            .is_none_or(|s| s.kind != kind || s.generations != generations)
        {
            *st = Some(Stacks {
                kind,
                per: stack_bank(&self.adapters, kind, c)?,
                generations,
            });
        }
        let Some((at, bt)) = st.as_ref().and_then(|s| s.per[l][p].as_ref()) else {
            return Ok(None);
        };
        let (at, bt) = match &g.used {
            None => (at.shallow_clone(), bt.shallow_clone()),
            Some(ids) => (at.f_index_select(0, ids)?, bt.f_index_select(0, ids)?),
        };
        let in_ = x.size()[1];
        let xp = x
            .f_index_select(0, &g.gather)?
            .f_view([g.n, g.width, in_])?;
        let y = xp.f_bmm(&at)?.f_bmm(&bt)?.f_view([g.n * g.width, out])?;
        let y = if g.base_rows {
            let zero = Tensor::f_zeros([1, out], (kind, x.device()))?;
            Tensor::f_cat(&[y, zero], 0)?
        } else {
            y
        };
        Ok(Some(y.f_index_select(0, &g.scatter)?))
    }
}

/// [`Stacks::per`] for `adapters`.
fn stack_bank(
    adapters: &[Adapter],
    kind: Kind,
    c: &LlamaConfig,
) -> Result<Vec<LayerStacks>, ModelError> {
    let _g = tch::no_grad_guard();
    let n = adapters.len() as i64;
    let mut per = Vec::with_capacity(c.num_hidden_layers);
    for l in 0..c.num_hidden_layers {
        let mut layer: LayerStacks = Default::default();
        for (p, slot) in layer.iter_mut().enumerate() {
            let parts = adapters
                .iter()
                .map(|a| a.stacked_product(l, p, kind, c))
                .collect::<Result<Vec<_>, _>>()?;
            let Some(r) = parts.iter().flatten().map(|(a, _)| a.size()[0]).max() else {
                continue;
            };
            let Some((a0, b0)) = parts.iter().flatten().next() else {
                continue;
            };
            let (in_, out, dev) = (a0.size()[1], b0.size()[0], a0.device());
            let at = Tensor::f_zeros([n, in_, r], (kind, dev))?;
            let bt = Tensor::f_zeros([n, r, out], (kind, dev))?;
            for (k, part) in parts.iter().enumerate() {
                if let Some((a, b)) = part {
                    let rk = a.size()[0];
                    at.f_select(0, k as i64)?
                        .f_narrow(1, 0, rk)?
                        .f_copy_(&a.f_transpose(0, 1)?)?;
                    bt.f_select(0, k as i64)?
                        .f_narrow(0, 0, rk)?
                        .f_copy_(&b.f_transpose(0, 1)?)?;
                }
            }
            *slot = Some((at, bt));
        }
        per.push(layer);
    }
    Ok(per)
}
