//! oato's scalar quantisation against vectors written by `scripts/gen-quant-vectors.py` from the
//! `gguf` Python package (llama.cpp's numpy port of ggml's reference code): dequantised values and
//! quantised bytes must match bit for bit. Q8_1 and Q8_K, which the package lacks, are checked
//! against the script's own numpy version of ggml's reference and by round-trip properties.

use std::path::{Path, PathBuf};

use oato::quant::{BlockQ8_1, BlockQ8K, GgmlType, as_blocks, dequantize_row, quantize_row};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant")
}

fn read(name: &str) -> Vec<u8> {
    let path = data_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

struct Case {
    op: String,
    ty: GgmlType,
    n: usize,
    input: String,
    expected: String,
    source: String,
}

fn cases() -> Vec<Case> {
    let text = String::from_utf8(read("manifest.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    let field = |c: &serde_json::Value, k: &str| {
        c[k].as_str()
            .unwrap_or_else(|| panic!("{k} in {c}"))
            .to_string()
    };
    manifest["cases"]
        .as_array()
        .expect("manifest.json: cases")
        .iter()
        .map(|c| Case {
            op: field(c, "op"),
            ty: GgmlType::from_name(&field(c, "type")).unwrap(),
            n: c["n"].as_u64().expect("n") as usize,
            input: field(c, "input"),
            expected: field(c, "expected"),
            source: field(c, "source"),
        })
        .collect()
}

/// Bitwise comparison; on mismatch, a line with the count, the largest error and where it is.
fn compare_f32(what: &str, got: &[f32], want: &[f32]) -> Result<String, String> {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut bad = 0;
    let (mut worst, mut at) = (0.0f64, 0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() != w.to_bits() {
            bad += 1;
            let e = (*g as f64 - *w as f64).abs();
            if bad == 1 || e > worst {
                (worst, at) = (e, i);
            }
        }
    }
    if bad == 0 {
        Ok(format!("{what}: {} values bit-exact", got.len()))
    } else {
        Err(format!(
            "{what}: {bad}/{} values differ; largest error {worst:e} at element {at} (block {}): got {} want {}",
            got.len(),
            at / 32,
            got[at],
            want[at]
        ))
    }
}

#[test]
fn dequantize_row_matches_the_gguf_package() {
    let mut failures = Vec::new();
    let mut seen = Vec::new();
    for c in cases().iter().filter(|c| c.op == "dequantize") {
        let src = read(&c.input);
        let want = f32s(&read(&c.expected));
        assert_eq!(want.len(), c.n, "{}: expected length", c.expected);
        // Read from an odd address too: blocks are viewed in place whatever the alignment.
        for offset in [0usize, 1] {
            let mut buf = vec![0u8; offset];
            buf.extend_from_slice(&src);
            let mut got = vec![0.0f32; c.n];
            dequantize_row(c.ty, &buf[offset..], &mut got).unwrap();
            let what = format!("dequantize {} ({}, offset {offset})", c.ty, c.source);
            match compare_f32(&what, &got, &want) {
                Ok(line) => eprintln!("{line}"),
                Err(line) => failures.push(line),
            }
        }
        seen.push(c.ty);
    }
    use GgmlType::*;
    for ty in [
        F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
        IQ4_NL, IQ4_XS,
    ] {
        assert!(
            seen.contains(&ty),
            "manifest.json has no dequantize case for {ty}"
        );
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// Which field of block `b` of type `ty` holds byte `off` (for mismatch reports).
fn field_at(ty: GgmlType, off: usize) -> &'static str {
    use GgmlType::*;
    match (ty, off) {
        (F32 | F16 | BF16, _) => "value",
        (Q4_0 | Q5_0 | Q8_0 | IQ4_NL | IQ4_XS, 0..2) | (Q4_1 | Q5_1 | Q8_1, 0..2) => "d",
        (IQ4_XS, 2..4) => "scales_h",
        (IQ4_XS, 4..8) => "scales_l",
        (Q4_1 | Q5_1, 2..4) => "m",
        (Q8_1, 2..4) => "s",
        (Q5_0, 2..6) | (Q5_1, 4..8) => "qh",
        (Q8_K, 0..4) => "d",
        (Q8_K, 260..) => "bsums",
        _ => "qs",
    }
}

#[test]
fn quantize_row_matches_the_gguf_package() {
    let input = f32s(&read("quant-input.f32"));
    let mut failures = Vec::new();
    let mut seen = Vec::new();
    for c in cases().iter().filter(|c| c.op == "quantize") {
        let x = &input[..c.n];
        let want = read(&c.expected);
        let mut got = vec![0u8; c.ty.row_bytes(c.n).unwrap()];
        quantize_row(c.ty, x, &mut got).unwrap();
        assert_eq!(got.len(), want.len(), "{}: row bytes", c.expected);
        let diffs: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
        let what = format!("quantize {} ({})", c.ty, c.source);
        if diffs.is_empty() {
            eprintln!("{what}: {} bytes identical", got.len());
        } else {
            let ts = c.ty.type_size();
            let first = diffs[0];
            // Also say how far apart the values are once dequantised.
            let (mut gv, mut wv) = (vec![0.0f32; c.n], vec![0.0f32; c.n]);
            let dq = dequantize_row(c.ty, &got, &mut gv).and(dequantize_row(c.ty, &want, &mut wv));
            let spread = match dq {
                Ok(()) => gv
                    .iter()
                    .zip(&wv)
                    .enumerate()
                    .map(|(i, (a, b))| ((*a as f64 - *b as f64).abs(), i))
                    .fold((0.0, 0), |m, e| if e.0 > m.0 { e } else { m }),
                Err(_) => (f64::NAN, 0),
            };
            failures.push(format!(
                "{what}: {} of {} bytes differ; first at byte {first} (block {}, field {}): got {:#04x} want {:#04x}; \
                 dequantised, largest difference {:e} at element {}",
                diffs.len(),
                got.len(),
                first / ts,
                field_at(c.ty, first % ts),
                got[first],
                want[first],
                spread.0,
                spread.1
            ));
        }
        seen.push(c.ty);
    }
    use GgmlType::*;
    for ty in [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q8_K] {
        assert!(
            seen.contains(&ty),
            "manifest.json has no quantize case for {ty}"
        );
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// Q8_1 and Q8_K, which the gguf package cannot make: every value comes back within half a step
/// (plus f16 rounding of Q8_1's scale), and the stored sums are the sums of the stored quants.
#[test]
fn q8_1_and_q8_k_round_trip_within_half_a_step() {
    let input = f32s(&read("quant-input.f32"));
    let x = &input[..];

    let mut q = vec![0u8; GgmlType::Q8_1.row_bytes(x.len()).unwrap()];
    quantize_row(GgmlType::Q8_1, x, &mut q).unwrap();
    let mut back = vec![0.0f32; x.len()];
    dequantize_row(GgmlType::Q8_1, &q, &mut back).unwrap();
    let blocks: &[BlockQ8_1] = as_blocks(&q).unwrap();
    let mut worst = (0.0f64, 0usize);
    for (b, blk) in blocks.iter().enumerate() {
        let amax = x[32 * b..32 * b + 32]
            .iter()
            .fold(0.0f32, |m, v| m.max(v.abs()));
        let step = amax as f64 / 127.0;
        // d = f16(amax / 127): off by at most 2^-11 relative, or 2^-25 absolute below f16's
        // normal range (the edge-case block of values near 1e-6 has a d that rounds to zero).
        let d_err = (step * 2f64.powi(-11)).max(2f64.powi(-25));
        let d = blk.d.to_f32() as f64;
        assert!((d - step).abs() <= d_err, "block {b}: d {d} amax {amax}");
        let sum: i32 = blk.qs.iter().map(|&v| v as i32).sum();
        let s_want = half::f16::from_f32(sum as f32 * (amax / 127.0)).to_f32();
        assert_eq!(
            blk.s.to_f32(),
            s_want,
            "block {b}: s = f16(d * sum(qs)) with sum {sum}"
        );
        assert!(
            blk.qs.iter().all(|&v| v > -128),
            "block {b}: q8_1 quants stay in -127..=127"
        );
        // half a step of the exact scale, plus 127 times the error of the stored scale
        let bound = (0.5 * step + 127.0 * d_err) * (1.0 + 1e-6);
        for i in 32 * b..32 * b + 32 {
            let e = (back[i] as f64 - x[i] as f64).abs() / bound;
            if e > worst.0 {
                worst = (e, i);
            }
        }
    }
    eprintln!(
        "Q8_1 round trip: largest error {:.3} of the bound at element {}",
        worst.0, worst.1
    );
    assert!(
        worst.0 <= 1.0,
        "Q8_1 round trip: error {:.3} of the bound at element {}",
        worst.0,
        worst.1
    );

    let mut q = vec![0u8; GgmlType::Q8_K.row_bytes(x.len()).unwrap()];
    quantize_row(GgmlType::Q8_K, x, &mut q).unwrap();
    let mut back = vec![0.0f32; x.len()];
    dequantize_row(GgmlType::Q8_K, &q, &mut back).unwrap();
    let blocks: &[BlockQ8K] = as_blocks(&q).unwrap();
    let mut worst = (0.0f64, 0usize);
    for (b, blk) in blocks.iter().enumerate() {
        let xs = &x[256 * b..256 * b + 256];
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
        let d = blk.d.get() as f64;
        if amax == 0.0 {
            assert_eq!(d, 0.0, "block {b}: all-zero block has d = 0");
        } else {
            // iscale = -127 / max: the element of largest magnitude maps to -127 * sign.
            assert!(
                (d.abs() - amax / 127.0).abs() <= amax / 127.0 * 1e-6,
                "block {b}: |d| {d} amax {amax}"
            );
        }
        for (g, s) in blk.bsums.iter().enumerate() {
            let sum: i32 = blk.qs[16 * g..16 * g + 16].iter().map(|&v| v as i32).sum();
            assert_eq!(s.get() as i32, sum, "block {b}: bsums[{g}]");
        }
        for i in 256 * b..256 * b + 256 {
            let bound = amax / 254.0 * (1.0 + 1e-5) + 1e-30;
            let e = (back[i] as f64 - x[i] as f64).abs() / bound;
            if e > worst.0 {
                worst = (e, i);
            }
        }
    }
    eprintln!(
        "Q8_K round trip: largest error {:.3} of half a step at element {}",
        worst.0, worst.1
    );
    assert!(
        worst.0 <= 1.0,
        "Q8_K round trip: error {:.3} of half a step at element {}",
        worst.0,
        worst.1
    );
}

#[test]
fn bad_lengths_and_types_are_errors_not_panics() {
    let mut out = vec![0.0f32; 64];
    assert!(dequantize_row(GgmlType::Q4_0, &[0u8; 35], &mut out).is_err());
    assert!(dequantize_row(GgmlType::Q4_0, &[0u8; 37], &mut out).is_err());
    assert!(
        dequantize_row(GgmlType::Q4_K, &[0u8; 144], &mut out).is_err(),
        "64 is not a whole Q4_K block"
    );
    assert!(dequantize_row(GgmlType::I32, &[0u8; 256], &mut out).is_err());
    let x = vec![1.0f32; 64];
    assert!(quantize_row(GgmlType::Q8_0, &x, &mut [0u8; 67]).is_err());
    assert!(quantize_row(GgmlType::Q4_K, &[0.0; 256], &mut [0u8; 144]).is_err());
    assert!(quantize_row(GgmlType::F64, &x, &mut [0u8; 512]).is_err());
    assert!(oato::quant::vec_dot_checked(GgmlType::Q8_0, &[0u8; 34], &[0u8; 33], 32).is_err());
    assert!(oato::quant::vec_dot_checked(GgmlType::Q8_K, &[0u8; 292], &[0u8; 1024], 256).is_err());
}
