//! Continuous batching in the executor: sequences on their own KV slots decode together in one
//! forward pass (`Session::forward_seqs`), joining and leaving at different steps, some prompts
//! prefilled alone and some inside the decode batch, and every sequence's greedy token ids equal
//! those of the same prompt run alone, on the CPU and on the CPU-backed test device (whole, and
//! split at random between the two).

mod common;

use std::sync::Arc;

use oato::model::Model;
use oato::quant::testdata::Rng;
use oato::runtime::backend::Backend;
use oato::runtime::cpu_backend::CpuBackend;
use oato::runtime::forward::{DeviceMap, SeqPart, Session};
use oato::runtime::sampler::argmax;
use oato::runtime::test_device::TestDevice;
use oato::tokenizer::Tokenizer;

use common::{greedy, model_path, random_half, scatter};

/// One sequence of the schedule: its prompt, the step it joins at, the tokens it generates.
struct Plan {
    prompt: Vec<u32>,
    join: usize,
    n: usize,
}

/// A running sequence: its plan's index, slot, next position and tokens so far.
struct Running {
    seq: usize,
    slot: usize,
    pos: usize,
    out: Vec<u32>,
}

/// Runs `plans` on the session's slots: at each step the sequences whose turn has come take a
/// free slot (the even ones prefilled alone first, the odd ones inside the step's batch), then
/// one forward call runs every running sequence's tokens; a sequence leaves once it has its
/// tokens, and its slot goes to the next. Returns each plan's tokens and the largest batch.
fn batched(session: &mut Session, plans: &[Plan]) -> (Vec<Vec<u32>>, usize) {
    let slots = session.slots();
    let mut done: Vec<Option<Vec<u32>>> = plans.iter().map(|_| None).collect();
    let mut running: Vec<Running> = Vec::new();
    let mut waiting: Vec<usize> = (0..plans.len()).collect();
    let mut widest = 0;
    let mut step = 0;
    while done.iter().any(Option::is_none) {
        // Leaves: those with all their tokens.
        running.retain(|r| {
            let over = r.out.len() >= plans[r.seq].n;
            if over {
                done[r.seq] = Some(r.out.clone());
            }
            !over
        });
        // Joins: a free slot for each sequence whose step has come.
        let mut fresh = Vec::new();
        while let Some(pos) = waiting.iter().position(|&i| plans[i].join <= step) {
            let free = (0..slots).find(|s| running.iter().chain(&fresh).all(|r| r.slot != *s));
            let Some(slot) = free else { break };
            let seq = waiting.remove(pos);
            let mut r = Running {
                seq,
                slot,
                pos: 0,
                out: Vec::new(),
            };
            if seq.is_multiple_of(2) {
                let p = &plans[seq].prompt;
                let part = SeqPart {
                    slot,
                    pos0: 0,
                    tokens: p,
                };
                let logits = session.forward_seqs(&[part]).unwrap();
                r.pos = p.len();
                r.out.push(argmax(&logits[0]));
                running.push(r);
            } else {
                fresh.push(r);
            }
        }
        running.append(&mut fresh);
        running.retain(|r| {
            let over = r.out.len() >= plans[r.seq].n;
            if over {
                done[r.seq] = Some(r.out.clone());
            }
            !over
        });
        if running.is_empty() {
            step += 1;
            continue;
        }
        // One forward call: a decode token for each running sequence, a whole prompt for
        // one that joined in this step.
        let fed: Vec<Vec<u32>> = running
            .iter()
            .map(|r| match r.out.last() {
                Some(&t) => vec![t],
                None => plans[r.seq].prompt.clone(),
            })
            .collect();
        let parts: Vec<SeqPart> = running
            .iter()
            .zip(&fed)
            .map(|(r, f)| SeqPart {
                slot: r.slot,
                pos0: r.pos,
                tokens: f,
            })
            .collect();
        widest = widest.max(parts.len());
        let logits = session.forward_seqs(&parts).unwrap();
        for ((r, l), f) in running.iter_mut().zip(&logits).zip(&fed) {
            r.pos += f.len();
            r.out.push(argmax(l));
        }
        step += 1;
    }
    (done.into_iter().map(Option::unwrap).collect(), widest)
}

