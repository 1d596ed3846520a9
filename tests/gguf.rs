//! GGUF reader and writer: round trips of every value type, and clear errors (never panics) on
//! truncated and hostile files built with the writer.

use std::path::PathBuf;

use oato::gguf::{GgufFile, GgufWriter, TensorEntry, Value, ValueType};
use oato::quant::GgmlType;

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("oato-gguf-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn write_bytes(name: &str, bytes: &[u8]) -> PathBuf {
    let p = tmp(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn open_err(name: &str, bytes: &[u8]) -> String {
    match GgufFile::open(write_bytes(name, bytes)) {
        Ok(_) => panic!("{name}: opened a bad file"),
        Err(e) => e.to_string(),
    }
}

/// A small valid file: every value type, a nested array, two tensors.
fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    w.set("t.u8", Value::U8(200));
    w.set("t.i8", Value::I8(-5));
    w.set("t.u16", Value::U16(60000));
    w.set("t.i16", Value::I16(-30000));
    w.set("t.u32", Value::U32(4_000_000_000));
    w.set("t.i32", Value::I32(-2_000_000_000));
    w.set("t.f32", Value::F32(1.5));
    w.set("t.bool", Value::Bool(true));
    w.set("t.u64", Value::U64(1 << 40));
    w.set("t.i64", Value::I64(-(1 << 40)));
    w.set("t.f64", Value::F64(-2.25));
    w.set("t.str", Value::String("héllo\n".into()));
    w.set("t.empty", Value::Array(ValueType::F32, vec![]));
    w.set(
        "t.nested",
        Value::Array(
            ValueType::Array,
            vec![
                Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2)]),
                Value::Array(ValueType::String, vec![Value::String("a".into())]),
            ],
        ),
    );
    let f32s: Vec<u8> = (0..64)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    w.add_tensor("a.weight", &[32, 2], GgmlType::F32, f32s)
        .unwrap();
    w.add_tensor("b.weight", &[32], GgmlType::Q8_0, vec![7u8; 34])
        .unwrap();
    w
}

#[test]
fn round_trip_every_value_type_and_tensor_data() {
    for version in [2u32, 3] {
        let mut w = sample_writer();
        w.version = version;
        let f = GgufFile::open(write_bytes(&format!("rt{version}.gguf"), &w.to_bytes())).unwrap();
        assert_eq!(f.version, version);
        assert_eq!(f.get("t.u8"), Some(&Value::U8(200)));
        assert_eq!(f.get("t.i16"), Some(&Value::I16(-30000)));
        assert_eq!(f.get_u64("t.u32").unwrap(), Some(4_000_000_000));
        assert_eq!(f.get_u64("t.u64").unwrap(), Some(1 << 40));
        assert!(f.get_u64("t.i64").is_err(), "negative value read as u64");
        assert_eq!(f.get_f64("t.f64").unwrap(), Some(-2.25));
        assert_eq!(f.get_bool("t.bool").unwrap(), Some(true));
        assert_eq!(f.get_str("t.str"), Some("héllo\n"));
        assert_eq!(
            f.get("t.empty"),
            Some(&Value::Array(ValueType::F32, vec![]))
        );
        let nested = f.get("t.nested").unwrap().as_array().unwrap();
        assert_eq!(
            nested[0],
            Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2)])
        );
        let a = f.tensor("a.weight").unwrap();
        assert_eq!(
            (a.dims.clone(), a.ty, a.n_bytes, a.n_rows()),
            (vec![32, 2], GgmlType::F32, 256, 2)
        );
        assert_eq!(f.data_offset % 32, 0);
        let data = f.tensor_data("a.weight").unwrap();
        assert_eq!(f32::from_le_bytes(data[12..16].try_into().unwrap()), 1.5);
        let b = f.tensor_data("b.weight").unwrap();
        assert_eq!(b, &[7u8; 34][..]);
        assert!(
            f.tensor_data("nope")
                .unwrap_err()
                .to_string()
                .contains("nope")
        );
    }
}

