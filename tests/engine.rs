//! The library's `Engine` stage (what `oato run` and a future server share): a model opened once
//! and placed whole on the CPU, split under a budget on the CPU-backed test device, and from the
//! placement file that budget's plan writes, gives the same greedy tokens each time.

mod common;

use common::{model_path, tmp_dir};
use oato::engine::{DeviceChoice, Opened, PlaceOptions, Split};
use oato::runtime::generate::generate;
use oato::runtime::sampler::{Sampler, SamplerConfig};
use oato::scheduler::Policy;

fn greedy(opened: &Opened, split: Split) -> (Vec<u32>, Option<oato::scheduler::Placement>) {
    let prompt = opened
        .tokenizer
        .encode("The capital of France is", true, true)
        .unwrap();
    let mut engine = opened
        .place(&PlaceOptions {
            split,
            threads: 2,
            ctx: 256,
            seqs: 1,
            prompt_tokens: prompt.len(),
            gen_tokens: 8,
            stream_min_tokens: None,
        })
        .unwrap();
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: 0.0,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        repeat_penalty: 1.0,
        repeat_last_n: 64,
        seed: 1,
    });
    let g = generate(
        &mut engine.session,
        &opened.tokenizer,
        true,
        &mut sampler,
        &prompt,
        8,
        |_| {},
    )
    .unwrap();
    (g.output_ids, engine.placement)
}

#[test]
fn whole_budget_and_file_placements_agree() {
    let dir = tmp_dir("engine", "agree");
    // Set before any backend opens; this binary has only this test.
    // SAFETY: no other thread of this test binary reads the environment meanwhile.
    unsafe {
        std::env::set_var("OATO_TEST_DEVICE", "2000000000");
        std::env::set_var("OATO_CACHE_DIR", dir.join("cache"));
    }
    oato::kernels::cpu::pool::set_threads(2);
    let cpu = Opened::open(&model_path(), DeviceChoice::Cpu).unwrap();
    let (want, none) = greedy(&cpu, Split::Whole);
    assert!(none.is_none() && want.len() == 8);

    let dev = Opened::open(&model_path(), DeviceChoice::Auto).unwrap();
    assert_eq!(dev.dev, 1, "the test device stands in for the GPU");
    let (got, placement) = greedy(
        &dev,
        Split::Budget {
            budget: "50%".into(),
            policy: Policy::Oato,
            stream: true,
            force_profile: false,
        },
    );
    assert_eq!(got, want);
    let placement = placement.expect("a split run has a placement");
    let file = dir.join("placement.json");
    std::fs::write(&file, placement.to_json().unwrap()).unwrap();
    let (from_file, _) = greedy(&dev, Split::File(file));
    assert_eq!(from_file, want);
}
