//! LoRA adapters, applied unmerged in f32: an adapted projection computes
//! `y = W x + s · B (A x)` with `A` `[r, in]` and `B` `[out, r]`. Two
//! files are read: PEFT's folders ([`peft`]: `s = lora_alpha / r`, or
//! `lora_alpha / √r` with rsLoRA, per-module patterns) and llama.cpp's
//! GGUF LoRA files ([`gguf`]: `s = alpha / r`).
//!
//! Only the text decoder's attention and MLP projections can be adapted
//! (`q/k/v/o_proj`, `gate/up/down_proj`), the modules transformers builds
//! for each layer: KV-shared layers have no `k_proj`/`v_proj`, and a
//! full layer whose V is its K has no `v_proj`. Anything else an adapter
//! holds (embeddings, the head, MoE experts, DoRA magnitudes, modules
//! saved whole) is refused at load with the tensor or field named, as is
//! a tensor whose shape is not the module's.

mod gguf;
mod peft;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Tensor;
use gemma4_kernels::float::{FloatMatrix, FloatType};
use gemma4_kernels::panel::{PanelMatrix, PANEL};
use gemma4_kernels::Bytes;
use gemma4_kernels::WeightMatrix;

use crate::config::{KvSource, TextConfig};
use crate::error::{ModelError, Result};
use crate::storage::{with_f32_values, with_f32_values_mut, KernelLinear, Linear};

/// The projections an adapter may change, in the order a layer runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Projection {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Projection {
    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// The module's name in the reference (`q_proj`, …).
    pub fn name(self) -> &'static str {
        match self {
            Projection::Q => "q_proj",
            Projection::K => "k_proj",
            Projection::V => "v_proj",
            Projection::O => "o_proj",
            Projection::Gate => "gate_proj",
            Projection::Up => "up_proj",
            Projection::Down => "down_proj",
        }
    }

    /// `self_attn` or `mlp`.
    fn parent(self) -> &'static str {
        match self {
            Projection::Q | Projection::K | Projection::V | Projection::O => "self_attn",
            Projection::Gate | Projection::Up | Projection::Down => "mlp",
        }
    }

    fn from_name(parent: &str, name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.parent() == parent && p.name() == name)
    }
}

/// One adapted projection: `s · B (A x)`, its factors kept as stored
/// (f32, bf16 or f16) and multiplied by the float kernels with f32
/// activations.
#[derive(Debug)]
pub struct LoraModule {
    /// `[r, in]`.
    a: Factor,
    /// `lora_B` transposed, `[r, out]`, in column panels: `B (A x)` is
    /// then `r` scaled rows added up, a slice of outputs at a time.
    b_t: PanelMatrix,
    scale: f64,
    rank: usize,
}

/// A module's activation rows up to which its products take the grouped
/// path ([`add_terms`]): each factor row read once for all of them, the
/// work of every module in the step split over the pool together. More
/// rows (a prompt) go through matrix products.
const FEW_ROWS: usize = 8;

/// Values of one output row an expand task adds at least: smaller tasks
/// cost more to hand out than they save.
const MIN_EXPAND_WIDTH: usize = 256;

impl LoraModule {
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The scaling PEFT applies (`s`).
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// `s · B (A x)` for the rows of `x` (`[n, in]` → `[n, out]`) as
    /// matrix products over the pool; the scaling is applied to the
    /// `[n, r]` product.
    fn delta_product(&self, x: &Tensor) -> Result<Tensor> {
        let (rank, out) = (self.b_t.rows(), self.b_t.cols());
        let low = (self.a.linear.forward(x)? * self.scale)?;
        let b_t = Tensor::from_vec(self.b_t.to_f32_rows(), (rank, out), x.device())?;
        Ok(low.matmul(&b_t)?)
    }

