"""Llama's Hugging Face files in Megatron-Core's terms, both ways: the trainer flags of a
config.json and the Megatron-Core state dict of its weights (model.safetensors, sharded or not,
or pytorch_model.bin); and a config.json and Hugging Face weights from a run's flags and state
dict. convert/convert_hf_llama.py writes the first as a checkpoint and exports the second.

What maps where (Megatron-Core's local layer spec; its checkpoints name the norms as Transformer
Engine's layers do, so either spec loads them):
- model.embed_tokens / lm_head / model.norm -> embedding.word_embeddings / output_layer /
  decoder.final_layernorm, the vocabulary rows padded with zeros to Megatron's padded size;
- q_proj, k_proj, v_proj -> linear_qkv, per key-value group: its query heads, its key, its value
  (Megatron-Core's order); o_proj -> linear_proj;
- gate_proj, up_proj -> linear_fc1 (gate first: Megatron's SwiGLU is silu(first half) * second);
  down_proj -> linear_fc2; input_layernorm, post_attention_layernorm -> input_layernorm,
  pre_mlp_layernorm.
Hugging Face's Llama applies rotary embeddings by halves (rotate_half), as Megatron-Core does by
default, so no weight is permuted. The way back (hf_state_dict) undoes each step exactly.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Mapping

import torch

from megatron_dpp.models import families
from megatron_dpp.one_line_errors import InputError

FAMILY = families.LLAMA  # the model these files convert to
# Hugging Face model types of Llama's architecture (Mistral's is Llama's, windowed attention
# aside, which check_llama_config refuses).
MODEL_TYPES = ("llama", "mistral")
CONFIG_FILE = "config.json"
# Llama 3.1's rotary scaling as Megatron-Core implements it (its fixed constants); a config with
# other values has another model.
LLAMA3_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
DTYPE_FLAGS = {"bfloat16": ["--bf16"], "float16": ["--fp16"], "float32": []}


def read_config(directory: str) -> dict:
    """The directory's config.json; InputError (one line) when it is missing or not JSON."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise InputError(f"{directory!r} has no {CONFIG_FILE}; pass the directory of a Hugging "
                         f"Face Llama model (config.json and its weights)")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as error:
        raise InputError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: not a JSON object")
    return config


def rope_settings(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None): as published (transformers 4's keys, Meta's files) or
    under rope_parameters (transformers 5's)."""
    parameters = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", parameters.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling")
    if scaling is None and parameters.get("rope_type", "default") != "default":
        scaling = parameters
    return theta, scaling


def _value(config: dict, key: str, path: str):
    if key not in config:
        raise InputError(f"{path}: no {key!r}; a Llama config.json has it")
    return config[key]


