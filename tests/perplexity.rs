//! Perplexity on the golden file's text against llama.cpp's figure (its own process: the golden
//! test switches the process-wide CPU variant).

mod common;

use oato::model::Model;
use oato::runtime::forward::Session;
use oato::runtime::perplexity::perplexity;
use oato::tokenizer::Tokenizer;

use common::{golden, golden_dir, model_path};

#[test]
fn perplexity_within_one_percent_of_llama_cpp() {
    let g = golden();
    let want = g["perplexity"]["llama_cpp_ppl"]["Q4_1"].as_f64().unwrap();
    let want_tokens = g["perplexity"]["tokens"].as_u64().unwrap() as usize;
    let text = std::fs::read_to_string(golden_dir().join("gpl3_2000w.txt")).unwrap();
    let model = Model::open(model_path()).unwrap();
    let tok = Tokenizer::from_gguf(&model.file).unwrap();
    let tokens = tok.encode(&text, true, false).unwrap();
    assert_eq!(tokens.len(), want_tokens, "token count of the text");
    let mut session = Session::new(&model, 512).unwrap();
    let bos = if tok.add_bos() { tok.bos() } else { None };
    let p = perplexity(&mut session, &tokens, 512, bos).unwrap();
    let rel = (p.ppl - want).abs() / want;
    println!(
        "perplexity {:.4} +/- {:.4} vs llama.cpp {want} ({:.3}% off)",
        p.ppl,
        p.stderr,
        rel * 100.0
    );
    assert_eq!(p.windows, 5);
    assert_eq!(p.scored, 5 * 255);
    assert!(
        rel < 0.01,
        "perplexity {:.4} is {:.2}% from llama.cpp's {want}",
        p.ppl,
        rel * 100.0
    );
}
