//! Weight storage behind the model's operations.
//!
//! The model sees three interfaces: [`LinearOp`] (`y = x · Wᵀ`),
//! [`EmbeddingOp`] (rows of a table for the step's tokens) and a set of
//! expert matrices ([`Experts`], one [`Linear`] per expert). Each storage
//! type implements them: our kernels over weights in place
//! ([`KernelLinear`], [`RowsEmbedding`], any [`WeightMatrix`]), and candle's
//! quantized matmul for GGUF k-quants ([`CandleQuantLinear`]). Which one a
//! tensor gets is decided by the loader ([`crate::loader`]), never by the
//! model.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{CpuStorage, Device, Module, Storage, Tensor};
use gemma4_kernels::float::{FloatMatrix, FloatType};
use gemma4_kernels::kquant::{self, SuperBlockMatrix};
use gemma4_kernels::legacy::{self, BlockMatrix};
use gemma4_kernels::q8_0::Q8_0Matrix;
use gemma4_kernels::{Bytes, Precision, WeightMatrix};

use crate::error::{ModelError, Result, WeightError};
use crate::mapped::MappedFile;

/// `y = x · Wᵀ` over some storage; `x` is `[n, in]`, `y` is `[n, out]`.
pub trait LinearOp: Send + Sync + std::fmt::Debug {
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
    fn in_features(&self) -> usize;
    fn out_features(&self) -> usize;
    /// The storage, as reported to users (`bf16`, `int8`, `Q4K`, …).
    fn storage(&self) -> &'static str;
    /// The kernels' matrix and activation precision, where this op is one
    /// of our kernels (so that it can join products over the same input).
    fn kernel(&self) -> Option<(&dyn WeightMatrix, Precision)> {
        None
    }
}

/// Rows of an embedding table; `[ids.len(), dim]` in f32.
pub trait EmbeddingOp: Send + Sync + std::fmt::Debug {
    fn lookup(&self, ids: &[u32], device: &Device) -> Result<Tensor>;
    fn rows(&self) -> usize;
    fn dim(&self) -> usize;
    fn storage(&self) -> &'static str;
}

/// A linear layer, whatever its storage.
#[derive(Debug, Clone)]
pub struct Linear(Arc<dyn LinearOp>);

impl Linear {
    pub fn new(op: Arc<dyn LinearOp>) -> Self {
        Self(op)
    }

    /// A dense f32 matrix `[out, in]`, for tests and small computed weights.
    pub fn from_f32(values: &[f32], out: usize, inp: usize) -> Result<Self> {
        let m = FloatMatrix::from_f32(values, out, inp).ok_or_else(|| {
            ModelError::Input(format!("{} values are not [{out}, {inp}]", values.len()))
        })?;
        Ok(Self::new(Arc::new(KernelLinear::new(Arc::new(m)))))
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }

    /// Each of `linears` applied to the same `x`. Where all are our kernels
    /// with one activation precision, they run as one product
    /// ([`gemma4_kernels::matmul_many`]: activations rounded once, one pass
    /// of the thread pool); the results are the same as one by one.
    pub fn forward_many(linears: &[&Linear], x: &Tensor) -> Result<Vec<Tensor>> {
        let kernels: Option<Vec<(&dyn WeightMatrix, Precision)>> =
            linears.iter().map(|l| l.0.kernel()).collect();
        let joint = kernels.filter(|k| {
            k.windows(2)
                .all(|p| p[0].1 == p[1].1 && p[0].0.cols() == p[1].0.cols())
        });
        let Some(kernels) = joint.filter(|k| k.len() > 1) else {
            return linears.iter().map(|l| l.forward(x)).collect();
        };
        let ws: Vec<&dyn WeightMatrix> = kernels.iter().map(|k| k.0).collect();
        let (ys, n) = with_activations(x, kernels[0].0.cols(), |xs, n| {
            gemma4_kernels::matmul_many(&ws, xs, n, kernels[0].1)
        })?;
        ys.into_iter()
            .zip(&ws)
            .map(|(y, w)| Ok(Tensor::from_vec(y, (n, w.rows()), x.device())?))
            .collect()
    }

