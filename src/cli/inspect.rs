//! `oato inspect FILE`: architecture, hyper-parameters, tokenizer, tensor table and totals.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use oato::error::Result;
use oato::gguf::GgufFile;
use oato::model::HParams;
use oato::tokenizer::Tokenizer;

#[derive(Args)]
pub struct InspectArgs {
    /// GGUF file.
    pub file: PathBuf,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Show every metadata entry, not only the short ones.
    #[arg(long)]
    pub all: bool,
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / (1 << 20) as f64)
}

pub fn run(a: InspectArgs) -> Result<()> {
    let f = GgufFile::open(&a.file)?;
    let arch = f.get_str("general.architecture").unwrap_or("?").to_string();
    let hp = HParams::from_gguf(&f);
    let tok = Tokenizer::from_gguf(&f);
    let mut per_type: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for t in &f.tensors {
        let e = per_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    let total: u64 = f.tensors.iter().map(|t| t.n_bytes).sum();
    let n_params: u64 = f.tensors.iter().map(|t| t.n_elements).sum();
    if a.json {
        let metadata: serde_json::Map<String, serde_json::Value> = f
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.to_json(32)))
            .collect();
        let tensors: Vec<_> = f
            .tensors
            .iter()
            .map(|t| json!({"name": t.name, "shape": t.dims, "type": t.ty.name(), "bytes": t.n_bytes, "offset": t.offset}))
            .collect();
        let out = json!({
            "file": a.file.display().to_string(),
            "file_bytes": f.file_size(),
            "version": f.version,
            "alignment": f.alignment,
            "arch": arch,
            "hparams": hp.as_ref().ok().map(|h| json!({
                "n_vocab": h.n_vocab, "n_embd": h.n_embd, "n_layer": h.n_layer, "n_head": h.n_head,
                "n_head_kv": h.n_head_kv, "head_dim": h.head_dim, "n_ff": h.n_ff, "rms_eps": h.rms_eps,
                "n_ctx_train": h.n_ctx_train, "rope_freq_base": h.rope.freq_base, "rope_dims": h.rope.n_dims,
                "rope_freq_scale": h.rope.freq_scale, "rope_neox": h.rope.neox,
                "mla": h.mla.map(|m| json!({"q_lora_rank": m.q_lora, "kv_lora_rank": m.kv_lora,
                    "qk_nope": m.nope, "qk_rope": m.rope, "v_head_dim": m.v})),
                "scales": {"embedding": h.scales.embd, "residual": h.scales.residual,
                    "logits": h.scales.logits}})),
            "tokenizer": match &tok { Ok(t) => json!(t.summary()), Err(e) => json!({"error": e.to_string()}) },
            "metadata": metadata,
            "tensors": tensors,
            "totals": {
                "tensors": f.tensors.len(), "params": n_params, "bytes": total,
                "per_type": per_type.iter().map(|(k, v)| (k.to_string(), json!({"tensors": v.0, "bytes": v.1}))).collect::<serde_json::Map<_, _>>(),
            },
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&out).expect("JSON values serialise")
        );
        return Ok(());
    }

    println!(
        "file:         {} ({} bytes, GGUF v{}, alignment {})",
        a.file.display(),
        f.file_size(),
        f.version,
        f.alignment
    );
    println!("architecture: {arch}");
    if let Some(name) = f.get_str("general.name") {
        println!("name:         {name}");
    }
    match &hp {
        Ok(h) => {
            println!(
                "hparams:      n_vocab {} n_embd {} n_layer {} n_head {} n_head_kv {} head_dim {} n_ff {}",
                h.n_vocab, h.n_embd, h.n_layer, h.n_head, h.n_head_kv, h.head_dim, h.n_ff
            );
            println!(
                "              rms_eps {:e} n_ctx_train {} rope base {} dims {} scale {} {}",
                h.rms_eps,
                h.n_ctx_train,
                h.rope.freq_base,
                h.rope.n_dims,
                h.rope.freq_scale,
                if h.rope.neox { "neox" } else { "normal" }
            );
            if let Some(m) = h.mla {
                println!(
                    "              latent attention: q_lora_rank {} kv_lora_rank {} key {} + {} (rope from \
                     dim {}) value {}; scales: embedding {} residual {} logits {}",
                    m.q_lora,
                    m.kv_lora,
                    m.nope,
                    m.rope,
                    h.rope.dim_offset,
                    m.v,
                    h.scales.embd,
                    h.scales.residual,
                    h.scales.logits
                );
            }
        }
        Err(e) => println!("hparams:      not runnable: {e}"),
    }
    match &tok {
        Ok(t) => println!("tokenizer:    {}", t.summary()),
        Err(e) => println!("tokenizer:    {e}"),
    }
    println!("\nmetadata ({} entries):", f.metadata.len());
    for (k, v) in &f.metadata {
        let s = v.summary();
        if a.all || s.len() <= 100 {
            println!("  {k:<44} {s}");
        } else {
            println!("  {k:<44} {}…", s.chars().take(100).collect::<String>());
        }
    }
    println!("\ntensors ({}):", f.tensors.len());
    println!(
        "  {:<36} {:<20} {:<6} {:>12}",
        "name", "shape", "type", "bytes"
    );
    for t in &f.tensors {
        println!(
            "  {:<36} {:<20} {:<6} {:>12}",
            t.name,
            t.shape_string(),
            t.ty.name(),
            t.n_bytes
        );
    }
    println!("\ntotals:");
    for (ty, (n, b)) in &per_type {
        println!("  {ty:<6} {n:>5} tensors {:>14}", mib(*b));
    }
    println!(
        "  all    {:>5} tensors {:>14}  ({n_params} parameters)",
        f.tensors.len(),
        mib(total)
    );
    Ok(())
}
