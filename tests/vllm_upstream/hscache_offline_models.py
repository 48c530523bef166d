"""Offline stand-ins for the Hugging Face models that vLLM's core tests name.

vLLM's scheduler tests build ``ModelConfig(model=...)`` for a handful of published models;
offline, each needs a local directory with the model's ``config.json``. ``write(root)``
creates those directories (configuration only, no weights) and returns ``{model_id: dir}``
for vLLM's ``VLLM_MODEL_REDIRECT_PATH``.

No tokenizer of these models is available offline. Text-only models are loaded with
``skip_tokenizer_init=True`` (see ``hscache_swap``). The multimodal processors of LLaVA and
Qwen2.5-VL cannot run without one, so their directories also get a *synthetic* word-level
tokenizer with the model's vocabulary size and special-token ids (LLaVA's ``<image>`` =
32000; Qwen's ``<|vision_start|>`` = 151652, ``<|image_pad|>`` = 151655 ...) and an image
processor with the published settings (CLIP for LLaVA-1.5; ``Qwen2VLImageProcessor`` and
its video twin for Qwen2.5-VL), generated with ``tokenizers``/``transformers``. The tests
feed token ids directly and never decode text; the image-token counts (576 per 336x336
image for LLaVA, pixels / (14 * 2)^2 for Qwen2.5-VL) come from the vision configs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# config.json of the models vLLM's tests name, as published on the Hugging Face Hub (the
# fields that matter for a config-only load). Only configuration: no weights.
CONFIGS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {
        "_name_or_path": "facebook/opt-125m",
        "activation_dropout": 0.0,
        "activation_function": "relu",
        "architectures": ["OPTForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 2,
        "do_layer_norm_before": True,
        "dropout": 0.1,
        "eos_token_id": 2,
        "ffn_dim": 3072,
        "hidden_size": 768,
        "init_std": 0.02,
        "layerdrop": 0.0,
        "max_position_embeddings": 2048,
        "model_type": "opt",
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "pad_token_id": 1,
        "prefix": "</s>",
        "torch_dtype": "float16",
        "use_cache": True,
        "vocab_size": 50272,
        "word_embed_proj_dim": 768,
    },
    # test_priority_preemption_bug.py.
    "facebook/opt-350m": {
        "_name_or_path": "facebook/opt-350m",
        "activation_dropout": 0.0,
        "activation_function": "relu",
        "architectures": ["OPTForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 2,
        "do_layer_norm_before": False,
        "dropout": 0.1,
        "eos_token_id": 2,
        "ffn_dim": 4096,
        "hidden_size": 1024,
        "init_std": 0.02,
        "layerdrop": 0.0,
        "max_position_embeddings": 2048,
        "model_type": "opt",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "pad_token_id": 1,
        "prefix": "</s>",
        "torch_dtype": "float16",
        "vocab_size": 50272,
        "word_embed_proj_dim": 512,
    },
    # vLLM 0.33's default `ModelConfig.model`.
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # tests/v1/core/test_scheduler.py: multimodal scheduling (encoder budget, EC connector).
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"],
        "ignore_index": -100,
        "image_token_index": 32000,
        "model_type": "llava",
        "pad_token_id": 32001,
        "projector_hidden_act": "gelu",
        "text_config": {
            "_name_or_path": "lmsys/vicuna-7b-v1.5",
            "architectures": ["LlamaForCausalLM"],
            "max_position_embeddings": 4096,
            "model_type": "llama",
            "rms_norm_eps": 1e-05,
            "torch_dtype": "float16",
            "vocab_size": 32064,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vision_config": {
            "hidden_size": 1024,
            "image_size": 336,
            "intermediate_size": 4096,
            "model_type": "clip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "projection_dim": 768,
            "vocab_size": 32000,
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": 32064,
    },
    # tests/v1/core/test_scheduler.py: MTP lookahead hashes (hybrid linear attention + MoE).
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # tests/v1/core/test_kv_cache_utils.py: max concurrency for a KV-cache config.
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # tests/v1/core/test_priority_scheduler_random.py: priority scheduling with images.
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_token_id": 151654,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 128000,
        "max_window_layers": 70,
        "model_type": "qwen2_5_vl",
        "num_attention_heads": 16,
        "num_hidden_layers": 36,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.41.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 2048,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vocab_size": 151936,
    },
}


# Models whose directory holds a tokenizer (so skip_tokenizer_init is not forced).
WITH_TOKENIZER = {"llava-hf/llava-1.5-7b-hf", "Qwen/Qwen2.5-VL-3B-Instruct"}

# Qwen2/2.5's added tokens, in id order from 151643 (the byte-level BPE vocabulary has
# ids 0..151642); tokenizer.json of Qwen/Qwen2.5-VL-3B-Instruct.
QWEN_ADDED_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
QWEN_FIRST_ADDED_ID = 151643
# The first 14 are special tokens; the tool-call, FIM and repo tokens are plain added ones.
QWEN_NUM_SPECIAL = 14

# preprocessor_config.json of Qwen/Qwen2.5-VL-3B-Instruct (CLIP's mean/std).
QWEN2_5_VL_PREPROCESSOR: dict[str, Any] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}

# chat_template.json of Qwen/Qwen2.5-VL-3B-Instruct (Qwen2-VL's ChatML template).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_llava_processor(d: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    specials = {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": 32000, "<pad>": 32001}
    vocab = {f"t{i}": i for i in range(3, 32064) if i not in specials.values()}
    vocab.update(specials)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
    )
    LlavaProcessor(
        image_processor=image_processor,
        tokenizer=fast,
        patch_size=14,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    ).save_pretrained(d)


def _write_qwen2_5_vl_processor(d: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    vocab = {f"t{i}": i for i in range(QWEN_FIRST_ADDED_ID)}
    vocab.update({t: QWEN_FIRST_ADDED_ID + i for i, t in enumerate(QWEN_ADDED_TOKENS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens(
        [
            AddedToken(t, special=i < QWEN_NUM_SPECIAL, normalized=False)
            for i, t in enumerate(QWEN_ADDED_TOKENS)
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
        additional_special_tokens=QWEN_ADDED_TOKENS[1:QWEN_NUM_SPECIAL],
    )
    # The published repository has one preprocessor_config.json, which transformers reads
    # for both the image and the video processor.
    Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**QWEN2_5_VL_PREPROCESSOR),
        video_processor=Qwen2VLVideoProcessor(**QWEN2_5_VL_PREPROCESSOR),
        tokenizer=fast,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    ).save_pretrained(d)


def write(root: Path) -> dict[str, str]:
    """Write every model directory under ``root``; return ``{model_id: directory}``."""
    out: dict[str, str] = {}
    for model_id, config in CONFIGS.items():
        d = root / model_id.replace("/", "--")
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(config, indent=2))
        if model_id == "llava-hf/llava-1.5-7b-hf":
            _write_llava_processor(d)
        elif model_id == "Qwen/Qwen2.5-VL-3B-Instruct":
            _write_qwen2_5_vl_processor(d)
        out[model_id] = str(d)
    return out
