"""Makes the tiny random Qwen2.5-Omni the vllm-omni end-to-end run serves (test scaffolding).

transformers' ``Qwen2_5OmniConfig`` shrunk (thinker text hidden 64, 2 layers, 2 heads / 1 KV
head, mrope sections [4, 6, 6]; vision depth 1; audio 1 layer; talker hidden 64, 2 layers,
head_dim 32; token2wav shrunk), random weights from a fixed seed saved with
``save_pretrained``, and a tokenizer built locally with ``tokenizers``: byte-level BPE padded
with filler entries so that Qwen's special tokens keep their real ids (151643...151656),
wrapped as a Qwen2 tokenizer. Nothing is downloaded. Runs in the vLLM 0.30 + vllm-omni 0.30
environment (``scripts/vllm030_env.sh``);
``python tests/omni_e2e/make_model.py DIR [--sliding-window W] [--thinker-hidden H
--thinker-layers L --thinker-heads N --thinker-kv-heads K]``.

``--thinker-*`` size the thinker's language model (``python -m hscache bench-omni-e2e``
wants one whose prefill dominates a request: hidden 512, 8 layers); its head dimension is
``H / N`` and the mrope sections scale with it ([4, 6, 6] per 32); the vision and audio
encoders' outputs, and the talker's input embedding, follow ``H``; the talker stays tiny.
The defaults are the end-to-end check's model, unchanged.

``--sliding-window W`` makes the thinker a hybrid: its text layer 0 full attention, layer 1
sliding window of ``W`` tokens (``use_sliding_window``, ``sliding_window``, ``layer_types``,
as transformers' Qwen2 configs say it), the same seeded weights. vLLM 0.30's Qwen2 does
not read ``layer_types`` (it builds every layer with the model-wide window, which vLLM sets
only when *all* layers slide), so the scaffolding plugin gives each layer its window
(``hscache_omni_cpu.hybrid``); ``max_window_layers`` stays the layer count because vLLM's
Qwen2 asserts exactly that when the layer types are mixed (``qwen2.py``,
``Qwen2Model.__init__``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

SEED = 1234
HIDDEN = 64
HEADS = 2
KV_HEADS = 1
HEAD_DIM = HIDDEN // HEADS  # 32: mrope sections [4, 6, 6] cover its half
FIRST_SPECIAL_ID = 151643
SPECIAL_TOKENS = [
    "<|endoftext|>",  # 151643
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",  # 151646 = audio_token_index
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_bos|>",  # 151652 = vision_start_token_id
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",  # 151655
    "<|VIDEO|>",  # 151656
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT_VOCAB = 152064  # the real thinker's; every special id above must be inside it


@dataclasses.dataclass(frozen=True)
class ThinkerSize:
    """The thinker language model's shape (the defaults: the end-to-end check's)."""

    hidden: int = HIDDEN
    layers: int = 2
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    max_positions: int = 4096

    def check(self) -> None:
        if min(self.hidden, self.layers, self.heads, self.kv_heads) <= 0:
            raise ValueError(f"thinker sizes must be > 0: {self}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden % heads and heads % kv_heads must be 0: {self}")
        if (self.hidden // self.heads) % 32:
            raise ValueError(f"the head dimension hidden / heads must be a multiple of 32: {self}")


def _config(sliding_window: int | None = None, size: ThinkerSize = ThinkerSize()) -> Any:
    from transformers import Qwen2_5OmniConfig

    size.check()
    scale = size.hidden // size.heads // HEAD_DIM
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}
    thinker_rope = {**rope, "mrope_section": [4 * scale, 6 * scale, 6 * scale]}
    text = {
        "vocab_size": TEXT_VOCAB,
        "hidden_size": size.hidden,
        "intermediate_size": 2 * size.hidden,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "max_position_embeddings": size.max_positions,
        "max_window_layers": size.layers,
        "layer_types": ["full_attention"] * size.layers,
        "rope_parameters": thinker_rope,
    }
    if sliding_window is not None:
        text.update(
            use_sliding_window=True,
            sliding_window=sliding_window,
            layer_types=["full_attention", "sliding_attention"]
            + ["full_attention"] * (size.layers - 2),
        )
    thinker = {
        "text_config": text,
        "vision_config": {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": size.hidden,
            "fullatt_block_indexes": [0],
        },
        "audio_config": {
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": size.hidden,
            "num_mel_bins": 128,
        },
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "bos_token_id": FIRST_SPECIAL_ID,
        "eos_token_id": FIRST_SPECIAL_ID + 2,
        "pad_token_id": FIRST_SPECIAL_ID,
    }
    talker = {
        "vocab_size": 8448,
        "embedding_size": size.hidden,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": size.max_positions,
        "max_window_layers": 2,
        "layer_types": ["full_attention"] * 2,
        "rope_parameters": rope,
    }
    token2wav = {
        "dit_config": {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 16,
            "emb_dim": 32,
            "enc_emb_dim": 16,
            "enc_dim": 16,
            "enc_channels": [16, 16, 16, 16, 48],
            "enc_attention_channels": 8,
            "enc_se_channels": 8,
            "look_ahead_layers": [1],
            "look_backward_layers": [0],
        },
        "bigvgan_config": {"upsample_initial_channel": 32},
    }
    config = Qwen2_5OmniConfig(
        thinker_config=thinker, talker_config=talker, token2wav_config=token2wav
    )
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    return config


def _tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    byte_level = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(sorted(byte_level))}
    # Fillers never produced by the merge-less BPE: they only hold ids so that the special
    # tokens below land on their real Qwen ids.
    for i in range(len(vocab), FIRST_SPECIAL_ID):
        vocab[f"<|filler_{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == FIRST_SPECIAL_ID + i, name
    fast = Qwen2TokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens={
            "audio_token": "<|AUDIO|>",
            "image_token": "<|IMAGE|>",
            "video_token": "<|VIDEO|>",
            "audio_bos_token": "<|audio_bos|>",
            "audio_eos_token": "<|audio_eos|>",
            "vision_bos_token": "<|vision_bos|>",
            "vision_eos_token": "<|vision_eos|>",
        },
    )
    fast.save_pretrained(str(out))


def _processor(out: Path) -> None:
    """The omni processor vLLM builds for the thinker (its multimodal budget needs one)."""
    from transformers import (
        AutoTokenizer,
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        WhisperFeatureExtractor,
    )

    processor = Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(),
        video_processor=Qwen2VLVideoProcessor(),
        feature_extractor=WhisperFeatureExtractor(feature_size=128),
        tokenizer=AutoTokenizer.from_pretrained(str(out)),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))


def make(out: Path, sliding_window: int | None = None, size: ThinkerSize = ThinkerSize()) -> Path:
    """Writes config, weights and tokenizer to ``out`` (skipped when already complete with
    the same sizes); ``sliding_window``: the thinker's layer 1 slides over that many tokens
    (a hybrid); ``size``: the thinker language model's shape."""
    size.check()
    stamp = out / ".hscache-model-complete"
    want = "ok\n" if size == ThinkerSize() else f"ok {json.dumps(dataclasses.asdict(size))}\n"
    if stamp.exists() and stamp.read_text() == want:
        return out
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = Qwen2_5OmniForConditionalGeneration(_config(sliding_window, size))
    model.save_pretrained(str(out))
    _tokenizer(out)
    _processor(out)
    gen = {"bos_token_id": FIRST_SPECIAL_ID, "eos_token_id": FIRST_SPECIAL_ID + 2}
    (out / "generation_config.json").write_text(json.dumps(gen))
    stamp.write_text(want)
    return out


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--sliding-window", type=int, default=None, help="the thinker's layer 1 window"
    )
    for name in ("hidden", "layers", "heads", "kv_heads"):
        parser.add_argument(f"--thinker-{name.replace('_', '-')}", type=int, default=None)
    args = parser.parse_args(argv)
    if args.sliding_window is not None and args.sliding_window <= 0:
        parser.error("--sliding-window must be > 0")
    given = {
        name: getattr(args, f"thinker_{name}")
        for name in ("hidden", "layers", "heads", "kv_heads")
        if getattr(args, f"thinker_{name}") is not None
    }
    try:
        size = ThinkerSize(**given)
        size.check()
    except ValueError as exc:
        parser.error(str(exc))
    print(make(args.out, args.sliding_window, size))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
