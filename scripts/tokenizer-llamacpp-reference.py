#!/usr/bin/env python3
"""Writes tests/data/tokenizer/llama-cpp-smollm2.json: llama.cpp's token ids for strings chosen to hit
the corners of the smollm pre-tokeniser and of special-token parsing (whitespace runs, digits,
contractions, punctuation, scripts, emoji, control characters, chat markup).

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


if __name__ == "__main__":
    main()
