#!/usr/bin/env python3
"""Writes tests/data/tokenizer/llama-cpp-smollm2.json: llama.cpp's token ids for strings chosen to hit
the corners of the smollm pre-tokeniser and of special-token parsing (whitespace runs, digits,
contractions, punctuation, scripts, emoji, control characters, chat markup).

Also writes tests/data/tokenizer/llama-cpp-spm-tiny.json: a tiny SentencePiece vocabulary (in a copy of
the model's metadata) and llama.cpp's ids for a few strings under it.

Usage: scripts/tokenizer-llamacpp-reference.py [BIN_DIR] [MODEL]
  BIN_DIR  llama.cpp's build/bin with llama-tokenize (default: the last line printed by
           ../shared/peers/build-llamacpp.sh, which builds it when needed)
  MODEL    default models/SmolLM2-135M-Instruct.Q4_1.gguf

Each string goes to llama-tokenize through a file (-f, --no-escape), so its bytes arrive unchanged;
the model's add_bos_token is false, so no BOS is added. Besides the model's own pre-tokenizer (smollm),
the same vocabulary is run under the other pre-tokenizers in PRES, through metadata-only copies of the
model with tokenizer.ggml.pre changed (needs gguf-py: pip install gguf). Rerun after changing CASES.
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (text, parse_special)
CASES = [
    ("", False),
    ("Hello world", False),
    (" leading space", False),
    ("trailing space ", False),
    ("  two leading spaces", False),
    ("multiple    spaces   inside  ", False),
    ("                                ", False),
    ("\n", False),
    ("\n\n\n", False),
    ("line1\nline2\r\nline3\r\n", False),
    ("\ttab\tseparated\t\t", False),
    (" \t \n mixed whitespace \n\t ", False),
    ("a\n b\n  c\n   d", False),
    ("1234567890", False),
    ("3.14159 and 2.71828", False),
    ("1,000,000 apples cost $1.5e6", False),
    ("x2y3z4 v1.2.3-rc4 abc123def", False),
    ("year 2024: 12:30pm, 31/12/1999", False),
    ("१२३ ٣٤٥ ² ³ ½ Ⅻ", False),
    ("I'm you're he'll we've they'd it's can't", False),
    ("I'M YOU'RE HE'LL IT'S", False),
    ("'s' 'tis 'quoted' \"double\"", False),
    ("Hello, world! How are you?", False),
    ("...!!!??? --- ***", False),
    ("(a+b)*c=d^2 <tag> {json: [1,2]} a|b~c `code` $5 #hash @at 100%", False),
    ("Ünïcödé façade naïve — “quotes” ‘single’ «guillemets»", False),
    ("日本語のテキストです。", False),
    ("中文，标点。还有数字123", False),
    ("Привет, мир! Как дела?", False),
    ("مرحبا بالعالم", False),
    ("שלום עולם", False),
    ("ἀρχὴ τοῦ λόγου", False),
    ("🤖 emoji 😀😃😄 family 👨‍👩‍👧‍👦 flag 🇫🇷", False),
    ("ℌ𝔢𝔩𝔩𝔬 𝟙𝟚𝟛", False),
    ("zero\u200bwidth nbsp\u00a0here ideographic\u3000space", False),
    ("combining e\u0301 a\u0308 versus \u00e9 \u00e4", False),
    ("control \u0001\u0002 \u007f del and \u0085 nel", False),
    ("def fibonacci(n):\n    if n <= 1:\n        return n\n    return fibonacci(n-1) + fibonacci(n-2)\n", False),
    ("for (int i = 0; i < 10; ++i) { sum += a[i]; }", False),
    ("https://example.com/path?q=1&r=two#frag", False),
    ("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", False),
    ("==========", False),
    # where the pre-tokenizers disagree
    (".Hello $var #tag @user 'quote", False),
    ("end!!\n\nnext ...\r\n\tx", False),
    (" \n \n x  \n  y \n", False),
    ("a+b==c<=d>>e ^_^ ~~ || &&", False),
    ("don't DON'T Don'T y'all ma'am", False),
    ("\u00e0\u00e9\u00ee 中\u00e9 \u0400\u0401", False),
    ("<|im_start|>user\nhi<|im_end|>", True),
    ("<|im_start|>user\nhi<|im_end|>", False),
    ("<|im_start|><|im_start|>x<|im_end|>\n<|endoftext|>", True),
    ("text <|im_start|> spaced <|im_end|> text", True),
    ("<|im_start partial <|im_end", True),
    ("<jupyter_code>print(1)<empty_output><jupyter_output>", True),
    ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
     "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", True),
]


PRES = ["smollm", "llama-bpe", "qwen2", "gpt-2", "default", "falcon"]


def vocab_file(model, pre, dest):
    """A metadata-only copy of MODEL with tokenizer.ggml.pre set to PRE (llama-tokenize loads only
    the vocabulary, so the tensors are not needed)."""
    import gguf  # gguf-py (pip install gguf)

    r = gguf.GGUFReader(model)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dest, arch=arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        val = pre if k == "tokenizer.ggml.pre" else f.contents()
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, val, f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(k, val, f.types[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenize(exe, model, text, parse_special, tmp):
    if not text:
        # llama-tokenize refuses an empty prompt; llama.cpp's tokenizer gives no tokens for it
        return []
    path = os.path.join(tmp, "prompt.txt")
    with open(path, "wb") as f:
        f.write(text.encode("utf-8"))
    cmd = [exe, "-m", model, "-f", path, "--ids", "--no-escape", "--log-disable"]
    if not parse_special:  # llama-tokenize parses special tokens by default
        cmd.append("--no-parse-special")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads([l for l in out.splitlines() if l.startswith("[")][-1])


# A tiny SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens <0xNN> (ids 3 + byte), pieces
# with scores, a user-defined and a control token. tests/tokenizer.rs builds the same vocabulary from
# the JSON this writes.
SPM_PIECES = [
    ("▁", -1.0, 1), ("h", -3.0, 1), ("e", -3.0, 1), ("l", -3.0, 1), ("o", -3.0, 1), ("he", -2.0, 1),
    ("ll", -1.5, 1), ("llo", -1.2, 1), ("hello", -1.1, 1), ("▁hello", -0.5, 1), ("▁▁", -2.0, 1),
    ("日", -3.0, 1), ("本", -3.0, 1), ("日本", -0.7, 1), ("▁日本", -4.0, 1), ("▁h", -2.5, 1),
    ("<|user|>", 0.0, 4), ("<ctl>", 0.0, 3),
]

SPM_CASES = [
    ("", False),
    ("hello", False),
    ("hello  日本!", False),
    (" hello", False),
    ("  hello", False),
    ("hello hello\nhello", False),
    ("日本 本日", False),
    ("héllo wörld", False),
    ("a<|user|>b hello", False),
    ("<ctl>hello<ctl>", True),
    ("<ctl>hello<ctl>", False),
    ("\n\t", False),
]


def spm_vocab():
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    for b in range(256):
        tokens.append("<0x%02X>" % b)
        scores.append(0.0)
        types.append(6)
    for t, sc, ty in SPM_PIECES:
        tokens.append(t)
        scores.append(sc)
        types.append(ty)
    return tokens, scores, types


def spm_vocab_file(model, dest):
    """MODEL's hyper-parameters with the tiny SentencePiece vocabulary in place of its tokenizer."""
    import gguf

    r = gguf.GGUFReader(model)
    w = gguf.GGUFWriter(dest, arch=r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k.startswith("tokenizer.") or k == "general.architecture":
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    tokens, scores, types = spm_vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenize_with_bos(exe, model, text, parse_special, tmp):
    """Like tokenize(), with the model's BOS; an empty text gives just BOS (llama.cpp's SPM rule)."""
    if not text:
        return [1]
    return tokenize(exe, model, text, parse_special, tmp)


def main():
    if len(sys.argv) > 1:
        bin_dir = sys.argv[1]
    else:
        script = os.path.join(ROOT, "..", "shared", "peers", "build-llamacpp.sh")
        out = subprocess.run(["bash", script], check=True, capture_output=True, text=True).stdout
        bin_dir = out.strip().splitlines()[-1]
    model = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    exe = os.path.join(bin_dir, "llama-tokenize")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True)
    version = (version.stdout + version.stderr).strip().splitlines()
    version.append(os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(bin_dir)))))
    results = [{"text": t, "parse_special": p, "ids": {}} for t, p in CASES]
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRES:
            vocab = model if pre == "smollm" else os.path.join(tmp, f"vocab-{pre}.gguf")
            if pre != "smollm":
                vocab_file(model, pre, vocab)
            for r in results:
                r["ids"][pre] = tokenize(exe, vocab, r["text"], r["parse_special"], tmp)
    lines = ["{"]
    lines.append(' "about": ' + json.dumps(
        "Token ids from llama.cpp's llama-tokenize for SmolLM2-135M-Instruct.Q4_1.gguf's vocabulary (no BOS: "
        "add_bos_token is false), under its own pre-tokenizer (smollm) and, in metadata-only copies, under "
        "others; made by scripts/tokenizer-llamacpp-reference.py") + ",")
    lines.append(' "llama_cpp": ' + json.dumps(version) + ",")
    lines.append(' "model": ' + json.dumps(os.path.basename(model)) + ",")
    lines.append(' "cases": [')
    for i, r in enumerate(results):
        lines.append('  {"text": %s, "parse_special": %s, "ids": {' % (json.dumps(r["text"]), json.dumps(r["parse_special"])))
        items = [f'   {json.dumps(pre)}: {json.dumps(ids)}' for pre, ids in r["ids"].items()]
        lines.append(",\n".join(items) + "}}" + ("," if i + 1 < len(results) else ""))
    lines.append(" ]")
    lines.append("}")
    dest = os.path.join(ROOT, "tests", "data", "tokenizer", "llama-cpp-smollm2.json")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest, "w") as f:
        f.write("\n".join(lines) + "\n")
    json.load(open(dest))  # check it parses
    print(f"{dest}: {len(results)} cases x {len(PRES)} pre-tokenizers")

    with tempfile.TemporaryDirectory() as tmp:
        vocab = os.path.join(tmp, "vocab-spm.gguf")
        spm_vocab_file(model, vocab)
        spm = [{"text": t, "parse_special": p, "ids": tokenize_with_bos(exe, vocab, t, p, tmp)} for t, p in SPM_CASES]
    tokens, scores, types = spm_vocab()
    lines = ["{"]
    lines.append(' "about": ' + json.dumps(
        "Token ids (with BOS, which SentencePiece vocabularies add by default) from llama.cpp's llama-tokenize "
        "for a tiny SentencePiece vocabulary; made by scripts/tokenizer-llamacpp-reference.py") + ",")
    lines.append(' "llama_cpp": ' + json.dumps(version) + ",")
    lines.append(' "tokens": ' + json.dumps(tokens, ensure_ascii=False) + ",")
    lines.append(' "scores": ' + json.dumps(scores) + ",")
    lines.append(' "types": ' + json.dumps(types) + ",")
    lines.append(' "cases": [')
    lines.append(",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in spm))
    lines.append(" ]")
    lines.append("}")
    dest = os.path.join(ROOT, "tests", "data", "tokenizer", "llama-cpp-spm-tiny.json")
    with open(dest, "w") as f:
        f.write("\n".join(lines) + "\n")
    json.load(open(dest))
    print(f"{dest}: {len(spm)} cases")


if __name__ == "__main__":
    main()
