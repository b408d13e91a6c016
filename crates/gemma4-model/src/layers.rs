//! Building blocks shared by the decoder: RMSNorm, rotary embeddings and
//! the numerically careful softmax. Linear layers and embedding tables are
//! in [`crate::storage`].

use candle_core::{DType, Device, Tensor, D};

use crate::error::Result;

/// RMSNorm over the last dimension, computed in f32 (on the CPU in one pass
/// by the kernels, bit for bit the tensor operations of `forward_ops`):
/// `x · (mean(x²) + eps)^-½ · w`. `weight = None` is the scale-less variant
/// (Gemma 4's `v_norm` and router norm).
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Option<Tensor>,
    /// The weight's values when it is an f32 vector on the CPU (empty for
    /// no weight), for the kernels' one-pass norm.
    cpu_weight: Option<Vec<f32>>,
    eps: f64,
}

impl RmsNorm {
    pub fn new(weight: Option<Tensor>, eps: f64) -> Self {
        let cpu_weight = match &weight {
            None => Some(Vec::new()),
            Some(w) if w.dtype() == DType::F32 && w.rank() == 1 && w.device().is_cpu() => {
                w.to_vec1::<f32>().ok()
            }
            Some(_) => None,
        };
        Self {
            weight,
            cpu_weight,
            eps,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(w) = &self.cpu_weight {
            let d = x.dim(D::Minus1)?;
            if d > 0
                && x.dtype() == DType::F32
                && x.device().is_cpu()
                && (w.is_empty() || w.len() == d)
            {
                let mut values = x.flatten_all()?.to_vec1::<f32>()?;
                gemma4_kernels::norm::rms_norm(&mut values, d, self.eps as f32, w);
                return Ok(Tensor::from_vec(values, x.shape(), x.device())?);
            }
        }
        self.forward_ops(x)
    }

    /// [`RmsNorm::forward`] as tensor operations (any dtype and device).
    fn forward_ops(&self, x: &Tensor) -> Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let inv = (ms + self.eps)?.sqrt()?.recip()?;
        let y = x.broadcast_mul(&inv)?;
        Ok(match &self.weight {
            Some(w) => y.broadcast_mul(w)?,
            None => y,
        })
    }
}

/// Softmax over the last dimension, max-subtracted, in f32.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&sum)?)
}

/// `cap · tanh(x / cap)`: the kernels' vectorized pass for f32 on the CPU
/// (split over their threads for a vocabulary's worth of logits), the
/// tensor library's ops elsewhere.
pub fn softcap(x: &Tensor, cap: f64) -> Result<Tensor> {
    if x.dtype() == DType::F32 && matches!(x.device(), Device::Cpu) {
        let mut values = x.flatten_all()?.to_vec1::<f32>()?;
        let cap = cap as f32;
        split_elementwise(&mut values, &|_, part| {
            gemma4_kernels::softcap::softcap(cap, part)
        });
        return Ok(Tensor::from_vec(values, x.shape(), x.device())?);
    }
    Ok(((x / cap)?.tanh()? * cap)?)
}

/// Rotary embedding for one layer shape, in the rotate-half layout.
#[derive(Debug, Clone)]
pub struct Rotary {
    /// `[head_dim / 2]`; zeros for pairs that are not rotated.
    inv_freq: Vec<f32>,
    position_scale: f32,
}

impl Rotary {
    pub fn new(spec: &crate::config::RopeSpec) -> Self {
        let half = spec.head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| {
                if i < spec.rotated_pairs {
                    // Matches the reference's f32 evaluation of 1 / theta^(2i/d).
                    let exponent = (2 * i) as f32 / spec.head_dim as f32;
                    1.0f32 / (spec.theta as f32).powf(exponent)
                } else {
                    0.0
                }
            })
            .collect();
        Self {
            inv_freq,
            position_scale: spec.position_scale as f32,
        }
    }

    /// `(cos, sin)` for the given positions, each `[n, head_dim]`.
    pub fn cos_sin(&self, positions: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut freqs = Vec::with_capacity(positions.len() * half * 2);
        for &p in positions {
            let pos = p as f32 / self.position_scale;
            let row: Vec<f32> = self.inv_freq.iter().map(|f| pos * f).collect();
            freqs.extend_from_slice(&row);
            freqs.extend_from_slice(&row);
        }
        let emb = Tensor::from_vec(freqs, (positions.len(), half * 2), device)?;
        Ok((emb.cos()?, emb.sin()?))
    }

    /// `x`: `[n, heads, head_dim]`; cos/sin: `[n, head_dim]`.
    pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let d = x.dim(D::Minus1)?;
        let x1 = x.narrow(D::Minus1, 0, d / 2)?;
        let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        let cos = cos.unsqueeze(1)?;
        let sin = sin.unsqueeze(1)?;
        Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
    }
}