#[test]
fn custom_alignment_is_honoured() {
    let mut w = sample_writer();
    w.set("general.alignment", Value::U32(64));
    let f = GgufFile::open(write_bytes("align64.gguf", &w.to_bytes())).unwrap();
    assert_eq!(f.alignment, 64);
    assert_eq!(f.data_offset % 64, 0);
    assert_eq!(f.tensor_data("b.weight").unwrap(), &[7u8; 34][..]);

    let mut w = sample_writer();
    w.set("general.alignment", Value::U32(48));
    let e = open_err("align48.gguf", &w.to_bytes());
    assert!(
        e.contains("general.alignment") && e.contains("power of two"),
        "{e}"
    );
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let bytes = sample_writer().to_bytes();
    let f = GgufFile::open(write_bytes("full.gguf", &bytes)).unwrap();
    let data_end = (f.data_offset + 256 + 32) as usize;
    for len in 0..data_end.min(bytes.len()) {
        let p = write_bytes("trunc.gguf", &bytes[..len]);
        match GgufFile::open(&p) {
            Ok(_) => panic!("a file cut to {len} of {} bytes opened", bytes.len()),
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.contains("truncated")
                        || e.contains("past the end")
                        || e.contains("cannot fit")
                        || e.contains("absurd")
                        || e.contains("magic"),
                    "cut at {len}: {e}"
                );
            }
        }
    }
}

#[test]
fn wrong_magic_and_versions() {
    let mut bytes = sample_writer().to_bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let e = open_err("magic.gguf", &bytes);
    assert!(e.contains("wrong magic") && e.contains("GGML"), "{e}");

    let mut bytes = sample_writer().to_bytes();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(open_err("v1.gguf", &bytes).contains("version 1"));
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(open_err("be.gguf", &bytes).contains("big-endian"));
    bytes[4..8].copy_from_slice(&77u32.to_le_bytes());
    assert!(open_err("v77.gguf", &bytes).contains("version 77"));
}

#[test]
fn absurd_counts_and_lengths() {
    let good = sample_writer().to_bytes();
    let mut bytes = good.clone();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = open_err("ntensors.gguf", &bytes);
    assert!(e.contains("tensor count") && e.contains("absurd"), "{e}");

    let mut bytes = good.clone();
    bytes[16..24].copy_from_slice(&(1u64 << 50).to_le_bytes());
    let e = open_err("nkv.gguf", &bytes);
    assert!(e.contains("metadata count") && e.contains("absurd"), "{e}");

    // The first key's length.
    let mut bytes = good.clone();
    bytes[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    let e = open_err("keylen.gguf", &bytes);
    assert!(
        e.contains("metadata key #0") && e.contains("past the end"),
        "{e}"
    );

    // A huge array count.
    let mut w = GgufWriter::new();
    w.set("x", Value::Array(ValueType::U64, vec![Value::U64(1)]));
    let mut bytes = w.to_bytes();
    // magic 4 + version 4 + counts 16 + key (8 + 1) + type 4 + elem type 4 = 41: the count.
    bytes[41..49].copy_from_slice(&(1u64 << 61).to_le_bytes());
    let e = open_err("arr.gguf", &bytes);
    assert!(e.contains("\"x\"") && e.contains("cannot fit"), "{e}");

    // An unknown value type.
    let mut bytes = w.to_bytes();
    bytes[33..37].copy_from_slice(&99u32.to_le_bytes());
    let e = open_err("vtype.gguf", &bytes);
    assert!(e.contains("unknown value type 99"), "{e}");
}

#[test]
fn deeply_nested_arrays_are_refused() {
    let mut v = Value::Array(ValueType::U8, vec![Value::U8(1)]);
    for _ in 0..20 {
        v = Value::Array(ValueType::Array, vec![v]);
    }
    let mut w = GgufWriter::new();
    w.set("deep", v);
    let e = open_err("deep.gguf", &w.to_bytes());
    assert!(e.contains("nested deeper"), "{e}");
}

#[test]
fn bad_tensor_entries() {
    let f32s = |n: usize| vec![0u8; n * 4];
    type Case = (&'static str, Box<dyn Fn(&mut GgufWriter)>, &'static str);
    let cases: Vec<Case> = vec![
        (
            "unknown-type",
            Box::new(|w| w.add_tensor_raw("t", &[32], 250, vec![0; 64])),
            "unknown ggml type id 250",
        ),
        (
            "iq-type",
            Box::new(|w| w.add_tensor_raw("t", &[256], 16, vec![0; 66])),
            "IQ2_XXS",
        ),
        (
            "dims0",
            Box::new(move |w| w.add_tensor_raw("t", &[], 0, f32s(1))),
            "0 dimensions",
        ),
        (
            "dims5",
            Box::new(move |w| w.add_tensor_raw("t", &[1, 1, 1, 1, 1], 0, f32s(1))),
            "5 dimensions",
        ),
        (
            "overflow",
            Box::new(|w| w.add_tensor_raw("t", &[1 << 32, 1 << 32, 4], 0, vec![])),
            "too many elements",
        ),
        (
            "block",
            Box::new(|w| w.add_tensor_raw("t", &[33], 8, vec![0; 34])),
            "not a multiple of the Q8_0 block",
        ),
        (
            "past-end",
            Box::new(|w| w.add_tensor_raw("t", &[1 << 20], 0, vec![0; 64])),
            "runs past the end",
        ),
        (
            "dup",
            Box::new(move |w| {
                w.add_tensor_raw("t", &[4], 0, f32s(4));
                w.add_tensor_raw("t", &[4], 0, f32s(4));
            }),
            "appears twice",
        ),
    ];
    for (name, build, want) in cases {
        let mut w = GgufWriter::new();
        build(&mut w);
        let e = open_err(&format!("{name}.gguf"), &w.to_bytes());
        assert!(e.contains(want), "{name}: {e}");
        if name != "dup" && name != "dims0" {
            assert!(
                e.contains("\"t\""),
                "{name}: error does not name the tensor: {e}"
            );
        }
    }

    // A misaligned offset, patched into a valid file.
    let mut w = GgufWriter::new();
    w.add_tensor("t", &[8], GgmlType::F32, f32s(8)).unwrap();
    let mut bytes = w.to_bytes();
    // header 24 + name (8 + 1) + n_dims 4 + dim 8 + type 4 = 49: the offset.
    bytes[49..57].copy_from_slice(&5u64.to_le_bytes());
    let e = open_err("misaligned.gguf", &bytes);
    assert!(e.contains("not a multiple of the alignment"), "{e}");
}

#[test]
fn missing_file_names_the_path() {
    let e = GgufFile::open("/nonexistent/model.gguf")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("/nonexistent/model.gguf"), "{e}");
}