/// Seven sequences over four slots: different prompt lengths, joins and lengths, so slots are
/// reused and the batch grows and shrinks (on AVX-512 the matmuls of four tokens take the
/// prefill tiles, those of fewer the decode kernel).
fn schedule(prompts: Vec<Vec<u32>>) -> Vec<Plan> {
    let (joins, ns) = ([0, 0, 1, 2, 3, 5, 6], [9, 4, 7, 5, 6, 8, 3]);
    prompts
        .into_iter()
        .zip(joins.into_iter().zip(ns))
        .map(|(prompt, (join, n))| Plan { prompt, join, n })
        .collect()
}

/// Each plan run alone on a one-slot CPU session.
fn reference(model: &Model, plans: &[Plan]) -> Vec<Vec<u32>> {
    let mut s = Session::new(model, 64).unwrap();
    plans
        .iter()
        .map(|p| greedy(&mut s, &p.prompt, p.n))
        .collect()
}

/// The batched run on the CPU, on the test device whole, split at random between them, and
/// split with half the CPU's weights streamed to the device for batches of 3 tokens or more
/// (placement rule 5, so decode batches stream too), each against `want`.
fn check_everywhere(model: &Model, plans: &[Plan], want: &[Vec<u32>], seed: u64) {
    let mut rng = Rng(seed);
    for round in 0..4 {
        let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new());
        let (backends, mut map) = if round == 0 {
            (vec![cpu], DeviceMap::uniform(model, 0))
        } else {
            let dev: Arc<dyn Backend> = Arc::new(TestDevice::new(1 << 30));
            (vec![cpu, dev], DeviceMap::uniform(model, 1))
        };
        if round >= 2 {
            scatter(&mut map, &mut rng);
        }
        if round == 3 {
            map.prefill_stream = random_half(&map, 0, &mut rng);
            assert!(!map.prefill_stream.is_empty());
            (map.stream_dev, map.stream_min_tokens) = (1, 3);
        }
        let mut session = Session::with_devices(model, 64, backends, &map).unwrap();
        session.set_slots(4).unwrap();
        assert_eq!(session.slots(), 4);
        let (got, widest) = batched(&mut session, plans);
        assert_eq!(widest, 4, "round {round}: the batch reached every slot");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(
                g, w,
                "round {round}: sequence {i} differs from its run alone"
            );
        }
    }
}

#[test]
fn batched_sequences_decode_as_they_do_alone() {
    let model = Model::open(model_path()).unwrap();
    let tok = Tokenizer::from_gguf(&model.file).unwrap();
    let prompts = [
        "The capital of France is",
        "Once upon a time, in a land far away, there lived",
        "1, 2, 3, 4,",
        "def fibonacci(n):",
        "The quick brown fox",
        "In the beginning",
        "Roses are red,",
    ]
    .iter()
    .map(|p| tok.encode(p, true, true).unwrap())
    .collect();
    let plans = schedule(prompts);
    let want = reference(&model, &plans);
    check_everywhere(&model, &plans, &want, 0xBA7C);
}

/// The same for multi-head latent attention (its RoPE of the shared key is per sequence too),
/// on the numpy-checked MiniCPM3 fixture.
#[test]
fn batched_latent_attention_decodes_as_alone() {
    let r = common::numpy_ref::Reference::load("minicpm3");
    let model = r.model("tiny-minicpm3.gguf");
    let p = &r.prompt;
    let prompts = (0..7)
        .map(|i| {
            let mut v = p[..p.len() - i % 3].to_vec();
            v.rotate_left(i % p.len().max(1));
            v
        })
        .collect();
    let plans = schedule(prompts);
    let want = reference(&model, &plans);
    check_everywhere(&model, &plans, &want, 0x3CB);
}

#[test]
fn a_bad_batch_is_an_error() {
    let model = Model::open(model_path()).unwrap();
    let mut s = Session::new(&model, 16).unwrap();
    s.set_slots(2).unwrap();
    let part = |slot, pos0, tokens| SeqPart { slot, pos0, tokens };
    let t = [1u32, 2];
    for (parts, why) in [
        (vec![part(2, 0, &t[..])], "slot"),
        (vec![part(0, 0, &t[..]), part(0, 2, &t[..])], "slot"),
        (vec![part(1, 15, &t[..])], "context full"),
        (vec![part(1, 0, &t[..0])], "no tokens"),
    ] {
        let e = s.forward_seqs(&parts).unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
    }
}
