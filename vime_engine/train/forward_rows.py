"""The tensors of one training forward over rows where samples may share their prompt
(vime_engine.algorithms.packing.shared_prompt_rows): a row is a prompt followed by the responses of its samples.

Each response is laid out after the one before it, but its position ids restart where the prompt ends and its
tokens attend only to the prompt and to earlier tokens of the same response, so every token sees exactly what it
saw in the sample's own sequence: the log-probs are the sample's, up to the order of floating-point sums. The first
response token of each sample is predicted by the prompt's last position, shared by the row's samples; the others
by the token before them in their response. Rows are right-padded; a padding position attends only to itself (a
query with nothing to attend to would give NaN, and NaN times a zero gradient is still NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vime_engine.sample import Sample

PADDING = -1  # segment of a padding position; the prompt is segment 0, the row's k-th response segment k


@dataclass(frozen=True)
class ForwardRows:
    input_ids: Tensor  # [rows, length]
    position_ids: Tensor  # [rows, length]
    # [rows, length] (1 = token) when no row shares its prompt: the model's own causal mask, on its fast path;
    # otherwise [rows, 1, length, length], True where the query (dim 2) attends to the key (dim 3).
    attention_mask: Tensor
    tokens: Tensor  # [rows, length]: 1 at a token, 0 at padding
    # One entry per response token, the samples in row order: its row, the position whose logit predicts it, and
    # its own position (where its token id is).
    token_rows: Tensor
    predictors: Tensor
    targets: Tensor
    # One entry per sample, in row order: its row, its prompt's length, where its response starts in the row and
    # the response's length.
    spans: tuple[tuple[int, int, int, int], ...]

    @property
    def flat_predictors(self) -> Tensor:
        """Each response token's predicting position in the rows flattened to [rows × length]: where the LM head
        must run (a shared prompt's last position once per sample of its row)."""
        return self.token_rows * self.input_ids.shape[1] + self.predictors

    def sample_token_index(self) -> list[Tensor]:
        """Each sample's tokens (prompt, then response) as positions in the rows flattened to [rows × length], where
        they are computed (a shared prompt's positions are those of every sample of its row)."""
        length, device = self.input_ids.shape[1], self.input_ids.device
        return [torch.cat([torch.arange(prompt), torch.arange(start, start + response)]).to(device) + row * length
                for row, prompt, start, response in self.spans]


def build_forward_rows(rows: list[list[Sample]], device: torch.device) -> ForwardRows:
    """The forward tensors of `rows` (each a non-empty list of samples with the same prompt tokens)."""
    sequences, positions, segments = [], [], []
    token_rows, predictors, targets, spans = [], [], [], []
    for row, samples in enumerate(rows):
        prompt = samples[0].prompt_tokens
        if any(s.prompt_tokens != prompt for s in samples):
            raise ValueError("the samples of a row must have the same prompt tokens")
        tokens, position, segment = list(prompt), list(range(len(prompt))), [0] * len(prompt)
        for k, sample in enumerate(samples, start=1):
            start, length = len(tokens), sample.response_length
            spans.append((row, len(prompt), start, length))
            tokens += sample.response_tokens
            position += range(len(prompt), len(prompt) + length)
            segment += [k] * length
            token_rows += [row] * length
            predictors += [len(prompt) - 1, *range(start, start + length - 1)][:length]
            targets += range(start, start + length)
        sequences.append(tokens)
        positions.append(position)
        segments.append(segment)
    longest = max(len(s) for s in sequences)
    input_ids = _padded(sequences, longest, 0)
    position_ids = _padded(positions, longest, 0)
    segment_ids = _padded(segments, longest, PADDING)
    if all(len(samples) == 1 for samples in rows):
        attention_mask = (segment_ids != PADDING).long()
    else:
        attention_mask = _shared_prompt_mask(segment_ids)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return ForwardRows(input_ids.to(device), position_ids.to(device), attention_mask.to(device),
                       (segment_ids != PADDING).long().to(device), as_tensor(token_rows), as_tensor(predictors),
                       as_tensor(targets), tuple(spans))


def _shared_prompt_mask(segment_ids: Tensor) -> Tensor:
    """[rows, 1, length, length]: causal, and a key outside the prompt only for a query of its own segment."""
    length = segment_ids.shape[1]
    query, key = segment_ids[:, :, None], segment_ids[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    visible = causal & (query != PADDING) & (key != PADDING) & ((key == 0) | (key == query))
    visible |= torch.eye(length, dtype=torch.bool)  # padding queries attend to themselves
    return visible[:, None]


def _padded(rows: list[list[int]], length: int, fill: int) -> Tensor:
    out = torch.full((len(rows), length), fill, dtype=torch.long)
    for i, values in enumerate(rows):
        out[i, : len(values)] = torch.tensor(values, dtype=torch.long)
    return out