    pub fn out_features(&self) -> usize {
        self.0.out_features()
    }

    pub fn storage(&self) -> &'static str {
        self.0.storage()
    }
}

/// An embedding table, whatever its storage.
#[derive(Debug, Clone)]
pub struct Embedding(Arc<dyn EmbeddingOp>);

impl Embedding {
    pub fn new(op: Arc<dyn EmbeddingOp>) -> Self {
        Self(op)
    }

    pub fn lookup(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        self.0.lookup(ids, device)
    }

    pub fn rows(&self) -> usize {
        self.0.rows()
    }

    pub fn storage(&self) -> &'static str {
        self.0.storage()
    }
}

/// The experts of one MoE layer: per expert, its `gate_up` and `down` matrices.
#[derive(Debug, Clone)]
pub struct Experts {
    pub gate_up: Vec<Linear>,
    pub down: Vec<Linear>,
}

/// `f` of the f32 activations of `x` (`[n, inp]`) and `n`, checked against
/// the weight's width; returns what `f` gives, and `n`.
fn with_activations<R>(
    x: &Tensor,
    inp: usize,
    f: impl FnOnce(&[f32], usize) -> R,
) -> Result<(R, usize)> {
    let (n, width) = x.dims2()?;
    if width != inp {
        return Err(ModelError::Input(format!(
            "input width {width} does not match the weight's {inp}"
        )));
    }
    with_f32_values(x, |xs| (f(xs, n), n))
}

/// `f` of the values of `x` in row-major order, as f32. A contiguous f32
/// tensor on the CPU is read in place (a prompt's activations and a
/// vocabulary's logits are megabytes); any other is copied out first.
pub fn with_f32_values<R>(x: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    {
        let (storage, layout) = x.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(values)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&values[start..end]));
        }
    }
    let values = x
        .flatten_all()?
        .to_dtype(candle_core::DType::F32)?
        .to_vec1::<f32>()?;
    Ok(f(&values))
}

/// `f` of the values of `y` in row-major order, changed in place, when
/// `y` is a contiguous f32 tensor on the CPU (as our products' outputs
/// are); `None`, with `f` not run, for any other.
///
/// Only for a tensor nothing else holds: a clone shares the values.
pub fn with_f32_values_mut<R>(y: &Tensor, f: impl FnOnce(&mut [f32]) -> R) -> Result<Option<R>> {
    let op = InPlace {
        f: std::cell::Cell::new(Some(f)),
        out: std::cell::Cell::new(None),
    };
    y.inplace_op1(&op)?;
    Ok(op.out.into_inner())
}

/// [`with_f32_values_mut`]'s pass over the storage.
struct InPlace<F, R> {
    f: std::cell::Cell<Option<F>>,
    out: std::cell::Cell<Option<R>>,
}

impl<F: FnOnce(&mut [f32]) -> R, R> candle_core::InplaceOp1 for InPlace<F, R> {
    fn name(&self) -> &'static str {
        "in-place f32 values"
    }

    fn cpu_fwd(
        &self,
        storage: &mut CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        if let (CpuStorage::F32(values), Some((start, end))) =
            (storage, layout.contiguous_offsets())
        {
            if let Some(f) = self.f.take() {
                self.out.set(Some(f(&mut values[start..end])));
            }
        }
        Ok(())
    }
}

/// A linear layer computed by our kernels (`gemma4-kernels`) over any [`WeightMatrix`].
#[derive(Debug, Clone)]
pub struct KernelLinear {
    matrix: Arc<dyn WeightMatrix>,
    precision: Precision,
}

impl KernelLinear {
    /// Exact: f32 activations against the stored values.
    pub fn new(matrix: Arc<dyn WeightMatrix>) -> Self {
        Self::with_precision(matrix, Precision::Exact)
    }

    pub fn with_precision(matrix: Arc<dyn WeightMatrix>, precision: Precision) -> Self {
        Self { matrix, precision }
    }
}

