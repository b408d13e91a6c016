//! The loader context: a weight source plus the storage policy.
//!
//! The model asks for "the linear `layers.3.self_attn.q_proj.weight`" or
//! "the embedding table `embed_tokens.weight`" and gets an operation; which
//! storage and kernel serve it is decided here, from how the tensor is
//! stored and from the [`LoadPolicy`] (as stored, int8 or 4-bit; exact f32
//! activations or candle's 8-bit-activation GGUF kernels). A device or
//! tensor-parallel shard choice would live here too.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::Tensor;
use gemma4_kernels::int8::Int8Matrix;
use gemma4_kernels::kquant_x8;
use gemma4_kernels::q4::{Q4Matrix, Q4Report};
use gemma4_kernels::{Precision, Rearranged, WeightMatrix};

use crate::error::{ModelError, Result};
use crate::source::WeightSource;
use crate::storage::{
    CandleQuantLinear, Embedding, Experts, KernelLinear, Linear, RowsEmbedding, StoredDtype,
    StoredTensor,
};

/// The storage name of compressed-tensors int4 matrices in load reports.
pub const PACKED_INT4: &str = "int4 (compressed-tensors)";

/// What matrices stored as floats become in memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Quant {
    /// As stored (bf16 stays bf16, mapped from the file).
    #[default]
    AsStored,
    /// Symmetric int8, one scale per output channel.
    Int8,
    /// 4-bit groups of 32 on the Q4_0 grid, one f32 scale per group.
    Q4,
}

impl Quant {
    pub fn name(self) -> &'static str {
        match self {
            Quant::AsStored => "as stored",
            Quant::Int8 => "int8",
            Quant::Q4 => "q4",
        }
    }
}

impl std::str::FromStr for Quant {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" | "as-stored" => Ok(Quant::AsStored),
            "int8" => Ok(Quant::Int8),
            "q4" | "q4_0" => Ok(Quant::Q4),
            other => Err(format!(
                "unknown quantization `{other}` (choose none, int8, q4 or q4_0)"
            )),
        }
    }
}

/// How a load keeps and runs weights.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadPolicy {
    /// Quantization of matrices stored as floats (GGUF blocks stay as they are).
    pub quant: Quant,
    /// f32 activations against every quantized matrix (exact against the
    /// widened weights). Without it, quantized matrices (GGUF blocks,
    /// `--quant` layouts) take integer kernels that round activations to 8
    /// bits per block, and the types our kernels lack (Q2_K, Q3_K) run
    /// through candle's, which do the same. Float matrices are exact either way.
    pub exact: bool,
    /// Map every matrix as stored and report the bytes a load would hold
    /// (what `plan` measures): the k-quant matrices a load copies into
    /// another layout are counted at the copy's size, not copied.
    pub measure_only: bool,
}

/// Where a load's bytes went, by storage.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    /// Per storage name: matrices and bytes.
    pub by_storage: BTreeMap<&'static str, (usize, u64)>,
    /// Bytes of weights every step reads (they become resident).
    pub resident_bytes: u64,
    /// Bytes of tables read by row from the mapping (only looked-up rows become resident).
    pub table_bytes: u64,
    /// Bytes of floats that were quantized on load.
    pub quantized_from_bytes: u64,
    /// 4-bit quantization: groups, and those already on their grid.
    pub q4: Q4Report,
    /// Matrices stored as floats that every step reads: elements, rows, bytes as stored.
    pub float_matrices: (u64, u64, u64),
}

impl LoadReport {
    /// `storage: matrices` per storage, for one-line summaries.
    pub fn storage_summary(&self) -> String {
        self.by_storage
            .iter()
            .map(|(k, (n, b))| format!("{k} ×{n} ({:.1} MiB)", *b as f64 / (1 << 20) as f64))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Resident weight bytes of the same checkpoint under `quant`, from a
    /// report of a load as stored.
    pub fn projected_weights(&self, quant: Quant) -> u64 {
        let (elements, rows, bytes) = self.float_matrices;
        let quantized = match quant {
            Quant::AsStored => bytes,
            Quant::Int8 => elements + 4 * rows,
            // 16 bytes of nibbles and a 4-byte scale per 32 values.
            Quant::Q4 => elements / 32 * 20,
        };
        self.resident_bytes - bytes + quantized
    }

    /// Whether the 4-bit quantization found the weights already on a Q4_0
    /// grid (a quantization-aware-trained checkpoint), so nothing was lost.
    pub fn q4_grid_detected(&self) -> bool {
        self.q4.groups > 0 && self.q4.on_grid * 100 >= self.q4.groups * 99
    }
}

/// Progress of a load: bytes of stored tensors handled so far, and in all.
pub type Progress<'a> = &'a dyn Fn(u64, u64);

/// The loader context handed to the model's constructor.
pub struct Weights<'a> {
    src: &'a dyn WeightSource,
    policy: LoadPolicy,
    report: RefCell<LoadReport>,
    progress: Option<Progress<'a>>,
    done: Cell<u64>,
}

