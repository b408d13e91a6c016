//! compressed-tensors checkpoints in the `pack-quantized` format (Google's
//! `-qat-w4a16-ct` exports): a linear layer's weight is stored as
//! `weight_packed` (int4 levels, eight to an int32, element `i` at bits
//! `4i` of its word, each level stored as `level + 8`), `weight_scale`
//! (one scale per group of input columns, or per row) and `weight_shape`
//! (`[out, in]`), and the value is `level · scale`. Symmetric int4 with
//! groups of a multiple of 32 maps exactly onto the q4 kernels' layout, so
//! the weights load as they are stored, without widening.

use gemma4_kernels::q4::{Q4Matrix, GROUP};
use safetensors::tensor::Dtype;

use crate::error::{Result, WeightError};
use crate::safetensors_store::SafetensorsStore;

/// Whether `base` (a full tensor name without `.weight`) is stored packed.
pub fn is_packed(store: &SafetensorsStore, base: &str) -> bool {
    store.contains(&format!("{base}.weight_packed"))
}

fn unsupported(name: &str, what: String) -> WeightError {
    WeightError::Dtype {
        name: name.to_string(),
        dtype: format!("compressed-tensors {what}; only symmetric int4 with groups of a multiple of {GROUP} columns (or one scale per row) loads"),
    }
}

/// The int4 matrix `[rows, cols]` of the linear layer `base`.
pub fn int4_matrix(
    store: &SafetensorsStore,
    base: &str,
    rows: usize,
    cols: usize,
) -> Result<Q4Matrix> {
    let packed_name = format!("{base}.weight_packed");
    if store.contains(&format!("{base}.weight_zero_point")) {
        return Err(unsupported(&packed_name, "asymmetric weights (a zero point)".into()).into());
    }
    let shape_name = format!("{base}.weight_shape");
    if store.contains(&shape_name) {
        let shape = store.get_raw(&shape_name, &[2])?;
        let shape: Vec<i64> = shape
            .to_dtype(candle_core::DType::I64)
            .and_then(|t| t.to_vec1())
            .map_err(|e| WeightError::Format {
                path: shape_name.clone(),
                message: crate::error::tensor_message(&e),
            })?;
        if shape != [rows as i64, cols as i64] {
            return Err(WeightError::Shape {
                name: shape_name,
                expected: vec![rows, cols],
                found: shape.iter().map(|&d| d.max(0) as usize).collect(),
            }
            .into());
        }
    }
    let words = store
        .shape(&packed_name)
        .and_then(|s| s.get(1).copied())
        .unwrap_or(0);
    if words * 8 != cols {
        return Err(unsupported(
            &packed_name,
            format!("weights of {} bits", words * 32 / cols.max(1)),
        )
        .into());
    }
    let packed = store.raw_bytes(&packed_name, &[rows, cols / 8], Dtype::I32)?;

    let scale_name = format!("{base}.weight_scale");
    let groups = store
        .shape(&scale_name)
        .and_then(|s| s.get(1).copied())
        .unwrap_or(0);
    let group = cols.checked_div(groups).unwrap_or(0);
    if groups == 0 || group * groups != cols || !group.is_multiple_of(GROUP) {
        return Err(unsupported(&scale_name, format!("groups of {group} columns")).into());
    }
    let scales = store.stored(&scale_name, &[rows, groups])?.to_f32()?;
    // One scale per group of 32, repeated across a wider group.
    let per_32: Vec<f32> = scales
        .chunks_exact(groups)
        .flat_map(|row| (0..cols / GROUP).map(move |g| row[g * GROUP / group]))
        .collect();
    Q4Matrix::from_packed_levels(rows, cols, packed, per_32).ok_or_else(|| {
        WeightError::Format {
            path: packed_name,
            message: "packed int4 weights do not fit their shape".into(),
        }
        .into()
    })
}
