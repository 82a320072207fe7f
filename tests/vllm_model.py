"""Make the tiny model the real-vLLM tests serve: ``python tests/vllm_model.py DIR``, run by the
real vLLM's own Python (``make vllm-real``), which has torch, transformers and tokenizers.

Nothing is fetched from a model hub. A Llama with random weights (seeded, so every machine
makes the same model) and a byte-level BPE tokenizer trained here on a few sentences. Its text
is noise, but its token counts, timings, KV blocks and metrics are vLLM's own. The shape is the
smallest the CPU attention backend takes: it refuses head_dim 16, so 4 heads of 64.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

MAX_POSITIONS = 2048  # a --max-model-len above it fails vLLM's start (the rollback test)
SENTENCES = [
    "vLLM serves large language models with paged attention and continuous batching.",
    "The agent watches throughput, latency and the KV cache, and restarts only when it helps.",
    "A restart drains requests, rewrites the flags, and verifies that the server recovered.",
    "Operators read the journal, the metrics and the status of every GPU host in the fleet.",
    "The quick brown fox jumps over the lazy dog while the scheduler preempts a sequence.",
]


def make(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(SENTENCES * 20, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: vllm_model.py DIRECTORY")
    make(Path(sys.argv[1]))