impl LinearOp for KernelLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (y, n) = with_activations(x, self.matrix.cols(), |xs, n| {
            gemma4_kernels::matmul_with(self.matrix.as_ref(), xs, n, self.precision)
        })?;
        Ok(Tensor::from_vec(y, (n, self.matrix.rows()), x.device())?)
    }
    fn in_features(&self) -> usize {
        self.matrix.cols()
    }
    fn out_features(&self) -> usize {
        self.matrix.rows()
    }
    fn storage(&self) -> &'static str {
        self.matrix.storage()
    }
    fn kernel(&self) -> Option<(&dyn WeightMatrix, Precision)> {
        Some((self.matrix.as_ref(), self.precision))
    }
}

/// A GGUF k-quant matrix through candle's quantized matmul, which rounds
/// the activations to 8 bits per block (fast, not exact).
#[derive(Debug, Clone)]
pub struct CandleQuantLinear {
    matmul: Arc<QMatMul>,
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
}

impl CandleQuantLinear {
    /// Copies the blocks out of `bytes` into candle's storage.
    pub fn new(bytes: &[u8], dtype: GgmlDType, rows: usize, cols: usize) -> Result<Self> {
        let storage = QStorage::from_data(Cow::Borrowed(bytes), &Device::Cpu, dtype)?;
        let q = QTensor::new(storage, (rows, cols))?;
        Ok(Self {
            matmul: Arc::new(QMatMul::from_qtensor(q)?),
            dtype,
            rows,
            cols,
        })
    }
}

impl LinearOp for CandleQuantLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.matmul.forward(x)?)
    }
    fn in_features(&self) -> usize {
        self.cols
    }
    fn out_features(&self) -> usize {
        self.rows
    }
    fn storage(&self) -> &'static str {
        ggml_name(self.dtype)
    }
}

/// Rows of a table kept as stored: a lookup widens only the rows asked
/// for. A table in a file is read row by row from it (through the page
/// cache, [`MappedFile::read_at`]), so none of it becomes resident memory;
/// otherwise the rows are read from memory.
#[derive(Debug, Clone)]
pub struct RowsEmbedding {
    table: Arc<dyn WeightMatrix>,
    file: Option<FileRows>,
}

/// Where a table's rows sit in its file.
#[derive(Debug, Clone)]
struct FileRows {
    file: Arc<MappedFile>,
    start: usize,
    row_bytes: usize,
    dtype: StoredDtype,
    name: String,
}

impl RowsEmbedding {
    pub fn new(table: Arc<dyn WeightMatrix>) -> Self {
        Self { table, file: None }
    }

    /// Reads the rows of `stored` (the tensor `table` views) from its file
    /// when it has one and its rows are whole byte runs.
    pub fn reading_from(mut self, stored: &StoredTensor) -> Self {
        let (rows, cols) = (self.table.rows(), self.table.cols());
        let row_bytes = expected_bytes(stored.dtype, &[1, cols]);
        if let (Some((file, range)), Some(row_bytes)) = (stored.file_range(), row_bytes) {
            if row_bytes * rows == range.len() {
                self.file = Some(FileRows {
                    file,
                    start: range.start,
                    row_bytes,
                    dtype: stored.dtype,
                    name: stored.name.clone(),
                });
            }
        }
        self
    }

    /// The rows `rows` read from the file into one buffer, as a matrix of
    /// `rows.len()` rows in the table's stored form.
    fn read_rows(&self, f: &FileRows, rows: &[usize]) -> Result<Arc<dyn WeightMatrix>> {
        let mut bytes = vec![0u8; rows.len() * f.row_bytes];
        for (&r, buf) in rows.iter().zip(bytes.chunks_exact_mut(f.row_bytes)) {
            f.file
                .read_at(f.start + r * f.row_bytes, buf)
                .map_err(|e| {
                    ModelError::Input(format!(
                        "cannot read row {r} of `{}` from {}: {e}",
                        f.name,
                        f.file.path().display()
                    ))
                })?;
        }
        let cols = self.table.cols();
        StoredTensor::new(
            f.name.clone(),
            f.dtype,
            vec![rows.len(), cols],
            Bytes::from_vec(bytes),
        )
        .matrix(rows.len(), cols)
    }
}

