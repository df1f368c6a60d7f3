"""Mock pretraining data as a pure function of (seed, global sample index).

Any rank can produce any sample without communication, so a promoted spare or a rank that
rolled back resumes at exactly the right sample from ``consumed_train_samples`` alone.
Sample ``i`` is an arithmetic sequence modulo the vocabulary with a random start and a
random small stride, so next-token loss falls quickly from ``log(vocab)``.
"""

from __future__ import annotations

from typing import Iterator, List

import torch


def sample_tokens(seed: int, index: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + int(index)) & 0x7FFF_FFFF_FFFF_FFFF)
    start = torch.randint(0, vocab_size, (1,), generator=g)
    stride = torch.randint(1, 4, (1,), generator=g)
    return (start + stride * torch.arange(seq_length + 1)) % vocab_size


def microbatches(seed: int, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                 dp_size: int, dp_rank: int, seq_length: int, vocab_size: int) -> List[dict]:
    """This DP rank's microbatches of the global batch that starts at ``consumed_samples``.

    Same interleaving as Megatron's MegatronPretrainingSampler: the global batch is read in
    chunks of ``micro_batch_size * dp_size`` and each DP rank takes its slice of each chunk.
    """
    num_micro = global_batch_size // (micro_batch_size * dp_size)
    out = []
    causal = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)
    for k in range(num_micro):
        base = consumed_samples + k * micro_batch_size * dp_size + dp_rank * micro_batch_size
        seqs = torch.stack([sample_tokens(seed, base + j, seq_length, vocab_size)
                            for j in range(micro_batch_size)])
        out.append({
            "tokens": seqs[:, :-1].contiguous(),
            "labels": seqs[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro_batch_size, seq_length, dtype=torch.float32),
            "position_ids": torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1)
                                 .contiguous(),
            "attention_mask": causal.view(1, 1, seq_length, seq_length),
        })
    return out


def as_iterator(batches: List[dict]) -> Iterator[dict]:
    return iter(batches)