impl<'a> Weights<'a> {
    pub fn new(src: &'a dyn WeightSource, policy: LoadPolicy) -> Self {
        Self {
            src,
            policy,
            report: RefCell::new(LoadReport::default()),
            progress: None,
            done: Cell::new(0),
        }
    }

    pub fn with_progress(mut self, progress: Progress<'a>) -> Self {
        self.progress = Some(progress);
        self
    }

    pub fn policy(&self) -> LoadPolicy {
        self.policy
    }

    pub fn report(&self) -> LoadReport {
        self.report.borrow().clone()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.src.contains(name)
    }

    pub fn norms_include_gemma3_offset(&self) -> bool {
        self.src.norms_include_gemma3_offset()
    }

    fn advance(&self, t: &StoredTensor) {
        self.done.set(self.done.get() + t.bytes.len() as u64);
        if let Some(p) = self.progress {
            p(self.done.get(), self.src.total_bytes());
        }
    }

    fn record(&self, storage: &'static str, bytes: usize, resident: bool) {
        let mut r = self.report.borrow_mut();
        let e = r.by_storage.entry(storage).or_default();
        e.0 += 1;
        e.1 += bytes as u64;
        if resident {
            r.resident_bytes += bytes as u64;
        } else {
            r.table_bytes += bytes as u64;
        }
    }

    /// A small tensor (norm weights, scales) widened to f32.
    pub fn vector(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.src.stored(name, shape)?;
        self.advance(&t);
        self.report.borrow_mut().resident_bytes += 4 * t.elements() as u64;
        Ok(Tensor::from_vec(
            t.to_f32()?,
            shape,
            &candle_core::Device::Cpu,
        )?)
    }

    /// The weight matrix `[out, in]` of a linear layer.
    pub fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear> {
        if let Some(packed) = self.src.packed_linear(name, out, inp) {
            // Already 4-bit in the checkpoint's own format: kept as it is,
            // whatever the policy asks of float matrices.
            let m = packed?;
            self.record(PACKED_INT4, m.stored_bytes(), true);
            return Ok(self.kernel_linear(Arc::new(m)));
        }
        let t = self.src.stored(name, &[out, inp])?;
        self.advance(&t);
        self.linear_from(&t, out, inp)
    }

    /// An embedding table `[rows, dim]`, read by row from its mapping. The
    /// stored tensor is returned too, for a head tied to it.
    pub fn embedding(
        &self,
        name: &str,
        rows: usize,
        dim: usize,
    ) -> Result<(Embedding, StoredTensor)> {
        let t = self.src.stored(name, &[rows, dim])?;
        self.advance(&t);
        let m = t.matrix(rows, dim)?;
        self.record(m.storage(), m.stored_bytes(), false);
        Ok((
            Embedding::new(Arc::new(RowsEmbedding::new(m).reading_from(&t))),
            t,
        ))
    }

    /// The output head tied to an embedding table: the same bytes as stored,
    /// or their quantized copy.
    pub fn tied_head(&self, table: &StoredTensor) -> Result<Linear> {
        let (rows, cols) = match table.shape[..] {
            [r, c] => (r, c),
            _ => {
                return Err(ModelError::Input(format!(
                    "`{}` is not a matrix",
                    table.name
                )))
            }
        };
        // Read in full every step, so no longer a by-row table.
        {
            let mut r = self.report.borrow_mut();
            r.table_bytes = r.table_bytes.saturating_sub(table.bytes.len() as u64);
            let name = table.dtype.name();
            if let Some(e) = r.by_storage.get_mut(name) {
                e.0 = e.0.saturating_sub(1);
                e.1 = e.1.saturating_sub(table.bytes.len() as u64);
                if e.0 == 0 {
                    r.by_storage.remove(name);
                }
            }
        }
        let head = self.linear_from(table, rows, cols)?;
        if head.storage() != table.dtype.name() {
            // Quantized or copied: the lookups read the table by row again.
            let mut r = self.report.borrow_mut();
            r.table_bytes += table.bytes.len() as u64;
        }
        Ok(head)
    }

