//! Which product follows which, for reading ahead.
//!
//! A model runs the same products in the same order step after step, with
//! short single-threaded work (norms, attention, sampling) between them.
//! Remembering which product came after each one lets [`crate::matmul_many`]
//! tell the pool's idle workers which weights to read ahead while that
//! work runs. A wrong guess (the first step, a freed matrix whose address
//! is reused) costs some idle bandwidth, nothing else.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::pool::{ReadAhead, READ_AHEAD_RUNS};
use crate::WeightMatrix;

/// Bytes of a product read ahead at most: a gap between products lasts
/// tens of microseconds (a megabyte or two of reading), and the caches
/// hold a few tens of megabytes.
const MAX_BYTES: usize = 8 << 20;

/// Products remembered before the table starts over (models loaded and
/// dropped in one process leave stale entries).
const MAX_ENTRIES: usize = 1 << 14;

/// The order products ran in, as far as the next one goes.
#[derive(Default)]
struct ProductOrder {
    /// The product that ran last.
    last: Option<usize>,
    /// For each product, what the product after it reads first.
    next: HashMap<usize, ReadAhead>,
}

impl ProductOrder {
    /// Notes that the product over `ws` starts now, and returns what
    /// followed it last time. A successor is written only when it changed
    /// (steps repeat the same order).
    fn starts(&mut self, ws: &[&dyn WeightMatrix]) -> Option<ReadAhead> {
        if self.next.len() >= MAX_ENTRIES {
            self.next.clear();
        }
        let key = key(ws);
        if let Some(last) = self.last.replace(key) {
            let now = runs(ws);
            if self.next.get(&last) != Some(&now) {
                self.next.insert(last, now);
            }
        }
        self.next.get(&key).copied()
    }
}

static ORDER: Mutex<Option<ProductOrder>> = Mutex::new(None);

/// Identifies a product by its first matrix.
fn key(ws: &[&dyn WeightMatrix]) -> usize {
    ws.first()
        .map_or(0, |w| (*w as *const dyn WeightMatrix).cast::<()>() as usize)
}

/// Notes that the product over `ws` starts now, and returns what the
/// product after it read first last time (to read ahead once it is done).
pub(crate) fn starts(ws: &[&dyn WeightMatrix]) -> Option<ReadAhead> {
    ORDER
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(ProductOrder::default)
        .starts(ws)
}

/// The stored bytes of `ws` in the order a product's chunks read them,
/// up to [`MAX_BYTES`].
fn runs(ws: &[&dyn WeightMatrix]) -> ReadAhead {
    let mut out = [(0, 0); READ_AHEAD_RUNS];
    let mut budget = MAX_BYTES;
    for (slot, bytes) in out.iter_mut().zip(ws.iter().filter_map(|w| w.stored_run())) {
        let len = bytes.len().min(budget);
        *slot = (bytes.as_ptr() as usize, len);
        budget -= len;
        if budget == 0 {
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q8_0::Q8_0Matrix;
    use crate::Bytes;

    fn matrix(rows: usize) -> Q8_0Matrix {
        let bytes = Bytes::from_vec(vec![0; rows * 34]);
        Q8_0Matrix::new(bytes, rows, 32).expect("a valid Q8_0 matrix")
    }

    #[test]
    fn a_product_is_followed_by_what_came_after_it_last_time() {
        let (a, b, c) = (matrix(2), matrix(3), matrix(4));
        let run = |m: &Q8_0Matrix| (m.stored_run().unwrap().as_ptr() as usize, m.stored_bytes());
        let mut order = ProductOrder::default();
        let step = |order: &mut ProductOrder| -> Vec<Option<ReadAhead>> {
            [&a as &dyn WeightMatrix, &b, &c]
                .iter()
                .map(|w| order.starts(&[*w]))
                .collect()
        };
        // The first step knows nothing yet.
        assert_eq!(step(&mut order), vec![None, None, None]);
        // The second knows every successor: c was followed by a (the next step).
        let second = step(&mut order);
        let first_run = |r: Option<ReadAhead>| r.map(|r| r[0]);
        assert_eq!(first_run(second[0]), Some(run(&b)));
        assert_eq!(first_run(second[1]), Some(run(&c)));
        assert_eq!(first_run(second[2]), Some(run(&a)));
        // A joint product's runs follow its matrices, within the byte budget.
        let joint = runs(&[&a, &b]);
        assert_eq!(&joint[..3], &[run(&a), run(&b), (0, 0)]);
    }
}