def check_llama_config(config: dict, path: str = CONFIG_FILE) -> None:
    """InputError, in one line, for a config.json that --model llama cannot build exactly."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise InputError(f"{path}: model_type {kind!r}; only Llama's architecture converts here "
                         f"({', '.join(repr(k) for k in MODEL_TYPES)})")
    refused = [
        (config.get("sliding_window") is not None,
         f"sliding_window {config.get('sliding_window')} (Mistral 7B v0.1's windowed attention; "
         f"--model llama attends to the whole sequence, as Mistral v0.2 and later do)"),
        (config.get("hidden_act", "silu") != "silu",
         f"hidden_act {config.get('hidden_act')!r} (Llama's MLP is SwiGLU: silu)"),
        (bool(config.get("attention_bias")), "attention_bias (--model llama has no biases)"),
        (bool(config.get("mlp_bias")), "mlp_bias (--model llama has no biases)"),
        (bool(config.get("tie_word_embeddings")),
         "tie_word_embeddings (Llama 3.2 1B/3B's tied output layer; --model llama's is its own)"),
    ]
    for condition, what in refused:
        if condition:
            raise InputError(f"{path}: {what} is not supported")
    hidden, heads = _value(config, "hidden_size", path), _value(config, "num_attention_heads", path)
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise InputError(f"{path}: head_dim {head_dim} is not hidden_size / num_attention_heads "
                         f"({hidden} / {heads}); --model llama has no separate head size")
    theta, scaling = rope_settings(config)
    if float(theta) != int(theta):
        raise InputError(f"{path}: rope_theta {theta} is not a whole number (--rotary-base is)")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        other = {key: scaling.get(key) for key in LLAMA3_ROPE_SCALING
                 if float(scaling.get(key, -1)) != LLAMA3_ROPE_SCALING[key]}
        if kind != "llama3" or other:
            raise InputError(f"{path}: rope_scaling {scaling} is not Llama 3.1's (rope_type "
                             f"'llama3' with {LLAMA3_ROPE_SCALING}), the one Megatron-Core "
                             f"implements")


def trainer_flags(config: dict) -> list[str]:
    """The model flags of `python -m megatron_dpp.pretrain --model llama` for this config (shape,
    grouped-query attention, rotary base and scaling, norm epsilon, positions)."""
    check_llama_config(config)
    heads = config["num_attention_heads"]
    theta, scaling = rope_settings(config)
    flags = ["--num-layers", str(config["num_hidden_layers"]),
             "--hidden-size", str(config["hidden_size"]),
             "--ffn-hidden-size", str(config["intermediate_size"]),
             "--num-attention-heads", str(heads),
             "--num-query-groups", str(config.get("num_key_value_heads") or heads),
             "--rotary-base", str(int(theta)),
             "--norm-epsilon", repr(float(config.get("rms_norm_eps", 1e-6))),
             "--max-position-embeddings", str(config["max_position_embeddings"])]
    if scaling is not None:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(float(scaling["factor"]))]
    return flags


def _padded_rows(weight: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    if weight.shape[0] > rows:
        raise InputError(f"{name} has {weight.shape[0]} rows, more than the padded vocabulary "
                         f"{rows}")
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def megatron_state_dict(weight: Callable[[str], torch.Tensor], config: dict,
                        padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """The state dict of Megatron-Core's Llama GPTModel (pp = tp = 1, local layer spec) from the
    Hugging Face weights, each read when needed by weight(name)."""
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    head_dim = hidden // heads
    state = {
        "embedding.word_embeddings.weight": _padded_rows(
            weight("model.embed_tokens.weight"), padded_vocab_size, "model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": weight("model.norm.weight"),
        "output_layer.weight": _padded_rows(weight("lm_head.weight"), padded_vocab_size,
                                            "lm_head.weight"),
    }
    for index in range(layers):
        hf, ours = f"model.layers.{index}.", f"decoder.layers.{index}."
        query = weight(hf + "self_attn.q_proj.weight").reshape(groups, -1, hidden)
        key = weight(hf + "self_attn.k_proj.weight").reshape(groups, head_dim, hidden)
        value = weight(hf + "self_attn.v_proj.weight").reshape(groups, head_dim, hidden)
        state[ours + "self_attention.linear_qkv.weight"] = (
            torch.cat([query, key, value], dim=1).reshape(-1, hidden))
        state[ours + "self_attention.linear_proj.weight"] = weight(hf + "self_attn.o_proj.weight")
        state[ours + "input_layernorm.weight"] = weight(hf + "input_layernorm.weight")
        state[ours + "pre_mlp_layernorm.weight"] = weight(hf + "post_attention_layernorm.weight")
        state[ours + "mlp.linear_fc1.weight"] = torch.cat(
            [weight(hf + "mlp.gate_proj.weight"), weight(hf + "mlp.up_proj.weight")])
        state[ours + "mlp.linear_fc2.weight"] = weight(hf + "mlp.down_proj.weight")
    return state


def hf_state_dict(state: Mapping[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The Hugging Face weights of Megatron-Core's Llama state dict (pp = tp = 1, local layer
    spec names), `config` the Hugging Face config.json (hf_config's); the vocabulary rows cut to
    config["vocab_size"]. Each tensor contiguous, as safetensors stores them."""
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, vocab = hidden // heads, config["vocab_size"]
    queries = heads // groups * head_dim  # rows of one group's query heads
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": state["decoder.final_layernorm.weight"],
           "lm_head.weight": state["output_layer.weight"][:vocab]}
    for index in range(layers):
        hf, ours = f"model.layers.{index}.", f"decoder.layers.{index}."
        qkv = state[ours + "self_attention.linear_qkv.weight"].reshape(groups, -1, hidden)
        out[hf + "self_attn.q_proj.weight"] = qkv[:, :queries].reshape(-1, hidden)
        out[hf + "self_attn.k_proj.weight"] = qkv[:, queries:queries + head_dim].reshape(-1, hidden)
        out[hf + "self_attn.v_proj.weight"] = qkv[:, queries + head_dim:].reshape(-1, hidden)
        out[hf + "self_attn.o_proj.weight"] = state[ours + "self_attention.linear_proj.weight"]
        out[hf + "input_layernorm.weight"] = state[ours + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = state[ours + "pre_mlp_layernorm.weight"]
        gate, up = state[ours + "mlp.linear_fc1.weight"].chunk(2)
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
        out[hf + "mlp.down_proj.weight"] = state[ours + "mlp.linear_fc2.weight"]
    return {name: tensor.contiguous() for name, tensor in out.items()}


def hf_config(args, vocab_size: int, dtype: torch.dtype, bos: int | None = None,
              eos: int | None = None) -> dict:
    """The config.json of a --model llama run's flags (`args`: the trainer's, as a checkpoint
    keeps them), with the keys Meta's published files use (rope_theta, rope_scaling), which
    transformers 4 and 5 both read."""
    names = {value: key for key, value in {
        "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.items()}
    scaling = None
    if getattr(args, "use_rope_scaling", False):
        scaling = {"rope_type": "llama3", "factor": float(args.rope_scaling_factor),
                   **LLAMA3_ROPE_SCALING}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.hidden_size, "intermediate_size": args.ffn_hidden_size,
        "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_query_groups or args.num_attention_heads,
        "head_dim": args.hidden_size // args.num_attention_heads, "hidden_act": "silu",
        "rms_norm_eps": args.norm_epsilon, "rope_theta": float(args.rotary_base),
        "rope_scaling": scaling, "max_position_embeddings": args.max_position_embeddings,
        "vocab_size": vocab_size, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": args.init_method_std,
        "torch_dtype": names[dtype], "use_cache": True,
    }
    if bos is not None:
        config["bos_token_id"] = bos
    if eos is not None:
        config["eos_token_id"] = eos
    return config


class HuggingFaceWeights:
    """The tensors of a Hugging Face model directory by name, read one at a time:
    model.safetensors (or its shards, by model.safetensors.index.json), else pytorch_model.bin
    (or its shards). InputError (one line) for a directory without weights or a missing name."""

    def __init__(self, directory: str):
        self.directory = directory
        self._where: dict[str, str] = {}
        self._single: str | None = None
        self._open: dict[str, Mapping] = {}
        for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                                   ("pytorch_model.bin.index.json", "pytorch_model.bin")):
            index = os.path.join(directory, index_name)
            if os.path.isfile(index):
                with open(index, encoding="utf-8") as handle:
                    self._where = dict(json.load(handle)["weight_map"])
                return
            if os.path.isfile(os.path.join(directory, single)):
                self._single = single
                return
        raise InputError(f"{directory!r} has no weights (model.safetensors, its index, or "
                         f"pytorch_model.bin)")

    def _file(self, name: str) -> str:
        if self._where:
            if name not in self._where:
                raise InputError(f"{self.directory!r}: the weights have no {name!r}")
            return self._where[name]
        return self._single

    def _tensors(self, file: str) -> Mapping:
        if file not in self._open:
            path = os.path.join(self.directory, file)
            if file.endswith(".safetensors"):
                try:
                    from safetensors import safe_open
                except ImportError:
                    raise InputError("reading model.safetensors needs the safetensors package: "
                                     "pip install safetensors") from None
                self._open[file] = safe_open(path, framework="pt")
            else:
                self._open[file] = torch.load(path, map_location="cpu", weights_only=True)
        return self._open[file]

    def __call__(self, name: str) -> torch.Tensor:
        tensors = self._tensors(self._file(name))
        if hasattr(tensors, "get_tensor"):
            if name not in tensors.keys():
                raise InputError(f"{self.directory!r}: the weights have no {name!r}")
            return tensors.get_tensor(name)
        if name not in tensors:
            raise InputError(f"{self.directory!r}: the weights have no {name!r}")
        return tensors[name]