    /// The experts of an MoE layer: `gate_up` `[e, 2·inter, hidden]` and
    /// `down` `[e, hidden, inter]`, one matrix per expert.
    pub fn experts(
        &self,
        gate_up: &str,
        down: &str,
        e: usize,
        inter: usize,
        h: usize,
    ) -> Result<Experts> {
        let gu = self.src.stored(gate_up, &[e, 2 * inter, h])?;
        let dn = self.src.stored(down, &[e, h, inter])?;
        self.advance(&gu);
        self.advance(&dn);
        let mut out = Experts {
            gate_up: Vec::with_capacity(e),
            down: Vec::with_capacity(e),
        };
        for i in 0..e {
            out.gate_up
                .push(self.linear_from(&gu.index_first(i)?, 2 * inter, h)?);
            out.down
                .push(self.linear_from(&dn.index_first(i)?, h, inter)?);
        }
        Ok(out)
    }

    /// The linear op for a stored matrix, by the policy.
    fn linear_from(&self, t: &StoredTensor, rows: usize, cols: usize) -> Result<Linear> {
        let matrix: Arc<dyn WeightMatrix> = match t.dtype {
            StoredDtype::Float(_)
            | StoredDtype::Ggml(GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) => {
                let m = t.matrix(rows, cols)?;
                {
                    let mut r = self.report.borrow_mut();
                    r.float_matrices.0 += (rows * cols) as u64;
                    r.float_matrices.1 += rows as u64;
                    r.float_matrices.2 += m.stored_bytes() as u64;
                }
                match self.policy.quant {
                    Quant::AsStored => self.in_arena(t)?.matrix(rows, cols)?,
                    quant => self.quantize(t, rows, cols, quant)?,
                }
            }
            // Q4_K, Q6_K, Q8_0, Q4_0 and Q5_0 in the fast mode on a CPU with
            // VNNI: eight rows interleaved for their kernels, a copy that
            // replaces the mapping.
            StoredDtype::Ggml(
                d @ (GgmlDType::Q4K
                | GgmlDType::Q6K
                | GgmlDType::Q8_0
                | GgmlDType::Q4_0
                | GgmlDType::Q5_0),
            ) if !self.policy.exact
                && gemma4_kernels::intdot::has_vnni()
                && rows.is_multiple_of(kquant_x8::ROWS) =>
            {
                use gemma4_kernels::block32_x8::{Q4_0Rows8, Q5_0Rows8, Q8_0Rows8};
                use kquant_x8::{Q4KRows8, Q6KRows8};
                let m = match d {
                    GgmlDType::Q4K => self.interleave::<Q4KRows8>(t, rows, cols)?,
                    GgmlDType::Q6K => self.interleave::<Q6KRows8>(t, rows, cols)?,
                    GgmlDType::Q4_0 => self.interleave::<Q4_0Rows8>(t, rows, cols)?,
                    GgmlDType::Q5_0 => self.interleave::<Q5_0Rows8>(t, rows, cols)?,
                    _ => self.interleave::<Q8_0Rows8>(t, rows, cols)?,
                };
                return Ok(self.kernel_linear(m));
            }
            // Our kernels over a copy of the blocks; exact mode takes the
            // remaining types through widened tiles.
            StoredDtype::Ggml(d) if self.policy.exact || has_kernel(d) => {
                self.in_arena(t)?.matrix(rows, cols)?
            }
            StoredDtype::Ggml(d) => {
                let op = CandleQuantLinear::new(t.bytes.as_slice(), d, rows, cols)?;
                // The blocks now live in candle's copy.
                t.release();
                self.record(crate::storage::ggml_name(d), t.bytes.len(), true);
                return Ok(Linear::new(Arc::new(op)));
            }
        };
        self.record(matrix.storage(), matrix.stored_bytes(), true);
        Ok(self.kernel_linear(matrix))
    }

    /// A linear op over one of our kernels, with the policy's activations.
    fn kernel_linear(&self, matrix: Arc<dyn WeightMatrix>) -> Linear {
        let precision = if self.policy.exact {
            Precision::Exact
        } else {
            Precision::Int8Activations
        };
        Linear::new(Arc::new(KernelLinear::with_precision(matrix, precision)))
    }

