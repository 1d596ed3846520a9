//! `oato serve` on 127.0.0.1 with real clients: whole and streamed answers that agree, the
//! OpenAI `openai` Python package and curl, 4xx errors with OpenAI bodies for bad input (the
//! server still serving after), a full queue's 503 with Retry-After, a disconnect cancelling its
//! generation, a split placement on the test device, concurrent requests decoding in one batch
//! exactly as they do alone (and a cancel among them), and a bounded load test (200 requests
//! from 16 clients) that reports p50/p99 latency and tokens/s and asserts every answer is whole.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use common::{model_path, oato_piped, repo, text, tmp_dir};

/// A server process on a free loopback port, killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `oato serve` with `args` (after the model and a free port) and waits until
    /// `/health` says ready.
    fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
        let m = model_path();
        let mut child = oato_piped(&["serve", m.to_str().unwrap(), "--port", "0", "-t", "1"])
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the oato binary runs");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout"))
            .read_line(&mut line)
            .expect("the server prints its address");
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        assert!(addr.starts_with("127.0.0.1:"), "{addr}");
        let server = Server { child, addr };
        // Loading takes seconds; a bounded wait (not a timing assertion).
        for _ in 0..600 {
            let (status, body) = server.get("/health");
            if status == 200 {
                assert_eq!(body["status"], "ready");
                return server;
            }
            assert_eq!((status, &body["status"]), (503, &json!("loading")));
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the server at {} did not become ready", server.addr)
    }

    fn get(&self, path: &str) -> (u16, Value) {
        let r = request(&self.addr, "GET", path, None);
        (r.status, r.json())
    }

    fn post(&self, path: &str, body: &str) -> Response {
        request(&self.addr, "POST", path, Some(body))
    }

    fn metric(&self, name: &str) -> f64 {
        let r = request(&self.addr, "GET", "/metrics", None);
        r.body
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("/metrics lacks {name}:\n{}", r.body))
    }
}

struct Response {
    status: u16,
    headers: String,
    body: String,
}

impl Response {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// The `data:` payloads of a server-sent event stream.
    fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
            .collect()
    }
}

/// One HTTP/1.0 exchange (the server closes the connection after the body, so no chunking).
fn request(addr: &str, method: &str, path: &str, body: Option<&str>) -> Response {
    let mut s = TcpStream::connect(addr).expect("connect to the server");
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read the response");
    let raw = text(&raw);
    let (head, body) = raw.split_once("\r\n\r\n").expect("a header and a body");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line: {head}"));
    Response {
        status,
        headers: head.to_ascii_lowercase(),
        body: body.to_string(),
    }
}

/// A streamed greedy completion of `max_tokens` (end-of-generation ignored), read until its
/// first text has arrived, so that it runs; dropping the connection cancels it.
fn streaming(addr: &str, prompt: &str, max_tokens: u64) -> TcpStream {
    let mut a = TcpStream::connect(addr).unwrap();
    let body = completion_body(prompt, max_tokens, true);
    write!(
        a,
        "POST /v1/completions HTTP/1.0\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !text(&seen).contains("\"text\"") {
        let n = a.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {}", text(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    a
}

fn completion_body(prompt: &str, max_tokens: u64, stream: bool) -> String {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
           "stream": stream})
    .to_string()
}

fn chat_body(content: &str, extra: Value) -> String {
    let mut b = json!({"model": "m", "messages": [{"role": "user", "content": content}]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b.to_string()
}

/// The text of a streamed response, checking every chunk's shape; and the last chunk.
fn streamed_text(r: &Response, object: &str, chat: bool) -> (String, Value) {
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.headers.contains("text/event-stream"), "{}", r.headers);
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let mut text = String::new();
    let mut last = Value::Null;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|_| panic!("chunk {e}"));
        assert_eq!(v["object"], object, "{e}");
        if v["choices"].as_array().is_some_and(|c| c.is_empty()) {
            last = v; // the usage chunk
            continue;
        }
        let c = &v["choices"][0];
        let piece = if chat {
            &c["delta"]["content"]
        } else {
            &c["text"]
        };
        text.push_str(piece.as_str().unwrap_or(""));
        if !c["finish_reason"].is_null() {
            last = v.clone();
        }
    }
    (text, last)
}