impl EmbeddingOp for RowsEmbedding {
    fn lookup(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        let (rows, dim) = (self.table.rows(), self.table.cols());
        let wanted: Vec<usize> = ids
            .iter()
            .map(|&id| {
                let r = id as usize;
                if r < rows {
                    Ok(r)
                } else {
                    Err(ModelError::Input(format!(
                        "token id {id} is outside the embedding table ({rows} rows)"
                    )))
                }
            })
            .collect::<Result<_>>()?;
        let mut out = vec![0f32; ids.len() * dim];
        match &self.file {
            Some(f) if !wanted.is_empty() => self
                .read_rows(f, &wanted)?
                .dequantize_rows(0..wanted.len(), &mut out),
            _ => {
                for (&r, out) in wanted.iter().zip(out.chunks_exact_mut(dim.max(1))) {
                    self.table.dequantize_rows(r..r + 1, out);
                }
            }
        }
        Ok(Tensor::from_vec(out, (ids.len(), dim), device)?)
    }
    fn rows(&self) -> usize {
        self.table.rows()
    }
    fn dim(&self) -> usize {
        self.table.cols()
    }
    fn storage(&self) -> &'static str {
        self.table.storage()
    }
}

/// GGUF blocks of any ggml type, read in place and widened through candle's
/// block decoders a tile at a time (f32 activations: exact).
#[derive(Debug, Clone)]
pub struct GgmlMatrix {
    bytes: Bytes,
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
}

impl GgmlMatrix {
    pub fn new(bytes: Bytes, dtype: GgmlDType, rows: usize, cols: usize) -> Option<Self> {
        if !cols.is_multiple_of(dtype.block_size()) {
            return None;
        }
        let row_bytes = cols / dtype.block_size() * dtype.type_size();
        (bytes.len() == rows * row_bytes).then_some(Self {
            bytes,
            dtype,
            rows,
            cols,
            row_bytes,
        })
    }
}

/// Rows widened per decoder call: amortizes the call, bounds the scratch.
const GGML_TILE: usize = 64;

impl WeightMatrix for GgmlMatrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> &'static str {
        ggml_name(self.dtype)
    }
    fn stored_bytes(&self) -> usize {
        self.bytes.len()
    }
    fn stored_run(&self) -> Option<&[u8]> {
        Some(self.bytes.as_slice())
    }
    fn dequantize_rows(&self, rows: Range<usize>, out: &mut [f32]) {
        let mut r = rows.start;
        while r < rows.end {
            let end = (r + GGML_TILE).min(rows.end);
            let src = &self.bytes.as_slice()[r * self.row_bytes..end * self.row_bytes];
            let count = (end - r) * self.cols;
            let dst = &mut out[(r - rows.start) * self.cols..(end - rows.start) * self.cols];
            let decoded = self.dtype.from_data(Cow::Borrowed(src)).dequantize(count);
            match decoded {
                Ok(candle_core::CpuStorage::F32(v)) => dst.copy_from_slice(&v),
                // The decoders only produce f32; anything else would be a
                // candle change, reported as NaN rather than silent zeros.
                _ => dst.fill(f32::NAN),
            }
            r = end;
        }
    }
    fn dots(&self, rows: Range<usize>, x: &[f32], n: usize, out: &mut [f32]) {
        let (len, cols) = (rows.len(), self.cols);
        let mut tile = vec![0f32; GGML_TILE.min(len) * cols];
        let mut r = rows.start;
        while r < rows.end {
            let end = (r + GGML_TILE).min(rows.end);
            let tile = &mut tile[..(end - r) * cols];
            self.dequantize_rows(r..end, tile);
            for (j, row) in tile.chunks_exact(cols).enumerate() {
                for t in 0..n {
                    out[t * len + (r - rows.start) + j] =
                        gemma4_kernels::float::dot_f32(&x[t * cols..(t + 1) * cols], row);
                }
            }
            r = end;
        }
    }
}