/// `gelu_pytorch_tanh(gate) · up`, in one pass of the kernels' vectorized
/// activation over f32 CPU tensors (the tensor library's otherwise).
pub fn gated_gelu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dtype() == DType::F32 && up.dtype() == DType::F32 && gate.shape() == up.shape() {
        if let (Device::Cpu, Device::Cpu) = (gate.device(), up.device()) {
            let (g, u) = (gate.contiguous()?, up.contiguous()?);
            let (gs, gl) = g.storage_and_layout();
            let (us, ul) = u.storage_and_layout();
            if let (
                candle_core::Storage::Cpu(candle_core::CpuStorage::F32(gd)),
                candle_core::Storage::Cpu(candle_core::CpuStorage::F32(ud)),
            ) = (&*gs, &*us)
            {
                let n = gate.elem_count();
                let gd = &gd[gl.start_offset()..gl.start_offset() + n];
                let ud = &ud[ul.start_offset()..ul.start_offset() + n];
                let mut out = vec![0f32; n];
                gelu_tanh_mul_split(gd, ud, &mut out);
                return Ok(Tensor::from_vec(out, gate.shape(), gate.device())?);
            }
        }
    }
    Ok((gate.gelu()? * up)?)
}

/// Elements from which [`gated_gelu`] and [`softcap`] split their pass over
/// the kernels' threads (a prompt's MLP or a step's logits; a decode step's
/// MLP rows stay on one thread).
const PARALLEL_MIN: usize = 1 << 16;

/// `f(at, part)` for the parts of `out` starting at element `at`: the whole
/// of it on this thread below [`PARALLEL_MIN`] elements, else one part per
/// thread of the kernels' pool. For element-wise passes, where each value
/// is computed alone and the split leaves every value as is.
fn split_elementwise(out: &mut [f32], f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    let pool = gemma4_kernels::pool::global();
    if pool.threads() == 1 || out.len() < PARALLEL_MIN {
        return f(0, out);
    }
    let chunk = out.len().div_ceil(pool.threads()).next_multiple_of(64);
    pool.for_each_chunk(out, chunk, &|i, part| f(i * chunk, part));
}

/// [`gemma4_kernels::gelu::gelu_tanh_mul`] in parts over the kernels' pool.
fn gelu_tanh_mul_split(gate: &[f32], up: &[f32], out: &mut [f32]) {
    split_elementwise(out, &|at, part| {
        let len = part.len();
        gemma4_kernels::gelu::gelu_tanh_mul(&gate[at..at + len], &up[at..at + len], part)
    });
}

/// Ids as an index tensor.
pub fn ids_tensor(ids: &[u32], device: &Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(ids, ids.len(), device)?.to_dtype(DType::U32)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-pass kernel gives the tensor operations' values bit for bit
    /// (where the tensor library sums in its AVX2 order), so a norm does not
    /// depend on which path runs it.
    #[test]
    fn the_norm_kernel_is_the_tensor_operations_bit_for_bit() -> Result<()> {
        #[cfg(target_arch = "x86_64")]
        if !is_x86_feature_detected!("avx2") {
            return Ok(());
        }
        let dev = Device::Cpu;
        for d in [7usize, 32, 256, 640, 1536 + 5] {
            let x: Vec<f32> = (0..3 * d)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.37)
                .collect();
            let x = Tensor::from_vec(x, (3, d), &dev)?;
            let w: Vec<f32> = (0..d).map(|i| 1.0 + (i % 13) as f32 * 0.01).collect();
            for weight in [None, Some(Tensor::from_vec(w.clone(), d, &dev)?)] {
                let norm = RmsNorm::new(weight, 1e-6);
                let fast = norm.forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
                let ops = norm.forward_ops(&x)?.flatten_all()?.to_vec1::<f32>()?;
                for (i, (a, b)) in fast.iter().zip(&ops).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "d={d} [{i}]: {a} vs {b}");
                }
            }
        }
        Ok(())
    }
}
