"""The exported graphs as nn.Modules with flat tensor signatures.

Names are the graphs' contract with every runtime (ONNX Runtime, TensorRT, Triton):

target:        input_ids [B,T] i64, position_ids [B,T] i64, attention_mask [B,T,P+T] bool,
               logits_index [K] i64 (positions that get logits), past_key_{i}, past_value_{i} [B,Hkv,P,D]
           ->  logits [B,K,V], captured [B,T,A*H], accept_path [B,K] i64, accept_length [B] i64,
               accept_tokens [B,K] i64, new_key_{i}, new_value_{i} [B,Hkv,T,D]
               (a sequence's past rows beyond its own length are masked out in attention_mask;
               accept_*: greedy acceptance over the K logits rows, their input_ids and the mask's
               new-row block as the tree (verify.accept_greedy_batch): the accepted path, root
               first, its length (the tokens the call adds) and its tokens (accepted drafts, then
               the bonus). For a prefill (K = 1, the last row) that is the greedy next token.)
drafter tree:  captured [B,T,A*Ht], input_ids [B,T] i64, past_key, past_value [B,Hkv,P,D],
               past_lengths [B] i64 (valid past rows), new_lengths [B] i64 (valid new rows, >= 1)
           ->  tree_tokens [B,N] i64, tree_parents [B,N+1] i64, tree_mask [B,N+1,N+1] bool,
               tree_depths [B,N+1] i64, tree_scores [B,N] f32, new_key, new_value [B,Hkv,T,D]
drafter step:  hidden [1,T,W], input_ids, position_ids [1,T], attention_mask [1,T,P+T], past_key,
               past_value -> logits [1,T,Vd], feedback [1,T,H], new_key, new_value
               (W = A*Ht for the first step, which applies fc; W = H for later steps)
"""
from __future__ import annotations

from torch import Tensor, nn

from ..config import TreeShape
from ..models.drafter import EagleDrafter
from ..models.target import LlamaTarget, TargetOutput
from ..tree import draft_trees
from ..verify import accept_greedy_batch


ACCEPT_OUTPUTS = ["accept_path", "accept_length", "accept_tokens"]


def kv_heads_and_dim(shape, source: str) -> tuple[int, int]:
    """(Hkv, D) of a KV input's declared shape [B, Hkv, rows, D]. Graphs exported before format
    7 put the rows before the heads ([B, rows, Hkv, D]); they are refused, not misread."""
    if len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in (shape[1], shape[3])):
        raise ValueError(f"{source}: KV input shape {list(shape)} is not [batch, kv_heads, rows, head_dim]: the "
                         f"graph was exported by an older eagle_trt (rows before heads); re-export it "
                         f"(python -m eagle_trt.build --force export)")
    return int(shape[1]), int(shape[3])


def target_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "position_ids", "attention_mask", "logits_index"]
    outputs = ["logits", "captured", *ACCEPT_OUTPUTS]
    for i in range(num_layers):
        inputs += [f"past_key_{i}", f"past_value_{i}"]
        outputs += [f"new_key_{i}", f"new_value_{i}"]
    return inputs, outputs


def greedy_accept(logits: Tensor, input_ids: Tensor, attention_mask: Tensor, logits_index: Tensor):
    """Greedy acceptance over the rows that got logits, inside the target graph: only the paths
    and their tokens (a few integers per sequence) need to leave the device, not [B, K, V] logits,
    and no second graph call is made (a separate acceptance graph cost 0.6 ms a call on ONNX
    Runtime CPU, mostly call and binding overhead)."""
    T = input_ids.shape[1]
    tree = attention_mask[:, :, -T:].index_select(1, logits_index).index_select(2, logits_index)
    return accept_greedy_batch(logits.argmax(-1), input_ids.index_select(1, logits_index), tree)


def target_graph_outputs(out: TargetOutput, input_ids: Tensor, attention_mask: Tensor, logits_index: Tensor) -> tuple:
    """The target graph's outputs (target_io_names) from the model's output on its inputs."""
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


DRAFT_TREE_INPUTS = ["captured", "input_ids", "past_key", "past_value", "past_lengths", "new_lengths"]
DRAFT_TREE_OUTPUTS = ["tree_tokens", "tree_parents", "tree_mask", "tree_depths", "tree_scores",
                      "new_key", "new_value"]


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


DRAFT_STEP_INPUTS = ["hidden", "input_ids", "position_ids", "attention_mask", "past_key", "past_value"]
DRAFT_STEP_OUTPUTS = ["logits", "feedback", "new_key", "new_value"]


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