#[test]
fn streamed_tensors_write_the_same_bytes_as_tensors_in_memory() {
    // In memory: the sample's two tensors, then a Q8_0 and an odd-sized F16 one (padding).
    let q8: Vec<u8> = (0..68u8).collect();
    let f16: Vec<u8> = (0..6u8).map(|b| b.wrapping_mul(37)).collect();
    let mut all = sample_writer();
    all.add_tensor("c.weight", &[64], GgmlType::Q8_0, q8.clone())
        .unwrap();
    all.add_tensor("d.weight", &[3], GgmlType::F16, f16.clone())
        .unwrap();
    // Streamed: the same two made by the producer, one at a time, after the sample's.
    let entries = [
        TensorEntry::new("c.weight", &[64], GgmlType::Q8_0).unwrap(),
        TensorEntry::new("d.weight", &[3], GgmlType::F16).unwrap(),
    ];
    let path = tmp("streamed.gguf");
    let mut calls = Vec::new();
    let n = sample_writer()
        .write_streamed(&path, &entries, |i, buf| {
            calls.push((i, buf.len()));
            buf.copy_from_slice(if i == 0 { &q8 } else { &f16 });
            Ok(())
        })
        .unwrap();
    assert_eq!(calls, [(0, 68), (1, 6)]);
    let want = all.to_bytes();
    assert_eq!(n, want.len() as u64);
    assert!(
        std::fs::read(&path).unwrap() == want,
        "streamed bytes differ"
    );
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tensor_data("d.weight").unwrap(), f16);

    // A producer that fails leaves no file behind, and its error comes back.
    let e = sample_writer()
        .write_streamed(&path, &entries, |i, _| match i {
            0 => Ok(()),
            _ => Err(oato::Error::Msg("no bytes for d.weight".into())),
        })
        .unwrap_err();
    assert!(e.to_string().contains("no bytes for d.weight"), "{e}");
    assert!(!path.exists());
    let e = TensorEntry::new("e", &[33], GgmlType::Q4_0).unwrap_err();
    assert!(
        e.to_string().contains("\"e\"") && e.to_string().contains("Q4_0"),
        "{e}"
    );
}
