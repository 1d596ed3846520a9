//! Decode step time against batch size on the CPU, what `oato serve --parallel` runs:
//! `cargo run --release --example decode_batch -- MODEL [THREADS] [B...]` prefills 16 tokens on
//! each of max(B) KV slots, then times `Session::forward_seqs` with one token on each of the first
//! b slots (median of 7 steps after one warm-up step) for each b given (default 1 2 3 4 8 16),
//! and prints ms per step and tokens per second.

use std::time::Instant;

use oato::model::Model;
use oato::runtime::forward::{SeqPart, Session};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first() else {
        eprintln!("usage: decode_batch MODEL [THREADS] [B...]");
        std::process::exit(2);
    };
    let threads = args
        .get(1)
        .map_or(2, |t| t.parse().expect("THREADS: a number"));
    let mut sizes: Vec<usize> = args
        .iter()
        .skip(2)
        .map(|b| b.parse().expect("B: a number"))
        .collect();
    if sizes.is_empty() {
        sizes = vec![1, 2, 3, 4, 8, 16];
    }
    oato::kernels::cpu::pool::set_threads(threads);
    let model = Model::open(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let slots = sizes.iter().copied().max().unwrap_or(1);
    let (prompt_len, steps) = (16, 8);
    let mut s = Session::new(&model, prompt_len + steps * sizes.len()).expect("a session");
    s.set_slots(slots).expect("the KV slots");
    let prompt: Vec<u32> = (1..=prompt_len as u32).collect();
    for slot in 0..slots {
        let part = SeqPart {
            slot,
            pos0: 0,
            tokens: &prompt,
        };
        s.forward_seqs(&[part]).expect("a prefill");
    }
    let tokens = vec![7u32; slots.max(steps)];
    let mut pos = prompt_len;
    println!("{path}: {threads} threads");
    for b in sizes {
        let mut ms = Vec::with_capacity(steps);
        for _ in 0..steps {
            let parts: Vec<SeqPart> = (0..b)
                .map(|i| SeqPart {
                    slot: i,
                    pos0: pos,
                    tokens: &tokens[i..i + 1],
                })
                .collect();
            let t = Instant::now();
            s.forward_seqs(&parts).expect("a decode step");
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            pos += 1;
        }
        // Every slot moves on together, so later sizes start where this one stopped.
        for slot in b..slots {
            let part = SeqPart {
                slot,
                pos0: pos - steps,
                tokens: &tokens[..steps],
            };
            s.forward_seqs(&[part]).expect("catching a slot up");
        }
        ms.remove(0);
        ms.sort_by(f64::total_cmp);
        let med = ms[ms.len() / 2];
        println!(
            "b={b:<3} {med:8.1} ms/step  {:7.1} tokens/s",
            b as f64 * 1e3 / med
        );
    }
}
