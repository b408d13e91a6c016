//! Property tests of the safetensors header reader: a length prefix and a
//! JSON header of any shape (lengths, offsets, dtypes, shapes all drawn at
//! random) are an error or a store, never a panic.

use std::path::PathBuf;

use gemma4_model::safetensors_store::SafetensorsStore;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

fn tensor_entry() -> impl Strategy<Value = Value> {
    (
        prop::sample::select(vec!["F32", "F16", "BF16", "I8", "U8", "Q4", ""]),
        prop::collection::vec(prop_oneof![0u64..8, Just(u64::MAX), Just(1 << 40)], 0..4),
        prop_oneof![0u64..64, Just(u64::MAX)],
        prop_oneof![0u64..64, Just(u64::MAX)],
    )
        .prop_map(
            |(dtype, shape, a, b)| json!({"dtype": dtype, "shape": shape, "data_offsets": [a, b]}),
        )
}

fn file_bytes() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec(("[a-z.]{1,12}", tensor_entry()), 0..4),
        prop_oneof![Just(None), any::<u64>().prop_map(Some)],
        prop::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(|(tensors, bad_len, data)| {
            let header: Map<String, Value> = tensors.into_iter().collect();
            let text = Value::Object(header).to_string();
            let len = bad_len.unwrap_or(text.len() as u64);
            let mut out = len.to_le_bytes().to_vec();
            out.extend_from_slice(text.as_bytes());
            out.extend(data);
            out
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn corrupt_safetensors_headers_are_errors(bytes in file_bytes(), raw in prop::collection::vec(any::<u8>(), 0..32), use_raw in any::<bool>()) {
        let dir: PathBuf = std::env::temp_dir().join(format!("gemma4-fuzz-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("model.safetensors");
        std::fs::write(&path, if use_raw { &raw } else { &bytes }).expect("write");
        if let Ok(store) = SafetensorsStore::open_files(std::slice::from_ref(&path)) {
            // Reading what the header promises must fail cleanly too.
            for name in store.names() {
                let shape = store.shape(&name).map(<[usize]>::to_vec).unwrap_or_default();
                let _ = store.get(&name, &shape);
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
