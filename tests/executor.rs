//! The hybrid executor without a GPU: a CPU-backed test device stands in for the GPU. For random
//! placements, every target operator runs on the backend its map names (counted by the device),
//! activations cross only through the devices' own buffers, and the greedy tokens equal the
//! all-CPU tokens.

mod common;

use std::sync::Arc;

use oato::model::Model;
use oato::quant::testdata::Rng;
use oato::runtime::backend::Backend;
use oato::runtime::cpu_backend::CpuBackend;
use oato::runtime::forward::{DeviceMap, Logits, Session, target_weights};
use oato::runtime::test_device::TestDevice;
use oato::tokenizer::Tokenizer;

use common::{greedy, model_path, random_half, scatter};

/// Backend 0 the CPU, backend 1 a test device (returned too, for its counters).
/// The test prompt's ids and the all-CPU greedy continuation of `n_gen` tokens.
fn reference(model: &Model, n_gen: usize) -> (Vec<u32>, Vec<u32>) {
    let tok = Tokenizer::from_gguf(&model.file).unwrap();
    let prompt = tok.encode("The capital of France is", true, true).unwrap();
    let want = greedy(&mut Session::new(model, 64).unwrap(), &prompt, n_gen);
    (prompt, want)
}

/// The session's copies between backends over one prefill of `prompt_len` tokens and
/// `calls - 1` decode steps equal the map's crossings for those batch sizes.
fn assert_copies_are_the_plans(
    session: &Session,
    map: &DeviceMap,
    prompt_len: usize,
    calls: usize,
    round: usize,
) {
    let model = session.model;
    assert_eq!(
        session.transfers.copies,
        map.crossings(model, 0, prompt_len) + (calls - 1) * map.crossings(model, 0, 1),
        "round {round}: copies against the plan's count"
    );
}

/// The CPU's activation buffers come from the device's host memory, as `open_backends` sets
/// them up: the device checks that the executor leaves the bytes a `write` took from there
/// unchanged until it has waited for the device to read them (`host_reads_done`).
fn cpu_and_test_device() -> (Vec<Arc<dyn Backend>>, Arc<TestDevice>) {
    let dev = Arc::new(TestDevice::new(1 << 30));
    let cpu = CpuBackend::new();
    assert!(cpu.use_host_memory(dev.host_memory().unwrap()));
    (vec![Arc::new(cpu), dev.clone()], dev)
}

#[test]
fn random_placements_run_where_the_map_says_and_match_the_cpu() {
    let model = Model::open(model_path()).unwrap();
    let (prompt, want) = reference(&model, 6);
    random_placements_match(&model, &prompt, &want, 0x0A70);
}

/// The same for multi-head latent attention (MiniCPM3's four projections are target operators
/// too), on the numpy-checked fixture of tests/minicpm3_reference.rs.
#[test]
fn random_placements_of_latent_attention_match_the_cpu() {
    let r = common::numpy_ref::Reference::load("minicpm3");
    let model = r.model("tiny-minicpm3.gguf");
    let want = greedy(&mut Session::new(&model, 64).unwrap(), &r.prompt, 6);
    assert_eq!(
        want,
        r.greedy[..6],
        "the CPU's greedy ids are the reference's"
    );
    for seed in [0x3C9, 0x3CA] {
        random_placements_match(&model, &r.prompt, &want, seed);
    }
}

/// Four rounds of placements on the CPU and the test device (all on the device, then random,
/// the last streaming half of the device's weights): each gives `want` after `prompt`, runs every
/// target operator where the map says, and copies what the plan says.
fn random_placements_match(model: &Model, prompt: &[u32], want: &[u32], seed: u64) {
    let n_gen = want.len();
    let mut rng = Rng(seed);
    for round in 0..4 {
        let (backends, dev) = cpu_and_test_device();
        // Round 0: everything on the device; the others: each weight and home at random.
        let mut map = DeviceMap::uniform(model, 1);
        if round > 0 {
            scatter(&mut map, &mut rng);
        }
        // Round 3 streams a random half of the device's weights (FlexGen-style).
        if round == 3 {
            map.streamed = random_half(&map, 1, &mut rng);
            assert!(!map.streamed.is_empty());
        }
        let mut session = Session::with_devices(model, 64, backends, &map).unwrap();
        let got = greedy(&mut session, prompt, n_gen);
        assert_eq!(
            got, want,
            "round {round}: tokens differ from the all-CPU run"
        );

        // Each forward call runs every target operator once, on its mapped backend only.
        let counts = dev.matmul_counts();
        let calls = n_gen; // one prefill + (n_gen - 1) decode steps
        let mut on_device = 0;
        for w in target_weights(model) {
            let expect = if map.weights[&w.name] == 1 { calls } else { 0 };
            let got = counts.get(&w.name).copied().unwrap_or(0);
            assert_eq!(
                got, expect,
                "round {round}: {} ran {got} times on the device",
                w.name
            );
            on_device += (expect > 0) as usize;
        }
        // Streamed weights are copied for every forward call (layer 0's once more: its copy for
        // the next call starts when a call ends); the others never.
        let prefetches = dev.prefetch_counts();
        for w in target_weights(model) {
            let first_layer = w.name.starts_with("blk.0.") as usize;
            let expect = if map.streamed.contains(&w.name) {
                calls + first_layer
            } else {
                0
            };
            assert_eq!(
                prefetches.get(&w.name).copied().unwrap_or(0),
                expect,
                "{}",
                w.name
            );
        }
        let crossings = session.transfers.copies;
        assert_copies_are_the_plans(&session, &map, prompt.len(), calls, round);
        println!(
            "round {round}: {on_device} of {} target operators on the test device, {crossings} copies",
            target_weights(model).len()
        );
        if round == 0 {
            // All on the device: only the embedding goes in and the logits come out.
            assert_eq!(crossings, calls, "round 0 copies");
        } else {
            assert!(
                crossings > calls,
                "round {round}: mixed placements cross more"
            );
        }
    }
}

