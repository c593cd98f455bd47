#!/usr/bin/env python3
"""Writes the HF reference fixtures the trainer's model tests check against
(trainer/tests/fixtures/models/<name>/): tiny random Llama, Qwen2 and Qwen3 checkpoints
saved by transformers (config.json + safetensors, Qwen3 sharded with
model.safetensors.index.json) and reference.safetensors with the input ids and the logits
transformers computes for them on CPU in float32 (eager attention).

Every parameter is perturbed (biases and norms too), so a missing bias, a wrong norm or a
mis-rotated head shows in the logits. Run once after changing it, in a throwaway venv:

    python3.11 -m venv /tmp/hfref && /tmp/hfref/bin/pip install torch==2.11.0 transformers safetensors gguf accelerate
    /tmp/hfref/bin/python scripts/hf-model-fixtures.py

With `--smollm2 GGUF` (the file scripts/setup-models.sh prints) it writes instead
trainer/tests/fixtures/models/smollm2-reference.safetensors: for a few prompts, the ids
transformers' own GGUF tokenizer gives and the logits at the last position of
SmolLM2-135M-Instruct as transformers loads the GGUF (dequantized to float32, eager
attention). trainer/tests/smollm2.rs compares graft's import against them.

Made with torch 2.11.0 and transformers 5.24.0.
"""

import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trainer", "tests", "fixtures", "models")

COMMON = dict(
    vocab_size=160,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

MODELS = {
    # Llama with biases everywhere and untied embeddings.
    "llama": (LlamaConfig, dict(COMMON, rope_theta=10000.0, attention_bias=True, mlp_bias=True,
                                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), None),
    # Qwen2: q/k/v biases, tied embeddings (like Qwen2.5-0.5B).
    "qwen2": (Qwen2Config, dict(COMMON, rope_theta=1000000.0, tie_word_embeddings=True,
                                bos_token_id=1, eos_token_id=2), None),
    # Qwen3: q/k norm, head_dim 16 != hidden / heads, untied, saved in shards.
    "qwen3": (Qwen3Config, dict(COMMON, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=False,
                                bos_token_id=1, eos_token_id=2), "40KB"),
}


def main():
    for name, (cls, kwargs, shard) in MODELS.items():
        torch.manual_seed(0)
        config = cls(**kwargs)
        config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.eval()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                elif pname.endswith("bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        out = os.path.join(ROOT, name)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        if shard:
            model.save_pretrained(out, safe_serialization=True, max_shard_size=shard)
        else:
            model.save_pretrained(out, safe_serialization=True)
        for extra in ("generation_config.json",):
            path = os.path.join(out, extra)
            if os.path.exists(path):
                os.remove(path)
        ids = torch.randint(0, kwargs["vocab_size"], (2, 11), generator=gen)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float().contiguous()
        save_file({"input_ids": ids.contiguous(), "logits": logits}, os.path.join(out, "reference.safetensors"))
        files = sorted(os.listdir(out))
        print(name, files, json.dumps({k: kwargs[k] for k in ("hidden_size", "num_hidden_layers")}))


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 17 + 25? Answer with a number.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


def smollm2(gguf_path):
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    tensors = {}
    for i, prompt in enumerate(SMOLLM2_PROMPTS):
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1].float().contiguous()
        tensors[f"input_ids_{i}"] = ids[0].contiguous()
        tensors[f"logits_{i}"] = logits
        print(i, ids.shape[1], "tokens; argmax", int(logits.argmax()), repr(tok.decode([int(logits.argmax())])))
    save_file(tensors, os.path.join(ROOT, "smollm2-reference.safetensors"))


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--smollm2":
        smollm2(sys.argv[2])
    else:
        main()
