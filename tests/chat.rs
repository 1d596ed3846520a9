//! `oato chat` with turns piped on standard input: the second turn runs only its new tokens (the
//! first turn's keys and values are reused), and that gives the tokens a fresh prefill of the
//! whole conversation gives; `/bye` and the end of input leave; a full context is said clearly;
//! Ctrl-C stops an answer and the conversation goes on.

mod common;

use std::io::{Read, Write};
use std::process::{Child, Output};

use common::{model_path, oato_piped, text};
use oato::engine::{DeviceChoice, Opened, PlaceOptions, Split};
use oato::runtime::generate::{CachedTokens, generate, generate_cached};
use oato::runtime::sampler::{Sampler, SamplerConfig};
use oato::tokenizer::chat::ChatMessage;

/// `oato chat` on the test model, greedy, with `-v` and `args`, running.
fn spawn_chat(args: &[&str]) -> Child {
    let m = model_path();
    oato_piped(&["chat", m.to_str().unwrap(), "-t", "1", "--temp", "0", "-v"])
        .args(args)
        .spawn()
        .expect("the oato binary runs")
}

fn chat(args: &[&str], input: &str) -> Output {
    let mut child = spawn_chat(args);
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// Each turn's (prompt, reused, computed, generated) from the `-v` lines.
fn turns(stderr: &str) -> Vec<[usize; 4]> {
    stderr
        .lines()
        .filter(|l| l.starts_with("turn "))
        .map(|l| {
            let nums: Vec<usize> = l
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|w| w.parse().ok())
                .collect();
            // turn N: prompt P tokens (R reused ..., C computed), G generated, ...
            assert!(nums.len() >= 5, "not a turn line: {l:?}\n{stderr}");
            [nums[1], nums[2], nums[3], nums[4]]
        })
        .collect()
}

#[test]
fn the_second_turn_reuses_the_first_turns_cache() {
    let out = chat(
        &["-n", "24"],
        "What is 2+2?\nAnd what is 3+3?\n/bye\nnot read\n",
    );
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    let t = turns(&err);
    assert_eq!(t.len(), 2, "two turns, then /bye: {err}");
    let [p1, r1, c1, g1] = t[0];
    assert_eq!((r1, c1), (0, p1), "{err}");
    let [p2, r2, c2, _] = t[1];
    // The cache held the first prompt and every answer token but the last sampled one; all of
    // it is reused, and only the new turn's tokens are computed.
    assert_eq!(r2, p1 + g1 - 1, "{err}");
    assert_eq!(c2, p2 - r2, "{err}");
    assert!(c2 < 30, "{c2} tokens computed for a short question: {err}");
    let answers = text(&out.stdout);
    assert_eq!(
        answers.lines().filter(|l| !l.is_empty()).count(),
        2,
        "{answers}"
    );
}

#[test]
fn reusing_the_cache_gives_the_tokens_of_a_fresh_prefill() {
    oato::kernels::cpu::pool::set_threads(1);
    let opened = Opened::open(&model_path(), DeviceChoice::Cpu).unwrap();
    let place = PlaceOptions {
        split: Split::Whole,
        threads: 1,
        ctx: 512,
        seqs: 1,
        prompt_tokens: 64,
        gen_tokens: 16,
        stream_min_tokens: None,
    };
    let greedy = || {
        Sampler::new(SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        })
    };
    let tok = &opened.tokenizer;
    let mut msgs = vec![ChatMessage::new("user", "Name a fruit.")];
    let ids1 = tok
        .encode(&opened.render_chat(&msgs).unwrap(), true, true)
        .unwrap();
    let mut engine = opened.place(&place).unwrap();
    let mut cached = CachedTokens::default();
    let s = &mut engine.session;
    let g1 = generate_cached(s, tok, false, &mut greedy(), &mut cached, &ids1, 16, |_| {
        true
    })
    .unwrap();
    assert_eq!(g1.cached_tokens, 0);
    msgs.push(ChatMessage::new("assistant", g1.text.clone()));
    msgs.push(ChatMessage::new("user", "And a vegetable?"));
    let ids2 = tok
        .encode(&opened.render_chat(&msgs).unwrap(), true, true)
        .unwrap();
    let g2 = generate_cached(s, tok, false, &mut greedy(), &mut cached, &ids2, 16, |_| {
        true
    })
    .unwrap();
    assert_eq!(g2.cached_tokens, ids1.len() + g1.output_ids.len() - 1);

    let mut fresh = opened.place(&place).unwrap();
    let want = generate(
        &mut fresh.session,
        tok,
        false,
        &mut greedy(),
        &ids2,
        16,
        |_| {},
    )
    .unwrap();
    assert_eq!(g2.output_ids, want.output_ids);
}

#[test]
fn a_full_context_is_said_and_end_of_input_leaves() {
    let out = chat(
        &["-n", "40", "-c", "80", "--ignore-eos"],
        "Tell me a story about a dragon.\nMore please.\n",
    );
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("the context is full"), "{err}");
    assert!(err.contains("--ctx is 80"), "{err}");
    assert_eq!(turns(&err).len(), 1, "{err}");
}

#[cfg(unix)]
#[test]
fn ctrl_c_stops_answers_and_the_chat_goes_on() {
    use std::io::BufRead;
    use std::sync::{Arc, Mutex};
    let mut child = spawn_chat(&["-n", "3000", "--ignore-eos"]);
    let pid = child.id() as libc::pid_t;
    // SAFETY: kill(2) on our own child, which is alive until we wait for it below.
    let interrupt = || assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let err = Arc::new(Mutex::new(String::new()));
    let reader = {
        let err = err.clone();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let line = line.unwrap();
                let mut e = err.lock().unwrap();
                e.push_str(&line);
                e.push('\n');
            }
        })
    };
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"Tell me a long story.\n").unwrap();
    stdin.flush().unwrap();
    // Once the first answer streams, interrupt it; then ask again, and interrupt the second
    // answer as it streams (a Ctrl-C between answers only prints a hint).
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 8];
    stdout.read_exact(&mut first).unwrap();
    interrupt();
    stdin.write_all(b"Thanks. Another one?\n").unwrap();
    drop(stdin);
    let mut buf = [0u8; 64];
    while stdout.read(&mut buf).unwrap() > 0 {
        if err.lock().unwrap().contains("turn 1:") {
            interrupt();
        }
    }
    let status = child.wait().unwrap();
    reader.join().unwrap();
    let err = err.lock().unwrap().clone();
    assert!(status.success(), "{status:?}: {err}");
    assert_eq!(err.matches("(answer stopped)").count(), 2, "{err}");
    let t = turns(&err);
    assert_eq!(t.len(), 2, "the chat went on after Ctrl-C: {err}");
    assert!(
        t.iter().all(|t| t[3] < 3000),
        "an answer ran to its end: {err}"
    );
}
