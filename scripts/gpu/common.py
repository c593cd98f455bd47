"""What the GPU check's helpers share (standard library only, so the graft side runs on any
Python 3): the model shapes, the figures file, and the one writer of random weights.

Figures: one JSON object a line in OUTDIR/figures.jsonl, each with "what" naming its kind
(the kinds are listed in scripts/gpu/check.py's docstring). Every helper appends to the same
file through `emit`; the parts run one after another, never at once.

Weights: `write_model` writes an HF Qwen3 directory (config.json + one bf16
model.safetensors) with random weights, from the standard library alone: random bytes
whose exponent bits are overwritten, so every matrix entry is +-[2^k, 2^(k+1)) with a
random sign and mantissa (k = --init-octave, default -5: RMS ~0.05, far enough from zero
that the next-token distribution is not flat and argmax comparisons mean something), the
norms 1. graft and transformers both load that directory: the same weights on both sides.
"""

import json
import math
import os
import random
import struct
import time

# Qwen3 dense configurations (HF config.json fields). "tiny" is graft's trainer bench's own
# tiny shape (trainer/benches/trainer.rs); "tiny-qwen3-vocab" keeps Qwen3's 151936-token
# vocabulary (the lm_head and the sampling over it, which dominate a small model's decode)
# with a body small enough for a CPU.
SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096),
    "tiny-qwen3-vocab": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=32, vocab_size=151936),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
}

# What every shape shares (Qwen3's released configs; all three sizes tie the embeddings).
COMMON = dict(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=40960)


def shape(name):
    if name not in SHAPES:
        raise SystemExit(f"unknown shape '{name}'; known: {', '.join(SHAPES)}")
    return SHAPES[name]


def tensors(s):
    """(HF name, dims, "rand" | "ones") of every stored tensor, in file order (the lm_head is
    tied to the embedding, so not stored)."""
    h, i, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", [s["vocab_size"], h], "rand")]
    for n in range(s["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [
            (p + "input_layernorm.weight", [h], "ones"),
            (p + "self_attn.q_proj.weight", [q, h], "rand"),
            (p + "self_attn.k_proj.weight", [kv, h], "rand"),
            (p + "self_attn.v_proj.weight", [kv, h], "rand"),
            (p + "self_attn.o_proj.weight", [h, q], "rand"),
            (p + "self_attn.q_norm.weight", [hd], "ones"),
            (p + "self_attn.k_norm.weight", [hd], "ones"),
            (p + "post_attention_layernorm.weight", [h], "ones"),
            (p + "mlp.gate_proj.weight", [i, h], "rand"),
            (p + "mlp.up_proj.weight", [i, h], "rand"),
            (p + "mlp.down_proj.weight", [h, i], "rand"),
        ]
    out.append(("model.norm.weight", [h], "ones"))
    return out


def parameters(s):
    return sum(math.prod(d) for _, d, _ in tensors(s))


def matmul_parameters(s):
    """Parameters that take part in a matmul per token: all but the norms (the tied
    embedding counts once, as the lm_head) -- the count graft's trainer bench uses for MFU."""
    return sum(math.prod(d) for _, d, kind in tensors(s) if kind == "rand")


def flops_per_token(s, seq):
    """Training FLOPs per token, as graft's trainer bench counts them: 6 x matmul parameters
    + 6 x layers x seq x attention width (causal attention's score and value products)."""
    return 6 * matmul_parameters(s) + 6 * s["num_hidden_layers"] * seq * s["num_attention_heads"] * s["head_dim"]


def hf_config(s):
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **s,
        **COMMON,
        "rope_parameters": {"rope_theta": COMMON["rope_theta"], "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": s["num_hidden_layers"],
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": "bfloat16",
    }


BF16_ONE = struct.pack("<H", 0x3F80)
CHUNK = 1 << 23  # bytes of random data made at a time


def write_model(directory, shape_name, seed, init_octave=-5):
    """Writes config.json + model.safetensors (bf16) to `directory`; returns the bytes
    written. Entries are +-[2^k, 2^(k+1)), k = init_octave (see the module doc)."""
    s = shape(shape_name)
    e = init_octave + 127  # the biased exponent
    if not 1 <= e <= 254:
        raise SystemExit(f"init octave {init_octave} is outside bf16's range")
    hi = bytes((x & 0x80) | (e >> 1) for x in range(256))  # sign kept, exponent's top 7 bits
    lo = bytes((x & 0x7F) | ((e & 1) << 7) for x in range(256))  # exponent's last bit, mantissa kept
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    header, offset = {}, 0
    ts = tensors(s)
    for name, dims, _ in ts:
        n = 2 * math.prod(dims)
        header[name] = {"dtype": "BF16", "shape": dims, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = os.path.join(directory, "model.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, dims, kind in ts:
            left = 2 * math.prod(dims)
            if kind == "ones":
                f.write(BF16_ONE * (left // 2))
                continue
            while left:
                b = bytearray(rng.randbytes(min(left, CHUNK)))
                b[1::2] = b[1::2].translate(hi)
                b[0::2] = b[0::2].translate(lo)
                f.write(b)
                left -= len(b)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(s), f, indent=2)
    return os.path.getsize(path)


def init_rms(init_octave):
    """The RMS of entries uniform in magnitude over [2^k, 2^(k+1)): sqrt(7/3) * 2^k."""
    return math.sqrt(7 / 3) * 2.0**init_octave


class Figures:
    """Appends figure lines to OUTDIR/figures.jsonl (and echoes them to stdout)."""

    def __init__(self, path):
        self.path = path

    def emit(self, what, **fields):
        line = json.dumps(finite({"what": what, **fields}), allow_nan=False, default=str)
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def finite(v):
    """NaN and infinities as strings ("nan", "inf"): JSON has no place for them, and a
    reader checking for numbers then sees them for what they are."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    return v


def figures(outdir):
    return Figures(os.path.join(outdir, "figures.jsonl"))


def now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
