//! The fuzz harness's slice for CI (the long run: `cargo run --release --example fuzz`): a few
//! thousand mutated GGUF files, profiles and placements through the readers and validators, and
//! not one panic. Also the inputs the long run found, kept as regressions: each is now a clear
//! error.

use oato::fuzz::{Seeds, Target, fuzz, replay};
use oato::gguf::{GgufFile, GgufWriter, Value};
use oato::model::Model;
use oato::quant::GgmlType;

#[test]
fn mutated_inputs_are_errors_never_panics() {
    let seeds = Seeds::new().expect("the seed files");
    for (target, inputs) in [
        (Target::Gguf, 4000),
        (Target::Profile, 600),
        (Target::Placement, 3000),
        (Target::Request, 4000),
    ] {
        let r = fuzz(target, &seeds, inputs, 0xC1);
        println!(
            "{}: {} inputs, {} accepted, {} rejected, {} panicked, {:.2} s",
            target.name(),
            r.inputs,
            r.accepted,
            r.rejected,
            r.panics.len(),
            r.secs
        );
        assert!(
            r.panics.is_empty(),
            "{}: {:?}",
            target.name(),
            r.panics.iter().map(|p| &p.message).collect::<Vec<_>>()
        );
        assert_eq!(r.inputs, inputs);
        // Both outcomes happen: the mutations reach past the parsers, and most are refused.
        assert!(r.accepted > 0 && r.rejected > r.accepted, "{r:?}");
    }
}

#[test]
fn what_the_fuzzer_found_is_now_a_clear_error() {
    let seeds = Seeds::new().expect("the seed files");
    let mut prof: serde_json::Value = serde_json::from_str(&seeds.profile).unwrap();
    // An operator kind the scheduler has no slot for (it indexed past a layer's seven).
    prof["operators"][2]["kind"] = "5attn_v".into();
    let e = replay(Target::Profile, &seeds, prof.to_string().as_bytes()).unwrap_err();
    assert!(e.to_string().contains("kind \"5attn_v\""), "{e}");
    // 2^32 layers (the scheduler allocated a slot for each, 300 GB, and aborted).
    let mut prof: serde_json::Value = serde_json::from_str(&seeds.profile).unwrap();
    prof["model"]["n_layer"] = (1u64 << 32).into();
    let e = replay(Target::Profile, &seeds, prof.to_string().as_bytes()).unwrap_err();
    assert!(e.to_string().contains("n_layer 4294967296"), "{e}");
    // The same through n_layer 0 (the layers then counted from the operators) and a layer of
    // 2^32.
    let mut prof: serde_json::Value = serde_json::from_str(&seeds.profile).unwrap();
    prof["model"]["n_layer"] = 0.into();
    prof["operators"][0]["layer"] = (1u64 << 32).into();
    let e = replay(Target::Profile, &seeds, prof.to_string().as_bytes()).unwrap_err();
    assert!(e.to_string().contains("in layer Some(4294967296)"), "{e}");
}

#[test]
fn a_gguf_with_two_billion_layers_is_refused_without_allocating_them() {
    // Model::from_gguf reserved room for block_count layers before reading one: 2^31 - 1, the
    // largest it accepts, asked for 600 GB and aborted.
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    for (k, v) in [
        ("embedding_length", 32),
        ("block_count", (1 << 31) - 1),
        ("attention.head_count", 2),
        ("feed_forward_length", 64),
    ] {
        w.set(&format!("llama.{k}"), Value::U32(v));
    }
    w.add_tensor(
        "token_embd.weight",
        &[32, 4],
        GgmlType::F32,
        vec![0; 32 * 4 * 4],
    )
    .unwrap();
    w.add_tensor("output_norm.weight", &[32], GgmlType::F32, vec![0; 32 * 4])
        .unwrap();
    let file = GgufFile::from_bytes("layers.gguf", &w.to_bytes()).unwrap();
    let e = Model::from_gguf(file).err().expect("refused").to_string();
    assert!(e.contains("blk.0."), "{e}");
}