/// ggml's name for a block type.
pub fn ggml_name(dtype: GgmlDType) -> &'static str {
    match dtype {
        GgmlDType::F32 => "f32",
        GgmlDType::F16 => "f16",
        GgmlDType::BF16 => "bf16",
        GgmlDType::Q4_0 => "Q4_0",
        GgmlDType::Q4_1 => "Q4_1",
        GgmlDType::Q5_0 => "Q5_0",
        GgmlDType::Q5_1 => "Q5_1",
        GgmlDType::Q8_0 => "Q8_0",
        GgmlDType::Q8_1 => "Q8_1",
        GgmlDType::Q2K => "Q2_K",
        GgmlDType::Q3K => "Q3_K",
        GgmlDType::Q4K => "Q4_K",
        GgmlDType::Q5K => "Q5_K",
        GgmlDType::Q6K => "Q6_K",
        GgmlDType::Q8K => "Q8_K",
    }
}

/// How a tensor's bytes are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDtype {
    Float(FloatType),
    Ggml(GgmlDType),
}

impl StoredDtype {
    pub fn name(self) -> &'static str {
        match self {
            StoredDtype::Float(t) => t.name(),
            StoredDtype::Ggml(d) => ggml_name(d),
        }
    }
}

/// One tensor as a checkpoint stores it: its encoding, shape and bytes
/// (usually a range of a mapped file).
#[derive(Debug, Clone)]
pub struct StoredTensor {
    pub name: String,
    pub dtype: StoredDtype,
    pub shape: Vec<usize>,
    pub bytes: Bytes,
    mapping: Option<(Arc<MappedFile>, Range<usize>)>,
}

impl StoredTensor {
    pub fn new(name: String, dtype: StoredDtype, shape: Vec<usize>, bytes: Bytes) -> Self {
        Self {
            name,
            dtype,
            shape,
            bytes,
            mapping: None,
        }
    }

    /// The tensor at `range` of a mapped file.
    pub fn mapped(
        name: String,
        dtype: StoredDtype,
        shape: Vec<usize>,
        file: &Arc<MappedFile>,
        range: Range<usize>,
    ) -> Result<Self, WeightError> {
        let bytes = file
            .bytes(range.clone())
            .ok_or_else(|| WeightError::Format {
                path: file.path().display().to_string(),
                message: format!(
                    "tensor `{name}` ends at byte {} but the file has {} bytes (truncated?)",
                    range.end,
                    file.len()
                ),
            })?;
        let expected = expected_bytes(dtype, &shape);
        if expected != Some(bytes.len()) {
            return Err(WeightError::Format {
                path: file.path().display().to_string(),
                message: format!(
                    "tensor `{name}` holds {} bytes, but {} of shape {shape:?} needs {}",
                    bytes.len(),
                    dtype.name(),
                    expected.map_or("an impossible size".into(), |e| e.to_string())
                ),
            });
        }
        Ok(Self {
            name,
            dtype,
            shape,
            bytes,
            mapping: Some((file.clone(), range)),
        })
    }

    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The file and byte range this tensor is mapped from, if it is.
    pub fn file_range(&self) -> Option<(Arc<MappedFile>, Range<usize>)> {
        self.mapping.clone()
    }

    /// Drops this tensor's mapped pages from the resident set (after a copy
    /// or a quantization made them unnecessary).
    pub fn release(&self) {
        if let Some((file, range)) = &self.mapping {
            file.release(range.clone());
        }
    }