    /// `t` with its bytes copied into [arena](gemma4_kernels::arena) memory
    /// (huge pages where the system grants them: every step reads a
    /// matrix in full). A mapped tensor is read from the file, not the
    /// mapping, so its pages never count as this process's memory beside
    /// the copy. A measuring load keeps the mapping.
    fn in_arena(&self, t: &StoredTensor) -> Result<StoredTensor> {
        if self.policy.measure_only {
            return Ok(t.clone());
        }
        let mut piece = gemma4_kernels::arena::alloc_zeroed(t.bytes.len());
        t.copy_to(piece.as_mut_slice())?;
        Ok(StoredTensor::new(
            t.name.clone(),
            t.dtype,
            t.shape.clone(),
            gemma4_kernels::Bytes::new(Arc::new(piece)),
        ))
    }

    /// A matrix with rows interleaved for its kernel, rearranged a slice of
    /// rows at a time, each slice's mapped pages dropped once it is copied,
    /// and recorded in the report. A measuring load keeps the mapping and
    /// records the rearranged size.
    fn interleave<M: Rearranged + 'static>(
        &self,
        t: &StoredTensor,
        rows: usize,
        cols: usize,
    ) -> Result<Arc<dyn WeightMatrix>> {
        const SLICE_BYTES: usize = 16 << 20;
        if self.policy.measure_only {
            let m = t.matrix(rows, cols)?;
            self.record(M::NAME, M::bytes_for(rows, cols), true);
            return Ok(m);
        }
        let misfit = || {
            ModelError::Input(format!(
                "`{}` cannot be read as a [{rows}, {cols}] {} matrix",
                t.name,
                t.dtype.name()
            ))
        };
        let mut m = M::with_capacity(rows, cols).ok_or_else(misfit)?;
        let row_bytes = (t.bytes.len() / rows.max(1)).max(1);
        let step = (SLICE_BYTES / row_bytes / M::GROUP_ROWS).max(1) * M::GROUP_ROWS;
        for start in (0..rows).step_by(step) {
            let part = t.row_range(start..(start + step).min(rows), cols)?;
            if !m.append_gguf(part.bytes.as_slice()) {
                return Err(misfit());
            }
            part.release();
        }
        if m.rows() != rows {
            return Err(misfit());
        }
        self.record(M::NAME, m.stored_bytes(), true);
        Ok(Arc::new(m))
    }

    /// Quantizes a float matrix a slice of rows at a time, dropping each
    /// slice's float pages once it is quantized, so a load never holds more
    /// than one slice of floats beside the quantized weights.
    fn quantize(
        &self,
        t: &StoredTensor,
        rows: usize,
        cols: usize,
        quant: Quant,
    ) -> Result<Arc<dyn WeightMatrix>> {
        const SLICE_BYTES: usize = 16 << 20;
        let row_bytes = (t.bytes.len() / rows.max(1)).max(1);
        let step = (SLICE_BYTES / row_bytes).max(1);
        // A width 4-bit groups cannot tile keeps 8 bits. Each slice is
        // quantized straight into the matrix's final buffer.
        let mut q4 = (quant == Quant::Q4)
            .then(|| Q4Matrix::with_capacity(rows, cols))
            .flatten();
        let mut int8 = q4.is_none().then(|| Int8Matrix::with_capacity(rows, cols));
        let misfit = || ModelError::Input(format!("`{}`: quantized slices do not fit", t.name));
        for start in (0..rows).step_by(step) {
            let part = t.row_range(start..(start + step).min(rows), cols)?;
            let m = part.matrix(part.shape[0], cols)?;
            if let Some(q) = q4.as_mut() {
                let rep = q.append_quantized(m.as_ref()).ok_or_else(misfit)?;
                let mut r = self.report.borrow_mut();
                r.q4.groups += rep.groups;
                r.q4.on_grid += rep.on_grid;
            } else if let Some(q) = int8.as_mut() {
                if !q.append_quantized(m.as_ref()) {
                    return Err(misfit());
                }
            }
            part.release();
        }
        self.report.borrow_mut().quantized_from_bytes += t.bytes.len() as u64;
        Ok(match (q4, int8) {
            (Some(q), _) => Arc::new(q),
            (None, Some(q)) => Arc::new(q),
            (None, None) => return Err(misfit()),
        })
    }
}

/// GGUF block types our kernels run in place; the rest (Q2_K, Q3_K) go
/// through candle's quantized matmul unless exact mode is asked for.
fn has_kernel(d: GgmlDType) -> bool {
    matches!(
        d,
        GgmlDType::Q8_0
            | GgmlDType::Q4_0
            | GgmlDType::Q4_1
            | GgmlDType::Q5_0
            | GgmlDType::Q5_1
            | GgmlDType::Q4K
            | GgmlDType::Q5K
            | GgmlDType::Q6K
    )
}
