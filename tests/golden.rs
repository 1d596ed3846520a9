//! The CPU engine against llama.cpp's reference outputs for the real test model
//! (tests/data/golden/smollm2-q4_1.json): greedy continuations under the file's parity rule and
//! last-position logits, under every CPU variant (perplexity is in tests/perplexity.rs: this file
//! switches the process-wide CPU variant).

mod common;

use oato::kernels::cpu::{Isa, set_isa};
use oato::model::Model;
use std::sync::Arc;

use oato::runtime::backend::Backend;
use oato::runtime::cpu_backend::CpuBackend;
use oato::runtime::cuda_backend::{self, CudaBackend};
use oato::runtime::forward::{DeviceMap, Logits, Session};
use oato::runtime::sampler::argmax;
use oato::tokenizer::Tokenizer;

use common::{Parity, check_parity, golden, ids, model_path, top_choices};

#[test]
fn parity_rule_rejects_what_it_should() {
    let top2 = serde_json::json!([[[5, 10.0], [6, 9.8]], [[7, 10.0], [8, 8.0]]]);
    assert!(matches!(
        check_parity(&[5, 7], &[5, 7], &top2),
        Ok(Parity::Equal)
    ));
    assert!(matches!(
        check_parity(&[6, 1], &[5, 7], &top2),
        Ok(Parity::NearTie { d: 0, .. })
    ));
    assert!(
        check_parity(&[9, 7], &[5, 7], &top2).is_err(),
        "not the second choice"
    );
    assert!(
        check_parity(&[5, 8], &[5, 7], &top2).is_err(),
        "margin too wide"
    );
    // Top five: a third choice within 0.5 of the top passes, one beyond or outside does not.
    let top5 = serde_json::json!([[[5, 10.0], [6, 9.9], [4, 9.6], [3, 9.4], [2, 9.0]]]);
    assert!(matches!(
        check_parity(&[4], &[5], &top5),
        Ok(Parity::NearTie { d: 0, .. })
    ));
    assert!(
        check_parity(&[3], &[5], &top5).is_err(),
        "0.6 below the top"
    );
    assert!(
        check_parity(&[9], &[5], &top5).is_err(),
        "not in the top five"
    );
}

/// The golden continuations under every CPU variant this machine supports (scalar, AVX2,
/// AVX-512): the variants compute bit-identical results, and this checks it end to end.
#[test]
fn greedy_continuations_and_logits_match_llama_cpp() {
    for isa in Isa::all_supported() {
        set_isa(isa).unwrap();
        println!("--- {}", isa.name());
        let model = Model::open(model_path()).unwrap();
        golden_greedy(&model, Session::new(&model, 512).unwrap());
    }
}

/// The same continuations with the whole model on the GPU (skipped, saying why, without one).
#[test]
fn all_gpu_greedy_continuations_match_llama_cpp() {
    if let Err(why) = cuda_backend::probe() {
        println!("skipped: {why}");
        return;
    }
    let model = Model::open(model_path()).unwrap();
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let gpu: Arc<dyn Backend> = Arc::new(CudaBackend::new(0).unwrap());
    println!("--- {}", gpu.describe());
    let map = DeviceMap::uniform(&model, 1);
    golden_greedy(
        &model,
        Session::with_devices(&model, 512, vec![cpu, gpu], &map).unwrap(),
    );
}

fn golden_greedy(model: &Model, mut session: Session) {
    let g = golden();
    let tok = Tokenizer::from_gguf(&model.file).unwrap();
    let mut failures = Vec::new();
    for p in g["prompts"].as_array().unwrap() {
        let prompt = p["prompt"].as_str().unwrap();
        let want_prompt = ids(&p["prompt_ids"]);
        let prompt_ids = tok.encode(prompt, true, true).unwrap();
        assert_eq!(prompt_ids, want_prompt, "prompt ids of {prompt:?}");

        session.reset();
        let mut logits = session.forward(&prompt_ids, Logits::Last).unwrap();
        // Last prompt position: each of llama.cpp's top-20 logits within 1.0.
        let mut worst = (0.0f64, 0u32);
        for pair in p["top20_logits_last_prompt_pos"].as_array().unwrap() {
            let id = pair[0].as_u64().unwrap() as u32;
            let diff = (logits[id as usize] as f64 - pair[1].as_f64().unwrap()).abs();
            if diff > worst.0 {
                worst = (diff, id);
            }
        }
        println!(
            "{prompt:?}: largest top-20 logit difference {:.4} at id {}",
            worst.0, worst.1
        );
        if worst.0 >= 1.0 {
            failures.push(format!(
                "{prompt:?}: logit of id {} differs by {:.3}",
                worst.1, worst.0
            ));
        }

        let want = ids(&p["output_ids"]);
        let mut out = Vec::new();
        while out.len() < want.len() {
            let t = argmax(&logits);
            out.push(t);
            if out.len() < want.len() {
                logits = session.forward(&[t], Logits::Last).unwrap();
            }
        }
        match check_parity(&out, &want, top_choices(p)) {
            Ok(r) => println!("{prompt:?}: {r:?}"),
            Err(e) => failures.push(format!(
                "{prompt:?}: {e}\n  ours: {out:?}\n  llama.cpp: {want:?}"
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