    /// Adds `Σ_k low[k] · s · Bᵀ[k, cols]` into `out` (`cols` starting at
    /// `from`): the same sums in the same order however the columns are
    /// split.
    fn expand_into(&self, low: &[f32], from: usize, out: &mut [f32]) {
        let scale = self.scale as f32;
        let mut coeffs = [0f32; 64];
        if low.len() <= coeffs.len() {
            for (c, l) in coeffs.iter_mut().zip(low) {
                *c = l * scale;
            }
            self.b_t.add_combination(&coeffs[..low.len()], from, out);
        } else {
            let coeffs: Vec<f32> = low.iter().map(|l| l * scale).collect();
            self.b_t.add_combination(&coeffs, from, out);
        }
    }
}

/// One module applied to some rows of a step: the rows (of `x` and `y`)
/// of the sequences whose adapter has this module.
pub type ModuleRows<'a> = (&'a LoraModule, Vec<u32>);

/// Adds each group's low-rank term `s · B (A x)` to its own rows of `y`
/// (`[n, out]`, the base product of `x`, `[n, in]`). A row belongs to one
/// group at most. Groups of a few rows (decode) share one split over the
/// pool: the `[rows, r]` products of every group, then every group's rows
/// of `y` in column slices. Larger groups run as matrix products.
///
/// `y`'s values may be changed in place: it must be a tensor nothing
/// else holds (a product's fresh output).
pub fn add_terms(groups: &[ModuleRows<'_>], x: &Tensor, y: Tensor) -> Result<Tensor> {
    let n = x.dim(0)?;
    let mut y = y;
    let mut few = Vec::new();
    for group in groups {
        let (module, rows) = group;
        if rows.len() <= FEW_ROWS {
            few.push(group);
        } else if rows.len() == n {
            // Every row (rows are distinct and in range): no gather.
            y = (y + module.delta_product(x)?)?;
        } else {
            let index = crate::layers::ids_tensor(rows, x.device())?;
            let delta = module.delta_product(&x.index_select(&index, 0)?)?;
            y = y.index_add(&index, &delta, 0)?;
        }
    }
    if few.is_empty() {
        return Ok(y);
    }
    let lows = with_f32_values(&x.contiguous()?, |xs| shrink(&few, xs))??;
    let (rows, cols) = y.dims2()?;
    // The base product's own values, changed in place where they can be.
    if let Some(done) = with_f32_values_mut(&y, |values| expand(&few, &lows, values, cols))? {
        done?;
        return Ok(y);
    }
    let mut values = y.flatten_all()?.to_vec1::<f32>()?;
    expand(&few, &lows, &mut values, cols)?;
    Ok(Tensor::from_vec(values, (rows, cols), x.device())?)
}

/// Each group's `[rows, r]` product `A x` (unscaled) of its rows of `xs`.
/// Tasks: a group's factor rows in pieces, enough pieces in all for every
/// thread.
fn shrink(groups: &[&ModuleRows<'_>], xs: &[f32]) -> Result<Vec<Vec<f32>>> {
    let pool = gemma4_kernels::pool::global();
    let gathered: Vec<Vec<f32>> = groups
        .iter()
        .map(|(module, rows)| {
            let width = module.a.matrix.cols();
            let mut g = Vec::with_capacity(rows.len() * width);
            for &r in rows {
                let r = r as usize;
                let row = xs.get(r * width..(r + 1) * width).ok_or_else(|| {
                    ModelError::Input(format!("LoRA row {r} is outside the step's activations"))
                })?;
                g.extend_from_slice(row);
            }
            Ok(g)
        })
        .collect::<Result<_>>()?;
    let pieces = (2 * pool.threads()).div_ceil(groups.len()).max(1);
    let tasks: Vec<(usize, std::ops::Range<usize>)> = groups
        .iter()
        .enumerate()
        .flat_map(|(g, (module, _))| {
            let step = module.rank.div_ceil(pieces).max(1);
            (0..module.rank)
                .step_by(step)
                .map(move |k| (g, k..(k + step).min(module.rank)))
        })
        .collect();
    let parts = pool.map(tasks.len(), &|i| {
        let (g, ks) = &tasks[i];
        let (module, rows) = groups[*g];
        let mut out = vec![0f32; rows.len() * ks.len()];
        module
            .a
            .matrix
            .dots(ks.clone(), &gathered[*g], rows.len(), &mut out);
        out
    });
    let mut lows: Vec<Vec<f32>> = groups
        .iter()
        .map(|(module, rows)| vec![0f32; rows.len() * module.rank])
        .collect();
    for ((g, ks), part) in tasks.iter().zip(parts) {
        let rank = groups[*g].0.rank;
        for (t, piece) in part.chunks_exact(ks.len()).enumerate() {
            lows[*g][t * rank + ks.start..t * rank + ks.end].copy_from_slice(piece);
        }
    }
    Ok(lows)
}

/// Adds every group's term to its rows of `y` (`cols` values each):
/// tasks are column slices of single rows, whole panels of `Bᵀ`.
fn expand(groups: &[&ModuleRows<'_>], lows: &[Vec<f32>], y: &mut [f32], cols: usize) -> Result<()> {
    let pool = gemma4_kernels::pool::global();
    let rows: usize = groups.iter().map(|(_, r)| r.len()).sum();
    let width = (rows * cols)
        .div_ceil(4 * pool.threads())
        .max(MIN_EXPAND_WIDTH)
        .next_multiple_of(PANEL)
        .min(cols.max(1));
    let mut y_rows: Vec<Option<&mut [f32]>> = y.chunks_exact_mut(cols.max(1)).map(Some).collect();
    let (mut parts, mut tasks) = (Vec::new(), Vec::new());
    for (g, (module, rows)) in groups.iter().enumerate() {
        if module.b_t.cols() != cols {
            return Err(ModelError::Input(format!(
                "a LoRA module of {} outputs applied to a product of {cols}",
                module.b_t.cols()
            )));
        }
        for (t, &r) in rows.iter().enumerate() {
            let row = y_rows
                .get_mut(r as usize)
                .and_then(Option::take)
                .ok_or_else(|| {
                    ModelError::Input(format!("LoRA row {r} is outside the step or in two groups"))
                })?;
            for (c, part) in row.chunks_mut(width).enumerate() {
                parts.push(part);
                tasks.push((g, t, c * width));
            }
        }
    }
    pool.for_each_part(parts, &|i, part| {
        let (g, t, from) = tasks[i];
        let rank = groups[g].0.rank;
        groups[g]
            .0
            .expand_into(&lows[g][t * rank..(t + 1) * rank], from, part);
    });
    Ok(())
}

/// A loaded adapter: per decoder layer, the projections it changes.
#[derive(Debug)]
pub struct LoraAdapter {
    name: String,
    path: PathBuf,
    layers: Vec<[Option<LoraModule>; 7]>,
    max_rank: usize,
    bytes: usize,
}

impl LoraAdapter {
    /// Reads the adapter at `path` for the model `cfg` describes: a PEFT
    /// folder (or its `adapter_config.json`), or a llama.cpp GGUF LoRA file.
    pub fn load(name: &str, path: &Path, cfg: &TextConfig) -> Result<Self> {
        let read = if gguf::is_gguf(path) {
            gguf::read(path)?
        } else {
            peft::read(path)?
        };
        Self::assemble(name, read, cfg)
    }

    /// Checks every factor pair against the module it adapts and builds
    /// the modules.
    fn assemble(name: &str, read: ReadAdapter, cfg: &TextConfig) -> Result<Self> {
        let ReadAdapter {
            path,
            shown,
            halves,
            scaling,
        } = read;
        if halves.is_empty() {
            return Err(ModelError::Input(format!("{shown} holds no LoRA tensors")));
        }
        let mut layers: Vec<[Option<LoraModule>; 7]> = Vec::new();
        layers.resize_with(cfg.num_layers(), Default::default);
        let mut max_rank = 0;
        let mut total = 0;
        for ((layer, proj), pair) in halves {
            let module_name = format!(
                "model.language_model.layers.{layer}.{}.{}",
                proj.parent(),
                proj.name()
            );
            let (Some(a), Some(b)) = pair else {
                return Err(ModelError::Input(format!(
                    "{shown}: {module_name} has only one of lora_A and lora_B"
                )));
            };
            let (out, inp) = module_shape(cfg, layer, proj)
                .map_err(|why| ModelError::Input(format!("{shown}: {module_name} {why}")))?;
            let rank = a.shape[0];
            if rank == 0 || a.shape != [rank, inp] || b.shape != [out, rank] {
                return Err(ModelError::Input(format!(
                    "{shown}: {module_name} has lora_A {:?} and lora_B {:?}, but the model's \
                     module takes {inp} values to {out} (expected [r, {inp}] and [{out}, r]); \
                     is the adapter for another model?",
                    a.shape, b.shape
                )));
            }
            let scale = scaling.scale(&module_name, rank)?;
            max_rank = max_rank.max(rank);
            total += a.bytes.len() + b.bytes.len();
            let slot = Projection::ALL
                .iter()
                .position(|&p| p == proj)
                .unwrap_or_default();
            layers[layer][slot] = Some(LoraModule {
                a: a.factor()?,
                b_t: b.transposed_panels()?,
                scale,
                rank,
            });
        }
        Ok(Self {
            name: name.to_string(),
            path,
            layers,
            max_rank,
            bytes: total,
        })
    }

    /// An adapter of rank `rank` on every projection the model has, with
    /// random factors stored as `ty` (`seed` fixes them) and scaling 2: what
    /// a benchmark measures the cost of adapters with, not a fine-tune.
    pub fn random(
        name: &str,
        cfg: &TextConfig,
        rank: usize,
        ty: FloatType,
        seed: u64,
    ) -> Result<Self> {
        if rank == 0 {
            return Err(ModelError::Input("a LoRA rank must be at least 1".into()));
        }
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut uniform = move || {
            // xorshift64*, mapped to [-1, 1)
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let x = state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
            x as f32 / (1u64 << 23) as f32 - 1.0
        };
        let mut layers: Vec<[Option<LoraModule>; 7]> = Vec::new();
        let mut bytes = 0;
        for layer in 0..cfg.num_layers() {
            let mut slots: [Option<LoraModule>; 7] = Default::default();
            for (slot, proj) in slots.iter_mut().zip(Projection::ALL) {
                let Ok((out, inp)) = module_shape(cfg, layer, proj) else {
                    continue;
                };
                let a_scale = 1.0 / (inp as f32).sqrt();
                let a = (0..rank * inp).map(|_| uniform() * a_scale);
                let a = StoredFactor::encode(a, ty, [rank, inp]);
                let b = (0..out * rank).map(|_| uniform() * 0.01);
                let b = StoredFactor::encode(b, ty, [out, rank]);
                bytes += a.bytes.len() + b.bytes.len();
                *slot = Some(LoraModule {
                    a: a.factor()?,
                    b_t: b.transposed_panels()?,
                    scale: 2.0,
                    rank,
                });
            }
            layers.push(slots);
        }
        Ok(Self {
            name: name.to_string(),
            path: PathBuf::new(),
            layers,
            max_rank: rank,
            bytes,
        })
    }

    /// The name requests choose it by.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The folder it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The largest rank of its modules.
    pub fn max_rank(&self) -> usize {
        self.max_rank
    }

    /// Bytes its factors hold.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The adapted projections, `(layer, projection, module)`.
    pub fn modules(&self) -> impl Iterator<Item = (usize, Projection, &LoraModule)> {
        self.layers.iter().enumerate().flat_map(|(i, slots)| {
            slots
                .iter()
                .zip(Projection::ALL)
                .filter_map(move |(m, p)| m.as_ref().map(|m| (i, p, m)))
        })
    }

    /// The module adapting `proj` of `layer`, if the adapter changes it.
    pub fn module(&self, layer: usize, proj: Projection) -> Option<&LoraModule> {
        let slot = Projection::ALL.iter().position(|&p| p == proj)?;
        self.layers.get(layer)?[slot].as_ref()
    }
}

/// `(out, in)` of `proj` on `layer`, or why the model has no such module.
fn module_shape(
    cfg: &TextConfig,
    layer: usize,
    proj: Projection,
) -> std::result::Result<(usize, usize), String> {
    let spec = cfg.layers.get(layer).ok_or_else(|| {
        format!(
            "names layer {layer}, but the model has {} layers; is the adapter for another model?",
            cfg.num_layers()
        )
    })?;
    let h = cfg.hidden_size;
    let q = cfg.num_attention_heads * spec.head_dim;
    let kv = spec.num_kv_heads * spec.head_dim;
    let own_kv = matches!(spec.kv, KvSource::Own);
    Ok(match proj {
        Projection::Q => (q, h),
        Projection::K | Projection::V if !own_kv => {
            return Err(
                "does not exist: the layer reads another layer's K/V (KV sharing); \
                 is the adapter for another model?"
                    .into(),
            )
        }
        Projection::V if spec.v_is_k => {
            return Err(
                "does not exist: the layer's V is its K (attention_k_eq_v); \
                 is the adapter for another model?"
                    .into(),
            )
        }
        Projection::K | Projection::V => (kv, h),
        Projection::O => (h, q),
        Projection::Gate | Projection::Up => (spec.intermediate_size, h),
        Projection::Down => (h, spec.intermediate_size),
    })
}

/// A LoRA factor as stored: its bytes, element type and `[rows, cols]`.
#[derive(Debug)]
struct StoredFactor {
    bytes: Bytes,
    ty: FloatType,
    shape: [usize; 2],
}

impl StoredFactor {
    /// `values` stored as `ty` (rounded to nearest).
    fn encode(values: impl Iterator<Item = f32>, ty: FloatType, shape: [usize; 2]) -> Self {
        let bytes = match ty {
            FloatType::F32 => values.flat_map(f32::to_le_bytes).collect(),
            FloatType::Bf16 => values
                .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            FloatType::F16 => values
                .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
        };
        Self {
            bytes: Bytes::from_vec(bytes),
            ty,
            shape,
        }
    }

    /// The `[cols, rows]` transpose, in the same element type, in column
    /// panels.
    fn transposed_panels(self) -> Result<PanelMatrix> {
        let [rows, cols] = self.shape;
        let size = self.ty.size();
        let src = self.bytes.as_slice();
        let mut out = vec![0u8; src.len()];
        for r in 0..rows {
            for c in 0..cols {
                let from = (r * cols + c) * size;
                let to = (c * rows + r) * size;
                out[to..to + size].copy_from_slice(&src[from..from + size]);
            }
        }
        PanelMatrix::from_row_major(&out, self.ty, cols, rows).ok_or_else(|| {
            ModelError::Input(format!("a LoRA factor's bytes are not [{rows}, {cols}]"))
        })
    }

    fn factor(self) -> Result<Factor> {
        let [rows, cols] = self.shape;
        let m: Arc<dyn WeightMatrix> = Arc::new(
            FloatMatrix::new(self.bytes, self.ty, rows, cols).ok_or_else(|| {
                ModelError::Input(format!("a LoRA factor's bytes are not [{rows}, {cols}]"))
            })?,
        );
        Ok(Factor {
            linear: Linear::new(Arc::new(KernelLinear::new(m.clone()))),
            matrix: m,
        })
    }
}

/// A factor's matrix, for products on the calling thread, and the same
/// matrix as a [`Linear`], for products over the pool.
#[derive(Debug)]
struct Factor {
    matrix: Arc<dyn WeightMatrix>,
    linear: Linear,
}

/// Both factors of each adapted projection in an adapter file, by
/// `(layer, projection)`: `(lora_A, lora_B)`.
type Halves = HashMap<(usize, Projection), (Option<StoredFactor>, Option<StoredFactor>)>;

/// Why an adapter that changes the experts is refused.
const EXPERTS_REFUSED: &str = "adapts the mixture of experts, which LoRA adapters cannot change \
     here (only the attention and dense MLP projections)";

/// An adapter file's factors, before they are checked against the model.
struct ReadAdapter {
    /// What [`LoraAdapter::path`] reports.
    path: PathBuf,
    /// The file that holds the factors, for messages.
    shown: String,
    halves: Halves,
    scaling: Box<dyn Scaling>,
}

/// How a file's format scales a module's term.
trait Scaling {
    /// `s` of `module` (its reference name), whose factors have rank `rank`.
    fn scale(&self, module: &str, rank: usize) -> Result<f64>;
}