    /// Every value widened to f32.
    ///
    /// A mapped tensor is read from the file, not through the mapping: a
    /// touched mapped page brings the folio around it into this process's
    /// resident set (a few norm vectors had kept 58 MiB of the demo's GGUF
    /// resident beside the weights' copies).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.elements()];
        let cols = self.shape.last().copied().unwrap_or(1).max(1);
        let rows = self.elements() / cols;
        let read = if self.mapping.is_some() {
            let mut buf = vec![0u8; self.bytes.len()];
            self.copy_to(&mut buf)?;
            Self::new(
                self.name.clone(),
                self.dtype,
                self.shape.clone(),
                Bytes::from_vec(buf),
            )
        } else {
            self.clone()
        };
        read.matrix(rows, cols)?.dequantize_rows(0..rows, &mut out);
        Ok(out)
    }

    /// Copies the tensor's bytes into `out` (its length): a mapped tensor
    /// is read from the file, so none of the mapping becomes resident.
    pub fn copy_to(&self, out: &mut [u8]) -> Result<(), WeightError> {
        match &self.mapping {
            Some((file, range)) => {
                file.read_at(range.start, out)
                    .map_err(|source| WeightError::Io {
                        path: file.path().display().to_string(),
                        source,
                    })
            }
            None => {
                out.copy_from_slice(self.bytes.as_slice());
                Ok(())
            }
        }
    }

    /// The tensor as a `[rows, cols]` matrix read in place.
    pub fn matrix(&self, rows: usize, cols: usize) -> Result<Arc<dyn WeightMatrix>> {
        let bad = || {
            ModelError::Input(format!(
                "tensor `{}` ({}, {:?}) cannot be read as a [{rows}, {cols}] matrix",
                self.name,
                self.dtype.name(),
                self.shape
            ))
        };
        let b = self.bytes.clone();
        Ok(match self.dtype {
            StoredDtype::Float(t) => Arc::new(FloatMatrix::new(b, t, rows, cols).ok_or_else(bad)?),
            StoredDtype::Ggml(GgmlDType::F32) => {
                Arc::new(FloatMatrix::new(b, FloatType::F32, rows, cols).ok_or_else(bad)?)
            }
            StoredDtype::Ggml(GgmlDType::F16) => {
                Arc::new(FloatMatrix::new(b, FloatType::F16, rows, cols).ok_or_else(bad)?)
            }
            StoredDtype::Ggml(GgmlDType::BF16) => {
                Arc::new(FloatMatrix::new(b, FloatType::Bf16, rows, cols).ok_or_else(bad)?)
            }
            StoredDtype::Ggml(GgmlDType::Q8_0) => {
                Arc::new(Q8_0Matrix::new(b, rows, cols).ok_or_else(bad)?)
            }
            StoredDtype::Ggml(GgmlDType::Q4_0) => {
                Arc::new(BlockMatrix::<legacy::Q4_0>::new(b, rows, cols).ok_or_else(bad)?)
            }
            StoredDtype::Ggml(GgmlDType::Q4_1) => {
                Arc::new(BlockMatrix::<legacy::Q4_1>::new(b, rows, cols).ok_or_else(bad)?)
            }
            StoredDtype::Ggml(GgmlDType::Q5_0) => {
                Arc::new(BlockMatrix::<legacy::Q5_0>::new(b, rows, cols).ok_or_else(bad)?)
            }
            StoredDtype::Ggml(GgmlDType::Q5_1) => {
                Arc::new(BlockMatrix::<legacy::Q5_1>::new(b, rows, cols).ok_or_else(bad)?)
            }
            StoredDtype::Ggml(GgmlDType::Q4K) => {
                Arc::new(SuperBlockMatrix::<kquant::Q4K>::new(b, rows, cols).ok_or_else(bad)?)
            }
            StoredDtype::Ggml(GgmlDType::Q5K) => {
                Arc::new(SuperBlockMatrix::<kquant::Q5K>::new(b, rows, cols).ok_or_else(bad)?)
            }
            StoredDtype::Ggml(GgmlDType::Q6K) => {
                Arc::new(SuperBlockMatrix::<kquant::Q6K>::new(b, rows, cols).ok_or_else(bad)?)
            }
            StoredDtype::Ggml(d) => Arc::new(GgmlMatrix::new(b, d, rows, cols).ok_or_else(bad)?),
        })
    }

    /// Rows `rows` of a `[rows, cols]` matrix, as their own tensor (a view).
    pub fn row_range(&self, rows: std::ops::Range<usize>, cols: usize) -> Result<Self> {
        let total = self.shape.first().copied().unwrap_or(0);
        let row_bytes = self.bytes.len() / total.max(1);
        let bytes = self
            .bytes
            .slice(rows.start * row_bytes..rows.end * row_bytes)
            .filter(|_| rows.end <= total)
            .ok_or_else(|| ModelError::Input(format!("`{}` has no rows {rows:?}", self.name)))?;
        let mapping = self.mapping.as_ref().map(|(f, r)| {
            (
                f.clone(),
                r.start + rows.start * row_bytes..r.start + rows.end * row_bytes,
            )
        });
        Ok(Self {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: vec![rows.len(), cols],
            bytes,
            mapping,
        })
    }

    /// Entry `i` of the first dimension (one expert of a stacked tensor).
    pub fn index_first(&self, i: usize) -> Result<Self> {
        let n = self.shape.first().copied().unwrap_or(0);
        let each = self.bytes.len() / n.max(1);
        let bytes = self
            .bytes
            .slice(i * each..(i + 1) * each)
            .filter(|_| i < n)
            .ok_or_else(|| ModelError::Input(format!("`{}` has no entry {i}", self.name)))?;
        let mapping = self
            .mapping
            .as_ref()
            .map(|(f, r)| (f.clone(), r.start + i * each..r.start + (i + 1) * each));
        Ok(Self {
            name: format!("{}[{i}]", self.name),
            dtype: self.dtype,
            shape: self.shape[1..].to_vec(),
            bytes,
            mapping,
        })
    }
}