#[test]
fn whole_and_streamed_answers_agree() {
    let s = Server::start(&["--ctx", "512"], &[]);
    let (status, models) = s.get("/v1/models");
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1.gguf");

    // Greedy, so the whole answer and the streamed one must be the same text.
    let opts = json!({"max_tokens": 12, "temperature": 0, "seed": 1});
    let whole = s.post(
        "/v1/chat/completions",
        &chat_body("What is the capital of France?", opts.clone()),
    );
    assert_eq!(whole.status, 200, "{}", whole.body);
    let w = whole.json();
    assert_eq!(w["object"], "chat.completion");
    let answer = w["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!answer.is_empty());
    let u = &w["usage"];
    let (p, c) = (
        u["prompt_tokens"].as_u64().unwrap(),
        u["completion_tokens"].as_u64().unwrap(),
    );
    assert!(p > 5 && (1..=12).contains(&c), "{u}");
    assert_eq!(u["total_tokens"].as_u64(), Some(p + c));
    let reason = w["choices"][0]["finish_reason"].as_str().unwrap();
    assert_eq!(reason == "length", c == 12, "{w}");

    let mut sopts = opts.clone();
    sopts["stream"] = json!(true);
    sopts["stream_options"] = json!({"include_usage": true});
    let r = s.post(
        "/v1/chat/completions",
        &chat_body("What is the capital of France?", sopts),
    );
    let (streamed, last) = streamed_text(&r, "chat.completion.chunk", true);
    assert_eq!(streamed, answer);
    // The same prompt again: all but its last token came from the cache.
    assert_eq!(
        last["usage"],
        json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
               "prompt_tokens_details": {"cached_tokens": p - 1}})
    );

    // A stop string cuts the answer just before it.
    let cut = answer
        .char_indices()
        .nth(answer.chars().count() / 2)
        .unwrap()
        .0;
    let stop = &answer[cut..];
    let stopped = s
        .post(
            "/v1/chat/completions",
            &chat_body(
                "What is the capital of France?",
                json!({"max_tokens": 12, "temperature": 0, "stop": [stop]}),
            ),
        )
        .json();
    assert_eq!(stopped["choices"][0]["message"]["content"], &answer[..cut]);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");

    // Completions, whole and streamed.
    let body = json!({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                      "ignore_eos": true});
    let w = s.post("/v1/completions", &body.to_string()).json();
    assert_eq!(w["object"], "text_completion");
    assert_eq!(w["usage"]["completion_tokens"], 6);
    assert_eq!(w["choices"][0]["finish_reason"], "length");
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = s.post("/v1/completions", &sb.to_string());
    let (streamed, last) = streamed_text(&r, "text_completion", false);
    assert_eq!(streamed, w["choices"][0]["text"].as_str().unwrap());
    assert_eq!(last["choices"][0]["finish_reason"], "length");

    // curl, when there is one.
    let mut generations = 5.0;
    match Command::new("curl")
        .args([
            "-s",
            "-S",
            &format!("http://{}/v1/chat/completions", s.addr),
        ])
        .args(["-H", "Content-Type: application/json", "-d"])
        .arg(chat_body("What is the capital of France?", opts))
        .output()
    {
        Ok(out) => {
            assert!(out.status.success(), "curl: {}", text(&out.stderr));
            let v: Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(v["choices"][0]["message"]["content"], answer);
            generations += 1.0;
        }
        Err(e) => println!("curl not run ({e})"),
    }

    let m = request(&s.addr, "GET", "/metrics", None);
    assert!(m.headers.contains("text/plain"), "{}", m.headers);
    for want in [
        "oato_ttft_seconds_bucket{le=\"+Inf\"}",
        "oato_tpot_seconds_count",
        "oato_queue_depth 0",
        "oato_placement_info{device=\"cpu",
        "oato_http_responses_total{code=\"200\"}",
    ] {
        assert!(m.body.contains(want), "/metrics lacks {want}:\n{}", m.body);
    }
    assert_eq!(s.metric("oato_requests_completed_total"), generations);
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let s = Server::start(&["--ctx", "256"], &[]);
    let long = "word ".repeat(400);
    let cases: Vec<(&str, String, u16, Value)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400, Value::Null),
        ("/v1/chat/completions", "[1, 2]".into(), 400, Value::Null),
        (
            "/v1/chat/completions",
            chat_body("hi", json!({"frobnicate": true})),
            400,
            json!("frobnicate"),
        ),
        (
            "/v1/chat/completions",
            chat_body("hi", json!({"max_tokens": 1_000_000_000})),
            400,
            json!("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            chat_body("hi", json!({"max_tokens": "ten"})),
            400,
            json!("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            chat_body("hi", json!({"temperature": "hot"})),
            400,
            json!("temperature"),
        ),
        (
            "/v1/chat/completions",
            chat_body("hi", json!({"top_p": 7})),
            400,
            json!("top_p"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}).to_string(),
            400,
            json!("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 5}]}).to_string(),
            400,
            json!("messages"),
        ),
        (
            "/v1/completions",
            json!({"prompt": 5}).to_string(),
            400,
            json!("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": long}).to_string(),
            400,
            json!("prompt"),
        ),
        ("/v1/nowhere", "{}".into(), 404, Value::Null),
    ];
    for (path, body, status, param) in cases {
        let r = s.post(path, &body);
        assert_eq!(r.status, status, "{path} {body:.80}: {}", r.body);
        let e = &r.json()["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
        assert!(e["type"].is_string(), "{e}");
        assert_eq!(e["param"], param, "{body:.80}: {e}");
    }
    // The prompt that does not fit names the limit.
    let r = s.post("/v1/completions", &json!({"prompt": long}).to_string());
    let e = &r.json()["error"];
    assert_eq!(e["code"], "context_length_exceeded");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 256 tokens"),
        "{e}"
    );
    let r = request(&s.addr, "GET", "/v1/chat/completions", None);
    assert_eq!(r.status, 405);
    assert!(r.json()["error"]["message"].is_string());

    // Still serving.
    let r = s.post(
        "/v1/chat/completions",
        &chat_body("hi", json!({"max_tokens": 3, "temperature": 0})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["choices"][0]["message"]["content"].is_string());
}