#[test]
fn bad_device_maps_are_errors() {
    let model = Model::open(model_path()).unwrap();
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new());
    let mut map = DeviceMap::uniform(&model, 0);
    map.weights.remove("blk.3.ffn_up.weight");
    let e = Session::with_devices(&model, 16, vec![cpu.clone()], &map)
        .err()
        .unwrap();
    assert!(e.to_string().contains("blk.3.ffn_up.weight"), "{e}");
    let mut map = DeviceMap::uniform(&model, 0);
    map.layer_home[2] = 5;
    let e = Session::with_devices(&model, 16, vec![cpu], &map)
        .err()
        .unwrap();
    assert!(e.to_string().contains("#5"), "{e}");
    let dev: Arc<dyn Backend> = Arc::new(TestDevice::new(1 << 30));
    let e = Session::with_devices(&model, 16, vec![dev], &DeviceMap::uniform(&model, 0))
        .err()
        .unwrap();
    assert!(e.to_string().contains("no CPU backend"), "{e}");
}

/// Prefill streaming (rule 5): the CPU weights listed in `prefill_stream` run on the device in a
/// prompt batch of at least `stream_min_tokens` tokens, copied there once per such call, and on
/// the CPU in decode; the tokens equal the all-CPU run, and the copies between backends are the
/// plan's for each batch size.
#[test]
fn prefill_streaming_runs_listed_weights_on_the_device_in_prefill_only() {
    let model = Model::open(model_path()).unwrap();
    let n_gen = 5;
    let (prompt, want) = reference(&model, n_gen);
    assert!(prompt.len() >= 4);

    let mut rng = Rng(0x5743);
    for round in 0..3 {
        let (backends, dev) = cpu_and_test_device();
        let mut map = DeviceMap::uniform(&model, 0);
        // Round 0: every weight on the CPU, all streamed, homes on the CPU (layer-split's CPU
        // layers); the others: random weights and homes, a random half of the CPU weights
        // streamed.
        if round > 0 {
            scatter(&mut map, &mut rng);
        }
        map.prefill_stream = map
            .weights
            .iter()
            .filter(|&(_, &d)| d == 0)
            .map(|(n, _)| n.clone())
            .filter(|_| round == 0 || rng.next() & 1 == 1)
            .collect();
        map.stream_dev = 1;
        map.stream_min_tokens = prompt.len();
        assert!(!map.prefill_stream.is_empty());
        let mut session = Session::with_devices(&model, 64, backends, &map).unwrap();
        let got = greedy(&mut session, &prompt, n_gen);
        assert_eq!(
            got, want,
            "round {round}: tokens differ from the all-CPU run"
        );

        let counts = dev.matmul_counts();
        let prefetches = dev.prefetch_counts();
        for w in target_weights(&model) {
            let resident = map.weights[&w.name] == 1;
            let streamed = map.prefill_stream.contains(&w.name);
            let expect = if resident {
                n_gen
            } else if streamed {
                1
            } else {
                0
            };
            assert_eq!(
                counts.get(&w.name).copied().unwrap_or(0),
                expect,
                "round {round}: {} device matmuls",
                w.name
            );
            assert_eq!(
                prefetches.get(&w.name).copied().unwrap_or(0),
                streamed as usize,
                "round {round}: {} copies for prefill",
                w.name
            );
        }
        assert_copies_are_the_plans(&session, &map, prompt.len(), n_gen, round);
        // A batch below the threshold does not stream.
        let before = dev.prefetch_counts().values().sum::<usize>();
        session.reset();
        session
            .forward(&prompt[..prompt.len() - 1], Logits::Last)
            .unwrap();
        assert_eq!(dev.prefetch_counts().values().sum::<usize>(), before);
    }
}