/// Bytes a tensor of this encoding and shape occupies.
pub fn expected_bytes(dtype: StoredDtype, shape: &[usize]) -> Option<usize> {
    let elems = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    match dtype {
        StoredDtype::Float(t) => elems.checked_mul(t.size()),
        StoredDtype::Ggml(d) => {
            let block = d.block_size();
            let row = *shape.last()?;
            if !row.is_multiple_of(block) {
                return None;
            }
            (elems / block).checked_mul(d.type_size())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table in a file is read row by row from the file (not through the
    /// mapping), row for row what the mapped matrix gives; a row the file
    /// no longer holds is an error, not a panic.
    #[test]
    fn file_tables_are_read_by_row_from_the_file() {
        let (rows, cols) = (7, 24);
        let values: Vec<half::bf16> = (0..rows * cols)
            .map(|i| half::bf16::from_f32(i as f32 * 0.25 - 9.0))
            .collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let path = std::env::temp_dir().join(format!("gemma4-rows-{}.bin", std::process::id()));
        let header = 100;
        let mut file = vec![0u8; header];
        file.extend_from_slice(&bytes);
        std::fs::write(&path, &file).expect("write");
        let mapped = MappedFile::open(&path).expect("map");
        let t = StoredTensor::mapped(
            "table".into(),
            StoredDtype::Float(FloatType::Bf16),
            vec![rows, cols],
            &mapped,
            header..header + bytes.len(),
        )
        .expect("tensor");
        let m = t.matrix(rows, cols).expect("matrix");
        let table = RowsEmbedding::new(m.clone()).reading_from(&t);
        assert!(table.file.is_some(), "the rows must come from the file");
        let ids = [6u32, 0, 3, 3];
        let got = table.lookup(&ids, &Device::Cpu).expect("lookup");
        let got = got
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("rows");
        let mut want = vec![0f32; cols];
        for (i, &id) in ids.iter().enumerate() {
            m.dequantize_rows(id as usize..id as usize + 1, &mut want);
            assert_eq!(&got[i * cols..(i + 1) * cols], &want[..], "row {id}");
        }
        // The file shrinks under us: the lookup fails with the file's name.
        std::fs::write(&path, &file[..header + cols * 2]).expect("truncate");
        let err = RowsEmbedding::new(m)
            .reading_from(&t)
            .lookup(&[5], &Device::Cpu)
            .expect_err("row past the end");
        assert!(err.to_string().contains("cannot read row 5"), "{err}");
        let _ = std::fs::remove_file(path);
    }

    /// Resident bytes of this process's mapping that starts at `addr`
    /// (`/proc/self/smaps`), `None` where there is no such file.
    #[cfg(target_os = "linux")]
    fn mapping_rss_kib(addr: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((start, _)) = range.split_once('-') {
                    if let Ok(start) = usize::from_str_radix(start, 16) {
                        inside = start == addr;
                        continue;
                    }
                }
            }
            if let Some(kib) = line.strip_prefix("Rss:").filter(|_| inside) {
                return kib.trim().trim_end_matches("kB").trim().parse().ok();
            }
        }
        None
    }

    /// Widening a mapped tensor (a norm's weights) reads the file: none of
    /// the mapping becomes resident, where a touched page would have brought
    /// its folio, up to megabytes of the checkpoint, into the resident set.
    #[cfg(target_os = "linux")]
    #[test]
    fn widening_a_mapped_tensor_leaves_the_mapping_unread() {
        let values: Vec<f32> = (0..4096).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut file = vec![7u8; 1 << 20];
        file.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        file.extend(vec![7u8; 1 << 20]);
        let path = std::env::temp_dir().join(format!("gemma4-vector-{}.bin", std::process::id()));
        std::fs::write(&path, &file).expect("write");
        let mapped = MappedFile::open(&path).expect("map");
        let start = 1 << 20;
        let t = StoredTensor::mapped(
            "norm".into(),
            StoredDtype::Float(FloatType::F32),
            vec![values.len()],
            &mapped,
            start..start + 4 * values.len(),
        )
        .expect("tensor");
        let addr = AsRef::<[u8]>::as_ref(mapped.as_ref()).as_ptr() as usize;
        assert_eq!(mapping_rss_kib(addr), Some(0), "nothing read yet");
        assert_eq!(t.to_f32().expect("widen"), values);
        assert_eq!(mapping_rss_kib(addr), Some(0), "the mapping was touched");
        // The check can fail: reading through the mapping makes it resident.
        let through_map: u64 = t.bytes.as_slice().iter().map(|&b| u64::from(b)).sum();
        assert!(through_map > 0);
        assert!(mapping_rss_kib(addr).is_some_and(|kib| kib > 0));
        let _ = std::fs::remove_file(path);
    }

    /// Our block decoders against candle's on the same bytes: candle
    /// quantizes f32 values into each GGUF block type, then both widen them.
    #[test]
    fn gguf_blocks_decode_as_candle_decodes_them() {
        let (rows, cols) = (5, 256);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1013) as f32 / 506.0 - 1.0) * 0.7)
            .collect();
        let src = Tensor::from_vec(values, (rows, cols), &Device::Cpu).expect("tensor");
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
            GgmlDType::Q2K,
        ] {
            let q = QTensor::quantize(&src, dtype).expect("quantize");
            let want = q
                .dequantize(&Device::Cpu)
                .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
                .expect("dequantize");
            let bytes = Bytes::from_vec(q.data().expect("data").into_owned());
            let t = StoredTensor::new(
                "w".into(),
                StoredDtype::Ggml(dtype),
                vec![rows, cols],
                bytes,
            );
            let m = t.matrix(rows, cols).expect("matrix");
            let mut got = vec![0f32; rows * cols];
            m.dequantize_rows(0..rows, &mut got);
            assert_eq!(got, want, "{dtype:?}");
            // The fused dot products agree with the widened values.
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
            let y = gemma4_kernels::matmul(m.as_ref(), &x, 1);
            for r in 0..rows {
                let r_want: f64 = (0..cols)
                    .map(|c| f64::from(x[c]) * f64::from(want[r * cols + c]))
                    .sum();
                assert!((f64::from(y[r]) - r_want).abs() < 1e-4, "{dtype:?} row {r}");
            }
        }
    }
}