#[test]
fn a_full_queue_refuses_and_a_disconnect_cancels() {
    // One request at a time, as before batching: B waits while A runs.
    let s = Server::start(
        &[
            "--ctx",
            "1024",
            "--queue",
            "1",
            "--retry-after",
            "7",
            "--parallel",
            "1",
        ],
        &[],
    );
    // A: a long streamed generation; read until its first text arrives, so it runs.
    let a = streaming(&s.addr, "Once upon a time", 900);
    // B waits in the queue (its one place)...
    let addr = s.addr.clone();
    let b = std::thread::spawn(move || {
        request(
            &addr,
            "POST",
            "/v1/chat/completions",
            Some(&chat_body("hi", json!({"max_tokens": 2}))),
        )
    });
    let mut queued = false;
    for _ in 0..600 {
        if s.metric("oato_queue_depth") == 1.0 {
            queued = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(queued, "B never reached the queue");
    // ...so C is refused.
    let c = s.post(
        "/v1/chat/completions",
        &chat_body("hi", json!({"max_tokens": 2})),
    );
    assert_eq!(c.status, 503, "{}", c.body);
    assert!(c.headers.contains("retry-after: 7"), "{}", c.headers);
    assert_eq!(c.json()["error"]["code"], "queue_full");
    // A's client goes: its generation stops, and B runs.
    drop(a);
    let b = b.join().unwrap();
    assert_eq!(b.status, 200, "{}", b.body);
    assert_eq!(s.metric("oato_requests_cancelled_total"), 1.0);
    // A stopped well before its 900 tokens (B made at most 2).
    let made = s.metric("oato_completion_tokens_total");
    assert!(made < 900.0, "{made} tokens generated");
    assert_eq!(s.metric("oato_requests_completed_total"), 1.0);
}

/// Six greedy completions: a prompt and a length each.
const BATCH_REQUESTS: [(&str, u64); 6] = [
    ("Once upon a time", 24),
    ("The capital of France is", 12),
    ("1, 2, 3, 4,", 20),
    ("def fibonacci(n):", 8),
    ("The quick brown fox jumps over", 16),
    ("In the beginning", 10),
];

/// The text of one greedy completion of `BATCH_REQUESTS[i]`.
fn completion_text(addr: &str, i: usize) -> String {
    let (prompt, n) = BATCH_REQUESTS[i];
    let r = request(
        addr,
        "POST",
        "/v1/completions",
        Some(&completion_body(prompt, n, false)),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], n, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// Every request of `BATCH_REQUESTS` at once, from its own client.
fn all_at_once(addr: &str) -> Vec<String> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..BATCH_REQUESTS.len())
            .map(|i| sc.spawn(move || completion_text(addr, i)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Continuous batching: six concurrent greedy requests over four slots (so some join while
/// others decode, and take the slots of those that left) give exactly the texts they give one
/// at a time, on the CPU and on the test device, and with prompts prefilled in pieces; one
/// client's disconnect cancels its
/// sequence without disturbing the others; /metrics shows the batch.
#[test]
fn concurrent_requests_decode_in_one_batch_as_they_do_alone() {
    let one = Server::start(&["--ctx", "256", "--parallel", "1"], &[]);
    let want: Vec<String> = (0..BATCH_REQUESTS.len())
        .map(|i| completion_text(&one.addr, i))
        .collect();
    assert_eq!(one.metric("oato_parallel"), 1.0);
    assert_eq!(
        one.metric("oato_decode_step_tokens_total"),
        one.metric("oato_decode_steps_total")
    );
    drop(one);

    let dir = tmp_dir("serve", "batch");
    let cache = dir.join("cache");
    let device = [
        ("OATO_TEST_DEVICE", "2000000000"),
        ("OATO_CACHE_DIR", cache.to_str().unwrap()),
    ];
    // The CPU, the test device, and prompts prefilled three tokens at a time between the
    // others' decode steps.
    for (ubatch, env) in [("512", &[][..]), ("512", &device[..]), ("3", &[][..])] {
        let s = Server::start(
            &["--ctx", "256", "--parallel", "4", "--ubatch", ubatch],
            env,
        );
        assert_eq!(s.metric("oato_parallel"), 4.0);
        let got = all_at_once(&s.addr);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g, w,
                "request {i} ({env:?}): batched text differs from alone"
            );
        }
        let (steps, tokens) = (
            s.metric("oato_decode_steps_total"),
            s.metric("oato_decode_step_tokens_total"),
        );
        assert!(
            tokens > steps && tokens <= 4.0 * steps,
            "{tokens} tokens in {steps} decode steps: no batch of 2 to 4"
        );
        assert_eq!(s.metric("oato_requests_running"), 0.0);
        // The engine says so once it is back waiting (a bounded wait, not a timing assertion).
        let idle = (0..500).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            s.metric("oato_batch_size") == 0.0
        });
        assert!(idle, "oato_batch_size stays above 0 with nothing running");
    }

    // A long streamed request, cancelled while two others decode beside it.
    let s = Server::start(&["--ctx", "256", "--parallel", "3"], &[]);
    let a = streaming(&s.addr, "Once upon a time", 200);
    let got = std::thread::scope(|sc| {
        let addr = &s.addr;
        let hs: Vec<_> = [0, 2]
            .into_iter()
            .map(|i| sc.spawn(move || completion_text(addr, i)))
            .collect();
        // Let the two join A's batch (a bounded wait), then A's client goes.
        let joined = (0..600).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            s.metric("oato_batch_size") >= 2.0
        });
        assert!(joined, "the two requests never decoded beside A");
        drop(a);
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(got, [want[0].clone(), want[2].clone()]);
    assert_eq!(s.metric("oato_requests_cancelled_total"), 1.0);
    assert_eq!(s.metric("oato_requests_completed_total"), 2.0);
    let made = s.metric("oato_completion_tokens_total");
    assert!(
        made < 200.0 + 44.0,
        "{made} tokens generated: A was not cancelled"
    );
}

#[test]
fn a_split_placement_on_the_test_device_serves() {
    let dir = tmp_dir("serve", "split");
    let cache = dir.join("cache");
    let s = Server::start(
        &[
            "--ctx",
            "256",
            "--vram-budget",
            "50%",
            // By bytes, whatever the profile: the oato policy may place nothing on a noisy
            // machine, where the CPU-backed device's benefits can all come out negative.
            "--policy",
            "layer-split",
            "--plan-prompt-tokens",
            "32",
        ],
        &[
            ("OATO_TEST_DEVICE", "2000000000"),
            ("OATO_CACHE_DIR", cache.to_str().unwrap()),
        ],
    );
    let r = s.post(
        "/v1/chat/completions",
        &chat_body("hi", json!({"max_tokens": 4, "temperature": 0})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let gpu = s.metric("oato_placement_weights{where=\"gpu\"}");
    let all = s.metric("oato_placement_weights{where=\"all\"}");
    assert!(
        gpu > 0.0 && gpu < all,
        "{gpu} of {all} weights on the test device"
    );
    assert!(s.metric("oato_gpu_memory_bytes{kind=\"weights\"}") > 0.0);
}

/// The `openai` package's version the test installs.
const OPENAI: &str = "openai==3.54.0";

/// A Python command with the `openai` package: a virtual environment under target/, made once;
/// where venv is missing, the system python3 with the package installed into
/// target/openai-pylib. `None` (the test then says why it did not run) only when pip is not
/// there either.
fn openai_python() -> Option<Command> {
    let has = |c: &mut Command| {
        c.args(["-c", "import openai"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let venv = repo().join("target/openai-venv");
    let py = venv.join("bin/python");
    let lib = repo().join("target/openai-pylib");
    let with_lib = || {
        let mut c = Command::new("python3");
        c.env("PYTHONPATH", &lib);
        c
    };
    if has(&mut Command::new(&py)) {
        return Some(Command::new(&py));
    }
    if has(&mut with_lib()) {
        return Some(with_lib());
    }
    let venv_ok = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .is_ok_and(|s| s.success());
    let (mut pip, python) = if venv_ok {
        let mut pip = Command::new(&py);
        pip.args(["-m", "pip", "install", "-q", OPENAI]);
        (pip, Command::new(&py))
    } else {
        println!(
            "python3 -m venv failed: installing openai into {}",
            lib.display()
        );
        let mut pip = Command::new("python3");
        pip.args(["-m", "pip", "install", "-q", "--target"])
            .arg(&lib)
            .arg(OPENAI);
        (pip, with_lib())
    };
    match pip.status() {
        Ok(s) if s.success() => {}
        other => {
            println!("skipped: pip could not install {OPENAI} ({other:?}); this test needs it");
            return None;
        }
    }
    let mut check = if venv_ok {
        Command::new(&py)
    } else {
        with_lib()
    };
    assert!(has(&mut check), "{OPENAI} installed but not importable");
    Some(python)
}

#[test]
fn the_openai_python_client_talks_to_it() {
    let Some(mut py) = openai_python() else {
        return;
    };
    let s = Server::start(&["--ctx", "512"], &[]);
    let script = r#"
import json, sys
from openai import OpenAI, BadRequestError
c = OpenAI(base_url=sys.argv[1], api_key="none")
msgs = [{"role": "user", "content": "What is the capital of France?"}]
whole = c.chat.completions.create(model="m", messages=msgs, max_tokens=10, temperature=0)
parts = []
for ch in c.chat.completions.create(model="m", messages=msgs, max_tokens=10, temperature=0, stream=True):
    if ch.choices and ch.choices[0].delta.content:
        parts.append(ch.choices[0].delta.content)
comp = c.completions.create(model="m", prompt="Once upon a time", max_tokens=5, temperature=0)
try:
    c.chat.completions.create(model="m", messages=msgs, max_tokens=10**9)
    err = None
except BadRequestError as e:
    err = {"status": e.status_code, "code": e.code, "param": e.param}
models = [m.id for m in c.models.list()]
print(json.dumps({
    "whole": whole.choices[0].message.content,
    "finish": whole.choices[0].finish_reason,
    "usage": [whole.usage.prompt_tokens, whole.usage.completion_tokens],
    "streamed": "".join(parts),
    "completion": comp.choices[0].text,
    "completion_tokens": comp.usage.completion_tokens,
    "error": err,
    "models": models,
}))
"#;
    let out = py
        .args(["-c", script, &format!("http://{}/v1", s.addr)])
        .output()
        .expect("python runs");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("openai client: {v}");
    assert!(!v["whole"].as_str().unwrap().is_empty());
    assert_eq!(v["streamed"], v["whole"]);
    assert!(v["usage"][1].as_u64().unwrap() <= 10);
    assert!(v["completion_tokens"].as_u64().unwrap() <= 5);
    assert_eq!(
        v["error"],
        json!({"status": 400, "code": "context_length_exceeded", "param": "max_tokens"})
    );
    assert_eq!(v["models"], json!(["SmolLM2-135M-Instruct.Q4_1.gguf"]));
}

#[test]
fn load_test_200_requests_from_16_clients() {
    const CLIENTS: usize = 16;
    const PER_CLIENT: usize = 13; // 16 × 13 = 208 ≥ 200
    const MAX_TOKENS: u64 = 4;
    let s = Server::start(&["--ctx", "256", "--queue", "32"], &[]);
    let deadline = Instant::now() + Duration::from_secs(300);
    let started = Instant::now();
    let results: Vec<Vec<(f64, u64)>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let addr = &s.addr;
                sc.spawn(move || {
                    let mut out = Vec::new();
                    for i in 0..PER_CLIENT {
                        assert!(Instant::now() < deadline, "the load test ran out of time");
                        let body = chat_body(
                            &format!("Client {c}, request {i}: name a colour."),
                            json!({"max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": i}),
                        );
                        let t = Instant::now();
                        let r = request(addr, "POST", "/v1/chat/completions", Some(&body));
                        let ms = t.elapsed().as_secs_f64() * 1e3;
                        assert_eq!(r.status, 200, "client {c} request {i}: {}", r.body);
                        let v = r.json();
                        let ch = &v["choices"][0];
                        assert!(ch["message"]["content"].is_string(), "{v}");
                        assert!(
                            ["stop", "length"].contains(&ch["finish_reason"].as_str().unwrap()),
                            "{v}"
                        );
                        let n = v["usage"]["completion_tokens"].as_u64().unwrap();
                        assert!((1..=MAX_TOKENS).contains(&n), "{v}");
                        // A length finish has all its tokens (a stop may come at the last one).
                        assert!(ch["finish_reason"] != "length" || n == MAX_TOKENS, "{v}");
                        out.push((ms, n));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let wall = started.elapsed().as_secs_f64();
    let mut lat: Vec<f64> = results.iter().flatten().map(|r| r.0).collect();
    let tokens: u64 = results.iter().flatten().map(|r| r.1).sum();
    assert_eq!(lat.len(), CLIENTS * PER_CLIENT);
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| lat[((lat.len() - 1) as f64 * p).round() as usize];
    println!(
        "load test: {} requests from {CLIENTS} clients in {wall:.1} s: latency p50 {:.0} ms, p99 \
         {:.0} ms; {tokens} tokens generated, {:.1} tokens/s, {:.2} requests/s",
        lat.len(),
        pct(0.5),
        pct(0.99),
        tokens as f64 / wall,
        lat.len() as f64 / wall
    );
    assert_eq!(s.metric("oato_requests_completed_total"), lat.len() as f64);
    assert_eq!(s.metric("oato_completion_tokens_total"), tokens as f64);
    assert_eq!(s.metric("oato_queue_depth"), 0.0);
}
