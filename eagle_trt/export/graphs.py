"""The exported graphs as nn.Modules with flat tensor signatures; the names of their inputs and
outputs, the graphs' contract with every runtime, are in eagle_trt/graph_names.py."""
from __future__ import annotations

from torch import Tensor, nn

from ..config import TreeShape
from ..models.drafter import EagleDrafter
from ..models.target import LlamaTarget, TargetOutput
from ..tree import draft_trees
from ..verify import accept_greedy_batch


def greedy_accept(logits: Tensor, input_ids: Tensor, attention_mask: Tensor, logits_index: Tensor):
    """Greedy acceptance over the rows that got logits, inside the target graph: only the paths
    and their tokens (a few integers per sequence) need to leave the device, not [B, K, V] logits,
    and no second graph call is made (a separate acceptance graph cost 0.6 ms a call on ONNX
    Runtime CPU, mostly call and binding overhead)."""
    T = input_ids.shape[1]
    tree = attention_mask[:, :, -T:].index_select(1, logits_index).index_select(2, logits_index)
    return accept_greedy_batch(logits.argmax(-1), input_ids.index_select(1, logits_index), tree)


def target_graph_outputs(out: TargetOutput, input_ids: Tensor, attention_mask: Tensor, logits_index: Tensor) -> tuple:
    """The target graph's outputs (graph_names.target_io_names) from the model's output on its inputs."""
    kv = [t for pair in zip(out.new_k, out.new_v) for t in pair]
    return (out.logits, out.captured, *greedy_accept(out.logits, input_ids, attention_mask, logits_index), *kv)


class TargetGraph(nn.Module):
    def __init__(self, model: LlamaTarget):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, logits_index: Tensor,
                *past: Tensor):
        out = self.model(input_ids, position_ids, attention_mask, list(past[0::2]), list(past[1::2]), logits_index)
        return target_graph_outputs(out, input_ids, attention_mask, logits_index)


class DraftTreeGraph(nn.Module):
    """Step 0 over the committed rows plus the unrolled tree expansion, in one graph, for a batch."""

    def __init__(self, drafter: EagleDrafter, shape: TreeShape):
        super().__init__()
        self.drafter, self.shape = drafter, shape

    def forward(self, captured: Tensor, input_ids: Tensor, past_key: Tensor, past_value: Tensor,
                past_lengths: Tensor, new_lengths: Tensor):
        tree, new_k, new_v = draft_trees(self.drafter, captured, input_ids, past_key, past_value, self.shape,
                                         past_lengths, new_lengths)
        return tree.tokens, tree.parents, tree.mask, tree.depths, tree.scores, new_k, new_v


class DrafterStepGraph(nn.Module):
    """One drafter step; `first=True` takes captured target states through fc (step 0)."""

    def __init__(self, drafter: EagleDrafter, first: bool):
        super().__init__()
        self.drafter, self.first = drafter, first

    def forward(self, hidden, input_ids, position_ids, attention_mask, past_key, past_value):
        if self.first:
            hidden = self.drafter.project(hidden)
        out = self.drafter(hidden, input_ids, position_ids, attention_mask, past_key, past_value)
        return out.logits, out.feedback, out.new_k, out.new_v
