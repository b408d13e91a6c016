//! LoRA adapters as PEFT writes them (`adapter_config.json` beside
//! `adapter_model.safetensors`), applied unmerged in f32: an adapted
//! projection computes `y = W x + s · B (A x)` with `A` `[r, in]`, `B`
//! `[out, r]` and `s = lora_alpha / r` (`lora_alpha / √r` with rsLoRA),
//! `r` and `lora_alpha` overridden per module by `rank_pattern` and
//! `alpha_pattern` as PEFT resolves them.
//!
//! Only the text decoder's attention and MLP projections can be adapted
//! (`q/k/v/o_proj`, `gate/up/down_proj`), the modules transformers builds
//! for each layer: KV-shared layers have no `k_proj`/`v_proj`, and a
//! full layer whose V is its K has no `v_proj`. Anything else an adapter
//! holds (embeddings, the head, MoE experts, DoRA magnitudes, modules
//! saved whole) is refused at load with the tensor or field named, as is
//! a tensor whose shape is not the module's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use candle_core::Tensor;
use gemma4_kernels::float::{widen, FloatMatrix, FloatType};
use gemma4_kernels::Bytes;
use gemma4_kernels::WeightMatrix;
use safetensors::tensor::{Dtype, SafeTensors};
use serde_json::Value;

use crate::config::{KvSource, TextConfig};
use crate::error::{ModelError, Result};
use crate::storage::{with_f32_values, KernelLinear, Linear};

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
    /// `lora_B` transposed, `[r, out]`: `B (A x)` is then `r` scaled rows
    /// added up, each read once in order.
    b_t: StoredFactor,
    scale: f64,
    rank: usize,
}

/// Activation rows up to which a module's products run on the calling
/// thread: a decode row's low-rank products are tens of thousands of
/// multiply-adds per module (rank 16 on E2B), less than waking the pool
/// costs twice (docs/serving.md has the measurement).
const INLINE_ROWS: usize = 8;

