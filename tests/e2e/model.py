"""A tiny random Llama and a byte-level BPE tokenizer, made locally (nothing downloaded).

    python tests/e2e/model.py DIR

Writes a Hugging Face checkpoint vLLM can serve on CPU: ``LlamaConfig`` with hidden size
128, 2 layers, 4 heads (head size 32, the CPU attention backend's minimum), random
weights scaled so that greedy decoding is not flat, fp32; and a byte-level BPE tokenizer
trained with ``tokenizers`` on a few sentences, wrapped in ``PreTrainedTokenizerFast``.
Deterministic (fixed seeds); about 2.4 MB. Reused if ``DIR/.complete`` exists.
"""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB_SIZE = 512
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A cache keeps the answers it has already computed, so the next question is cheap.",
    "Blocks of keys and values are shared between requests that start with the same words.",
    "When memory runs out, the scheduler preempts a request and computes it again later.",
    "Prefix caching reuses the work of a system prompt across many conversations.",
    "Rust and Python meet at a thin boundary; the bookkeeping lives on the Rust side.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25.",
]


def make_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(out))


def make_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)  # random but not flat: greedy decoding varies by context
    model.save_pretrained(str(out), safe_serialization=True)


def make(out: Path) -> Path:
    """Writes the checkpoint into ``out`` (once) and returns it."""
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(out)))
    make_model(out, vocab)
    (out / ".complete").write_text("ok\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(make(Path(sys.argv[1])))
