"""A real OpenAI-compatible server for the endpoint tests: llama.cpp (through llama-cpp-python's server) serving a GGUF
of a quantgate test model, written here with llama.cpp's own `gguf` package.

Why a writer of our own rather than llama.cpp's convert_hf_to_gguf.py: that script ships only in llama.cpp's source
tree (not in any wheel), and it recognises a BPE tokenizer by hashing how known hub vocabularies split a test string,
which a tokenizer trained here can never match. Ours is SmolLM's pre-tokenizer (digits one by one, then GPT-2's
byte-level regex), which llama.cpp knows as `smollm`; everything else is what the converter writes for a Llama: the
same tensor names, Q/K rows permuted back to llama.cpp's rotary layout, the vocabulary and merges as `gpt2`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotary halves back to llama.cpp's interleaved pairs (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path, qtype: str = "F32", noise: float = 0.0) -> Path:
    """The Llama checkpoint in `model_dir` as one GGUF file: 2-D weights in `qtype` (F32, F16 or Q8_0), norms F32;
    `noise` > 0: another model, each 2-D weight moved by `noise` x its own spread (a redeploy's other weights)."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(str(model_dir / "model.safetensors"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(str(out), "llama")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_name(model_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_rope_freq_base((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 1e4)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type({"F32": 0, "F16": 1, "Q8_0": 7}[qtype])
    reverse = {i: t for t, i in tok.get_vocab().items()}
    special = set(tok.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([reverse.get(i, f"[PAD{i}]") for i in range(config["vocab_size"])])
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(config["vocab_size"])])
    gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer)
    writer.add_add_bos_token(False)  # the tokenizer's post-processor adds nothing, as in-process evaluation sees it
    rng = np.random.default_rng(0)
    for name, value in tensors.items():
        value = value.astype(np.float32)
        if noise and value.ndim == 2:
            value = value + noise * value.std() * rng.standard_normal(value.shape, dtype=np.float32)
        if name.endswith("q_proj.weight"):
            value = _permute(value, heads)
        elif name.endswith("k_proj.weight"):
            value = _permute(value, kv_heads)
        target = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}.get(name)
        if target is None:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            target = f"blk.{layer}.{NAMES[rest.removesuffix('.weight')]}.weight"
        if value.ndim == 2 and qtype == "Q8_0":
            writer.add_tensor(target, gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(target, value.astype(np.float16) if value.ndim == 2 and qtype == "F16" else value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(gguf_file: Path, name: str, log: Path, api_key: str | None = None, extra: tuple[str, ...] = (),
            port: int | None = None):
    """`python -m llama_cpp.server` on `port` (default a free local one) serving `gguf_file` as `name`,
    greedy-deterministic (one thread, one sequence); yields its base URL (…/v1) once /v1/models answers, and stops it
    after."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_file), "--model_alias", name,
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "512", "--n_threads", "1", "--n_batch", "512",
           "--seed", "0", "--logits_all", "true", "--verbose", "false", *extra]
    if api_key:
        cmd += ["--api_key", api_key]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                request = urllib.request.Request(f"{base}/models",
                                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
                with urllib.request.urlopen(request, timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, f"llama_cpp.server exited {proc.returncode}: {log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"llama_cpp.server did not answer in 120 s: {log.read_text()[-3000:]}"
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
