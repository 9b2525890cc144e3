"""Build a tiny random-weight Llama model directory locally: no downloads, seeded, reproducible.

The model has a real byte-level BPE tokenizer trained on the spot, a ChatML chat template and
random weights, so vLLM on CPU can serve it and the simulator can tokenize exactly like it.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from epp.extras import MissingExtra, require_extra

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said each "
    "she which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under name very "
    "through just form sentence great think say help low line differ turn cause much mean before move "
    "right boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth father "
    "system prompt user assistant question answer model cache block token request route replica server "
    "query table select from where group order limit join database schema customer invoice product"
).split()


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        sentence = " ".join(words)
        out.append(sentence.capitalize() + rng.choice([".", "?", "!", ",", ":"]))
    return out


def build_tokenizer(seed: int = 0, vocab_size: int = 2048):
    """Train a byte-level BPE tokenizer (every byte string is encodable) on a seeded corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Mirror Llama: a BOS token is prepended when special tokens are added.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def write_tiny_model(
    dest: Path,
    *,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 4096,
    weights: bool = True,
) -> Path:
    """Write config.json, tokenizer files and (optionally) random safetensors weights into `dest`."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(seed, vocab_size)
    tok.save(str(dest / "tokenizer.json"))
    real_vocab = tok.get_vocab_size()
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "</s>",
                "add_bos_token": True,
                "model_max_length": max_position_embeddings,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
    )
    (dest / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"})
    )
    intermediate = hidden_size * 2
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": real_vocab,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    (dest / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos})
    )
    if weights:
        _write_weights(dest / "model.safetensors", config, seed)
    return dest


def _write_weights(path: Path, config: dict, seed: int) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]

    def mat(rows: int, cols: int):
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    tensors = {"model.embed_tokens.weight": mat(v, h), "model.norm.weight": np.ones(h, np.float32),
               "lm_head.weight": mat(v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = mat(h, h)
        tensors[p + "mlp.gate_proj.weight"] = mat(inter, h)
        tensors[p + "mlp.up_proj.weight"] = mat(inter, h)
        tensors[p + "mlp.down_proj.weight"] = mat(h, inter)
        tensors[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    save_file(tensors, str(path), metadata={"format": "pt"})


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-weights", action="store_true", help="tokenizer and config only (no 'engine' extra needed)")
    args = parser.parse_args()
    if not args.no_weights:
        try:
            require_extra("engine", "python -m epp.engine.tinymodel (its random weights)")
        except MissingExtra as exc:
            print(exc, file=sys.stderr)
            return 2
    print(write_tiny_model(args.dest, seed=args.seed, weights=not args.no_weights))
    return 0


if __name__ == "__main__":
    sys.exit(main())