impl LoraModule {
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The scaling PEFT applies (`s`).
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// `s · B (A x)` for the rows of `x` (`[n, in]` → `[n, out]`); the
    /// scaling is applied to the `[n, r]` product.
    pub fn delta(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        let [rank, out] = self.b_t.shape;
        if n > INLINE_ROWS {
            // Many rows: both products as matrix products.
            let low = (self.a.linear.forward(x)? * self.scale)?;
            let mut b_t = vec![0f32; rank * out];
            widen(self.b_t.ty, self.b_t.bytes.as_slice(), &mut b_t);
            let b_t = Tensor::from_vec(b_t, (rank, out), x.device())?;
            return Ok(low.matmul(&b_t)?);
        }
        let a = self.a.matrix.as_ref();
        let mut low = vec![0f32; n * rank];
        with_f32_values(&x.contiguous()?, |xs| a.dots(0..rank, xs, n, &mut low))?;
        let scale = self.scale as f32;
        let mut delta = vec![0f32; n * out];
        let mut row = vec![0f32; out];
        let width = out * self.b_t.ty.size();
        for (k, bytes) in self.b_t.bytes.as_slice().chunks_exact(width).enumerate() {
            widen(self.b_t.ty, bytes, &mut row);
            for (t, d) in delta.chunks_exact_mut(out).enumerate() {
                let l = low[t * rank + k] * scale;
                d.iter_mut().zip(&row).for_each(|(d, w)| *d += l * w);
            }
        }
        Ok(Tensor::from_vec(delta, (n, out), x.device())?)
    }
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
    /// Reads the PEFT adapter folder `dir` (or its `adapter_config.json`'s
    /// folder) for the model `cfg` describes.
    pub fn load(name: &str, dir: &Path, cfg: &TextConfig) -> Result<Self> {
        let dir = if dir.is_file() {
            dir.parent().unwrap_or(Path::new("."))
        } else {
            dir
        };
        let config_path = dir.join("adapter_config.json");
        let settings = AdapterSettings::read(&config_path)?;
        let weights_path = dir.join("adapter_model.safetensors");
        let bytes = std::fs::read(&weights_path).map_err(|e| {
            let hint = if dir.join("adapter_model.bin").is_file() {
                " (only safetensors adapters are read; PEFT writes them by default)"
            } else {
                ""
            };
            ModelError::Input(format!(
                "cannot read LoRA weights {}: {e}{hint}",
                weights_path.display()
            ))
        })?;
        let file = SafeTensors::deserialize(&bytes).map_err(|e| {
            ModelError::Input(format!(
                "{} is not a usable safetensors file: {e}",
                weights_path.display()
            ))
        })?;
        let shown = weights_path.display().to_string();
        let halves = read_factors(&file, &shown)?;
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
            if a.shape != [rank, inp] || b.shape != [out, rank] {
                return Err(ModelError::Input(format!(
                    "{shown}: {module_name} has lora_A {:?} and lora_B {:?}, but the model's \
                     module takes {inp} values to {out} (expected [r, {inp}] and [{out}, r]); \
                     is the adapter for another model?",
                    a.shape, b.shape
                )));
            }
            let scale = settings.scale(&module_name, rank).map_err(|why| {
                ModelError::Input(format!("{}: {module_name}: {why}", config_path.display()))
            })?;
            max_rank = max_rank.max(rank);
            total += a.bytes.len() + b.bytes.len();
            let slot = Projection::ALL
                .iter()
                .position(|&p| p == proj)
                .unwrap_or_default();
            layers[layer][slot] = Some(LoraModule {
                a: a.factor()?,
                b_t: b.transposed(),
                scale,
                rank,
            });
        }
        Ok(Self {
            name: name.to_string(),
            path: dir.to_path_buf(),
            layers,
            max_rank,
            bytes: total,
        })
    }

    /// An adapter of rank `rank` on every projection the model has, with
    /// random bf16 factors (`seed` fixes them) and scaling 2: what a benchmark
    /// measures the cost of adapters with, not a fine-tune.
    pub fn random(name: &str, cfg: &TextConfig, rank: usize, seed: u64) -> Result<Self> {
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
                let a =
                    StoredFactor::bf16((0..rank * inp).map(|_| uniform() * a_scale), [rank, inp]);
                let b = StoredFactor::bf16((0..out * rank).map(|_| uniform() * 0.01), [out, rank]);
                bytes += a.bytes.len() + b.bytes.len();
                *slot = Some(LoraModule {
                    a: a.factor()?,
                    b_t: b.transposed(),
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

/// `(layer, projection, is lora_A)` of an adapter tensor's name, or why it
/// cannot be applied.
fn parse_name(name: &str) -> std::result::Result<(usize, Projection, bool), String> {
    let rest = name.strip_prefix("base_model.model.").unwrap_or(name);
    let rest = ["model.language_model.", "language_model.model.", "model."]
        .iter()
        .find_map(|p| rest.strip_prefix(p))
        .unwrap_or(rest);
    let (module, is_a) = if let Some(m) = rest.strip_suffix(".lora_A.weight") {
        (m, true)
    } else if let Some(m) = rest.strip_suffix(".lora_B.weight") {
        (m, false)
    } else if rest.contains("lora_magnitude_vector") {
        return Err("is a DoRA magnitude; DoRA adapters are not supported".into());
    } else if rest.contains("lora_embedding") {
        return Err("adapts an embedding; only the attention and MLP projections can be".into());
    } else {
        return Err(
            "is not a LoRA factor (only `lora_A.weight` / `lora_B.weight` of the attention \
             and MLP projections are read; modules saved whole are not supported)"
                .into(),
        );
    };
    let parts: Vec<&str> = module.split('.').collect();
    if let ["layers", n, parent, proj] = parts[..] {
        let layer = n
            .parse()
            .map_err(|_| format!("names layer `{n}`, which is not a number"))?;
        if let Some(p) = Projection::from_name(parent, proj) {
            return Ok((layer, p, is_a));
        }
    }
    if module.contains("experts") || module.contains("router") {
        return Err(
            "adapts the mixture of experts, which LoRA adapters cannot change here \
             (only the attention and dense MLP projections)"
                .into(),
        );
    }
    Err(
        "adapts a module that cannot be adapted: only the text decoder's \
         q/k/v/o_proj and gate/up/down_proj are"
            .into(),
    )
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
    fn bf16(values: impl Iterator<Item = f32>, shape: [usize; 2]) -> Self {
        let bytes = values
            .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        Self {
            bytes: Bytes::from_vec(bytes),
            ty: FloatType::Bf16,
            shape,
        }
    }

    /// The `[cols, rows]` transpose, in the same element type.
    fn transposed(self) -> Self {
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
        Self {
            bytes: Bytes::from_vec(out),
            ty: self.ty,
            shape: [cols, rows],
        }
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

fn read_factors(file: &SafeTensors<'_>, shown: &str) -> Result<Halves> {
    let mut halves = Halves::new();
    for (tensor_name, view) in file.tensors() {
        let bad = |why: String| ModelError::Input(format!("{shown}: `{tensor_name}` {why}"));
        let (layer, proj, is_a) = parse_name(&tensor_name).map_err(bad)?;
        let ty = match view.dtype() {
            Dtype::F32 => FloatType::F32,
            Dtype::BF16 => FloatType::Bf16,
            Dtype::F16 => FloatType::F16,
            other => {
                return Err(bad(format!(
                    "is stored as {other:?}; LoRA factors are read in bf16, f16 or f32"
                )))
            }
        };
        let [rows, cols] = view.shape()[..] else {
            return Err(bad(format!(
                "has shape {:?}; a LoRA factor is a matrix",
                view.shape()
            )));
        };
        let factor = StoredFactor {
            bytes: Bytes::from_vec(view.data().to_vec()),
            ty,
            shape: [rows, cols],
        };
        let entry = halves.entry((layer, proj)).or_default();
        if is_a {
            entry.0 = Some(factor);
        } else {
            entry.1 = Some(factor);
        }
    }
    Ok(halves)
}

/// The parts of `adapter_config.json` that decide the computation.
struct AdapterSettings {
    r: f64,
    alpha: f64,
    rslora: bool,
    /// In the file's order.
    rank_pattern: Vec<(regex::Regex, f64)>,
    alpha_pattern: Vec<(regex::Regex, f64)>,
}

impl AdapterSettings {
    fn read(path: &Path) -> Result<Self> {
        let shown = path.display();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ModelError::Input(format!("cannot read {shown}: {e}")))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Input(format!("{shown} is not valid JSON: {e}")))?;
        let Value::Object(fields) = json else {
            return Err(ModelError::Input(format!("{shown} is not a JSON object")));
        };
        let bad = |field: &str, why: &str| ModelError::Input(format!("{shown}: `{field}` {why}"));
        match fields.get("peft_type").and_then(|v| v.as_str()) {
            Some("LORA") | None => {}
            Some(other) => {
                return Err(bad(
                    "peft_type",
                    &format!("is {other}; only LORA adapters are read"),
                ))
            }
        }
        let truthy = |v: &Value| match v {
            Value::Null | Value::Bool(false) => false,
            Value::Array(a) => !a.is_empty(),
            Value::Object(o) => !o.is_empty(),
            Value::String(s) => !s.is_empty() && s != "none",
            _ => true,
        };
        for (field, what) in [
            ("use_dora", "DoRA"),
            ("lora_bias", "LoRA biases"),
            ("bias", "trained biases"),
            ("fan_in_fan_out", "transposed (fan_in_fan_out) factors"),
            ("modules_to_save", "modules saved whole"),
            ("target_parameters", "adapted parameters (MoE experts)"),
            ("layer_replication", "layer replication"),
            ("trainable_token_indices", "trained token embeddings"),
            ("alora_invocation_tokens", "activated LoRA"),
            ("use_qalora", "QA-LoRA"),
        ] {
            if fields.get(field).is_some_and(&truthy) {
                return Err(bad(
                    field,
                    &format!("asks for {what}, which is not supported"),
                ));
            }
        }
        let number = |field: &str| -> Result<f64> {
            fields
                .get(field)
                .and_then(|v| v.as_f64())
                .ok_or_else(|| bad(field, "is missing or not a number"))
        };
        let pattern = |field: &str| -> Result<Vec<(regex::Regex, f64)>> {
            let Some(v) = fields.get(field) else {
                return Ok(Vec::new());
            };
            // The crate keeps objects in the file's order (serde_json's
            // `preserve_order`): PEFT takes the first key that matches.
            let pairs = match v {
                Value::Null => return Ok(Vec::new()),
                Value::Object(o) => o,
                _ => return Err(bad(field, "is not an object")),
            };
            pairs
                .iter()
                .map(|(key, value)| {
                    let re = regex::Regex::new(&format!(r"^(.*\.)?({key})$")).map_err(|e| {
                        bad(
                            field,
                            &format!("key `{key}` is not a regular expression: {e}"),
                        )
                    })?;
                    let n = value
                        .as_f64()
                        .ok_or_else(|| bad(field, &format!("value of `{key}` is not a number")))?;
                    Ok((re, n))
                })
                .collect()
        };
        Ok(Self {
            r: number("r")?,
            alpha: number("lora_alpha")?,
            rslora: fields
                .get("use_rslora")
                .is_some_and(|v| v.as_bool() == Some(true)),
            rank_pattern: pattern("rank_pattern")?,
            alpha_pattern: pattern("alpha_pattern")?,
        })
    }

    /// PEFT's scaling of `module`, whose factors have rank `rank`.
    fn scale(&self, module: &str, rank: usize) -> std::result::Result<f64, String> {
        let find = |pattern: &[(regex::Regex, f64)], default: f64| {
            pattern
                .iter()
                .find(|(re, _)| re.is_match(module))
                .map_or(default, |&(_, v)| v)
        };
        let r = find(&self.rank_pattern, self.r);
        let alpha = find(&self.alpha_pattern, self.alpha);
        if r != rank as f64 {
            return Err(format!(
                "the config gives rank {r}, but lora_A has {rank} rows"
            ));
        }
        if r <= 0.0 {
            return Err(format!("rank {r} is not positive"));
        }
        Ok(if self.rslora {
            alpha / r.sqrt()
        } else {
            alpha / r
        })
    }
}
